// Datasets: indexable collections of (data, target) examples, as torch.utils.data.Dataset.
//
// A Dataset maps an index in [0, size()) to an Example. DataLoader asks for whole batches with
// get_batch(), whose default stacks get() results; datasets held in memory override it to
// gather a batch with one index_select per tensor (TensorDataset, MNIST).
//
// Threads: get() and get_batch() are const and may be called concurrently from DataLoader's
// worker threads, so implementations must not mutate shared state without locking.
#pragma once

#include <cstdint>
#include <vector>

#include <ember/tensor/ops.h>

namespace ember::nn::data {

/// One example, or a batch of them (then the first dim of each tensor is the batch).
/// `target` may be undefined for unlabeled data.
struct Example {
  Tensor data;
  Tensor target;
};

/// A batch: an Example whose tensors are stacked along a new first dim.
using Batch = Example;

/// Abstract map-style dataset.
class Dataset {
 public:
  virtual ~Dataset() = default;
  /// Number of examples.
  virtual int64_t size() const = 0;
  /// The example at `index` (0 <= index < size(); implementations throw IndexError otherwise).
  virtual Example get(int64_t index) const = 0;
  /// The examples at `indices` stacked along a new dim 0 (targets too, when defined). The
  /// default calls get() for each index and stacks; it throws ValueError for an empty list or
  /// when some examples have a target and others do not.
  virtual Example get_batch(const std::vector<int64_t>& indices) const;
};

/// A dataset over in-memory tensors whose first dim indexes the examples (torch's
/// TensorDataset with two tensors). get() returns views; get_batch() copies the rows with
/// index_select, one call per tensor.
class TensorDataset : public Dataset {
 public:
  /// `target` may be undefined; when defined its first dim must equal data's. Throws
  /// ValueError for an undefined or 0-d `data` or mismatched sizes.
  TensorDataset(Tensor data, Tensor target);
  int64_t size() const override { return data_.size(0); }
  /// Views data[index] and target[index]; negative indices are IndexErrors.
  Example get(int64_t index) const override;
  /// data[indices] and target[indices] (copies). Throws IndexError naming the first bad index.
  Example get_batch(const std::vector<int64_t>& indices) const override;
  /// The whole data tensor [N, ...].
  const Tensor& data() const { return data_; }
  /// The whole target tensor [N, ...] (undefined when none was given).
  const Tensor& targets() const { return target_; }

 protected:
  /// For subclasses that fill the tensors in their own constructor (call set_tensors there).
  TensorDataset() = default;
  /// Validates and stores the tensors; the checks of the public constructor, `op` names the
  /// caller in messages.
  void set_tensors(const char* op, Tensor data, Tensor target);

 private:
  Tensor data_;
  Tensor target_;
};

}  // namespace ember::nn::data
