// DistributedDataParallel over the MPI process group with real ranks under mpirun. Run by ctest,
// the DDPMpiWorld cases start `mpirun -np 2` and `-np 4` on this binary selecting the
// DDPMpiRanks cases, which every rank then runs: a CNN (conv and linear layers) trained on each
// rank's slice of a batch ends where one process trained on the whole batch ends (default
// buckets; one bucket per parameter with gradient_as_bucket_view and no_sync accumulation),
// the allreduce hook gives the same bits as no hook and fp16 stays within half precision,
// PowerSGD with several buckets keeps every rank identical, and join() with uneven inputs
// trains as the closed form says. Outside mpirun the DDPMpiRanks cases skip.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>

#include <ember/distributed/backends/process_group_mpi.h>
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/powersgd.h>
#include <ember/nn/optim/sgd.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/backends/mpi_job.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::Batch;
using test::require;
using test::require_close;

TEST(DDPMpiWorld, Np2) {
  test::expect_mpi_job_passes(2, "DDPMpiRanks.*", 240s, ProcessGroupMpi::is_available());
}
TEST(DDPMpiWorld, Np4) {
  test::expect_mpi_job_passes(4, "DDPMpiRanks.*", 240s, ProcessGroupMpi::is_available());
}

// ---- run by every rank under mpirun ------------------------------------------------------------

std::shared_ptr<ProcessGroup> world() {
  static std::shared_ptr<ProcessGroupMpi> g = ProcessGroupMpi::create();
  return g;
}

constexpr int kSteps = 4;
constexpr int64_t kRowsPerRank = 4;

Batch batch_for_step(int step, int n) { return test::cnn_batch(60 + step, kRowsPerRank * n); }

/// kSteps SGD (momentum) steps of the CNN under DDP on this rank's slice of each batch, every
/// rank starting from different weights (DDP broadcasts rank 0's). `setup` may register a hook;
/// with `micro` > 1 each slice is split into that many micro-batches, all but the last under
/// no_sync(), each loss scaled by 1 / micro.
std::shared_ptr<nn::Sequential> train_ddp(const DDPOptions& o,
                                          const std::function<void(DistributedDataParallel&)>&
                                              setup = {},
                                          int micro = 1) {
  auto pg = world();
  const int rank = pg->rank(), n = pg->size();
  auto model = test::make_cnn(300 + rank);
  auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
  if (setup) setup(*ddp);
  nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < kSteps; ++step) {
    const Batch mine = test::slice(batch_for_step(step, n), rank, n);
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      const Batch part = test::slice(mine, m, micro);
      if (m + 1 < micro) {
        auto guard = ddp->no_sync();
        (test::loss_of(*ddp, part) / static_cast<double>(micro)).backward();
      } else {
        (test::loss_of(*ddp, part) / static_cast<double>(micro)).backward();
      }
    }
    opt.step();
  }
  return model;
}

/// The same steps in one process on the whole batches, from rank 0's initial weights.
std::shared_ptr<nn::Sequential> train_alone() {
  const int n = world()->size();
  auto model = test::make_cnn(300);
  nn::optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    test::loss_of(*model, batch_for_step(step, n)).backward();
    opt.step();
  }
  return model;
}

void require_params_close(const std::string& what, const nn::Module& got, const nn::Module& want,
                          double tol) {
  const auto a = got.named_parameters();
  const auto b = want.named_parameters();
  require(a.size() == b.size(), what + ": parameter count");
  for (size_t i = 0; i < a.size(); ++i) {
    require_close(what + " " + a[i].first + " on rank " + std::to_string(world()->rank()),
                  a[i].second, b[i].second, tol);
  }
}

TEST(DDPMpiRanks, TrainsLikeOneProcess) {
  SKIP_UNLESS_UNDER_MPIRUN();
  auto model = train_ddp({});
  require_params_close("default buckets", *model, *train_alone(), 1e-4);
  test::require_same_on_all_ranks(*world(), *model);
}

TEST(DDPMpiRanks, OneBucketPerParameterViewsAndNoSync) {
  SKIP_UNLESS_UNDER_MPIRUN();
  DDPOptions o;
  o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;
  o.gradient_as_bucket_view = true;
  auto model = train_ddp(o, {}, /*micro=*/2);
  require_params_close("small buckets, views, no_sync", *model, *train_alone(), 1e-4);
  test::require_same_on_all_ranks(*world(), *model);
}

TEST(DDPMpiRanks, AllreduceHookIsNoHookAndFp16IsClose) {
  SKIP_UNLESS_UNDER_MPIRUN();
  DDPOptions o;
  o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;
  auto plain = train_ddp(o);
  auto hooked = train_ddp(o, [](DistributedDataParallel& d) { d.register_comm_hook(allreduce_hook); });
  require_params_close("allreduce hook", *hooked, *plain, 0);
  auto fp16 = train_ddp(o, [](DistributedDataParallel& d) { d.register_comm_hook(fp16_compress_hook); });
  require_params_close("fp16 hook", *fp16, *plain, 5e-3);
}

// Several buckets: the hook's all-reduces must be issued in the same order on every rank (what
// makes torch 1.13's PowerSGD crash over gloo).
TEST(DDPMpiRanks, PowerSGDWithSeveralBucketsKeepsRanksIdentical) {
  SKIP_UNLESS_UNDER_MPIRUN();
  DDPOptions o;
  o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;
  auto state = std::make_shared<PowerSGDState>(
      PowerSGDOptions{.matrix_approximation_rank = 1, .start_powerSGD_iter = 2,
                      .min_compression_rate = 1});
  auto model = train_ddp(o, [&](DistributedDataParallel& d) {
    d.register_comm_hook(state, powersgd_hook);
    require(d.bucket_indices().size() >= 3, "want several buckets");
  });
  require(state->iteration() == kSteps, "PowerSGD saw " + std::to_string(state->iteration()) +
                                            " iterations, want " + std::to_string(kSteps));
  test::require_same_on_all_ranks(*world(), *model);
}

// Rank r has 2 + r batches. While some ranks have joined, the summed gradients are divided by
// the initial world size, so step k of the last rank uses sum over ranks still at work of
// grad(mean loss of their slice) / n: one process reproduces that loss exactly.
TEST(DDPMpiRanks, JoinWithUnevenInputs) {
  SKIP_UNLESS_UNDER_MPIRUN();
  auto pg = world();
  const int rank = pg->rank(), n = pg->size();
  auto model = test::make_cnn(400 + rank);
  auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
  nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05, .momentum = 0.9});
  ddp->join([&] {
    for (int step = 0; step < 2 + rank; ++step) {
      opt.zero_grad();
      test::loss_of(*ddp, test::slice(batch_for_step(step, n), rank, n)).backward();
      opt.step();
    }
  });
  auto ref = test::make_cnn(400);
  nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < 2 + (n - 1); ++step) {
    ref_opt.zero_grad();
    const Batch b = batch_for_step(step, n);
    Tensor loss;
    for (int r = 0; r < n; ++r) {
      if (step >= 2 + r) continue;  // rank r has joined
      Tensor l = test::loss_of(*ref, test::slice(b, r, n)) / static_cast<double>(n);
      loss = loss.defined() ? loss + l : l;
    }
    loss.backward();
    ref_opt.step();
  }
  require_params_close("after join", *model, *ref, 1e-4);
  test::require_same_on_all_ranks(*pg, *model);
}

}  // namespace
}  // namespace ember::dist
