// gradcheck: compares the gradients autograd computes with central finite differences.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember::autograd {

struct GradcheckOptions {
  double eps = 1e-6;   ///< finite-difference step
  double atol = 1e-5;
  double rtol = 1e-3;
};

struct GradcheckResult {
  bool ok = true;
  std::string message;  ///< what differed, when !ok
  explicit operator bool() const { return ok; }
};

using GradcheckFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

/// For every input that requires grad (which must be float64) and every floating output of
/// fn(inputs), checks d output / d input from autograd (one vector-Jacobian product per output
/// element) against (f(x + eps) - f(x - eps)) / (2 eps), element by element:
/// |analytical - numerical| <= atol + rtol * |numerical|. Inputs may be non-contiguous and on
/// any device; inputs whose elements share memory (expanded views) are rejected.
GradcheckResult gradcheck(const GradcheckFn& fn, const std::vector<Tensor>& inputs,
                          const GradcheckOptions& opts = {});
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opts = {});

}  // namespace ember::autograd
