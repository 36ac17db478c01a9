#include <ember/distributed/debug/debug.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>

#include <ember/tensor/ops/creation.h>

namespace ember::dist {

DebugLevel debug_level() {
  const char* env = std::getenv("EMBER_DISTRIBUTED_DEBUG");
  if (env == nullptr) return DebugLevel::Off;
  std::string v(env);
  std::transform(v.begin(), v.end(), v.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (v.empty() || v == "OFF") return DebugLevel::Off;
  if (v == "INFO") return DebugLevel::Info;
  if (v == "DETAIL") return DebugLevel::Detail;
  throw ValueError(
      detail::str_cat("[EMBER_DISTRIBUTED_DEBUG] expected OFF, INFO or DETAIL, got '", env, "'"));
}

namespace {

// The fingerprint of one collective: fixed length, so the check itself can never mismatch.
enum Slot { kSeq, kKind, kDtype, kNumel, kRoot, kOp, kNdim, kDims, kLen = kDims + 8 };
constexpr int kMaxDims = 8;  // more dims: the last slot holds a hash of the rest

std::string describe(const int64_t* f) {
  std::ostringstream os;
  os << to_string(static_cast<OpType>(f[kKind])) << "(";
  if (f[kDtype] >= 0) {
    os << static_cast<Dtype>(f[kDtype]) << " [";
    const int64_t nd = f[kNdim];
    for (int64_t d = 0; d < std::min<int64_t>(nd, kMaxDims); ++d) {
      os << (d ? ", " : "") << (d == kMaxDims - 1 && nd > kMaxDims ? "#" : "") << f[kDims + d];
    }
    os << "]";
  }
  if (f[kRoot] >= 0) os << ", root " << f[kRoot];
  if (f[kOp] >= 0) os << ", " << to_string(static_cast<ReduceOp>(f[kOp]));
  os << ")";
  return os.str();
}

// The check's all-gather failed (another rank issued something else, left the group, or is
// busy elsewhere): the same error, of the same type, prefixed with what this rank was about to
// issue, so that the message names the collective the caller issued and not only the check's.
[[noreturn]] void rethrow_check_failure(const DistError& e, const std::string& prefix) {
  const std::string msg = prefix + e.what();
  if (dynamic_cast<const DistTimeoutError*>(&e)) throw DistTimeoutError(msg);
  if (dynamic_cast<const DistBackendError*>(&e)) throw DistBackendError(msg);
  if (dynamic_cast<const DistNetworkError*>(&e)) throw DistNetworkError(msg);
  if (dynamic_cast<const DistStoreError*>(&e)) throw DistStoreError(msg);
  throw DistError(msg);
}

}  // namespace

CheckedProcessGroup::CheckedProcessGroup(std::shared_ptr<ProcessGroup> inner)
    : ForwardingProcessGroup(std::move(inner), "CheckedProcessGroup") {}

void CheckedProcessGroup::check(OpType kind, const Tensor& t, int root, int op) {
  const uint64_t seq = seq_++;
  std::vector<int64_t> f(kLen, -1);
  f[kSeq] = static_cast<int64_t>(seq);
  f[kKind] = static_cast<int64_t>(kind);
  f[kRoot] = root;
  f[kOp] = op;
  if (t.defined()) {
    f[kDtype] = static_cast<int64_t>(t.dtype());
    f[kNumel] = t.numel();
    f[kNdim] = t.dim();
    uint64_t rest = 1469598103934665603ull;  // FNV-1a over the dims that do not fit
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (d < kMaxDims - 1 || t.dim() <= kMaxDims) {
        f[kDims + d] = t.size(d);
      } else {
        rest = (rest ^ static_cast<uint64_t>(t.size(d))) * 1099511628211ull;
        f[kDims + kMaxDims - 1] = static_cast<int64_t>(rest >> 1);
      }
    }
  }
  if (size_ == 1) return;
  const Device device = t.defined() ? t.device() : inner_->default_device();
  Tensor mine = from_vector(f);
  if (!device.is_cpu()) mine = mine.to(device);
  Tensor all = zeros({static_cast<int64_t>(size_) * kLen}, kInt64);
  if (!device.is_cpu()) all = all.to(device);
  try {
    inner_->allgather_into_tensor(all, mine)->wait();
  } catch (const DistError& e) {
    rethrow_check_failure(e, detail::str_cat("[CheckedProcessGroup] rank ", rank_, " of ", size_,
                                             ": the check before its collective #", seq, ", ",
                                             describe(f.data()), ", failed: "));
  }
  const std::vector<int64_t> v = all.cpu().to_vector<int64_t>();
  // The first rank that differs from rank 0 (every rank finds the same pair).
  for (int r = 1; r < size_; ++r) {
    if (std::equal(v.begin(), v.begin() + kLen, v.begin() + r * kLen)) continue;
    const int64_t* a = v.data();
    const int64_t* b = v.data() + r * kLen;
    std::string hint;
    if (a[kSeq] != b[kSeq]) {
      hint =
          " (they have issued different numbers of collectives: one rank issued a collective "
          "the other did not)";
    } else if (a[kKind] == b[kKind] && a[kDtype] == b[kDtype]) {
      hint =
          " (same collective, different tensors: check that every rank wraps the same model "
          "with the same options, e.g. bucket_cap_mb, and feeds tensors of the same shape)";
    }
    throw DistError(detail::str_cat(
        "[CheckedProcessGroup] collective #", a[kSeq], " on rank ", rank_, " of ", size_,
        " differs across ranks: rank 0 called ", describe(a), " (its collective #", a[kSeq],
        ") but rank ", r, " called ", describe(b), " (its collective #", b[kSeq], ")",
        "\n  Every rank must issue the same collectives in the same order "
        "(EMBER_DISTRIBUTED_DEBUG=DETAIL check)", hint));
  }
}

WorkPtr CheckedProcessGroup::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  check(OpType::Allreduce, tensor, -1, static_cast<int>(opts.op));
  return inner_->allreduce(tensor, opts);
}
WorkPtr CheckedProcessGroup::allreduce_coalesced(std::vector<Tensor>& tensors,
                                                 const AllreduceOptions& opts) {
  check_coalesced(backend_name().c_str(), tensors);
  int64_t total = 0;
  for (const Tensor& t : tensors) total += t.numel();
  // Checked as the allreduce of the concatenation (one element expanded, no copy, to the
  // total), which is what it is on every backend: so a rank whose bucket all-reduces its
  // gradients in place matches a joined rank all-reducing a flat buffer of zeros.
  check(OpType::Allreduce, empty({1}, tensors[0].options()).expand({total}), -1,
        static_cast<int>(opts.op));
  return inner_->allreduce_coalesced(tensors, opts);
}
WorkPtr CheckedProcessGroup::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  check(OpType::Broadcast, tensor, opts.root, -1);
  return inner_->broadcast(tensor, opts);
}
WorkPtr CheckedProcessGroup::reduce(Tensor& tensor, const ReduceOptions& opts) {
  check(OpType::Reduce, tensor, opts.root, static_cast<int>(opts.op));
  return inner_->reduce(tensor, opts);
}
WorkPtr CheckedProcessGroup::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                       const CollectiveOptions& opts) {
  check(OpType::Allgather, input, -1, -1);
  return inner_->allgather(outputs, input, opts);
}
WorkPtr CheckedProcessGroup::allgather_into_tensor(Tensor& output, const Tensor& input,
                                                   const CollectiveOptions& opts) {
  check(OpType::AllgatherIntoTensor, input, -1, -1);
  return inner_->allgather_into_tensor(output, input, opts);
}
WorkPtr CheckedProcessGroup::gather(std::vector<Tensor>& outputs, const Tensor& input,
                                    const GatherOptions& opts) {
  check(OpType::Gather, input, opts.root, -1);
  return inner_->gather(outputs, input, opts);
}
WorkPtr CheckedProcessGroup::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                     const ScatterOptions& opts) {
  // Only root passes inputs: fingerprint the output.
  check(OpType::Scatter, output, opts.root, -1);
  return inner_->scatter(output, inputs, opts);
}
WorkPtr CheckedProcessGroup::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                            const ReduceScatterOptions& opts) {
  check(OpType::ReduceScatter, output, -1, static_cast<int>(opts.op));
  return inner_->reduce_scatter(output, inputs, opts);
}
WorkPtr CheckedProcessGroup::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                   const ReduceScatterOptions& opts) {
  check(OpType::ReduceScatterTensor, output, -1, static_cast<int>(opts.op));
  return inner_->reduce_scatter_tensor(output, input, opts);
}
WorkPtr CheckedProcessGroup::alltoall(std::vector<Tensor>& outputs,
                                      const std::vector<Tensor>& inputs,
                                      const CollectiveOptions& opts) {
  check(OpType::Alltoall, inputs.empty() ? Tensor() : inputs[0], -1, -1);
  return inner_->alltoall(outputs, inputs, opts);
}
WorkPtr CheckedProcessGroup::barrier(const CollectiveOptions& opts) {
  check(OpType::Barrier, Tensor(), -1, -1);
  return inner_->barrier(opts);
}
}  // namespace ember::dist
