// Gradient compression hooks for slow links: int8 quantization, 1-bit (sign) compression and
// top-k sparsification, each with error feedback, and a wrapper that compresses only between
// nodes while the ranks of a node reduce exactly.
//
//   auto state = std::make_shared<dist::CompressionState>(dist::CompressionOptions{
//       .error_feedback = true, .start_iter = 10});
//   ddp.register_comm_hook(state, dist::sign_compress_hook, "sign");
//   ...
//   state->stats().ratio;            // bytes an all-reduce would have sent / bytes sent
//   state->state_dict();             // residuals and counters, for a checkpoint
//
// Three schemes, all on CPU buckets of any floating dtype (computed in float32):
//
// - quantization_pertensor_hook / quantization_perchannel_hook: PyTorch's hooks of those names
//   (ddp_comm_hooks.quantization_hooks, CUDA-only there): every rank quantizes its bucket to
//   uint8 with its own affine parameters (torch's MinMaxObserver / PerChannelMinMaxObserver,
//   quint8), the quantized buckets are all-gathered and each rank dequantizes and averages them.
//   The same arithmetic as torch, in one all-gather where torch runs two in sequence (the
//   parameters ride in front of the bytes). A rank sends (W-1) x its bucket's bytes / 4: 4x
//   fewer bytes than an all-reduce at 2 ranks, 2x at 4, and worse beyond (all-gather's cost
//   grows with W); use int8_compress_hook there.
//
// - int8_compress_hook and sign_compress_hook: a compressed all-reduce. The bucket (plus this
//   rank's residual) is cut into W chunks and each chunk compressed: int8 with per-channel
//   parameters (512 elements a channel), sign with one bit an element and one scale per 512
//   elements (their mean magnitude: the least-squares scale, EF-signSGD's). The messages are
//   exchanged one of two ways (CompressionOptions::exchange):
//   - two phases (the scheme of DeepSpeed's 1-bit Adam): an all-to-all hands chunk c of every
//     rank to rank c, which decodes and averages them, adds its own residual for that chunk,
//     compresses the average again and all-gathers it. Each rank sends 2 (W-1)/W of its bucket
//     compressed, like a ring all-reduce sends it uncompressed: int8 ~4x fewer bytes than the
//     all-reduce at any W, sign ~30x. The average is compressed twice.
//   - one all-gather: every rank's compressed chunks go to every rank, which decodes and
//     averages them. Each rank sends (W-1) times its compressed bucket, and the average is
//     compressed once, the workers' error only. At 2 ranks (or 2 node leaders, under
//     compress_across_nodes) that is the same bytes as two phases, in one round instead of
//     two, and it is the default there; beyond, it sends W/2 times more than two phases.
//   The second compression costs accuracy: sign trains measurably closer to plain all-reduce
//   with the all-gather (docs/ddp.md has the numbers).
//
// - topk_compress_hook: the k = ceil(ratio * numel) largest-magnitude entries of bucket plus
//   residual are sent as (int32 index, float32 value) pairs, all-gathered, summed into a zero
//   bucket and averaged; a rank sends (W-1) 8k bytes.
//
// Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what a rank did not send this
// step (its input minus the decoded message it sent) is added to its next step's input, so no
// gradient is lost, only delayed. The residuals are kept per bucket (keyed by the bucket's
// parameter set, stable across DDP's bucket rebuild) and are part of state_dict().
//
// compress_across_nodes(inner, local, leaders): the bucket is averaged exactly inside the node
// onto its leader (a reduce over the local group, shared memory where the node's ranks share a
// machine), the node leaders run `inner` over the leaders' group, and each leader broadcasts the
// result inside its node. Only compressed bytes cross the network.
//
// Every collective is issued from DDP's threads in bucket order (second phases through
// GradBucket::defer, Note [comm hook ordering] in comm_hooks.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/nn/module.h>

namespace ember::dist {

/// How int8_compress_hook and sign_compress_hook exchange their messages (see the file comment).
enum class CompressedExchange : int {
  /// kAllGather at 2 ranks, where it sends the same bytes as kTwoPhase; kTwoPhase beyond.
  kAuto = 0,
  /// All-to-all, a compressed average per chunk, all-gather: 2 (W-1)/W of the bucket per rank.
  kTwoPhase = 1,
  /// Every rank's compressed bucket to every rank, averaged there: (W-1) buckets per rank.
  kAllGather = 2,
};

/// Hyperparameters of the compressing hooks with state.
struct CompressionOptions {
  /// Add what a rank did not send last step to its next input (see the file comment).
  bool error_feedback = true;
  /// Iterations (backward passes) of plain all-reduce first (as PowerSGD's start_powerSGD_iter
  /// and 1-bit Adam's warm-up): compressing from the first step slows early training.
  int64_t start_iter = 0;
  /// int8_compress_hook: elements that share one scale and zero point.
  int64_t channel_size = 512;
  /// sign_compress_hook: elements that share one scale, a positive multiple of 8.
  int64_t sign_block = 512;
  /// topk_compress_hook: the fraction of a bucket's elements sent, in (0, 1].
  double topk_ratio = 0.01;
  /// int8, sign and top-k, in [0, 1): momentum applied before compression, as in blockwise
  /// momentum SGD with error feedback (Zheng et al., NeurIPS 2019) and 1-bit Adam. Each rank
  /// keeps its local velocity u = momentum u + g and compresses u (plus its residual) instead of
  /// g. The ranks' velocities average to the velocity of the averaged gradient, so the hook
  /// returns momentum SGD's step, delayed only by what the residual holds; applied after
  /// compression, momentum would amplify the residual's delayed coordinates instead. The
  /// optimizer must then run WITHOUT momentum (SGD momentum 0). During warm-up the velocity
  /// follows the averaged gradient. 0: off.
  double momentum = 0;
  /// topk_compress_hook with momentum: Deep Gradient Compression's momentum factor masking (Lin
  /// et al., ICLR 2018), which clears the velocity of every coordinate sent.
  bool momentum_masking = false;
  /// int8_compress_hook and sign_compress_hook: two phases or one all-gather.
  CompressedExchange exchange = CompressedExchange::kAuto;
};

/// Whether int8_compress_hook and sign_compress_hook all-gather over `world` ranks with `how`.
bool exchanges_by_allgather(CompressedExchange how, int world);

/// State of int8_compress_hook, sign_compress_hook and topk_compress_hook: the iteration count,
/// the residuals of error feedback, and what was sent. One state per DDP (its buckets share it).
/// Threads: used by the hooks on DDP's threads; read it between iterations.
class CompressionState {
 public:
  /// Throws ValueError for start_iter < 0, channel_size < 1, topk_ratio outside (0, 1], momentum
  /// outside [0, 1), or momentum_masking without momentum.
  explicit CompressionState(CompressionOptions options = {});

  const CompressionOptions& options() const { return options_; }
  /// Iterations seen so far (incremented when the last bucket of an iteration is hooked).
  int64_t iteration() const { return iter_; }

  struct Stats {
    /// Buckets compressed so far (not counting warm-up all-reduces).
    int64_t buckets = 0;
    /// Bytes this rank sent for them: every message times the ranks it reaches, as a ring or
    /// direct exchange moves it (all-to-all: W-1 chunks; all-gather: W-1 copies).
    int64_t bytes_sent = 0;
    /// Bytes a ring all-reduce of the same buckets in float32 would have sent: 2 (W-1)/W each.
    int64_t allreduce_bytes = 0;
    /// allreduce_bytes / bytes_sent (0 before any compressed bucket).
    double ratio = 0;
  };
  Stats stats() const;

  /// The worker residual of the bucket with GradBucket::key() `key` (float32, the bucket's
  /// numel rounded up to a multiple of W for the two-phase hooks), or an undefined tensor.
  Tensor residual(const std::string& key) const;

  /// Everything needed to continue identically after a restart: "iteration", the statistics,
  /// the options ("option.<name>"), and "residual.<key>" / "server_residual.<key>" /
  /// "velocity.<key>" per bucket.
  /// Copies, safe to save with nn::save_safetensors.
  nn::NamedTensors state_dict() const;
  /// Restores what state_dict() returned (options too). Throws ValueError naming an entry it does
  /// not know or a missing "iteration".
  void load_state_dict(const nn::NamedTensors& state);

  /// For the hooks (compression_hooks.cpp): whether this bucket still takes a plain all-reduce,
  /// bumping the iteration on the last bucket.
  bool warming_up(const GradBucket& bucket);
  /// For the hooks: the residual tensors of `key` (created as zeros of `numel` elements, or
  /// re-created if the bucket's size changed).
  Tensor& worker_residual(const std::string& key, int64_t numel);
  Tensor& server_residual(const std::string& key, int64_t numel);
  /// For the hooks with options().momentum: the velocity of `key`.
  Tensor& velocity(const std::string& key, int64_t numel);
  void count(int64_t bytes_sent, int64_t allreduce_bytes);

 private:
  CompressionOptions options_;
  int64_t iter_ = 0;
  Stats stats_;
  std::map<std::string, Tensor> worker_;
  std::map<std::string, Tensor> server_;
  std::map<std::string, Tensor> velocity_;
};

/// PyTorch's quantization_pertensor_hook (one scale and zero point per rank and bucket).
std::shared_ptr<Future> quantization_pertensor_hook(GradBucket& bucket);
/// PyTorch's quantization_perchannel_hook: a scale and zero point per 512 elements.
std::shared_ptr<Future> quantization_perchannel_hook(GradBucket& bucket);

/// int8 compressed all-reduce (per-channel parameters, options().channel_size).
std::shared_ptr<Future> int8_compress_hook(CompressionState& state, GradBucket& bucket);
/// 1-bit compressed all-reduce: signs and one scale per options().sign_block elements.
std::shared_ptr<Future> sign_compress_hook(CompressionState& state, GradBucket& bucket);
/// Top-k sparsification (options().topk_ratio), all-gathered indices and values.
std::shared_ptr<Future> topk_compress_hook(CompressionState& state, GradBucket& bucket);

/// Reduces exactly inside the node and runs `inner` between nodes only (see the file comment).
/// `local`: this rank's node group (its rank 0 the leader); `leaders`: the group of node leaders
/// (null on ranks that are not their node's leader). The result is averaged over every rank,
/// also when nodes have different numbers of ranks (each leader weighs its node's mean by its
/// share of the ranks, counted among the leaders at the first bucket: one scalar all-reduce).
/// Throws ValueError if `local` or `inner` is null, or `leaders` is given on a non-leader or
/// missing on a leader.
CommHook compress_across_nodes(CommHook inner, std::shared_ptr<ProcessGroup> local,
                               std::shared_ptr<ProcessGroup> leaders);

}  // namespace ember::dist

namespace ember::dist::codec {

// The encodings on the wire, exposed for tests and for users who build their own hooks. A
// message for m elements holds a header (parameters) and a payload; decode_add adds the decoded
// values to acc[0, m); decode_range writes decoded elements [first, first + count) to
// out[0, count), the bits decode_add adds to zeros (a hook decodes straight into a bucket's
// pieces with it), and throws ValueError for a range past m. encode with `residual` (m floats)
// also stores there x minus what the message decodes to, exactly (error feedback).

/// uint8 affine quantization with one scale and zero point (two float32 each) per `channel`
/// elements (the last channel may be shorter), torch's quint8 MinMaxObserver arithmetic.
int64_t int8_bytes(int64_t m, int64_t channel);
void int8_encode(const float* x, int64_t m, int64_t channel, uint8_t* out,
                 float* residual = nullptr);
void int8_decode_add(const uint8_t* in, int64_t m, int64_t channel, float* acc);
void int8_decode_range(const uint8_t* in, int64_t m, int64_t channel, int64_t first, int64_t count,
                       float* out);

/// One float32 scale (the mean of |x|) per `block` elements (the last block may be shorter),
/// then one bit per element (1: x >= 0). `block` is a positive multiple of 8, so that each
/// block's bits start on a byte.
int64_t sign_bytes(int64_t m, int64_t block);
void sign_encode(const float* x, int64_t m, int64_t block, uint8_t* out,
                 float* residual = nullptr);
void sign_decode_add(const uint8_t* in, int64_t m, int64_t block, float* acc);
void sign_decode_range(const uint8_t* in, int64_t m, int64_t block, int64_t first, int64_t count,
                       float* out);

/// topk_compress_hook's choice: the indices of the k largest |x[i]| of n, increasing. A NaN
/// counts as the largest magnitude; ties go to the lower index, so every rank and every run
/// picks the same. Throws ValueError for k outside [1, n].
std::vector<int32_t> topk_indices(const float* x, int64_t n, int64_t k);

}  // namespace ember::dist::codec
