#!/usr/bin/env bash
# FP8 weights, one stream (issue 32, bench/RESULTS.md 2026-11-29): fewer launches in a one-token
# step. The Q/K/V split (bias, RoPE) done in the Q/K/V GEMV's epilogue (`KVFLEET_GEMV_QKV`), the
# split-KV merge folded into the decode kernel (`KVFLEET_FUSED_MERGE`), a row a warp in the O
# and down GEMVs (`KVFLEET_FP8_GEMV_ROW`), the argmax and the embedding with 16-byte loads; each
# against the code before in the same call (the switches at 0 turn each off).
# Here: release builds of the model bench (`cargo bench --bench model --no-run`) as `model`, the
# one before as `model-old`, the GPU test binaries `cuda_lib` (kvfleet-cuda's unit tests),
# `cuda_model` and `cuda_attention`, stripped and xz-compressed into $KVFLEET_L_DIR/bin/
# (.device/fp8-launches), with bench/peers.py, bench/http_load.py, bench/device/ncu_step.py and
# bench/device/llama-3.1-8b.json beside them; `kvfleet` (the worker) for `http`.
#   bash bench/device/fp8_launches.sh tests  # the GPU tests the change touches
#   bash bench/device/fp8_launches.sh one    # ceilings; one stream, FP8 and bf16, old and new
#                                            # with each switch off, rounds; 256 streams
#   bash bench/device/fp8_launches.sh switches  # one stream, FP8, the fused merge off and the
#                                            # row-a-warp GEMV off, at 128- and 1,024-token prompts
#   bash bench/device/fp8_launches.sh ncu    # per-kernel times of one decode step (ncu), old and new
#   bash bench/device/fp8_launches.sh http   # the worker through HTTP, FP8 and bf16 up at once:
#                                            # one stream and 256 streams, rounds
# KVFLEET_L_ROUNDS (3).
set -uo pipefail
mode=${1:?usage: fp8_launches.sh tests|one|switches|ncu|http}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=${KVFLEET_L_DIR:-.device/fp8-launches}
bin=/root/launches-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do
  b="$bin/$(basename "$f" .xz)"; xz -dc "$f" > "$b" && chmod +x "$b"
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

# bench BIN FP8 PROMPT BATCHES STEPS TAG: the model bench, dummy Llama-3.1-8B.
bench() {
  local exe=$1 fp8=$2 prompt=$3 batches=$4 steps=$5 tag=$6
  KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$fp8 KVFLEET_BENCH_PROMPT=$prompt \
    KVFLEET_BENCH_BATCHES=$batches KVFLEET_BENCH_STEPS=$steps timeout 200 "$bin/$exe" > "$OUT/bench_$tag.log" 2>&1
  echo "$tag: $(grep -E "prefill of|tok/s \(runs|panicked|error" "$OUT/bench_$tag.log" | sed 's/^llama3-8b[^:]*: //' | tr '\n' ' ')"
}

case "$mode" in
  tests)
    step "kvfleet-cuda GPU unit tests (FP8 kernels and fusions)"
    [ -x "$bin/cuda_lib" ] && timeout 240 "$bin/cuda_lib" --ignored --test-threads 1 gpu_ 2>&1 | tee "$OUT/cuda_lib.log" \
      | grep -E "^test |result|panicked" | tail -12
    step "GPU model tests on dummy geometries and random logits"
    # The tests that need no SmolLM2 GGUF (too large to carry beside the binaries).
    timeout 300 "$bin/cuda_model" --ignored --test-threads 1 gpu_fused_gemv gpu_dummy gpu_rows gpu_draws gpu_adjusted \
      gpu_steps_return 2>&1 | tee "$OUT/cuda_model.log" \
      | grep -E "^test |result|panicked" | tail -16
    if [ -x "$bin/cuda_attention" ]; then
      step "attention kernel tests"
      timeout 400 "$bin/cuda_attention" --ignored --test-threads 1 2>&1 | tee "$OUT/cuda_attention.log" \
        | grep -E "^test |result|panicked" | tail -30
    fi
    ;;
  one)
    step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
    PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    for r in $(seq 1 "${KVFLEET_L_ROUNDS:-3}"); do
      step "round $r: one stream (128-token prompt, 256 steps)"
      [ -x "$bin/model-old" ] && bench model-old 1 128 1 256 "one_fp8_old_$r"
      bench model 1 128 1 256 "one_fp8_new_$r"
      KVFLEET_GEMV_QKV=0 bench model 1 128 1 256 "one_fp8_noqkv_$r"
      KVFLEET_FUSED_MERGE=0 bench model 1 128 1 256 "one_fp8_nomerge_$r"
      KVFLEET_FP8_GEMV_ROW=0 bench model 1 128 1 256 "one_fp8_norow_$r"
      [ -x "$bin/model-old" ] && bench model-old 0 128 1 256 "one_bf16_old_$r"
      bench model 0 128 1 256 "one_bf16_new_$r"
    done
    step "one stream at a longer context (1,024-token prompt, 256 steps), old and new"
    [ -x "$bin/model-old" ] && bench model-old 1 1024 1 256 "long_fp8_old"
    bench model 1 1024 1 256 "long_fp8_new"
    step "256 streams decode (128-token prompts, 64 steps), old and new"
    [ -x "$bin/model-old" ] && bench model-old 1 128 256 64 "b256_fp8_old"
    bench model 1 128 256 64 "b256_fp8_new"
    ;;
  switches)
    # The fused merge and the row-a-warp GEMV, each on and off, at two contexts, rounds.
    for r in $(seq 1 "${KVFLEET_L_ROUNDS:-3}"); do
      for p in 128 1024; do
        step "round $r: one stream, $p-token prompt"
        bench model 1 $p 1 256 "sw_${p}_new_$r"
        KVFLEET_FUSED_MERGE=0 bench model 1 $p 1 256 "sw_${p}_nomerge_$r"
        KVFLEET_FP8_GEMV_ROW=0 bench model 1 $p 1 256 "sw_${p}_norow_$r"
      done
    done
    ;;
  ncu)
    for exe in model-old model; do
      [ -x "$bin/$exe" ] || continue
      step "ncu: $exe, one decode step's kernels"
      KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 KVFLEET_BENCH_PROMPT=128 \
        KVFLEET_BENCH_BATCHES=1 KVFLEET_BENCH_STEPS=40 python3 $dev/ncu_step.py --capture "$OUT/ncu_$exe.csv" \
        --skip 6000 --count 700 -- "$bin/$exe" | head -16
      xz -T4 "$OUT/ncu_$exe.csv"
    done
    ;;
  http)
    step "HTTP: the worker twice, FP8 and bf16 (dummy Llama-3.1-8B), 0.45 of the memory each"
    port=8000
    for w in fp8 bf16; do
      q=(); [ $w = fp8 ] && q=(--quantization fp8)
      "$bin/kvfleet" worker --listen 127.0.0.1:$port --model-weights dummy --model-config $dev/llama-3.1-8b.json \
        --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 \
        --gpu-memory-utilization 0.45 --max-waiting 4096 "${q[@]}" > "$OUT/worker_$w.log" 2>&1 &
      for _ in $(seq 1 150); do curl -sf 127.0.0.1:$port/readyz >/dev/null && break; sleep 1; done
      curl -sf 127.0.0.1:$port/readyz >/dev/null || { echo "$w not ready"; tail -5 "$OUT/worker_$w.log"; }
      timeout 60 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 32 \
        --requests 256 --vocab 128000 > "$OUT/http_warm_$w.log" 2>&1
      port=$((port + 1))
    done
    show() { tail -1 "$1" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"$2"'", {k: r[k] for k in ("errors","output_tok_per_s","ttft_p50_ms","itl_p50_ms")})'; }
    for r in $(seq 1 "${KVFLEET_L_ROUNDS:-3}"); do
      port=8000
      for w in fp8 bf16; do
        step "HTTP round $r: $w, 1 stream x 130/512, 2 requests"
        timeout 60 python3 $dev/http_load.py --port $port --concurrency 1 --prompt-tokens 130 --output-tokens 512 \
          --requests 2 --vocab 128000 > "$OUT/http1_${w}_$r.log" 2>&1
        show "$OUT/http1_${w}_$r.log" "$w one $r"
        step "HTTP round $r: $w, 256 streams x 130/512, 512 requests"
        timeout 120 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 512 \
          --requests 512 --vocab 128000 > "$OUT/http256_${w}_$r.log" 2>&1
        show "$OUT/http256_${w}_$r.log" "$w 256 $r"
        port=$((port + 1))
      done
    done
    kill %1 %2 2>/dev/null
    ;;
esac
step done
echo "== summary"
for f in "$OUT"/bench_*.log; do
  [ -e "$f" ] || continue
  echo "$(basename "$f" .log): $(grep -hoE "prefill of [0-9]+ tokens [0-9.]+ ms|linear layers [0-9]+ TFLOP/s|[0-9.]+ tok/s \(runs" "$f" | tr '\n' ' ')"
done
(cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf logs_$mode.tgz ./*.log && rm -f ./*.log)
