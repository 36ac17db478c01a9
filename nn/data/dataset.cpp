#include <ember/nn/data/dataset.h>

#include <utility>

namespace ember::nn::data {

Example Dataset::get_batch(const std::vector<int64_t>& indices) const {
  EMBER_CHECK(!indices.empty(), "[Dataset::get_batch] expected at least one index, got none");
  std::vector<Tensor> data;
  std::vector<Tensor> targets;
  data.reserve(indices.size());
  targets.reserve(indices.size());
  for (int64_t index : indices) {
    Example e = get(index);
    EMBER_CHECK(e.data.defined(), "[Dataset::get_batch] get(", index,
                ") returned an example with undefined data");
    data.push_back(std::move(e.data));
    targets.push_back(std::move(e.target));
  }
  const bool labeled = targets.front().defined();
  for (size_t i = 0; i < targets.size(); ++i) {
    EMBER_CHECK(targets[i].defined() == labeled, "[Dataset::get_batch] example ", indices[i],
                (labeled ? " has no target but example " : " has a target but example "),
                indices.front(), (labeled ? " has one" : " has none"));
  }
  return {stack(data, 0), labeled ? stack(targets, 0) : Tensor()};
}

TensorDataset::TensorDataset(Tensor data, Tensor target) {
  set_tensors("TensorDataset", std::move(data), std::move(target));
}

void TensorDataset::set_tensors(const char* op, Tensor data, Tensor target) {
  EMBER_CHECK(data.defined(), "[", op, "] expected a defined data tensor");
  EMBER_CHECK(data.dim() >= 1, "[", op,
              "] expected data with at least one dim (the example index), got a 0-d tensor");
  if (target.defined()) {
    EMBER_CHECK(target.dim() >= 1 && target.size(0) == data.size(0), "[", op,
                "] expected target with first dim ", data.size(0), " (data shape ", data.shape(),
                "), got target of shape ", target.shape());
  }
  data_ = std::move(data);
  target_ = std::move(target);
}

namespace {
void check_index(int64_t index, int64_t size) {
  EMBER_CHECK_TYPE(IndexError, index >= 0 && index < size, "[TensorDataset] index ", index,
                   " is out of range for a dataset of ", size, " examples");
}
}  // namespace

Example TensorDataset::get(int64_t index) const {
  check_index(index, size());
  return {data_.select(0, index), target_.defined() ? target_.select(0, index) : Tensor()};
}

Example TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  for (int64_t index : indices) check_index(index, size());
  const Tensor idx = from_vector(indices, {static_cast<int64_t>(indices.size())}, data_.device());
  Example out;
  out.data = index_select(data_, 0, idx);
  if (target_.defined()) {
    out.target = index_select(target_, 0,
                              target_.device() == data_.device() ? idx : idx.to(target_.device()));
  }
  return out;
}

}  // namespace ember::nn::data
