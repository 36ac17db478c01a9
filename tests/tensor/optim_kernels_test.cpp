// Fused optimizer updates (tensor/ops/optim.h): the fused kernels against the tensor-op fallback
// (taken for non-contiguous tensors), which is PyTorch 1.13's single-tensor op chain and is
// checked against PyTorch's values in tests/nn/optim_test.cpp.
#include <ember/tensor/ops/optim.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ember/tensor/ops.h>
#include "tests/tensor/test_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;

// The same values in a non-contiguous (every other element) layout: forces the fallback.
Tensor strided_copy(const Tensor& t) {
  Tensor base = zeros({2 * t.numel()}, TensorOptions(t.dtype()).device(t.device()));
  Tensor v = base.slice(0, 0, std::nullopt, 2);
  v.copy_(t);
  return v;
}

struct AdamCase {
  const char* name;
  detail::AdamStepArgs args;
};

std::vector<AdamCase> adam_cases() {
  std::vector<AdamCase> cs;
  detail::AdamStepArgs a;
  a.lr = 0.01;
  cs.push_back({"plain", a});
  a.weight_decay = 0.1;
  cs.push_back({"l2", a});
  a.decoupled = true;
  cs.push_back({"adamw", a});
  a.amsgrad = true;
  cs.push_back({"adamw_amsgrad", a});
  a.decoupled = false;
  a.maximize = true;
  a.beta1 = 0.8;
  a.beta2 = 0.99;
  a.eps = 1e-3;
  cs.push_back({"l2_amsgrad_maximize", a});
  return cs;
}

// Runs three Adam steps (fresh gradients each step) and returns p, m, v, vmax.
std::vector<Tensor> run_adam(const detail::AdamStepArgs& a0, int64_t n, Dtype dt, bool fused,
                             Device dev = kCPU) {
  auto make = [&](Tensor t) {
    t = t.to(dev);
    return fused ? t.clone() : strided_copy(t);
  };
  Tensor p = make(rand_t({n}, dt, 1));
  Tensor m = make(zeros({n}, dt)), v = make(zeros({n}, dt)), vmax = make(zeros({n}, dt));
  for (int step = 1; step <= 3; ++step) {
    Tensor g = make(rand_t({n}, dt, 10 + step));
    detail::AdamStepArgs a = a0;
    a.step = step;
    detail::adam_update_(p, g, m, v, vmax, a);
  }
  return {p.cpu(), m.cpu(), v.cpu(), vmax.cpu()};
}

TEST(OptimKernels, AdamFusedMatchesOpChain) {
  for (const AdamCase& c : adam_cases()) {
    for (Dtype dt : {kFloat32, kFloat64}) {
      for (int64_t n : {0, 1, 7, 1237, 70001}) {  // empty, tails, several blocks, threads
        const auto fused = run_adam(c.args, n, dt, true);
        const auto chain = run_adam(c.args, n, dt, false);
        const double tol = dt == kFloat32 ? 1e-6 : 1e-13;
        const char* names[] = {"param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
        for (int k = 0; k < (c.args.amsgrad ? 4 : 3); ++k) {
          expect_close(fused[k], chain[k].to_vector<double>(), tol,
                       std::string(c.name) + " " + names[k] + " " +
                           std::string(dtype_name(dt)) + " n=" + std::to_string(n));
        }
      }
    }
  }
}

TEST(OptimKernels, AdamReducedPrecisionComputesInFloat) {
  // The state is stored in the parameter's dtype (as in PyTorch). bfloat16 keeps float32's
  // range, so it tracks the float32 run; float16's v underflows for small gradients, so it is
  // compared with the op chain on float16 instead (which rounds after every op, hence the
  // looser tolerance). eps = 1e-3 keeps float16's denominator representable.
  for (AdamCase c : adam_cases()) {
    c.args.eps = 1e-3;
    const auto ref = run_adam(c.args, 300, kFloat32, true);
    const auto bf = run_adam(c.args, 300, kBFloat16, true);
    expect_close(bf[0], ref[0].to_vector<double>(), 1.6e-2, std::string(c.name) + " bfloat16");
    const auto h = run_adam(c.args, 300, kFloat16, true);
    const auto hchain = run_adam(c.args, 300, kFloat16, false);
    expect_close(h[0], hchain[0].to_vector<double>(), 1e-2, std::string(c.name) + " float16");
  }
}

struct SgdCase {
  const char* name;
  detail::SgdStepArgs args;
};

std::vector<SgdCase> sgd_cases() {
  std::vector<SgdCase> cs;
  detail::SgdStepArgs a;
  a.lr = 0.1;
  cs.push_back({"plain", a});
  a.weight_decay = 0.01;
  a.maximize = true;
  cs.push_back({"wd_maximize", a});
  a.momentum = 0.9;
  cs.push_back({"momentum", a});
  a.dampening = 0.3;
  cs.push_back({"dampening", a});
  a.dampening = 0;
  a.nesterov = true;
  cs.push_back({"nesterov", a});
  return cs;
}

std::vector<Tensor> run_sgd(const detail::SgdStepArgs& a0, int64_t n, Dtype dt, bool fused) {
  auto make = [&](Tensor t) { return fused ? t.clone() : strided_copy(t); };
  Tensor p = make(rand_t({n}, dt, 2));
  Tensor buf = make(full({n}, 123.0, dt));  // garbage: the first step must overwrite it
  for (int step = 1; step <= 3; ++step) {
    Tensor g = make(rand_t({n}, dt, 20 + step));
    detail::SgdStepArgs a = a0;
    a.init_buffer = step == 1;
    detail::sgd_update_(p, g, buf, a);
  }
  return {p, buf};
}

TEST(OptimKernels, SgdFusedMatchesOpChain) {
  for (const SgdCase& c : sgd_cases()) {
    for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
      for (int64_t n : {0, 5, 1237, 70001}) {
        const auto fused = run_sgd(c.args, n, dt, true);
        const auto chain = run_sgd(c.args, n, dt, false);
        // 16-bit: the fused kernel rounds once, the chain after every op.
        const double tol = dt == kFloat32   ? 1e-6
                           : dt == kFloat64 ? 1e-13
                           : dt == kFloat16 ? 4e-3
                                            : 3e-2;
        const std::string what =
            std::string(c.name) + " " + std::string(dtype_name(dt)) + " n=" + std::to_string(n);
        expect_close(fused[0], chain[0].to_vector<double>(), tol, what + " param");
        if (c.args.momentum != 0) {
          expect_close(fused[1], chain[1].to_vector<double>(), tol, what + " momentum_buffer");
        }
      }
    }
  }
}

TEST(OptimKernels, SgdClosedForm) {
  // p = 1, g = 2, lr = 0.5, momentum 0.9: step 1 buf = 2, p = 0; step 2 buf = 3.8, p = -1.9.
  Tensor p = ones({3}), g = full({3}, 2.0), buf = empty({3});
  detail::SgdStepArgs a;
  a.lr = 0.5;
  a.momentum = 0.9;
  a.init_buffer = true;
  detail::sgd_update_(p, g, buf, a);
  expect_close(p, {0, 0, 0}, 0, "param after step 1");
  a.init_buffer = false;
  detail::sgd_update_(p, g, buf, a);
  expect_close(buf, {3.8, 3.8, 3.8}, 1e-7, "buffer after step 2");
  expect_close(p, {-1.9, -1.9, -1.9}, 1e-7, "param after step 2");
}

TEST(OptimKernels, BumpsVersions) {
  Tensor p = ones({4}), g = ones({4}), m = zeros({4}), v = zeros({4});
  const uint32_t pv = p.version(), mv = m.version(), vv = v.version(), gv = g.version();
  detail::adam_update_(p, g, m, v, Tensor(), detail::AdamStepArgs{});
  EXPECT_GT(p.version(), pv);
  EXPECT_GT(m.version(), mv);
  EXPECT_GT(v.version(), vv);
  EXPECT_EQ(g.version(), gv);
}

TEST(OptimKernels, Errors) {
  Tensor p = ones({4}), g = ones({4}), m = zeros({4}), v = zeros({4});
  detail::AdamStepArgs a;
  expect_error([&] { detail::adam_update_(p, ones({5}), m, v, Tensor(), a); },
               {"[adam_update_]", "grad", "[4]", "[5]"});
  expect_error([&] { detail::adam_update_(p, Tensor(), m, v, Tensor(), a); },
               {"[adam_update_]", "grad"});
  a.amsgrad = true;
  expect_error([&] { detail::adam_update_(p, g, m, v, Tensor(), a); },
               {"[adam_update_]", "max_exp_avg_sq"});
  detail::SgdStepArgs s;
  s.momentum = 0.9;
  expect_error([&] { detail::sgd_update_(p, g, Tensor(), s); },
               {"[sgd_update_]", "momentum_buffer"});
  expect_error([&] { detail::sgd_update_(p, g, zeros({2, 2}), s); },
               {"[sgd_update_]", "momentum_buffer", "[2, 2]"});
}

TEST(OptimKernels, CudaMatchesCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  for (const AdamCase& c : adam_cases()) {
    for (Dtype dt : {kFloat32, kFloat64, kBFloat16}) {
      const auto cpu = run_adam(c.args, 1237, dt, true);
      const auto gpu = run_adam(c.args, 1237, dt, true, cuda_device(0));
      const double tol = dt == kFloat64 ? 1e-13 : dt == kFloat32 ? 1e-6 : 1e-2;
      for (int k = 0; k < 3; ++k) {
        expect_close(gpu[k], cpu[k].to_vector<double>(), tol,
                     std::string(c.name) + " " + std::string(dtype_name(dt)));
      }
    }
  }
  for (const SgdCase& c : sgd_cases()) {
    Tensor p = rand_t({1000}, kFloat32, 3), g = rand_t({1000}, kFloat32, 4);
    Tensor buf = zeros({1000});
    Tensor pc = p.cuda(), gc = g.cuda(), bc = buf.cuda();
    detail::SgdStepArgs a = c.args;
    a.init_buffer = true;
    detail::sgd_update_(p, g, buf, a);
    detail::sgd_update_(pc, gc, bc, a);
    expect_close(pc, p.to_vector<double>(), 1e-6, std::string("sgd ") + c.name);
  }
}

}  // namespace
}  // namespace ember
