#!/usr/bin/env bash
# The 256-row FP8 step's row kernels (issue 32): `kvf_add_rms_norm_fp8` with its loads issued
# before its stores, `kvf_silu_quantize_fp8` with its loads batched, against the build before,
# in one call.
#   bash bench/device/append.sh pack; cp -r .device/append .device/append-old  # here, before
#   bash bench/device/append.sh pack                                           # here, after
#   bash bench/device/rows.sh                  # on the device (carry .device/append and
#                                              # .device/append-old)
# Runs the FP8 GPU tests of the new build, ncu of one 256-row decode step of each build (each
# kernel alone), the model bench at 256 rows and a 2,048-token prefill (once each), then both
# workers through HTTP: 256 streams and one stream, twice. $OUT gets the logs.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/append
for b in new old; do
  src=$dev; [ $b = old ] && src=.device/append-old
  mkdir -p /root/$b
  for f in $src/bin/*.xz; do xz -dc "$f" > "/root/$b/$(basename "$f" .xz)" && chmod +x "/root/$b/$(basename "$f" .xz)"; done
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
bench_env() { env KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=1 "$@"; }

step "GPU tests of the new build: FP8 GEMMs, GEMVs and fusions (bit-equality), the FP8 model steps"
{ timeout 150 /root/new/cuda_lib --ignored --test-threads 1 gpu_fp8
  timeout 150 /root/new/cuda_model --ignored --test-threads 1 gpu_dummy; } > "$OUT/tests.log" 2>&1
grep -E "^test |test result|panicked" "$OUT/tests.log" | tail -16

for b in old new; do
  step "ncu, $b: one 256-row decode step's kernels, each alone"
  bench_env KVFLEET_BENCH_PROMPT=8 KVFLEET_BENCH_BATCHES=256 KVFLEET_BENCH_STEPS=12 timeout 200 \
    python3 $dev/ncu_step.py --capture "$OUT/ncu_$b.csv" --skip 1500 --count 800 -- /root/$b/model | head -16
  xz -T4 "$OUT/ncu_$b.csv"
done

step "model bench: 256 rows (128-token prompts, 128 steps) and a 2,048-token prefill, each build"
for r in 1; do
  for b in old new; do
    bench_env KVFLEET_BENCH_PROMPT=128 KVFLEET_BENCH_BATCHES=256 KVFLEET_BENCH_STEPS=128 timeout 150 /root/$b/model > "$OUT/b.log" 2>&1
    echo "$b rows256 round $r: $(grep -E "tok/s \(runs|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //' | tr '\n' ' ')"
    bench_env KVFLEET_BENCH_PROMPT=2048 KVFLEET_BENCH_BATCHES=1 KVFLEET_BENCH_STEPS=8 timeout 120 /root/$b/model > "$OUT/b.log" 2>&1
    echo "$b prefill round $r: $(grep -E "prefill of|panicked|error" "$OUT/b.log" | sed 's/^Llama-3-8B-dummy //' | tr '\n' ' ')"
  done
done

step "HTTP: the two builds' workers, FP8, 0.45 of the memory each"
i=0
for b in old new; do
  /root/$b/kvfleet worker --listen 127.0.0.1:$((8000 + i)) --model-weights dummy --model-config $dev/llama-3.1-8b.json \
    --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 \
    --gpu-memory-utilization 0.45 --max-waiting 4096 --quantization fp8 >> "$OUT/workers.log" 2>&1 &
  i=$((i + 1))
done
names=(old new)
source "$(dirname "$0")/http.sh"
warm 0 1
for r in 1 2; do
  for i in 0 1; do hl $i 256 512 "256 streams, round $r"; done
  for i in 0 1; do hl $i 1 2 "one stream, round $r"; done
done
kill %1 %2 2>/dev/null
step done
rm -f "$OUT/b.log" "$OUT/h.log"
