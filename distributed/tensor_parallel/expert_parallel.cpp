#include <ember/distributed/tensor_parallel/expert_parallel.h>

#include <numeric>
#include <utility>

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/distributed/functional/collectives.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

// Sends each expert's rows to the rank holding it, runs this rank's experts over what every
// rank sent, and sends the outputs back.
//
// The rows arrive grouped by expert, so the rows for rank r (experts [r L, (r + 1) L)) are one
// block: the first exchange moves blocks. What rank r receives is grouped by source and then
// by expert; it is regrouped by expert (every source's rows for expert 0, then for expert 1,
// ...) to run each expert once, and put back in source order for the return exchange, which
// leaves each rank's outputs in the order its rows left.
class ExpertParallelDispatch final : public nn::ExpertDispatch {
 public:
  explicit ExpertParallelDispatch(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

  Tensor run(nn::MoE& moe, const Tensor& rows, const std::vector<int64_t>& counts) override {
    const int n = group_->size();
    const int64_t L = moe.local_experts();
    // How many rows this rank sends each expert, exchanged so that every rank learns what it
    // receives: got[s L + e] rows from rank s for its local expert e.
    std::vector<int64_t> got;
    {
      NoGradGuard no_grad;
      const Tensor mine = from_vector(counts, {static_cast<int64_t>(counts.size())});
      got = functional::all_to_all_single(mine.to(rows.device()), {}, {}, group_)
                .to(kCPU)
                .to_vector<int64_t>();
    }
    std::vector<int64_t> send(n, 0), recv(n, 0), per_expert(static_cast<size_t>(L), 0);
    for (int r = 0; r < n; ++r) {
      for (int64_t e = 0; e < L; ++e) {
        send[r] += counts[static_cast<size_t>(r * L + e)];
        recv[r] += got[static_cast<size_t>(r * L + e)];
        per_expert[static_cast<size_t>(e)] += got[static_cast<size_t>(r * L + e)];
      }
    }
    const Tensor received = functional::all_to_all_single(rows, recv, send, group_);

    // The received rows are blocks in got's order (source-major, then expert); by_expert[i] is
    // the received row placed i-th when grouped by expert.
    std::vector<int64_t> block_start(got.size() + 1, 0);
    std::partial_sum(got.begin(), got.end(), block_start.begin() + 1);
    std::vector<int64_t> by_expert;
    by_expert.reserve(static_cast<size_t>(block_start.back()));
    for (int64_t e = 0; e < L; ++e) {
      for (int s = 0; s < n; ++s) {
        const auto b = static_cast<size_t>(s * L + e);
        for (int64_t i = 0; i < got[b]; ++i) by_expert.push_back(block_start[b] + i);
      }
    }
    bool identity = true;
    for (size_t i = 0; i < by_expert.size() && identity; ++i) {
      identity = by_expert[i] == static_cast<int64_t>(i);
    }
    Tensor outs;
    if (identity) {
      outs = moe.run_local_experts(received, per_expert);
    } else {
      std::vector<int64_t> back(by_expert.size());
      for (size_t i = 0; i < by_expert.size(); ++i) back[static_cast<size_t>(by_expert[i])] = i;
      const int64_t m = static_cast<int64_t>(by_expert.size());
      const Tensor grouped =
          index_select(received, 0, from_vector(by_expert, {m}).to(rows.device()));
      outs = index_select(moe.run_local_experts(grouped, per_expert), 0,
                          from_vector(back, {m}).to(rows.device()));
    }
    return functional::all_to_all_single(outs, send, recv, group_);
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

}  // namespace

void parallelize_experts(const std::shared_ptr<nn::MoE>& moe, std::shared_ptr<ProcessGroup> group,
                         const ExpertParallelOptions& options) {
  EMBER_CHECK(moe != nullptr, "[parallelize_experts] expected a MoE layer, got null");
  EMBER_CHECK(group != nullptr, "[parallelize_experts] expected a process group, got null");
  const int64_t E = moe->options.experts, n = group->size();
  EMBER_CHECK(moe->local_experts() == E,
              "[parallelize_experts] the layer already holds only experts ", moe->first_expert(),
              " to ", moe->first_expert() + moe->local_experts() - 1, " of ", E);
  EMBER_CHECK(E % n == 0, "[parallelize_experts] the group's ", n, " ranks do not divide the ", E,
              " experts");
  const double divide = options.gradient_divide_factor.value_or(static_cast<double>(n));
  EMBER_CHECK(divide > 0, "[parallelize_experts] expected gradient_divide_factor > 0, got ",
              divide);
  const int64_t L = E / n;
  moe->keep_experts(group->rank() * L, L);
  moe->set_dispatch(std::make_shared<ExpertParallelDispatch>(group));
  // Each expert weight is recorded as its Shard(0) of the whole over the group, so that
  // checkpoints save and load it at any other layout and clip_grad_norm_ counts its shards.
  {
    NoGradGuard no_grad;
    const auto mesh = DeviceMesh::from_group({group}, moe->w1.is_cuda() ? "cuda" : "cpu");
    for (const Tensor& w : {moe->w1, moe->w3, moe->w2}) {
      Shape whole = w.shape();
      whole[0] = E;
      register_dtensor(w, DTensor::from_local(w, mesh, {Shard(0)}, whole));
    }
  }
  if (divide != 1.0) {
    for (const Tensor& w : {moe->w1, moe->w3, moe->w2}) {
      w.register_hook([divide](const Tensor& g) { return g / divide; });
    }
  }
}

std::vector<std::string> expert_parameter_names(nn::Module& root) {
  std::vector<std::string> names;
  for (const auto& [name, m] : root.named_modules()) {
    const auto* moe = dynamic_cast<const nn::MoE*>(m.get());
    // A layer holding all its experts is replicated: data parallelism keeps it in step.
    if (moe == nullptr || moe->local_experts() == moe->options.experts) continue;
    for (const char* w : {"w1", "w3", "w2"}) names.push_back(name.empty() ? w : name + "." + w);
  }
  return names;
}

}  // namespace ember::dist
