// The hooks' state_dict entries: numbers stored as one-element tensors (int64 or float64), so a
// hook's state is saved with nn::save_safetensors beside the model's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/error.h>
#include <ember/tensor/tensor.h>

namespace ember::dist::detail {

inline Tensor int_entry(int64_t v) { return from_vector(std::vector<int64_t>{v}); }
inline Tensor float_entry(double v) { return from_vector(std::vector<double>{v}); }

// `op` names the caller in the error ("[PowerSGDState]").
inline int64_t read_int(const char* op, const std::string& name, const Tensor& t) {
  EMBER_CHECK(t.defined() && t.numel() == 1, op, " entry '", name,
              "' must hold one number, got ", t.defined() ? t.numel() : 0, " elements");
  return t.to(kInt64).reshape({-1}).to_vector<int64_t>()[0];
}
inline double read_float(const char* op, const std::string& name, const Tensor& t) {
  EMBER_CHECK(t.defined() && t.numel() == 1, op, " entry '", name,
              "' must hold one number, got ", t.defined() ? t.numel() : 0, " elements");
  return t.to(kFloat64).reshape({-1}).to_vector<double>()[0];
}

}  // namespace ember::dist::detail
