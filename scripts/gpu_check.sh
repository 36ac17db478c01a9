#!/usr/bin/env bash
# gpu_check.sh BUNDLE OUTDIR [tests|bench|train|attn|gpt|gpt_graph|gpt124m|cpu]... — what only a GPU machine can show, run
# on the GPU machine from a bundle made here by scripts/gpu_bundle.sh (a CUDA build in build/):
#   device call: bash scripts/gpu_check.sh .gpu/bundle.txz $OUT tests bench   (carry: .gpu)
# The steps run in the order given, the most wanted first: the whole call has $BUDGET seconds
# (default 540, counted from the script's start, for a device call of timeout_s 570). Each step,
# test and run checks it: once fewer than $BUDGET_MIN (default 10) seconds are left it is not
# started and a "skipped: budget" line says so, and every timeout is capped at what is left.
#   tests  every test case whose name says CUDA, cuda or NCCL (or matches $TEST_FILTER), each in
#          its own process (as ctest runs
#          them: a process that initialised CUDA cannot fork ranks that use it), each under
#          $TEST_TIMEOUT (default 60 s); PASS/FAIL lines as they finish, the summary and the
#          failures' output in OUTDIR/tests.log
#   bench  benchmarks/run_cuda_bench.py: bench_cuda beside PyTorch on the same GPU
#          ($BENCH_FILTER selects cases, e.g. gpt_; $BENCH_ROUNDS, default 3; each bench_cuda or
#          bench_cuda_torch.py run under $BENCH_TIMEOUT, default 120 s, the step under
#          $BENCH_STEP_TIMEOUT, default 300 s); the table after every round in OUTDIR/bench_cuda.md
#   train  examples/fashion_mnist --device cuda, 1 rank and 2 ranks sharing the GPU (gloo,
#          staged through host memory), beside benchmarks/vs_pytorch/fashion_mnist_torch.py;
#          the IDX files from $FASHION_MNIST, else /usr/share/datasets/fashion-mnist, else
#          .gpu/fashion-mnist (a GPU machine lacks Debian's package: carry a copy there)
#   attn   bench_attention on the GPU (bfloat16 at GPT-2-small head shapes, float32 at the CPU
#          table's shapes, float32 with TF32 allowed at GPT-2's) beside the GPU PyTorch's
#          F.scaled_dot_product_attention
#   gpt    ($GPT_AMPS, default "bf16 fp16 off") examples/gpt on the GPU (a 6-layer, 384-wide model, 256-token context) in float32,
#          bfloat16 and float16 (GradScaler) beside gpt_torch.py with the same model, written-out
#          and fused attention; the KJV as plain text from .gpu/kjv.txt (the GPU machine has no
#          bible-kjv to decode /usr/lib/bible.data: copy examples/gpt's token file there, it is
#          the text byte for byte)
#   gpt_graph  the same 10.8M GPT in bf16 ($GPT_BATCH, default 64; $GPT_STEPS, default 100),
#          eager and with --cuda-graph, tokens_per_s of each (OUTDIR/gpt_graph.log)
#   gpt124m  examples/gpt at GPT-2 124M's shape (12 layers, 768 wide, 12 heads, context 1024,
#          vocabulary 50304, batch $GPT124M_BATCH, default 16) on synthetic tokens beside
#          gpt_torch.py on the same token file (the one Ember's banner names): bf16 (Ember DDP
#          and FSDP over NCCL on one rank, PyTorch eager with SDPA) and float32 with TF32; each
#          prints tokens_per_s= and mfu= (H200/H100 SXM dense peaks: 989.4 TFLOPS bf16, 494.7
#          TF32)
#   gpt124m_compile  PyTorch's torch.compile on the same tokens (bf16)
#   gpt124m_val  $GPT124M_VAL_STEPS (default 200) steps on the carried KJV text (byte tokens, the
#          same vocabulary) for both, for their validation losses. Summary of all three in
#          OUTDIR/gpt124m.md, rewritten after every run; each PyTorch run's whole output in
#          OUTDIR/gpt124m_<run>.log
#   cpu    the CPU benchmarks that need a quiet machine with cores to spare: bench_collectives
#          (allreduce, 2 and 4 ranks, pipelined; 2 ranks, latency) and bench_ddp (CNN and MLP,
#          1, 2 and 4 ranks), each beside the machine's PyTorch over gloo
# Each writes OUTDIR/<step>.log, line by line as it runs (Python unbuffered, grep line-buffered),
# so a call killed part way keeps what finished.
set -uo pipefail
bundle=$1 out=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
budget=${BUDGET:-540}
b=/tmp/ember_gpu_bundle

# spent WHAT [LOG]: true, after a "skipped: budget" line (on stdout, and appended to LOG), once
# fewer than $BUDGET_MIN seconds of the budget are left.
spent() {
  [ $((budget - SECONDS)) -ge "${BUDGET_MIN:-10}" ] && return 1
  local line="skipped: budget ($1; ${SECONDS} s of ${budget} s spent)"
  echo "$line"
  [ $# -lt 2 ] || echo "$line" >> "$2"
  return 0
}
# cap T: T seconds, or what is left of the budget if that is less (at least 1).
cap() {
  local t=$1 left=$((budget - SECONDS))
  [ "$left" -lt "$t" ] && t=$left
  [ "$t" -ge 1 ] || t=1
  echo "$t"
}
# tmo T COMMAND...: timeout at cap T, KILL 5 s after TERM.
tmo() { local t; t=$(cap "$1"); shift; timeout -k 5 "$t" "$@"; }
# ended RC: a line for a run that did not exit 0 (124 and 137: timeout's TERM and KILL).
ended() {
  case $1 in
    0) ;;
    124 | 137) echo "ended: timed out (rc $1)" ;;
    *) echo "ended: rc $1" ;;
  esac
}

rm -rf "$b" && mkdir -p "$b" && tar xf "$bundle" -C "$b"
timeout 60 nvidia-smi -L | tee "$out/device.txt"
timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$out/device.txt"
# gpt_torch.py needs numpy besides torch: a missing one shows here, not in each GPT step.
timeout 120 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >> "$out/device.txt" 2>&1
timeout 60 python3 -c 'import numpy; print("numpy", numpy.__version__)' >> "$out/device.txt" 2>&1

run_tests() {
  local log=$out/tests.log pass=0 fail=0 skip=0 exe t res rc list
  : >> "$log"
  # The example tests find the bundled programs, and the GPT tests the carried KJV text.
  export EMBER_BUILD_DIR=$b/bin/build
  [ -f "$root/.gpu/kjv.txt" ] && export EMBER_GPT_TEXT=$root/.gpu/kjv.txt
  for exe in "$b"/bin/build/tests/*; do
    [ -x "$exe" ] || continue
    spent "tests from $(basename "$exe") on" "$log" && break
    list=$(tmo 60 "$b/run.sh" "$exe" --gtest_list_tests --gtest_filter="${TEST_FILTER:-*Cuda*:*CUDA*:*Nccl*:*_cuda*}" |
           awk '/^[^ ]/{s=$1} /^  /{print s $1}')
    for t in $list; do
      spent "tests from $(basename "$exe") $t on" "$log" && break 2
      res=$(tmo "${TEST_TIMEOUT:-60}" "$b/run.sh" "$exe" --gtest_filter="$t" 2>&1)
      rc=$?
      # Here-strings, not `echo | grep -q`: under pipefail grep -q quitting first can make
      # echo die of SIGPIPE, and the test would count as passed.
      if [ $rc -ne 0 ]; then
        fail=$((fail + 1)); echo "FAIL $(basename "$exe") $t ($(ended $rc))" | tee -a "$log"
        tail -40 <<<"$res" >> "$log"
      elif grep -q '\[  SKIPPED \]' <<<"$res"; then
        skip=$((skip + 1)); echo "SKIP $(basename "$exe") $t: $(grep -m1 -i 'skipped\|no cuda\|needs' <<<"$res" | head -c 200)" >> "$log"
      else
        pass=$((pass + 1)); echo "PASS $(basename "$exe") $t" >> "$log"
      fi
    done
  done
  echo "tests: $pass passed, $fail failed, $skip skipped" | tee -a "$log"
}

run_bench() {
  local t round=${BENCH_TIMEOUT:-120}
  t=$(cap "${BENCH_STEP_TIMEOUT:-300}")
  [ "$round" -gt "$t" ] && round=$t  # one round's run no longer than the step
  BENCH_TIMEOUT=$round \
    tmo "$t" python3 -u "$root/benchmarks/run_cuda_bench.py" --bench "$b/run.sh bin/build/benchmarks/bench_cuda" \
    --rounds "${BENCH_ROUNDS:-3}" --filter "${BENCH_FILTER:-}" \
    --markdown "$out/bench_cuda.md" 2>&1 | tee -a "$out/bench.log"
  ended "${PIPESTATUS[0]}" | tee -a "$out/bench.log"
}

run_train() {
  local data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist} fm=$b/bin/build/examples/fashion_mnist
  local log=$out/train.log t=${TRAIN_TIMEOUT:-300}
  [ -d "$data" ] || data=$root/.gpu/fashion-mnist
  {
    spent "train: ember, 1 rank" && return
    echo "== ember, 1 rank, cuda"
    tmo "$t" "$b/run.sh" "$fm" --device cuda --model cnn --epochs 2 --data "$data" 2>&1 |
      grep --line-buffered -v '\[#'
    ended "${PIPESTATUS[0]}"
    spent "train: ember, 2 ranks" && return
    echo "== ember, 2 ranks sharing the GPU, cuda (gloo)"
    tmo "$t" "$b/run.sh" "$b/bin/build/launcher/emberrun" --standalone --nproc-per-node 2 "$fm" --device cuda:0 \
      --model cnn --epochs 2 --data "$data" 2>&1 | grep --line-buffered -v '\[#'
    ended "${PIPESTATUS[0]}"
    spent "train: torch, 1 rank" && return
    echo "== torch, 1 rank, cuda"
    tmo "$t" python3 -u "$root/benchmarks/vs_pytorch/fashion_mnist_torch.py" --device cuda --nproc 1 --model cnn \
      --epochs 2 --data "$data" 2>&1
    ended $?
    spent "train: torch, 2 ranks" && return
    echo "== torch, 2 ranks sharing the GPU, cuda (gloo)"
    tmo "$t" python3 -u "$root/benchmarks/vs_pytorch/fashion_mnist_torch.py" --device cuda --nproc 2 \
      --model cnn --epochs 2 --data "$data" 2>&1
    ended $?
  } | tee -a "$log"
}

run_attn() {
  export EMBER_PYTHON=$(command -v python3) EMBER_SOURCE_DIR=$root
  local ba=$b/bin/build/benchmarks/bench_attention
  # bench_attention prints each length's line as it is measured; its PyTorch side is a Python
  # subprocess per round.
  {
    spent "attn: bfloat16" && return
    tmo 200 "$b/run.sh" "$ba" --device cuda --dtype bfloat16 --batch 8 --heads 12 --dim 64 \
      --seq 256,1024,2048 --rounds 3 --reps 10
    ended $?
    spent "attn: float32" && return
    tmo 120 "$b/run.sh" "$ba" --device cuda --dtype float32 --seq 128,512 --rounds 3 --reps 10
    ended $?
    # GPT-2 124M's float32 attention with TF32 allowed on both sides (Ember's TF32 kernel).
    spent "attn: float32 + TF32" && return
    tmo 200 "$b/run.sh" "$ba" --device cuda --dtype float32 --allow-tf32 --batch 8 --heads 12 \
      --dim 64 --seq 1024,2048 --rounds 3 --reps 10
    ended $?
  } 2>&1 | tee -a "$out/attn.log"
}

run_gpt() {
  local data=$root/.gpu/kjv.txt cache=/tmp/ember_gpt_cache
  local model=(--layers 6 --heads 6 --dim 384 --context 256 --batch-size 64 --steps "${GPT_STEPS:-300}"
               --eval-every 0 --eval-batches 8 --seed 0)
  {
    for amp in ${GPT_AMPS:-bf16 fp16 off}; do
      spent "gpt: ember, amp $amp" && return
      echo "== ember, 1 rank, cuda, amp $amp"
      tmo "${GPT_TIMEOUT:-240}" "$b/run.sh" "$b/bin/build/examples/gpt" --device cuda --amp "$amp" --data "$data" \
        --cache-dir "$cache" "${model[@]}" 2>&1 | grep --line-buffered -v '\[#'
      ended "${PIPESTATUS[0]}"
      local attns=(fused)
      [ "$amp" = bf16 ] && attns=(fused written)  # PyTorch 1.13's written-out attention, once
      for attn in "${attns[@]}"; do
        spent "gpt: torch, amp $amp, attention $attn" && return
        echo "== torch, 1 rank, cuda, amp $amp, attention $attn"
        tmo "${GPT_TIMEOUT:-240}" python3 -u "$root/benchmarks/vs_pytorch/gpt_torch.py" --device cuda --amp "$amp" \
          --attention "$attn" --tokens "$cache/$(basename "$data").tokens" "${model[@]}" 2>&1
        ended $?
      done
    done
  } | tee -a "$out/gpt.log"
}

# The 10.8M GPT in bf16, eager and with --cuda-graph (Note [CUDA graphs]), in one call.
run_gpt_graph() {
  local data=$root/.gpu/kjv.txt cache=/tmp/ember_gpt_cache
  local model=(--layers 6 --heads 6 --dim 384 --context 256 --batch-size "${GPT_BATCH:-64}"
               --steps "${GPT_STEPS:-100}" --eval-every 0 --eval-batches 8 --seed 0 --amp bf16)
  {
    for graph in "" --cuda-graph; do
      spent "gpt_graph: ${graph:-eager}" && return
      echo "== ember, 1 rank, cuda, amp bf16 ${graph:-eager}"
      tmo "${GPT_TIMEOUT:-240}" "$b/run.sh" "$b/bin/build/examples/gpt" --device cuda --data "$data" \
        --cache-dir "$cache" "${model[@]}" $graph 2>&1 | grep --line-buffered -v '\[#'
      ended "${PIPESTATUS[0]}"
    done
  } | tee -a "$out/gpt_graph.log"
}

# GPT-2 124M's shape and the runs of one comparison (gpt124m, gpt124m_compile, gpt124m_val).
g124_shape=(--layers 12 --heads 12 --dim 768 --context 1024 --vocab 50304 --lr 6e-4 --seed 0
            --batch-size "${GPT124M_BATCH:-16}")
g124_cache=/tmp/ember_gpt_cache
g124() {  # g124 LABEL TIMEOUT ember|torch ARGS...: one run, its output appended to gpt124m.log
  local label=$1 t=$2 who=$3 log=$out/gpt124m.log rc; shift 3
  if spent "gpt124m: $label" "$log"; then g124_summary; return; fi
  echo "== $label" | tee -a "$log"
  if [ "$who" = ember ]; then
    tmo "$t" "$b/run.sh" "$b/bin/build/examples/gpt" --device cuda --cache-dir "$g124_cache" \
      "${g124_shape[@]}" "$@" 2>&1 | grep --line-buffered -v '\[#' | tee -a "$log"
    rc=${PIPESTATUS[0]}
  else
    # The whole output in its own file, written as it runs; its tail in gpt124m.log.
    local own; own=$out/gpt124m_$(tr -cs 'A-Za-z0-9' '_' <<<"$label" | sed 's/_*$//').log
    tmo "$t" python3 -u "$root/benchmarks/vs_pytorch/gpt_torch.py" --device cuda \
      --attention fused "${g124_shape[@]}" "$@" > "$own" 2>&1
    rc=$?
    tail -30 "$own" | tee -a "$log"
  fi
  ended "$rc" | tee -a "$log"
  g124_summary
}
# The synthetic token file of this run's shape: the one the latest Ember run's banner names
# ("data synthetic PATH: ..."), else the name examples/gpt.cpp's synthetic_tokens gives
# g124_shape at $GPT124M_STEPS steps on one rank (synthetic-v<vocab>-n<count>-s<seed>.bin).
g124_tokens() {
  local f
  f=$(grep -o 'data synthetic [^:]*: ' "$out/gpt124m.log" 2>/dev/null | tail -n 1 |
      sed 's/^data synthetic //; s/: $//')
  if [ -z "$f" ]; then
    local steps=${GPT124M_STEPS:-30} batch=${GPT124M_BATCH:-16} T=1024 mib=$((1 << 20))
    local train=$((steps * batch * T + T + 1))
    local n=$((train + train / 9 + T + 1))
    n=$(((n + mib - 1) / mib * mib))
    [ $n -lt $((1 << 22)) ] && n=$((1 << 22))
    [ $n -gt $(((1 << 31) - mib)) ] && n=$(((1 << 31) - mib))
    f=$g124_cache/synthetic-v50304-n$n-s0.bin
  fi
  echo "$f"
}
# g124_synthetic LABEL TIMEOUT ARGS...: a PyTorch run on the synthetic tokens Ember made, or a
# FAILED line when there are none (examples/gpt --data synthetic writes them: run it first).
g124_synthetic() {
  local label=$1 t=$2 tokens; shift 2
  tokens=$(g124_tokens)
  if [ ! -s "$tokens" ]; then
    if spent "gpt124m: $label" "$out/gpt124m.log"; then g124_summary; return; fi
    echo "== $label" | tee -a "$out/gpt124m.log"
    echo "FAILED: no synthetic token file $tokens (an Ember run of this shape with --data synthetic writes it)" |
      tee -a "$out/gpt124m.log"
    g124_summary
    return
  fi
  g124 "$label" "$t" torch --tokens "$tokens" "$@"
}
g124_summary() {
  grep -E '^== |tokens_per_s=|mfu=|val_loss=|validation loss|peak|Error|error|^ended: |^FAILED|^skipped: ' \
    "$out/gpt124m.log" > "$out/gpt124m.md"
}

run_gpt124m() {  # speed on synthetic tokens: bf16 (DDP and FSDP, one rank), float32 with TF32
  local speed=(--steps "${GPT124M_STEPS:-30}" --warmup-steps 10 --eval-every 0 --eval-batches 1)
  local bf16=(--amp bf16 --peak-tflops 989.4) tf32=(--amp off --allow-tf32 --peak-tflops 494.7)
  local t=${GPT124M_TIMEOUT:-120}
  g124 "ember, bf16, synthetic" "$t" ember --data synthetic "${bf16[@]}" "${speed[@]}"
  g124_synthetic "torch eager (SDPA), bf16, synthetic" "$t" "${bf16[@]}" "${speed[@]}"
  # Over NCCL, as PyTorch's FSDP runs: over gloo every CUDA gather is staged through the host.
  g124 "ember FSDP (NCCL), bf16, synthetic" "$t" ember --data synthetic --shard fsdp \
    --backend nccl "${bf16[@]}" "${speed[@]}"
  g124 "ember, float32 + TF32, synthetic" "$t" ember --data synthetic "${tf32[@]}" "${speed[@]}"
  g124_synthetic "torch eager, float32 + TF32, synthetic" "$t" "${tf32[@]}" "${speed[@]}"
}

run_gpt124m_compile() {  # torch.compile on the same synthetic tokens (bf16)
  local speed=(--steps "${GPT124M_STEPS:-30}" --warmup-steps 10 --eval-every 0 --eval-batches 1)
  g124_synthetic "torch.compile, bf16, synthetic" "${GPT124M_COMPILE_TIMEOUT:-240}" --compile \
    --amp bf16 --peak-tflops 989.4 "${speed[@]}"
}

run_gpt124m_val() {  # validation loss after $GPT124M_VAL_STEPS (200) steps on the KJV's bytes
  local quality=(--steps "${GPT124M_VAL_STEPS:-200}" --warmup-steps 10 --eval-every 0
                 --eval-batches 8 --amp bf16 --peak-tflops 989.4)
  local t=${GPT124M_TIMEOUT:-150}
  g124 "ember, bf16, KJV bytes" "$t" ember --data "$root/.gpu/kjv.txt" "${quality[@]}"
  g124 "torch eager (SDPA), bf16, KJV bytes" "$t" torch --tokens "$g124_cache/kjv.txt.tokens" \
    "${quality[@]}"
}

run_cpu() {
  local bb=$b/bin/build/benchmarks
  export EMBER_PYTHON=$(command -v python3) EMBER_SOURCE_DIR=$root
  nproc >> "$out/cpu.log"
  {
    for np in 2 4; do
      spent "cpu: allreduce, $np ranks" && return
      tmo 120 "$b/run.sh" "$bb/bench_collectives" --np $np --op allreduce --rounds 2 --torch 2>&1
      ended $?
    done
    spent "cpu: allreduce latency" && return
    tmo 60 "$b/run.sh" "$bb/bench_collectives" --np 2 --op allreduce --rounds 2 --torch \
      --mode latency --max-bytes 65536 2>&1
    ended $?
    spent "cpu: ddp" && return
    tmo 200 "$b/run.sh" "$bb/ddp/bench_ddp" --np 1,2,4 --model cnn,mlp --torch --repeats 2 2>&1
    ended $?
  } | tee -a "$out/cpu.log"
}

for step in "$@"; do
  case $step in
    gpt124m*) log=$out/gpt124m.log ;;
    *) log=$out/$step.log ;;
  esac
  spent "step $step" "$log" && continue
  case $step in
    tests) run_tests ;;
    bench) run_bench ;;
    train) run_train ;;
    attn) run_attn ;;
    gpt) run_gpt ;;
    gpt_graph) run_gpt_graph ;;
    gpt124m) run_gpt124m ;;
    gpt124m_compile) run_gpt124m_compile ;;
    gpt124m_val) run_gpt124m_val ;;
    cpu) run_cpu ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done
