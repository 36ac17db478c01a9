// ForwardingProcessGroup and the wrappers built on it (CheckedProcessGroup, DelayingGroup): every
// method of ProcessGroup reaches the wrapped group, and what a wrapper reports about its group
// (device, backend, memory) is the wrapped group's. The DETAIL-over-NCCL case: DDP builds the
// checked group's tensors on the device the wrapped group asks for.
#include <ember/distributed/forwarding_process_group.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/debug/debug.h>
#include <ember/distributed/debug/delaying_group.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;

// A world of one that records which operation each call was and answers every query with a
// value no default has, so a wrapper that does not forward a call is seen.
class Recording final : public ProcessGroup {
 public:
  Recording() : ProcessGroup(0, 1, Options{7s}) { set_global_ranks({5}); }

  std::string backend_name() const override { return "recording"; }
  Device default_device() const override { return cuda_device(3); }
  bool coalesced_without_copies(const Device&) const override { return true; }
  Tensor zeros_for_collectives(IntList shape, TensorOptions opts) const override {
    ++zeros_made;
    return zeros(shape, opts);
  }

  WorkPtr allreduce(Tensor&, const AllreduceOptions&) override { return saw(OpType::Allreduce); }
  WorkPtr allreduce_coalesced(std::vector<Tensor>&, const AllreduceOptions&) override {
    return saw(OpType::AllreduceCoalesced);
  }
  WorkPtr broadcast(Tensor&, const BroadcastOptions&) override { return saw(OpType::Broadcast); }
  WorkPtr reduce(Tensor&, const ReduceOptions&) override { return saw(OpType::Reduce); }
  WorkPtr allgather(std::vector<Tensor>&, const Tensor&, const CollectiveOptions&) override {
    return saw(OpType::Allgather);
  }
  WorkPtr allgather_into_tensor(Tensor&, const Tensor&, const CollectiveOptions&) override {
    return saw(OpType::AllgatherIntoTensor);
  }
  WorkPtr gather(std::vector<Tensor>&, const Tensor&, const GatherOptions&) override {
    return saw(OpType::Gather);
  }
  WorkPtr scatter(Tensor&, const std::vector<Tensor>&, const ScatterOptions&) override {
    return saw(OpType::Scatter);
  }
  WorkPtr reduce_scatter(Tensor&, const std::vector<Tensor>&,
                         const ReduceScatterOptions&) override {
    return saw(OpType::ReduceScatter);
  }
  WorkPtr reduce_scatter_tensor(Tensor&, const Tensor&, const ReduceScatterOptions&) override {
    return saw(OpType::ReduceScatterTensor);
  }
  WorkPtr alltoall(std::vector<Tensor>&, const std::vector<Tensor>&,
                   const CollectiveOptions&) override {
    return saw(OpType::Alltoall);
  }
  WorkPtr barrier(const CollectiveOptions&) override { return saw(OpType::Barrier); }
  WorkPtr send(const Tensor&, int, int) override { return saw(OpType::Send); }
  WorkPtr recv(Tensor&, int, int) override { return saw(OpType::Recv); }

  std::vector<OpType> seen;
  mutable int zeros_made = 0;

 private:
  WorkPtr saw(OpType op) {
    seen.push_back(op);
    auto w = std::make_shared<Work>(to_string(op), timeout());
    w->finish({});
    return w;
  }
};

// Calls the method of `op` on `pg` with tensors a world of one accepts.
void call(ProcessGroup& pg, OpType op) {
  Tensor t = ones({4});
  std::vector<Tensor> one{ones({4})};
  switch (op) {
    case OpType::Allreduce: pg.allreduce(t)->wait(); return;
    case OpType::AllreduceCoalesced: pg.allreduce_coalesced(one)->wait(); return;
    case OpType::Broadcast: pg.broadcast(t)->wait(); return;
    case OpType::Reduce: pg.reduce(t)->wait(); return;
    case OpType::Allgather: pg.allgather(one, t)->wait(); return;
    case OpType::AllgatherIntoTensor: pg.allgather_into_tensor(t, ones({4}))->wait(); return;
    case OpType::Gather: pg.gather(one, t)->wait(); return;
    case OpType::Scatter: pg.scatter(t, one)->wait(); return;
    case OpType::ReduceScatter: pg.reduce_scatter(t, one)->wait(); return;
    case OpType::ReduceScatterTensor: pg.reduce_scatter_tensor(t, ones({4}))->wait(); return;
    case OpType::Alltoall: pg.alltoall(one, {ones({4})})->wait(); return;
    case OpType::Barrier: pg.barrier()->wait(); return;
    case OpType::Send: pg.send(t, 0)->wait(); return;
    case OpType::Recv: pg.recv(t, 0)->wait(); return;
  }
  FAIL() << "no call for OpType " << static_cast<int>(op);
}

using Wrap = std::function<std::shared_ptr<ProcessGroup>(std::shared_ptr<ProcessGroup>)>;
struct Wrapper {
  const char* name;
  Wrap wrap;
};

void PrintTo(const Wrapper& w, std::ostream* os) { *os << w.name; }

class EveryWrapper : public ::testing::TestWithParam<Wrapper> {};

// Each OpType's method, called on the wrapper, is seen by the wrapped group as that same
// operation (not as a composite of others), and the wrapper reports the wrapped group's rank,
// size, timeout, global ranks, backend, device and memory.
TEST_P(EveryWrapper, ForwardsEveryMethod) {
  auto inner = std::make_shared<Recording>();
  std::shared_ptr<ProcessGroup> w = GetParam().wrap(inner);
  EXPECT_EQ(w->rank(), 0);
  EXPECT_EQ(w->size(), 1);
  EXPECT_EQ(w->timeout(), inner->timeout());
  EXPECT_EQ(w->global_ranks(), std::vector<int>({5}));
  EXPECT_EQ(w->backend_name(), "recording");
  EXPECT_EQ(w->default_device(), cuda_device(3));
  EXPECT_TRUE(w->coalesced_without_copies(kCPU));
  w->zeros_for_collectives({2}, TensorOptions(kFloat32));
  EXPECT_EQ(inner->zeros_made, 1);
  for (int k = 0; k < kOpTypeCount; ++k) {
    const auto op = static_cast<OpType>(k);
    inner->seen.clear();
    call(*w, op);
    EXPECT_EQ(inner->seen, std::vector<OpType>({op})) << to_string(op) << " through "
                                                      << GetParam().name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Wrappers, EveryWrapper,
    ::testing::Values(
        Wrapper{"ForwardingProcessGroup",
                [](std::shared_ptr<ProcessGroup> g) {
                  return std::make_shared<ForwardingProcessGroup>(std::move(g));
                }},
        Wrapper{"CheckedProcessGroup",
                [](std::shared_ptr<ProcessGroup> g) {
                  return std::make_shared<CheckedProcessGroup>(std::move(g));
                }},
        Wrapper{"DelayingGroup",
                [](std::shared_ptr<ProcessGroup> g) {
                  return std::make_shared<DelayingGroup>(std::move(g), DelayOptions{.cpu_delay = 1ms});
                }}),
    [](const ::testing::TestParamInfo<Wrapper>& info) { return std::string(info.param.name); });

TEST(ForwardingProcessGroup, RefusesNullNamingTheWrapper) {
  test::expect_error([] { ForwardingProcessGroup g(nullptr); },
                     {"[ForwardingProcessGroup] expected a process group to wrap, got null"});
  test::expect_error([] { CheckedProcessGroup g(nullptr); }, {"[CheckedProcessGroup]"});
  test::expect_error([] { DelayingGroup g(nullptr); }, {"[DelayingGroup]"});
}

// Under EMBER_DISTRIBUTED_DEBUG=DETAIL, DDP issues its collectives on a CheckedProcessGroup and
// builds its own small tensors (parameter check, bucket rebuild, the debug fingerprints) on that
// group's default_device(): over NCCL the GPU. The wrapper must report the wrapped group's
// device; before ForwardingProcessGroup it answered the CPU.
class DetailDebug {
 public:
  DetailDebug() { ::setenv("EMBER_DISTRIBUTED_DEBUG", "DETAIL", 1); }
  ~DetailDebug() { ::unsetenv("EMBER_DISTRIBUTED_DEBUG"); }
};

TEST(CheckedProcessGroup, ReportsTheWrappedGroupsDevice) {
  CheckedProcessGroup checked(std::make_shared<Recording>());
  EXPECT_EQ(checked.default_device(), cuda_device(3));
}

// A group whose collectives must be on its GPU (as NCCL's), over threads sharing one GPU:
// records the devices of the tensors it is given.
class OnDevice final : public ForwardingProcessGroup {
 public:
  OnDevice(std::shared_ptr<ProcessGroup> inner, Device d)
      : ForwardingProcessGroup(std::move(inner)), device_(d) {}
  Device default_device() const override { return device_; }
  WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in,
                                const CollectiveOptions& o) override {
    note(in);
    return inner_->allgather_into_tensor(out, in, o);
  }
  WorkPtr allreduce(Tensor& t, const AllreduceOptions& o) override {
    note(t);
    return inner_->allreduce(t, o);
  }
  WorkPtr broadcast(Tensor& t, const BroadcastOptions& o) override {
    note(t);
    return inner_->broadcast(t, o);
  }
  int off_device = 0;

 private:
  void note(const Tensor& t) {
    if (t.device() != device_) ++off_device;
  }
  Device device_;
};

TEST(CheckedProcessGroup, DdpUnderDetailBuildsItsTensorsOnTheGroupsGpu) {
  EMBER_REQUIRE_CUDA();
  DetailDebug detail;
  test::ThreadsSetup s;
  s.device = cuda_device(0);
  test::run_threads_or_throw(s, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto g = std::make_shared<OnDevice>(pg, cuda_device(0));
    manual_seed(11);
    auto model = std::make_shared<nn::Linear>(8, 4);
    model->to(cuda_device(0));
    DistributedDataParallel ddp(model, g);
    test::require(std::dynamic_pointer_cast<CheckedProcessGroup>(ddp.comm_group()) != nullptr,
                  "DETAIL wraps the group");
    Tensor x = ones({2, 8}, TensorOptions().device(cuda_device(0)));
    ddp.forward(x).sum().backward();
    test::require(g->off_device == 0, "rank " + std::to_string(rank) + ": " +
                                          std::to_string(g->off_device) +
                                          " collective(s) got tensors off the group's GPU");
  });
}

}  // namespace
}  // namespace ember::dist
