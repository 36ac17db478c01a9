#include <ember/distributed/trace_clock.h>

#include <limits>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist {

void align_trace_clock(ProcessGroup& pg, int rounds) {
  if (pg.rank() == 0 || pg.size() == 1) {
    for (int k = 0; k < rounds && pg.size() > 1; ++k) {  // rank 0 takes part in every round
      pg.barrier()->wait();
      Tensor c0 = from_vector<int64_t>({trace::now_us()}, {1}, pg.default_device());
      pg.broadcast(c0)->wait();
    }
    trace::set_clock_offset(pg.rank(), 0, 0);
    return;
  }
  int64_t best_width = std::numeric_limits<int64_t>::max();
  int64_t best_offset = 0;
  for (int k = 0; k < rounds; ++k) {
    const int64_t entered = trace::now_us();
    pg.barrier()->wait();
    Tensor c0 = from_vector<int64_t>({0}, {1}, pg.default_device());
    pg.broadcast(c0)->wait();
    const int64_t rank0 = c0.to(kCPU).to_vector<int64_t>()[0];
    const int64_t arrived = trace::now_us();
    if (arrived - entered < best_width) {
      best_width = arrived - entered;
      best_offset = entered + (arrived - entered) / 2 - rank0;
    }
  }
  trace::set_clock_offset(pg.rank(), best_offset, (best_width + 1) / 2);
}

}  // namespace ember::dist
