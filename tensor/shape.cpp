#include <ember/tensor/shape.h>

#include <algorithm>

namespace ember {

bool IntList::operator==(const IntList& o) const {
  return size_ == o.size_ && std::equal(begin(), end(), o.begin());
}

Shape Shape::filled(int64_t n, int64_t value) {
  Shape s;
  s.resize(n, value);
  return s;
}

void Shape::assign(IntList l) {
  EMBER_CHECK(l.size() <= kMaxDims, "[Shape] at most ", kMaxDims, " dimensions are supported, got ",
              l.size());
  std::copy(l.begin(), l.end(), d_);
  n_ = static_cast<int8_t>(l.size());
}

void Shape::resize(int64_t n, int64_t value) {
  EMBER_CHECK(n >= 0 && n <= kMaxDims, "[Shape] at most ", kMaxDims,
              " dimensions are supported, got ", n);
  for (int64_t i = n_; i < n; ++i) d_[i] = value;
  n_ = static_cast<int8_t>(n);
}

void Shape::insert(int64_t pos, int64_t v) {
  EMBER_CHECK(n_ < kMaxDims, "[Shape] at most ", kMaxDims, " dimensions are supported");
  for (int64_t i = n_; i > pos; --i) d_[i] = d_[i - 1];
  d_[pos] = v;
  ++n_;
}

void Shape::erase(int64_t pos) {
  for (int64_t i = pos; i + 1 < n_; ++i) d_[i] = d_[i + 1];
  --n_;
}

bool Shape::operator==(const Shape& o) const { return IntList(*this) == IntList(o); }

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int64_t i = 0; i < n_; ++i) n *= d_[i];
  return n;
}

std::ostream& operator<<(std::ostream& os, IntList s) {
  os << '[';
  for (int64_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os << ']';
}
std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << IntList(s); }

Shape contiguous_strides(IntList sizes) {
  Shape st = Shape::filled(sizes.size(), 1);
  int64_t acc = 1;
  for (int64_t i = sizes.size() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= std::max<int64_t>(sizes[i], 1);
  }
  return st;
}

Shape broadcast_shapes(const char* op, IntList a, IntList b) {
  const int64_t n = std::max(a.size(), b.size());
  Shape out = Shape::filled(n, 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ia = i - (n - a.size()), ib = i - (n - b.size());
    const int64_t sa = ia >= 0 ? a[ia] : 1, sb = ib >= 0 ? b[ib] : 1;
    EMBER_CHECK(sa == sb || sa == 1 || sb == 1, "[", op, "] shapes ", a, " and ", b,
                " cannot be broadcast: size ", sa, " vs ", sb, " at dim ", i);
    out[i] = sa == 1 ? sb : sa;
  }
  return out;
}

int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim) {
  const int64_t lo = ndim > 0 ? -ndim : -1, hi = ndim > 0 ? ndim - 1 : 0;
  EMBER_CHECK_TYPE(IndexError, dim >= lo && dim <= hi, "[", op,
                   "] dimension out of range (expected to be in range of [", lo, ", ", hi,
                   "], but got ", dim, ")");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

}  // namespace ember
