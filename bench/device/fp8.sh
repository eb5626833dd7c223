#!/usr/bin/env bash
# FP8 weights on the GPU (issue 32), on the device machine after `bench/device/pack.sh fp8-a`
# (then `fp8-b`) here; two calls because SmolLM2's GGUF does not fit one carry.
#   bash bench/device/fp8.sh a   # stash the GGUF's first half and the binaries; ceilings (copy,
#                                # bf16 and FP8 GEMM); FP8 kernel tests; the Gemma 3 geometry test;
#                                # the planner against the pools; the model bench, dummy
#                                # Llama-3.1-8B, bf16 then FP8 (KVFLEET_FP8_NO_BENCH=1: no bench)
#   bash bench/device/fp8.sh b   # join the GGUF; SmolLM2 FP8 tests; the bf16 GPU model tests
# KVFLEET_FP8_BENCH="1,256 2048:1" picks the bench rows: BATCHES or PROMPT:BATCHES;
# KVFLEET_FP8_VARIANTS="bf16 fp8" the variants (fp8-unit: unit scales in cuBLASLt and the
# epilogue; the int, h2 and mma GEMVs lost and are gone); KVFLEET_FP8_PROFILE=1,256 adds profiles.
set -uo pipefail
part=${1:?usage: fp8.sh a|b}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1
dev=.device/fp8-$part
stash=/root/kvfleet-stash; mkdir -p "$stash"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$stash/$(basename "$f" .xz)" && chmod +x "$stash/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
case "$part" in
  a)
    cp $dev/gguf.part1 "$stash/"
    step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
    PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    step "FP8 kernels against the host"
    timeout 120 "$stash/cuda_lib" --ignored --nocapture fp8 2>&1 | tee "$OUT/cuda_lib_fp8.log" | grep -E "^test |result|panicked" | tail -8
    step "Gemma 3 geometry, FP8 against bf16"
    timeout 120 "$stash/cuda_fp8" --ignored --nocapture gemma3 2>&1 | tee "$OUT/cuda_fp8_gemma.log" | grep -E "^test |ratio|result|panicked" | tail -8
    step "planner against the worker's pools, dummy Llama-3.1-8B, bf16 and FP8 weights"
    timeout 300 "$stash/cuda_capacity" --ignored --nocapture llama 2>&1 | tee "$OUT/cuda_capacity.log" \
      | grep -E "^test |check .* tokens|result|panicked" | tail -8
    [ -n "${KVFLEET_FP8_NO_BENCH:-}" ] && { step done; exit 0; }
    for row in ${KVFLEET_FP8_BENCH:-1,256 2048:1}; do
      prompt=128; batches=$row
      case "$row" in *:*) prompt=${row%%:*}; batches=${row##*:} ;; esac
      # bf16, FP8 (cuBLASLt applies the row scales where it can) and FP8 with unit scales and
      # the epilogue kernel (the path of Ada and older cuBLAS), in the same call.
      for v in ${KVFLEET_FP8_VARIANTS:-bf16 fp8}; do
        fp8=1; unit=0; gemv=cvt
        case "$v" in bf16) fp8=0 ;; fp8-unit) unit=1 ;; esac
        step "model bench: dummy Llama-3.1-8B, $v, prompt $prompt, batches $batches"
        KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$fp8 KVFLEET_FP8_UNIT_SCALES=$unit KVFLEET_FP8_GEMV=$gemv \
          KVFLEET_BENCH_PROMPT=$prompt KVFLEET_BENCH_BATCHES=$batches KVFLEET_BENCH_STEPS=${KVFLEET_FP8_STEPS:-128} \
          timeout 240 "$stash/model" 2>&1 | tee "$OUT/bench_model_${v}_${prompt}.log" \
          | grep -E "ready in|prefill|tok/s|cuBLASLt|panicked|error" | tail -8
      done
    done
    if [ -n "${KVFLEET_FP8_PROFILE:-}" ]; then
      for v in bf16 fp8; do
        fp8=$([ $v = fp8 ] && echo 1 || echo 0)
        step "profile: dummy Llama-3.1-8B, $v, batches $KVFLEET_FP8_PROFILE"
        KVFLEET_PROFILE=1 KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$fp8 \
          KVFLEET_BENCH_BATCHES=$KVFLEET_FP8_PROFILE KVFLEET_BENCH_STEPS=64 timeout 240 "$stash/model" \
          > "$OUT/profile_$v.log" 2>&1
        sed 's/\x1b\[[0-9;]*m//g' "$OUT/profile_$v.log" | grep -A22 "profile" | tail -24
      done
    fi
    ;;
  b)
    gguf=$stash/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$stash/gguf.part1" $dev/gguf.part2 > "$gguf" || exit 3
    echo "$(cat $dev/gguf.sha256)  $gguf" | sha256sum -c - || exit 3
    export KVFLEET_SMOLLM2_GGUF=$gguf
    for gemv in cvt; do
      step "SmolLM2 FP8 tests, the $gemv GEMV"
      KVFLEET_FP8_GEMV=$gemv timeout 200 "$stash/cuda_fp8" --ignored --nocapture --test-threads 1 2>&1 \
        | tee "$OUT/cuda_fp8_$gemv.log" | grep -E "^test |ratio|top-1|weights:|result|panicked" | tail -30
    done
    step "the bf16 GPU model tests (unchanged)"
    timeout 300 "$stash/cuda_model" --ignored --test-threads 1 2>&1 | tee "$OUT/cuda_model.log" | grep -E "^test |result|panicked" | tail -40
    ;;
esac
step done
