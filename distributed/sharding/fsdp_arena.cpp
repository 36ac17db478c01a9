// FSDP's arenas by device (detail/fsdp_arena.h): the host one wraps a HostArena; the CUDA one is
// in fsdp_cuda_arena.cpp.
#include <ember/distributed/sharding/detail/fsdp_arena.h>

#include <ember/distributed/sharding/detail/host_arena.h>
#include <ember/tensor/error.h>

namespace ember::dist::detail {
namespace {

class CpuArena final : public FsdpArena {
 public:
  CpuArena(size_t nbytes, const std::string& label) : arena_(nbytes, label) {}
  void* data() const override { return arena_.data(); }
  size_t nbytes() const override { return arena_.nbytes(); }
  size_t held_bytes() const override { return arena_.nbytes(); }
  Device device() const override { return kCPU; }
  bool committed() const override { return arena_.committed(); }
  void commit() override { arena_.commit(); }
  void release() override { arena_.release(); }

 private:
  HostArena arena_;
};

}  // namespace

std::shared_ptr<FsdpArena> make_fsdp_arena(const Device& device, size_t nbytes,
                                           const std::string& label) {
  if (device.is_cpu()) return std::make_shared<CpuArena>(nbytes, label);
  EMBER_CHECK_TYPE(NotImplementedError, device.is_cuda(), "[", label, "] parameters on ",
                   device.str(), ": fully_shard shards parameters on the CPU or a CUDA device");
  return make_cuda_arena(device.index, nbytes, label);
}

}  // namespace ember::dist::detail
