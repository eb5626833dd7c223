#!/usr/bin/env bash
# The FP8 GEMMs' epilogue fused into their neighbours (issue 32, bench/RESULTS.md 2026-11-28):
# the build before (`*-old`) and after, alternating in one call, on the device machine.
# Here: build this tree's `kvfleet` and model bench (release), its GPU tests, and the worker of
# the tree before (`kvfleet-old`), then strip and xz them into .device/fp8-fused/bin/ as model,
# kvfleet, kvfleet-old, cuda_lib (and cuda_fp8), with bench/peers.py, bench/http_load.py and
# bench/device/llama-3.1-8b.json in .device/fp8-fused/. In process the unfused path is this
# build's `KVFLEET_FP8_FUSE=none` (the code before, kept as the fallback); through HTTP it is
# the old worker.
#   bash bench/device/fused.sh quick  # the GPU tests; one prefill of each variant; profiles
#   bash bench/device/fused.sh full   # ceilings; prefill and 256-stream decode in process,
#                                     # unfused and fused alternating; HTTP 256 streams x 130/512,
#                                     # old and new workers up at once (each idle while the other
#                                     # is timed), alternating
#   bash bench/device/fused.sh inproc # the GPU tests, then full's in-process part
#   bash bench/device/fused.sh http   # full's HTTP part
# KVFLEET_FUSED_ROUNDS (3), KVFLEET_FUSED_HTTP_ROUNDS (3).
set -uo pipefail
mode=${1:?usage: fused.sh quick|full|inproc|http}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/fp8-fused
bin=/root/fused-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

# bench BUILD FP8 FUSE PROMPT BATCHES STEPS TAG: the model bench, dummy Llama-3.1-8B.
bench() {
  local build=$1 fp8=$2 fuse=$3 prompt=$4 batches=$5 steps=$6 tag=$7
  KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$fp8 KVFLEET_FP8_FUSE=$fuse \
    KVFLEET_BENCH_PROMPT=$prompt KVFLEET_BENCH_BATCHES=$batches KVFLEET_BENCH_STEPS=$steps \
    timeout 200 "$bin/$build" > "$OUT/bench_$tag.log" 2>&1
  echo "$tag: $(grep -E "prefill of|tok/s \(runs|panicked|error" "$OUT/bench_$tag.log" | sed 's/^llama3-8b[^:]*: //' | tr '\n' ' ')"
}

case "$mode" in
  quick)
    step "FP8 kernel and fusion tests (cuda_lib fp8)"
    timeout 180 "$bin/cuda_lib" --ignored --nocapture --test-threads 1 fp8 2>&1 | tee "$OUT/cuda_lib_fp8.log" \
      | grep -E "^test |cuBLASLt|result|panicked" | tail -14
    step "Gemma 3 geometry, FP8 against bf16 (its GeGLU fused)"
    [ -x "$bin/cuda_fp8" ] && timeout 120 "$bin/cuda_fp8" --ignored --nocapture gemma3 2>&1 | tee "$OUT/cuda_fp8_gemma.log" \
      | grep -E "^test |ratio|result|panicked" | tail -6
    step "prefill 2,048 tokens: each fusion alone, all, none"
        for fuse in none all norm glu qkv; do bench model 1 "$fuse" 2048 1 8 "fp8_$fuse"; done
    step "profiles of the prefill (KVFLEET_PROFILE=1)"
    for fuse in none all; do
      KVFLEET_PROFILE=1 KVFLEET_FP8_FUSE=$fuse KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 \
        KVFLEET_BENCH_PROMPT=2048 KVFLEET_BENCH_BATCHES=1 KVFLEET_BENCH_STEPS=4 timeout 200 "$bin/model" > "$OUT/profile_$fuse.log" 2>&1
      echo "-- $fuse"; sed 's/\x1b\[[0-9;]*m//g' "$OUT/profile_$fuse.log" | grep -A18 "profile" | tail -19
    done
    ;;
  full|inproc)
    if [ "$mode" = inproc ]; then
      step "FP8 kernel and fusion tests (cuda_lib fp8)"
      timeout 180 "$bin/cuda_lib" --ignored --nocapture --test-threads 1 fp8 2>&1 | tee "$OUT/cuda_lib_fp8.log" \
        | grep -E "^test |cuBLASLt|result|panicked" | tail -14
    fi
    step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
    PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    for r in $(seq 1 "${KVFLEET_FUSED_ROUNDS:-3}"); do
      step "in process, round $r: prefill 2,048 tokens, FP8 unfused then fused, then bf16"
      bench model 1 none 2048 1 8 "fp8_none_$r"
      bench model 1 all 2048 1 8 "fp8_all_$r"
      bench model 0 all 2048 1 8 "bf16_$r"
      step "in process, round $r: 256 streams decode (128-token prompts), FP8 unfused then fused"
      bench model 1 none 128 256 64 "fp8_none_256_$r"
      bench model 1 all 128 256 64 "fp8_all_256_$r"
    done
    ;;
esac
case "$mode" in
  full|http)
    step "HTTP: both workers up (FP8, dummy Llama-3.1-8B), 0.45 of the memory each"
    port=8000
    for b in kvfleet-old kvfleet; do
      "$bin/$b" worker --listen 127.0.0.1:$port --model-weights dummy --model-config $dev/llama-3.1-8b.json \
        --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 \
        --gpu-memory-utilization 0.45 --max-waiting 4096 --quantization fp8 > "$OUT/worker_$b.log" 2>&1 &
      for _ in $(seq 1 150); do curl -sf 127.0.0.1:$port/readyz >/dev/null && break; sleep 1; done
      curl -sf 127.0.0.1:$port/readyz >/dev/null || { echo "$b not ready"; tail -5 "$OUT/worker_$b.log"; }
      curl -s 127.0.0.1:$port/v1/capacity | python3 -c 'import json,sys; c=json.load(sys.stdin); print("'$b'", {k: c.get(k) for k in ("kvTokens","totalBlocks")})'
      # Warm-up: every GEMM shape of the load plans once.
      timeout 60 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 32 \
        --requests 256 --vocab 128000 > "$OUT/http_warm_$b.log" 2>&1
      port=$((port + 1))
    done
    for r in $(seq 1 "${KVFLEET_FUSED_HTTP_ROUNDS:-3}"); do
      port=8000
      for b in kvfleet-old kvfleet; do
        step "HTTP round $r: $b, 256 streams x 130/512, 512 requests"
        timeout 120 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 512 \
          --requests 512 --vocab 128000 > "$OUT/http_${b}_$r.log" 2>&1
        tail -1 "$OUT/http_${b}_$r.log" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'$b' '$r'", {k: r[k] for k in ("errors","output_tok_per_s","ttft_p50_ms","itl_p50_ms")})'
        port=$((port + 1))
      done
    done
    ;;
esac
step done
echo "== summary"
for f in "$OUT"/bench_*.log; do
  echo "$(basename "$f" .log): $(grep -hoE "prefill of [0-9]+ tokens [0-9.]+ ms|linear layers [0-9]+ TFLOP/s|[0-9.]+ tok/s \(runs" "$f" | tr '\n' ' ')"
done
# At most 8 files come back: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
