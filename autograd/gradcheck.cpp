#include <ember/autograd/gradcheck.h>

#include <cmath>

#include <ember/autograd/engine.h>
#include <ember/tensor/ops.h>

namespace ember::autograd {

namespace {

/// The storage offset of row-major element j of t.
int64_t element_offset(const Tensor& t, int64_t j) {
  int64_t off = t.storage_offset();
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    off += (j % t.size(d)) * t.stride(d);
    j /= t.size(d);
  }
  return off;
}

bool has_overlap(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) return true;
  }
  return false;
}

/// Flattened float64 CPU copy of every floating output (undefined outputs become empty).
std::vector<std::vector<double>> evaluate(const GradcheckFn& fn, const std::vector<Tensor>& in) {
  NoGradGuard no_grad;
  std::vector<std::vector<double>> r;
  for (const Tensor& o : fn(in)) {
    if (o.defined() && o.is_floating_point()) {
      r.push_back(o.to_vector<double>());
    } else {
      r.emplace_back();
    }
  }
  return r;
}

}  // namespace

GradcheckResult gradcheck(const GradcheckFn& fn, const std::vector<Tensor>& inputs,
                          const GradcheckOptions& opts) {
  std::vector<size_t> wrt;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.defined() || !x.requires_grad()) continue;
    EMBER_CHECK_TYPE(TypeError, x.dtype() == kFloat64, "[gradcheck] input ", i,
                     " requires grad but has dtype ", x.dtype(),
                     "; finite differences need float64 inputs");
    EMBER_CHECK(!has_overlap(x), "[gradcheck] input ", i, " has elements that share memory (shape ",
                x.shape(), ", strides ", x.strides(), "); pass a tensor without zero strides");
    wrt.push_back(i);
  }
  EMBER_CHECK(!wrt.empty(), "[gradcheck] no input requires grad");

  const std::vector<Tensor> outputs = fn(inputs);
  std::vector<Tensor> wrt_tensors;
  for (size_t i : wrt) wrt_tensors.push_back(inputs[i]);

  // Analytical Jacobians first, for every output: the finite differences below perturb the
  // inputs in place, which bumps their version and would invalidate tensors the graph saved.
  // analytic[k][w][l][j] = d out_k[l] / d in_w[j].
  std::vector<std::vector<std::vector<std::vector<double>>>> analytic(outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Tensor& out = outputs[k];
    if (!out.defined() || !out.is_floating_point()) continue;
    analytic[k].resize(wrt.size());
    for (int64_t l = 0; l < out.numel(); ++l) {
      std::vector<Tensor> grads(wrt.size());
      if (out.requires_grad()) {
        Tensor go = zeros(out.shape(), out.options());
        {
          NoGradGuard no_grad;
          go.view({-1}).select(0, l).fill_(1);
        }
        grads = grad({out}, wrt_tensors, {go}, /*retain_graph=*/true, false,
                     /*allow_unused=*/true);
      }
      for (size_t w = 0; w < wrt.size(); ++w) {
        const Tensor& x = inputs[wrt[w]];
        const Tensor& g = grads[w];
        if (!g.defined()) {
          analytic[k][w].emplace_back(x.numel(), 0.0);
          continue;
        }
        if (!(g.shape() == x.shape()) || g.dtype() != x.dtype()) {
          return {false, detail::str_cat("gradient for input ", wrt[w], " has shape ", g.shape(),
                                         " and dtype ", g.dtype(), "; expected shape ", x.shape(),
                                         " and dtype ", x.dtype())};
        }
        analytic[k][w].push_back(g.to_vector<double>());
      }
    }
  }
  // Numerical Jacobians, one input element at a time, compared as they are made.
  for (size_t w = 0; w < wrt.size(); ++w) {
    const Tensor& x = inputs[wrt[w]];
    for (int64_t j = 0; j < x.numel(); ++j) {
      Tensor e = x.detach().as_strided({}, {}, element_offset(x, j));
      const Tensor orig = e.clone();
      std::vector<std::vector<double>> plus, minus;
      {
        NoGradGuard no_grad;
        e.add_(opts.eps);
        plus = evaluate(fn, inputs);
        e.copy_(orig);
        e.add_(-opts.eps);
        minus = evaluate(fn, inputs);
        e.copy_(orig);
      }
      for (size_t k = 0; k < outputs.size(); ++k) {
        if (analytic[k].empty()) continue;
        for (int64_t l = 0; l < outputs[k].numel(); ++l) {
          const double num = (plus[k][l] - minus[k][l]) / (2 * opts.eps);
          const double ana = analytic[k][w][l][j];
          if (!(std::fabs(ana - num) <= opts.atol + opts.rtol * std::fabs(num))) {
            return {false, detail::str_cat("Jacobian mismatch for output ", k, " (shape ",
                                           outputs[k].shape(), ") with respect to input ", wrt[w],
                                           " (shape ", x.shape(), "): d out[", l, "] / d in[", j,
                                           "] is ", ana, " from autograd but ", num,
                                           " from finite differences")};
          }
        }
      }
    }
  }
  return {};
}

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opts) {
  return gradcheck(GradcheckFn([&fn](const std::vector<Tensor>& in) {
                     return std::vector<Tensor>{fn(in)};
                   }),
                   inputs, opts);
}

}  // namespace ember::autograd
