#include <ember/tensor/device.h>

#include <charconv>

#include <ember/tensor/error.h>

namespace ember {

Device::Device(std::string_view s) {
  if (s == "cpu") {
    type = DeviceType::CPU;
    index = 0;
    return;
  }
  if (s.substr(0, 4) == "cuda") {
    type = DeviceType::CUDA;
    index = 0;
    if (s.size() == 4) return;
    if (s[4] == ':' && s.size() > 5) {
      int v = -1;
      auto [p, ec] = std::from_chars(s.data() + 5, s.data() + s.size(), v);
      if (ec == std::errc() && p == s.data() + s.size() && v >= 0 && v < 128) {
        index = static_cast<int8_t>(v);
        return;
      }
    }
  }
  throw ValueError(detail::str_cat("[Device] cannot parse device '", s,
                                   "'; expected 'cpu', 'cuda' or 'cuda:N'"));
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace ember
