// Option structs for collectives in tests, spelled out: designated initializers that leave
// out the timeout field would trip -Wmissing-field-initializers.
#pragma once

#include <optional>

#include <ember/distributed/process_group.h>

namespace ember::test {

using dist::AllreduceOptions;
using dist::BroadcastOptions;
using dist::Duration;
using dist::GatherOptions;
using dist::ReduceOp;
using dist::ReduceOptions;
using dist::ReduceScatterOptions;
using dist::ScatterOptions;

inline AllreduceOptions ar(ReduceOp op, std::optional<Duration> timeout = {}) {
  AllreduceOptions o;
  o.op = op;
  o.timeout = timeout;
  return o;
}
inline BroadcastOptions bc(int root) {
  BroadcastOptions o;
  o.root = root;
  return o;
}
inline ReduceOptions rd(int root, ReduceOp op) {
  ReduceOptions o;
  o.root = root;
  o.op = op;
  return o;
}
inline GatherOptions ga(int root) {
  GatherOptions o;
  o.root = root;
  return o;
}
inline ScatterOptions sc(int root) {
  ScatterOptions o;
  o.root = root;
  return o;
}
inline ReduceScatterOptions rs(ReduceOp op) {
  ReduceScatterOptions o;
  o.op = op;
  return o;
}

}  // namespace ember::test
