// The error of every CUDA entry point in a build with EMBER_WITH_CUDA=OFF (tensor/cuda/no_cuda*.cpp
// stand in for the CUDA sources there).
#pragma once

#include <ember/tensor/error.h>

namespace ember::detail {

[[noreturn]] inline void no_cuda(const char* what) {
  throw NotImplementedError(
      str_cat("[", what, "] CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF"));
}

}  // namespace ember::detail
