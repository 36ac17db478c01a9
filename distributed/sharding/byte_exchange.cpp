#include <ember/distributed/sharding/detail/byte_exchange.h>

#include <algorithm>
#include <cstring>

#include <ember/tensor/ops/creation.h>

namespace ember::dist::detail {

std::vector<std::string> exchange_bytes(dist::ProcessGroup& pg, const std::string& mine, int root) {
  const int n = pg.size();
  const Device dev = pg.default_device();
  Tensor len = from_vector(std::vector<int64_t>{static_cast<int64_t>(mine.size())}).to(dev);
  Tensor lens = zeros({n}, TensorOptions(kInt64).device(dev));
  pg.allgather_into_tensor(lens, len)->wait();
  const std::vector<int64_t> sizes = lens.to_vector<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(sizes.begin(), sizes.end()));
  Tensor padded = zeros({longest}, kUInt8);
  std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  const Tensor in = padded.to(dev);
  std::vector<Tensor> outs;  // one per rank, `longest` bytes each
  if (root < 0) {
    Tensor all = empty({longest * n}, TensorOptions(kUInt8).device(dev));
    pg.allgather_into_tensor(all, in)->wait();
    for (int r = 0; r < n; ++r) outs.push_back(all.narrow(0, r * longest, longest));
  } else {
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r)
        outs.push_back(empty({longest}, TensorOptions(kUInt8).device(dev)));
    }
    dist::GatherOptions o;
    o.root = root;
    pg.gather(outs, in, o)->wait();
  }
  std::vector<std::string> out;
  for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
    const Tensor host = outs[static_cast<size_t>(r)].to(kCPU).contiguous();
    out.emplace_back(static_cast<const char*>(host.data_ptr()),
                     static_cast<size_t>(sizes[static_cast<size_t>(r)]));
  }
  return out;
}

}  // namespace ember::dist::detail
