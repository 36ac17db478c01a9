// The sharded checkpoint format shared by its writer (sharded_checkpoint.cpp) and reader
// (sharded_checkpoint_read.cpp): the index's constants, shapes and boxes, how a piece of a box
// maps to runs of the whole tensor. Not part of the public API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <ember/distributed/checkpoint/sharded_checkpoint.h>

namespace ember::dist::sharded_format {

using Json = nlohmann::json;

constexpr const char* kIndexName = "index.json";
constexpr const char* kFormat = "ember.sharded_checkpoint";
// Version 2 added boxes and replicated pieces, version 3 each piece's checksum; older indexes
// read as ever (without checksums to check).
constexpr int kVersion = 3;

inline std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

inline std::string shape_str(const std::vector<int64_t>& shape) { return Json(shape).dump(); }

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Whether `shape` is one a tensor can have: at most kMaxDims sizes, none negative, a product
// that fits int64 (checked before numel_of is trusted with a shape from a user or a file).
inline bool valid_shape(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  return static_cast<int64_t>(shape.size()) <= kMaxDims;
}

// What is wrong with `box` of a tensor of `shape` ("" if nothing): a view of another element
// count, dimensions that do not match, or a block outside the view.
inline std::string box_error(const std::vector<int64_t>& shape, const Box& box) {
  if (box.whole()) {
    return box.view.empty() && box.offset.empty() ? "" : "a box without a shape has a view or offset";
  }
  const std::vector<int64_t>& dims = box.view.empty() ? shape : box.view;
  if (!valid_shape(box.view) || numel_of(dims) != numel_of(shape)) {
    return "a box's view " + shape_str(box.view) + " does not have the tensor's " +
           std::to_string(numel_of(shape)) + " elements";
  }
  if (box.offset.size() != dims.size() || box.shape.size() != dims.size()) {
    return "a box at " + shape_str(box.offset) + " of shape " + shape_str(box.shape) +
           " does not have the " + std::to_string(dims.size()) + " dimensions of " +
           shape_str(dims);
  }
  for (size_t d = 0; d < dims.size(); ++d) {
    if (box.offset[d] < 0 || box.shape[d] < 0 || box.offset[d] > dims[d] - box.shape[d]) {
      return "a box at " + shape_str(box.offset) + " of shape " + shape_str(box.shape) +
             " is outside " + shape_str(dims);
    }
  }
  return "";
}

inline int64_t box_numel(const std::vector<int64_t>& shape, const Box& box) {
  return numel_of(box.whole() ? shape : box.shape);
}

// A run of consecutive elements of the whole tensor.
struct Span {
  int64_t start = 0;
  int64_t length = 0;
};

// The runs of the whole tensor (of `shape`, row-major) that elements [offset, offset + numel)
// of `box` (valid: box_error() is "") are, in the box's order, adjacent runs merged. A block
// whose trailing dimensions are whole is one run per index of the dimensions before them.
inline std::vector<Span> spans_of(const std::vector<int64_t>& shape, const Box& box, int64_t offset,
                           int64_t numel) {
  std::vector<Span> out;
  if (numel <= 0) return out;
  if (box.whole()) return {{offset, numel}};
  const std::vector<int64_t>& dims = box.view.empty() ? shape : box.view;
  const int n = static_cast<int>(dims.size());
  // d: the last dimension the box does not span whole; the run is its extent times what follows.
  int d = n - 1;
  while (d > 0 && box.offset[static_cast<size_t>(d)] == 0 &&
         box.shape[static_cast<size_t>(d)] == dims[static_cast<size_t>(d)]) {
    --d;
  }
  std::vector<int64_t> stride(static_cast<size_t>(n), 1);
  for (int k = n - 2; k >= 0; --k) {
    stride[static_cast<size_t>(k)] = stride[static_cast<size_t>(k) + 1] * dims[static_cast<size_t>(k) + 1];
  }
  const int64_t run = box.shape[static_cast<size_t>(d)] * stride[static_cast<size_t>(d)];
  for (int64_t p = offset; p < offset + numel;) {
    int64_t row = p / run;
    const int64_t within = p % run;
    const int64_t len = std::min(run - within, offset + numel - p);
    int64_t start = box.offset[static_cast<size_t>(d)] * stride[static_cast<size_t>(d)] + within;
    for (int k = d - 1; k >= 0; --k) {
      const auto kk = static_cast<size_t>(k);
      start += (box.offset[kk] + row % box.shape[kk]) * stride[kk];
      row /= box.shape[kk];
    }
    if (!out.empty() && out.back().start + out.back().length == start) {
      out.back().length += len;
    } else {
      out.push_back({start, len});
    }
    p += len;
  }
  return out;
}

inline Json box_json(const Box& box) {
  return {{"view", box.view}, {"offset", box.offset}, {"shape", box.shape}};
}

inline std::string rank_file_name(const std::string& save_id, int rank) {
  return save_id + ".rank" + std::to_string(rank) + ".safetensors";
}

// The name of a piece inside its rank's file, by the flat index of its first element: unique,
// since the non-empty pieces one rank writes of a tensor do not overlap.
// Entry::runs from its pieces, sorted by start.
inline void make_runs(ShardedCheckpoint::Entry& e) {
  e.runs.clear();
  for (size_t i = 0; i < e.pieces.size(); ++i) {
    const auto& p = e.pieces[i];
    int64_t at = 0;
    for (const Span& s : spans_of(e.shape, p.box, p.offset, p.numel)) {
      e.runs.push_back({s.start, s.length, i, at});
      at += s.length;
    }
  }
  std::sort(e.runs.begin(), e.runs.end(),
            [](const auto& a, const auto& b) { return a.start < b.start; });
}

}  // namespace ember::dist::sharded_format
