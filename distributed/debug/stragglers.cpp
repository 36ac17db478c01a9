#include <ember/distributed/debug/stragglers.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>

namespace ember::dist {
namespace {

constexpr int kFields = 3;  // step, data, comm_wait

std::string ms(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f ms", v);
  return buf;
}

}  // namespace

double StepTimes::compute_ms() const { return std::max(0.0, step_ms - data_ms - comm_wait_ms); }

std::vector<StepTimes> gather_step_times(ProcessGroup& pg, const StepTimes& mine) {
  for (double v : {mine.step_ms, mine.data_ms, mine.comm_wait_ms}) {
    EMBER_CHECK(std::isfinite(v) && v >= 0, "[gather_step_times] rank ", pg.rank(),
                ": times must be finite and >= 0 ms, got step ", mine.step_ms, ", data ",
                mine.data_ms, ", communication wait ", mine.comm_wait_ms);
  }
  const Tensor local = from_vector<double>({mine.step_ms, mine.data_ms, mine.comm_wait_ms},
                                           {kFields}, pg.default_device());
  Tensor all = empty({static_cast<int64_t>(pg.size()) * kFields}, local.options());
  pg.allgather_into_tensor(all, local)->wait();
  const std::vector<double> v = all.to(kCPU).to_vector<double>();
  std::vector<StepTimes> out(static_cast<size_t>(pg.size()));
  for (size_t r = 0; r < out.size(); ++r) {
    out[r] = {v[r * kFields], v[r * kFields + 1], v[r * kFields + 2]};
  }
  return out;
}

int slowest_rank(const std::vector<StepTimes>& ranks) {
  EMBER_CHECK(!ranks.empty(), "[slowest_rank] expected the times of at least one rank, got none");
  int worst = 0;
  for (size_t r = 1; r < ranks.size(); ++r) {
    if (ranks[r].busy_ms() > ranks[static_cast<size_t>(worst)].busy_ms()) {
      worst = static_cast<int>(r);
    }
  }
  return worst;
}

std::string straggler_report(const std::vector<StepTimes>& ranks) {
  EMBER_CHECK(!ranks.empty(),
              "[straggler_report] expected the times of at least one rank, got none");
  auto sorted_by = [&](auto key) {
    std::vector<size_t> order(ranks.size());
    for (size_t r = 0; r < order.size(); ++r) order[r] = r;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return key(ranks[a]) < key(ranks[b]); });
    return order;
  };
  const auto by_step = sorted_by([](const StepTimes& t) { return t.step_ms; });
  const auto by_busy = sorted_by([](const StepTimes& t) { return t.busy_ms(); });
  const auto slowest = static_cast<size_t>(slowest_rank(ranks));
  const StepTimes& s = ranks[slowest];
  const double median_busy = ranks[by_busy[by_busy.size() / 2]].busy_ms();
  const double over = median_busy > 0 ? 100.0 * (s.busy_ms() - median_busy) / median_busy : 0.0;
  char pct[32];
  std::snprintf(pct, sizeof pct, "%+.1f%%", over);
  return detail::str_cat(
      "step time over ", ranks.size(), ranks.size() == 1 ? " rank: min " : " ranks: min ",
      ms(ranks[by_step.front()].step_ms), " (rank ", by_step.front(), "), median ",
      ms(ranks[by_step[by_step.size() / 2]].step_ms), ", max ", ms(ranks[by_step.back()].step_ms),
      " (rank ", by_step.back(), "); slowest rank ", slowest, ": busy ", ms(s.busy_ms()), " (",
      pct, " over the median), data ", ms(s.data_ms), ", compute ", ms(s.compute_ms()),
      ", waiting on communication ", ms(s.comm_wait_ms));
}

}  // namespace ember::dist
