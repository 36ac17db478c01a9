// MNIST and Fashion-MNIST from their IDX files (torchvision.datasets.MNIST / FashionMNIST with
// transforms.ToTensor(), optionally followed by transforms.Normalize).
#pragma once

#include <optional>
#include <string>

#include <ember/nn/data/dataset.h>

namespace ember::nn::data {

/// Where this machine keeps Fashion-MNIST.
inline constexpr const char* kFashionMnistRoot = "/usr/share/datasets/fashion-mnist";

/// Per-channel normalisation (x - mean) / std applied after scaling to [0, 1], computed in
/// float32 as torchvision's Normalize does.
struct Normalization {
  double mean = 0.0;
  double std = 1.0;
};

/// A split of any data set in MNIST's IDX layout (MNIST, Fashion-MNIST, KMNIST, ...), whole in
/// memory: data() is float32 [N, 1, 28, 28] (pixel / 255, bit-identical to ToTensor), targets()
/// int64 [N]. get_batch gathers rows with index_select.
class MNIST : public TensorDataset {
 public:
  /// Reads `root`/train-images-idx3-ubyte.gz and train-labels-idx1-ubyte.gz (t10k-* when
  /// !train). A file without .gz is read uncompressed when only that one exists. Throws
  /// ValueError, naming the file, when a file is missing or unreadable, is not gzip (for .gz),
  /// is truncated (gzip stream or payload), has trailing bytes, a bad magic number (images:
  /// 0x00000803, labels: 0x00000801), images that are not 28x28, or when the image and label
  /// counts differ; and for a normalisation std of 0.
  explicit MNIST(const std::string& root, bool train = true,
                 std::optional<Normalization> normalize = std::nullopt);
  bool train() const { return train_; }

 private:
  bool train_;
};

/// Fashion-MNIST (torchvision.datasets.FashionMNIST): MNIST's reader with this machine's copy of
/// Fashion-MNIST as the default root. Throws as MNIST does.
class FashionMNIST : public MNIST {
 public:
  explicit FashionMNIST(const std::string& root = kFashionMnistRoot, bool train = true,
                        std::optional<Normalization> normalize = std::nullopt)
      : MNIST(root, train, normalize) {}
};

}  // namespace ember::nn::data
