// The NCCL backend's registration: its factory picks the sockets' interface, and splits the
// world's communicator for new_group. Built with NCCL only; no_nccl.cpp registers the backend's
// refusal otherwise.
#include <cstdlib>

#include <ember/distributed/backends/net.h>
#include <ember/distributed/backends/process_group_nccl.h>
#include <ember/distributed/init.h>

namespace ember::dist {

namespace {

std::shared_ptr<ProcessGroup> make_nccl(const BackendArgs& a) {
  // new_group over an NCCL world splits its communicator (as c10d does): no new bootstrap, and
  // collective over the world, so ranks outside the new group take part too.
  if (auto* parent = dynamic_cast<ProcessGroupNccl*>(a.parent.get())) {
    ProcessGroupNccl::NcclOptions o;
    o.timeout = a.timeout;
    o.device = parent->device();
    return parent->split(a.global_ranks, o);
  }
  if (a.rank < 0) return nullptr;  // not a member of this group
  // As gloo's set-up: unless the user chose, NCCL's sockets (its bootstrap, and its data when
  // there is no InfiniBand) use the interface that reaches rank 0, not whichever NCCL guesses
  // first (often a container bridge that the other nodes cannot reach). Set before rank 0
  // makes its ncclUniqueId, which carries its bootstrap address.
  const std::string ifname = net::nccl_socket_ifname(a.master_addr);
  if (!ifname.empty()) ::setenv("NCCL_SOCKET_IFNAME", ifname.c_str(), 0);
  ProcessGroupNccl::NcclOptions o;
  o.timeout = a.timeout;
  return std::make_shared<ProcessGroupNccl>(a.store, a.rank, a.size, o);
}

const bool kNcclRegistered = [] {
  register_backend("nccl", make_nccl);
  return true;
}();

}  // namespace

}  // namespace ember::dist
