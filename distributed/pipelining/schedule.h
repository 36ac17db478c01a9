// Pipeline schedules as data (torch.distributed.pipelining's schedules): every rank's list of
// actions, made by a schedule, checked, printed, saved and loaded, and run by one executor
// (pipeline.h).
//
// An action is (stage, kind, micro-batch), written as PyTorch writes it: "0F3" (stage 0's
// forward of micro-batch 3), "1B2" (full backward), "1I2" (backward for the input only), "1W2"
// (backward for the weights, Note [Split backward] in autograd/engine.cpp), and the transfers
// "0SEND_F3", "1RECV_F3", "1SEND_B2", "0RECV_B2". A schedule first gives each rank its
// computation in order; add_communication() then puts each send right after the computation
// that produces it and each receive right before the one that needs it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ember::dist::pipelining {

enum class ActionKind { Forward, Backward, BackwardInput, BackwardWeight, SendF, RecvF, SendB, RecvB };

struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::Forward;
  int microbatch = 0;
  bool operator==(const Action&) const = default;
};

/// "0F3", "1RECV_B2".
std::string to_string(const Action& a);
/// The inverse of to_string; throws ValueError naming the text.
Action parse_action(const std::string& text);

/// One list of actions per rank.
using RankActions = std::vector<std::vector<Action>>;

enum class ScheduleKind { GPipe, OneFOneB, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBV };
/// "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble" (interleaved), "zbv".
std::string to_string(ScheduleKind k);
/// The inverse; throws ValueError listing the names.
ScheduleKind parse_schedule(const std::string& name);
/// Stages per rank a schedule takes by default: 1 for GPipe and 1F1B, 2 for the others.
int default_stages_per_rank(ScheduleKind k);

/// Which rank runs `stage` of `num_stages` over `ranks`: stage % ranks (one stage per rank, or
/// looped), or the V of ZBV (rank r runs stages r and 2 * ranks - 1 - r).
int stage_rank(ScheduleKind k, int stage, int num_stages, int ranks);

/// The computation of `kind` for `ranks` ranks, `stages_per_rank` stages each and
/// `microbatches` micro-batches, per rank in order. Throws ValueError naming the schedule for
/// what it cannot run: GPipe and 1F1B take one stage per rank, ZBV two, the interleaved ones
/// a number of micro-batches divisible by the ranks.
RankActions compute_actions(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches);

/// `compute` with the transfers between stages on different ranks (`rank_of_stage[s]`).
RankActions add_communication(const RankActions& compute, const std::vector<int>& rank_of_stage);

/// What validate() finds.
struct ScheduleCheck {
  bool ok = true;
  std::string error;        ///< the first problem, naming ranks and actions
  int steps = 0;            ///< the simulated length in time units
  std::vector<double> idle; ///< per rank, the fraction of the simulated time it waits
};

/// Checks `actions` (with communication) for `num_stages` stages and `microbatches`
/// micro-batches: every stage runs forward and backward (full, or input and weight) once per
/// micro-batch on the rank `rank_of_stage` names, after what it needs; every send has its
/// receive on the peer and the reverse; and the lists run to the end when each rank takes its
/// actions in order, a receive waiting for its send (a blocking order is reported with each
/// rank's waiting action). Simulates unit costs (forward 1, full backward 2, input and weight
/// backward 1 each, transfers 0) for the idle fractions.
ScheduleCheck validate(const RankActions& actions, int num_stages, int microbatches,
                       const std::vector<int>& rank_of_stage);

/// PyTorch's table: a row per time step of the simulation, a column per rank, computation only
/// (`actions` with or without the transfers).
std::string format_table(const RankActions& actions, int num_stages, int microbatches,
                         const std::vector<int>& rank_of_stage);

/// A schedule as CSV, a row per rank, an action per cell (PyTorch's _dump_csv / _load_csv).
std::string to_csv(const RankActions& actions);
/// Reads to_csv's text; empty cells are skipped. Throws ValueError naming row and cell.
RankActions from_csv(const std::string& text);

}  // namespace ember::dist::pipelining
