// SmallVec<T, N>: a vector that keeps up to N elements inline (no heap allocation), for the
// per-node lists of the backward graph: almost every node has one output and at most two
// inputs, and recording a node must cost as few allocations as possible.
#pragma once

#include <array>
#include <cstddef>
#include <utility>
#include <vector>

namespace ember::autograd {

template <typename T, size_t N>
class SmallVec {
 public:
  SmallVec() = default;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return on_heap() ? heap_.data() : inline_.data(); }
  const T* data() const { return on_heap() ? heap_.data() : inline_.data(); }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& back() { return data()[size_ - 1]; }

  void reserve(size_t n) {
    if (n > N && !on_heap()) spill(n);
  }
  void push_back(T v) {
    if (!on_heap() && size_ < N) {
      inline_[size_++] = std::move(v);
      return;
    }
    if (!on_heap()) spill(size_ + 1);
    heap_.push_back(std::move(v));
    ++size_;
  }
  void resize(size_t n) {
    if (n > N && !on_heap()) spill(n);
    if (on_heap()) {
      heap_.resize(n);
    } else {
      for (size_t i = n; i < size_; ++i) inline_[i] = T();
    }
    size_ = n;
  }
  void clear() {
    if (on_heap()) {
      heap_.clear();
      heap_.shrink_to_fit();
    } else {
      for (size_t i = 0; i < size_; ++i) inline_[i] = T();
    }
    size_ = 0;
  }

 private:
  bool on_heap() const { return heap_.capacity() != 0; }
  void spill(size_t cap) {
    heap_.reserve(cap);
    for (size_t i = 0; i < size_; ++i) {
      heap_.push_back(std::move(inline_[i]));
      inline_[i] = T();
    }
  }

  size_t size_ = 0;
  std::array<T, N> inline_{};
  std::vector<T> heap_;
};

}  // namespace ember::autograd
