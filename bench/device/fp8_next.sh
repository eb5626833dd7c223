#!/usr/bin/env bash
# FP8 weights, the next step (issue 32, bench/RESULTS.md 2026-11-28, second section): the O and
# down GEMMs' residual add folded into the next RMSNorm (KVFLEET_FP8_FUSE `add`), and the
# one-token GEMV with its first weight chunks fetched before it waits for the previous kernel
# (KVFLEET_FP8_GEMV `pre`, `pre4`), each against the code before in the same call.
# Here: release builds of the model bench (`cargo bench --bench model --no-run`), the
# kvfleet-cuda unit tests (`cargo test --release -p kvfleet-cuda --lib --no-run`) and the worker,
# stripped and xz-compressed into .device/fp8-next/bin/ as model, cuda_lib and kvfleet, with
# bench/peers.py, bench/http_load.py and bench/device/llama-3.1-8b.json in .device/fp8-next/.
# Through HTTP the code before is the same worker with the switches of the code before
# (KVFLEET_FP8_FUSE=norm,glu,qkv, KVFLEET_FP8_GEMV=cvt), up beside the new settings.
#   bash bench/device/fp8_next.sh inproc  # GPU tests; ceilings; prefill 2,048 tokens with and
#                                         # without `add`; one stream with each GEMV; rounds
#   bash bench/device/fp8_next.sh http    # the workers through HTTP: one stream and 256 streams
#   bash bench/device/fp8_next.sh verify  # the GPU tests and one prefill with and without `add`
#                                         # (the binaries in KVFLEET_NEXT_DIR, .device/fp8-next)
#   bash bench/device/fp8_next.sh bps     # one stream, FP8 and bf16, with the GEMV grid capped at
#                                         # 4 (the default), 8 and 16 blocks an SM and uncapped (0)
# KVFLEET_NEXT_ROUNDS (3), KVFLEET_NEXT_GEMVS ("cvt pre pre4"), KVFLEET_NEXT_NEW_GEMV (the new
# worker's GEMV, cvt).
set -uo pipefail
mode=${1:?usage: fp8_next.sh inproc|http|verify|bps}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=${KVFLEET_NEXT_DIR:-.device/fp8-next}
bin=/root/next-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

# bench FP8 FUSE GEMV PROMPT BATCHES STEPS TAG: the model bench, dummy Llama-3.1-8B.
bench() {
  local fp8=$1 fuse=$2 gemv=$3 prompt=$4 batches=$5 steps=$6 tag=$7
  KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$fp8 KVFLEET_FP8_FUSE=$fuse \
    KVFLEET_FP8_GEMV=$gemv KVFLEET_BENCH_PROMPT=$prompt KVFLEET_BENCH_BATCHES=$batches KVFLEET_BENCH_STEPS=$steps \
    timeout 200 "$bin/model" > "$OUT/bench_$tag.log" 2>&1
  echo "$tag: $(grep -E "prefill of|tok/s \(runs|panicked|error" "$OUT/bench_$tag.log" | sed 's/^llama3-8b[^:]*: //' | tr '\n' ' ')"
}

case "$mode" in
  inproc)
    step "FP8 kernel tests (cuda_lib fp8)"
    timeout 240 "$bin/cuda_lib" --ignored --nocapture --test-threads 1 fp8 2>&1 | tee "$OUT/cuda_lib_fp8.log" \
      | grep -E "^test |cuBLASLt|result|panicked" | tail -16
    step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
    PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    for r in $(seq 1 "${KVFLEET_NEXT_ROUNDS:-3}"); do
      step "round $r: prefill 2,048 tokens, FP8 without then with add"
      bench 1 norm,glu,qkv cvt 2048 1 8 "prefill_noadd_$r"
      bench 1 all cvt 2048 1 8 "prefill_all_$r"
      step "round $r: one stream (128-token prompt, 128 steps), each GEMV"
      for g in ${KVFLEET_NEXT_GEMVS:-cvt pre pre4}; do bench 1 all "$g" 128 1 128 "one_${g}_$r"; done
    done
    step "bf16, once: prefill and one stream"
    bench 0 all cvt 2048 1 8 "prefill_bf16"
    bench 0 all cvt 128 1 128 "one_bf16"
    step "256 streams decode (128-token prompts, 64 steps), without then with add"
    bench 1 norm,glu,qkv cvt 128 256 64 "b256_noadd"
    bench 1 all cvt 128 256 64 "b256_all"
    step "profile of the prefill with add (KVFLEET_PROFILE=1)"
    KVFLEET_PROFILE=1 KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 \
      KVFLEET_BENCH_PROMPT=2048 KVFLEET_BENCH_BATCHES=1 KVFLEET_BENCH_STEPS=4 timeout 200 "$bin/model" > "$OUT/profile_all.log" 2>&1
    sed 's/\x1b\[[0-9;]*m//g' "$OUT/profile_all.log" | grep -A18 "profile" | tail -19
    ;;
  verify)
    step "FP8 kernel tests (cuda_lib fp8)"
    timeout 240 "$bin/cuda_lib" --ignored --nocapture --test-threads 1 fp8 2>&1 | tee "$OUT/cuda_lib_fp8.log" \
      | grep -E "^test |result|panicked" | tail -16
    for r in $(seq 1 "${KVFLEET_NEXT_ROUNDS:-1}"); do
      step "round $r: prefill 2,048 tokens, FP8 without then with add"
      bench 1 norm,glu,qkv cvt 2048 1 8 "prefill_noadd_$r"
      bench 1 all cvt 2048 1 8 "prefill_all_$r"
    done
    ;;
  bps)
    PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    for r in $(seq 1 "${KVFLEET_NEXT_ROUNDS:-3}"); do
      for b in 4 8 16 0; do
        step "round $r: one stream, KVFLEET_GEMV_BLOCKS_PER_SM=$b"
        export KVFLEET_GEMV_BLOCKS_PER_SM=$b
        bench 1 all cvt 128 1 128 "bps_fp8_${b}_$r"
        bench 0 all cvt 128 1 128 "bps_bf16_${b}_$r"
      done
    done
    unset KVFLEET_GEMV_BLOCKS_PER_SM
    ;;
  http)
    step "HTTP: both workers up (FP8, dummy Llama-3.1-8B), 0.45 of the memory each"
    port=8000
    for b in before after; do
      if [ $b = before ]; then fuse=norm,glu,qkv gemv=cvt; else fuse=all gemv=${KVFLEET_NEXT_NEW_GEMV:-cvt}; fi
      KVFLEET_FP8_FUSE=$fuse KVFLEET_FP8_GEMV=$gemv "$bin/kvfleet" worker --listen 127.0.0.1:$port --model-weights dummy \
        --model-config $dev/llama-3.1-8b.json --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 \
        --max-num-batched-tokens 2048 --gpu-memory-utilization 0.45 --max-waiting 4096 --quantization fp8 \
        > "$OUT/worker_$b.log" 2>&1 &
      for _ in $(seq 1 150); do curl -sf 127.0.0.1:$port/readyz >/dev/null && break; sleep 1; done
      curl -sf 127.0.0.1:$port/readyz >/dev/null || { echo "$b not ready"; tail -5 "$OUT/worker_$b.log"; }
      timeout 60 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 32 \
        --requests 256 --vocab 128000 > "$OUT/http_warm_$b.log" 2>&1
      port=$((port + 1))
    done
    show() { tail -1 "$1" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"$2"'", {k: r[k] for k in ("errors","output_tok_per_s","ttft_p50_ms","itl_p50_ms")})'; }
    for r in $(seq 1 "${KVFLEET_NEXT_ROUNDS:-3}"); do
      port=8000
      for b in before after; do
        step "HTTP round $r: $b, 1 stream x 130/512, 2 requests"
        timeout 60 python3 $dev/http_load.py --port $port --concurrency 1 --prompt-tokens 130 --output-tokens 512 \
          --requests 2 --vocab 128000 > "$OUT/http1_${b}_$r.log" 2>&1
        show "$OUT/http1_${b}_$r.log" "$b one $r"
        step "HTTP round $r: $b, 256 streams x 130/512, 512 requests"
        timeout 120 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 512 \
          --requests 512 --vocab 128000 > "$OUT/http256_${b}_$r.log" 2>&1
        show "$OUT/http256_${b}_$r.log" "$b 256 $r"
        port=$((port + 1))
      done
    done
    ;;
esac
step done
echo "== summary"
for f in "$OUT"/bench_*.log; do
  [ -e "$f" ] || continue
  echo "$(basename "$f" .log): $(grep -hoE "prefill of [0-9]+ tokens [0-9.]+ ms|linear layers [0-9]+ TFLOP/s|[0-9.]+ tok/s \(runs" "$f" | tr '\n' ' ')"
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
