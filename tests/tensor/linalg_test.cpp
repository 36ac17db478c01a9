// Matrix products (tensor/ops/linalg.h) against naive loops written here: mm, bmm, addmm, mm_out
// and matmul's shape rules (1-d promotion, batch broadcasting, folding), strided and transposed
// operands, 0-sized dims, 16-bit dtypes through float32, error messages, CUDA vs CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <ember/tensor/cpu/matmul_dnnl.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_close;
using ember::test::expect_error;
using ember::test::lcg_values;
using ember::test::rand_t;

using namespace ember;

namespace {

// Naive reference: a [..., n, k] @ b [..., k, m] with both already expanded to the same batch,
// in double, from row-major values.
std::vector<double> naive_bmm(const std::vector<double>& a, const std::vector<double>& b,
                              int64_t batch, int64_t n, int64_t k, int64_t m) {
  std::vector<double> c(batch * n * m, 0.0);
  for (int64_t z = 0; z < batch; ++z) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += a[(z * n + i) * k + p] * b[(z * k + p) * m + j];
        c[(z * n + i) * m + j] = s;
      }
    }
  }
  return c;
}

double tol_for(Dtype t, int64_t k) {
  switch (t) {
    case kFloat64:
      return 1e-12 * (k + 1);
    case kFloat32:
      return 1e-5 * (k + 1);
    case kBFloat16:
      return 2e-2 * (k + 1);
    default:
      return 2e-3 * (k + 1);
  }
}

const Dtype kFloatDtypes[] = {kFloat32, kFloat64};

}  // namespace

TEST(Mm, MatchesNaiveLoops) {
  const int64_t shapes[][3] = {{1, 1, 1},  {3, 5, 4},  {17, 33, 9},
                               {64, 1, 7}, {1, 40, 1}, {70, 65, 66}};
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    for (auto& s : shapes) {
      const int64_t n = s[0], k = s[1], m = s[2];
      Tensor a = rand_t({n, k}, dt, n * 7 + k), b = rand_t({k, m}, dt, m * 13 + k);
      Tensor c = mm(a, b);
      EXPECT_EQ(c.shape(), Shape({n, m}));
      EXPECT_EQ(c.dtype(), dt);
      auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, n, k, m);
      expect_close(c, want, tol_for(dt, k), std::string("mm ") + std::string(dtype_name(dt)));
    }
  }
}

TEST(Mm, TransposedAndStridedOperands) {
  for (Dtype dt : kFloatDtypes) {
    const int64_t n = 13, k = 11, m = 9;
    Tensor a = rand_t({n, k}, dt, 1), b = rand_t({k, m}, dt, 2);
    auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, n, k, m);
    const double tol = tol_for(dt, k);
    // Transposed views: BLAS transpose flags, no copies.
    Tensor at = a.t().contiguous().t(), bt = b.t().contiguous().t();
    ASSERT_FALSE(at.is_contiguous());
    expect_close(mm(at, b), want, tol, "a^T layout");
    expect_close(mm(a, bt), want, tol, "b^T layout");
    expect_close(mm(at, bt), want, tol, "both transposed");
    // Row stride larger than the row (a column slice of a wider matrix): a BLAS leading dim.
    Tensor wide = rand_t({n, k + 5}, dt, 3);
    Tensor a_slice = wide.narrow(1, 2, k);
    auto want2 = naive_bmm(a_slice.to_vector<double>(), b.to_vector<double>(), 1, n, k, m);
    expect_close(mm(a_slice, b), want2, tol, "column slice");
    // Every other column: no BLAS layout, copied.
    Tensor twice = rand_t({k, 2 * m}, dt, 4);
    Tensor b_step = twice.slice(1, 0, 2 * m, 2);
    auto want3 = naive_bmm(a.to_vector<double>(), b_step.to_vector<double>(), 1, n, k, m);
    expect_close(mm(a, b_step), want3, tol, "stepped columns");
    // Expanded (zero-stride) rows.
    Tensor row = rand_t({1, k}, dt, 5);
    Tensor a_exp = row.expand({n, k});
    auto want4 = naive_bmm(a_exp.to_vector<double>(), b.to_vector<double>(), 1, n, k, m);
    expect_close(mm(a_exp, b), want4, tol, "expanded rows");
  }
}

TEST(Mm, ZeroSizedDims) {
  for (Dtype dt : kFloatDtypes) {
    // k = 0: an empty sum gives zeros.
    Tensor c = mm(empty({3, 0}, dt), empty({0, 4}, dt));
    EXPECT_EQ(c.shape(), Shape({3, 4}));
    expect_close(c, std::vector<double>(12, 0.0), 0, "k = 0");
    // n = 0 or m = 0: empty results.
    EXPECT_EQ(mm(empty({0, 5}, dt), empty({5, 4}, dt)).shape(), Shape({0, 4}));
    EXPECT_EQ(mm(empty({3, 5}, dt), empty({5, 0}, dt)).shape(), Shape({3, 0}));
    EXPECT_EQ(matmul(empty({2, 0, 5}, dt), empty({5, 3}, dt)).shape(), Shape({2, 0, 3}));
    EXPECT_EQ(matmul(empty({0, 2, 5}, dt), empty({4, 5, 3}, dt).narrow(0, 0, 1)).shape(),
              Shape({0, 2, 3}));
    Tensor z = matmul(empty({2, 3, 0}, dt), empty({0, 2}, dt));
    EXPECT_EQ(z.shape(), Shape({2, 3, 2}));
    expect_close(z, std::vector<double>(12, 0.0), 0, "batched k = 0");
    // addmm with k = 0 is beta * bias.
    Tensor bias = rand_t({3, 4}, dt, 9);
    std::vector<double> want = bias.to_vector<double>();
    for (auto& v : want) v *= 0.5;
    expect_close(addmm(bias, empty({3, 0}, dt), empty({0, 4}, dt), 0.5, 2.0), want, 1e-6,
                 "addmm k = 0");
  }
}

TEST(Matmul, OneDimensionalOperands) {
  for (Dtype dt : kFloatDtypes) {
    const double tol = tol_for(dt, 8);
    Tensor v = rand_t({7}, dt, 1), w = rand_t({7}, dt, 2);
    Tensor dot = matmul(v, w);
    EXPECT_EQ(dot.dim(), 0);
    double want = 0;
    auto vv = v.to_vector<double>(), wv = w.to_vector<double>();
    for (int i = 0; i < 7; ++i) want += vv[i] * wv[i];
    EXPECT_NEAR(dot.item<double>(), want, tol);

    Tensor a = rand_t({5, 7}, dt, 3);
    Tensor av = matmul(a, v);  // [5, 7] @ [7] -> [5]
    EXPECT_EQ(av.shape(), Shape({5}));
    expect_close(av, naive_bmm(a.to_vector<double>(), vv, 1, 5, 7, 1), tol, "2-d @ 1-d");

    Tensor b = rand_t({7, 4}, dt, 4);
    Tensor vb = matmul(v, b);  // [7] @ [7, 4] -> [4]
    EXPECT_EQ(vb.shape(), Shape({4}));
    expect_close(vb, naive_bmm(vv, b.to_vector<double>(), 1, 1, 7, 4), tol, "1-d @ 2-d");

    Tensor bb = rand_t({3, 7, 4}, dt, 5);
    Tensor vbb = matmul(v, bb);  // [7] @ [3, 7, 4] -> [3, 4]
    EXPECT_EQ(vbb.shape(), Shape({3, 4}));
    std::vector<double> rep;
    for (int z = 0; z < 3; ++z) rep.insert(rep.end(), vv.begin(), vv.end());
    expect_close(vbb, naive_bmm(rep, bb.to_vector<double>(), 3, 1, 7, 4), tol, "1-d @ 3-d");

    Tensor aa = rand_t({3, 5, 7}, dt, 6);
    Tensor aav = matmul(aa, v);  // [3, 5, 7] @ [7] -> [3, 5]
    EXPECT_EQ(aav.shape(), Shape({3, 5}));
    expect_close(aav, naive_bmm(aa.to_vector<double>(), vv, 1, 15, 7, 1), tol, "3-d @ 1-d");
  }
}

TEST(Matmul, BroadcastsBatchDims) {
  for (Dtype dt : kFloatDtypes) {
    Tensor a = rand_t({2, 1, 3, 4}, dt, 1), b = rand_t({5, 4, 2}, dt, 2);
    Tensor c = matmul(a, b);
    ASSERT_EQ(c.shape(), Shape({2, 5, 3, 2}));
    // Reference: expand both to [2, 5, ...] by hand.
    auto av = a.to_vector<double>(), bv = b.to_vector<double>();
    std::vector<double> ae, be;
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 5; ++j) {
        ae.insert(ae.end(), av.begin() + i * 12, av.begin() + (i + 1) * 12);
        be.insert(be.end(), bv.begin() + j * 8, bv.begin() + (j + 1) * 8);
      }
    }
    expect_close(c, naive_bmm(ae, be, 10, 3, 4, 2), tol_for(dt, 4), "broadcast batch");
    // Also through a transposed batch operand (the batched path over strided views).
    Tensor bt = b.transpose(1, 2).contiguous().transpose(1, 2);
    expect_close(matmul(a, bt), naive_bmm(ae, be, 10, 3, 4, 2), tol_for(dt, 4),
                 "broadcast batch, transposed b");
    // 2-d @ batched: a is broadcast over b's batch.
    Tensor m2 = rand_t({3, 4}, dt, 3);
    Tensor c2 = matmul(m2, b);
    ASSERT_EQ(c2.shape(), Shape({5, 3, 2}));
    auto mv = m2.to_vector<double>();
    std::vector<double> me;
    for (int j = 0; j < 5; ++j) me.insert(me.end(), mv.begin(), mv.end());
    expect_close(c2, naive_bmm(me, bv, 5, 3, 4, 2), tol_for(dt, 4), "2-d @ 3-d");
  }
}

TEST(Matmul, FoldsBatchedTimesMatrixAndHandlesStridedBatches) {
  for (Dtype dt : kFloatDtypes) {
    Tensor a = rand_t({2, 3, 6, 5}, dt, 1), b = rand_t({5, 4}, dt, 2);
    auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, 36, 5, 4);
    Tensor c = matmul(a, b);
    ASSERT_EQ(c.shape(), Shape({2, 3, 6, 4}));
    expect_close(c, want, tol_for(dt, 5), "folded");
    // A permuted batch (leading dims do not merge): the batched path on strided views.
    Tensor ap = a.permute({1, 0, 2, 3}).contiguous().permute({1, 0, 2, 3});
    ASSERT_FALSE(ap.is_contiguous());
    expect_close(matmul(ap, b), want, tol_for(dt, 5), "permuted batch");
    // Method sugar.
    expect_close(a.matmul(b), want, tol_for(dt, 5), "Tensor::matmul");
  }
}

TEST(Bmm, MatchesNaiveWithTransposedBatches) {
  for (Dtype dt : kFloatDtypes) {
    Tensor a = rand_t({4, 6, 3}, dt, 1), b = rand_t({4, 3, 5}, dt, 2);
    auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 4, 6, 3, 5);
    expect_close(bmm(a, b), want, tol_for(dt, 3), "bmm");
    Tensor at = a.transpose(1, 2).contiguous().transpose(1, 2);
    Tensor bt = b.transpose(1, 2).contiguous().transpose(1, 2);
    expect_close(bmm(at, bt), want, tol_for(dt, 3), "bmm transposed");
    Tensor bexp = b.narrow(0, 0, 1).expand({4, 3, 5});
    auto want2 = naive_bmm(a.to_vector<double>(), bexp.to_vector<double>(), 4, 6, 3, 5);
    expect_close(bmm(a, bexp), want2, tol_for(dt, 3), "bmm expanded");
  }
}

TEST(Addmm, BroadcastsBiasAndScales) {
  for (Dtype dt : {kFloat32, kFloat64, kBFloat16}) {
    const int64_t n = 5, k = 6, m = 4;
    Tensor a = rand_t({n, k}, dt, 1), b = rand_t({k, m}, dt, 2);
    auto prod = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, n, k, m);
    for (Shape bs : {Shape({m}), Shape({n, 1}), Shape({n, m}), Shape({1, m}), Shape()}) {
      Tensor bias = rand_t(bs, dt, 3 + bs.size());
      Tensor full_bias = bias.expand({n, m}).contiguous();
      auto bv = full_bias.to_vector<double>();
      std::vector<double> want(n * m);
      for (int64_t i = 0; i < n * m; ++i) want[i] = 0.5 * bv[i] + 2.0 * prod[i];
      expect_close(addmm(bias, a, b, 0.5, 2.0), want, tol_for(dt, k), "addmm");
      for (int64_t i = 0; i < n * m; ++i) want[i] = bv[i] + prod[i];
      expect_close(addmm(bias, a, b), want, tol_for(dt, k), "addmm default scales");
    }
    // beta = 0 ignores the bias entirely, NaNs included.
    Tensor nan_bias = full({m}, std::numeric_limits<double>::quiet_NaN(), dt);
    expect_close(addmm(nan_bias, a, b, 0, 1), prod, tol_for(dt, k), "beta = 0");
  }
}

// A CPU without AVX-512 has no bfloat16 matmul in Debian's oneDNN: its products go through
// float32 copies and sgemm. Forced here, so every machine checks that path: shapes, transposed
// and sliced operands, and addmm's scales, against naive loops.
TEST(Mm, Bf16ThroughFloat32MatchesNaiveLoops) {
  detail::force_bf16_gemm_through_f32(true);
  struct Reset {
    ~Reset() { detail::force_bf16_gemm_through_f32(false); }
  } reset;
  const int64_t shapes[][3] = {{1, 1, 1}, {3, 5, 4}, {17, 33, 9}, {70, 65, 66}, {300, 260, 270}};
  for (auto& s : shapes) {
    const int64_t n = s[0], k = s[1], m = s[2];
    Tensor a = rand_t({n, k}, kBFloat16, n * 7 + k), b = rand_t({k, m}, kBFloat16, m * 13 + k);
    auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, n, k, m);
    const std::string what = "bf16 through f32 " + std::to_string(n) + "x" + std::to_string(k);
    expect_close(mm(a, b), want, tol_for(kBFloat16, k), what);
    expect_close(mm(a.t().contiguous().t(), b.t().contiguous().t()), want, tol_for(kBFloat16, k),
                 what + ", both transposed");
    Tensor bias = rand_t({n, m}, kBFloat16, 9);
    auto bv = bias.to_vector<double>();
    std::vector<double> scaled(n * m);
    for (int64_t i = 0; i < n * m; ++i) scaled[i] = 0.5 * bv[i] + 2.0 * want[i];
    expect_close(addmm(bias, a, b, 0.5, 2.0), scaled, tol_for(kBFloat16, k), what + ", addmm");
  }
  Tensor wide = rand_t({13, 16}, kBFloat16, 3), b = rand_t({11, 9}, kBFloat16, 4);
  Tensor a_slice = wide.narrow(1, 2, 11);
  expect_close(mm(a_slice, b),
               naive_bmm(a_slice.to_vector<double>(), b.to_vector<double>(), 1, 13, 11, 9),
               tol_for(kBFloat16, 11), "bf16 through f32, column slice");
}

// float32 and bfloat16 products run on cached oneDNN primitives, one per shape and thread count,
// shared by every thread: several threads multiplying the same shapes at once (ranks as threads)
// each get their own product, before and after the thread count changes.
TEST(Mm, SameShapesFromSeveralThreadsAndThreadCounts) {
  const int before = get_num_threads();
  for (Dtype dt : {kFloat32, kBFloat16}) {
    const int64_t n = 96, k = 80, m = 72;
    for (int threads : {2, 1}) {
      set_num_threads(threads);
      constexpr int kThreads = 4;
      std::vector<Tensor> as, bs, cs(kThreads);
      for (int t = 0; t < kThreads; ++t) {
        as.push_back(rand_t({n, k}, dt, 10 + t));
        bs.push_back(rand_t({m, k}, dt, 20 + t).t());  // a transposed operand too
      }
      std::vector<std::thread> workers;
      for (int t = 0; t < kThreads; ++t) {
        workers.emplace_back([&, t] {
          for (int rep = 0; rep < 5; ++rep) cs[t] = mm(as[t], bs[t]);
        });
      }
      for (auto& w : workers) w.join();
      for (int t = 0; t < kThreads; ++t) {
        auto want = naive_bmm(as[t].to_vector<double>(), bs[t].contiguous().to_vector<double>(), 1,
                              n, k, m);
        expect_close(cs[t], want, tol_for(dt, k),
                     std::string("thread ") + std::to_string(t) + " " + std::string(dtype_name(dt)));
      }
    }
  }
  set_num_threads(before);
}

TEST(MmOut, WritesIntoExistingTensors) {
  for (Dtype dt : kFloatDtypes) {
    Tensor a = rand_t({4, 3}, dt, 1), b = rand_t({3, 5}, dt, 2);
    auto want = naive_bmm(a.to_vector<double>(), b.to_vector<double>(), 1, 4, 3, 5);
    Tensor out = full({4, 5}, 7.0, dt);
    Tensor& r = mm_out(out, a, b);
    EXPECT_TRUE(r.is_same(out));
    expect_close(out, want, tol_for(dt, 3), "mm_out");
    // A non-contiguous out (transposed view) is written through.
    Tensor base = zeros({5, 4}, dt);
    Tensor out_t = base.t();
    mm_out(out_t, a, b);
    expect_close(base.t(), want, tol_for(dt, 3), "mm_out transposed");
    // out aliasing an input.
    Tensor sq = rand_t({4, 4}, dt, 3);
    auto sqv = sq.to_vector<double>();
    auto want_sq = naive_bmm(sqv, sqv, 1, 4, 4, 4);
    mm_out(sq, sq, sq);
    expect_close(sq, want_sq, tol_for(dt, 4), "mm_out aliasing");
  }
}

TEST(Linalg, ErrorsNameOpAndShapes) {
  Tensor a = zeros({2, 3}), b = zeros({4, 5});
  expect_error([&] { mm(a, b); }, {"[mm]", "[2, 3]", "[4, 5]"});
  expect_error([&] { matmul(a, b); }, {"[matmul]", "[2, 3]", "[4, 5]"});
  expect_error([&] { matmul(zeros({3}), zeros({4})); }, {"[matmul]", "[3]", "[4]"});
  expect_error([&] { matmul(scalar_tensor(1.0), a); }, {"[matmul]", "0-d"});
  expect_error([&] { mm(zeros({2, 3, 1}), b); }, {"[mm]", "2-d", "[2, 3, 1]"});
  expect_error(
      [&] {
        bmm(zeros({2, 3, 4}), zeros({3, 4, 5}));
      },
      {"[bmm]", "batch", "[2, 3, 4]", "[3, 4, 5]"});
  expect_error(
      [&] {
        matmul(zeros({2, 3, 4}), zeros({3, 4, 5}));
      },
      {"matmul", "[2]", "[3]"});
  EXPECT_THROW(mm(zeros({2, 2}, kInt64), zeros({2, 2}, kInt64)), TypeError);
  expect_error(
      [&] {
        mm(zeros({2, 2}, kInt64), zeros({2, 2}, kInt64));
      },
      {"[mm]", "int64"});
  EXPECT_THROW(mm(zeros({2, 2}), zeros({2, 2}, kFloat64)), TypeError);
  expect_error(
      [&] {
        mm(zeros({2, 2}), zeros({2, 2}, kFloat64));
      },
      {"[mm]", "float32", "float64"});
  expect_error(
      [&] {
        addmm(zeros({3}), a, zeros({3, 4}));
      },
      {"[addmm]", "bias", "[3]", "[2, 4]"});
  expect_error(
      [&] {
        addmm(zeros({4}, kFloat64), a, zeros({3, 4}));
      },
      {"[addmm]", "float64", "float32"});
  Tensor bad_out = zeros({3, 3});
  expect_error(
      [&] {
        mm_out(bad_out, a, zeros({3, 4}));
      },
      {"[mm_out]", "[2, 4]", "[3, 3]"});
  expect_error([&] { mm(Tensor(), a); }, {"[mm]", "'a'"});
  // Mixed devices need a CUDA tensor: checked by LinalgCuda.MatchesCpu where a GPU exists.
}

// addmm with a [m] bias, alpha = beta = 1 (a Linear layer): the bias comes from cuBLASLt's
// epilogue, for every operand layout a Linear produces or a view can (transposed, offset,
// unaligned), shapes from one row to GPT-sized; float64 and other cases take the general path.
TEST(LinalgCuda, AddmmBiasEpilogueMatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  struct Shape3 {
    int64_t n, k, m;
  };
  for (Dtype dt : {kFloat32, kFloat16, kBFloat16, kFloat64}) {
    for (Shape3 s : {Shape3{1, 8, 8}, Shape3{33, 40, 17}, Shape3{64, 128, 256},
                     Shape3{1000, 384, 1152}}) {
      const double tol = dt == kFloat32 ? 1e-4 : dt == kFloat64 ? 1e-10 : tol_for(dt, s.k);
      const Tensor x = rand_t({s.n, s.k}, dt, 1), w = rand_t({s.m, s.k}, dt, 2);
      const Tensor bias_big = rand_t({s.m + 1}, dt, 3);
      const Tensor xt = rand_t({s.k, s.n}, dt, 4).t();           // a column-major a
      const Tensor wt = rand_t({s.k, s.m}, dt, 5);               // a row-major b
      for (int variant = 0; variant < 4; ++variant) {
        const Tensor a = variant % 2 == 0 ? x : xt;
        const Tensor b = variant < 2 ? w.t() : wt;
        const Tensor bias = variant == 3 ? bias_big.narrow(0, 1, s.m) : bias_big.narrow(0, 0, s.m);
        const std::string what = std::string(dtype_name(dt)) + " n=" + std::to_string(s.n) +
                                 " k=" + std::to_string(s.k) + " m=" + std::to_string(s.m) +
                                 " variant " + std::to_string(variant);
        // The device operands as the same views of device copies.
        const Tensor ga = variant % 2 == 0 ? x.cuda() : xt.t().contiguous().cuda().t();
        const Tensor gb = variant < 2 ? w.cuda().t() : wt.cuda();
        const Tensor gbias = bias_big.cuda().narrow(0, variant == 3 ? 1 : 0, s.m);
        const Tensor got = addmm(gbias, ga, gb);
        EXPECT_EQ(got.shape(), Shape({s.n, s.m})) << what;
        expect_close(got.cpu(), addmm(bias, a, b).to_vector<double>(), tol, what);
      }
    }
  }
}

// allow_tf32 as PyTorch's: off by default (float32 products exact), and when on, float32
// matmuls (the plain GEMM and the bias epilogue) may round their operands to TF32's 10-bit
// mantissa. 1 + 2^-12 is a float32 TF32 cannot hold: 64 such products sum to 64 + 2^-6 in
// float32 and to 64 in TF32.
TEST(LinalgCuda, AllowTf32IsOffByDefaultAndRoundsFloat32MatmulsWhenOn) {
  EXPECT_FALSE(ember::cuda::matmul_allow_tf32());
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  const Tensor a = full({64, 64}, 1.0 + std::ldexp(1.0, -12)).cuda();
  const Tensor b = ones({64, 64}).cuda(), bias = zeros({64}).cuda();
  const double exact = 64.0 + std::ldexp(1.0, -6);
  EXPECT_EQ(mm(a, b).cpu().to_vector<double>()[0], exact);
  EXPECT_EQ(addmm(bias, a, b).cpu().to_vector<double>()[0], exact);
  ember::cuda::set_matmul_allow_tf32(true);
  const double tf32_mm = mm(a, b).cpu().to_vector<double>()[0];
  const double tf32_addmm = addmm(bias, a, b).cpu().to_vector<double>()[0];
  const double f64 = mm(a.to(kFloat64), b.to(kFloat64)).cpu().to_vector<double>()[0];
  ember::cuda::set_matmul_allow_tf32(false);
  EXPECT_EQ(tf32_mm, 64.0) << "TF32 tensor cores round 1 + 2^-12 to 1";
  EXPECT_EQ(tf32_addmm, 64.0) << "the bias epilogue too";
  EXPECT_EQ(f64, exact) << "float64 never uses TF32";
  EXPECT_EQ(mm(a, b).cpu().to_vector<double>()[0], exact) << "off again";
}

TEST(LinalgCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    const double tol = dt == kFloat32 ? 1e-4 : tol_for(dt, 40);
    Tensor a = rand_t({2, 1, 33, 40}, dt, 1), b = rand_t({5, 40, 17}, dt, 2);
    Tensor want = matmul(a, b);
    expect_close(matmul(a.cuda(), b.cuda()).cpu(), want.to_vector<double>(), tol, "batched");
    Tensor at = rand_t({40, 33}, dt, 3).t(), bt = rand_t({17, 40}, dt, 4).t();
    expect_close(mm(at.cuda(), bt.cuda()).cpu(), mm(at, bt).to_vector<double>(), tol, "transposed");
    Tensor bias = rand_t({17}, dt, 5);
    expect_close(addmm(bias.cuda(), at.cuda(), bt.cuda(), 0.5, 2).cpu(),
                 addmm(bias, at, bt, 0.5, 2).to_vector<double>(), tol, "addmm");
    Tensor v = rand_t({40}, dt, 6);
    expect_close(matmul(v.cuda(), v.cuda()).cpu(), matmul(v, v).to_vector<double>(), tol, "dot");
    Tensor z = matmul(empty({3, 0}, dt).cuda(), empty({0, 4}, dt).cuda()).cpu();
    expect_close(z, std::vector<double>(12, 0.0), 0, "k = 0");
    Tensor kb = rand_t({3, 4}, dt, 7);
    std::vector<double> half_bias = kb.to_vector<double>();
    for (auto& x : half_bias) x *= 0.5;
    expect_close(addmm(kb.cuda(), empty({3, 0}, dt).cuda(), empty({0, 4}, dt).cuda(), 0.5, 1).cpu(),
                 half_bias, 1e-2, "addmm k = 0");
  }
  expect_error(
      [&] {
        mm(zeros({2, 2}), zeros({2, 2}).cuda());
      },
      {"[mm]", "cpu", "cuda:0"});
}
