// Which local address and interface reach a peer: how the gloo and nccl set-ups pick the network
// a multi-node job talks over when the user named none (internal to distributed/).
#pragma once

#include <string>

namespace ember::dist::net {

/// "localhost", 127.x.y.z or ::1.
bool is_loopback(const std::string& host);

/// This machine's address on the route to `host` ("" when there is none or `host` does not
/// resolve): the kernel's own routing decision, found without sending anything.
std::string local_address_towards(const std::string& host);

/// The name of the interface that has `address` ("" when none has it).
std::string interface_with_address(const std::string& address);

/// The interface on the route to `host` ("lo" for a loopback host; "" when there is no route).
std::string interface_towards(const std::string& host);

/// The addresses of interface `name`, comma-separated ("none" when it has none or is absent).
std::string addresses_of(const std::string& name);

/// The NCCL_SOCKET_IFNAME the nccl set-up should give NCCL: "=<the interface towards
/// master_addr>" ('=': that interface exactly, not every name it prefixes), or "" to leave NCCL's choice alone (the user set NCCL_SOCKET_IFNAME, no address is known, or
/// no interface routes to it).
std::string nccl_socket_ifname(const std::string& master_addr);

/// The network NCCL was told to use, for errors and the debug log: "NCCL_SOCKET_IFNAME=eth0
/// (10.1.2.3), MASTER_ADDR=10.1.2.1".
std::string nccl_network_summary();

}  // namespace ember::dist::net
