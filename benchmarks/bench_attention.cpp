// bench_attention: scaled_dot_product_attention forward + backward, Ember's fused kernel (forced
// with SdpBackend::kFused) beside
// Ember's written-out (math) path and PyTorch's (benchmarks/bench_attention_torch.py under
// $EMBER_PYTHON, run as a subprocess), on GPT-like shapes.
//   bench_attention [--batch 16] [--heads 4] [--dim 32] [--seq 128,512] [--causal 1]
//                   [--rounds 5] [--reps 10] [--no-torch] [--no-math]
//                   [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--allow-tf32]
// The PyTorch column is its F.scaled_dot_product_attention where it has one (PyTorch 2: flash
// attention on the CPU, flash or memory-efficient kernels on a GPU), else (1.13) the
// written-out attention.
// Each round runs the three one after another for a sequence length, so load on a shared
// machine hits all of them alike; every number printed is the median over rounds of the median
// over `reps` timed steps (rounds whose PyTorch run failed left out; "-" when none is left).
// Each length's line is printed (and flushed) as soon as it is measured, so a run killed part
// way keeps the lengths it finished. The fused result is first checked against the math path
// at each length; a mismatch prints a WARNING line, the timing goes on, and the exit status
// is 1.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "cmake/build_paths.h"
#include <ember/nn/attention.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/threading.h>

using namespace ember;
namespace F = ember::nn::functional;

namespace {

struct Args {
  int64_t batch = 16, heads = 4, dim = 32;
  std::vector<int64_t> seqs{128, 512};
  bool causal = true;
  int rounds = 5, reps = 10;
  bool torch = true;
  bool math = true;
  bool allow_tf32 = false;  // CUDA float32: TF32 tensor cores for matmuls and fused attention
  std::string device = "cpu", dtype = "float32";
  Device dev() const { return Device(device); }
  Dtype dt() const {
    return dtype == "bfloat16" ? kBFloat16 : dtype == "float16" ? kFloat16 : kFloat32;
  }
};

void sync(const Args& a) {
  if (a.dev().is_cuda()) cuda::synchronize();
}

// The median of the values that are not NaN (a failed PyTorch run gives NaN, and std::sort
// with NaN has no order); NaN when none is left.
double median(std::vector<double> v) {
  std::erase_if(v, [](double x) { return std::isnan(x); });
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Problem {
  Tensor q, k, v, g;
  Problem(const Args& a, int64_t T) {
    Generator gen(0);
    const Shape s{a.batch, a.heads, T, a.dim};
    auto make = [&] { return randn(s, kFloat32, &gen).to(a.dev()).to(a.dt()); };
    q = make().requires_grad_();
    k = make().requires_grad_();
    v = make().requires_grad_();
    g = make();
  }
  template <typename Fn>
  void step(Fn attn) {
    for (Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());
    attn(q, k, v, Tensor(), 0.0, true, std::nullopt, nullptr).backward(g);
  }
};

// Median seconds of one forward + backward over `reps` steps, after one warm-up step.
template <typename Fn>
double time_steps(const Args& a, Problem& p, int reps, Fn attn) {
  using clock = std::chrono::steady_clock;
  p.step(attn);
  sync(a);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = clock::now();
    p.step(attn);
    sync(a);
    t.push_back(std::chrono::duration<double>(clock::now() - t0).count());
  }
  return median(t);
}

double time_torch(const Args& a, int64_t T) {
  std::ostringstream cmd;
  cmd << bench::python_script(EMBER_SOURCE_DIR, "benchmarks/bench_attention_torch.py")
      << " --batch " << a.batch << " --heads " << a.heads << " --seq " << T << " --dim " << a.dim
      << (a.causal ? " --causal" : "") << " --reps " << a.reps << " --threads " << get_num_threads()
      << " --device " << a.device << " --dtype " << a.dtype
      << (a.allow_tf32 ? " --allow-tf32" : "");
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (p == nullptr) return NAN;
  double sec = NAN;
  char line[256];
  while (std::fgets(line, sizeof line, p) != nullptr) std::sscanf(line, "sec=%lf", &sec);
  ::pclose(p);
  return sec;
}

// The fused gradients against the math path's: "" when they match, else what differs (printed
// as a WARNING; the length is timed all the same).
std::string check(const Args& a, int64_t T) try {
  Problem p(a, T);
  std::vector<Tensor> got, want;
  p.step(F::scaled_dot_product_attention);
  for (Tensor* t : {&p.q, &p.k, &p.v}) got.push_back(t->grad());
  p.step(F::scaled_dot_product_attention_math);
  for (Tensor* t : {&p.q, &p.k, &p.v}) want.push_back(t->grad());
  // Low precision: both paths round their float32 results once to the input's type.
  // TF32: 10-bit mantissas in the products, as float16's.
  const double tol = a.dt() == kFloat32 && !a.allow_tf32 ? 1e-3 : a.dt() == kBFloat16 ? 1e-1 : 2e-2;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = (got[i] - want[i]).to(kFloat32).abs().max().item<double>();
    if (!(err < tol)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "fused and math gradients differ by %g (tolerance %g)", err,
                    tol);
      return buf;
    }
  }
  return "";
} catch (const std::exception& e) {
  return std::string("the check threw: ") + e.what();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"scaled_dot_product_attention forward+backward: fused vs math vs PyTorch"};
  app.add_option("--batch", a.batch)->check(CLI::PositiveNumber);
  app.add_option("--heads", a.heads)->check(CLI::PositiveNumber);
  app.add_option("--dim", a.dim, "head dim")->check(CLI::PositiveNumber);
  app.add_option("--seq", a.seqs, "sequence lengths")->delimiter(',');
  app.add_option("--causal", a.causal);
  app.add_option("--rounds", a.rounds)->check(CLI::Range(1, 1000));
  app.add_option("--reps", a.reps, "timed steps per round")->check(CLI::Range(1, 100000));
  bool no_torch = false;
  app.add_flag("--no-torch", no_torch, "skip PyTorch");
  app.add_option("--device", a.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", a.dtype)->check(CLI::IsMember({"float32", "bfloat16", "float16"}));
  bool no_math = false;
  app.add_flag("--no-math", no_math, "skip Ember's math path");
  app.add_flag("--allow-tf32", a.allow_tf32,
               "CUDA float32 on TF32 tensor cores, both sides (allow_tf32; fused attention "
               "included)");
  CLI11_PARSE(app, argc, argv);
  cuda::set_matmul_allow_tf32(a.allow_tf32);
  a.torch = !no_torch;
  a.math = !no_math;

  std::printf(
      "attention forward+backward, %s%s on %s, B=%lld H=%lld D=%lld, %s, %d threads, "
      "median of %d rounds x %d steps (ms)\n",
      a.dtype.c_str(), a.allow_tf32 ? " (TF32 allowed)" : "", a.device.c_str(),
      static_cast<long long>(a.batch), static_cast<long long>(a.heads),
      static_cast<long long>(a.dim), a.causal ? "causal" : "no mask", get_num_threads(), a.rounds,
      a.reps);
  std::printf("%6s %10s %10s %10s %14s %14s\n", "T", "fused", "math", "torch", "torch/fused",
              "math/fused");
  std::fflush(stdout);
  // A column skipped (--no-math, --no-torch) or without a result prints as "-".
  auto cell = [](double v, const char* format) {
    if (std::isnan(v)) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, format, v);
    return std::string(buf);
  };
  auto ms = [&](double v) { return cell(v * 1e3, "%.3f"); };
  auto ratio = [&](double v) { return cell(v, "%.2fx"); };
  bool mismatched = false;  // the exit status says so, after every length is timed
  for (int64_t T : a.seqs) {
    std::string mismatch;
    {
      F::SdpBackendGuard kernel(F::SdpBackend::kFused);
      mismatch = check(a, T);
    }
    if (!mismatch.empty()) {
      mismatched = true;
      std::printf("WARNING: T=%lld: %s; timed all the same\n", static_cast<long long>(T),
                  mismatch.c_str());
      std::fflush(stdout);
    }
    std::vector<double> fused, math, torch;
    for (int r = 0; r < a.rounds; ++r) {
      Problem p(a, T);
      {
        F::SdpBackendGuard kernel(F::SdpBackend::kFused);  // on CUDA kAuto would take math
        fused.push_back(time_steps(a, p, a.reps, F::scaled_dot_product_attention));
      }
      if (a.math) math.push_back(time_steps(a, p, a.reps, F::scaled_dot_product_attention_math));
      if (a.torch) torch.push_back(time_torch(a, T));
    }
    const double f = median(fused), m = median(math), t = median(torch);
    std::printf("%6lld %10s %10s %10s %14s %14s\n", static_cast<long long>(T), ms(f).c_str(),
                ms(m).c_str(), ms(t).c_str(), ratio(t / f).c_str(), ratio(m / f).c_str());
    std::fflush(stdout);
  }
  return mismatched ? 1 : 0;
}
