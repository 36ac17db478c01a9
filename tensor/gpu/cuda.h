// CUDA runtime: devices, streams and events. Safe to call on a machine without a GPU or driver:
// device_count() is then 0 and is_available() false; anything needing a device throws
// NotImplementedError/CudaError saying why. In a build without CUDA every call reports that.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ember/tensor/device.h>

namespace ember {
class Tensor;
}  // namespace ember

namespace ember::cuda {

/// Number of usable CUDA devices (0 when no driver, no device or a CPU-only build).
int device_count();
bool is_available();
/// True when Ember was compiled with CUDA support.
bool is_built();
/// Why no device is usable ("built without CUDA", "no CUDA driver", ...); empty if one is.
const char* unavailable_reason();
int current_device();
void set_device(int index);
/// Whether `device` has an active primary context (this process has used it), without creating
/// one; false without a device. Device guards restore only such a device, as PyTorch's do, so a
/// rank never makes a context (hundreds of MiB) on a GPU it does not use.
bool has_context(int device);
/// Waits for all work on the device (default: the current one).
void synchronize(int device = -1);
/// The device's name as the driver gives it, e.g. "NVIDIA H200" (torch.cuda.get_device_name;
/// default: the current device). Throws as synchronize() does without that device.
std::string get_device_name(int device = -1);

/// Whether float32 matmuls on CUDA may use TF32 tensor cores (10-bit mantissa products, float32
/// accumulation): PyTorch's torch.backends.cuda.matmul.allow_tf32, and as there off by default
/// (float32 matmuls then give float32 results). Convolutions follow cuDNN's default, which
/// allows TF32, as PyTorch's torch.backends.cudnn.allow_tf32 does. Process-wide, thread-safe;
/// a no-op without CUDA.
void set_matmul_allow_tf32(bool allow);
bool matmul_allow_tf32();

/// A CUDA stream handle. Copyable; the default-constructed value is the legacy default stream
/// of device 0. Streams made by Stream::create live for the whole process (as PyTorch's pool).
class Stream {
 public:
  Stream() = default;
  Stream(void* handle, int device) : handle_(handle), device_(device) {}
  /// A new non-blocking stream on `device` (priority: lower is more urgent, 0 default).
  static Stream create(int device = -1, int priority = 0);
  void* handle() const { return handle_; }
  int device() const { return device_; }
  void synchronize() const;
  /// True when all work queued on the stream has finished.
  bool query() const;
  bool operator==(const Stream& o) const { return handle_ == o.handle_ && device_ == o.device_; }

 private:
  void* handle_ = nullptr;
  int device_ = 0;
};

/// The stream ops on `device` are queued on (per thread, like PyTorch's current stream).
Stream current_stream(int device = -1);
void set_current_stream(const Stream& s);
Stream default_stream(int device = -1);

/// Makes `s` current for its device while alive; restores the previous stream after.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream prev_;
};

/// A CUDA event for ordering streams and timing. Created lazily on first record.
class Event {
 public:
  explicit Event(bool enable_timing = false) : timing_(enable_timing) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const Stream& s);
  void record() { record(current_stream()); }
  /// Makes future work on `s` wait for this event.
  void block(const Stream& s) const;
  void synchronize() const;
  bool query() const;
  /// Milliseconds between two recorded timing events.
  float elapsed_ms(const Event& end) const;
  /// The device of the stream it was last recorded on.
  int device() const { return device_; }

 private:
  void* handle_ = nullptr;
  int device_ = 0;
  bool timing_;
};

/// Marks that `ptr` (from the CUDA caching allocator) is in use on stream s, so the allocator
/// waits for s before reusing it after it is freed (torch's record_stream).
void record_stream(void* ptr, const Stream& s);
/// The same for the memory of tensor `t` (torch's Tensor.record_stream): nothing for a tensor
/// without elements, on the CPU, or over memory the allocator did not hand out (from_blob's,
/// whose owner keeps it alive).
void record_stream(const Tensor& t, const Stream& s);
/// Releases the cached segments with no block in use back to CUDA (a segment holding a live
/// block stays), after waiting for the device if blocks freed after record_stream still wait on
/// their events. Touches only devices this process has allocated on.
void empty_cache();

/// Memory statistics of the caching allocator of `device` (-1: the current one), in bytes, as
/// torch.cuda's. "Allocated" is the memory in blocks handed out and not yet freed, counted in
/// block sizes as PyTorch counts them: a request rounds up to a multiple of 512 bytes, and a
/// block taken from the cache keeps a rest of up to 1 MiB that was not worth splitting off, so
/// it is at least the sum of the tensors' sizes. A block counts as freed when its tensor is,
/// even while it waits for record_stream events. "Reserved" is the memory got from cudaMalloc
/// and not yet released (allocated plus cached). All are 0 where CUDA is unavailable and for a
/// device that has not allocated; an index not below device_count() is a ValueError.
int64_t memory_allocated(int device = -1);
/// The highest memory_allocated since the program started or reset_peak_memory_stats.
int64_t max_memory_allocated(int device = -1);
int64_t memory_reserved(int device = -1);
/// The highest memory_reserved since the program started or reset_peak_memory_stats.
int64_t max_memory_reserved(int device = -1);
/// Sets the peaks of `device` (-1: the current one) to the current values; a no-op where CUDA
/// is unavailable.
void reset_peak_memory_stats(int device = -1);

/// Queues a kernel on `s` that spins for about `cycles` GPU clock cycles and does nothing else
/// (torch.cuda._sleep): tests use it to hold a stream busy and show that later work really
/// waits for it (a missing stream wait then gives a wrong result instead of passing by luck).
void spin(int64_t cycles, const Stream& s);
void spin(int64_t cycles);

}  // namespace ember::cuda
