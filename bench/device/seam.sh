#!/usr/bin/env bash
# The model seam's no-behaviour-change check (issue 54) on the device machine, after
# `bench/device/seam.sh pack` here; three calls on one warm machine, because SmolLM2's GGUF does
# not fit one carry beside the binaries.
#   bash bench/device/seam.sh pack   # (here) the release worker of this tree and of BASE=PATH, the
#                                    # GPU tests, the PTX digests; GGUF halves into .device/seam-b, -c
#   bash bench/device/seam.sh a      # (device) bench/http_load.py rows, base and new workers side
#                                    # by side, bf16 then FP8 (stashes the binaries for b and c)
#   bash bench/device/seam.sh b      # (device) stash the GGUF's first half; the GPU tests that
#                                    # need no GGUF
#   bash bench/device/seam.sh c      # (device) join the GGUF; the SmolLM2 GPU tests
set -uo pipefail
part=${1:?usage: seam.sh pack|a|b|c}
if [ "$part" = pack ]; then
  cd "$(dirname "$0")/../.."
  base=${BASE:?BASE=PATH of the earlier release kvfleet}
  rm -rf .device/seam-a .device/seam-b .device/seam-c; mkdir -p .device/seam-a/bin .device/seam-b .device/seam-c
  cargo build --release --locked -p kvfleet --bin kvfleet
  strip -o .device/seam-a/bin/kvfleet target/release/kvfleet && xz -T2 -6 .device/seam-a/bin/kvfleet
  strip -o .device/seam-a/bin/kvfleet-base "$base" && xz -T2 -6 .device/seam-a/bin/kvfleet-base
  cargo test --release --locked -p kvfleet-cuda --lib --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print("cuda_lib", m["executable"])' > /tmp/seam-exes
  cargo test --release --locked --test cuda_model --test cuda_gemma3 --test cuda_fp8 --test cuda_capacity \
    --test cuda_drafter --test cuda_worker --test cuda_attention --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["target"]["name"], m["executable"])' >> /tmp/seam-exes
  while read -r name exe; do strip -o ".device/seam-a/bin/$name" "$exe" && xz -T2 -6 ".device/seam-a/bin/$name"; done < /tmp/seam-exes
  cp bench/http_load.py bench/device/llama-3.1-8b.json .device/seam-a/
  gguf="${KVFLEET_SMOLLM2_GGUF:-.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
  half=$(( ($(stat -Lc %s "$gguf") + 1) / 2 ))
  head -c "$half" "$gguf" > .device/seam-b/gguf.part1
  tail -c +"$((half + 1))" "$gguf" > .device/seam-c/gguf.part2
  sha256sum -b "$gguf" | cut -d' ' -f1 > .device/seam-c/gguf.sha256
  du -sh .device/seam-*
  exit 0
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/seam-$part
stash=/root/kvfleet-stash; mkdir -p "$stash"
for f in $dev/bin/*.xz; do [ -e "$f" ] && xz -dc "$f" > "$stash/$(basename "$f" .xz)" && chmod +x "$stash/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
tests() { # NAME ARGS...: a GPU test binary, its summary lines
  local name=$1; shift
  timeout 300 "$stash/$name" --ignored --test-threads 1 "$@" > "$OUT/test_$name.log" 2>&1
  echo "$name: $(grep -E '^test result' "$OUT/test_$name.log" | tail -1) $(grep -cE '^test .* FAILED' "$OUT/test_$name.log") failed"
  grep -E '^test .* FAILED|panicked' "$OUT/test_$name.log" | head -5
}
case "$part" in
  a)
    show() { tail -1 "$1" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"$2"'", r["errors"], "errors", round(r["output_tok_per_s"],1), "tok/s, ttft p50", round(r["ttft_p50_ms"],1), "itl p50", round(r["itl_p50_ms"],2))'; }
    for w in bf16 fp8; do
      q=(); [ $w = fp8 ] && q=(--quantization fp8)
      step "HTTP: base and new workers, $w weights (dummy Llama-3.1-8B), 0.45 of the memory each"
      port=8000; pids=()
      for b in kvfleet-base kvfleet; do
        "$stash/$b" worker --listen 127.0.0.1:$port --model-weights dummy --model-config $dev/llama-3.1-8b.json \
          --attention-backend KVFLEET_CUDA --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 \
          --gpu-memory-utilization 0.45 --max-waiting 4096 "${q[@]}" > "$OUT/worker_${b}_$w.log" 2>&1 &
        pids+=($!)
        for _ in $(seq 1 150); do curl -sf 127.0.0.1:$port/readyz >/dev/null && break; sleep 1; done
        curl -sf 127.0.0.1:$port/readyz >/dev/null || { echo "$b $w not ready"; tail -5 "$OUT/worker_${b}_$w.log"; }
        timeout 60 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 32 \
          --requests 256 --vocab 128000 > "$OUT/warm.log" 2>&1
        port=$((port + 1))
      done
      for r in 1 2; do
        port=8000
        for b in kvfleet-base kvfleet; do
          timeout 60 python3 $dev/http_load.py --port $port --concurrency 1 --prompt-tokens 130 --output-tokens 512 \
            --requests 2 --vocab 128000 > "$OUT/h.log" 2>&1; cat "$OUT/h.log" >> "$OUT/http.log"
          show "$OUT/h.log" "$w $b 1x130/512 round $r:"
          timeout 120 python3 $dev/http_load.py --port $port --concurrency 256 --prompt-tokens 130 --output-tokens 512 \
            --requests 512 --vocab 128000 > "$OUT/h.log" 2>&1; cat "$OUT/h.log" >> "$OUT/http.log"
          show "$OUT/h.log" "$w $b 256x130/512 round $r:"
          port=$((port + 1))
        done
      done
      grep -hE "tuning|GpuTuning" "$OUT"/worker_kvfleet_$w.log | sed 's/\x1b\[[0-9;]*m//g' | head -2
      kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; sleep 2
    done
    ;;
  b)
    cp $dev/gguf.part1 "$stash/"; echo stashed
    step "GPU tests that need no GGUF"
    tests cuda_lib
    tests cuda_attention
    tests cuda_capacity
    tests cuda_gemma3 dummy
    tests cuda_gemma3 windowed
    ;;
  c)
    gguf=$stash/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$stash/gguf.part1" $dev/gguf.part2 > "$gguf" || exit 3
    echo "$(cat $dev/gguf.sha256)  $gguf" | sha256sum -c - || exit 3
    export KVFLEET_SMOLLM2_GGUF=$gguf
    step "SmolLM2 GPU tests"
    tests cuda_model
    tests cuda_fp8
    tests cuda_drafter
    tests cuda_worker
    ;;
esac
step done
