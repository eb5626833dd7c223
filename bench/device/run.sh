#!/usr/bin/env bash
# Runs on the device machine (the `device` tool), in the repository root, after pack.sh here
# (carry .device/MODE).
# Every log and JSON goes to $OUT; a short table is printed last.
#   bash bench/device/run.sh attention   # peers (copy, GEMM, SDPA, FlashInfer) + attention bench + GPU tests
#   bash bench/device/run.sh model-a     # stash the GGUF's first half; dummy-geometry model tests
#   bash bench/device/run.sh model-b     # join the GGUF; SmolLM2 GPU tests; model benchmark
set -uo pipefail
mode=${1:?usage: run.sh attention|serve|model-a|model-b}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1
dev=.device/$mode
bin=/tmp/kvfleet-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
stash=/root/kvfleet-stash; mkdir -p "$stash"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

case "$mode" in
  attention)
    step "FlashInfer install"
    site=/tmp/site; mkdir -p "$site"
    (cd "$site" && python3 -m zipfile -e "$OLDPWD"/$dev/whl/fi-trim.zip . && \
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$OLDPWD"/$dev/whl/apache_tvm_ffi-*.whl) \
      || echo "FlashInfer install failed"
    step "peers"
    PYTHONPATH=$site timeout 300 python3 $dev/peers.py "$OUT/anchors.json" 2>&1 | tee "$OUT/peers.log" | grep -v Warning
    step "attention bench"
    timeout 240 "$bin/attention" --anchors "$OUT/anchors.json" --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log" | tail -14
    # Variant builds carried to compare in the same run: "$dev/variants.txt" lines "TAG ARGS..."
    # run "$bin/attention_TAG ARGS" (e.g. "--only decode_nvfp4").
    if [ -f "$dev/variants.txt" ]; then
      while read -r tag args; do
        [ -x "$bin/attention_$tag" ] || continue
        step "attention bench, variant $tag $args"
        echo "### variant $tag $args" >> "$OUT/variants.log"
        timeout 240 "$bin/attention_$tag" --anchors "$OUT/anchors.json" $args 2>&1 \
          | tee -a "$OUT/variants.log" | sed -n '/^== kvfleet/,$p' | tail -n +3
      done < "$dev/variants.txt"
    fi
    if [ -x "$bin/kvfleet" ] && [ -n "${KVFLEET_DEVICE_WORKER_MODEL:-}" ]; then
      step "worker with a dummy-weight model on the GPU"
      "$bin/kvfleet" worker --listen 127.0.0.1:8000 --model-weights dummy --model-config "$KVFLEET_DEVICE_WORKER_MODEL" \
        --attention-backend KVFLEET_CUDA > "$OUT/worker.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 90); do curl -sf 127.0.0.1:8000/readyz >/dev/null && break; sleep 1; done
      curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
        -d '{"model":"dummy","prompt":"Hello","max_tokens":8,"temperature":0}'; echo
      curl -s 127.0.0.1:8000/v1/capacity | head -c 600; echo
      curl -s 127.0.0.1:8000/metrics | grep -E '^kvfleet_(kv_cache_capacity_tokens|gpu_info)' | head -5
      kill $pid 2>/dev/null; wait $pid 2>/dev/null
      grep -E "ERROR|WARN|engine runs on the CPU|model loaded|ready" "$OUT/worker.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -8
    fi
    if [ -x "$bin/model" ]; then
      step "model bench: dummy Llama-3-8B (the worker's attention path end to end)"
      KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b timeout 120 "$bin/model" 2>&1 \
        | tee "$OUT/bench_model_8b.log" | sed -n '/^model /,$p'
    fi
    step "cuda_attention tests"
    timeout 240 "$bin/cuda_attention" --ignored --test-threads 1 2>&1 | tee "$OUT/cuda_attention.log" | tail -15
    step "cuda_worker test"
    timeout 120 "$bin/cuda_worker" --ignored --nocapture 2>&1 | tee "$OUT/cuda_worker.log" | tail -25
    ;;
  serve)
    # The served model through HTTP (issue 19): ceilings of this call, then each worker build
    # carried (kvfleet-base first, when present) with dummy Llama-3.1-8B weights, the same load
    # rows, and the profile tables (KVFLEET_PROFILE=1) the worker logs.
    # KVFLEET_DEVICE_BUILDS picks the builds, KVFLEET_DEVICE_HTTP_SAMPLING adds http_load.py
    # sampling flags (e.g. "--temperature 1 --top-p 0.9"), KVFLEET_DEVICE_PROFILE=1 turns the profile on
    # (it costs launch time: time the figures without it), KVFLEET_DEVICE_TAG names the logs.
    if [ ! -s "$OUT/ceilings.json" ]; then
      step "ceilings (copy bandwidth, bf16 GEMM)"
      PEERS_CEILINGS_ONLY=1 timeout 120 python3 $dev/peers.py "$OUT/ceilings.json" 2>&1 | grep -v Warning
    fi
    for build in ${KVFLEET_DEVICE_BUILDS:-kvfleet-base kvfleet}; do
      [ -x "$bin/$build" ] || continue
      for dtype in ${KVFLEET_DEVICE_HTTP_DTYPES:-bfloat16}; do
      # KVFLEET_DEVICE_QUANT="none fp8": the weights as they are, then FP8 (issue 32).
      for quant in ${KVFLEET_DEVICE_QUANT:-none}; do
        step "HTTP load: $build, dummy Llama-3.1-8B, $dtype KV, quantization $quant"
        log="$OUT/${build}_$dtype${KVFLEET_DEVICE_TAG:-}"
        [ "$quant" = none ] || log="${log}_$quant"
        KVFLEET_PROFILE=${KVFLEET_DEVICE_PROFILE:-0} "$bin/$build" worker --listen 127.0.0.1:8000 --model-weights dummy \
          --model-config $dev/llama-3.1-8b.json --attention-backend KVFLEET_CUDA --kv-cache-dtype "$dtype" \
          --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens ${KVFLEET_DEVICE_CHUNK:-2048} \
          --gpu-memory-utilization 0.92 --max-waiting 4096 $([ "$quant" = none ] || echo --quantization "$quant") \
          > "$log.worker.log" 2>&1 &
        pid=$!
        for _ in $(seq 1 120); do curl -sf 127.0.0.1:8000/readyz >/dev/null && break; sleep 1; done
        for row in ${KVFLEET_DEVICE_HTTP_ROWS:-1:130:512:1 64:130:512:64 256:130:512:256 256:1500:128:256 1:1500:16:5}; do
          IFS=: read -r c p o n <<< "$row"
          timeout 150 python3 $dev/http_load.py --port 8000 --concurrency "$c" --prompt-tokens "$p" \
            --output-tokens "$o" --requests "$n" --vocab 128000 --metrics ${KVFLEET_DEVICE_HTTP_SAMPLING:-} 2>&1 | tee -a "$log.http.log" | tail -1 \
            | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print({k: r[k] for k in ("concurrency","prompt_tokens","output_tokens","errors","output_tok_per_s","ttft_p50_ms","ttft_p99_ms","itl_p50_ms","itl_p99_ms")})' 
        done
        kill $pid; wait $pid 2>/dev/null
        [ "${KVFLEET_DEVICE_PROFILE:-0}" = 1 ] && sed 's/\x1b\[[0-9;]*m//g' "$log.worker.log" | grep -A12 "profile" | tail -40
      done
      done
    done
    ;;
  model-a)
    cp $dev/gguf.part1 "$stash/" && for f in "$bin"/*; do cp "$f" "$stash/"; done
    step "cuda_model dummy-geometry tests"
    "$stash/cuda_model" --ignored --nocapture dummy 2>&1 | tee "$OUT/cuda_model_dummy.log" | tail -12
    [ -n "${KVFLEET_DEVICE_TESTS_ONLY:-}" ] && { step "done"; exit 0; }
    step "model bench: dummy Llama-3-8B"
    KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=llama3-8b "$stash/model" 2>&1 | tee "$OUT/bench_model_8b.log" | tail -14
    # The served model through HTTP: the worker with dummy Llama-3.1-8B weights on the GPU,
    # bench/http_load.py with /metrics sampled during each run (bench/RESULTS.md).
    for dtype in ${KVFLEET_DEVICE_HTTP_DTYPES:-bfloat16}; do
      step "HTTP load: dummy Llama-3.1-8B, $dtype KV"
      "$stash/kvfleet" worker --listen 127.0.0.1:8000 --model-weights dummy --model-config $dev/llama-3.1-8b.json \
        --attention-backend KVFLEET_CUDA --kv-cache-dtype "$dtype" --max-model-len 4096 --max-num-seqs 256 \
        --max-num-batched-tokens 2048 --gpu-memory-utilization 0.92 --max-waiting 4096 > "$OUT/worker_8b_$dtype.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 120); do curl -sf 127.0.0.1:8000/readyz >/dev/null && break; sleep 1; done
      curl -s 127.0.0.1:8000/v1/capacity > "$OUT/capacity_8b_$dtype.json"; head -c 400 "$OUT/capacity_8b_$dtype.json"; echo
      for row in ${KVFLEET_DEVICE_HTTP_ROWS:-1:130:512 64:130:512 256:130:512 256:1500:128}; do
        IFS=: read -r c p o <<< "$row"
        timeout 150 python3 $dev/http_load.py --port 8000 --concurrency "$c" --prompt-tokens "$p" --output-tokens "$o" \
          --vocab 128000 --metrics 2>&1 | tee -a "$OUT/http_8b_$dtype.log" | tail -3
      done
      curl -s 127.0.0.1:8000/metrics > "$OUT/metrics_8b_$dtype.txt"
      kill $pid; wait $pid 2>/dev/null
      grep -E "ERROR|WARN|KV pool|ready" "$OUT/worker_8b_$dtype.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -4
    done
    ;;
  model-b)
    gguf=$stash/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$stash/gguf.part1" $dev/gguf.part2 > "$gguf" || exit 3
    echo "$(cat $dev/gguf.sha256)  $gguf" | sha256sum -c - || exit 3
    export KVFLEET_SMOLLM2_GGUF=$gguf
    step "cuda_model tests"
    "$stash/cuda_model" --ignored --nocapture --test-threads 1 2>&1 | tee "$OUT/cuda_model.log" | grep -E "test |ratio|result|panicked|tokens" | tail -30
    [ -n "${KVFLEET_DEVICE_TESTS_ONLY:-}" ] && { step "done"; exit 0; }
    step "model bench: SmolLM2"
    KVFLEET_BENCH_DEVICE=cuda KVFLEET_BENCH_MODELS=smollm2 "$stash/model" 2>&1 | tee "$OUT/bench_model_smollm2.log" | tail -14
    step "worker serves SmolLM2 on the GPU"
    "$stash/kvfleet" worker --listen 127.0.0.1:8000 --model "$gguf" --attention-backend KVFLEET_CUDA \
      --max-num-seqs 256 --max-num-batched-tokens 2048 > "$OUT/worker.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -sf 127.0.0.1:8000/readyz >/dev/null && break; sleep 1; done
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
      -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0}' \
      | tee "$OUT/chat.json"; echo
    curl -s 127.0.0.1:8000/v1/capacity > "$OUT/capacity_smollm2.json"; head -c 400 "$OUT/capacity_smollm2.json"; echo
    timeout 120 python3 $dev/http_load.py --port 8000 --concurrency 64 --prompt-tokens 130 --output-tokens 256 \
      --vocab 49000 --metrics 2>&1 | tee "$OUT/http_smollm2.log" | tail -3
    curl -s 127.0.0.1:8000/metrics | grep -E '^(kvfleet_kv_cache_capacity_tokens|vllm:(generation_tokens_total|num_preemptions_total|time_to_first_token_seconds_count))' | head
    kill $pid; wait $pid 2>/dev/null
    tail -5 "$OUT/worker.log"
    ;;
esac
step "done"
