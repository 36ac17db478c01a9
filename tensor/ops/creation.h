// Creating tensors: from nothing, from values, from existing memory. Random creation is in
// tensor/ops/random.h.
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember {

/// Uninitialised tensor of `shape`.
Tensor empty(IntList shape, TensorOptions opts = {});
Tensor zeros(IntList shape, TensorOptions opts = {});
Tensor ones(IntList shape, TensorOptions opts = {});
/// Tensor filled with value; the dtype defaults to the scalar's (bool, int64 or float32)
/// unless opts names one explicitly via full(shape, v, dtype).
Tensor full(IntList shape, const Scalar& value);
Tensor full(IntList shape, const Scalar& value, TensorOptions opts);
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, const Scalar& value);
/// A 0-dim tensor holding value.
Tensor scalar_tensor(const Scalar& value, TensorOptions opts);
Tensor scalar_tensor(const Scalar& value);

/// Values start, start+step, ... < end. The dtype is int64 when start, end and step are all
/// integral, else float32 (PyTorch's rule) unless given.
Tensor arange(const Scalar& end);
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step = 1);
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step, TensorOptions opts);
/// `steps` values evenly spaced from start to end inclusive.
Tensor linspace(double start, double end, int64_t steps, TensorOptions opts = {});
/// n x m identity (m defaults to n).
Tensor eye(int64_t n, std::optional<int64_t> m = {}, TensorOptions opts = {});

/// Copies values into a new tensor of `shape` (default: 1-d of values.size()).
template <typename T>
Tensor from_vector(const std::vector<T>& values, IntList shape = {}, Device device = kCPU);
/// A 1-d tensor from a braced list: tensor({1.f, 2.f}) is float32, tensor({1, 2}) int64.
Tensor tensor(std::initializer_list<float> values, TensorOptions opts = {});
Tensor tensor(std::initializer_list<double> values, TensorOptions opts = kFloat64);
Tensor tensor(std::initializer_list<int64_t> values, TensorOptions opts = kInt64);
Tensor tensor(std::initializer_list<int> values, TensorOptions opts = kInt64);
Tensor tensor(std::initializer_list<bool> values, TensorOptions opts = kBool);

/// Wraps existing memory without copying (torch::from_blob). `strides` defaults to contiguous.
/// `deleter(data)` runs when the last tensor using the memory dies; without one the caller
/// must keep the memory alive.
Tensor from_blob(void* data, IntList shape, TensorOptions opts,
                 std::function<void(void*)> deleter = {});
Tensor from_blob(void* data, IntList shape, IntList strides, TensorOptions opts,
                 std::function<void(void*)> deleter = {});

}  // namespace ember
