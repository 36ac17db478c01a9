#include <ember/distributed/debug/collective_trace.h>

namespace ember::dist::tracing {

int64_t result_bytes(const std::vector<Tensor>& outputs) {
  int64_t bytes = 0;
  for (const Tensor& t : outputs) bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return bytes;
}

}  // namespace ember::dist::tracing
