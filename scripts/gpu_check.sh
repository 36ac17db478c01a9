#!/usr/bin/env bash
# gpu_check.sh BUNDLE OUTDIR [tests|bench|train|attn|gpt|gpt_graph|gpt124m|cpu]... — what only a GPU machine can show, run
# on the GPU machine from a bundle made here by scripts/gpu_bundle.sh (a CUDA build in build/):
#   device call: bash scripts/gpu_check.sh .gpu/bundle.txz $OUT tests bench   (carry: .gpu)
#   tests  every test case whose name says CUDA, cuda or NCCL (or matches $TEST_FILTER), each in
#          its own process (as ctest runs
#          them: a process that initialised CUDA cannot fork ranks that use it); summary and the
#          failures' output in OUTDIR/tests.log
#   bench  benchmarks/run_cuda_bench.py: bench_cuda beside PyTorch on the same GPU
#          ($BENCH_FILTER selects cases, e.g. gpt_; $BENCH_ROUNDS, default 3)
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
#          gpt_torch.py on the same token file: bf16 (Ember DDP and FSDP over NCCL on one rank, PyTorch
#          eager with SDPA) and float32 with TF32; each prints tokens_per_s= and mfu= (H200/H100
#          SXM dense peaks: 989.4 TFLOPS bf16, 494.7 TF32)
#   gpt124m_compile  PyTorch's torch.compile on the same tokens (bf16)
#   gpt124m_val  $GPT124M_VAL_STEPS (default 200) steps on the carried KJV text (byte tokens, the
#          same vocabulary) for both, for their validation losses. Summary of all three in
#          OUTDIR/gpt124m.md
#   cpu    the CPU benchmarks that need a quiet machine with cores to spare: bench_collectives
#          (allreduce, 2 and 4 ranks, pipelined; 2 ranks, latency) and bench_ddp (CNN and MLP,
#          1, 2 and 4 ranks), each beside the machine's PyTorch over gloo
# Each writes OUTDIR/<step>.log.
set -uo pipefail
bundle=$1 out=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
b=/tmp/ember_gpu_bundle
rm -rf "$b" && mkdir -p "$b" && tar xf "$bundle" -C "$b"
nvidia-smi -L | tee "$out/device.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$out/device.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >> "$out/device.txt" 2>&1

run_tests() {
  local log=$out/tests.log pass=0 fail=0 skip=0
  : > "$log"
  # The example tests find the bundled programs, and the GPT tests the carried KJV text.
  export EMBER_BUILD_DIR=$b/bin/build
  [ -f "$root/.gpu/kjv.txt" ] && export EMBER_GPT_TEXT=$root/.gpu/kjv.txt
  for exe in "$b"/bin/build/tests/*; do
    [ -x "$exe" ] || continue
    for t in $("$b/run.sh" "$exe" --gtest_list_tests --gtest_filter="${TEST_FILTER:-*Cuda*:*CUDA*:*Nccl*:*_cuda*}" |
               awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
      res=$(timeout "${TEST_TIMEOUT:-120}" "$b/run.sh" "$exe" --gtest_filter="$t" 2>&1)
      rc=$?
      if [ $rc -ne 0 ]; then
        fail=$((fail + 1)); echo "FAIL $(basename "$exe") $t (rc $rc)" >> "$log"
        echo "$res" | tail -40 >> "$log"
      elif echo "$res" | grep -q '\[  SKIPPED \]'; then
        skip=$((skip + 1)); echo "SKIP $(basename "$exe") $t: $(echo "$res" | grep -m1 -i 'skipped\|no cuda\|needs' | head -c 200)" >> "$log"
      else
        pass=$((pass + 1)); echo "PASS $(basename "$exe") $t" >> "$log"
      fi
    done
  done
  echo "tests: $pass passed, $fail failed, $skip skipped" | tee -a "$log"
}

run_bench() {
  timeout "${BENCH_STEP_TIMEOUT:-420}" python3 "$root/benchmarks/run_cuda_bench.py" --bench "$b/run.sh bin/build/benchmarks/bench_cuda" \
    --rounds "${BENCH_ROUNDS:-3}" --filter "${BENCH_FILTER:-}" \
    --markdown "$out/bench_cuda.md" 2>&1 | tee "$out/bench.log"
}

run_train() {
  local data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist} fm=$b/bin/build/examples/fashion_mnist
  [ -d "$data" ] || data=$root/.gpu/fashion-mnist
  {
    echo "== ember, 1 rank, cuda"
    "$b/run.sh" "$fm" --device cuda --model cnn --epochs 2 --data "$data" 2>&1 | grep -v '\[#'
    echo "== ember, 2 ranks sharing the GPU, cuda (gloo)"
    "$b/run.sh" "$b/bin/build/launcher/emberrun" --standalone --nproc-per-node 2 "$fm" --device cuda:0 \
      --model cnn --epochs 2 --data "$data" 2>&1 | grep -v '\[#'
    echo "== torch, 1 rank, cuda"
    python3 "$root/benchmarks/vs_pytorch/fashion_mnist_torch.py" --device cuda --nproc 1 --model cnn \
      --epochs 2 --data "$data" 2>&1
    echo "== torch, 2 ranks sharing the GPU, cuda (gloo)"
    timeout 300 python3 "$root/benchmarks/vs_pytorch/fashion_mnist_torch.py" --device cuda --nproc 2 \
      --model cnn --epochs 2 --data "$data" 2>&1
  } | tee "$out/train.log"
}

run_attn() {
  export EMBER_PYTHON=$(command -v python3) EMBER_SOURCE_DIR=$root
  local ba=$b/bin/build/benchmarks/bench_attention
  {
    timeout 200 "$b/run.sh" "$ba" --device cuda --dtype bfloat16 --batch 8 --heads 12 --dim 64 \
      --seq 256,1024,2048 --rounds 3 --reps 10
    timeout 120 "$b/run.sh" "$ba" --device cuda --dtype float32 --seq 128,512 --rounds 3 --reps 10
    # GPT-2 124M's float32 attention with TF32 allowed on both sides (Ember's TF32 kernel).
    timeout 200 "$b/run.sh" "$ba" --device cuda --dtype float32 --allow-tf32 --batch 8 --heads 12 \
      --dim 64 --seq 1024,2048 --rounds 3 --reps 10
  } 2>&1 | tee "$out/attn.log"
}

run_gpt() {
  local data=$root/.gpu/kjv.txt cache=/tmp/ember_gpt_cache
  local model=(--layers 6 --heads 6 --dim 384 --context 256 --batch-size 64 --steps "${GPT_STEPS:-300}"
               --eval-every 0 --eval-batches 8 --seed 0)
  {
    for amp in ${GPT_AMPS:-bf16 fp16 off}; do
      echo "== ember, 1 rank, cuda, amp $amp"
      timeout "${GPT_TIMEOUT:-240}" "$b/run.sh" "$b/bin/build/examples/gpt" --device cuda --amp $amp --data "$data" \
        --cache-dir "$cache" "${model[@]}" 2>&1 | grep -v '\[#'
      local attns=(fused)
      [ $amp = bf16 ] && attns=(fused written)  # PyTorch 1.13's written-out attention, once
      for attn in "${attns[@]}"; do
        echo "== torch, 1 rank, cuda, amp $amp, attention $attn"
        timeout "${GPT_TIMEOUT:-240}" python3 "$root/benchmarks/vs_pytorch/gpt_torch.py" --device cuda --amp $amp \
          --attention $attn --tokens "$cache/$(basename "$data").tokens" "${model[@]}" 2>&1
      done
    done
  } | tee "$out/gpt.log"
}

# The 10.8M GPT in bf16, eager and with --cuda-graph (Note [CUDA graphs]), in one call.
run_gpt_graph() {
  local data=$root/.gpu/kjv.txt cache=/tmp/ember_gpt_cache
  local model=(--layers 6 --heads 6 --dim 384 --context 256 --batch-size "${GPT_BATCH:-64}"
               --steps "${GPT_STEPS:-100}" --eval-every 0 --eval-batches 8 --seed 0 --amp bf16)
  {
    for graph in "" --cuda-graph; do
      echo "== ember, 1 rank, cuda, amp bf16 ${graph:-eager}"
      timeout "${GPT_TIMEOUT:-240}" "$b/run.sh" "$b/bin/build/examples/gpt" --device cuda --data "$data" \
        --cache-dir "$cache" "${model[@]}" $graph 2>&1 | grep -v '\[#'
    done
  } | tee "$out/gpt_graph.log"
}

# GPT-2 124M's shape and the runs of one comparison (gpt124m, gpt124m_compile, gpt124m_val).
g124_shape=(--layers 12 --heads 12 --dim 768 --context 1024 --vocab 50304 --lr 6e-4 --seed 0
            --batch-size "${GPT124M_BATCH:-16}")
g124_cache=/tmp/ember_gpt_cache
g124() {  # g124 LABEL TIMEOUT ember|torch ARGS...: one run, its output appended to gpt124m.log
  local label=$1 t=$2 who=$3; shift 3
  echo "== $label" | tee -a "$out/gpt124m.log"
  if [ "$who" = ember ]; then
    timeout "$t" "$b/run.sh" "$b/bin/build/examples/gpt" --device cuda --cache-dir "$g124_cache" \
      "${g124_shape[@]}" "$@" 2>&1 | grep -v '\[#' | tee -a "$out/gpt124m.log"
  else
    timeout "$t" python3 "$root/benchmarks/vs_pytorch/gpt_torch.py" --device cuda \
      --attention fused "${g124_shape[@]}" "$@" 2>&1 | tail -30 | tee -a "$out/gpt124m.log"
  fi
}
g124_tokens() { ls "$g124_cache"/synthetic-*.bin 2>/dev/null | head -1; }
g124_summary() {
  grep -E '^== |tokens_per_s=|mfu=|val_loss=|validation loss|peak|Error|error' "$out/gpt124m.log" \
    > "$out/gpt124m.md"
}

run_gpt124m() {  # speed on synthetic tokens: bf16 (DDP and FSDP, one rank), float32 with TF32
  local speed=(--steps "${GPT124M_STEPS:-30}" --warmup-steps 10 --eval-every 0 --eval-batches 1)
  local bf16=(--amp bf16 --peak-tflops 989.4) tf32=(--amp off --allow-tf32 --peak-tflops 494.7)
  local t=${GPT124M_TIMEOUT:-120}
  g124 "ember, bf16, synthetic" "$t" ember --data synthetic "${bf16[@]}" "${speed[@]}"
  local tokens; tokens=$(g124_tokens)
  g124 "torch eager (SDPA), bf16, synthetic" "$t" torch --tokens "$tokens" "${bf16[@]}" "${speed[@]}"
  # Over NCCL, as PyTorch's FSDP runs: over gloo every CUDA gather is staged through the host.
  g124 "ember FSDP (NCCL), bf16, synthetic" "$t" ember --data synthetic --shard fsdp \
    --backend nccl "${bf16[@]}" "${speed[@]}"
  g124 "ember, float32 + TF32, synthetic" "$t" ember --data synthetic "${tf32[@]}" "${speed[@]}"
  g124 "torch eager, float32 + TF32, synthetic" "$t" torch --tokens "$tokens" "${tf32[@]}" "${speed[@]}"
  g124_summary
}

run_gpt124m_compile() {  # torch.compile on the same synthetic tokens (bf16)
  local speed=(--steps "${GPT124M_STEPS:-30}" --warmup-steps 10 --eval-every 0 --eval-batches 1)
  g124 "torch.compile, bf16, synthetic" "${GPT124M_COMPILE_TIMEOUT:-240}" torch --compile \
    --tokens "$(g124_tokens)" --amp bf16 --peak-tflops 989.4 "${speed[@]}"
  g124_summary
}

run_gpt124m_val() {  # validation loss after $GPT124M_VAL_STEPS (200) steps on the KJV's bytes
  local quality=(--steps "${GPT124M_VAL_STEPS:-200}" --warmup-steps 10 --eval-every 0
                 --eval-batches 8 --amp bf16 --peak-tflops 989.4)
  local t=${GPT124M_TIMEOUT:-150}
  g124 "ember, bf16, KJV bytes" "$t" ember --data "$root/.gpu/kjv.txt" "${quality[@]}"
  g124 "torch eager (SDPA), bf16, KJV bytes" "$t" torch --tokens "$g124_cache/kjv.txt.tokens" \
    "${quality[@]}"
  g124_summary
}

run_cpu() {
  local bb=$b/bin/build/benchmarks
  export EMBER_PYTHON=$(command -v python3) EMBER_SOURCE_DIR=$root
  nproc > "$out/cpu.log"
  for np in 2 4; do
    timeout 120 "$b/run.sh" "$bb/bench_collectives" --np $np --op allreduce --rounds 2 --torch \
      2>&1 | tee -a "$out/cpu.log"
  done
  timeout 60 "$b/run.sh" "$bb/bench_collectives" --np 2 --op allreduce --rounds 2 --torch \
    --mode latency --max-bytes 65536 2>&1 | tee -a "$out/cpu.log"
  timeout 200 "$b/run.sh" "$bb/ddp/bench_ddp" --np 1,2,4 --model cnn,mlp --torch --repeats 2 2>&1 | tee -a "$out/cpu.log"
}

for step in "$@"; do
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
