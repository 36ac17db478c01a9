// The options and statistics of DistributedDataParallel (ddp.h), apart so that its reducer and
// join rounds (ddp/detail/) can use them without including the module itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ember::dist {

/// Options of DistributedDataParallel (torch's constructor arguments of the same names).
struct DDPOptions {
  /// Bucket size in MiB (a bucket closes once it holds at least this much).
  double bucket_cap_mb = 25;
  /// Size in MiB of the first bucket of each dtype and device (reduced first, so communication
  /// starts early); capped at bucket_cap_mb. torch's dist._DEFAULT_FIRST_BUCKET_BYTES.
  double first_bucket_cap_mb = 1;
  /// Copy rank 0's buffers to every rank at the start of each training-mode forward.
  bool broadcast_buffers = true;
  /// After the first reduction, grad() of each parameter is a view into its bucket's flat
  /// buffer (saves one copy and the memory of the gradients).
  bool gradient_as_bucket_view = false;
  /// Parameters that get no gradient in an iteration contribute zeros instead of raising an
  /// error; a parameter that no rank used keeps its grad() untouched.
  bool find_unused_parameters = false;
  /// The model uses the same parameters in every iteration. The first synchronised iteration
  /// finds the parameters that get no gradient (like find_unused_parameters, whose value is then
  /// ignored); later iterations mark those ready at the first gradient, so their buckets launch
  /// during backward, and skip the extra all-reduce. A later iteration whose set of parameters
  /// with gradients differs throws ValueError naming them. Buckets are rebuilt (unlike with
  /// find_unused_parameters alone).
  bool static_graph = false;
  /// Parameters (named as module->named_parameters() names them) that DDP leaves alone: not
  /// checked, broadcast or reduced (torch's _set_params_and_buffers_to_ignore_for_model), e.g.
  /// the experts each rank holds under expert parallelism (expert_parallel.h). A name that is no
  /// parameter of the module is a ValueError.
  std::vector<std::string> ignored_parameters;
};

/// Options of DistributedDataParallel::join (torch's DistributedDataParallel.join arguments).
struct JoinOptions {
  /// While some ranks have joined, divide the summed gradients by the initial world size (true,
  /// torch's default: every sample weighs the same) or by the number of ranks that still have
  /// data (false: like training on fewer ranks). Ignored with a communication hook (the hook
  /// divides as it likes, as in torch).
  bool divide_by_initial_world_size = true;
  /// false: join() just runs the body (the inputs are known to be even; no extra all-reduce).
  bool enable = true;
  /// Throw DistError on every rank at the first iteration in which some rank has run out of
  /// data, instead of carrying on with fewer ranks (needed when the loop runs collectives DDP
  /// does not know about, e.g. SyncBatchNorm).
  bool throw_on_early_termination = false;
};

/// What one DistributedDataParallel did (torch's DDP logging data,
/// `ddp._get_ddp_logging_data()`), from DistributedDataParallel::stats(): its configuration,
/// bucket layout and per-iteration timings, on this rank.
struct DDPStats {
  /// A phase's time in one synchronised iteration, in milliseconds.
  struct Timing {
    double last_ms = 0;  ///< in the last synchronised iteration
    double mean_ms = 0;  ///< over every synchronised iteration so far
  };
  int world_size = 0;
  int rank = 0;
  std::string backend;
  /// The registered communication hook's name ("allreduce", "fp16_compress", "bf16_compress",
  /// "noop", the name given to register_comm_hook, or "custom"); empty without a hook.
  std::string comm_hook;
  double bucket_cap_mb = 0;
  bool find_unused_parameters = false;
  bool static_graph = false;
  bool gradient_as_bucket_view = false;
  int64_t parameters = 0;  ///< parameters synchronised (those requiring grad)
  int64_t bucket_count = 0;
  std::vector<int64_t> bucket_bytes;  ///< each bucket's flat buffer, in reduction order
  int64_t rebuilds = 0;               ///< bucket rebuilds so far (at most one)
  int64_t unused_parameters = 0;      ///< no rank used them in the last synchronised iteration
  int64_t iterations = 0;             ///< synchronised iterations timed
  /// Bytes this rank sent for the gradients in the last synchronised iteration, per bucket in
  /// reduction order and in all: DDP's own all-reduce counted as a ring moves it (2 (W-1)/W of
  /// the bucket), a hook's as it records them (GradBucket::record_bytes_sent; every built-in
  /// hook does). -1 where a hook did not record (bytes_sent then -1 too).
  std::vector<int64_t> bucket_bytes_sent;
  int64_t bytes_sent = 0;
  /// What a ring all-reduce of every bucket sends: bytes_sent without compression.
  int64_t allreduce_bytes = 0;
  /// allreduce_bytes / bytes_sent summed over every iteration whose bytes were known (0 if
  /// none was, or nothing was sent): how much less a compressing hook sends.
  double compression_ratio = 0;
  /// Forward: the module's forward. Backward: from the end of forward to the end of the
  /// autograd pass. Communication: from the first bucket's launch until every bucket was
  /// reduced; overlapped_communication: its part before backward ended; exposed_communication:
  /// the time the end of backward waited for it (what communication added to the step).
  Timing forward, backward, communication, overlapped_communication, exposed_communication;
};

}  // namespace ember::dist
