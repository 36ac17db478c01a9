// cuda::record_stream of a tensor: compiled in every build (the pointer form is the allocator's,
// or the stand-in's that refuses it without CUDA).
#include <ember/tensor/gpu/cuda.h>

#include <ember/tensor/error.h>
#include <ember/tensor/tensor.h>

namespace ember::cuda {

void record_stream(const Tensor& t, const Stream& s) {
  if (!t.defined() || !t.is_cuda() || t.numel() == 0 || t.storage()->data() == nullptr) return;
  try {
    record_stream(t.storage()->data(), s);
  } catch (const ValueError&) {
    // Not the allocator's memory (from_blob): its owner keeps it alive.
  }
}

}  // namespace ember::cuda
