#!/usr/bin/env bash
# Sampling on the GPU (issue 19), on the device machine after `BASE=<earlier kvfleet>
# bench/device/pack.sh serve` here with the GPU test and bench binaries added
# (KVFLEET_PACK_GPU_BINS=1): the pick tests against the host, the pick kernel alone against
# the host's picks, the in-process decode with device draws against greedy, then the served
# model through HTTP with sampled requests for both builds (run.sh serve).
#   bash bench/device/sampling.sh            # everything
#   KVFLEET_SAMPLING_PARTS="tests pick" ...   # a subset: tests pick decode http
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dev=.device/serve
bin=/tmp/kvfleet-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
parts=${KVFLEET_SAMPLING_PARTS:-tests pick decode http}
for part in $parts; do
  case "$part" in
    tests)
      step "cuda_model: device picks against the host's, dummy geometries"
      timeout 300 "$bin/cuda_model" --ignored --nocapture --test-threads 1 picked draws dummy 2>&1 \
        | tee "$OUT/cuda_model_sampling.log" | grep -E "^test |equal to the host|result|panicked" | tail -20
      ;;
    pick)
      step "pick kernel alone against the host (rows 1 and 256 of a 128,256-token vocabulary)"
      KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_PICK=1 timeout 200 "$bin/model" 2>&1 | tee "$OUT/bench_pick.log" | tail -12
      ;;
    decode)
      for s in greedy temperature top-p; do
        step "in-process decode, dummy Llama-3-8B, $s"
        KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_BATCHES=${KVFLEET_SAMPLING_BATCHES:-1,256} \
          KVFLEET_BENCH_SAMPLING=$s timeout 200 "$bin/model" 2>&1 | tee "$OUT/bench_decode_$s.log" | tail -3
      done
      ;;
    http)
      step "HTTP, sampled requests (temperature 1, top-p 0.9), both builds"
      KVFLEET_DEVICE_HTTP_SAMPLING=${KVFLEET_DEVICE_HTTP_SAMPLING:---temperature 1 --top-p 0.9} \
        KVFLEET_DEVICE_HTTP_ROWS=${KVFLEET_DEVICE_HTTP_ROWS:-1:130:256:1 256:130:32:256} \
        KVFLEET_DEVICE_TAG=_sampled bash bench/device/run.sh serve
      ;;
  esac
done
step "done"
