#!/usr/bin/env bash
# One stream, FP8 weights (issue 32): the one-token Q/K/V GEMV writing the token's K/V into the
# cache (`GpuOptions::single_token_append`, no append launch) against the append launch, in one
# call, and the worker through HTTP.
#   bash bench/device/append.sh pack  # here: bench/device/pack.sh append (the model bench, the GPU
#                                     # tests cuda_lib and cuda_model, the worker, into .device/append/)
#   bash bench/device/append.sh run   # on the device: the GPU tests, the ceilings, the model bench
#                                     # with the launch (KVFLEET_BENCH_APPEND=0) and without,
#                                     # rounds alternating, then the worker through HTTP, FP8 and bf16
#   bash bench/device/append.sh accept  # on the device: issue 32's acceptance set at the build's
#                                     # defaults: ceilings, a 2,048-token prefill (FP8, bf16), one
#                                     # stream in the model bench, ncu of one FP8 decode step, then
#                                     # three workers through HTTP (FP8, FP8 with the append launch
#                                     # (KVFLEET_SINGLE_TOKEN_APPEND=0), bf16): one stream in
#                                     # rounds, 256 streams (ACCEPT_QUICK=1: no grid caps, no ncu)
#   bash bench/device/append.sh scales  # on the device: the FP8 GEMMs' scale path per shape
#                                     # (KVFLEET_FP8_UNIT_SCALES unset: timed, 0: per-row, 1: unit):
#                                     # the FP8 GPU tests, the ceilings, the model bench at 256 rows
#                                     # and a 2,048-token prefill for each, then three workers
#                                     # through HTTP (FP8 timed, FP8 per-row, bf16): one stream in
#                                     # rounds and 256 streams, twice
#   bash bench/device/append.sh margin  # on the device: the build's default pick again (ceilings,
#                                     # prefill and 256 rows in the model bench, per-row beside it;
#                                     # one FP8 worker through HTTP: 256 streams and one stream)
#   bash bench/device/append.sh bucket  # on the device: the scale choice timed once a bucket of
#                                     # token counts: the FP8 GPU tests, ceilings, prefill and 256
#                                     # rows (FP8 default, per-row; bf16 prefill), then three workers
#                                     # through HTTP (FP8 warmed, FP8 cold with its timings logged,
#                                     # bf16): 256 streams and one stream, twice
#   bash bench/device/append.sh skinny  # on the device: steps of 2-8 tokens on kvf_gemm_fp8_skinny
#                                     # against cuBLASLt (KVFLEET_FP8_SKINNY=off): the FP8 GPU tests,
#                                     # the ceilings, the model bench at 2-16 rows (units of 16 and 32
#                                     # rows, KVFLEET_FP8_SKINNY_UNIT=32, too), rounds alternating,
#                                     # then two FP8 workers through HTTP at 2, 4, 8 streams, one
#                                     # stream and 256 streams
#   bash bench/device/append.sh profile  # on the device: ceilings, then two FP8 workers through HTTP,
#                                     # one with KVFLEET_PROFILE=1: 256 streams and one stream, twice;
#                                     # the profiled worker's tables printed
# $OUT gets the logs; the summary is printed last. The early-launch experiment this script
# replaced is at commit a3b4c22 (bench/device/early.sh there).
set -uo pipefail
mode=${1:?usage: append.sh pack|run|accept|scales|margin|bucket|profile|skinny}
dev=.device/append

if [ "$mode" = pack ]; then
  exec "$(dirname "$0")/pack.sh" append
fi

OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
bin=/root/append-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do b="$bin/$(basename "$f" .xz)"; xz -dc "$f" > "$b" && chmod +x "$b"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
# worker I MEM [VAR=VALUE ...] [-- ARGS ...]: the worker on dummy Llama-3.1-8B at port 8000 + I with
# MEM of the GPU's memory, the variables in its environment and ARGS added; logs in workers.log.
worker() {
  local i=$1 mem=$2 vars=(); shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  env "${vars[@]}" "$bin/kvfleet" worker --listen 127.0.0.1:$((8000 + i)) --model-weights dummy \
    --model-config $dev/llama-3.1-8b.json --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 \
    --max-num-batched-tokens 2048 --gpu-memory-utilization "$mem" --max-waiting 4096 "$@" >> "$OUT/workers.log" 2>&1 &
}
# warm and hl: the HTTP load.
source "$(dirname "$0")/http.sh"

# sb TAG PICK PROMPT BATCH STEPS: the model bench, FP8, KVFLEET_FP8_UNIT_SCALES=PICK (- unset), one
# process; its log kept in bench.log, its figures printed.
sb() {
  local pick=(); [ "$2" != - ] && pick=(KVFLEET_FP8_UNIT_SCALES=$2)
  env "${pick[@]}" KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 KVFLEET_BENCH_PROMPT=$3 \
    KVFLEET_BENCH_BATCHES=$4 KVFLEET_BENCH_STEPS=$5 timeout 120 "$bin/model" > "$OUT/b.log" 2>&1
  { echo "== bench $1"; cat "$OUT/b.log"; } >> "$OUT/bench.log"
  echo "$1: $(grep -E "prefill of|tok/s \(runs|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //' | tr '\n' ' ')"
}

# fp8_tests: the FP8 GEMM and GEMV tests of cuda_lib (every scale pick) and the FP8 model steps
# of cuda_model, into tests.log.
fp8_tests() {
  { timeout 150 "$bin/cuda_lib" --ignored --test-threads 1 --nocapture gpu_fp8
    timeout 150 "$bin/cuda_model" --ignored --test-threads 1 gpu_kv_written gpu_fused_gemv gpu_dummy; } > "$OUT/tests.log" 2>&1
}
# bf16_prefill: the model bench's 2,048-token prefill with bf16 weights, printed.
bf16_prefill() {
  KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=0 KVFLEET_BENCH_PROMPT=2048 \
    KVFLEET_BENCH_BATCHES=1 KVFLEET_BENCH_STEPS=8 timeout 120 "$bin/model" > "$OUT/b.log" 2>&1
  echo "prefill_bf16: $(grep -E "prefill of|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //' | tr '\n' ' ')"
}
# ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3 (bench/peers.py), into ceilings.json.
ceilings() {
  step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
  PEERS_CEILINGS_ONLY=1 timeout 60 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning | tail -4
}

if [ "$mode" = skinny ]; then
  step "GPU tests: the FP8 GEMMs (the skinny one too), GEMVs and fusions, the FP8 model steps"
  fp8_tests
  grep -E "^test |test result|panicked" "$OUT/tests.log" | tail -24
  ceilings
  # sk TAG SKINNY BATCHES [VAR=VALUE]: the model bench, FP8, 128-token prompts,
  # KVFLEET_FP8_SKINNY=SKINNY.
  sk() {
    env KVFLEET_FP8_SKINNY=$2 ${4:-} KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 \
      KVFLEET_BENCH_PROMPT=128 KVFLEET_BENCH_BATCHES=$3 KVFLEET_BENCH_STEPS=64 timeout 150 "$bin/model" > "$OUT/b.log" 2>&1
    { echo "== bench $1"; cat "$OUT/b.log"; } >> "$OUT/bench.log"
    echo "$1: $(grep -E "tok/s \(runs|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //' | tr '\n' ' ')"
  }
  step "model bench, FP8, 2-16 rows: skinny (default), skinny in units of 32 rows only, cuBLASLt (off), alternating"
  for r in 1 2; do
    sk "skinny_r$r" 8 1,2,4,8,16
    sk "skinny_unit32_r$r" 8 1,2,4,8,16 KVFLEET_FP8_SKINNY_UNIT=32
    sk "cublaslt_r$r" off 1,2,4,8,16
  done
  step "HTTP: two FP8 workers at 0.45 of the memory: skinny (default), cuBLASLt (KVFLEET_FP8_SKINNY=off)"
  names=(skinny cublaslt)
  worker 0 0.45 -- --quantization fp8
  worker 1 0.45 KVFLEET_FP8_SKINNY=off -- --quantization fp8
  warm 0 1
  for r in 1 2; do
    for c in 2 4 8; do
      for i in 0 1; do hl $i $c $((2 * c)) "$c streams, round $r"; done
    done
    for i in 0 1; do hl $i 1 2 "one stream, round $r"; done
  done
  for i in 0 1; do hl $i 256 512 "256 streams"; done
  kill %1 %2 2>/dev/null
  step done
  rm -f "$OUT/b.log" "$OUT/h.log"
  exit 0
fi

if [ "$mode" = margin ]; then
  ceilings
  step "model bench, FP8: prefill 2,048 (default, per-row, default), 256 rows (default)"
  sb prefill_default - 2048 1 8
  sb prefill_per_row 0 2048 1 8
  sb prefill_default_again - 2048 1 8
  sb rows256_default - 128 256 128
  step "HTTP: one FP8 worker at the default, 0.45 of the memory"
  names=(fp8)
  worker 0 0.45 -- --quantization fp8
  warm 0
  for r in 1 2; do
    hl 0 256 512 "256 streams, round $r"
    hl 0 1 2 "one stream, round $r"
  done
  kill %1 2>/dev/null
  step done
  rm -f "$OUT/b.log" "$OUT/h.log"
  exit 0
fi

if [ "$mode" = profile ]; then
  ceilings
  step "HTTP: two FP8 workers at 0.45 of the memory, one with KVFLEET_PROFILE=1 (its own log)"
  names=(fp8 fp8_profiled)
  worker 0 0.45 -- --quantization fp8
  env KVFLEET_PROFILE=1 "$bin/kvfleet" worker --listen 127.0.0.1:8001 --model-weights dummy \
    --model-config $dev/llama-3.1-8b.json --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 \
    --max-num-batched-tokens 2048 --gpu-memory-utilization 0.45 --max-waiting 4096 --quantization fp8 > "$OUT/profile.log" 2>&1 &
  warm 0 1
  for r in 1 2; do
    for i in 0 1; do hl $i 256 512 "256 streams, round $r"; done
    for i in 0 1; do hl $i 1 2 "one stream, round $r"; done
  done
  kill -INT %1 %2 2>/dev/null; sleep 8; kill %1 %2 2>/dev/null
  step "the profiled worker's tables (every 10 s and at shutdown)"
  sed 's/\x1b\[[0-9;]*m//g' "$OUT/profile.log" | grep -E "ms per step|^shape |^(decode|prefill) <=" | head -120
  step done
  rm -f "$OUT/b.log" "$OUT/h.log"
  exit 0
fi

if [ "$mode" = bucket ]; then
  step "GPU tests: the FP8 GEMM at a model width (the bucket's shared choice), the FP8 GEMMs and GEMVs"
  fp8_tests
  grep -E "^test |test result|panicked|per-row scales in" "$OUT/tests.log" | tail -24
  ceilings
  step "model bench, FP8: prefill 2,048 and 256 rows, default then per-row; bf16 prefill"
  sb prefill_default - 2048 1 8
  sb prefill_per_row 0 2048 1 8
  sb rows256_default - 128 256 128
  sb rows256_per_row 0 128 256 128
  bf16_prefill
  step "HTTP: three workers (FP8 warmed, FP8 cold, bf16), 0.3 of the memory each"
  names=(fp8 fp8_cold bf16)
  worker 0 0.3 -- --quantization fp8
  # The cold worker's plan log (kvfleet_cuda at debug) counts its timings.
  env RUST_LOG=info,kvfleet_cuda::gpu::lt=debug "$bin/kvfleet" worker --listen 127.0.0.1:8001 --model-weights dummy \
    --model-config $dev/llama-3.1-8b.json --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 \
    --max-num-batched-tokens 2048 --gpu-memory-utilization 0.3 --max-waiting 4096 --quantization fp8 > "$OUT/cold.log" 2>&1 &
  worker 2 0.3
  warm 0 2
  for _ in $(seq 1 150); do curl -sf 127.0.0.1:8001/readyz >/dev/null && break; sleep 1; done
  for r in 1 2; do
    step "HTTP round $r: 256 streams x 130/512, 512 requests; one stream, 2 requests"
    for i in 0 1 2; do hl $i 256 512 "256 streams, round $r"; done
    echo "fp8_cold after round $r: $(grep -c "FP8 GEMM scales timed" "$OUT/cold.log") timed, $(grep -c "FP8 GEMM planned" "$OUT/cold.log") planned"
    for i in 0 1 2; do hl $i 1 2 "one stream, round $r"; done
  done
  kill %1 %2 %3 2>/dev/null
  grep "FP8 GEMM scales timed" "$OUT/cold.log" | sed 's/.*FP8 GEMM scales timed//' | head -60
  xz -T4 "$OUT/cold.log"
  step done
  rm -f "$OUT/b.log" "$OUT/h.log"
  exit 0
fi

if [ "$mode" = scales ]; then
  step "GPU tests: the FP8 GEMM and GEMVs (every scale pick), the fusions, the FP8 model steps"
  fp8_tests
  grep -E "^test |test result|panicked|per-row scales in" "$OUT/tests.log" | tail -20
  ceilings
  step "model bench, FP8: 256 rows (128-token prompts, 128 steps) and a 2,048-token prefill; timed, per-row, unit"
  for p in - 0 1; do sb "rows256_pick$p" $p 128 256 128; done
  for p in - 0 1; do sb "prefill_pick$p" $p 2048 1 8; done
  bf16_prefill
  step "HTTP: three workers (FP8 timed, FP8 per-row, bf16), 0.3 of the memory each"
  names=(fp8 fp8_per_row bf16)
  worker 0 0.3 -- --quantization fp8
  worker 1 0.3 KVFLEET_FP8_UNIT_SCALES=0 -- --quantization fp8
  worker 2 0.3
  warm 0 1 2
  for r in 1 2; do
    step "HTTP round $r: 256 streams x 130/512, 512 requests; one stream, 2 requests"
    for i in 0 1 2; do hl $i 256 512 "256 streams, round $r"; done
    for i in 0 1 2; do hl $i 1 2 "one stream, round $r"; done
  done
  kill %1 %2 %3 2>/dev/null
  step "model bench again, 256 rows: timed, per-row"
  for p in - 0; do sb "rows256_pick${p}_again" $p 128 256 128; done
  step done
  rm -f "$OUT/b.log" "$OUT/h.log"
  exit 0
fi

if [ "$mode" = accept ]; then
  ceilings
  # mb TAG FP8 PROMPT BATCH STEPS: the model bench at the build's defaults, one process.
  mb() {
    KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$2 KVFLEET_BENCH_PROMPT=$3 \
      KVFLEET_BENCH_BATCHES=$4 KVFLEET_BENCH_STEPS=$5 timeout 120 "$bin/model" > "$OUT/b.log" 2>&1
    { echo "== bench $1"; cat "$OUT/b.log"; } >> "$OUT/bench.log"
    echo "$1: $(grep -E "prefill of|tok/s \(runs|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //' | tr '\n' ' ')"
  }
  step "prefill 2,048 tokens, FP8 then bf16; one stream (128-token prompt, 256 steps), FP8 then bf16"
  mb prefill_fp8 1 2048 1 8
  mb prefill_bf16 0 2048 1 8
  mb one_fp8 1 128 1 256
  mb one_bf16 0 128 1 256
  # ACCEPT_QUICK=1 leaves out the grid caps and the ncu capture (a re-run of the figures only).
  if [ -z "${ACCEPT_QUICK:-}" ]; then
    step "one stream FP8 at other GEMV grid caps (KVFLEET_GEMV_BLOCKS_PER_SM; 4 is the default)"
    for cap in 3 5 6; do KVFLEET_GEMV_BLOCKS_PER_SM=$cap mb "one_fp8_cap$cap" 1 128 1 256; done
    step "ncu: one FP8 decode step's kernels, each alone"
    KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 KVFLEET_BENCH_PROMPT=128 \
      KVFLEET_BENCH_BATCHES=1 KVFLEET_BENCH_STEPS=40 python3 $dev/ncu_step.py --capture "$OUT/ncu.csv" -- "$bin/model" | head -20
    xz -T4 "$OUT/ncu.csv"
  fi
  mb one_fp8_again 1 128 1 256
  step "HTTP: three workers (FP8, FP8 with the append launch, bf16), 0.3 of the memory each"
  names=(fp8 fp8_launch bf16)
  worker 0 0.3 KVFLEET_SINGLE_TOKEN_APPEND=1 -- --quantization fp8
  worker 1 0.3 KVFLEET_SINGLE_TOKEN_APPEND=0 -- --quantization fp8
  worker 2 0.3 KVFLEET_SINGLE_TOKEN_APPEND=1
  warm 0 1 2
  for r in 1 2 3; do
    for i in 0 1 2; do hl $i 1 2 "one stream, round $r"; done
  done
  step "HTTP: 256 streams x 130/512, 512 requests, twice each (FP8, bf16)"
  for r in 1 2; do
    for i in 0 2; do hl $i 256 512 "256 streams, round $r"; done
  done
  kill %1 %2 %3 2>/dev/null
  step done
  rm -f "$OUT/b.log" "$OUT/h.log"
  exit 0
fi

step "GPU tests: the GEMV's K/V against the append launch, the fused GEMVs, the FP8 kernels"
{
  timeout 120 "$bin/cuda_model" --ignored --test-threads 1 --nocapture gpu_kv_written gpu_fused_gemv gpu_dummy
  timeout 60 "$bin/cuda_lib" --ignored --test-threads 1 gpu_fp8
} > "$OUT/tests.log" 2>&1
grep -E "^test |test result|panicked|bit-equal" "$OUT/tests.log" | tail -30

step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
PEERS_CEILINGS_ONLY=1 timeout 60 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning | tail -4

# bench TAG FP8 PROMPT BATCH STEPS APPEND: one process.
bench() {
  KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$2 KVFLEET_BENCH_PROMPT=$3 \
    KVFLEET_BENCH_BATCHES=$4 KVFLEET_BENCH_STEPS=$5 KVFLEET_BENCH_APPEND=$6 timeout 120 "$bin/model" > "$OUT/b.log" 2>&1
  { echo "== bench $1"; cat "$OUT/b.log"; } >> "$OUT/bench.log"
  echo "$1: $(grep -E "tok/s \(runs|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //; s/; forward incl. the token copy/, step/')"
}
for r in 1 2; do
  step "round $r: one stream FP8, 128-token prompt, 256 steps: the append launch, then the GEMV's K/V"
  bench "fp8_launch_$r" 1 128 1 256 0
  bench "fp8_gemv_$r" 1 128 1 256 1
done
step "bf16, and FP8 at a 1,024-token prompt, launch against the GEMV's K/V"
bench bf16_launch 0 128 1 256 0
bench bf16_gemv 0 128 1 256 1
bench long_fp8_launch 1 1024 1 256 0
bench long_fp8_gemv 1 1024 1 256 1

step "HTTP: the worker twice (FP8, bf16), 0.45 of the memory each"
port=8000
for w in fp8 bf16; do
  q=(); [ "$w" = fp8 ] && q=(--quantization fp8)
  "$bin/kvfleet" worker --listen 127.0.0.1:$port --model-weights dummy --model-config $dev/llama-3.1-8b.json \
    --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 \
    --gpu-memory-utilization 0.45 --max-waiting 4096 "${q[@]}" >> "$OUT/workers.log" 2>&1 &
  port=$((port + 1))
done
names=(fp8 bf16)
warm 0 1
for r in 1 2; do
  for i in 0 1; do hl $i 1 2 "one stream, round $r"; done
done
step "HTTP: 256 streams x 130/512, 512 requests, once each"
for i in 0 1; do hl $i 256 512 "256 streams"; done
kill %1 %2 2>/dev/null
step done
rm -f "$OUT/b.log" "$OUT/h.log"
