#!/usr/bin/env bash
# Runs on the device machine (the `device` tool) after `bench/device/pack.sh harden` here
# (carry .device/harden): the release worker on the GPU under the overload of issue 35, the
# hostile OpenAI bodies of tests/fuzz_openai.rs sent to it, and its cold start (issue 31).
#   bash .device/harden/harden.sh            # everything (about 6 minutes)
#   KVFLEET_HARDEN_PARTS="cold" bash ...     # some of: overload fuzz cold tests
# Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/harden
bin=/tmp/kvfleet-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
parts=${KVFLEET_HARDEN_PARTS:-overload fuzz cold tests}
K="$bin/kvfleet"
wait_ready() { for _ in $(seq 1 300); do curl -sf "127.0.0.1:$1/readyz" >/dev/null && return 0; sleep 0.2; done; return 1; }

if [[ " $parts " == *" overload "* ]]; then
  # The CPU run's pool and bounds (bench/RESULTS.md, issue 22): 64 blocks of 16 tokens, 16
  # running, 32 waiting; dummy Llama-3.1-8B weights, bf16 KV.
  step "overload: 10x the pool for 60 s, dummy Llama-3.1-8B"
  "$K" worker --listen 127.0.0.1:8000 --model-weights dummy --model-config $dev/llama-3.1-8b.json \
    --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-kv-tokens 1024 --max-waiting 32 \
    --max-num-seqs 16 > "$OUT/overload.worker.log" 2>&1 &
  pid=$!
  wait_ready 8000 || { echo "worker not ready"; tail -20 "$OUT/overload.worker.log"; }
  timeout 200 python3 $dev/overload.py --port 8000 --pid $pid --duration 60 --vocab 128000 2>&1 | tee "$OUT/overload.log" | tail -25
  curl -s 127.0.0.1:8000/v1/capacity | tee "$OUT/overload.capacity.json" | head -c 600; echo
  kill -TERM $pid; wait $pid; echo "worker exit: $?"
fi

if [[ " $parts " == *" fuzz "* ]]; then
  # The property of tests/fuzz_openai.rs against the GPU worker: SmolLM2-135M's geometry with
  # dummy weights, a 64-token context so that valid requests stay short, served as "fuzz".
  step "hostile OpenAI bodies against the GPU worker"
  "$K" worker --listen 127.0.0.1:8001 --model-weights dummy --model-config $dev/smollm2-135m.json \
    --attention-backend KVFLEET_CUDA --served-model-name fuzz --max-model-len 64 --max-num-seqs 4 \
    > "$OUT/fuzz.worker.log" 2>&1 &
  pid=$!
  wait_ready 8001 || { echo "worker not ready"; tail -20 "$OUT/fuzz.worker.log"; }
  start=$(date +%s)
  KVFLEET_FUZZ_PORT=8001 KVFLEET_FUZZ_CASES=${KVFLEET_HARDEN_FUZZ_CASES:-20000} timeout 300 \
    "$bin/fuzz_openai" --test-threads=1 2>&1 | tee "$OUT/fuzz.log" | tail -8
  echo "fuzz wall: $(( $(date +%s) - start )) s"
  grep -c " 500 \| panicked" "$OUT/fuzz.worker.log" || true
  kill -0 $pid && echo "worker alive after the fuzz" || echo "WORKER DIED"
  curl -s 127.0.0.1:8001/metrics | grep -E "^kvfleet_requests_|^vllm:num_requests" | head -20
  kill -TERM $pid; wait $pid; echo "worker exit: $?"
fi

if [[ " $parts " == *" cold "* ]]; then
  # Process start -> /readyz and -> first streamed token of a request waiting for it.
  # Dummy weights are made on the device (no file read, no host-to-device copy); the disk read of a
  # checkpoint of 8B bf16 size (16 GiB) is timed apart below.
  for m in smollm2-135m llama-3.1-8b; do
    step "cold start: dummy $m"
    timeout 300 python3 $dev/cold_start.py --port 8002 --runs 3 --label "gpu dummy $m" -- \
      "$K" worker --listen 127.0.0.1:8002 --model-weights dummy --model-config $dev/$m.json \
      --attention-backend KVFLEET_CUDA --max-model-len 4096 2>&1 | tee -a "$OUT/cold.log"
  done
  step "disk: a 16 GiB file written, then read with the page cache dropped"
  dd if=/dev/zero of=/tmp/weights.bin bs=64M count=256 conv=fsync status=none
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped)"
  dd if=/tmp/weights.bin of=/dev/null bs=64M 2>&1 | tail -1 | tee -a "$OUT/cold.log"
  rm -f /tmp/weights.bin
fi

if [[ " $parts " == *" tests "* ]] && [ -x "$bin/cuda_model" ]; then
  step "GPU tests (no model file)"
  "$bin/cuda_model" --ignored --skip smollm2 --skip paris 2>&1 | tee "$OUT/cuda_model.log" | tail -6
  [ -x "$bin/cuda_worker" ] && "$bin/cuda_worker" --ignored 2>&1 | tee "$OUT/cuda_worker.log" | tail -6
fi
step "done"
