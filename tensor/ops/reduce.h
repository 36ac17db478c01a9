// Reductions. `dims` empty means all dims. keepdim keeps reduced dims as size 1. Integer and
// bool inputs to sum/prod accumulate in int64 (PyTorch); mean/var/std/norm/logsumexp/softmax need
// floating inputs. Floating reductions accumulate in float32 for 16-bit inputs and in the input
// type otherwise, with pairwise/blocked summation so error grows like log(n), not n.
#pragma once

#include <optional>
#include <utility>

#include <ember/tensor/tensor.h>

namespace ember {

Tensor sum(const Tensor& t, IntList dims = {}, bool keepdim = false,
           std::optional<Dtype> dtype = {});
Tensor mean(const Tensor& t, IntList dims = {}, bool keepdim = false);
Tensor prod(const Tensor& t, IntList dims = {}, bool keepdim = false);
/// Largest / smallest value over all elements.
Tensor max(const Tensor& t);
Tensor min(const Tensor& t);
/// (values, indices) along dim; indices are int64 (first occurrence of the extreme).
std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim = false);
std::pair<Tensor, Tensor> min(const Tensor& t, int64_t dim, bool keepdim = false);
/// max/min values over several dims.
Tensor amax(const Tensor& t, IntList dims = {}, bool keepdim = false);
Tensor amin(const Tensor& t, IntList dims = {}, bool keepdim = false);
/// Index of the extreme over dim, or over the flattened tensor when dim is absent.
Tensor argmax(const Tensor& t, std::optional<int64_t> dim = {}, bool keepdim = false);
Tensor argmin(const Tensor& t, std::optional<int64_t> dim = {}, bool keepdim = false);
/// The k largest (smallest unless `largest`) elements along dim and their positions (int64),
/// both of t's shape with dim's size k (torch.topk). Always in order, best first, whatever
/// `sorted` says (torch leaves the order unspecified then); NaN counts as larger than every
/// number, and of equal values the lower position comes first. Differentiable in t (the values
/// are gathered at the positions). Throws IndexError unless 0 <= k <= t.size(dim), TypeError
/// for a bool tensor.
std::pair<Tensor, Tensor> topk(const Tensor& t, int64_t k, int64_t dim = -1, bool largest = true,
                               bool sorted = true);
/// Variance with Bessel's correction by default (correction = 1), as torch.var.
Tensor var(const Tensor& t, IntList dims = {}, int64_t correction = 1, bool keepdim = false);
Tensor std(const Tensor& t, IntList dims = {}, int64_t correction = 1, bool keepdim = false);
/// p-norm (p = 2 default; p = inf gives max |x|).
Tensor norm(const Tensor& t, double p = 2.0, IntList dims = {}, bool keepdim = false);
/// log(sum(exp(t))) over dims, computed stably.
Tensor logsumexp(const Tensor& t, IntList dims, bool keepdim = false);
Tensor softmax(const Tensor& t, int64_t dim);
Tensor log_softmax(const Tensor& t, int64_t dim);
/// The gradient of softmax (log_softmax when `log`) along dim, given its output and the output's
/// gradient `grad` (same shape and device, floating): output * (grad - sum(grad * output)), or
/// grad - exp(output) * sum(grad), summed over dim (what autograd's softmax nodes run). Over the
/// last dim of CUDA tensors of one dtype with grad mode off it is one fused kernel; otherwise
/// those tensor ops, recorded when grad mode is on (so a second derivative flows through them).
/// Throws ValueError/TypeError naming "softmax_backward" for mismatched or non-floating
/// operands, IndexError for a dim out of range.
Tensor softmax_backward(const Tensor& grad, const Tensor& output, int64_t dim, bool log = false);
/// True if any / all elements are nonzero (bool results).
Tensor any(const Tensor& t);
Tensor all(const Tensor& t);

}  // namespace ember
