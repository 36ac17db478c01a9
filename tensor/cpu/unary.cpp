// CPU kernels for unary element-wise ops, where and clamp.
#include <limits>

#include <ember/tensor/cpu/elementwise_loops.h>
#include <ember/tensor/cpu/wide_loops.h>
#include <ember/tensor/detail/elementwise_dispatch.h>

namespace ember::detail {

using cpu_ew::unary_loop;

void unary_cpu(UnaryOp op, const Tensor& out, const Tensor& in) {
  if (cpu_ew::unary_wide(op, out, in)) return;
  cpu_ew::CpuRun run{out, in, in};
  dispatch_unary(op, in.dtype(), run);
}

void where_cpu(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (out.numel() == 0) return;
  Geometry g = make_geometry(out.shape(), {&out, &cond, &a, &b});
  EMBER_DISPATCH_ALL(out.dtype(), "where", [&]<typename T>() {
    cpu::cpu_elementwise<T, bool, T, T>(g, fn::Where<T>{});
  });
}

void clamp_cpu(const Tensor& out, const Tensor& in, const std::optional<Scalar>& lo,
               const std::optional<Scalar>& hi) {
  cpu_ew::CpuRun run{out, in, in};
  dispatch_clamp(in.dtype(), lo, hi, run);
}

}  // namespace ember::detail
