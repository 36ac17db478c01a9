// Core tensor machinery: dtypes and promotion, half types, shapes, views, copies, creation,
// printing, the caching allocator, and CUDA reporting on machines without a GPU.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <string>

#include <ember/tensor/ops.h>
#include "tests/tensor/test_util.h"

using namespace ember;

TEST(Dtype, PromotionFollowsPyTorch) {
  EXPECT_EQ(promote_types(kBool, kUInt8), kUInt8);
  EXPECT_EQ(promote_types(kUInt8, kInt32), kInt32);
  EXPECT_EQ(promote_types(kInt32, kInt64), kInt64);
  EXPECT_EQ(promote_types(kInt64, kFloat16), kFloat16);
  EXPECT_EQ(promote_types(kFloat16, kBFloat16), kFloat32);
  EXPECT_EQ(promote_types(kBFloat16, kFloat32), kFloat32);
  EXPECT_EQ(promote_types(kFloat32, kFloat64), kFloat64);
  EXPECT_EQ(promote_types(kInt64, kInt64), kInt64);
  // Scalars raise the category, never the width.
  EXPECT_EQ(promote_with_scalar(kFloat16, ScalarKind::Floating), kFloat16);
  EXPECT_EQ(promote_with_scalar(kInt32, ScalarKind::Integral), kInt32);
  EXPECT_EQ(promote_with_scalar(kInt32, ScalarKind::Floating), kFloat32);
  EXPECT_EQ(promote_with_scalar(kBool, ScalarKind::Integral), kInt64);
  EXPECT_EQ(promote_with_scalar(kUInt8, ScalarKind::Bool), kUInt8);
}

TEST(Dtype, NamesRoundTripAndBadNameIsClear) {
  for (int i = 0; i < kNumDtypes; ++i) {
    Dtype t = static_cast<Dtype>(i);
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  }
  EXPECT_EQ(dtype_from_name("half"), kFloat16);
  try {
    dtype_from_name("float8");
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("float8"), std::string::npos) << e.what();
  }
}

TEST(Half, ConversionsRoundToNearestEven) {
  // Exactly representable values survive.
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f /*2^-14*/, 5.9604645e-8f /*2^-24*/}) {
    EXPECT_EQ(static_cast<float>(Half(v)), v) << v;
  }
  EXPECT_EQ(Half(1.0f).x, 0x3c00);
  EXPECT_EQ(Half(-2.0f).x, 0xc000);
  EXPECT_EQ(Half(65520.0f).x, 0x7c00);  // rounds up to inf
  EXPECT_EQ(Half(65519.0f).x, 0x7bff);  // rounds down to max
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(Half(1.0f + 0.00048828125f).x, 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9: ties to even (up).
  EXPECT_EQ(Half(1.0f + 3 * 0.00048828125f).x, 0x3c02);
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(std::nanf("")))));
  EXPECT_TRUE(std::isinf(static_cast<float>(Half(1e6f))));
  // Subnormals: 3 * 2^-25 is halfway between 2^-24 and 2^-23: ties to even (2^-23).
  EXPECT_EQ(Half(3 * 2.98023224e-8f).x, 0x0002);
}

TEST(Half, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(BFloat16(1.0f).x, 0x3f80);
  EXPECT_EQ(static_cast<float>(BFloat16(3.0f)), 3.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(BFloat16(1.00390625f).x, 0x3f80);
  EXPECT_EQ(BFloat16(1.01171875f).x, 0x3f82);  // 1 + 3*2^-8 ties up to even
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::nanf("")))));
}

TEST(Device, ParsesAndRejects) {
  EXPECT_TRUE(Device("cpu").is_cpu());
  EXPECT_EQ(Device("cuda:3").index, 3);
  EXPECT_EQ(Device("cuda").index, 0);
  EXPECT_EQ(Device("cuda:1").str(), "cuda:1");
  EXPECT_THROW(Device("gpu"), ValueError);
  EXPECT_THROW(Device("cuda:x"), ValueError);
  EXPECT_THROW(Device("cuda:"), ValueError);
}

TEST(Shape, BroadcastRulesAndErrors) {
  EXPECT_EQ(broadcast_shapes("t", {3, 1, 5}, {4, 1}), Shape({3, 4, 5}));
  EXPECT_EQ(broadcast_shapes("t", {}, {2, 3}), Shape({2, 3}));
  EXPECT_EQ(broadcast_shapes("t", {0, 1}, {1, 7}), Shape({0, 7}));
  try {
    broadcast_shapes("add", {2, 3}, {4});
    FAIL();
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("[add]"), std::string::npos) << m;
    EXPECT_NE(m.find("[2, 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("[4]"), std::string::npos) << m;
  }
  EXPECT_EQ(wrap_dim("t", -1, 3), 2);
  EXPECT_THROW(wrap_dim("t", 3, 3), IndexError);
}

TEST(Creation, FillsAndDtypes) {
  Tensor z = zeros({2, 3});
  EXPECT_EQ(z.dtype(), kFloat32);
  EXPECT_EQ(z.shape(), Shape({2, 3}));
  for (float v : z.to_vector<float>()) EXPECT_EQ(v, 0.0f);
  Tensor o = ones({4}, kInt32);
  EXPECT_EQ(o.to_vector<int32_t>(), std::vector<int32_t>({1, 1, 1, 1}));
  EXPECT_EQ(full({2}, 7).dtype(), kInt64);
  EXPECT_EQ(full({2}, 7.5).dtype(), kFloat32);
  EXPECT_EQ(full({2}, true).dtype(), kBool);
  EXPECT_EQ(full({2}, 2.5, kFloat16).to_vector<float>(), std::vector<float>({2.5f, 2.5f}));
  Tensor e = empty({0, 3});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_THROW(empty({-1}), ValueError);
}

TEST(Creation, RangesAndEye) {
  EXPECT_EQ(arange(5).to_vector<int64_t>(), std::vector<int64_t>({0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(5).dtype(), kInt64);
  EXPECT_EQ(arange(1, 10, 3).to_vector<int64_t>(), std::vector<int64_t>({1, 4, 7}));
  EXPECT_EQ(arange(5, 0, -2).to_vector<int64_t>(), std::vector<int64_t>({5, 3, 1}));
  Tensor f = arange(0.0, 1.0, 0.25);
  EXPECT_EQ(f.dtype(), kFloat32);
  EXPECT_EQ(f.to_vector<float>(), std::vector<float>({0, 0.25, 0.5, 0.75}));
  EXPECT_THROW(arange(0, 5, 0), ValueError);
  EXPECT_THROW(arange(5, 0, 1), ValueError);
  Tensor l = linspace(0, 1, 5, kFloat64);
  EXPECT_EQ(l.to_vector<double>(), std::vector<double>({0, 0.25, 0.5, 0.75, 1.0}));
  EXPECT_EQ(linspace(-1, 1, 1).to_vector<float>(), std::vector<float>({-1}));
  Tensor i = eye(2, 3);
  EXPECT_EQ(i.to_vector<float>(), std::vector<float>({1, 0, 0, 0, 1, 0}));
}

TEST(Creation, FromBlobSharesMemoryAndRunsDeleter) {
  static int deleted = 0;
  float* buf = new float[6]{0, 1, 2, 3, 4, 5};
  {
    Tensor t = from_blob(buf, {2, 3}, kFloat32, [](void* p) {
      delete[] static_cast<float*>(p);
      ++deleted;
    });
    EXPECT_EQ(t.data<float>(), buf);
    Tensor c = t.t();
    EXPECT_EQ(c.contiguous().to_vector<float>(), std::vector<float>({0, 3, 1, 4, 2, 5}));
  }
  EXPECT_EQ(deleted, 1);
  int64_t vals[3] = {10, 20, 30};
  Tensor s = from_blob(vals, {2}, {2}, kInt64);  // strided: 10, 30
  EXPECT_EQ(s.to_vector<int64_t>(), std::vector<int64_t>({10, 30}));
  EXPECT_THROW(from_blob(nullptr, {2}, kFloat32), ValueError);
}

TEST(Creation, FromBlobRefusesAnAddressItsDtypeCannotSitAt) {
  alignas(8) unsigned char buf[64] = {};
  for (int i = 0; i < 16; ++i) buf[4 + i] = static_cast<unsigned char>(i);
  // One byte past a float boundary: no float32 element can start there.
  try {
    from_blob(buf + 1, {4}, kFloat32);
    ADD_FAILURE() << "a float32 tensor at an odd address was accepted";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[from_blob]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
    EXPECT_NE(msg.find("multiple of 4 bytes"), std::string::npos) << msg;
  }
  EXPECT_THROW(from_blob(buf + 4, {2}, kFloat64), ValueError);
  EXPECT_THROW(from_blob(buf + 2, {2}, kInt32), ValueError);
  // Where the element size divides the address, the memory is used as it is.
  EXPECT_EQ(from_blob(buf + 4, {2}, kInt32).data_ptr(), static_cast<void*>(buf + 4));
  EXPECT_EQ(from_blob(buf + 5, {2}, kUInt8).to_vector<uint8_t>(), std::vector<uint8_t>({1, 2}));
  EXPECT_EQ(from_blob(buf + 6, {2}, kBFloat16).numel(), 2);
}

TEST(Views, ShareStorageAndMatchPyTorchStrides) {
  Tensor a = arange(24).view({2, 3, 4});
  EXPECT_EQ(a.strides(), Shape({12, 4, 1}));
  Tensor p = a.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), Shape({4, 2, 3}));
  EXPECT_EQ(p.strides(), Shape({1, 12, 4}));
  EXPECT_FALSE(p.is_contiguous());
  EXPECT_EQ(p.storage(), a.storage());
  // movedim: the same view as the permutation that moves one dim; negative dims wrap.
  EXPECT_EQ(a.movedim(2, 0).strides(), p.strides());
  EXPECT_EQ(a.movedim(-1, 0).shape(), Shape({4, 2, 3}));
  EXPECT_EQ(a.movedim(0, 2).shape(), Shape({3, 4, 2}));
  EXPECT_EQ(a.movedim(0, 2).strides(), a.permute({1, 2, 0}).strides());
  EXPECT_EQ(a.movedim(1, 1).strides(), a.strides());
  EXPECT_EQ(a.movedim(2, 0).movedim(0, 2).strides(), a.strides());
  EXPECT_THROW(a.movedim(3, 0), IndexError);
  // Writes through a view are seen by the base.
  a.select(1, 2).fill_(-1);
  EXPECT_EQ(a[0][2][3].item<int64_t>(), -1);
  EXPECT_EQ(a[1][2][0].item<int64_t>(), -1);
  EXPECT_EQ(a[1][1][0].item<int64_t>(), 16);
  // narrow / slice with step / negative indices.
  Tensor r = arange(10);
  EXPECT_EQ(r.narrow(0, 2, 3).to_vector<int64_t>(), std::vector<int64_t>({2, 3, 4}));
  EXPECT_EQ(r.slice(0, 1, -1, 3).to_vector<int64_t>(), std::vector<int64_t>({1, 4, 7}));
  EXPECT_EQ(r.slice(0, -3).to_vector<int64_t>(), std::vector<int64_t>({7, 8, 9}));
  EXPECT_EQ(r.slice(0, 20).numel(), 0);
  EXPECT_THROW(r.narrow(0, 8, 3), IndexError);
  EXPECT_THROW(r.select(0, 10), IndexError);
  // view infers -1 and refuses incompatible strides; reshape copies then.
  EXPECT_EQ(a.view({-1, 4}).shape(), Shape({6, 4}));
  EXPECT_THROW(a.view({5, -1}), ValueError);
  EXPECT_THROW(p.view({-1}), ValueError);
  Tensor flat = p.reshape({-1});
  EXPECT_NE(flat.storage(), a.storage());
  EXPECT_EQ(flat[1].item<int64_t>(), 4);  // p[0][0][1] = a[0][1][0]
  // A transposed tensor viewed by merging only contiguous dims works without a copy.
  Tensor t = arange(12).view({3, 4}).t();  // [4, 3] strides [1, 4]
  EXPECT_EQ(t.unsqueeze(0).view({4, 3}).storage(), t.storage());
}

TEST(Views, ExpandSqueezeUnsqueezeAsStrided) {
  Tensor v = arange(3).view({3, 1});
  Tensor e = v.expand({2, 3, 4});
  EXPECT_EQ(e.strides(), Shape({0, 1, 0}));
  EXPECT_EQ(e.contiguous().to_vector<int64_t>()[4], 1);
  EXPECT_THROW(v.expand({3, 2, 2}), ValueError);  // would change a non-singleton dim? no: 3->2
  EXPECT_EQ(v.expand({-1, 5}).shape(), Shape({3, 5}));
  Tensor s = zeros({1, 3, 1, 2});
  EXPECT_EQ(s.squeeze().shape(), Shape({3, 2}));
  EXPECT_EQ(s.squeeze(2).shape(), Shape({1, 3, 2}));
  EXPECT_EQ(s.squeeze(1).shape(), s.shape());
  EXPECT_EQ(s.unsqueeze(-1).shape(), Shape({1, 3, 1, 2, 1}));
  EXPECT_EQ(s.unsqueeze(0).shape(), Shape({1, 1, 3, 1, 2}));
  Tensor r = arange(6);
  Tensor w = r.as_strided({2, 2}, {1, 2}, 1);  // [[1, 3], [2, 4]]
  EXPECT_EQ(w.contiguous().to_vector<int64_t>(), std::vector<int64_t>({1, 3, 2, 4}));
  EXPECT_THROW(r.as_strided({4}, {2}), ValueError);  // would read past the storage
  EXPECT_EQ(arange(6).view({2, 3}).flatten().shape(), Shape({6}));
  EXPECT_EQ(zeros({2, 3, 4, 5}).flatten(1, 2).shape(), Shape({2, 12, 5}));
  EXPECT_THROW(zeros({2, 3}).permute({0, 0}), ValueError);
  EXPECT_THROW(zeros({2, 3}).permute({0}), ValueError);
}

// Sizes and dims that used to pass unchecked: a narrow whose end overflows int64 (it made a
// view far past the storage), negative expanded sizes, out-of-range dims of a 0-dim tensor
// (PyTorch takes -1 and 0 there), and element counts that overflow int64 (they wrapped to 0
// elements on a 0-byte storage under a huge shape).
TEST(Views, BadSizesAndDimsAreRefused) {
  const int64_t big = int64_t{1} << 32;
  test::expect_error<IndexError>([] { arange(10).narrow(0, 1, INT64_MAX); },
                                 {"[narrow]", "exceeds dimension size (10)"});
  test::expect_error<IndexError>([] { arange(10).narrow(0, 11, 0); }, {"[narrow]"});
  EXPECT_EQ(arange(10).narrow(0, 10, 0).numel(), 0);
  test::expect_error<ValueError>(
      [] { ones({1}).expand({-2}); },
      {"[expand] the expanded size -2 at dimension 0 must be non-negative"});
  test::expect_error<ValueError>([] { ones({1, 1}).expand({-2, -3}); }, {"[expand]", "-2"});
  const Tensor s = scalar_tensor(1.0);
  test::expect_error<IndexError>([&] { s.transpose(3, 7); },
                                 {"[transpose] dimension out of range"});
  test::expect_error<IndexError>([&] { s.squeeze(5); }, {"[squeeze] dimension out of range"});
  test::expect_error<IndexError>([&] { s.flatten(4, 9); }, {"[flatten] dimension out of range"});
  EXPECT_EQ(s.transpose(0, -1).dim(), 0);
  EXPECT_EQ(s.squeeze(-1).dim(), 0);
  EXPECT_EQ(s.flatten(0, -1).shape(), Shape({1}));
  test::expect_error<ValueError>([&] { zeros({big, big}); }, {"[empty]", "overflows int64"});
  test::expect_error<ValueError>(
      [&] {
        zeros({big, big / 8}, kFloat64);
      },
      {"[empty]", "in bytes", "overflows int64"});
  test::expect_error<ValueError>(
      [&] {
        zeros({0}).view({big, big});
      },
      {"[view]", "overflows int64"});
}

// Writes whose result would depend on the order the loop visits the elements are refused, as
// in PyTorch: an output sharing some, but not all, of its memory with an input (a + a^T into a
// gave [[0, 3], [5, 6]]), and an expanded output, several of whose elements are one location
// (copy_ kept the last value; scatter_add_ raced between threads). The same elements, and
// disjoint views of one storage, stay fine.
TEST(Copy, OverlapsThatWouldDependOnTheLoopOrderAreRefused) {
  Tensor a = arange(0, 4, 1, kFloat32).view({2, 2});
  test::expect_error<ValueError>([&] { a.add_(a.t()); }, {"[add_]", "share memory", "clone()"});
  test::expect_error<ValueError>([&] { a.add_(a[0]); }, {"[add_]", "share memory"});
  Tensor x = ones({16});
  test::expect_error<ValueError>([&] { x.narrow(0, 1, 15).copy_(x.narrow(0, 0, 15)); },
                                 {"[copy_]", "share memory"});
  Tensor out = x.narrow(0, 0, 8);
  test::expect_error<ValueError>([&] { add_out(out, x.narrow(0, 4, 8), x.narrow(0, 8, 8)); },
                                 {"[add_out]", "share memory"});
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>(16, 1.0f)) << "a refused write wrote";
  a.add_(a.t().clone());
  EXPECT_EQ(a.to_vector<float>(), std::vector<float>({0, 3, 3, 6}));
  a.mul_(a);  // the same elements
  EXPECT_EQ(a.to_vector<float>(), std::vector<float>({0, 9, 9, 36}));
  Tensor row = arange(0, 4, 1, kFloat32);
  row.unsqueeze(0).add_(row);  // the same elements under another shape
  row.view({1, 4}).copy_(row);
  EXPECT_EQ(row.to_vector<float>(), std::vector<float>({0, 2, 4, 6}));
  x.narrow(0, 0, 8).add_(x.narrow(0, 8, 8));  // disjoint halves of one storage
  EXPECT_EQ(x.to_vector<float>()[0], 2.0f);
  Tensor ex = zeros({1}).expand({3});
  test::expect_error<ValueError>(
      [&] {
        ex.copy_(tensor({1.f, 2.f, 3.f}));
      },
      {"[copy_] cannot write into a tensor where several elements share"});
  test::expect_error<ValueError>(
      [&] {
        index_add_(ex, 0, tensor({0, 1, 2}), ones({3}));
      },
      {"[index_add_] cannot write"});
  Tensor rows = zeros({1, 4}).expand({64, 4});
  test::expect_error<ValueError>(
      [&] {
        scatter_add_(rows, 1, zeros({64, 4}, kInt64), ones({64, 4}));
      },
      {"[scatter_add_] cannot write"});
}

// A value the dtype cannot hold is refused (PyTorch's "cannot be converted ... without
// overflow") instead of wrapping: 300 into uint8 gave 44. Floating values into integer dtypes
// are truncated when they fit; infinities and NaN fill floating tensors.
TEST(Creation, ValuesTheDtypeCannotHoldAreRefused) {
  test::expect_error<ValueError>(
      [] { full({1}, 300, kUInt8); },
      {"[fill_] value 300 cannot be converted to uint8 without overflow"});
  test::expect_error<ValueError>([] { full({1}, -1, kUInt8); }, {"uint8"});
  test::expect_error<ValueError>([] { full({2}, 1e20, kInt32); }, {"int32"});
  test::expect_error<ValueError>([] { full({2}, 1e20, kInt64); }, {"int64"});
  test::expect_error<ValueError>([] { full({1}, 1e6, kFloat16); }, {"float16"});
  test::expect_error<ValueError>([] { zeros({2}).fill_(1e300); }, {"float32"});
  EXPECT_EQ(full({1}, 255, kUInt8).item<int64_t>(), 255);
  EXPECT_EQ(full({1}, -2.5, kInt32).item<int64_t>(), -2);
  EXPECT_EQ(full({1}, INT64_MIN, kInt64).item<int64_t>(), INT64_MIN);
  EXPECT_TRUE(std::isinf(full({1}, -INFINITY, kFloat16).item<float>()));
  EXPECT_TRUE(std::isnan(full({1}, NAN, kBFloat16).item<float>()));
  EXPECT_EQ(full({1}, 65504, kFloat16).item<float>(), 65504.0f);
}

TEST(Copy, ConvertsDtypesBroadcastsAndBumpsVersion) {
  Tensor f = tensor({1.5f, -2.25f, 3.0f, 0.0f});
  EXPECT_EQ(f.to(kInt32).to_vector<int32_t>(), std::vector<int32_t>({1, -2, 3, 0}));
  EXPECT_EQ(f.to(kBool).to_vector<bool>(), std::vector<bool>({true, true, true, false}));
  EXPECT_EQ(f.to(kFloat16).to(kFloat64).to_vector<double>(),
            std::vector<double>({1.5, -2.25, 3.0, 0.0}));
  EXPECT_EQ(f.to(kBFloat16).to_vector<float>(), std::vector<float>({1.5f, -2.25f, 3.0f, 0.0f}));
  Tensor dst = zeros({2, 4}, kFloat64);
  const uint32_t v0 = dst.version();
  dst.copy_(f);
  EXPECT_GT(dst.version(), v0);
  EXPECT_EQ(dst[1].to_vector<double>(), std::vector<double>({1.5, -2.25, 3.0, 0.0}));
  EXPECT_THROW(zeros({3}).copy_(f), ValueError);
  // Copy into a non-contiguous destination.
  Tensor m = zeros({3, 2});
  m.t().copy_(arange(6).view({2, 3}));
  EXPECT_EQ(m.to_vector<float>(), std::vector<float>({0, 3, 1, 4, 2, 5}));
  // to() without a change returns the same tensor; clone() never does.
  EXPECT_TRUE(f.to(kFloat32).is_same(f));
  EXPECT_NE(f.clone().storage(), f.storage());
}

// A copy onto the elements it reads (another handle on the same view) leaves them as they were
// and still counts as a write; a view of the same storage at another offset is a real copy.
TEST(Copy, OntoTheSameElementsKeepsThemAndBumpsVersion) {
  Tensor a = arange(0, 6, 1, kFloat32);
  Tensor v = a.view({2, 3});
  const uint32_t v0 = a.version();
  v.copy_(a.view({2, 3}));
  EXPECT_GT(a.version(), v0);
  EXPECT_EQ(a.to_vector<float>(), std::vector<float>({0, 1, 2, 3, 4, 5}));
  a.narrow(0, 3, 3).copy_(a.narrow(0, 0, 3));
  EXPECT_EQ(a.to_vector<float>(), std::vector<float>({0, 1, 2, 0, 1, 2}));
}

TEST(Copy, LargeCopyUsesAllThreadsAndIsExact) {
  Tensor a = arange(0, 1 << 20, 1, kFloat32).view({1024, 1024});
  Tensor b = a.t().contiguous();
  EXPECT_EQ(b[3][5].item<float>(), 5 * 1024 + 3);
  Tensor c = b.to(kFloat64);
  EXPECT_EQ(c[1023][1023].item<double>(), 1024.0 * 1024 - 1);
}

TEST(Item, ChecksNumel) {
  EXPECT_EQ(scalar_tensor(3.5).item<float>(), 3.5f);
  EXPECT_EQ(scalar_tensor(3.5).item().to_double(), 3.5);
  EXPECT_THROW(zeros({2}).item<float>(), ValueError);
  EXPECT_THROW(zeros({2}).data<int64_t>(), TypeError);
  EXPECT_THROW(Tensor().view({1}), ValueError);
}

TEST(Print, MatchesPyTorchFormat) {
  EXPECT_EQ(tensor({1.f, 2.f, 3.f}).str(), "tensor([1., 2., 3.])");
  EXPECT_EQ(tensor({1.5f, -2.f}).str(), "tensor([ 1.5000, -2.0000])");
  EXPECT_EQ(arange(4).view({2, 2}).str(), "tensor([[0, 1],\n        [2, 3]])");
  EXPECT_EQ(tensor({true, false}).str(), "tensor([ True, False])");
  EXPECT_EQ(tensor({1, 2}, kInt32).str(), "tensor([1, 2], dtype=torch.int32)");
  EXPECT_EQ(scalar_tensor(2.0).str(), "tensor(2.)");
  EXPECT_EQ(empty({0}).str(), "tensor([])");
  EXPECT_EQ(empty({0, 3}).str(), "tensor([], size=(0, 3))");
  EXPECT_EQ(tensor({1e-5f, 1.f}).str(), "tensor([1.0000e-05, 1.0000e+00])");
  EXPECT_EQ(arange(2000).str(), "tensor([   0,    1,    2,  ..., 1997, 1998, 1999])");
  EXPECT_EQ(arange(8).view({2, 2, 2}).str(),
            "tensor([[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]])");
}

TEST(Allocator, ReusesLargeBlocksWithoutFreshPages) {
  cpu_empty_cache();
  const auto before = cpu_allocator_stats();
  { Tensor a = empty({1 << 20}); }
  const auto mid = cpu_allocator_stats();
  EXPECT_EQ(mid.num_fresh, before.num_fresh + 1);
  EXPECT_GE(mid.cached, 4 << 20);
  { Tensor b = empty({1 << 20}); }
  const auto after = cpu_allocator_stats();
  EXPECT_EQ(after.num_fresh, mid.num_fresh);
  EXPECT_EQ(after.num_reused, mid.num_reused + 1);
  cpu_empty_cache();
  EXPECT_EQ(cpu_allocator_stats().cached, 0);
}

TEST(Allocator, PeakIsTheHighestSinceTheLastReset) {
  Tensor kept = empty({1 << 16});
  { Tensor big = empty({1 << 20}); }
  const auto high = cpu_allocator_stats();
  EXPECT_GE(high.peak_allocated, high.allocated + (4 << 20));
  cpu_reset_peak_stats();
  EXPECT_EQ(cpu_allocator_stats().peak_allocated, cpu_allocator_stats().allocated);
  { Tensor small = empty({1 << 16}); }
  const auto after = cpu_allocator_stats();
  EXPECT_GE(after.peak_allocated, after.allocated + (4 << 16));
  EXPECT_LT(after.peak_allocated, after.allocated + (4 << 20));
}

// Whether the mapping that holds `addr` is advised onto huge pages (VmFlags "hg" in
// /proc/self/smaps: MADV_HUGEPAGE, whatever the kernel then grants); nullopt if none holds it.
std::optional<bool> advised_huge(uintptr_t addr) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {  // a mapping's first line
      inside = addr >= lo && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.find(" hg") != std::string::npos;
    }
  }
  return std::nullopt;
}

// Blocks from 2 MiB are 2 MiB-aligned with their whole huge pages advised onto transparent huge
// pages and their tail left on small pages (no block is rounded up to a huge page); smaller
// blocks are not advised.
TEST(Allocator, AdvisesTheWholeHugePagesOfBlocksFromTwoMiB) {
  {
    const int probe = ::madvise(nullptr, 0, MADV_HUGEPAGE);
    if (probe != 0 && errno == EINVAL) GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  cpu_empty_cache();
  constexpr int64_t kMiB = 1 << 20;
  Tensor t = empty({3 * kMiB}, kUInt8);
  const auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
  EXPECT_EQ(p % (2 * kMiB), 0u);
  EXPECT_EQ(advised_huge(p), std::optional<bool>(true));
  EXPECT_EQ(advised_huge(p + 2 * kMiB - 1), std::optional<bool>(true));
  EXPECT_EQ(advised_huge(p + 2 * kMiB), std::optional<bool>(false));
  EXPECT_EQ(advised_huge(p + 3 * kMiB - 1), std::optional<bool>(false));
  Tensor small = empty({kMiB}, kUInt8);
  EXPECT_EQ(advised_huge(reinterpret_cast<uintptr_t>(small.data_ptr())),
            std::optional<bool>(false));
  Tensor exact = empty({2 * kMiB}, kUInt8);
  EXPECT_EQ(advised_huge(reinterpret_cast<uintptr_t>(exact.data_ptr())), std::optional<bool>(true));
  t = Tensor();
  small = Tensor();
  exact = Tensor();
  cpu_empty_cache();
}

TEST(Cuda, ReportsWhyNoDeviceInsteadOfCrashing) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present; covered by cuda_test";
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_STRNE(cuda::unavailable_reason(), "");
  try {
    zeros({2}).to(Device("cuda"));
    FAIL() << "expected an error";
  } catch (const NotImplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
  EXPECT_THROW(zeros({2}, Device("cuda:0")), Error);
  EXPECT_THROW(zeros({2}).pin_memory(), NotImplementedError);
}

TEST(Threading, SettingIsGlobalAndValidated) {
  const int n = get_num_threads();
  set_num_threads(1);
  EXPECT_EQ(get_num_threads(), 1);
  EXPECT_THROW(set_num_threads(0), ValueError);
  set_num_threads(n);
}
