#!/usr/bin/env bash
# two_nodes.sh: allreduce between two "nodes" of 2 ranks each, hierarchical vs the flat ring.
#
# The nodes are two network namespaces joined by a veth pair whose both ends are shaped with
# `tc qdisc ... tbf` (a rate, burst 256kb, latency 10ms), so the link between them behaves like a
# network of that bandwidth. One emberrun per namespace runs bench_collectives with 2 ranks: once
# as init_process_group chooses (the hierarchical group: shared memory inside each node, TCP
# between the two node leaders) and once with EMBER_GLOO_HIERARCHICAL=0 (gloo's flat ring of 4
# over TCP, whose two crossing edges each carry 1.5 times the buffer). With --torch, also
# torch.distributed's gloo (/usr/bin/python3) in the same layout; with --ddp, also bench_ddp's
# MLP (DDP step time) both ways.
#
#   sudo benchmarks/collectives/two_nodes.sh [--rates "1gbit 10gbit"] [--min-bytes 16777216]
#        [--max-bytes 67108864] [--iters 5] [--warmup 1] [--rounds 3] [--build build] [--torch]
#        [--ddp]
#
# Needs root (namespaces, tc) and the ip and tc tools; bench_collectives and emberrun built in
# --build. The namespaces (and every process left in them) are removed on exit, also on error
# or Ctrl-C.
set -euo pipefail

rates="1gbit 10gbit"
min_bytes=$((16 << 20))
max_bytes=$((64 << 20))
iters=5
warmup=1
rounds=3
build=build
torch=0
ddp=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --min-bytes) min_bytes="$2"; shift 2 ;;
    --max-bytes) max_bytes="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --torch) torch=1; shift ;;
    --ddp) ddp=1; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "two_nodes.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

here="$(cd "$(dirname "$0")" && pwd)"
emberrun="$build/launcher/emberrun"
bench="$build/benchmarks/bench_collectives"
bench_ddp="$build/benchmarks/ddp/bench_ddp"
needed=("$emberrun" "$bench")
[[ $ddp -eq 0 ]] || needed+=("$bench_ddp")
for f in "${needed[@]}"; do
  if [[ ! -x "$f" ]]; then
    echo "two_nodes.sh: $f not built (cmake --build $build --target $(basename "$f"))" >&2
    exit 2
  fi
done
[[ $(id -u) -eq 0 ]] || { echo "two_nodes.sh: needs root (network namespaces, tc)" >&2; exit 2; }

source "$here/netns_pair.sh"
netns_up

port=29611
# Runs PROGRAM ARGS... as 2 ranks on each node (node 0's rank 0 prints); $1:
# EMBER_GLOO_HIERARCHICAL, $2: the store's port (one per run).
run_ember() {
  local switch="$1"
  shift
  netns_emberrun "EMBER_GLOO_HIERARCHICAL=$switch" "$@"
}
allreduce_args=(--op allreduce --min-bytes "$min_bytes" --max-bytes "$max_bytes" --iters "$iters"
                --warmup "$warmup" --rounds "$rounds")

# torch.distributed's gloo, 2 ranks per namespace: rank 0 prints "bytes time_us" per size.
run_torch() {
  local procs=() i node
  for i in 3 2 1 0; do
    node=$((i / 2))
    ip netns exec "${ns[$node]}" env RANK=$i WORLD_SIZE=4 MASTER_ADDR="${addr[0]}" \
      MASTER_PORT="$1" GLOO_SOCKET_IFNAME="${dev[$node]}" /usr/bin/python3 - \
      "$min_bytes" "$max_bytes" "$iters" "$warmup" <<'EOF' &
import sys, time, torch, torch.distributed as dist
lo, hi, iters, warmup = map(int, sys.argv[1:5])
dist.init_process_group("gloo")
size = lo
while size <= hi:
    t = torch.full((size // 4,), float(dist.get_rank() + 1))
    for _ in range(warmup + 1):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True) for _ in range(iters)]
    for w in works:
        w.wait()
    if dist.get_rank() == 0:
        print(size, f"{(time.perf_counter() - t0) / iters * 1e6:.1f}", flush=True)
    size *= 2
dist.destroy_process_group()
EOF
    procs+=($!)
  done
  wait "${procs[@]}"
}

for rate in $rates; do
  netns_shape "$rate"
  echo "=== $rate link, 2 namespaces x 2 ranks: hierarchical (the default) ==="
  hier="$(run_ember 1 $((port++)) "$bench" "${allreduce_args[@]}")"
  echo "$hier"
  echo "=== $rate link, 2 namespaces x 2 ranks: flat ring (EMBER_GLOO_HIERARCHICAL=0) ==="
  flat="$(run_ember 0 $((port++)) "$bench" "${allreduce_args[@]}")"
  echo "$flat"
  tor=""
  if [[ $torch -eq 1 ]]; then
    echo "=== $rate link, 2 namespaces x 2 ranks: torch.distributed gloo ==="
    tor="$(run_torch $((port++)))"
    echo "$tor"
  fi
  echo "=== $rate summary: time per allreduce (ms) and speedup of the hierarchical group ==="
  # bench_collectives rows, after emberrun's "[rank 0]:" prefix: bytes count time(us) ...
  awk -v H="$hier" -v F="$flat" -v T="$tor" 'BEGIN {
    split(H, h, "\n"); split(F, f, "\n"); split(T, t, "\n");
    for (i in h) { l = h[i]; sub(/^[^:]*: */, "", l); n = split(l, w, " ");
                   if (n >= 3 && w[1] ~ /^[0-9]+$/ && w[2] ~ /^[0-9]+$/) ht[w[1]] = w[3] }
    for (i in f) { l = f[i]; sub(/^[^:]*: */, "", l); n = split(l, w, " ");
                   if (n >= 3 && w[1] ~ /^[0-9]+$/ && w[2] ~ /^[0-9]+$/) ft[w[1]] = w[3] }
    for (i in t) { n = split(t[i], w, " "); if (n == 2) tt[w[1]] = w[2] }
    printf "%12s %10s %10s %9s %10s %9s\n", "bytes", "hier(ms)", "flat(ms)", "hier/flat", "torch(ms)", "vs torch"
    for (b in ht) if (b in ft) {
      tm = (b in tt) ? sprintf("%10.1f %8.2fx", tt[b] / 1000, tt[b] / ht[b]) : sprintf("%10s %9s", "-", "-")
      printf "%12d %10.1f %10.1f %8.2fx %s\n", b, ht[b] / 1000, ft[b] / 1000, ft[b] / ht[b], tm
    }
  }' | sort -n
  if [[ $ddp -eq 1 ]]; then
    for sw in 1 0; do
      echo "=== $rate link: bench_ddp --model mlp, EMBER_GLOO_HIERARCHICAL=$sw ==="
      run_ember "$sw" $((port++)) "$bench_ddp" --model mlp --threads 1 | grep -v '^emberrun' || true
    done
  fi
done
