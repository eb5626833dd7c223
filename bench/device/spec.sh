#!/usr/bin/env bash
# Speculative decoding on the GPU (issue 36), and guidellm against a GPU worker (issue 34), on
# the device machine after `bench/device/pack.sh spec-a` (then `spec-b`) here; two calls on the
# same warm machine because SmolLM2's GGUF does not fit one carry.
#   bash bench/device/spec.sh a   # stash the worker and the GGUF's first half; dummy Llama-3.1-8B
#                                 # served through HTTP with speculation off and on: 256 streams
#                                 # (it turns itself off) and 1 stream (random text: the cost of
#                                 # rejected proposals)
#   bash bench/device/spec.sh b   # join the GGUF; SmolLM2 on the copy workload at 1 stream,
#                                 # speculation off and on (bench/spec_copy.py); guidellm
#   bash bench/device/spec.sh c   # (carry .device/spec-a) where speculation stops paying: dummy
#                                 # Llama-3.1-8B at 1-128 streams, off and on with
#                                 # disable_by_batch_size out of the way
# Logs and JSON go to $OUT.
set -uo pipefail
part=${1:?usage: spec.sh a|b|c}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/spec-$part; [ "$part" = c ] && dev=.device/spec-a
stash=/root/kvfleet-stash; mkdir -p "$stash"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$stash/$(basename "$f" .xz)" && chmod +x "$stash/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
NGRAM=${KVFLEET_SPEC_CONFIG:-'{"method":"ngram","num_speculative_tokens":4}'}

# worker NAME ARGS...: starts the worker on :8000 and waits for it.
worker() {
  local name=$1; shift
  "$stash/kvfleet" worker --listen 127.0.0.1:8000 --attention-backend KVFLEET_CUDA "$@" > "$OUT/worker_$name.log" 2>&1 &
  wpid=$!
  for _ in $(seq 1 150); do curl -sf 127.0.0.1:8000/readyz >/dev/null && return 0; sleep 1; done
  echo "worker $name did not become ready"; tail -5 "$OUT/worker_$name.log"; return 1
}
stop() { kill "$wpid" 2>/dev/null; wait "$wpid" 2>/dev/null; }
spec_of() { curl -s 127.0.0.1:8000/v1/capacity | python3 -c 'import json,sys; print(json.load(sys.stdin)["live"].get("speculative"))'; }

case "$part" in
  a)
    cp $dev/gguf.part1 "$stash/"
    for mode in off on; do
      args=(); [ "$mode" = on ] && args=(--speculative-config "$NGRAM")
      step "dummy Llama-3.1-8B, speculation $mode"
      worker "8b_$mode" --model-weights dummy --model-config bench/device/llama-3.1-8b.json --max-num-seqs 256 \
        --max-num-batched-tokens 2048 --gpu-memory-utilization 0.92 --max-waiting 4096 "${args[@]}" || continue
      for rep in 1 2 3; do
        for row in ${KVFLEET_SPEC_ROWS:-256:130:512:256 1:130:512:1}; do
          IFS=: read -r c p o n <<< "$row"
          timeout 150 python3 bench/http_load.py --port 8000 --concurrency "$c" --prompt-tokens "$p" \
            --output-tokens "$o" --requests "$n" > "$OUT/load_8b_${mode}_${c}_$rep.log" 2>&1
          tail -1 "$OUT/load_8b_${mode}_${c}_$rep.log" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"$mode"' rep '"$rep"'", {k: r[k] for k in ("concurrency","errors","output_tok_per_s","ttft_p50_ms","itl_p50_ms")})'
        done
      done
      [ "$mode" = on ] && spec_of
      stop
    done
    ;;
  b)
    cat "$stash/gguf.part1" $dev/gguf.part2 > "$stash/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat $dev/gguf.sha256)  $stash/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
    gguf=$stash/SmolLM2-135M-Instruct.Q4_1.gguf
    for mode in off on; do
      args=(); [ "$mode" = on ] && args=(--speculative-config "$NGRAM")
      step "SmolLM2, copy workload, 1 stream, speculation $mode"
      worker "smollm2_$mode" --model "$gguf" "${args[@]}" || continue
      timeout 200 python3 bench/spec_copy.py --port 8000 --text docs/security.md --runs ${KVFLEET_SPEC_RUNS:-5} \
        --save "$OUT/copy_$mode.json" 2>&1 | tee "$OUT/copy_$mode.log"
      [ "$mode" = on ] && spec_of
      if [ "$mode" = off ]; then
        # The same greedy request while one other stream shares every step (a batch of 2): how
        # much the GPU's greedy text depends on the shape of the step without speculation.
        step "SmolLM2, copy workload beside one other stream, speculation off"
        python3 bench/http_load.py --port 8000 --concurrency 1 --prompt-tokens 64 --output-tokens 4000 \
          --requests 1 > "$OUT/copy_side_load.log" 2>&1 &
        side=$!
        sleep 1
        timeout 200 python3 bench/spec_copy.py --port 8000 --text docs/security.md --runs 2 \
          --save "$OUT/copy_off_batch2.json" 2>&1 | tee "$OUT/copy_off_batch2.log"
        kill $side 2>/dev/null; wait $side 2>/dev/null
      fi
      stop
    done
    if [ -z "${KVFLEET_SPEC_NO_GUIDELLM:-}" ]; then
      step "guidellm (issue 34) against the GPU worker"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/glsite $dev/whl/*.whl || exit 3
      export PYTHONPATH=/tmp/glsite
      python3 -c 'import importlib.metadata as m; print({p: m.version(p) for p in ("guidellm", "datasets", "pyarrow", "pandas", "transformers", "torch")})'
      KVFLEET_BIN="$stash/kvfleet" GGUF="$gguf" PROMETHEUS= IP_PY= GL_PY=python3 TOK_PY=python3 \
        WORKER_ARGS="--attention-backend KVFLEET_CUDA --max-num-seqs 256 --max-num-batched-tokens 2048" \
        GL_RATE=${KVFLEET_GL_RATE:-16} GL_SECONDS=${KVFLEET_GL_SECONDS:-30} GL_PROMPT=256 GL_OUTPUT=128 OUT=/tmp/clients \
        timeout 300 bash bench/clients/run.sh 2>&1 | tee "$OUT/guidellm_run.log" | grep -v "^20..-..-.. " | tail -40
      cp /tmp/clients/summary.txt "$OUT/guidellm_summary.txt" 2>/dev/null
      cp /tmp/clients/guidellm/benchmarks.json "$OUT/guidellm_benchmarks.json" 2>/dev/null
      cp /tmp/clients/guidellm.log "$OUT/guidellm.log" 2>/dev/null
    fi
    ;;
  c)
    # Random weights loop on one token, so n-gram proposals are accepted at ~100%: the sweep
    # shows, for each batch size, whether even perfect proposals still pay for their rows.
    for mode in off on; do
      args=(); [ "$mode" = on ] && args=(--speculative-config '{"method":"ngram","num_speculative_tokens":4,"disable_by_batch_size":100000}')
      step "dummy Llama-3.1-8B sweep, speculation $mode"
      worker "8b_sweep_$mode" --model-weights dummy --model-config bench/device/llama-3.1-8b.json --max-num-seqs 256 \
        --max-num-batched-tokens 2048 --gpu-memory-utilization 0.92 --max-waiting 4096 "${args[@]}" || continue
      for c in ${KVFLEET_SPEC_SWEEP:-1 8 16 32 64 128}; do
        for rep in 1 2; do
          # KVFLEET_SPEC_TEMP=1: sampled at temperature 1 over random logits, where proposals
          # are almost never accepted: the cost of rejected rows, with the back-off.
          timeout 120 python3 bench/http_load.py --port 8000 --concurrency "$c" --prompt-tokens 130 \
            --output-tokens 256 --requests "$c" ${KVFLEET_SPEC_TEMP:+--temperature $KVFLEET_SPEC_TEMP} \
            > "$OUT/sweep_${mode}_${c}_$rep.log" 2>&1
        done
        tail -1 "$OUT/sweep_${mode}_${c}_2.log" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"$mode"'", {k: r[k] for k in ("concurrency","errors","output_tok_per_s","itl_p50_ms")})'
      done
      [ "$mode" = on ] && spec_of
      stop
    done
    ;;
esac
step done
