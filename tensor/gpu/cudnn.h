// Whether this build has cuDNN (torch.backends.cudnn.is_available()). cuDNN is optional in a CUDA
// build: without it (EMBER_WITH_CUDNN=OFF, or cudnn.h or libcudnn not found at configure time)
// every CUDA op runs except convolution, which throws NotImplementedError saying how to get it.
#pragma once

namespace ember::cuda {

/// True when Ember was built with cuDNN; false in a CPU-only build. Says nothing about devices:
/// see cuda::is_available().
bool cudnn_is_available();

}  // namespace ember::cuda
