// MNIST and Fashion-MNIST from their IDX files (torchvision.datasets.MNIST / FashionMNIST with
// transforms.ToTensor(), optionally followed by transforms.Normalize).
#pragma once

#include <optional>
#include <string>

#include "nn/data/dataset.h"

namespace ember::nn::data {

/// Where this machine keeps Fashion-MNIST.
inline constexpr const char* kFashionMnistRoot = "/usr/share/datasets/fashion-mnist";

/// Per-channel normalisation (x - mean) / std applied after scaling to [0, 1], computed in
/// float32 as torchvision's Normalize does.
struct Normalization {
  double mean = 0.0;
  double std = 1.0;
};

/// The whole split in memory: data() is float32 [N, 1, 28, 28] (pixel / 255, bit-identical to
/// ToTensor), targets() int64 [N]. get_batch gathers rows with index_select.
class MNIST : public TensorDataset {
 public:
  /// Reads `root`/train-images-idx3-ubyte.gz and train-labels-idx1-ubyte.gz (t10k-* when
  /// !train). A file without .gz is read uncompressed when only that one exists. Throws
  /// ValueError, naming the file, when a file is missing or unreadable, is not gzip (for .gz),
  /// is truncated (gzip stream or payload), has trailing bytes, a bad magic number (images:
  /// 0x00000803, labels: 0x00000801), images that are not 28x28, or when the image and label
  /// counts differ; and for a normalisation std of 0.
  explicit MNIST(const std::string& root = kFashionMnistRoot, bool train = true,
                 std::optional<Normalization> normalize = std::nullopt);
  bool train() const { return train_; }

 private:
  bool train_;
};

namespace detail {
/// The bytes of `path`, gunzipped when it ends in ".gz" (throws ValueError naming the file when
/// it cannot be opened, is not gzip, or its gzip stream is truncated or corrupt).
std::string read_maybe_gzip(const std::string& path);
}  // namespace detail

}  // namespace ember::nn::data
