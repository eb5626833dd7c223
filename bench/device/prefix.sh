#!/usr/bin/env bash
# Prefix caching on the GPU (issue 29), on the device machine after `bench/device/pack.sh serve`
# here: the worker with dummy Llama-3.1-8B weights, once with the prefix cache on and once
# with it off (`--no-enable-prefix-caching`), each running the same parts in the same call:
#   greedy     the same greedy requests (a shared 600-token prefix, a repeat, a shorter share)
#              to both workers: the generated text must not depend on the cache
#   shared     64 clients, 8 groups of a 4,000-token shared prefix, 200 unique and 128 output
#              tokens a request, 1,024 requests (bench/http_load.py --shared-prefix-*)
#   multiturn  64 conversations of 10 turns, 200 new and 128 output tokens a turn
#   rows       the serving rows of bench/RESULTS.md without a shared prefix
#   KVFLEET_PREFIX_PARTS="greedy shared rows"   (default: greedy shared multiturn rows)
#   KVFLEET_PREFIX_DTYPES="bfloat16 fp8_e4m3"   (KV dtypes; parts after greedy run on the first)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dev=.device/serve
bin=/tmp/kvfleet-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
parts=${KVFLEET_PREFIX_PARTS:-greedy shared multiturn rows}
dtypes=${KVFLEET_PREFIX_DTYPES:-bfloat16}
first_dtype=${dtypes%% *}
load() { timeout "${2:-300}" python3 $dev/http_load.py --port 8000 --vocab 128000 --metrics $1 2>&1 | tee -a "$log.http.log" | tail -1; }
summary() { python3 -c 'import json,sys
r=json.loads(sys.stdin.read())
keys=("mode","concurrency","prompt_tokens","output_tokens","errors","output_tok_per_s","ttft_p50_ms","ttft_p90_ms","ttft_p99_ms","itl_p50_ms","hit_rate","ideal_hit_rate")
print({k: r[k] for k in keys if k in r})
for t in r.get("per_turn", []): print("   turn", t)'; }
for dtype in $dtypes; do
  for cache in on off; do
    log="$OUT/prefix_${cache}_$dtype"
    flag=--enable-prefix-caching; [ "$cache" = off ] && flag=--no-enable-prefix-caching
    step "worker: dummy Llama-3.1-8B, $dtype KV, prefix cache $cache"
    "$bin/kvfleet" worker --listen 127.0.0.1:8000 --model-weights dummy --model-config $dev/llama-3.1-8b.json \
      --attention-backend KVFLEET_CUDA --kv-cache-dtype "$dtype" --max-model-len 8192 --max-num-seqs 256 \
      --max-num-batched-tokens 2048 --gpu-memory-utilization 0.92 --max-waiting 4096 $flag > "$log.worker.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -sf 127.0.0.1:8000/readyz >/dev/null && break; sleep 1; done
    for part in $parts; do
      [ "$part" != greedy ] && [ "$dtype" != "$first_dtype" ] && continue
      case "$part" in
        greedy)
          step "greedy requests ($cache, $dtype)"
          python3 - "$OUT/greedy_${cache}_$dtype.json" <<'PY'
import json, random, sys, urllib.request
rng = random.Random(29)
shared = [rng.randrange(1000, 128000) for _ in range(600)]
tail = lambda: [rng.randrange(1000, 128000) for _ in range(40)]
a, b, c = tail(), tail(), tail()
prompts = [shared + a, shared + b, shared + a, shared[:300] + c, shared + b]
out = []
for p in prompts:
    body = json.dumps({"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", body, {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=120))
    out.append({"text": r["choices"][0]["text"], "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                "prompt": r["usage"]["prompt_tokens"]})
json.dump(out, open(sys.argv[1], "w"))
print("cached tokens per request:", [o["cached"] for o in out])
PY
          ;;
        shared)
          step "shared prefix ($cache): 64 clients, 8 x 4,000 shared + 200 unique, 128 out, 1,024 requests"
          load "--shared-prefix-groups 8 --shared-prefix-tokens 4000 --unique-tokens 200 --output-tokens 128 --num-requests 1024 --concurrency 64" 420 | summary
          ;;
        multiturn)
          step "multi-turn ($cache): 64 conversations x 10 turns, 200 new + 128 out a turn"
          load "--turns 10 --conversations 64 --turn-tokens 200 --output-tokens 128" 300 | summary
          ;;
        rows)
          for row in ${KVFLEET_DEVICE_HTTP_ROWS:-1:130:512:1 256:130:512:256 256:1500:128:256}; do
            IFS=: read -r c p o n <<< "$row"
            step "row $row ($cache)"
            load "--concurrency $c --prompt-tokens $p --output-tokens $o --requests $n" 150 | summary
          done
          ;;
      esac
    done
    curl -s 127.0.0.1:8000/v1/capacity > "$log.capacity.json"
    python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); l=c["live"]; print({k: l.get(k) for k in ("prefixCaching","cachedBlocks","prefixCacheQueries","prefixCacheHits","prefixCacheHitRate")}, "totalBlocks", c["totalBlocks"])' "$log.capacity.json"
    kill $pid; wait $pid 2>/dev/null
    grep -E "ERROR|panicked" "$log.worker.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -3
  done
  if [ -s "$OUT/greedy_on_$dtype.json" ] && [ -s "$OUT/greedy_off_$dtype.json" ]; then
    python3 -c 'import json,sys
on, off = (json.load(open(p)) for p in sys.argv[1:3])
same = sum(a["text"] == b["text"] for a, b in zip(on, off))
print(f"greedy {sys.argv[3]}: {same}/{len(on)} texts equal with the cache on and off; cached tokens on: {[a["cached"] for a in on]}")' \
      "$OUT/greedy_on_$dtype.json" "$OUT/greedy_off_$dtype.json" "$dtype" | tee -a "$OUT/greedy.txt"
  fi
done
step "done"
