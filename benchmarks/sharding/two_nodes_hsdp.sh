#!/usr/bin/env bash
# two_nodes_hsdp.sh: examples/gpt on two "nodes" of 2 ranks joined by a slow link, FSDP over the
# whole world against HSDP (sharded within a node, replicated across nodes).
#
# The nodes are the two network namespaces of benchmarks/collectives/netns_pair.sh: a veth pair
# whose both ends are shaped with `tc qdisc ... tbf` to each --rates rate. One emberrun per
# namespace (--nnodes 2 --node-rank K --nproc-per-node 2, the rendezvous store on the first
# namespace's address) trains examples/gpt on the KJV text (--data) with a model sized so that
# model state dominates, in two configurations:
#   fsdp  --shard fsdp: sharded over all 4 ranks, so every all-gather and reduce-scatter of the
#         parameters and gradients crosses the link;
#   hsdp  --shard hsdp: sharded over each node's 2 ranks (LOCAL_WORLD_SIZE) and replicated
#         across the nodes, so only the all-reduce of each gradient shard with its replica
#         crosses the link.
# Every round runs both (their order alternating from round to round, so a drift of the
# machine's load does not favour one), --rounds rounds per rate. The table gives each rate's
# median training tokens/s (examples/gpt's tokens_per_s= line) and hsdp/fsdp.
#
#   sudo benchmarks/sharding/two_nodes_hsdp.sh [--rates "1gbit 10gbit"] [--rounds 3]
#        [--steps 12] [--warmup-steps 2] [--layers 8] [--heads 8] [--dim 512] [--context 64]
#        [--batch-size 4] [--data /usr/lib/bible.data] [--limit 900] [--build build]
#
# Needs root (namespaces, tc), the ip and tc tools, emberrun and examples/gpt built in --build,
# and the text (/usr/lib/bible.data is Debian's bible-kjv-text: apt-get install bible-kjv-text).
# Both nodes' output of every run is kept in a mktemp folder, printed at the start and left for
# inspection. The namespaces and every process left in them are removed on exit, also on error
# or Ctrl-C; a run past --limit seconds is stopped.
set -euo pipefail

rates="1gbit 10gbit"
rounds=3
steps=12
warmup_steps=2
layers=8
heads=8
dim=512
context=64
batch_size=4
data=/usr/lib/bible.data
limit=900
build=build
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --warmup-steps) warmup_steps="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --heads) heads="$2"; shift 2 ;;
    --dim) dim="$2"; shift 2 ;;
    --context) context="$2"; shift 2 ;;
    --batch-size) batch_size="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --limit) limit="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "two_nodes_hsdp.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

here="$(cd "$(dirname "$0")" && pwd)"
emberrun="$build/launcher/emberrun"
gpt="$build/examples/gpt"
for f in "$emberrun" "$gpt"; do
  if [[ ! -x "$f" ]]; then
    echo "two_nodes_hsdp.sh: $f not built (cmake --build $build --target $(basename "$f"))" >&2
    exit 2
  fi
done
# Not `| grep -q`: grep quitting at the first match would fail the pipe (SIGPIPE, pipefail).
if [[ "$("$gpt" --help)" != *hsdp* ]]; then
  echo "two_nodes_hsdp.sh: $gpt has no --shard hsdp (cmake --build $build --target gpt)" >&2
  exit 2
fi
if [[ ! -r "$data" ]]; then
  echo "two_nodes_hsdp.sh: no $data (apt-get install bible-kjv-text, or --data FILE)" >&2
  exit 2
fi
for t in ip tc timeout; do
  command -v "$t" > /dev/null || { echo "two_nodes_hsdp.sh: needs $t on PATH" >&2; exit 2; }
done
if [[ $(id -u) -ne 0 ]]; then
  echo "two_nodes_hsdp.sh: needs root (network namespaces, tc)" >&2
  exit 2
fi
if (( steps <= warmup_steps )); then
  echo "two_nodes_hsdp.sh: --steps ($steps) must exceed --warmup-steps ($warmup_steps)" >&2
  exit 2
fi

# The namespaces are made after the checks, so a refused start leaves nothing to clean up.
# shellcheck source=../collectives/netns_pair.sh
source "$here/../collectives/netns_pair.sh"
logs="$(mktemp -d -t two_nodes_hsdp.XXXXXX)"
echo "# per-run logs (both nodes): $logs"
netns_up

# All 4 ranks share this machine's cores, but each emberrun would give its 2 ranks half of them
# (cores / --nproc-per-node): set a quarter each, or the ranks oversubscribe the cores twice.
threads=$(( $(nproc) / 4 ))
(( threads >= 1 )) || threads=1

# --warmup-steps leaves the first steps' one-time costs (buffers allocated, first use of each
# collective) out of tokens/s; evaluation is cut to one batch at the end, as in
# benchmarks/sharding/run_sharding.py.
gpt_args=(--data "$data" --layers "$layers" --heads "$heads" --dim "$dim" --context "$context"
          --batch-size "$batch_size" --steps "$steps" --warmup-steps "$warmup_steps"
          --eval-every 0 --eval-batches 1 --seed 0)

# Runs examples/gpt --shard $1 on both nodes, the store on port $2, node K's output into
# $3.nodeK; prints the run's tokens/s (global rank 0, on node 0, prints it). Fails with both
# logs' tails.
run_gpt() {
  local shard="$1" at="$2" log="$3" other rc=0 rc1=0 tps
  local common=(--nnodes 2 --nproc-per-node 2 --master-addr "${addr[0]}" --master-port "$at")
  ip netns exec "${ns[1]}" env EMBER_NUM_THREADS="$threads" timeout -k 10 "$limit" \
    "$emberrun" "${common[@]}" --node-rank 1 "$gpt" "${gpt_args[@]}" --shard "$shard" \
    > "$log.node1" 2>&1 &
  other=$!
  ip netns exec "${ns[0]}" env EMBER_NUM_THREADS="$threads" timeout -k 10 "$limit" \
    "$emberrun" "${common[@]}" --node-rank 0 "$gpt" "${gpt_args[@]}" --shard "$shard" \
    > "$log.node0" 2>&1 || rc=$?
  wait "$other" || rc1=$?
  # emberrun prefixes each rank's lines ("[rank 0]: tokens_per_s=1234"); the value is last.
  tps="$(sed -n 's/^\(.*: \)\{0,1\}tokens_per_s=\([0-9.]\{1,\}\)$/\2/p' "$log.node0" | tail -1)"
  if [[ $rc -ne 0 || $rc1 -ne 0 || -z "$tps" ]]; then
    {
      echo "two_nodes_hsdp.sh: --shard $shard failed (node 0: status $rc, node 1: status $rc1)"
      echo "--- $log.node0 (last lines)"; tail -n 20 "$log.node0"
      echo "--- $log.node1 (last lines)"; tail -n 20 "$log.node1"
    } >&2
    exit 1
  fi
  echo "$tps"
}

median() {
  tr ' ' '\n' <<<"$1" | grep . | sort -g |
    awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'
}

echo "# GPT (layers $layers, heads $heads, dim $dim, context $context," \
     "batch $batch_size per rank)," \
     "$steps steps ($warmup_steps untimed), 2 namespaces x 2 ranks, $threads thread(s) per rank," \
     "$(nproc) cores, $rounds rounds per rate, load before: $(cut -d' ' -f1 /proc/loadavg)"
# A store port per run, as the last run's may still be in TIME_WAIT; counted here because
# run_gpt runs in a command substitution's subshell.
port=29811
declare -A tps_runs
for rate in $rates; do
  netns_shape "$rate"
  for ((r = 1; r <= rounds; r++)); do
    if (( r % 2 )); then order="fsdp hsdp"; else order="hsdp fsdp"; fi
    for shard in $order; do
      tps="$(run_gpt "$shard" $((port++)) "$logs/$rate-round$r-$shard")"
      tps_runs[$rate/$shard]+="$tps "
      echo "$rate round $r --shard $shard: $tps tokens/s"
    done
  done
done

echo "=== medians of $rounds rounds: training tokens/s, 2 namespaces x 2 ranks ==="
printf "%-10s %12s %12s %10s\n" rate "fsdp tok/s" "hsdp tok/s" "hsdp/fsdp"
for rate in $rates; do
  f="$(median "${tps_runs[$rate/fsdp]}")"
  h="$(median "${tps_runs[$rate/hsdp]}")"
  printf "%-10s %12.0f %12.0f %9.2fx\n" "$rate" "$f" "$h" \
    "$(awk -v a="$h" -v b="$f" 'BEGIN {print a / b}')"
done
echo "# load after: $(cut -d' ' -f1 /proc/loadavg)"
