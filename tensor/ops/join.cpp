// Joining (cat, stack) and splitting (split, split_with_sizes, chunk). cat copies each input
// into a narrow() view of the output with copy_, which already handles dtype conversion,
// strided layouts, threads and devices; the splits return views.
//
// Autograd: cat records one node (its gradient is a narrow of the output's gradient per
// input); stack records through unsqueeze and cat. A split records one node for all its parts
// (views), whose gradient is the cat of theirs, as PyTorch's SplitBackward: one pass, where a
// node per part would each spread its gradient over a zero tensor of the input's size, to be
// summed.
#include <vector>

#include <ember/tensor/detail/record.h>
#include <ember/tensor/ops/indexing.h>

namespace ember {

using detail::check_defined;

namespace {
// PyTorch's legacy rule: 1-d tensors of size 0 are ignored by cat whatever the other shapes.
bool legacy_empty(const Tensor& t) { return t.dim() == 1 && t.size(0) == 0; }

std::string position(const char* list, size_t i) { return detail::str_cat(list, "[", i, "]"); }

// Records cat from `tensors` to `out` when any of them requires grad.
Tensor recorded_cat(const std::vector<Tensor>& tensors, Tensor out, int64_t dim) {
  if (detail::should_record_list(tensors)) {
    detail::record_list<OpId::Cat>(tensors, {&out}, {.dim = dim});
  }
  return out;
}

// The views of t along dim at consecutive sizes (which add up to its size), recorded as one op.
std::vector<Tensor> split_parts(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  std::vector<Tensor> out;
  out.reserve(sizes.size());
  Shape shape = t.shape();
  int64_t offset = t.storage_offset();
  for (int64_t s : sizes) {
    shape[dim] = s;
    out.push_back(detail::make_view(t, shape, t.strides(), offset));
    offset += s * t.stride(dim);
  }
  if (detail::should_record(t)) detail::record_outputs(OpId::Split, t, out, DimAttrs{.dim = dim});
  return out;
}
}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  EMBER_CHECK(!tensors.empty(), "[cat] expected a non-empty list of tensors, got an empty list");
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_defined("cat", tensors[i], position("tensors", i).c_str());
  }
  const Device device = tensors[0].device();
  Dtype dtype = tensors[0].dtype();
  int64_t ref = -1;  // the first tensor that takes part
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    EMBER_CHECK(t.device() == device, "[cat] expected all tensors on the same device, got ",
                device, " for tensor 0 and ", t.device(), " for tensor ", i);
    dtype = promote_types(dtype, t.dtype());  // skipped tensors still promote, as in PyTorch
    if (ref < 0 && !legacy_empty(t)) ref = static_cast<int64_t>(i);
  }
  if (ref < 0) return recorded_cat(tensors, detail::make_empty({0}, dtype, device), 0);
  const Tensor& r = tensors[ref];
  EMBER_CHECK(r.dim() > 0, "[cat] zero-dimensional tensor (tensor ", ref,
              ") cannot be concatenated");
  dim = wrap_dim("cat", dim, r.dim());
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (legacy_empty(t)) continue;
    EMBER_CHECK(t.dim() == r.dim(), "[cat] expected tensors with the same number of dims: tensor ",
                i, " has shape ", t.shape(), " but tensor ", ref, " has shape ", r.shape());
    for (int64_t d = 0; d < r.dim(); ++d) {
      EMBER_CHECK(d == dim || t.size(d) == r.size(d), "[cat] sizes of tensors must match except "
                  "in dim ", dim, ": tensor ", i, " has shape ", t.shape(), " but tensor ", ref,
                  " has shape ", r.shape());
    }
    total += t.size(dim);
  }
  Shape shape = r.shape();
  shape[dim] = total;
  Tensor out = detail::make_empty(shape, dtype, device);
  if (out.numel() > 0) {
    NoGradGuard no_grad;  // the copies are this op's kernel; cat records itself below
    int64_t offset = 0;
    for (const Tensor& t : tensors) {
      if (legacy_empty(t)) continue;
      const int64_t n = t.size(dim);
      if (n > 0) out.narrow(dim, offset, n).copy_(t);
      offset += n;
    }
  }
  return recorded_cat(tensors, std::move(out), dim);
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  EMBER_CHECK(!tensors.empty(), "[stack] expected a non-empty list of tensors, got an empty list");
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_defined("stack", tensors[i], position("tensors", i).c_str());
    EMBER_CHECK(tensors[i].shape() == tensors[0].shape(), "[stack] expected all tensors to have "
                "the same shape, got ", tensors[0].shape(), " at position 0 and ",
                tensors[i].shape(), " at position ", i);
  }
  dim = wrap_dim("stack", dim, tensors[0].dim() + 1);
  for (const Tensor& t : tensors) parts.push_back(t.unsqueeze(dim));
  return cat(parts, dim);
}

std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim) {
  check_defined("split", t, "self");
  EMBER_CHECK(t.dim() > 0, "[split] expected a tensor with at least one dim, got a 0-d tensor");
  dim = wrap_dim("split", dim, t.dim());
  const int64_t n = t.size(dim);
  EMBER_CHECK(split_size >= 0, "[split] expected split_size >= 0, got ", split_size);
  EMBER_CHECK(split_size > 0 || n == 0, "[split] split_size can be 0 only if dim ", dim,
              " has size 0, got size ", n);
  const int64_t parts = n == 0 ? 1 : (n + split_size - 1) / split_size;
  std::vector<int64_t> sizes;
  sizes.reserve(parts);
  for (int64_t i = 0; i < parts; ++i) sizes.push_back(std::min(split_size, n - i * split_size));
  return split_parts(t, sizes, dim);
}

std::vector<Tensor> split_with_sizes(const Tensor& t, IntList sizes, int64_t dim) {
  check_defined("split_with_sizes", t, "self");
  EMBER_CHECK(t.dim() > 0,
              "[split_with_sizes] expected a tensor with at least one dim, got a 0-d tensor");
  dim = wrap_dim("split_with_sizes", dim, t.dim());
  int64_t total = 0;
  for (int64_t s : sizes) {
    EMBER_CHECK(s >= 0, "[split_with_sizes] expected non-negative sizes, got ", sizes);
    total += s;
  }
  EMBER_CHECK(total == t.size(dim), "[split_with_sizes] sizes ", sizes, " add up to ", total,
              " but dim ", dim, " of the tensor (shape ", t.shape(), ") has size ", t.size(dim));
  return split_parts(t, std::vector<int64_t>(sizes.begin(), sizes.end()), dim);
}

std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim) {
  check_defined("chunk", t, "self");
  EMBER_CHECK(chunks > 0, "[chunk] expected chunks > 0, got ", chunks);
  EMBER_CHECK(t.dim() > 0, "[chunk] expected a tensor with at least one dim, got a 0-d tensor");
  dim = wrap_dim("chunk", dim, t.dim());
  const int64_t n = t.size(dim);
  // torch.chunk: pieces of ceil(n / chunks), so there may be fewer than `chunks`; an empty dim
  // gives `chunks` empty pieces.
  if (n == 0) return split_with_sizes(t, std::vector<int64_t>(chunks, 0), dim);
  return split(t, (n + chunks - 1) / chunks, dim);
}

}  // namespace ember
