// Where a tensor's memory lives: the host ("cpu") or one CUDA device ("cuda:N").
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace ember {

enum class DeviceType : uint8_t { CPU, CUDA };

/// A device: type plus index (always 0 for the CPU). Cheap to copy and compare.
struct Device {
  DeviceType type = DeviceType::CPU;
  int8_t index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int idx = 0) : type(t), index(static_cast<int8_t>(idx)) {}
  /// Parses "cpu", "cuda" (device 0) or "cuda:N"; throws ValueError on anything else.
  Device(std::string_view spec);  // NOLINT: implicit, like torch.device("cuda:1")
  Device(const char* spec) : Device(std::string_view(spec)) {}  // NOLINT

  constexpr bool is_cpu() const { return type == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type == DeviceType::CUDA; }
  constexpr bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  std::string str() const;
};

inline constexpr Device kCPU{DeviceType::CPU, 0};
/// CUDA device `index` (default 0).
constexpr Device cuda_device(int index = 0) { return Device(DeviceType::CUDA, index); }

std::ostream& operator<<(std::ostream& os, const Device& d);

}  // namespace ember
