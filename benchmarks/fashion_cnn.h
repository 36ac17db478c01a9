// The CNN of examples/fashion_mnist.cpp (conv 1->32, conv 32->64, each 3x3 with ReLU and 2x2
// max-pooling, then linear 3136->128->10), for the benchmarks that time it (bench_cuda,
// bench_ddp). The example keeps its own copy: it is meant to be read on its own.
#pragma once

#include <memory>

#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/conv.h>
#include <ember/nn/layers/flatten.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/pooling.h>

namespace bench {

inline std::shared_ptr<ember::nn::Sequential> fashion_cnn() {
  namespace nn = ember::nn;
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(1, 32, 3, nn::Conv2dOptions{.padding = 1}),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
      std::make_shared<nn::Conv2d>(32, 64, 3, nn::Conv2dOptions{.padding = 1}),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64 * 7 * 7, 128),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(128, 10));
}

}  // namespace bench
