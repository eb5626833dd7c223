#!/usr/bin/env bash
# EAGLE-3 drafters on the GPU (issue 36) and the FP8 one-token GEMVs (issue 32), on the device
# machine after `bench/device/pack.sh draft-a` (`draft-b`, `draft-c`) here; three calls on the
# same warm machine because SmolLM2's GGUF does not fit one carry beside the rest.
#   bash bench/device/drafter.sh a   # stash the binaries; ceilings;
#                                    # the FP8 kernel tests (every GEMV variant); the model bench,
#                                    # dummy Llama-3.1-8B, bf16 / FP8 cvt / FP8 h2, 1 stream and a
#                                    # 2,048-token prefill; the HTTP rows of the same three
#   bash bench/device/drafter.sh b   # stash the GGUF's first half (and binaries packed with it)
#   bash bench/device/drafter.sh c   # join the GGUF; the GPU drafter against the CPU's; the GPU
#                                    # model tests; SmolLM2 served with EAGLE-3 on the GPU
# Logs and JSON go to $OUT.
set -uo pipefail
part=${1:?usage: drafter.sh a|b|c}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/draft-$part
stash=/root/kvfleet-stash; mkdir -p "$stash"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$stash/$(basename "$f" .xz)" && chmod +x "$stash/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

# worker NAME ARGS...: starts the worker on :8000 and waits for it.
worker() {
  local name=$1; shift
  "$stash/kvfleet" worker --listen 127.0.0.1:8000 --attention-backend KVFLEET_CUDA "$@" > "$OUT/worker_$name.log" 2>&1 &
  wpid=$!
  for _ in $(seq 1 150); do curl -sf 127.0.0.1:8000/readyz >/dev/null && return 0; sleep 1; done
  echo "worker $name did not become ready"; tail -5 "$OUT/worker_$name.log"; return 1
}
stop() { kill "$wpid" 2>/dev/null; wait "$wpid" 2>/dev/null; }

case "$part" in
  a)
    cp $dev/*.py $dev/*.json "$stash/"
    step "ceilings: copy bandwidth, bf16 and FP8 GEMM 8192^3"
    PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    step "FP8 kernels against the host (every GEMV variant)"
    timeout 120 "$stash/cuda_lib" --ignored --nocapture fp8 2>&1 | tee "$OUT/cuda_lib_fp8.log" | grep -E "^test |result|panicked" | tail -8
    for row in ${KVFLEET_DRAFT_BENCH:-1 2048:1}; do
      prompt=128; batches=$row
      case "$row" in *:*) prompt=${row%%:*}; batches=${row##*:} ;; esac
      for rep in 1 2; do
        for v in ${KVFLEET_DRAFT_VARIANTS:-bf16 cvt}; do
          fp8=1; [ "$v" = bf16 ] && fp8=0
          step "model bench: dummy Llama-3.1-8B, $v, prompt $prompt, batches $batches, round $rep"
          KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b KVFLEET_BENCH_FP8=$fp8 KVFLEET_FP8_GEMV=$v \
            KVFLEET_BENCH_PROMPT=$prompt KVFLEET_BENCH_BATCHES=$batches KVFLEET_BENCH_STEPS=128 \
            timeout 200 "$stash/model" 2>&1 | tee "$OUT/bench_model_${v}_${prompt}_$rep.log" \
            | grep -E "prefill|tok/s|panicked|error" | tail -4
        done
      done
    done
    if [ -z "${KVFLEET_DRAFT_NO_HTTP:-}" ]; then
      for v in ${KVFLEET_DRAFT_HTTP:-bf16 cvt h2}; do
        q=(); [ "$v" = bf16 ] || q=(--quantization fp8)
        step "HTTP: dummy Llama-3.1-8B, $v, 1 stream x 130/512"
        KVFLEET_FP8_GEMV=$v worker "8b_$v" --model-weights dummy --model-config "$stash/llama-3.1-8b.json" --max-num-seqs 256 \
          --max-num-batched-tokens 2048 --gpu-memory-utilization 0.92 "${q[@]}" || continue
        for rep in 1 2 3; do
          timeout 60 python3 "$stash/http_load.py" --port 8000 --concurrency 1 --prompt-tokens 130 --output-tokens 512 \
            --requests 2 > "$OUT/http_${v}_$rep.log" 2>&1
          tail -1 "$OUT/http_${v}_$rep.log" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"$v"' rep '"$rep"'", {k: r[k] for k in ("errors","output_tok_per_s","itl_p50_ms")})'
        done
        stop
      done
    fi
    ;;
  b)
    cp $dev/gguf.part1 "$stash/"
    ;;
  c)
    cat "$stash/gguf.part1" $dev/gguf.part2 > "$stash/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat $dev/gguf.sha256)  $stash/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
    export KVFLEET_SMOLLM2_GGUF=$stash/SmolLM2-135M-Instruct.Q4_1.gguf
    step "the GPU drafters against the CPU's"
    timeout 240 "$stash/cuda_drafter" --ignored --nocapture --test-threads 1 2>&1 | tee "$OUT/cuda_drafter.log" \
      | grep -E "^test |prompt|drafted|result|panicked" | tail -24
    if [ -z "${KVFLEET_DRAFT_NO_MODEL_TESTS:-}" ]; then
      step "the GPU model tests"
      timeout 240 "$stash/cuda_model" --ignored --test-threads 1 2>&1 | tee "$OUT/cuda_model.log" | grep -E "^test |result|panicked" | tail -16
    fi
    # Random drafters of SmolLM2's geometry (its heads, so the GPU kernels take them), made here.
    for kind in eagle3 dflash; do
      [ -d "$stash/$kind" ] || python3 tests/fixtures/eagle3/generate.py --kind $kind --out "$stash/$kind" \
        --hidden 576 --vocab 49152 --target-layers 30 --heads 9 --kv-heads 3 --head-dim 64 --ff 1536 \
        --draft-tokens 198,28,30,260,281,282,284,288
    done
    [ -z "${KVFLEET_DRAFT_NO_HF:-}" ] && {
    step "transformers bf16 on the GPU: the log-probability fixture's prompts (issue 34)"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hfsite $dev/whl/*.whl
    PYTHONPATH=/tmp/hfsite HF_DTYPE=bfloat16 HF_DEVICE=cuda timeout 200 python3 bench/reference/smollm2_logprobs_hf.py \
      "$KVFLEET_SMOLLM2_GGUF" tests/fixtures/smollm2_logprobs_reference.json "$OUT/logprobs_hf_bf16.json" 2>&1 \
      | grep -v Warning | tail -6
    }
    for mode in ${KVFLEET_DRAFT_METHODS:-off eagle3}; do
      args=(); [ "$mode" = off ] || args=(--speculative-config '{"method":"'$mode'","num_speculative_tokens":3,"model":"'$stash/$mode'"}')
      step "SmolLM2 on the GPU, copy workload, 1 stream, speculation $mode"
      worker "smollm2_$mode" --model "$KVFLEET_SMOLLM2_GGUF" "${args[@]}" || continue
      curl -s 127.0.0.1:8000/v1/capacity > "$OUT/capacity_$mode.json"
      if [ "$mode" = off ] && [ -z "${KVFLEET_DRAFT_NO_HF:-}" ]; then
        for ref in tests/fixtures/smollm2_logprobs_reference.json "$OUT/logprobs_hf_bf16.json"; do
          step "the GPU worker's log-probabilities against $(basename "$ref")"
          timeout 60 python3 bench/reference/logprobs_vs_fixture.py --port 8000 --fixture "$ref" 2>&1 | tail -6
        done
      fi
      python3 -c 'import json; c=json.load(open("'"$OUT/capacity_$mode.json"'")); print({k: c.get(k) for k in ("kvTokens","totalBlocks")}, c.get("gpuMemory"))'
      timeout 200 python3 bench/spec_copy.py --port 8000 --text docs/security.md --runs 3 \
        --save "$OUT/copy_$mode.json" 2>&1 | tee "$OUT/copy_$mode.log" | tail -6
      curl -s 127.0.0.1:8000/v1/capacity | python3 -c 'import json,sys; print(json.load(sys.stdin)["live"].get("speculative"))'
      stop
    done
    ;;
esac
step done
