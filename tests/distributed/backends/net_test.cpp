// How the nccl and gloo set-ups find the interface that reaches rank 0 (distributed/backends/net.h).
#include <ember/distributed/backends/net.h>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "tests/launcher/netns.h"

namespace ember::dist::net {
namespace {

/// Unsets (or sets) NCCL_SOCKET_IFNAME for the scope and restores it after.
class IfnameScope {
 public:
  explicit IfnameScope(const char* value) {
    if (const char* v = std::getenv("NCCL_SOCKET_IFNAME")) saved_ = v;
    if (value == nullptr) {
      ::unsetenv("NCCL_SOCKET_IFNAME");
    } else {
      ::setenv("NCCL_SOCKET_IFNAME", value, 1);
    }
  }
  ~IfnameScope() {
    if (saved_) {
      ::setenv("NCCL_SOCKET_IFNAME", saved_->c_str(), 1);
    } else {
      ::unsetenv("NCCL_SOCKET_IFNAME");
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST(Net, LoopbackIsReachedThroughLo) {
  EXPECT_TRUE(is_loopback("127.0.0.1"));
  EXPECT_TRUE(is_loopback("localhost"));
  EXPECT_FALSE(is_loopback("10.0.0.1"));
  EXPECT_EQ(local_address_towards("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(interface_towards("127.0.0.1"), "lo");
  EXPECT_NE(addresses_of("lo").find("127.0.0.1"), std::string::npos) << addresses_of("lo");
  EXPECT_EQ(addresses_of("no-such-interface"), "none");
  EXPECT_EQ(interface_towards("no-such-host.invalid"), "");
}

TEST(Net, NcclInterfaceIsTheOneTowardsRankZeroUnlessTheUserChose) {
  {
    IfnameScope unset(nullptr);
    EXPECT_EQ(nccl_socket_ifname("127.0.0.1"), "=lo");  // exactly lo, not every lo* interface
    EXPECT_EQ(nccl_socket_ifname(""), "");              // no address known: NCCL chooses
    EXPECT_EQ(nccl_socket_ifname("no-such-host.invalid"), "");
  }
  IfnameScope user("ib0");
  EXPECT_EQ(nccl_socket_ifname("127.0.0.1"), "");
}

// Two "nodes" (network namespaces, each with a veth end on a shared bridge): inside node 0,
// the route to node 1's address goes through node 0's veth end, which is what NCCL must be told
// to use.
TEST(Net, NcclInterfaceAcrossNamespacesIsTheVeth) {
  std::string why;
  auto net = emberrun_test::NetnsNodes::create(2, &why);
  if (!net) GTEST_SKIP() << why;
  std::string towards, ifname, error;
  // A network namespace belongs to a thread: this one enters node 0's and ends with it.
  std::thread inside([&] {
    const int fd = ::open(("/var/run/netns/" + net->ns[0]).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
      error = "cannot enter " + net->ns[0];
      if (fd >= 0) ::close(fd);
      return;
    }
    ::close(fd);
    towards = interface_towards(net->addr[1]);
    IfnameScope unset(nullptr);
    ifname = nccl_socket_ifname(net->addr[1]);
  });
  inside.join();
  ASSERT_EQ(error, "");
  EXPECT_EQ(towards, net->ifname[0]);
  EXPECT_EQ(ifname, "=" + net->ifname[0]);
}

}  // namespace
}  // namespace ember::dist::net
