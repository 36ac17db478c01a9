// PyTorch-style printing: tensor([[1., 2.], [3., 4.]], dtype=torch.float64). Floats print as
// integers with a trailing '.' when every value is integral, in fixed point with 4 decimals
// normally, and in scientific notation when magnitudes span more than 1000x or leave
// [1e-4, 1e8). Tensors of more than 1000 elements are summarised with '...' (3 items per edge).
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember {

namespace {

constexpr int64_t kThreshold = 1000;
constexpr int64_t kEdge = 3;

struct Formatter {
  enum Mode { kInt, kBool, kFloatInt, kFixed, kSci } mode = kFixed;
  int width = 1;

  std::string format(double v) const {
    char buf[64];
    switch (mode) {
      case kBool: return v != 0 ? "True" : "False";
      case kInt: std::snprintf(buf, sizeof buf, "%.0f", v); break;
      case kFloatInt:
        if (std::isfinite(v)) {
          std::snprintf(buf, sizeof buf, "%.0f.", v);
        } else {
          std::snprintf(buf, sizeof buf, "%s", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
        }
        break;
      case kFixed:
        if (std::isfinite(v)) {
          std::snprintf(buf, sizeof buf, "%.4f", v);
        } else {
          std::snprintf(buf, sizeof buf, "%s", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
        }
        break;
      case kSci: std::snprintf(buf, sizeof buf, "%.4e", v); break;
    }
    return buf;
  }
  std::string pad(double v) const {
    std::string s = format(v);
    return s.size() < static_cast<size_t>(width) ? std::string(width - s.size(), ' ') + s : s;
  }
};

// Values that will be printed (respecting summarisation), in row-major order of that subset.
void collect(const Tensor& t, bool summarize, std::vector<double>* out) {
  if (t.dim() == 0) {
    out->push_back(t.item<double>());
    return;
  }
  const int64_t n = t.size(0);
  auto visit = [&](int64_t i) { collect(t.select(0, i), summarize, out); };
  if (summarize && n > 2 * kEdge) {
    for (int64_t i = 0; i < kEdge; ++i) visit(i);
    for (int64_t i = n - kEdge; i < n; ++i) visit(i);
  } else {
    for (int64_t i = 0; i < n; ++i) visit(i);
  }
}

Formatter make_formatter(Dtype dtype, const std::vector<double>& vals) {
  Formatter f;
  if (dtype == kBool) {
    f.mode = Formatter::kBool;
  } else if (!is_floating(dtype)) {
    f.mode = Formatter::kInt;
  } else {
    bool all_int = true;
    double max_abs = 0, min_abs = INFINITY;
    bool any_finite = false;
    for (double v : vals) {
      if (!std::isfinite(v)) continue;
      any_finite = true;
      if (v != std::floor(v)) all_int = false;
      const double a = std::fabs(v);
      max_abs = std::max(max_abs, a);
      if (a != 0) min_abs = std::min(min_abs, a);
    }
    if (!any_finite) {
      f.mode = Formatter::kFixed;
    } else if (all_int) {
      f.mode = max_abs > 1e8 ? Formatter::kSci : Formatter::kFloatInt;
    } else if (max_abs > 1e8 || (min_abs != INFINITY && (max_abs / min_abs > 1000 || min_abs < 1e-4))) {
      f.mode = Formatter::kSci;
    } else {
      f.mode = Formatter::kFixed;
    }
  }
  for (double v : vals) f.width = std::max<int>(f.width, static_cast<int>(f.format(v).size()));
  return f;
}

void render(std::ostringstream& os, const Tensor& t, const Formatter& f, bool summarize,
            int indent) {
  if (t.dim() == 0) {
    os << f.pad(t.item<double>());
    return;
  }
  const int64_t n = t.size(0);
  os << '[';
  const bool skip = summarize && n > 2 * kEdge;
  bool first = true;
  for (int64_t i = 0; i < n; ++i) {
    if (skip && i == kEdge) {
      if (t.dim() == 1) {
        const std::string dots = "...";
        os << ", " << std::string(f.width > 3 ? f.width - 3 : 0, ' ') << dots;
      } else {
        os << ",\n" << std::string(indent + 1, ' ') << "...";
      }
      i = n - kEdge;
    }
    if (!first) {
      if (t.dim() == 1) {
        os << ", ";
      } else {
        os << ',' << std::string(t.dim() - 1, '\n') << std::string(indent + 1, ' ');
      }
    }
    first = false;
    render(os, t.select(0, i), f, summarize, indent + 1);
  }
  os << ']';
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  Tensor c = is_cpu() ? *this : cpu();
  const bool summarize = numel() > kThreshold;
  std::vector<double> vals;
  if (numel() > 0) collect(c, summarize, &vals);
  Formatter f = make_formatter(dtype(), vals);
  std::ostringstream os;
  os << "tensor(";
  if (numel() == 0) {
    os << "[]";
    if (dim() != 1) {
      os << ", size=(";
      for (int64_t d = 0; d < dim(); ++d) os << (d ? ", " : "") << size(d);
      os << (dim() == 1 ? ",)" : ")");
    }
  } else {
    render(os, c, f, summarize, 7);
  }
  if (is_cuda()) os << ", device='" << device() << "'";
  if (dtype() != kFloat32 && dtype() != kInt64 && dtype() != kBool) {
    os << ", dtype=torch." << dtype();
  }
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace ember
