// Spans of elements taken as one buffer, for the shared-memory allreduce (allreduce_coalesced
// without packing) and its single-copy path (a peer's spans, by their addresses in the peer's
// process). Internal to shm_*.cpp: not installed, not part of the public API.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include <ember/distributed/detail/shm_allreduce.h>

namespace ember::detail {

// The concatenation of `spans`; keeps a reference to them.
class Segments {
 public:
  Segments(const std::vector<ShmAllreduce::Span>& spans, size_t elem) : spans_(spans), elem_(elem) {
    starts_.reserve(spans.size());
    for (const auto& s : spans) {
      starts_.push_back(count_);
      count_ += s.count;
    }
  }
  size_t count() const { return count_; }

  // f(pointer, position, n) for each piece of elements [a, b) that lies in one span, in order;
  // `position` is the piece's first element in the concatenation.
  template <typename F>
  void for_each(size_t a, size_t b, F&& f) const {
    if (a >= b) return;
    size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), a) -
                                   starts_.begin()) - 1;
    while (a < b) {
      const size_t end = std::min(b, starts_[i] + spans_[i].count);
      if (end > a) f(static_cast<char*>(spans_[i].data) + (a - starts_[i]) * elem_, a, end - a);
      a = std::max(a, end);
      ++i;
    }
  }

 private:
  const std::vector<ShmAllreduce::Span>& spans_;
  size_t elem_;
  std::vector<size_t> starts_;
  size_t count_ = 0;
};

}  // namespace ember::detail
