// ProcessGroupGloo's collectives and send/recv: each checks its arguments on the calling
// thread and submits a job (process_group_gloo.cpp runs it) that goes through shared memory when
// the group has it, else through Gloo's TCP transport after the ranks agree on what they issued
// (Note [ranks that disagree over TCP]). Built only when gloo is found.
#include <ember/distributed/backends/process_group_gloo.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/scatter.h>
#include <gloo/types.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/backends/detail/gloo_agreement.h>
#include <ember/distributed/backends/detail/process_group_gloo_impl.h>
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/backends/detail/shm_kernels.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

using Clock = std::chrono::steady_clock;

using dist::detail::ShmAllreduce;
using dist::detail::pg_gloo::ShmList;
using dist::detail::pg_gloo::divide_in_place;
using dist::detail::pg_gloo::divide_span;
using dist::detail::pg_gloo::reduce_fn;
using dist::detail::pg_gloo::shm_reduction;

// c10d's slot prefix for send/recv; the collectives use 0x01..0x08 (gloo/types.h).
constexpr uint8_t kSendRecvSlotPrefix = 0x09;

// Note [shared-memory allreduce]: the tensors (contiguous CPU, one dtype) reduced in place as
// one buffer, Avg's division included.
void shm_allreduce(dist::detail::ShmAllreduce& shm, uint64_t ticket,
                   const std::vector<Tensor>& ts, ReduceOp op, std::chrono::milliseconds left) {
  std::vector<dist::detail::ShmAllreduce::Span> spans;
  for (const Tensor& t : ts) spans.push_back({t.data_ptr(), static_cast<size_t>(t.numel())});
  EMBER_DISPATCH_NUMERIC(ts[0].dtype(), "[gloo] allreduce", [&]<typename T>() {
    shm.run(ticket, spans, ts[0].dtype(), op, reduce_fn<T>(op),
            op == ReduceOp::Avg ? &divide_span<T> : nullptr, Clock::now() + left);
  });
}

// Note [small allreduce]: Gloo's ring allreduce takes 2(n-1) dependent steps, each a network
// round trip; below this size latency dominates, so every rank instead sends its buffer straight
// to every peer and receives theirs (one round, all transfers in flight at once) and reduces
// locally in rank order 0..n-1, which gives every rank bitwise the same result. (Gloo's own
// allgather is a ring of n-1 steps: slower for small buffers than this exchange, and slower even
// than its ring allreduce.)
// With 2 ranks the exchange moves the same bytes as the ring (each sends its whole buffer once)
// in one step instead of two, so it pays up to a larger size; above kTwoRankExchangeBytes the
// ring's halved reduction work, spread over both ranks, wins (docs/benchmarks.md). With more
// ranks the exchange sends (n-1) times the buffer, so it is kept for small ones.
constexpr size_t kSmallAllreduceBytes = 64 * 1024;
constexpr size_t kTwoRankExchangeBytes = 512 * 1024;
size_t small_allreduce_bytes(int n) {
  return n == 2 ? kTwoRankExchangeBytes : kSmallAllreduceBytes;
}

using dist::OpType;
using dist::detail::make_desc;

// Note [ranks that disagree over TCP]: every collective's receive holds the largest message a
// peer may send on the same tag, a small allreduce's, whatever this rank issued.
void agree(const std::shared_ptr<gloo::Context>& ctx, uint32_t tag,
           const dist::detail::GlooOpDesc& mine, std::chrono::milliseconds left) {
  dist::detail::agree(ctx, tag, mine, small_allreduce_bytes(ctx->size), left);
}

bool is_supported(Dtype d) { return d != Dtype::Bool; }

// Note [CUDA tensors over gloo]: allreduce, broadcast and allgather_into_tensor accept CUDA
// tensors by staging them through host memory (as c10d's gloo backend does): the device data
// is copied to a host tensor on the caller's thread (which waits for the caller's current
// stream, so the values are final), the collective runs on the host copy, and the result is
// copied back to the device (a synchronous copy) before the Work completes. Slow, but it lets
// several ranks share one GPU in tests and run DDP on CUDA tensors without NCCL.
template <typename Run>
WorkPtr staged(const char* name, const Tensor& device_out, const Tensor& host_out, Run run) {
  WorkPtr inner = run();
  Tensor dev = device_out, host = host_out;
  return chain_work(inner, name, [dev, host]() mutable {
    dev.copy_(host);
    return std::vector<Tensor>{dev};
  });
}

void check_tensor(const char* op, const Tensor& t, const char* what = "tensor") {
  EMBER_CHECK(t.defined(), "[gloo] ", op, ": ", what, " is undefined");
  EMBER_CHECK(t.device().is_cpu(), "[gloo] ", op, " expects CPU tensors, got ", what, " on ",
              t.device(), " (allreduce, broadcast and allgather_into_tensor also take CUDA "
              "tensors, staged through host memory; use nccl for the others)");
  EMBER_CHECK(t.is_contiguous(), "[gloo] ", op, " expects contiguous tensors, got a ",
              "non-contiguous ", what, " (shape ", t.shape(), ")");
  EMBER_CHECK_TYPE(TypeError, is_supported(t.dtype()), "[gloo] ", op,
                   " supports float32, float64, float16, bfloat16, int32, int64 and uint8, got ",
                   what, " of dtype ", t.dtype());
}

// Gloo options of a collective that moves whole tensors as bytes (allgather, alltoall).
template <typename Opts>
void set_bytes(Opts& o, const Tensor& in, const Tensor& out, uint32_t tag,
               std::chrono::milliseconds left) {
  o.template setInput<uint8_t>(static_cast<uint8_t*>(in.data_ptr()),
                               static_cast<size_t>(in.nbytes()));
  o.template setOutput<uint8_t>(static_cast<uint8_t*>(out.data_ptr()),
                                static_cast<size_t>(out.nbytes()));
  o.setTag(tag);
  o.setTimeout(left);
}

void check_list(const char* op, const std::vector<Tensor>& list, int n, const Tensor& like,
                const char* what) {
  EMBER_CHECK(static_cast<int>(list.size()) == n, "[gloo] ", op, " expected ", n, " ", what,
              " tensors (one per rank), got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    EMBER_CHECK(list[i].defined() && list[i].shape() == like.shape() &&
                    list[i].dtype() == like.dtype() && list[i].device().is_cpu(),
                "[gloo] ", op, ": ", what, "[", i, "] must be a CPU tensor of shape ", like.shape(),
                " and dtype ", like.dtype());
  }
}

}  // namespace

WorkPtr ProcessGroupGloo::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  if (tensor.defined() && tensor.is_cuda()) {  // Note [CUDA tensors over gloo]
    Tensor host = tensor.contiguous().to(kCPU);
    return staged("allreduce of a CUDA tensor", tensor, host, [&] { return allreduce(host, opts); });
  }
  check_tensor("allreduce", tensor);
  const uint32_t tag = static_cast<uint32_t>(seq_);
  // Before the ticket: a refused collective (issued from a callback) must not take one.
  std::string label = next_op_label("allreduce");
  const int n = size_;
  auto ctx = impl_->context();
  // Empty tensors too: a rank whose tensor is empty meets its peers in shared memory, where the
  // agreement check names the counts, instead of leaving them to wait out the timeout.
  dist::detail::ShmAllreduce* shm = ctx ? impl_->shm() : nullptr;
  const uint64_t ticket = shm ? shm->next_ticket() : 0;  // in issue order, as on every rank
  Tensor t = tensor;
  const ReduceOp op = opts.op;
  const auto route =
      shm ? impl_->route_for(static_cast<size_t>(t.nbytes())) : Impl::Route::Worker;
  return record_flight(
      impl_->submit(
          label, timeout_of(opts.timeout),
          [=](std::chrono::milliseconds left) {
            if (shm) {
              shm_allreduce(*shm, ticket, {t}, op, left);
              return std::vector<Tensor>{t};
            }
            if (ctx) {
              EMBER_DISPATCH_NUMERIC(t.dtype(), "[gloo] allreduce", [&]<typename T>() {
                dist::detail::tcp_allreduce<T>(ctx, t.dtype(), t.template data<T>(),
                                               static_cast<size_t>(t.numel()), op, reduce_fn<T>(op),
                                               small_allreduce_bytes(n), tag, left);
              });
            }
            if (op == ReduceOp::Avg && n > 1) divide_in_place(t, n);
            return std::vector<Tensor>{t};
          },
          route),
      {tensor});
}

WorkPtr ProcessGroupGloo::allreduce_coalesced(std::vector<Tensor>& tensors,
                                              const AllreduceOptions& opts) {
  check_coalesced("gloo", tensors);
  dist::detail::ShmAllreduce* shm = impl_->shm();
  if (!shm || !tensors[0].device().is_cpu()) return ProcessGroup::allreduce_coalesced(tensors, opts);
  int64_t total = 0;
  for (const Tensor& t : tensors) {
    check_tensor("allreduce_coalesced", t);
    total += t.numel();
  }
  std::string label = next_op_label("allreduce_coalesced");  // before the ticket, as allreduce
  const uint64_t ticket = shm->next_ticket();  // in issue order; empty too, as allreduce
  std::vector<Tensor> ts = tensors;
  const ReduceOp op = opts.op;
  const size_t bytes = static_cast<size_t>(total) * static_cast<size_t>(tensors[0].element_size());
  return record_flight(impl_->submit(
                           label, timeout_of(opts.timeout),
                           [=](std::chrono::milliseconds left) {
                             shm_allreduce(*shm, ticket, ts, op, left);
                             return ts;
                           },
                           impl_->route_for(bytes)),
                       tensors);
}

WorkPtr ProcessGroupGloo::reduce(Tensor& tensor, const ReduceOptions& opts) {
  check_tensor("reduce", tensor);
  check_root("reduce", opts.root);
  const uint32_t tag = static_cast<uint32_t>(seq_);
  const int n = size_, me = rank_, root = opts.root;
  auto ctx = impl_->context();
  const ShmTicket shm = take_ticket("reduce");
  Tensor t = tensor;
  const ReduceOp op = opts.op;
  return record_flight(
      impl_->submit(
          shm.label, timeout_of(opts.timeout),
          [=](std::chrono::milliseconds left) {
            if (shm) {
              shm.shm->reduce(shm.ticket, t.data_ptr(), static_cast<size_t>(t.numel()), t.dtype(),
                              shm_reduction(t.dtype(), op), root, Clock::now() + left);
              return std::vector<Tensor>{t};
            }
            if (ctx)
              agree(ctx, tag, make_desc(OpType::Reduce, t.dtype(), t.numel(), root, op), left);
            if (ctx && t.numel() > 0) {
              EMBER_DISPATCH_NUMERIC(t.dtype(), "[gloo] reduce", [&]<typename T>() {
                gloo::ReduceOptions o(ctx);
                o.setOutput<T>(t.template data<T>(), static_cast<size_t>(t.numel()));
                o.setRoot(root);
                o.setReduceFunction(reduce_fn<T>(op));
                o.setTag(tag);
                o.setTimeout(left);
                gloo::reduce(o);
              });
            }
            if (op == ReduceOp::Avg && n > 1 && me == root) divide_in_place(t, n);
            return std::vector<Tensor>{t};
          },
          impl_->route_for(static_cast<size_t>(t.nbytes()))),
      {tensor});
}

WorkPtr ProcessGroupGloo::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  if (tensor.defined() && tensor.is_cuda()) {  // Note [CUDA tensors over gloo]
    Tensor host = tensor.contiguous().to(kCPU);
    return staged("broadcast of a CUDA tensor", tensor, host, [&] { return broadcast(host, opts); });
  }
  check_tensor("broadcast", tensor);
  check_root("broadcast", opts.root);
  const uint32_t tag = static_cast<uint32_t>(seq_);
  const int root = opts.root;
  auto ctx = impl_->context();
  const ShmTicket shm = take_ticket("broadcast");
  Tensor t = tensor;
  return record_flight(
      impl_->submit(
          shm.label, timeout_of(opts.timeout),
          [=](std::chrono::milliseconds left) {
            if (shm) {
              shm.shm->broadcast(shm.ticket, t.data_ptr(), static_cast<size_t>(t.numel()),
                                 t.dtype(), root, Clock::now() + left);
              return std::vector<Tensor>{t};
            }
            if (ctx)
              agree(ctx, tag, make_desc(OpType::Broadcast, t.dtype(), t.numel(), root), left);
            if (ctx && t.numel() > 0) {
              gloo::BroadcastOptions o(ctx);
              // Output only, on the root too: Gloo then broadcasts in place. Given the same memory
              // as an input as well, its root copies input to output while its transport thread is
              // still sending that memory: a race (the same bytes, but a race), and one copy of the
              // tensor for nothing.
              o.setOutput<uint8_t>(static_cast<uint8_t*>(t.data_ptr()),
                                   static_cast<size_t>(t.nbytes()));
              o.setRoot(root);
              o.setTag(tag);
              o.setTimeout(left);
              gloo::broadcast(o);
            }
            return std::vector<Tensor>{t};
          },
          impl_->route_for(static_cast<size_t>(t.nbytes()))),
      {tensor});
}

namespace {
// Note [receives first over TCP]: Gloo's TCP pairs move an unbound buffer only once the peer
// has announced a matching receive, and announcements travel on the same socket as the data.
// gloo::alltoall and gloo::allgather post each send before the matching receive: a rank that
// arrives second finds its peer's receive announced, writes its whole message, and only then
// announces its own receive, which reaches the peer behind that message. The two directions take
// turns instead of overlapping, and over a link slower than the CPUs a large exchange takes up
// to twice as long (docs/benchmarks.md). Ember's loops post every receive of a step before its
// sends, so the announcement goes first; the messages, slots and results are Gloo's. Below
// GlooOptions::receives_first_bytes (a peer's chunk, a rank's input) a collective keeps Gloo's
// order: there the late rank's immediate write from its own thread beats waiting for the peer's
// event loop to send once the announcement lands. Both orders send the same messages on the
// same slots, so ranks that chose differently still match.

// Every peer's chunk of `in` to that peer, and theirs into `out` at their rank's offset.
void alltoall_receives_first(const std::shared_ptr<gloo::Context>& ctx, const Tensor& in,
                             const Tensor& out, uint32_t tag, std::chrono::milliseconds left) {
  const int n = ctx->size, me = ctx->rank;
  const size_t chunk = static_cast<size_t>(in.nbytes()) / static_cast<size_t>(n);
  auto* src = static_cast<char*>(in.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  std::memcpy(dst + static_cast<size_t>(me) * chunk, src + static_cast<size_t>(me) * chunk, chunk);
  const uint64_t slot = gloo::Slot::build(gloo::kAlltoallSlotPrefix, tag);
  dist::detail::PostedBuffer rx(ctx->createUnboundBuffer(dst, chunk * static_cast<size_t>(n)),
                                std::make_shared<Tensor>(out));
  dist::detail::PostedBuffer tx(ctx->createUnboundBuffer(src, chunk * static_cast<size_t>(n)),
                                std::make_shared<Tensor>(in));
  for (int i = 1; i < n; ++i) {
    const int from = (me + n - i) % n;
    rx->recv(from, slot, static_cast<size_t>(from) * chunk, chunk);
  }
  for (int i = 1; i < n; ++i) {
    const int to = (me + i) % n;
    tx->send(to, slot, static_cast<size_t>(to) * chunk, chunk);
  }
  for (int i = 1; i < n; ++i) dist::detail::wait_for(*rx, true, left);
  for (int i = 1; i < n; ++i) dist::detail::wait_for(*tx, false, left);
}

// The ring allgather: in step s (of n - 1) a rank passes segment (rank - s) to its right and
// receives segment (rank - s - 1) from its left, each segment in two halves so that one half's
// transfer overlaps the other's. `out` holds n segments of `in`'s size.
void allgather_receives_first(const std::shared_ptr<gloo::Context>& ctx, const Tensor& in,
                              const Tensor& out, uint32_t tag, std::chrono::milliseconds left) {
  const int n = ctx->size, me = ctx->rank;
  const size_t seg = static_cast<size_t>(in.nbytes());
  auto* dst = static_cast<char*>(out.data_ptr());
  if (dst + static_cast<size_t>(me) * seg != in.data_ptr()) {
    std::memcpy(dst + static_cast<size_t>(me) * seg, in.data_ptr(), seg);
  }
  const uint64_t slot = gloo::Slot::build(gloo::kAllgatherSlotPrefix, tag);
  dist::detail::PostedBuffer buf(ctx->createUnboundBuffer(dst, seg * static_cast<size_t>(n)),
                                 std::make_shared<Tensor>(out));  // `in` is copied, not posted
  const int right = (me + 1) % n, from = (me + n - 1) % n;
  const size_t half[2] = {seg / 2, seg - seg / 2};  // as Gloo splits, an empty half included
  const size_t at[2] = {0, seg / 2};
  int pending = 0;  // transfers posted and not yet waited for, of each kind
  for (int s = 0; s < n - 1; ++s) {
    const size_t send_seg = static_cast<size_t>((me - s + n) % n);
    const size_t recv_seg = static_cast<size_t>((me - s - 1 + 2 * n) % n);
    for (int h = 0; h < 2; ++h) {
      // Half h of this step's segment arrived in the step before: wait for it (receives on one
      // pair and slot complete in order), and for the send before it.
      if (pending == 2) {
        dist::detail::wait_for(*buf, true, left);
        dist::detail::wait_for(*buf, false, left);
        --pending;
      }
      buf->recv(from, slot, recv_seg * seg + at[h], half[h]);
      buf->send(right, slot, send_seg * seg + at[h], half[h]);
      ++pending;
    }
  }
  for (; pending > 0; --pending) {
    dist::detail::wait_for(*buf, true, left);
    dist::detail::wait_for(*buf, false, left);
  }
}
}  // namespace

WorkPtr ProcessGroupGloo::allgather_into_tensor(Tensor& output, const Tensor& input,
                                                const CollectiveOptions& opts) {
  if (output.defined() && input.defined() && output.is_cuda() && input.is_cuda()) {
    Tensor host_in = input.contiguous().to(kCPU);  // Note [CUDA tensors over gloo]
    Tensor host_out = empty(output.shape(), output.dtype());
    return staged("allgather_into_tensor of CUDA tensors", output, host_out,
                  [&] { return allgather_into_tensor(host_out, host_in, opts); });
  }
  check_tensor("allgather_into_tensor", input, "input");
  check_tensor("allgather_into_tensor", output, "output");
  EMBER_CHECK(output.dtype() == input.dtype() && output.numel() == input.numel() * size_,
              "[gloo] allgather_into_tensor: output must hold ", size_, " x ", input.numel(),
              " elements of ", input.dtype(), ", got ", output.numel(), " of ", output.dtype());
  const uint32_t tag = static_cast<uint32_t>(seq_);
  auto ctx = impl_->context();
  const size_t first = impl_->receives_first_bytes();
  const ShmTicket shm = take_ticket("allgather_into_tensor");
  const int n = size_;
  Tensor in = input, out = output;
  return record_flight(
      impl_->submit(
          shm.label, timeout_of(opts.timeout),
          [=](std::chrono::milliseconds left) {
            if (shm) {
              std::vector<void*> slots;
              for (int r = 0; r < n; ++r) {
                slots.push_back(static_cast<char*>(out.data_ptr()) +
                                static_cast<size_t>(r) * static_cast<size_t>(in.nbytes()));
              }
              shm.shm->gather(shm.ticket, in.data_ptr(), slots, static_cast<size_t>(in.numel()),
                              in.dtype(), /*root=*/-1, Clock::now() + left);
              return std::vector<Tensor>{out};
            }
            if (!ctx) {
              out.view(in.shape()).copy_(in);
              return std::vector<Tensor>{out};
            }
            agree(ctx, tag, make_desc(OpType::Allgather, in.dtype(), in.numel()), left);
            if (in.numel() > 0 && static_cast<size_t>(in.nbytes()) >= first) {
              allgather_receives_first(ctx, in, out, tag, left);
            } else if (in.numel() > 0) {
              gloo::AllgatherOptions o(ctx);
              set_bytes(o, in, out, tag, left);
              gloo::allgather(o);
            }
            return std::vector<Tensor>{out};
          },
          impl_->route_for(static_cast<size_t>(out.nbytes()))),
      {input});
}

WorkPtr ProcessGroupGloo::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                    const CollectiveOptions& opts) {
  if (!impl_->shm() || !input.defined() || !input.device().is_cpu()) {
    return ProcessGroup::allgather(outputs, input, opts);
  }
  check_tensor("allgather", input, "input");
  check_list("allgather", outputs, size_, input, "outputs");
  const ShmTicket shm = take_ticket("allgather");
  Tensor in = input;
  const ShmList outs = ShmList::outputs(outputs);
  return record_flight(impl_->submit(shm.label, timeout_of(opts.timeout),
                                     [=](std::chrono::milliseconds left) {
                                       shm.shm->gather(shm.ticket, in.data_ptr(), outs.writes(),
                                                       static_cast<size_t>(in.numel()), in.dtype(),
                                                       /*root=*/-1, Clock::now() + left);
                                       return outs.finish();
                                     }),
                       {input});
}

WorkPtr ProcessGroupGloo::gather(std::vector<Tensor>& outputs, const Tensor& input,
                                 const GatherOptions& opts) {
  check_tensor("gather", input, "input");
  check_root("gather", opts.root);
  const int me = rank_, root = opts.root, n = size_;
  if (me == root) {
    check_list("gather", outputs, n, input, "outputs");
  } else {
    check_only_root_passes("gather", root, outputs.size(), "output");
  }
  const uint32_t tag = static_cast<uint32_t>(seq_);
  auto ctx = impl_->context();
  const ShmTicket shm = take_ticket("gather");
  Tensor in = input;
  std::vector<Tensor> outs = outputs;
  const ShmList shm_outs = ShmList::outputs(shm ? outputs : std::vector<Tensor>{});
  return record_flight(
      impl_->submit(shm.label, timeout_of(opts.timeout),
                    [=](std::chrono::milliseconds left) mutable {
                      if (shm) {
                        shm.shm->gather(shm.ticket, in.data_ptr(), shm_outs.writes(),
                                        static_cast<size_t>(in.numel()), in.dtype(), root,
                                        Clock::now() + left);
                        return shm_outs.finish();
                      }
                      if (!ctx) {
                        outs[0].copy_(in);
                        return outs;
                      }
                      agree(ctx, tag, make_desc(OpType::Gather, in.dtype(), in.numel(), root),
                            left);
                      if (in.numel() == 0) return outs;
                      Tensor flat;
                      gloo::GatherOptions o(ctx);
                      o.setInput<uint8_t>(static_cast<uint8_t*>(in.data_ptr()),
                                          static_cast<size_t>(in.nbytes()));
                      if (me == root) {
                        flat = empty({static_cast<int64_t>(n) * in.numel()}, in.options());
                        o.setOutput<uint8_t>(static_cast<uint8_t*>(flat.data_ptr()),
                                             static_cast<size_t>(flat.nbytes()));
                      }
                      o.setRoot(root);
                      o.setTag(tag);
                      o.setTimeout(left);
                      gloo::gather(o);
                      for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
                        outs[r].copy_(flat.narrow(0, r * in.numel(), in.numel()).view(in.shape()));
                      }
                      return outs;
                    }),
      {input});
}

WorkPtr ProcessGroupGloo::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                  const ScatterOptions& opts) {
  check_tensor("scatter", output, "output");
  check_root("scatter", opts.root);
  const int me = rank_, root = opts.root, n = size_;
  std::vector<Tensor> ins;
  if (me == root) {
    check_list("scatter", inputs, n, output, "inputs");
    for (const Tensor& t : inputs) ins.push_back(t.contiguous());
  } else {
    check_only_root_passes("scatter", root, inputs.size(), "input");
  }
  const uint32_t tag = static_cast<uint32_t>(seq_);
  auto ctx = impl_->context();
  const ShmTicket shm = take_ticket("scatter");
  Tensor out = output;
  return record_flight(
      impl_->submit(shm.label, timeout_of(opts.timeout),
                    [=](std::chrono::milliseconds left) mutable {
                      if (shm) {
                        shm.shm->scatter(shm.ticket, ShmList::inputs(ins).reads(), out.data_ptr(),
                                         static_cast<size_t>(out.numel()), out.dtype(), root,
                                         Clock::now() + left);
                        return std::vector<Tensor>{out};
                      }
                      if (!ctx) {
                        out.copy_(ins[0]);
                        return std::vector<Tensor>{out};
                      }
                      agree(ctx, tag, make_desc(OpType::Scatter, out.dtype(), out.numel(), root),
                            left);
                      if (out.numel() > 0) {
                        gloo::ScatterOptions o(ctx);
                        const size_t nb = static_cast<size_t>(out.nbytes());
                        if (me == root) {
                          std::vector<uint8_t*> ptrs;
                          for (Tensor& t : ins) ptrs.push_back(static_cast<uint8_t*>(t.data_ptr()));
                          o.setInputs<uint8_t>(ptrs, nb);
                        }
                        o.setOutput<uint8_t>(static_cast<uint8_t*>(out.data_ptr()), nb);
                        o.setRoot(root);
                        o.setTag(tag);
                        o.setTimeout(left);
                        gloo::scatter(o);
                      }
                      return std::vector<Tensor>{out};
                    }),
      {output});
}

WorkPtr ProcessGroupGloo::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                         const ReduceScatterOptions& opts) {
  if (!impl_->shm() || !output.defined() || !output.device().is_cpu()) {
    return ProcessGroup::reduce_scatter(output, inputs, opts);
  }
  check_tensor("reduce_scatter", output, "output");
  check_list("reduce_scatter", inputs, size_, output, "inputs");
  const ShmList ins = ShmList::inputs(inputs);
  return shm_reduce_scatter("reduce_scatter", output, ins.tensors(), ins.reads(), opts);
}

WorkPtr ProcessGroupGloo::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                const ReduceScatterOptions& opts) {
  if (!impl_->shm() || !output.defined() || !output.device().is_cpu()) {
    return ProcessGroup::reduce_scatter_tensor(output, input, opts);
  }
  check_tensor("reduce_scatter_tensor", output, "output");
  check_tensor("reduce_scatter_tensor", input, "input");
  check_reduce_scatter_tensor(output, input);
  std::vector<const void*> blocks;
  for (int r = 0; r < size_; ++r) {
    blocks.push_back(static_cast<const char*>(input.data_ptr()) +
                     static_cast<size_t>(r) * static_cast<size_t>(output.nbytes()));
  }
  return shm_reduce_scatter("reduce_scatter_tensor", output, {input}, blocks, opts);
}

WorkPtr ProcessGroupGloo::shm_reduce_scatter(const char* name, Tensor& output,
                                             std::vector<Tensor> inputs,
                                             std::vector<const void*> blocks,
                                             const ReduceScatterOptions& opts) {
  const ShmTicket shm = take_ticket(name);
  Tensor out = output;
  const ReduceOp op = opts.op;
  return record_flight(
      impl_->submit(
          shm.label, timeout_of(opts.timeout),
          [=, keep = std::move(inputs)](std::chrono::milliseconds left) {
            (void)keep;  // the inputs stay alive until the collective ends
            shm.shm->reduce_scatter(shm.ticket, blocks, out.data_ptr(),
                                    static_cast<size_t>(out.numel()), out.dtype(),
                                    shm_reduction(out.dtype(), op), Clock::now() + left);
            return std::vector<Tensor>{out};
          },
          impl_->route_for(static_cast<size_t>(out.nbytes()) * static_cast<size_t>(size_))),
      {output});
}

WorkPtr ProcessGroupGloo::alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                                   const CollectiveOptions& opts) {
  EMBER_CHECK(!inputs.empty(), "[gloo] alltoall expected ", size_, " input tensors, got none");
  check_tensor("alltoall", inputs[0], "inputs[0]");
  check_list("alltoall", inputs, size_, inputs[0], "inputs");
  check_list("alltoall", outputs, size_, inputs[0], "outputs");
  if (impl_->shm()) {
    const ShmTicket shm = take_ticket("alltoall");
    const ShmList ins = ShmList::inputs(inputs), outs = ShmList::outputs(outputs);
    const Tensor like = inputs[0];
    return record_flight(impl_->submit(shm.label, timeout_of(opts.timeout),
                                       [=](std::chrono::milliseconds left) {
                                         shm.shm->alltoall(shm.ticket, ins.reads(), outs.writes(),
                                                           static_cast<size_t>(like.numel()),
                                                           like.dtype(), Clock::now() + left);
                                         return outs.finish();
                                       }),
                         inputs);
  }
  std::vector<Tensor> flat_in;
  for (const Tensor& t : inputs) flat_in.push_back(t.reshape({-1}));
  Tensor in = cat(flat_in, 0);
  const uint32_t tag = static_cast<uint32_t>(seq_);
  auto ctx = impl_->context();
  const size_t first = impl_->receives_first_bytes();
  std::vector<Tensor> outs = outputs;
  return record_flight(
      impl_->submit(next_op_label("alltoall"), timeout_of(opts.timeout),
                    [=](std::chrono::milliseconds left) mutable {
                      if (!ctx) {
                        outs[0].copy_(in.view(outs[0].shape()));
                        return outs;
                      }
                      agree(ctx, tag, make_desc(OpType::Alltoall, in.dtype(), in.numel()), left);
                      if (in.numel() == 0) return outs;
                      Tensor out = empty_like(in);
                      if (static_cast<size_t>(in.nbytes()) / outs.size() >= first) {
                        alltoall_receives_first(ctx, in, out, tag, left);
                      } else {
                        gloo::AlltoallOptions o(ctx);
                        set_bytes(o, in, out, tag, left);
                        gloo::alltoall(o);
                      }
                      const int64_t k = in.numel() / static_cast<int64_t>(outs.size());
                      for (size_t r = 0; r < outs.size(); ++r) {
                        outs[r].copy_(
                            out.narrow(0, static_cast<int64_t>(r) * k, k).view(outs[r].shape()));
                      }
                      return outs;
                    }),
      inputs);
}

// Note [barrier and two workers]: with two worker threads a barrier could finish while a
// collective issued before it still runs on the other worker. As in c10d's gloo backend, the
// barrier first waits for every earlier collective of this rank (they started before it, so
// none of them waits on it), then meets the other ranks: once it completes, every rank's
// earlier collectives have completed. It meets them through shared memory when the group has
// it (on the calling thread when nothing is in flight, Note [inline collectives]; there is
// then nothing to wait for), else through Gloo's barrier.
namespace {
void wait_for_earlier(const std::vector<WorkPtr>& prior, Clock::time_point deadline) {
  for (const WorkPtr& w : prior) {
    const auto rest =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      if (rest.count() > 0) w->future()->wait(rest);
    } catch (...) {
      // An earlier collective that failed reports its own error (and the group is then
      // broken, so the barrier itself fails too); one still running is a timeout here.
    }
    if (!w->is_completed()) {
      throw DistTimeoutError(detail::str_cat("timed out waiting for ", w->describe(),
                                             ", issued before the barrier"));
    }
  }
}
}  // namespace

WorkPtr ProcessGroupGloo::barrier(const CollectiveOptions& opts) {
  const uint32_t tag = static_cast<uint32_t>(seq_);
  auto ctx = impl_->context();
  std::vector<WorkPtr> prior = impl_->unfinished_collectives();
  std::string label = next_op_label("barrier");  // before the ticket, as allreduce
  dist::detail::ShmAllreduce* shm = impl_->shm();
  const uint64_t ticket = shm ? shm->next_ticket() : 0;  // in issue order, as on every rank
  return record_flight(
      impl_->submit(
          label, timeout_of(opts.timeout),
          [=](std::chrono::milliseconds left) {
            const auto deadline = Clock::now() + left;
            const auto rest = [deadline] {
              return std::max(
                  std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
            };
            wait_for_earlier(prior, deadline);
            if (shm) {
              shm->barrier(ticket, deadline);
            } else if (ctx) {
              // Checked like any collective, so that a barrier that meets another rank's allreduce
              // fails at once naming both instead of waiting out the timeout on different slots.
              agree(ctx, tag, make_desc(OpType::Barrier, Dtype::UInt8, 0), rest());
              gloo::BarrierOptions o(ctx);
              o.setTag(tag);
              o.setTimeout(rest());
              gloo::barrier(o);
            }
            return std::vector<Tensor>{};
          },
          impl_->route_for(0)),
      {});
}

WorkPtr ProcessGroupGloo::send(const Tensor& tensor, int dst, int tag) {
  return point_to_point(/*is_send=*/true, tensor, dst, tag);
}

WorkPtr ProcessGroupGloo::recv(Tensor& tensor, int src, int tag) {
  return point_to_point(/*is_send=*/false, tensor, src, tag);
}

WorkPtr ProcessGroupGloo::point_to_point(bool is_send, const Tensor& tensor, int peer, int tag) {
  const char* op = is_send ? "send" : "recv";
  check_tensor(op, tensor);
  EMBER_CHECK(peer >= 0 && peer < size_ && peer != rank_, "[gloo] ", op, ": ",
              is_send ? "dst " : "src ", peer, " must be another rank of this group of size ",
              size_, " (this is rank ", rank_, ")");
  EMBER_CHECK(tag >= 0, "[gloo] ", op, ": tag must be >= 0, got ", tag);
  Tensor t = tensor;
  const uint64_t slot = gloo::Slot::build(kSendRecvSlotPrefix, static_cast<uint32_t>(tag));
  std::shared_ptr<dist::detail::P2pTransfer> transfer;
  try {
    transfer = std::make_shared<dist::detail::P2pTransfer>(
        impl_->context(), is_send, peer, static_cast<uint32_t>(tag), slot, t.data_ptr(), t.dtype(),
        t.numel(), static_cast<size_t>(t.nbytes()));
  } catch (const std::exception& e) {  // Gloo's: the connection is already broken
    throw DistBackendError(impl_->p2p_post_failed(
        detail::str_cat("[gloo] ", op, " #", p2p_seq_, " on rank ", rank_, " of ", size_,
                        is_send ? " to" : " from", " rank ", peer, " tag ", tag),
        e.what()));
  }
  // Sends run on several threads: one to the same peer and tag waits for the one before
  // (Note [send and receive threads]).
  auto done = std::make_shared<std::promise<void>>();
  std::shared_future<void> before;
  if (is_send) before = impl_->previous_send(peer, tag, done->get_future().share());
  return record_flight(
      impl_->submit(
          detail::str_cat(next_p2p_label(op), is_send ? " to rank " : " from rank ", peer, " tag ",
                          tag),
          timeout(),
          [t, transfer, done, before, impl = impl_.get()](std::chrono::milliseconds left) {
            struct Finish {
              std::promise<void>& p;
              ~Finish() { p.set_value(); }
            } finish{*done};
            const auto deadline = std::chrono::steady_clock::now() + left;
            if (before.valid() && before.wait_until(deadline) != std::future_status::ready) {
              throw DistTimeoutError(
                  "an earlier send to the same rank on the same tag did not finish");
            }
            try {
              transfer->run(std::max(std::chrono::milliseconds(0),
                                     std::chrono::duration_cast<std::chrono::milliseconds>(
                                         deadline - std::chrono::steady_clock::now())));
            } catch (...) {
              // Note [buffers of a failed operation]: the transfer's buffers, and the tensor a
              // recv writes into, stay alive until the broken group's connections are closed.
              if (impl->broken()) {
                impl->waits().retire(
                    std::make_shared<std::pair<std::shared_ptr<dist::detail::P2pTransfer>, Tensor>>(
                        transfer, t));
              }
              throw;
            }
            return std::vector<Tensor>{t};
          },
          is_send ? Impl::Route::Send : Impl::Route::Recv),
      {tensor});
}

}  // namespace ember::dist
