// CUDA core: devices, streams, events, the caching allocator, copies between host and device.
// Every test needs a GPU and skips with the reason where there is none.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/cuda/runtime/host_use.h>

using namespace ember;

#ifdef EMBER_WITH_CUDA
namespace ember::detail {
struct CublasFunctions;
const CublasFunctions& cublas();  // tensor/cuda/runtime/cublas_loader.h
}  // namespace ember::detail
#endif

#define REQUIRE_CUDA()                                                                    \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

TEST(CudaCore, BuildReportsCudaSupport) {
#ifdef EMBER_WITH_CUDA
  EXPECT_TRUE(cuda::is_built());
#else
  EXPECT_FALSE(cuda::is_built());
  EXPECT_EQ(cuda::device_count(), 0);
#endif
}

// Whether a library whose file name starts with `prefix` is mapped into this process.
bool library_mapped(const std::string& prefix) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/" + prefix) != std::string::npos) return true;
  }
  return false;
}

// cuBLAS's static initialisers cost every process that loads it ~90 ms at start, GPU or not, so
// Ember opens it when a GEMM first needs it instead of linking it. Needs no GPU.
TEST(CudaCore, CublasIsOpenedAtItsFirstUseNotAtStart) {
#ifndef EMBER_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (library_mapped("libcublas") && cuda::is_available()) {
    GTEST_SKIP() << "an earlier test in this process used cuBLAS on the GPU";
  }
  EXPECT_FALSE(library_mapped("libcublas")) << "cuBLAS was loaded with the process";
  ember::detail::cublas();
  EXPECT_TRUE(library_mapped("libcublas.so"));
  EXPECT_TRUE(library_mapped("libcublasLt.so"));
#endif
}

TEST(CudaCore, RoundTripPreservesValuesAndConvertsDtypes) {
  REQUIRE_CUDA();
  Tensor h = arange(0, 1000, 1, kFloat32).view({10, 100});
  Tensor d = h.to(Device("cuda"));
  EXPECT_TRUE(d.is_cuda());
  EXPECT_EQ(d.cpu().to_vector<float>(), h.to_vector<float>());
  // Conversion on the device, then back.
  EXPECT_EQ(d.to(kFloat16).cpu().to_vector<float>(), h.to(kFloat16).to_vector<float>());
  EXPECT_EQ(d.to(kBFloat16).to(kFloat64).cpu().to_vector<double>(),
            h.to(kBFloat16).to(kFloat64).to_vector<double>());
  // Non-contiguous sources and destinations on both sides.
  EXPECT_EQ(d.t().cpu().contiguous().to_vector<float>(), h.t().contiguous().to_vector<float>());
  Tensor dst = zeros({100, 10}, Device("cuda"));
  dst.copy_(h.t());
  EXPECT_EQ(dst.cpu().to_vector<float>(), h.t().contiguous().to_vector<float>());
  Tensor back = zeros({100, 10});
  back.t().copy_(d);
  EXPECT_EQ(back.t().contiguous().to_vector<float>(), h.to_vector<float>());
  // Broadcast copy on the device.
  Tensor row = arange(0, 5, 1, kFloat32).to(Device("cuda"));
  Tensor m = empty({3, 5}, Device("cuda"));
  m.copy_(row);
  EXPECT_EQ(m.cpu()[2].to_vector<float>(), std::vector<float>({0, 1, 2, 3, 4}));
}

TEST(CudaCore, FillAndCreationOnDevice) {
  REQUIRE_CUDA();
  EXPECT_EQ(full({4}, 2.5, TensorOptions(kFloat32).device(Device("cuda"))).cpu().to_vector<float>(),
            std::vector<float>(4, 2.5f));
  EXPECT_EQ(zeros({3}, TensorOptions(kInt64).device(Device("cuda"))).cpu().to_vector<int64_t>(),
            std::vector<int64_t>(3, 0));
  Tensor e = eye(3, {}, Device("cuda")).cpu();
  EXPECT_EQ(e.to_vector<float>(), eye(3).to_vector<float>());
  EXPECT_EQ(arange(0, 4, 1, TensorOptions(kInt32).device(Device("cuda"))).cpu().to_vector<int32_t>(),
            std::vector<int32_t>({0, 1, 2, 3}));
}

TEST(CudaCore, PinnedNonBlockingCopyCompletesAfterSync) {
  REQUIRE_CUDA();
  Tensor h = arange(0, 1 << 20, 1, kFloat32).pin_memory();
  EXPECT_TRUE(h.is_pinned());
  Tensor d = h.to(Device("cuda"), /*non_blocking=*/true);
  cuda::current_stream().synchronize();
  Tensor back = empty({1 << 20}, TensorOptions().pinned_memory());
  back.copy_(d);
  EXPECT_EQ(back[12345].item<float>(), 12345.0f);
}

// A pinned buffer copied to the GPU without blocking, step after step, holds one event per
// stream it is used on, not one per copy; once freed and its copies done, none.
TEST(CudaCore, APinnedBufferCopiedManyTimesHoldsOneEventPerStream) {
  REQUIRE_CUDA();
  // Events of earlier tests in this process, done, are given back by the next pinned allocation.
  cuda::current_stream().synchronize();
  { Tensor warm = empty({16}, TensorOptions().pinned_memory()); }
  const int64_t before = detail::pinned_events_held();
  {
    Tensor h = arange(0, 4096, 1, kFloat32).pin_memory();
    for (int step = 0; step < 1000; ++step) {
      Tensor d = h.to(Device("cuda"), /*non_blocking=*/true);
    }
    EXPECT_EQ(detail::pinned_events_held(), before + 1);
  }
  cuda::current_stream().synchronize();
  Tensor other = empty({16}, TensorOptions().pinned_memory());  // gives back what is done
  EXPECT_EQ(detail::pinned_events_held(), before);
}

TEST(CudaCore, StreamsOrderWorkAndEventsTime) {
  REQUIRE_CUDA();
  cuda::Stream s = cuda::Stream::create();
  Tensor a;
  {
    cuda::StreamGuard g(s);
    EXPECT_EQ(cuda::current_stream(), s);
    a = full({1 << 20}, 3.0, Device("cuda"));
  }
  EXPECT_EQ(cuda::current_stream(), cuda::default_stream());
  cuda::Event done(/*enable_timing=*/true), start(/*enable_timing=*/true);
  start.record(s);
  done.record(s);
  done.block(cuda::current_stream());
  EXPECT_EQ(a.cpu()[7].item<float>(), 3.0f);
  done.synchronize();
  EXPECT_TRUE(done.query());
  EXPECT_GE(start.elapsed_ms(done), 0.0f);
}

TEST(CudaCore, AllocatorReusesFreedBlocksOnSameStream) {
  REQUIRE_CUDA();
  void* first;
  {
    Tensor t = empty({1 << 18}, Device("cuda"));
    first = t.storage()->data();
  }
  Tensor u = empty({1 << 18}, Device("cuda"));
  EXPECT_EQ(u.storage()->data(), first);
  // A block recorded on another stream is not handed out again until that stream is done.
  cuda::Stream s = cuda::Stream::create();
  void* p;
  {
    Tensor t = empty({1 << 18}, Device("cuda"));
    p = t.storage()->data();
    cuda::record_stream(p, s);
  }
  s.synchronize();
  cuda::empty_cache();
}

TEST(CudaCore, BadDeviceIndexIsAnError) {
  REQUIRE_CUDA();
  const int n = cuda::device_count();
  EXPECT_THROW(zeros({1}).to(cuda_device(n)), ValueError);
}

// torch.cuda.get_device_name: the driver's name of the device (what examples/gpt looks its peak
// up by); without that device an error naming the call and the index.
TEST(CudaCore, DeviceNameIsTheDriversAndABadIndexIsAnError) {
  const int n = cuda::device_count();
  try {
    cuda::get_device_name(n);
    ADD_FAILURE() << "expected an error for device " << n;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[get_device_name]"), std::string::npos) << e.what();
  }
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  const std::string name = cuda::get_device_name();
  EXPECT_FALSE(name.empty());
  EXPECT_EQ(cuda::get_device_name(0), name);
  std::printf("device 0: %s\n", name.c_str());
}

// The caching allocator on a real device. Each test allocates on a stream of its own: blocks
// belong to their stream, so blocks cached by earlier tests cannot serve these requests and
// the addresses below are those of fresh segments.
namespace {
constexpr int64_t kMiB = int64_t{1} << 20;
char* data(const Tensor& t) { return static_cast<char*>(t.storage()->data()); }
Tensor mib_tensor(int64_t mib) { return empty({mib * kMiB / 4}, Device("cuda")); }
}  // namespace

TEST(CudaAllocator, StatsAreZeroWithoutADevice) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present (this checks the stubs)";
  EXPECT_EQ(cuda::memory_allocated(), 0);
  EXPECT_EQ(cuda::max_memory_allocated(0), 0);
  EXPECT_EQ(cuda::memory_reserved(), 0);
  EXPECT_EQ(cuda::max_memory_reserved(-1), 0);
  EXPECT_NO_THROW(cuda::reset_peak_memory_stats());
  EXPECT_NO_THROW(cuda::empty_cache());
}

TEST(CudaAllocator, StatsCountRoundedBlocksAndPeaks) {
  REQUIRE_CUDA();
  cuda::StreamGuard g(cuda::Stream::create());
  cuda::reset_peak_memory_stats();
  const int64_t base = cuda::memory_allocated();
  const int64_t reserved = cuda::memory_reserved();
  EXPECT_EQ(cuda::max_memory_allocated(), base);
  EXPECT_EQ(cuda::max_memory_reserved(), reserved);
  {
    Tensor t = empty({1000}, Device("cuda"));  // 4000 bytes: a 4096-byte block
    EXPECT_EQ(cuda::memory_allocated() - base, 4096);
    EXPECT_EQ(cuda::memory_reserved() - reserved, 2 * kMiB);              // a new small segment
    Tensor u = empty({1}, TensorOptions(kUInt8).device(Device("cuda")));  // 512 bytes
    EXPECT_EQ(cuda::memory_allocated() - base, 4096 + 512);
    EXPECT_EQ(cuda::memory_reserved() - reserved, 2 * kMiB);  // same segment
  }
  EXPECT_EQ(cuda::memory_allocated(), base);
  EXPECT_EQ(cuda::max_memory_allocated(), base + 4096 + 512);
  EXPECT_EQ(cuda::max_memory_reserved(), reserved + 2 * kMiB);
  EXPECT_EQ(cuda::memory_allocated(cuda::current_device()), cuda::memory_allocated());
  cuda::empty_cache();
  cuda::reset_peak_memory_stats();
  EXPECT_EQ(cuda::max_memory_allocated(), cuda::memory_allocated());
  EXPECT_EQ(cuda::max_memory_reserved(), cuda::memory_reserved());
  EXPECT_LE(cuda::memory_reserved(), reserved);
  EXPECT_THROW(cuda::memory_allocated(cuda::device_count()), ValueError);
}

TEST(CudaAllocator, SplitsASegmentAndMergesFreedNeighbours) {
  REQUIRE_CUDA();
  cuda::StreamGuard g(cuda::Stream::create());
  const int64_t reserved = cuda::memory_reserved();
  Tensor a = mib_tensor(4), b = mib_tensor(4), c = mib_tensor(4);  // one 20 MiB segment
  EXPECT_EQ(data(b), data(a) + 4 * kMiB);
  EXPECT_EQ(data(c), data(a) + 8 * kMiB);
  EXPECT_EQ(cuda::memory_reserved() - reserved, 20 * kMiB);
  char* base = data(a);
  a = Tensor();
  b = Tensor();
  // a and b merged into one 8 MiB block; it ties with the 8 MiB after c and has the lower address.
  Tensor ab = mib_tensor(8);
  EXPECT_EQ(data(ab), base);
  // Blocks carved from one segment hold their own values.
  ab.fill_(1.0);
  c.fill_(2.0);
  EXPECT_EQ(ab.sum().item<float>(), static_cast<float>(2 * kMiB));
  EXPECT_EQ(c.sum().item<float>(), static_cast<float>(2 * kMiB));
  ab = Tensor();
  c = Tensor();
  // The sums' results took a small-pool segment; the 20 MiB one is whole again and serves a
  // 20 MiB request without a new segment.
  const int64_t before_whole = cuda::memory_reserved();
  Tensor whole = mib_tensor(20);
  EXPECT_EQ(data(whole), base);
  EXPECT_EQ(cuda::memory_reserved(), before_whole);
}

TEST(CudaAllocator, BlockUsedOnAnotherStreamWaitsForIt) {
  REQUIRE_CUDA();
  cuda::Stream mine = cuda::Stream::create(), other = cuda::Stream::create();
  cuda::StreamGuard g(mine);
  char* p;
  {
    Tensor t = mib_tensor(4);
    p = data(t);
    cuda::spin(int64_t{1} << 31, other);  // about a second: long past the next allocation
    cuda::record_stream(p, other);
  }
  Tensor u = mib_tensor(4);
  EXPECT_NE(data(u), p) << "reused while the stream it was recorded on was still running";
  other.synchronize();
  Tensor v = mib_tensor(4);
  EXPECT_EQ(data(v), p);
}

TEST(CudaAllocator, OutOfMemoryReleasesCachedSegmentsAndRetries) {
  REQUIRE_CUDA();
  cuda::StreamGuard g(cuda::Stream::create());
  // Fill the device with 1 GiB segments, then cache them all: only giving the cache back lets a
  // 2 GiB request (which no 1 GiB block can hold) fit.
  std::vector<Tensor> held;
  try {
    for (;;) held.push_back(mib_tensor(1024));
  } catch (const OutOfMemoryError&) {
  }
  ASSERT_GE(held.size(), 3u) << "the device has too little memory for this test";
  held.clear();
  Tensor big = mib_tensor(2048);
  EXPECT_EQ(big.numel(), 512 * kMiB);
  big = Tensor();
  cuda::empty_cache();
}

TEST(CudaAllocator, OutOfMemoryErrorGivesTheSizesAndTheDevice) {
  REQUIRE_CUDA();
  try {
    Tensor t = empty({int64_t{1} << 38}, Device("cuda"));  // 1 TiB
    FAIL() << "allocating 1 TiB succeeded";
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    const std::string gpu = "GPU " + std::to_string(cuda::current_device());
    for (const std::string& part :
         {std::string("CUDA out of memory. Tried to allocate 1024.00 GiB."),
          gpu + " has a total capacity of ", std::string(" is free."),
          std::string(" is allocated by Ember"), std::string(" is reserved by Ember"),
          std::string("requested 1099511627776"), std::string("allocated "),
          std::string("reserved "), std::string("free "), std::string("total ")}) {
      EXPECT_NE(m.find(part), std::string::npos) << "missing \"" << part << "\" in: " << m;
    }
  }
  // The allocator still works.
  EXPECT_EQ(full({4}, 1.0, Device("cuda")).sum().item<float>(), 4.0f);
}
