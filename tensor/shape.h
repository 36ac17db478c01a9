// Shape: the sizes or strides of a tensor, stored inline (no heap allocation) for up to
// kMaxDims dimensions. IntList: a non-owning view of int64 values that binds to a braced
// list, a std::vector or a Shape, so ops take `zeros({2, 3})` and `zeros(t.shape())` alike.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <vector>

#include <ember/tensor/error.h>

namespace ember {

/// Most dimensions a tensor can have.
inline constexpr int kMaxDims = 16;

/// Non-owning view of contiguous int64 values. Valid only while what it views lives (a
/// braced list lives until the end of the full expression that contains the call).
class IntList {
 public:
  constexpr IntList() = default;
  constexpr IntList(const int64_t* data, int64_t size) : data_(data), size_(size) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"  // a view by design: see the class comment
#endif
  constexpr IntList(std::initializer_list<int64_t> l) : data_(l.begin()), size_(l.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  IntList(const std::vector<int64_t>& v) : data_(v.data()), size_(v.size()) {}  // NOLINT
  constexpr const int64_t* begin() const { return data_; }
  constexpr const int64_t* end() const { return data_ + size_; }
  constexpr const int64_t* data() const { return data_; }
  constexpr int64_t size() const { return size_; }
  constexpr bool empty() const { return size_ == 0; }
  constexpr int64_t operator[](int64_t i) const { return data_[i]; }
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  bool operator==(const IntList& o) const;

 private:
  const int64_t* data_ = nullptr;
  int64_t size_ = 0;
};

/// Fixed-capacity vector of int64 (sizes or strides). Trivially copyable.
class Shape {
 public:
  constexpr Shape() = default;
  Shape(IntList l) { assign(l); }  // NOLINT: implicit so a Shape is made from {2, 3}
  Shape(std::initializer_list<int64_t> l) { assign(IntList(l)); }
  Shape(const std::vector<int64_t>& v) { assign(IntList(v)); }  // NOLINT
  /// n copies of value.
  static Shape filled(int64_t n, int64_t value);

  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t* begin() { return d_; }
  int64_t* end() { return d_ + n_; }
  const int64_t* begin() const { return d_; }
  const int64_t* end() const { return d_ + n_; }
  int64_t* data() { return d_; }
  const int64_t* data() const { return d_; }
  int64_t& operator[](int64_t i) { return d_[i]; }
  int64_t operator[](int64_t i) const { return d_[i]; }
  int64_t& back() { return d_[n_ - 1]; }
  int64_t back() const { return d_[n_ - 1]; }
  void push_back(int64_t v) {
    EMBER_CHECK(n_ < kMaxDims, "[Shape] at most ", kMaxDims, " dimensions are supported");
    d_[n_++] = v;
  }
  void pop_back() { --n_; }
  void resize(int64_t n, int64_t value = 0);
  void insert(int64_t pos, int64_t v);
  void erase(int64_t pos);
  void clear() { n_ = 0; }
  operator IntList() const { return IntList(d_, n_); }  // NOLINT
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  bool operator==(const Shape& o) const;
  bool operator==(IntList o) const { return IntList(*this) == o; }

  /// Product of all values (1 for an empty shape).
  int64_t numel() const;

 private:
  void assign(IntList l);
  int64_t d_[kMaxDims];
  int8_t n_ = 0;
};

std::ostream& operator<<(std::ostream& os, IntList s);
std::ostream& operator<<(std::ostream& os, const Shape& s);

/// Row-major (C-contiguous) strides for sizes.
Shape contiguous_strides(IntList sizes);
/// Broadcast two shapes by NumPy rules; throws ValueError naming `op` and both shapes.
Shape broadcast_shapes(const char* op, IntList a, IntList b);
/// Wraps a possibly negative dim into [0, ndim); throws IndexError naming `op`.
int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim);

}  // namespace ember
