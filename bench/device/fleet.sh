#!/usr/bin/env bash
# Fleet routing on GPUs (issue 30), on the device machine after `bench/device/pack.sh serve`
# here (it packs this script and bench/http_load.py too). Two workers (dummy Llama-3.1-8B,
# bf16 KV, KV events on): one per GPU when the machine has two, else both on GPU 0 with the
# memory split. Each worker's KV pool is capped at KVFLEET_FLEET_KV_TOKENS (default 100,000;
# several, space-separated, run the comparison once per cap)
# so that the workload's distinct prefixes (32 x 4,000 = 128,000 tokens) exceed one replica's
# cache but not the fleet's, as in llm-d's published workload (150 tenants x 6,000 tokens over
# 8 pods); with uncapped H100 pools (~465,000 tokens each) every replica would hold every prefix
# and there would be nothing to route.
#
# In one call, the same seeded workload (groups in random order) through:
#   rr      bench/http_load.py sending request i to worker i mod 2 (what a Service does)
#   router  `kvfleet router` in front of both workers
# then the router's own latency: its pick-latency histogram over a 256-stream run (p50 and p99
# interpolated in its buckets, fine from 25 us to 10 ms), and one stream's TTFT direct and
# through the router. `bench/router_latency.rs` measures the same without a GPU.
# KVFLEET_FLEET_ROUTER_CPUS=0-3 runs the router on those cores alone (taskset) and the workers
# and the client on the others, to tell the router's own cost from preemption by the workers'
# threads; KVFLEET_FLEET_ORDER=skip runs only the latency steps.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dev=.device/serve
bin=/tmp/kvfleet-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
gpus=$(nvidia-smi -L | wc -l)
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
caps=${KVFLEET_FLEET_KV_TOKENS:-100000}
groups=${KVFLEET_FLEET_GROUPS:-32}
requests=${KVFLEET_FLEET_REQUESTS:-2048}
conc=${KVFLEET_FLEET_CONCURRENCY:-128}
rcpus=${KVFLEET_FLEET_ROUTER_CPUS:-}
pin_router=(); pin_rest=()
if [ -n "$rcpus" ]; then
  pin_router=(taskset -c "$rcpus"); pin_rest=(taskset -c "$(( ${rcpus##*-} + 1 ))-$(( $(nproc) - 1 ))")
  echo "router on cores $rcpus; workers and client on ${pin_rest[2]}"
fi
pids=()
stop_fleet() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_fleet EXIT
start_fleet() {
  local cap=$1
  for i in 0 1; do
    gpu=$i; util=0.92
    if [ "$gpus" -lt 2 ]; then gpu=0; util=0.45; fi
    step "worker $i on GPU $gpu (utilisation $util, KV capped at $cap tokens)"
    CUDA_VISIBLE_DEVICES=$gpu "${pin_rest[@]}" "$bin/kvfleet" worker --listen 127.0.0.1:800$((i + 1)) --model-weights dummy \
      --model-config $dev/llama-3.1-8b.json --attention-backend KVFLEET_CUDA --kv-cache-dtype bfloat16 \
      --max-model-len 8192 --max-num-seqs 256 --max-num-batched-tokens 2048 --gpu-memory-utilization $util \
      --max-waiting 4096 --max-kv-tokens "$cap" --kv-events-endpoint tcp://127.0.0.1:560$((i + 1)) \
      > "$OUT/worker${i}_$cap.log" 2>&1 &
    pids+=($!)
    # On one GPU the second worker sizes its pools after the first has taken its memory.
    if [ "$gpus" -lt 2 ]; then for _ in $(seq 1 180); do curl -sf 127.0.0.1:800$((i + 1))/readyz >/dev/null && break; sleep 1; done; fi
  done
  for i in 1 2; do for _ in $(seq 1 180); do curl -sf 127.0.0.1:800$i/readyz >/dev/null && break; sleep 1; done; done
  step "router"
  "${pin_router[@]}" "$bin/kvfleet" router --listen 127.0.0.1:8000 --model-weights dummy --model-config $dev/llama-3.1-8b.json \
    --worker http://127.0.0.1:8001,tcp://127.0.0.1:5601 --worker http://127.0.0.1:8002,tcp://127.0.0.1:5602 \
    > "$OUT/router_$cap.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 60); do
    n=$(curl -sf 127.0.0.1:8000/v1/router/state | python3 -c 'import json,sys; print(sum(1 for r in json.load(sys.stdin)["replicas"] if r["subscribed"] and r["scraped"]))' 2>/dev/null)
    [ "${n:-0}" = 2 ] && break; sleep 1
  done
  sleep 1
}
summary() { python3 -c 'import json,sys
r=json.loads(sys.stdin.read())
keys=("mode","concurrency","errors","output_tok_per_s","ttft_p50_ms","ttft_p90_ms","ttft_p99_ms","itl_p50_ms","hit_rate","ideal_hit_rate")
print({k: r[k] for k in keys if k in r})'; }
load() { timeout "${2:-420}" "${pin_rest[@]}" python3 $dev/http_load.py --vocab 128000 $1 2>&1 | tee -a "$OUT/http.log" | tail -1; }
first_cap=${caps%% *}
for cap in $caps; do
  start_fleet "$cap"
  work="--shared-prefix-groups $groups --shared-prefix-tokens 4000 --unique-tokens 200 --output-tokens 128 --num-requests $requests --concurrency $conc --group-order random --seed 30"
  for how in ${KVFLEET_FLEET_ORDER:-rr router}; do
    case "$how" in
      skip) continue ;;
      rr) port=8001,8002 ;;
      router) port=8000 ;;
    esac
    step "cap $cap: shared prefix through $how: $groups groups x 4,000 + 200 unique, 128 out, $requests requests, $conc clients"
    load "--port $port $work --cache-salt $how-$RANDOM" 540 | tee "$OUT/shared_${how}_$cap.json" | summary
  done
  curl -s 127.0.0.1:8000/metrics > "$OUT/router_metrics_shared_$cap.txt"
  grep -E "^kvfleet_router_(requests_total|prefix_predictions_total)" "$OUT/router_metrics_shared_$cap.txt"
  [ "$cap" = "$(echo $caps | awk '{print $NF}')" ] || stop_fleet
done

step "router latency: 256 streams through the router (pick-latency histogram before/after)"
curl -s 127.0.0.1:8000/metrics > "$OUT/router_metrics_a.txt"
load "--port 8000 --shared-prefix-groups $groups --shared-prefix-tokens 4000 --unique-tokens 200 --output-tokens 64 --num-requests 1024 --concurrency 256 --group-order random --seed 31" 300 | summary
curl -s 127.0.0.1:8000/metrics > "$OUT/router_metrics_b.txt"
python3 - "$OUT/router_metrics_a.txt" "$OUT/router_metrics_b.txt" <<'PY'
import sys
def buckets(path):
    out = {}
    for line in open(path):
        if line.startswith("kvfleet_router_pick_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
        elif line.startswith("kvfleet_router_pick_seconds_sum"):
            out["sum"] = float(line.split()[-1])
    return out
a, b = buckets(sys.argv[1]), buckets(sys.argv[2])
d = {k: b[k] - a.get(k, 0) for k in b}
n = d[float("inf")]
les = sorted(k for k in d if k != "sum")
def q(p):
    # Linear within the bucket, as histogram_quantile (the buckets are 25-250 us wide below 2 ms).
    lo, below = 0.0, 0.0
    for le in les:
        if d[le] >= p * n:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((p * n - below) / (d[le] - below) if d[le] > below else 1.0)
        lo, below = le, d[le]
print(f"pick latency over {n:.0f} requests: mean {d['sum'] / n * 1e6:.0f} us; p50 {q(0.5) * 1e3:.3f} ms; p99 {q(0.99) * 1e3:.3f} ms (interpolated in buckets); share under 1 ms {d[0.001] / n:.4f}")
PY
step "one stream, 130-token prompts, 16 out: direct vs through the router"
for port in 8001 8000; do
  load "--port $port --concurrency 1 --prompt-tokens 130 --output-tokens 16 --requests 64" 120 | summary
done
curl -s 127.0.0.1:8000/metrics > "$OUT/router_metrics_end.txt"
grep -E "^kvfleet_router_(requests_total|prefix_predictions_total|upstream_errors_total|kv_event_gaps_total|predicted|reported)" "$OUT/router_metrics_end.txt"
step done
