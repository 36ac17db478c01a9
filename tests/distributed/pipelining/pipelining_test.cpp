// Pipeline parallelism: every schedule at 2 and 4 ranks (threads, and processes over gloo)
// trains like the unsplit model; schedules as data (validation, the table, CSV); the failure
// modes (shapes, batches, a rank that stops, a stage that throws).
#include <ember/distributed/pipelining/pipeline.h>

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <set>

#include <ember/autograd/autograd.h>
#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/checkpoint/model_checkpoint.h>
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/forwarding_process_group.h>
#include <ember/distributed/init.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/tensor_parallel/parallelize.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist::pipelining {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::require;
using test::require_close;

constexpr int kWidth = 8;
constexpr int kBlocks = 8;  // Linear + Tanh each: 16 modules
constexpr int kBatch = 16;

/// The model, its parameters set from `init` (the same on every rank).
std::shared_ptr<nn::Sequential> make_model(const std::vector<Tensor>& init) {
  auto m = std::make_shared<nn::Sequential>();
  for (int i = 0; i < kBlocks; ++i) {
    m->push_back(std::make_shared<nn::Linear>(kWidth, kWidth));
    m->push_back(std::make_shared<nn::Tanh>());
  }
  NoGradGuard no_grad;
  const auto params = m->parameters();
  for (size_t i = 0; i < params.size(); ++i) Tensor(params[i]).copy_(init[i]);
  return m;
}

std::vector<Tensor> initial_values() {
  std::vector<Tensor> v;
  for (int i = 0; i < kBlocks; ++i) {
    v.push_back(test::rand_t({kWidth, kWidth}, kFloat32, 100 + i) * 0.6);
    v.push_back(test::rand_t({kWidth}, kFloat32, 200 + i) * 0.1);
  }
  return v;
}

Tensor batch_x(int step) { return test::rand_t({kBatch, kWidth}, kFloat32, 1000 + step); }
Tensor batch_y(int step) { return test::rand_t({kBatch, kWidth}, kFloat32, 2000 + step) * 0.5; }

Tensor mse(const Tensor& out, const Tensor& target) { return nn::functional::mse_loss(out, target); }

struct Reference {
  std::vector<std::pair<std::string, Tensor>> params;  // after the steps
  std::vector<double> losses;                          // per step
  Tensor eval_output;  // after the steps, of the batch of the step after them
};

/// `model`'s parameters named in `frozen` no longer require grad.
void freeze(nn::Module& model, const std::set<std::string>& frozen) {
  for (auto& [name, p] : model.named_parameters()) {
    if (frozen.count(name)) Tensor(p).requires_grad_(false);
  }
}

/// The unsplit model trained `steps` AdamW steps on the whole batches (`frozen`: parameters
/// that stay as they are).
Reference train_reference(int steps, const std::set<std::string>& frozen = {}) {
  auto model = make_model(initial_values());
  freeze(*model, frozen);
  nn::optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  Reference ref;
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    Tensor loss = mse(model->forward(batch_x(t)), batch_y(t));
    loss.backward();
    opt.step();
    ref.losses.push_back(loss.item<double>());
  }
  for (const auto& [name, p] : model->named_parameters()) ref.params.push_back({name, p.detach().clone()});
  NoGradGuard no_grad;
  ref.eval_output = model->forward(batch_x(steps));
  return ref;
}

/// One rank's part of a pipelined run: its stages of the model, trained `steps` AdamW steps
/// with `kind` over `pg`, then checked against `ref` (losses on the last stage's rank, every
/// parameter of its stages).
void train_pipelined(const std::shared_ptr<ProcessGroup>& pg, ScheduleKind kind, int v, int m,
                     int steps, const Reference& ref, const std::string& what,
                     const std::set<std::string>& frozen = {}) {
  const int p = pg->size(), rank = pg->rank(), S = p * v;
  auto model = make_model(initial_values());
  freeze(*model, frozen);
  auto parts = split_sequential_evenly(*model, S);
  std::vector<std::shared_ptr<PipelineStage>> stages;
  std::vector<Tensor> params;
  for (int s = 0; s < S; ++s) {
    if (stage_rank(kind, s, S, p) != rank) continue;
    stages.push_back(std::make_shared<PipelineStage>(parts[s], s, S, kCPU, pg));
    for (const Tensor& t : parts[s]->parameters()) params.push_back(t);
  }
  PipelineSchedule schedule(stages, m, kind, {.loss_fn = mse});
  nn::optim::AdamW opt(params, {.lr = 1e-2});
  const bool first = stage_rank(kind, 0, S, p) == rank, last = stage_rank(kind, S - 1, S, p) == rank;
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    std::vector<Tensor> losses;
    const Tensor out = schedule.step(first ? batch_x(t) : Tensor(), last ? batch_y(t) : Tensor(), &losses);
    opt.step();
    if (last) {
      require(out.defined() && out.shape() == Shape({kBatch, kWidth}), what + ": merged output");
      require(static_cast<int>(losses.size()) == m, what + ": a loss per micro-batch");
      double mean = 0;
      for (const Tensor& l : losses) mean += l.item<double>() / m;
      require_close(what + ": loss at step " + std::to_string(t), from_vector(std::vector<double>{mean}),
                    from_vector(std::vector<double>{ref.losses[t]}), 1e-5);
    } else {
      require(!out.defined() && losses.empty(), what + ": no output off the last stage");
    }
  }
  // Forward only: the trained model's output and loss of the next batch, no gradient touched.
  opt.zero_grad();
  std::vector<Tensor> eval_losses;
  const Tensor out = schedule.eval(first ? batch_x(steps) : Tensor(), last ? batch_y(steps) : Tensor(),
                                   &eval_losses);
  for (const Tensor& p : params) require(!p.grad().defined(), what + ": eval left a gradient");
  if (last) {
    require_close(what + ": eval output", out, ref.eval_output, 1e-5);
    require(static_cast<int>(eval_losses.size()) == m, what + ": an eval loss per micro-batch");
    require_close(what + ": eval loss", eval_losses[0],
                  mse(ref.eval_output.narrow(0, 0, kBatch / m), batch_y(steps).narrow(0, 0, kBatch / m)), 1e-5);
    const Tensor no_target = schedule.eval(first ? batch_x(steps) : Tensor(), Tensor(), &eval_losses);
    require(no_target.defined() && eval_losses.size() == static_cast<size_t>(m), what + ": eval without a target");
  } else {
    require(!out.defined(), what + ": no eval output off the last stage");
    schedule.eval(first ? batch_x(steps) : Tensor());
  }
  for (const auto& st : stages) {
    for (const auto& [name, p] : st->submodule().named_parameters()) {
      bool found = false;
      for (const auto& [rname, rp] : ref.params) {
        if (rname != name) continue;
        require_close(what + ": " + name, p, rp, 1e-5);
        found = true;
      }
      require(found, what + ": parameter " + name + " is not the unsplit model's");
    }
  }
}

struct Case {
  ScheduleKind kind;
  int p;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string s = to_string(info.param.kind);
  for (char& c : s) c = c == '-' ? '_' : c;
  return s + "_p" + std::to_string(info.param.p);
}

class EverySchedule : public ::testing::TestWithParam<Case> {};

// 20 AdamW steps at 8 micro-batches as rank threads: every step's loss and every parameter
// within 1e-5 of the unsplit model's.
TEST_P(EverySchedule, TrainsLikeTheUnsplitModel) {
  const auto [kind, p] = GetParam();
  const Reference ref = train_reference(20);
  run_rank_threads(p, [&](int rank) {
    train_pipelined(default_group(), kind, default_stages_per_rank(kind), 8, 20, ref,
                    to_string(kind) + " p" + std::to_string(p) + " rank " + std::to_string(rank));
  }, 60s);
}

INSTANTIATE_TEST_SUITE_P(
    Threads, EverySchedule,
    ::testing::Values(Case{ScheduleKind::GPipe, 2}, Case{ScheduleKind::GPipe, 4},
                      Case{ScheduleKind::OneFOneB, 2}, Case{ScheduleKind::OneFOneB, 4},
                      Case{ScheduleKind::Interleaved1F1B, 2}, Case{ScheduleKind::Interleaved1F1B, 4},
                      Case{ScheduleKind::LoopedBFS, 2}, Case{ScheduleKind::LoopedBFS, 4},
                      Case{ScheduleKind::InterleavedZeroBubble, 2},
                      Case{ScheduleKind::InterleavedZeroBubble, 4}, Case{ScheduleKind::ZBV, 2},
                      Case{ScheduleKind::ZBV, 4}),
    case_name);

// Frozen parameters (requires_grad false): one weight of the first stage, and the whole first
// stage, whose output then needs no gradient and whose backward is skipped. The split backward
// of zero-bubble and ZBV leaves frozen weights out of its weight half.
TEST(PipelineThreads, FrozenParametersTrainLikeTheUnsplitModel) {
  // Two ranks, two stages each for the split schedules: stage 0 is blocks 0 and 1.
  const std::set<std::string> one = {"0.weight"};
  const std::set<std::string> stage0 = {"0.weight", "0.bias", "2.weight", "2.bias"};
  for (const auto& frozen : {one, stage0}) {
    const Reference ref = train_reference(4, frozen);
    for (ScheduleKind kind :
         {ScheduleKind::OneFOneB, ScheduleKind::InterleavedZeroBubble, ScheduleKind::ZBV}) {
      const int v = default_stages_per_rank(kind);
      // 1F1B runs one stage per rank: its stage 0 is blocks 0 to 3, frozen only in part.
      run_rank_threads(
          2,
          [&](int rank) {
            train_pipelined(default_group(), kind, v, 4, 4, ref,
                            to_string(kind) + " frozen " + std::to_string(frozen.size()) +
                                " rank " + std::to_string(rank),
                            frozen);
          },
          60s);
    }
  }
}

// Interleaved 1F1B with fewer micro-batches than ranks (one round of 2 at 4 ranks; Megatron's
// schedule takes only multiples of the ranks). Rounds of different sizes (9 at 4 ranks: 5 and
// 4) need a batch this model's 16 rows do not divide, and so many stages that 16 modules do
// not split evenly at 3 ranks: Schedules.EveryScheduleIsValidForManyRanksAndMicroBatches
// checks those orders by simulation, and the executor runs whatever order is valid.
TEST(PipelineThreads, Interleaved1F1BTakesAnyNumberOfMicroBatches) {
  const Reference ref = train_reference(3);
  for (const auto& [p, m] : {std::pair{4, 2}, std::pair{4, 1}}) {
    run_rank_threads(
        p,
        [&](int rank) {
          train_pipelined(
              default_group(), ScheduleKind::Interleaved1F1B, 2, m, 3, ref,
              "p" + std::to_string(p) + " m" + std::to_string(m) + " rank " + std::to_string(rank));
        },
        60s);
  }
}

// The same as processes over gloo (shared memory and TCP), 1F1B and zero-bubble.
TEST(PipelineGloo, OneFOneBAndZeroBubbleTrainLikeTheUnsplitModel) {
  const Reference ref = train_reference(6);
  for (ScheduleKind kind : {ScheduleKind::OneFOneB, ScheduleKind::InterleavedZeroBubble}) {
    for (bool shm : {true, false}) {
      test::run_gloo_ranks(2, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
        train_pipelined(pg, kind, default_stages_per_rank(kind), 4, 6, ref,
                        to_string(kind) + (shm ? " shm" : " tcp") + " rank " + std::to_string(rank));
      }, shm);
    }
  }
}

// A stage lets go of what it sent once the send completes: 1F1B's last stage holds the input
// gradients still on their way back, not one per micro-batch of the step. The step's peak is
// read off the CPU allocator's high-water mark (blocks of 128 KiB and up: an input gradient here
// is 512 KiB, the last stage's output 16 KiB) in each rank's own process.
TEST(PipelineGloo, SentGradientsAreLetGoOnceTheyArrive) {
  constexpr int kW = 256, kRows = 512, kM = 16;
  constexpr int64_t kActivation = int64_t{kRows} * kW * 4;
  test::run_gloo_ranks(2, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) {
    auto module = std::make_shared<nn::Sequential>();
    module->push_back(std::make_shared<nn::Linear>(kW, rank == 0 ? kW : 8));
    auto stage = std::make_shared<PipelineStage>(module, rank, 2, kCPU, pg);
    PipelineSchedule schedule({stage}, kM, ScheduleKind::OneFOneB, {.loss_fn = mse});
    const Tensor x = rank == 0 ? test::rand_t({kRows * kM, kW}, kFloat32, 1) : Tensor();
    const Tensor y = rank == 1 ? test::rand_t({kRows * kM, 8}, kFloat32, 2) : Tensor();
    schedule.step(x, y);  // the first step also sends the shapes and allocates the .grads
    // The mark only moves once `allocated` passes it: a ballast block first raises `allocated`
    // to the old mark, so the mark then rises by exactly the step's own peak.
    const AllocatorStats before = cpu_allocator_stats();
    const Tensor ballast = empty({before.peak_allocated - before.allocated + (1 << 20)}, kUInt8);
    const int64_t base = cpu_allocator_stats().allocated;
    schedule.step(x, y);
    const int64_t rise = cpu_allocator_stats().peak_allocated - base;
    std::fprintf(stderr, "rank %d: the step's peak is %.1f activations\n", rank,
                 static_cast<double>(rise) / kActivation);
    // Rank 1 holds a received input, its gradient and the sends in flight; kept to the end of
    // the step they were 16 more.
    if (rank == 1) {
      test::require(rise < 8 * kActivation, "rank 1's step peaked at " + std::to_string(rise) +
                                                " bytes: more than 8 activations");
    }
  });
}

}  // namespace
}  // namespace ember::dist::pipelining

namespace ember::dist::pipelining {
namespace {

std::vector<int> ranks_of(ScheduleKind k, int p, int v) {
  std::vector<int> r;
  for (int s = 0; s < p * v; ++s) r.push_back(stage_rank(k, s, p * v, p));
  return r;
}

ScheduleCheck check_of(ScheduleKind k, int p, int m) {
  const int v = default_stages_per_rank(k);
  const auto rank_of = ranks_of(k, p, v);
  return validate(add_communication(compute_actions(k, p, v, m), rank_of), p * v, m, rank_of);
}

double worst_idle(const ScheduleCheck& c) { return *std::max_element(c.idle.begin(), c.idle.end()); }

// The simulated bubble (unit costs: forward 1, backward 2, or input and weight backward 1 each)
// is the analytic one: (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) for
// interleaved 1F1B; zero-bubble's is at most half of 1F1B's.
TEST(Schedules, SimulatedBubbleIsTheAnalyticOne) {
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      const double one = static_cast<double>(p - 1) / (m + p - 1);
      for (ScheduleKind k : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
        const ScheduleCheck c = check_of(k, p, m);
        ASSERT_TRUE(c.ok) << c.error;
        for (double idle : c.idle) EXPECT_NEAR(idle, one, 1e-9) << to_string(k) << " p" << p << " m" << m;
      }
      const ScheduleCheck il = check_of(ScheduleKind::Interleaved1F1B, p, m);
      ASSERT_TRUE(il.ok) << il.error;
      EXPECT_NEAR(worst_idle(il), static_cast<double>(p - 1) / (2 * m + p - 1), 1e-9) << "p" << p << " m" << m;
      for (ScheduleKind k : {ScheduleKind::InterleavedZeroBubble, ScheduleKind::ZBV}) {
        const ScheduleCheck zb = check_of(k, p, m);
        ASSERT_TRUE(zb.ok) << zb.error;
        EXPECT_LE(worst_idle(zb), one / 2) << to_string(k) << " p" << p << " m" << m;
      }
    }
  }
}

// Every schedule, for 1 to 8 ranks and 1 to 24 micro-batches (odd counts, one micro-batch,
// fewer micro-batches than ranks, rounds of interleaved 1F1B that differ in size), is generated
// and valid; interleaved 1F1B idles no more than 1F1B, and the zero-bubble ones hold no more
// activations on any rank than interleaved 1F1B.
TEST(Schedules, EveryScheduleIsValidForManyRanksAndMicroBatches) {
  for (ScheduleKind k :
       {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBFS, ScheduleKind::InterleavedZeroBubble, ScheduleKind::ZBV}) {
    const int v = default_stages_per_rank(k);
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 24; ++m) {
        const std::string what = to_string(k) + " p" + std::to_string(p) + " m" + std::to_string(m);
        RankActions compute;
        ASSERT_NO_THROW(compute = compute_actions(k, p, v, m)) << what;
        const ScheduleCheck c =
            validate(add_communication(compute, ranks_of(k, p, v)), p * v, m, ranks_of(k, p, v));
        ASSERT_TRUE(c.ok) << what << ": " << c.error;
        if (k == ScheduleKind::Interleaved1F1B) {
          // Two stages per rank idle no more than one (in any rounds).
          EXPECT_LE(worst_idle(c), worst_idle(check_of(ScheduleKind::OneFOneB, p, m)) + 1e-9)
              << what;
        }
        if (k != ScheduleKind::InterleavedZeroBubble || m % p != 0) continue;
        auto peak = [](const RankActions& a) {
          int most = 0;
          for (const auto& rank : a) {
            int held = 0;
            for (const Action& x : rank) {
              if (x.kind == ActionKind::Forward) ++held;
              if (x.kind == ActionKind::Backward || x.kind == ActionKind::BackwardInput) --held;
              most = std::max(most, held);
            }
          }
          return most;
        };
        EXPECT_LE(peak(compute), peak(compute_actions(ScheduleKind::Interleaved1F1B, p, v, m)))
            << what;
      }
    }
  }
}

}  // namespace
}  // namespace ember::dist::pipelining

namespace ember::dist::pipelining {
namespace {

// The validator names what is wrong: a send nobody receives, a receive nobody sends, an order
// that blocks, a backward before its forward, a stage on the wrong rank, a missing weight
// backward.
TEST(Schedules, ValidatorRejectsBrokenSchedules) {
  const std::vector<int> two = {0, 1};
  auto check = [&](const std::string& csv, int m, const std::string& want) {
    const ScheduleCheck c = validate(from_csv(csv), 2, m, two);
    EXPECT_FALSE(c.ok) << csv;
    EXPECT_NE(c.error.find(want), std::string::npos) << "got: " << c.error << "\nwant: " << want;
  };
  const std::string good = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n";
  EXPECT_TRUE(validate(from_csv(good), 2, 1, two).ok) << validate(from_csv(good), 2, 1, two).error;
  check("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1B0,1SEND_B0\n", 1,
        "rank 0 sends 0SEND_F0 but rank 1 never receives it (1RECV_F0)");
  check("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0\n", 1,
        "rank 0 waits for 0RECV_B0 but rank 1 never sends it (1SEND_B0)");
  check("0RECV_B0,0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n", 1,
        "the schedule blocks: rank 0 waits at 0RECV_B0; rank 1 waits at 1RECV_F0");
  check("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1B0,1F0,1SEND_B0\n", 1, "rank 1 runs 1B0 before its forward");
  check("1F0\n0F0\n", 1, "rank 0 runs 1F0 but stage 1 is on rank 1");
  check("0F0,0SEND_F0,0RECV_B0,0I0\n1RECV_F0,1F0,1B0,1SEND_B0\n", 1,
        "stage 0 never completes backward for micro-batch 0 (no weight backward after its input backward)");
  check("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n", 2, "stage 0 never runs forward for micro-batch 1");
  EXPECT_THROW(from_csv("0F0,0X1\n"), ValueError);
  test::expect_error([] { from_csv("0F0\n0F0,zz\n"); }, {"from_csv: row 1 (rank 1), cell 1", "cannot read the action 'zz'"});
  test::expect_error([] { compute_actions(ScheduleKind::OneFOneB, 2, 2, 4); },
                     {"1f1b runs one stage per rank, got 2"});
  test::expect_error([] { parse_schedule("2f2b"); }, {"unknown schedule '2f2b'"});
}

// Every schedule round-trips through CSV and prints PyTorch's table.
TEST(Schedules, CsvRoundTripAndTable) {
  for (ScheduleKind k : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B,
                         ScheduleKind::LoopedBFS, ScheduleKind::InterleavedZeroBubble, ScheduleKind::ZBV}) {
    const int v = default_stages_per_rank(k);
    const RankActions a = add_communication(compute_actions(k, 4, v, 8), ranks_of(k, 4, v));
    EXPECT_EQ(from_csv(to_csv(a)), a) << to_string(k);
    EXPECT_EQ(parse_schedule(to_string(k)), k);
  }
  const std::string table = format_table(compute_actions(ScheduleKind::OneFOneB, 2, 1, 2), 2, 2, {0, 1});
  EXPECT_EQ(table, "Step\tRank 0\tRank 1\n0\t0F0\t\n1\t0F1\t1F0\n2\t\t1B0\n3\t\t1B0\n4\t0B0\t1F1\n"
                   "5\t0B0\t1B1\n6\t\t1B1\n7\t0B1\t\n8\t0B1\t\n") << table;
}

// A schedule of one's own from CSV (GPipe order on one rank, 1F1B on the other: legal) trains
// like the unsplit model; a step with a batch the micro-batches do not divide is refused.
TEST(PipelineThreads, RunsAUsersCsvScheduleAndRefusesABadBatch) {
  const Reference ref = train_reference(3);
  const std::string csv = "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n";
  run_rank_threads(2, [&](int rank) {
    auto model = make_model(initial_values());
    auto parts = split_sequential(*model, {6});
    auto stage = std::make_shared<PipelineStage>(parts[rank], rank, 2);
    PipelineSchedule schedule({stage}, 4, from_csv(csv), {.loss_fn = mse});
    nn::optim::AdamW opt(parts[rank]->parameters(), {.lr = 1e-2});
    for (int t = 0; t < 3; ++t) {
      opt.zero_grad();
      schedule.step(rank == 0 ? batch_x(t) : Tensor(), rank == 1 ? batch_y(t) : Tensor());
      opt.step();
    }
    for (const auto& [name, p] : parts[rank]->named_parameters()) {
      bool found = false;
      for (const auto& [rname, rp] : ref.params) {
        if (rname != name) continue;
        require_close("csv schedule: " + name, p, rp, 1e-5);
        found = true;
      }
      require(found, "csv schedule: parameter " + name + " is not the unsplit model's");
    }
    if (rank == 0) {
      test::expect_error([&] { schedule.step(batch_x(0).narrow(0, 0, 10)); },
                         {"[PipelineSchedule::step] a input of 10 along dim 0 does not divide into 4 micro-batches"});
    }
  }, 60s);
  run_rank_threads(2, [&](int rank) {
    auto model = make_model(initial_values());
    auto parts = split_sequential(*model, {6});
    auto stage = std::make_shared<PipelineStage>(parts[rank], rank, 2);
    test::expect_error([&] { PipelineSchedule({stage}, 4, from_csv("1F0\n0F0\n"), {.loss_fn = mse}); },
                       {rank == 0 ? "[PipelineSchedule] stage 0 was given to rank 0 but the schedule runs it on rank 1"
                                  : "[PipelineSchedule] stage 1 was given to rank 1 but the schedule runs it on rank 0"});
    test::expect_error([&] { PipelineSchedule({stage}, 4, ScheduleKind::OneFOneB, {}); },
                       {"expected a loss_fn"});
  }, 60s);
}

// The threads group under NCCL's name: what a pipeline over NCCL is told.
class NamedNccl final : public ForwardingProcessGroup {
 public:
  using ForwardingProcessGroup::ForwardingProcessGroup;
  std::string backend_name() const override { return "nccl"; }
};

// NCCL pairs sends and receives by order, not tag: refused at construction, saying why.
TEST(PipelineThreads, AnNcclGroupIsRefusedSayingWhy) {
  run_rank_threads(
      2,
      [&](int rank) {
        auto model = make_model(initial_values());
        auto parts = split_sequential(*model, {6});
        auto nccl = std::make_shared<NamedNccl>(default_group());
        auto stage = std::make_shared<PipelineStage>(parts[rank], rank, 2, kCPU, nccl);
        test::expect_error(
            [&] { PipelineSchedule({stage}, 4, ScheduleKind::OneFOneB, {.loss_fn = mse}); },
            {"[PipelineSchedule] the stages' group is NCCL's", "ignore tags",
             "gloo, MPI or threads group"});
      },
      60s);
}

// A stage whose output changes shape after the first step fails at the sender naming both
// shapes; the receiver, left waiting, fails within its timeout naming stage, micro-batch and
// peer. A rank that runs fewer micro-batches, and a rank that stops mid-step, end every rank
// within the timeout too.
TEST(PipelineThreads, FailuresEndEveryRankNamingStageAndMicrobatch) {
  auto build = [](int rank, int m, bool dynamic = false, int dynamic_rank = -1) {
    auto model = make_model(initial_values());
    auto parts = split_sequential(*model, {6});
    auto stage = std::make_shared<PipelineStage>(
        parts[rank], rank, 2, kCPU, default_group(),
        PipelineStageOptions{.dynamic_shapes =
                                 dynamic && (dynamic_rank < 0 || rank == dynamic_rank)});
    return std::make_shared<PipelineSchedule>(std::vector<std::shared_ptr<PipelineStage>>{stage}, m,
                                              ScheduleKind::OneFOneB, ScheduleOptions{.loss_fn = mse});
  };
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // Shapes: the second step's batch is wider in rows, so each micro-batch's output is too.
  std::vector<std::string> msgs(2);
  run_rank_threads(2, [&](int rank) {
    auto schedule = build(rank, 4);
    schedule->step(rank == 0 ? batch_x(0) : Tensor(), rank == 1 ? batch_y(0) : Tensor());
    const Tensor x = cat({batch_x(1), batch_x(2)}, 0), y = cat({batch_y(1), batch_y(2)}, 0);
    msgs[rank] = message([&] { schedule->step(rank == 0 ? x : Tensor(), rank == 1 ? y : Tensor()); });
  }, 2s);
  EXPECT_NE(msgs[0].find("stage 0 (rank 0), micro-batch 0 sending its output to stage 1 (rank 1): the output is "
                         "[8, 8] float32 but stage 1 takes [4, 8] float32"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[1].find("stage 1 (rank 1), micro-batch 0 receiving its input from stage 0 (rank 0)"),
            std::string::npos) << msgs[1];
  // With dynamic_shapes the same step runs, set on both stages or on either one alone (the
  // sender whose output varies, or the receiver): the ranks agree on it at construction.
  for (int dynamic_rank : {-1, 0, 1}) {
    run_rank_threads(
        2,
        [&](int rank) {
          auto schedule = build(rank, 4, true, dynamic_rank);
          for (int repeat = 0; repeat < 2; ++repeat) {
            schedule->step(rank == 0 ? batch_x(0) : Tensor(), rank == 1 ? batch_y(0) : Tensor());
          }
          const Tensor x = cat({batch_x(1), batch_x(2)}, 0), y = cat({batch_y(1), batch_y(2)}, 0);
          const Tensor out = schedule->step(rank == 0 ? x : Tensor(), rank == 1 ? y : Tensor());
          if (rank == 1) {
            require(out.shape() == Shape({2 * kBatch, kWidth}),
                    "dynamic shapes on rank " + std::to_string(dynamic_rank) + ": merged output");
          }
        },
        60s);
  }
  // Rank 1 runs 2 micro-batches where rank 0 runs 4: both are told at construction.
  run_rank_threads(2, [&](int rank) { msgs[rank] = message([&] { build(rank, rank == 0 ? 4 : 2); }); }, 2s);
  EXPECT_NE(msgs[0].find("[PipelineSchedule] the ranks disagree: rank 1 runs 2 micro-batches over 2 "
                         "stages, this rank (0) 4 over 2"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[1].find("the ranks disagree: rank 0 runs 4 micro-batches"), std::string::npos) << msgs[1];
  // A rank that stops mid-step: the other's next transfer fails.
  run_rank_threads(2, [&](int rank) {
    auto schedule = build(rank, 4);
    if (rank == 1) {
      msgs[1] = "left";
      return;
    }
    msgs[0] = message([&] { schedule->step(batch_x(0)); });
  }, 2s);
  EXPECT_NE(msgs[0].find("[PipelineSchedule] stage 0 (rank 0), micro-batch 0"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[0].find("rank 1"), std::string::npos) << msgs[0];
}

// A stage module whose forward throws at its `fail_at`-th call (a user's error, an allocation
// that fails), as the middle stage of a pipeline.
struct FailingStage : nn::Module {
  FailingStage(std::shared_ptr<nn::Module> m, int fail_at)
      : inner(register_module("inner", std::move(m))), fail_at(fail_at) {}
  Tensor forward(const Tensor& x) override {
    if (++calls == fail_at) throw std::runtime_error("out of memory: tried to allocate 64 GiB");
    return (*inner)(x);
  }
  std::shared_ptr<nn::Module> inner;
  int fail_at, calls = 0;
};

// Three stages, 1F1B over 4 micro-batches; the middle stage's forward throws at micro-batch 1
// of the second step while rank 0 waits for a gradient from it and rank 2 for its input. The
// failing rank gets its own error and stays alive (a process that exits closes its sockets, which
// would wake its peers anyway) until the others have failed: they fail at once, under a
// 60-second group timeout, naming the rank, its stage, micro-batch and the error, because the
// failed step aborted the group (without it they wait out the 60 s and fail with a timeout).
// `reported(rank)` tells the failing rank that `rank` has failed; `wait_for_reports()` waits
// for both.
void middle_stage_fails(const std::shared_ptr<ProcessGroup>& pg, int rank,
                        const std::function<void(int)>& reported,
                        const std::function<void()>& wait_for_reports) {
  auto model = make_model(initial_values());
  auto parts = split_sequential(*model, {6, 12});
  std::shared_ptr<nn::Module> mine = parts[rank];
  if (rank == 1) mine = std::make_shared<FailingStage>(mine, /*fail_at=*/4 + 2);
  auto stage = std::make_shared<PipelineStage>(mine, rank, 3, kCPU, pg);
  PipelineSchedule schedule({stage}, 4, ScheduleKind::OneFOneB, {.loss_fn = mse});
  auto step = [&](int t) {
    schedule.step(rank == 0 ? batch_x(t) : Tensor(), rank == 2 ? batch_y(t) : Tensor());
  };
  step(0);
  std::string msg;
  try {
    step(1);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  if (rank == 1) {
    require(msg == "out of memory: tried to allocate 64 GiB", "rank 1 got: " + msg);
    wait_for_reports();
    return;
  }
  reported(rank);
  const std::string want =
      "rank 1 aborted the group: [PipelineSchedule] stage 1 (rank 1), micro-batch 1, "
      "forward: out of memory: tried to allocate 64 GiB";
  require(msg.find(want) != std::string::npos, "rank " + std::to_string(rank) + ": " + msg);
  // Where this rank was: in a transfer (rank 0 in a receive, or, on a loaded machine, still
  // checking on an earlier send).
  require(msg.rfind("[PipelineSchedule] ", 0) == 0,
          "rank " + std::to_string(rank) + " names no place: " + msg);
}

TEST(PipelineGloo, AStageThatThrowsEndsEveryRanksStepNamingItsError) {
  test::run_store_children(3, [](int rank, std::shared_ptr<TCPStore> store) {
    auto pg =
        std::make_shared<ProcessGroupGloo>(std::make_shared<PrefixStore>("pg", store), rank, 3,
                                           ProcessGroupGloo::GlooOptions{60s, "127.0.0.1"});
    middle_stage_fails(
        pg, rank, [&](int r) { store->set("reported" + std::to_string(r), Bytes{1}); },
        [&] {
          store->wait({"reported0", "reported2"}, 120s);
        });
  });
}

TEST(PipelineThreads, AStageThatThrowsEndsEveryRanksStepNamingItsError) {
  std::mutex mu;
  std::condition_variable cv;
  int reports = 0;
  run_rank_threads(
      3,
      [&](int rank) {
        middle_stage_fails(
            default_group(), rank,
            [&](int) {
              std::lock_guard<std::mutex> lock(mu);
              ++reports;
              cv.notify_all();
            },
            [&] {
              std::unique_lock<std::mutex> lock(mu);
              require(cv.wait_for(lock, 120s, [&] { return reports == 2; }),
                      "the others did not fail");
            });
      },
      60s);
}

// pp 2 x dp 2 as rank threads, each stage's module in DDP or fully_shard-ed over its dp group:
// rank 2 (the last stage of the first pipeline) throws in its forward at the second step and
// stays alive. Its pipeline peer (rank 0) fails through the stages' group. Its data-parallel
// peer (rank 3, the last stage of the other pipeline) would wait for rank 2's gradients (or,
// sharded, its parameters' all-gather) until the 60 s timeout, but fails through the aborted
// data-parallel group, and its own failure ends rank 1. Every rank's error carries rank 2's.
TEST(PipelineThreads, AStageThatThrowsAlsoEndsItsDataParallelPeers) {
  for (const std::string wrap : {"ddp", "fsdp"}) {
    std::vector<std::string> msgs(4);
    std::mutex mu;
    std::condition_variable cv;
    int reports = 0;
    run_rank_threads(
        4,
        [&](int rank) {
          auto mesh = init_device_mesh("cpu", {2, 2}, {"pp", "dp"});
          auto pp = mesh->get_group("pp"), dp = mesh->get_group("dp");
          auto model = make_model(initial_values());
          auto parts = split_sequential(*model, {8});
          std::shared_ptr<nn::Module> m = parts[pp->rank()];
          if (wrap == "fsdp") fully_shard(m, {.group = dp});
          if (rank == 2) m = std::make_shared<FailingStage>(m, /*fail_at=*/4 + 2);
          if (wrap == "ddp") m = std::make_shared<DistributedDataParallel>(m, dp);
          auto stage = std::make_shared<PipelineStage>(m, pp->rank(), 2, kCPU, pp);
          PipelineSchedule schedule({stage}, 4, ScheduleKind::OneFOneB, {.loss_fn = mse});
          const int64_t half = kBatch / 2, at = dp->rank() * half;
          auto step = [&](int t) {
            schedule.step(pp->rank() == 0 ? batch_x(t).narrow(0, at, half) : Tensor(),
                          pp->rank() == 1 ? batch_y(t).narrow(0, at, half) : Tensor());
          };
          step(0);
          try {
            step(1);
          } catch (const std::exception& e) {
            msgs[rank] = e.what();
          }
          std::unique_lock<std::mutex> lock(mu);
          if (rank == 2) {
            require(cv.wait_for(lock, 120s, [&] { return reports == 3; }),
                    wrap + ": the others did not fail");
          } else {
            ++reports;
            cv.notify_all();
          }
        },
        60s);
    EXPECT_EQ(msgs[2], "out of memory: tried to allocate 64 GiB") << wrap;
    for (int r : {0, 1, 3}) {
      EXPECT_NE(msgs[r].find("out of memory: tried to allocate 64 GiB"), std::string::npos)
          << wrap << " rank " << r << ": " << msgs[r];
    }
  }
}

}  // namespace
}  // namespace ember::dist::pipelining

namespace ember::dist::pipelining {
namespace {

// Pipeline x data parallel: pp 2 x dp 2 as 4 rank threads on one mesh, each stage's module
// wrapped in DDP over its dp group (1F1B, and zero-bubble with its split backward) or
// fully_shard-ed over it (1F1B); each dp rank trains on its half of the batch. Gradients are
// reduced once per step, and the parameters follow the unsplit model's within 1e-5.
TEST(PipelineThreads, TimesDataParallelTrainsLikeTheUnsplitModel) {
  const Reference ref = train_reference(5);
  for (const std::string wrap : {"ddp", "ddp-zero-bubble", "fsdp"}) {
    run_rank_threads(4, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {2, 2}, {"pp", "dp"});
      auto pp = mesh->get_group("pp"), dp = mesh->get_group("dp");
      const ScheduleKind kind = wrap == "ddp-zero-bubble" ? ScheduleKind::InterleavedZeroBubble
                                                          : ScheduleKind::OneFOneB;
      const int S = 2 * default_stages_per_rank(kind);
      auto model = make_model(initial_values());
      auto parts = split_sequential_evenly(*model, S);
      std::vector<std::shared_ptr<PipelineStage>> stages;
      std::vector<Tensor> params;
      std::vector<int> mine;
      int reductions = 0;  // DDP's bucket reductions on this rank
      for (int s = 0; s < S; ++s) {
        if (stage_rank(kind, s, S, 2) != pp->rank()) continue;
        mine.push_back(s);
        std::shared_ptr<nn::Module> m = parts[s];
        if (wrap == "fsdp") {
          fully_shard(parts[s], {.group = dp});
          for (const Tensor& t : fsdp_parameters(*parts[s])) params.push_back(t);
        } else {
          auto ddp = std::make_shared<DistributedDataParallel>(parts[s], dp);
          ddp->register_comm_hook([&reductions](GradBucket& b) {
            ++reductions;
            return allreduce_hook(b);
          });
          m = ddp;
          for (const Tensor& t : parts[s]->parameters()) params.push_back(t);
        }
        stages.push_back(std::make_shared<PipelineStage>(m, s, S, kCPU, pp));
      }
      PipelineSchedule schedule(stages, 4, kind, {.loss_fn = mse});
      nn::optim::AdamW opt(params, {.lr = 1e-2});
      const bool first = pp->rank() == stage_rank(kind, 0, S, 2);
      const bool last = pp->rank() == stage_rank(kind, S - 1, S, 2);
      const int64_t half = kBatch / 2, at = dp->rank() * half;
      for (int t = 0; t < 5; ++t) {
        opt.zero_grad();
        const int before = reductions;
        schedule.step(first ? batch_x(t).narrow(0, at, half) : Tensor(),
                      last ? batch_y(t).narrow(0, at, half) : Tensor());
        opt.step();
        // One bucket per stage (a few KB of gradients each), reduced once per step.
        if (wrap != "fsdp") require(reductions - before == static_cast<int>(mine.size()),
                                    wrap + ": " + std::to_string(reductions - before) +
                                        " reductions in a step of " + std::to_string(mine.size()) + " stages");
      }
      for (int s : mine) {
        const nn::NamedTensors got =
            wrap == "fsdp" ? full_state_dict(*parts[s]) : parts[s]->named_parameters();
        require(!got.empty(), wrap + ": stage " + std::to_string(s) + " has no parameters");
        for (const auto& [name, p] : got) {
          bool found = false;
          for (const auto& [rname, rp] : ref.params) {
            if (rname != name) continue;
            require_close(wrap + " rank " + std::to_string(rank) + ": " + name, p, rp, 1e-5);
            found = true;
          }
          require(found, wrap + ": parameter " + name + " is not the unsplit model's");
        }
      }
    }, 60s);
  }
}

}  // namespace
}  // namespace ember::dist::pipelining

namespace ember::dist::pipelining {
namespace {

/// `steps` steps of a 2-stage pipeline whose dp ranks each train on their half of the batch.
void train_two_stages_on_half_batches(PipelineSchedule& schedule, nn::optim::Optimizer& opt,
                                      const ProcessGroup& pp, const ProcessGroup& dp, int steps) {
  const int64_t half = kBatch / 2, at = dp.rank() * half;
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    schedule.step(pp.rank() == 0 ? batch_x(t).narrow(0, at, half) : Tensor(),
                  pp.rank() == 1 ? batch_y(t).narrow(0, at, half) : Tensor());
    opt.step();
  }
}

/// Trains the unsplit model from `dir`'s checkpoint (saved after `from` steps) up to `steps`
/// and checks it ends where the uninterrupted run does.
void resume_in_one_process(const std::string& dir, int from, int steps, const std::string& what) {
  auto model = make_model(initial_values());
  nn::optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  const auto meta = load_model_checkpoint(dir, *model, &opt);
  EXPECT_EQ(meta.at("step"), std::to_string(from)) << what;
  for (int t = from; t < steps; ++t) {
    opt.zero_grad();
    mse(model->forward(batch_x(t)), batch_y(t)).backward();
    opt.step();
  }
  const Reference ref = train_reference(steps);
  const auto got = model->named_parameters();
  for (size_t i = 0; i < got.size(); ++i) require_close(what + ": " + got[i].first, got[i].second, ref.params[i].second, 1e-5);
}

// Checkpoints saved per stage (each rank its stage's parameters and AdamW state, under the
// unsplit model's names) go on at another pipeline degree: pp 2 -> one process, and
// pp 2 x dp 2 (DDP stages, the replicas' parts written once) -> one process, as if
// uninterrupted.
TEST(PipelineCheckpoint, SavedPerStageGoesOnInOneProcess) {
  test::TempDir pp2, pp2dp2;
  run_rank_threads(2, [&](int rank) {
    auto model = make_model(initial_values());
    auto parts = split_sequential_evenly(*model, 2);
    auto stage = std::make_shared<PipelineStage>(parts[rank], rank, 2);
    PipelineSchedule schedule({stage}, 4, ScheduleKind::OneFOneB, {.loss_fn = mse});
    nn::optim::AdamW opt(parts[rank]->parameters(), {.lr = 1e-2});
    for (int t = 0; t < 3; ++t) {
      opt.zero_grad();
      schedule.step(rank == 0 ? batch_x(t) : Tensor(), rank == 1 ? batch_y(t) : Tensor());
      opt.step();
    }
    save_model_checkpoint(pp2.path(), *parts[rank], &opt, *default_group(), {{"step", "3"}});
  }, 60s);
  resume_in_one_process(pp2.path(), 3, 6, "pp 2 -> 1");

  run_rank_threads(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"pp", "dp"});
    auto pp = mesh->get_group("pp"), dp = mesh->get_group("dp");
    auto model = make_model(initial_values());
    auto parts = split_sequential_evenly(*model, 2);
    auto part = parts[pp->rank()];
    auto stage = std::make_shared<PipelineStage>(std::make_shared<DistributedDataParallel>(part, dp),
                                                 pp->rank(), 2, kCPU, pp);
    PipelineSchedule schedule({stage}, 2, ScheduleKind::OneFOneB, {.loss_fn = mse});
    nn::optim::AdamW opt(part->parameters(), {.lr = 1e-2});
    train_two_stages_on_half_batches(schedule, opt, *pp, *dp, 4);
    save_model_checkpoint(pp2dp2.path(), *part, &opt, *default_group(), {{"step", "4"}});
  }, 60s);
  resume_in_one_process(pp2dp2.path(), 4, 6, "pp 2 x dp 2 -> 1");
}

}  // namespace
}  // namespace ember::dist::pipelining

namespace ember::dist::pipelining {
namespace {

// 3-D: pp 2 x dp 2 x tp 2 as 8 rank threads on one mesh. Each stage's Linear pairs are
// column- then row-parallel over tp, the stage fully_shard-ed over dp (2-D FSDP), the stages
// pipelined with 1F1B over pp; each dp rank trains on its half of the batch. The checkpoint it
// saves after 4 steps holds, read in one process, the unsplit model's parameters after 4 steps
// within 1e-5.
TEST(PipelineThreads, ThreeDimensionalTrainsLikeTheUnsplitModel) {
  test::TempDir dir;
  run_rank_threads(8, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
    auto pp = mesh->get_group("pp"), dp = mesh->get_group("dp");
    auto model = make_model(initial_values());
    auto part = split_sequential_evenly(*model, 2)[pp->rank()];
    ParallelizePlan plan;
    for (int64_t i = part->begin(); i < part->end(); i += 4) {
      plan.push_back({std::to_string(i), ColwiseParallel()});
      plan.push_back({std::to_string(i + 2), RowwiseParallel()});
    }
    parallelize_module(part, (*mesh)["tp"], plan);
    fully_shard(part, {.group = dp});
    auto stage = std::make_shared<PipelineStage>(part, pp->rank(), 2, kCPU, pp);
    PipelineSchedule schedule({stage}, 2, ScheduleKind::OneFOneB, {.loss_fn = mse});
    nn::optim::AdamW opt(fsdp_parameters(*part), {.lr = 1e-2});
    train_two_stages_on_half_batches(schedule, opt, *pp, *dp, 4);
    save_model_checkpoint(dir.path(), *part, &opt, *default_group(), {{"step", "4"}});
  }, 60s);
  resume_in_one_process(dir.path(), 4, 4, "pp 2 x dp 2 x tp 2 -> 1");
}

}  // namespace
}  // namespace ember::dist::pipelining
