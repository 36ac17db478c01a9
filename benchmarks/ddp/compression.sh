#!/usr/bin/env bash
# compression.sh: DDP's compressing hooks over a slow link (issue 39's measurement): 2 "nodes"
# (network namespaces joined by a veth pair shaped to --rate, benchmarks/collectives/
# netns_pair.sh) x 2 ranks, the hierarchical gloo group (shared memory inside a node).
#
# For each --hooks spec (bench_ddp's --comm-hook, docs/ddp.md), in --rounds interleaved rounds:
#   - bench_ddp --model MODEL: the median DDP step time and the bytes the hook sent (its summary);
#   - where PyTorch has that hook on CPU (allreduce, fp16, powersgd, post_localsgd): the same
#     model, batch and hook under torch's DDP (bench_ddp_hooks_torch.py, /usr/bin/python3).
# Then, unless --accuracy-steps 0, examples/fashion_mnist --model mlp (the same MLP, MODEL
# mlp512) trained --accuracy-steps steps with each hook from the same seed: the test loss and
# accuracy after that budget. The summary prints each hook's speed-up over plain all-reduce,
# its ratio to PyTorch's step rate, and its test loss relative to all-reduce's.
# --bucket-cap-mb "25 8" runs every hook at each of DDP's bucket sizes in every round (rows
# "hook@8MB"); the speed-ups are then over plain all-reduce's fastest bucket size.
#
#   sudo benchmarks/ddp/compression.sh [--rate 1gbit] [--model mlp512] [--steps 30] [--batch 64]
#        [--rounds 3] [--accuracy-steps 300] [--hooks "none int8 sign topk:ratio=0.01 ..."]
#        [--bucket-cap-mb "25"] [--build build]
#
# Needs root (namespaces, tc), bench_ddp, fashion_mnist and emberrun built in --build; the
# namespaces and every process in them are removed on exit.
set -euo pipefail

rate=1gbit
model=mlp512
steps=30
batch=64
rounds=3
accuracy_steps=300
hooks="none fp16 int8 sign topk:ratio=0.01 powersgd:rank=4,start=2 post_localsgd:start=0,period=4,local=2 post_localsgd:start=0,period=8,local=2"
build=build
caps=25
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rate) rate="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --accuracy-steps) accuracy_steps="$2"; shift 2 ;;
    --hooks) hooks="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --bucket-cap-mb) caps="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compression.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

here="$(cd "$(dirname "$0")" && pwd)"
emberrun="$build/launcher/emberrun"
bench="$build/benchmarks/ddp/bench_ddp"
example="$build/examples/fashion_mnist"
for f in "$emberrun" "$bench" "$example"; do
  [[ -x "$f" ]] || { echo "compression.sh: $f not built" >&2; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { echo "compression.sh: needs root (network namespaces, tc)" >&2; exit 2; }

source "$here/../collectives/netns_pair.sh"
netns_up
netns_shape "$rate"
port=29711

# PyTorch's DDP with hook $1, 2 ranks per namespace; prints rank 0's "RESULT step_ms".
run_torch() {
  local procs=() i node
  for i in 3 2 1 0; do
    node=$((i / 2))
    ip netns exec "${ns[$node]}" env RANK=$i WORLD_SIZE=4 MASTER_ADDR="${addr[0]}" \
      MASTER_PORT="$2" GLOO_SOCKET_IFNAME="${dev[$node]}" OMP_WAIT_POLICY=PASSIVE \
      /usr/bin/python3 "$here/bench_ddp_hooks_torch.py" --model "$model" --hook "$1" \
      --steps "$steps" --batch "$batch" --threads 1 &
    procs+=($!)
  done
  wait "${procs[@]}"
}

torch_has() {
  case "${1%%:*}" in none|allreduce|fp16|powersgd|post_localsgd) return 0 ;; *) return 1 ;; esac
}

# The rows: each hook, at each bucket size when more than one is given ("int8@8MB").
rows=()
for cap in $caps; do
  for h in $hooks; do
    if [[ $caps == *" "* ]]; then rows+=("$h@${cap}MB"); else rows+=("$h"); fi
  done
done
hook_of() { echo "${1%@*}"; }
cap_of() { if [[ $1 == *@*MB ]]; then local c=${1##*@}; echo "${c%MB}"; else echo "$caps"; fi; }

declare -A ember_ms torch_ms bytes
for ((r = 1; r <= rounds; r++)); do
  for row in "${rows[@]}"; do
    h="$(hook_of "$row")"
    out="$(netns_emberrun "" $((port++)) "$bench" --model "$model" --comm-hook "$h" \
           --steps "$steps" --batch "$batch" --repeats 1 --threads 1 \
           --bucket-cap-mb "$(cap_of "$row")")"
    # The row after emberrun's "[rank 0]:" prefix: model ranks thr params | step ...
    ms="$(sed -n "s/^[^:]*: *$model \+4 .*| *\([0-9.]\+\) .*/\1/p" <<<"$out" | head -1)"
    [[ -n "$ms" ]] || { echo "compression.sh: no bench_ddp row for $h:"; echo "$out"; exit 1; } >&2
    ember_ms[$row]+="$ms "
    bytes[$row]="$(grep -o 'sent .*' <<<"$out" | head -1 || true)"
    echo "round $r $row: Ember ${ms} ms/step ${bytes[$row]}"
    grep "$model \+4 " <<<"$out" || true
    # PyTorch once per hook (the first bucket size), at its default bucket size.
    if torch_has "$h" && [[ $(cap_of "$row") == "${caps%% *}" ]]; then
      t="$( (run_torch "$h" $((port++)) || true) | sed -n 's/^RESULT \([0-9.]\+\).*/\1/p')"
      [[ -z "$t" ]] || torch_ms[$row]+="$t "
      echo "round $r $row: PyTorch ${t} ms/step"
    fi
  done
done

median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }

declare -A loss acc
if [[ $accuracy_steps -gt 0 ]]; then
  for h in $hooks; do
    out="$(netns_emberrun "" $((port++)) "$example" --model mlp --max-steps "$accuracy_steps" \
           --batch-size 64 --comm-hook "$h" 2>&1)"
    loss[$h]="$(grep -o 'test loss [0-9.]*' <<<"$out" | tail -1 | awk '{print $3}')"
    acc[$h]="$(grep -o 'test_accuracy=[0-9.]*' <<<"$out" | tail -1 | cut -d= -f2)"
    echo "accuracy $h: test loss ${loss[$h]}, accuracy ${acc[$h]}"
  done
fi

# Plain all-reduce's fastest bucket size is the base.
base=""
for row in "${rows[@]}"; do
  case "$(hook_of "$row")" in none|allreduce) ;; *) continue ;; esac
  m="$(median "${ember_ms[$row]}")"
  if [[ -z $base ]] || awk -v a="$m" -v b="$base" 'BEGIN {exit !(a < b)}'; then base=$m; fi
done
echo "=== $rate link, 2 namespaces x 2 ranks, $model, medians of $rounds rounds ==="
printf "%-42s %9s %9s %9s %9s %9s %10s\n" hook "ms/step" "vs none" "torch ms" "vs torch" \
  "test loss" "vs none"
for row in "${rows[@]}"; do
  h="$(hook_of "$row")"
  e="$(median "${ember_ms[$row]}")"
  t="-"; vt="-"
  if [[ -n "${torch_ms[$row]:-}" ]]; then
    t="$(median "${torch_ms[$row]}")"
    vt="$(awk -v a="$t" -v b="$e" 'BEGIN {printf "%.2fx", a / b}')"
  fi
  l="${loss[$h]:--}"; vl="-"
  if [[ -n "${loss[none]:-}" && "$l" != "-" ]]; then
    vl="$(awk -v a="$l" -v b="${loss[none]}" 'BEGIN {printf "%+.1f%%", 100 * (a / b - 1)}')"
  fi
  printf "%-42s %9.1f %8.2fx %9s %9s %9s %10s\n" "$row" "$e" \
    "$(awk -v a="$base" -v b="$e" 'BEGIN {print a / b}')" "$t" "$vt" "$l" "$vl"
  [[ -z "${bytes[$row]}" ]] || echo "    ${bytes[$row]}"
done
