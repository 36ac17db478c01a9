// Pipeline schedules as data (schedule.h).
#include <ember/distributed/pipelining/schedule.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <ember/tensor/error.h>

namespace ember::dist::pipelining {

namespace {

using ember::detail::str_cat;

struct KindName {
  ActionKind kind;
  const char* text;
};
// Longest first, so that parsing "SEND_F" is not taken for "F".
constexpr KindName kKinds[] = {{ActionKind::SendF, "SEND_F"}, {ActionKind::RecvF, "RECV_F"},
                               {ActionKind::SendB, "SEND_B"}, {ActionKind::RecvB, "RECV_B"},
                               {ActionKind::Forward, "F"},    {ActionKind::Backward, "B"},
                               {ActionKind::BackwardInput, "I"},
                               {ActionKind::BackwardWeight, "W"}};


int cost(ActionKind k) {
  switch (k) {
    case ActionKind::Forward: return 1;
    case ActionKind::Backward: return 2;
    case ActionKind::BackwardInput: return 1;
    case ActionKind::BackwardWeight: return 1;
    default: return 0;
  }
}

// ---- the schedules' computation ----

std::vector<std::vector<Action>> gpipe(int p, int m) {
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) out[r].push_back({r, ActionKind::Forward, i});
    for (int i = 0; i < m; ++i) out[r].push_back({r, ActionKind::Backward, i});
  }
  return out;
}

std::vector<std::vector<Action>> one_f_one_b(int p, int m) {
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - r - 1, m);
    for (int i = 0; i < warmup; ++i) out[r].push_back({r, ActionKind::Forward, i});
    for (int i = 0; i + warmup < m; ++i) {
      out[r].push_back({r, ActionKind::Forward, warmup + i});
      out[r].push_back({r, ActionKind::Backward, i});
    }
    for (int i = m - warmup; i < m; ++i) out[r].push_back({r, ActionKind::Backward, i});
  }
  return out;
}

// Megatron-LM's interleaved schedule: micro-batches in rounds, each round through every local
// stage in turn (forward: first stage first; backward: last first), depth first. Megatron's
// rounds are of p micro-batches, so m must be a multiple of p; PyTorch's flexible version makes
// max(1, m / p) rounds of m / rounds each, so m must be a multiple of the rounds. Here the
// rounds' sizes may differ by one (the larger first), so any m runs: with m a multiple of p
// this is Megatron's order exactly. The warm-up is Megatron's with the largest round's size for
// p: (v - 1) rounds of forwards for the last rank, two more per rank before it.
std::vector<std::vector<Action>> interleaved(int p, int v, int m) {
  const int rounds = std::max(1, m / p);
  const int base = m / rounds, larger = m % rounds;  // `larger` rounds take base + 1
  // The forward order of one rank's local (chunk, micro-batch) pairs, round by round.
  std::vector<std::pair<int, int>> order;
  for (int k = 0, first = 0; k < rounds; ++k) {
    const int size = base + (k < larger ? 1 : 0);
    for (int c = 0; c < v; ++c) {
      for (int i = 0; i < size; ++i) order.emplace_back(c, first + i);
    }
    first += size;
  }
  const int total = m * v;
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    auto at = [&](int i, bool forward) {
      const auto [c, mb] = order[i];
      return Action{r + (forward ? c : v - 1 - c) * p,
                    forward ? ActionKind::Forward : ActionKind::Backward, mb};
    };
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * (base + (larger > 0 ? 1 : 0)), total);
    for (int i = 0; i < warmup; ++i) out[r].push_back(at(i, true));
    for (int j = 0; j + warmup < total; ++j) {
      out[r].push_back(at(warmup + j, true));
      out[r].push_back(at(j, false));
    }
    for (int j = total - warmup; j < total; ++j) out[r].push_back(at(j, false));
  }
  return out;
}

std::vector<std::vector<Action>> looped_bfs(int p, int v, int m) {
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    for (int k = 0; k < v; ++k) {
      for (int i = 0; i < m; ++i) out[r].push_back({r + k * p, ActionKind::Forward, i});
    }
    for (int k = v - 1; k >= 0; --k) {
      for (int i = 0; i < m; ++i) out[r].push_back({r + k * p, ActionKind::Backward, i});
    }
  }
  return out;
}

// Zero-bubble schedules by list scheduling at unit costs (forward, input and weight backward 1
// each, as ZB-H1 assumes): at each time every free rank takes, among what its inputs allow, an
// input backward first (it is on the way back to stage 0), then a forward while fewer than
// `limit[r]` micro-batches wait for their input backward there (the memory bound), then the
// oldest pending weight backward, which fills what would be a bubble.
std::vector<std::vector<Action>> zero_bubble(ScheduleKind kind, int p, int v, int m) {
  const int S = p * v;
  // The bound counts micro-batches that entered the rank (forwards of its first stage) and
  // whose input backward there is still to come; the forwards of its later stages are never
  // held back. Counting those too would let first-stage forwards fill the bound while the later
  // stage's forward that the oldest micro-batch's backward needs waits for a slot: the schedule
  // then stalls once there are enough micro-batches (4 ranks from 9). A micro-batch in flight
  // holds up to v stages' activations, so the interleaved bound is Megatron's warm-up forwards,
  // (v - 1) p + 2 (p - r - 1) + 1, in micro-batches, plus one: no rank then holds more stage
  // activations than interleaved 1F1B does (docs/pipelining.md). In the V a micro-batch comes
  // back through the rank's second stage before its first stage's backward, and the bound is
  // p: two half-size stages each, the activations 1F1B keeps on its first rank.
  std::vector<int> limit(p);
  for (int r = 0; r < p; ++r) {
    const int forwards = (v - 1) * p + 2 * (p - r - 1) + 1;
    limit[r] = kind == ScheduleKind::ZBV ? p : (forwards + v - 1) / v + 1;
  }
  auto counted = [&](int s) { return s < p; };
  constexpr int kNever = 1 << 30;
  std::vector<std::vector<int>> f_done(S, std::vector<int>(m, kNever)), i_done = f_done;
  std::vector<int> f_next(S, 0), i_next(S, 0), busy(p, 0), in_flight(p, 0);
  std::vector<std::vector<Action>> pending_w(p), out(p);
  int remaining = S * m * 3;
  for (int t = 0; remaining > 0; ++t) {
    EMBER_CHECK(t < 100 * S * m, "[pipelining] ", to_string(kind),
                ": generating the schedule stalled (", p, " ranks, ", v, " stages each, ", m,
                " micro-batches)");
    for (int r = 0; r < p; ++r) {
      if (busy[r] > t) continue;
      std::optional<Action> pick;
      // Input backward: the stage's next micro-batch whose output gradient is there.
      for (int s = S - 1; s >= 0 && !pick; --s) {
        if (stage_rank(kind, s, S, p) != r || i_next[s] >= m) continue;
        const int mb = i_next[s];
        const bool grad_there = s == S - 1 ? f_done[s][mb] <= t : i_done[s + 1][mb] <= t;
        if (f_done[s][mb] <= t && grad_there) pick = Action{s, ActionKind::BackwardInput, mb};
      }
      // Forward: the earliest micro-batch (then the earliest stage) whose input is there.
      if (!pick) {
        int best_mb = kNever;
        for (int s = 0; s < S; ++s) {
          if (stage_rank(kind, s, S, p) != r || f_next[s] >= m) continue;
          if (counted(s) && in_flight[r] >= limit[r]) continue;
          const int mb = f_next[s];
          if ((s == 0 || f_done[s - 1][mb] <= t) && mb < best_mb) {
            best_mb = mb;
            pick = Action{s, ActionKind::Forward, mb};
          }
        }
      }
      if (!pick && !pending_w[r].empty()) {
        pick = pending_w[r].front();
        pending_w[r].erase(pending_w[r].begin());
      }
      if (!pick) continue;
      busy[r] = t + 1;
      --remaining;
      out[r].push_back(*pick);
      if (pick->kind == ActionKind::Forward) {
        f_done[pick->stage][pick->microbatch] = t + 1;
        ++f_next[pick->stage];
        if (counted(pick->stage)) ++in_flight[r];
      } else if (pick->kind == ActionKind::BackwardInput) {
        i_done[pick->stage][pick->microbatch] = t + 1;
        ++i_next[pick->stage];
        if (counted(pick->stage)) --in_flight[r];
        pending_w[r].push_back({pick->stage, ActionKind::BackwardWeight, pick->microbatch});
      }
    }
  }
  return out;
}

}  // namespace

std::string to_string(const Action& a) {
  for (const KindName& k : kKinds) {
    if (k.kind == a.kind) return str_cat(a.stage, k.text, a.microbatch);
  }
  return "?";
}

Action parse_action(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  for (const KindName& k : kKinds) {
    const std::string name = k.text;
    if (i > 0 && text.compare(i, name.size(), name) == 0) {
      const std::string mb = text.substr(i + name.size());
      if (!mb.empty() && std::all_of(mb.begin(), mb.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
        return {std::stoi(text.substr(0, i)), k.kind, std::stoi(mb)};
      }
    }
  }
  throw ValueError(str_cat("[pipelining] cannot read the action '", text,
                           "': expected stage, kind (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B) "
                           "and micro-batch, as in 0F3 or 1RECV_B2"));
}

std::string to_string(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::GPipe: return "gpipe";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved1F1B: return "interleaved-1f1b";
    case ScheduleKind::LoopedBFS: return "looped-bfs";
    case ScheduleKind::InterleavedZeroBubble: return "zero-bubble";
    case ScheduleKind::ZBV: return "zbv";
  }
  return "?";
}

ScheduleKind parse_schedule(const std::string& name) {
  for (ScheduleKind k : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B,
                         ScheduleKind::LoopedBFS, ScheduleKind::InterleavedZeroBubble,
                         ScheduleKind::ZBV}) {
    if (to_string(k) == name) return k;
  }
  throw ValueError(str_cat("[pipelining] unknown schedule '", name,
                           "': expected gpipe, 1f1b, interleaved-1f1b, looped-bfs, zero-bubble "
                           "or zbv"));
}

int default_stages_per_rank(ScheduleKind k) {
  return k == ScheduleKind::GPipe || k == ScheduleKind::OneFOneB ? 1 : 2;
}

int stage_rank(ScheduleKind k, int stage, int num_stages, int ranks) {
  if (k == ScheduleKind::ZBV) return stage < ranks ? stage : num_stages - 1 - stage;
  return stage % ranks;
}

RankActions compute_actions(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches) {
  const std::string name = to_string(kind);
  EMBER_CHECK(ranks >= 1 && stages_per_rank >= 1 && microbatches >= 1, "[pipelining] ", name,
              ": expected at least one rank, stage per rank and micro-batch, got ", ranks, ", ",
              stages_per_rank, " and ", microbatches);
  switch (kind) {
    case ScheduleKind::GPipe:
    case ScheduleKind::OneFOneB:
      EMBER_CHECK(stages_per_rank == 1, "[pipelining] ", name,
                  " runs one stage per rank, got ", stages_per_rank,
                  " (interleaved-1f1b, looped-bfs, zero-bubble and zbv run several)");
      return kind == ScheduleKind::GPipe ? gpipe(ranks, microbatches)
                                         : one_f_one_b(ranks, microbatches);
    case ScheduleKind::Interleaved1F1B:
      return interleaved(ranks, stages_per_rank, microbatches);
    case ScheduleKind::LoopedBFS:
      return looped_bfs(ranks, stages_per_rank, microbatches);
    case ScheduleKind::InterleavedZeroBubble:
      return zero_bubble(kind, ranks, stages_per_rank, microbatches);
    case ScheduleKind::ZBV:
      EMBER_CHECK(stages_per_rank == 2, "[pipelining] zbv runs exactly two stages per rank, got ",
                  stages_per_rank);
      return zero_bubble(kind, ranks, 2, microbatches);
  }
  return {};
}

RankActions add_communication(const RankActions& compute, const std::vector<int>& rank_of_stage) {
  const int S = static_cast<int>(rank_of_stage.size());
  RankActions out(compute.size());
  for (size_t r = 0; r < compute.size(); ++r) {
    const int me = static_cast<int>(r);
    for (const Action& a : compute[r]) {
      const bool fwd = a.kind == ActionKind::Forward;
      const bool back = a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput;
      if (fwd && a.stage > 0 && rank_of_stage[a.stage - 1] != me) {
        out[r].push_back({a.stage, ActionKind::RecvF, a.microbatch});
      }
      if (back && a.stage < S - 1 && rank_of_stage[a.stage + 1] != me) {
        out[r].push_back({a.stage, ActionKind::RecvB, a.microbatch});
      }
      out[r].push_back(a);
      if (fwd && a.stage < S - 1 && rank_of_stage[a.stage + 1] != me) {
        out[r].push_back({a.stage, ActionKind::SendF, a.microbatch});
      }
      if (back && a.stage > 0 && rank_of_stage[a.stage - 1] != me) {
        out[r].push_back({a.stage, ActionKind::SendB, a.microbatch});
      }
    }
  }
  return out;
}

namespace {

// The simulation behind validate() and format_table(): runs every rank's list in order, a
// receive waiting for its send; records each computation's start.
struct Simulation {
  ScheduleCheck check;
  std::vector<std::vector<std::pair<int, Action>>> starts;  // per rank: (start, action)
};

Simulation simulate(const RankActions& actions, int S, int m, const std::vector<int>& rank_of) {
  Simulation sim;
  ScheduleCheck& c = sim.check;
  const int p = static_cast<int>(actions.size());
  sim.starts.resize(p);
  auto fail = [&](std::string why) {
    if (c.ok) {
      c.ok = false;
      c.error = std::move(why);
    }
  };
  EMBER_CHECK(static_cast<int>(rank_of.size()) == S, "[pipelining] validate: expected the rank of each of ",
              S, " stages, got ", rank_of.size());
  // Every action's stage and micro-batch in range and on its rank; sends and receives paired.
  std::map<std::tuple<int, int, int>, int> sends;  // (kind F/B, sending stage, mb) -> rank
  std::set<std::tuple<int, int, int>> recvs;
  for (int r = 0; r < p && c.ok; ++r) {
    for (const Action& a : actions[r]) {
      if (a.stage < 0 || a.stage >= S || a.microbatch < 0 || a.microbatch >= m) {
        fail(str_cat("rank ", r, "'s action ", to_string(a), " names a stage or micro-batch out of range (",
                     S, " stages, ", m, " micro-batches)"));
        break;
      }
      if (rank_of[a.stage] != r) {
        fail(str_cat("rank ", r, " runs ", to_string(a), " but stage ", a.stage, " is on rank ",
                     rank_of[a.stage]));
        break;
      }
      if (a.kind == ActionKind::SendF) sends[{0, a.stage, a.microbatch}] = r;
      if (a.kind == ActionKind::SendB) sends[{1, a.stage, a.microbatch}] = r;
      if (a.kind == ActionKind::RecvF) recvs.insert({0, a.stage - 1, a.microbatch});
      if (a.kind == ActionKind::RecvB) recvs.insert({1, a.stage + 1, a.microbatch});
    }
  }
  for (const auto& [key, r] : sends) {
    if (!c.ok) break;
    const auto [dir, s, mb] = key;
    if (!recvs.count(key)) {
      const Action want{dir == 0 ? s + 1 : s - 1, dir == 0 ? ActionKind::RecvF : ActionKind::RecvB, mb};
      const int peer = want.stage >= 0 && want.stage < S ? rank_of[want.stage] : -1;
      fail(str_cat("rank ", r, " sends ", to_string(Action{s, dir == 0 ? ActionKind::SendF : ActionKind::SendB, mb}),
                   " but rank ", peer, " never receives it (", to_string(want), ")"));
    }
  }
  for (const auto& key : recvs) {
    if (!c.ok) break;
    if (!sends.count(key)) {
      const auto [dir, s, mb] = key;
      const Action recv{dir == 0 ? s + 1 : s - 1, dir == 0 ? ActionKind::RecvF : ActionKind::RecvB, mb};
      const Action send{s, dir == 0 ? ActionKind::SendF : ActionKind::SendB, mb};
      fail(str_cat("rank ", rank_of[recv.stage], " waits for ", to_string(recv), " but rank ",
                   rank_of[s], " never sends it (", to_string(send), ")"));
    }
  }
  if (!c.ok) return sim;
  // Run.
  std::vector<size_t> next(p, 0);
  std::vector<int> clock(p, 0), busy(p, 0);
  std::map<std::tuple<int, int, int>, int> sent_at;
  std::set<std::tuple<int, int>> input, grad, fwd, back_in, full;  // (stage, mb) per fact
  std::set<std::tuple<int, int>> weight;
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p && c.ok; ++r) {
      while (next[r] < actions[r].size() && c.ok) {
        const Action& a = actions[r][next[r]];
        const std::tuple<int, int> sm{a.stage, a.microbatch};
        const std::string what = str_cat("rank ", r, " runs ", to_string(a));
        if (a.kind == ActionKind::RecvF || a.kind == ActionKind::RecvB) {
          const bool f = a.kind == ActionKind::RecvF;
          auto it = sent_at.find({f ? 0 : 1, f ? a.stage - 1 : a.stage + 1, a.microbatch});
          if (it == sent_at.end()) break;  // waits
          clock[r] = std::max(clock[r], it->second);
          (f ? input : grad).insert(sm);
        } else if (a.kind == ActionKind::SendF || a.kind == ActionKind::SendB) {
          const bool f = a.kind == ActionKind::SendF;
          if (!(f ? fwd.count(sm) : (full.count(sm) || back_in.count(sm)))) {
            fail(str_cat(what, " before the ", f ? "forward" : "backward", " that produces it"));
            break;
          }
          sent_at[{f ? 0 : 1, a.stage, a.microbatch}] = clock[r];
        } else {
          if (a.kind == ActionKind::Forward) {
            if (fwd.count(sm)) { fail(str_cat(what, " twice")); break; }
            if (a.stage > 0 && !input.count(sm)) {
              fail(str_cat(what, " before it has its input (", to_string(Action{a.stage, ActionKind::RecvF, a.microbatch}),
                           " or ", to_string(Action{a.stage - 1, ActionKind::Forward, a.microbatch}), " on this rank)"));
              break;
            }
            fwd.insert(sm);
            if (a.stage + 1 < S && rank_of[a.stage + 1] == r) input.insert({a.stage + 1, a.microbatch});
          } else if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) {
            if (full.count(sm) || back_in.count(sm)) { fail(str_cat(what, " twice")); break; }
            if (!fwd.count(sm)) { fail(str_cat(what, " before its forward")); break; }
            if (a.stage < S - 1 && !grad.count(sm)) {
              fail(str_cat(what, " before it has its output's gradient"));
              break;
            }
            (a.kind == ActionKind::Backward ? full : back_in).insert(sm);
            if (a.stage > 0 && rank_of[a.stage - 1] == r) grad.insert({a.stage - 1, a.microbatch});
          } else {
            if (!back_in.count(sm)) { fail(str_cat(what, " before its input backward (", to_string(Action{a.stage, ActionKind::BackwardInput, a.microbatch}), ")")); break; }
            if (weight.count(sm)) { fail(str_cat(what, " twice")); break; }
            weight.insert(sm);
          }
          sim.starts[r].push_back({clock[r], a});
          clock[r] += cost(a.kind);
          busy[r] += cost(a.kind);
        }
        ++next[r];
        progress = true;
      }
    }
  }
  if (!c.ok) return sim;
  std::string stuck;
  for (int r = 0; r < p; ++r) {
    if (next[r] < actions[r].size()) {
      stuck += str_cat(stuck.empty() ? "" : "; ", "rank ", r, " waits at ", to_string(actions[r][next[r]]));
    }
  }
  if (!stuck.empty()) {
    fail(str_cat("the schedule blocks: ", stuck));
    return sim;
  }
  for (int s = 0; s < S && c.ok; ++s) {
    for (int mb = 0; mb < m && c.ok; ++mb) {
      const std::tuple<int, int> sm{s, mb};
      if (!fwd.count(sm)) fail(str_cat("stage ", s, " never runs forward for micro-batch ", mb));
      else if (!full.count(sm) && !(back_in.count(sm) && weight.count(sm)))
        fail(str_cat("stage ", s, " never completes backward for micro-batch ", mb,
                     back_in.count(sm) ? " (no weight backward after its input backward)" : ""));
    }
  }
  c.steps = *std::max_element(clock.begin(), clock.end());
  for (int r = 0; r < p; ++r) c.idle.push_back(c.steps == 0 ? 0.0 : 1.0 - static_cast<double>(busy[r]) / c.steps);
  return sim;
}

}  // namespace

ScheduleCheck validate(const RankActions& actions, int num_stages, int microbatches,
                       const std::vector<int>& rank_of_stage) {
  return simulate(actions, num_stages, microbatches, rank_of_stage).check;
}

std::string format_table(const RankActions& actions, int num_stages, int microbatches,
                         const std::vector<int>& rank_of_stage) {
  bool transfers = false;
  for (const auto& row : actions) {
    for (const Action& a : row) transfers = transfers || cost(a.kind) == 0;
  }
  Simulation sim = simulate(transfers ? actions : add_communication(actions, rank_of_stage),
                            num_stages, microbatches, rank_of_stage);
  EMBER_CHECK(sim.check.ok, "[pipelining] format_table: the schedule is not valid: ", sim.check.error);
  const int p = static_cast<int>(actions.size());
  std::vector<std::vector<std::string>> cells(sim.check.steps, std::vector<std::string>(p));
  for (int r = 0; r < p; ++r) {
    for (const auto& [t, a] : sim.starts[r]) {
      for (int k = 0; k < cost(a.kind); ++k) cells[t + k][r] = to_string(a);
    }
  }
  std::ostringstream os;
  os << "Step";
  for (int r = 0; r < p; ++r) os << "\tRank " << r;
  os << "\n";
  for (int t = 0; t < sim.check.steps; ++t) {
    os << t;
    for (int r = 0; r < p; ++r) os << "\t" << cells[t][r];
    os << "\n";
  }
  return os.str();
}

std::string to_csv(const RankActions& actions) {
  std::ostringstream os;
  for (const auto& row : actions) {
    for (size_t i = 0; i < row.size(); ++i) os << (i ? "," : "") << to_string(row[i]);
    os << "\n";
  }
  return os.str();
}

RankActions from_csv(const std::string& text) {
  RankActions out;
  std::istringstream in(text);
  std::string line;
  for (int row = 0; std::getline(in, line); ++row) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<Action> actions;
    std::istringstream cells(line);
    std::string cell;
    for (int col = 0; std::getline(cells, cell, ','); ++col) {
      cell.erase(0, cell.find_first_not_of(" \t"));
      cell.erase(cell.find_last_not_of(" \t") + 1);
      if (cell.empty()) continue;
      try {
        actions.push_back(parse_action(cell));
      } catch (const ValueError& e) {
        throw ValueError(str_cat("[pipelining] from_csv: row ", row, " (rank ", row, "), cell ", col, ": ", e.what()));
      }
    }
    out.push_back(std::move(actions));
  }
  return out;
}

}  // namespace ember::dist::pipelining
