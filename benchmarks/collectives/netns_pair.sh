# netns_pair.sh: two "nodes" for the benchmarks that measure over a network, sourced by
# benchmarks/collectives/two_nodes.sh and benchmarks/ddp/compression.sh (not run by itself).
#
# netns_up: two network namespaces (ns[0], ns[1]) joined by a veth pair (dev[0], dev[1]) with
# the addresses addr[0] and addr[1] (10.251.x.1 and .2, inside the namespaces only), and an EXIT
# trap that kills every process left in them and removes them, also on error or Ctrl-C.
# netns_shape RATE: shapes both ends with `tc qdisc ... tbf` (the rate, burst 256kb, latency
# 10ms), so the link behaves like a network of that bandwidth.
# netns_emberrun ENV PORT PROGRAM ARGS...: PROGRAM as 2 ranks on each node under emberrun (node
# 0's rank 0 prints; node 1's output is dropped); ENV is "NAME=VALUE" given to both (or "").

netns_cleanup() {
  for n in "${ns[@]}"; do
    if ip netns list | grep -q "^$n\b"; then
      for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
      ip netns del "$n" 2>/dev/null || true
    fi
  done
}

netns_up() {
  local id="$$" i
  ns=("ember-bench-$id-a" "ember-bench-$id-b")
  dev=("ebb${id}a" "ebb${id}b")
  addr=("10.251.$((id % 250)).1" "10.251.$((id % 250)).2")
  trap netns_cleanup EXIT
  trap 'exit 130' INT TERM
  ip netns add "${ns[0]}"
  ip netns add "${ns[1]}"
  ip link add "${dev[0]}" type veth peer name "${dev[1]}"
  for i in 0 1; do
    ip link set "${dev[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${dev[$i]}"
    ip -n "${ns[$i]}" link set "${dev[$i]}" up
    ip -n "${ns[$i]}" link set lo up
  done
}

netns_shape() {
  local i
  for i in 0 1; do
    ip netns exec "${ns[$i]}" tc qdisc replace dev "${dev[$i]}" root tbf rate "$1" \
      burst 256kb latency 10ms
  done
}

netns_emberrun() {
  local env_kv="$1" at="$2"
  shift 2
  local common=(--nnodes 2 --nproc-per-node 2 --master-addr "${addr[0]}" --master-port "$at"
                --local-ranks-filter 0)
  local envs=()
  [[ -z "$env_kv" ]] || envs=("$env_kv")
  ip netns exec "${ns[1]}" env "${envs[@]}" "$emberrun" "${common[@]}" --node-rank 1 "$@" \
    > /dev/null &
  local other=$!
  ip netns exec "${ns[0]}" env "${envs[@]}" "$emberrun" "${common[@]}" --node-rank 0 "$@"
  wait "$other"
}
