#!/usr/bin/env bash
# Real clients against one `kvfleet worker` (issue 34; bench/clients.md): inference-perf with
# its server-side report read through a real Prometheus scraping the worker, then guidellm.
# The same script runs on the CPU here and on the GPU machine (bench/device/clients.sh).
#
# Environment (defaults in brackets):
#   KVFLEET_BIN      the kvfleet binary [target/release/kvfleet]
#   GGUF             the served GGUF [$KVFLEET_SMOLLM2_GGUF]
#   WORKER_ARGS      extra worker flags [none: the CPU engine]
#   PROMETHEUS       a prometheus binary ["" or missing: no server-side report]
#   IP_PY, GL_PY     Python with inference-perf / guidellm ["" skips that tool]
#   TOK_PY           Python with transformers + gguf, to write the tokenizer directory [$GL_PY]
#   RATES            inference-perf's two stage rates, requests/s ["0.5 1"]
#   DURATION         seconds per inference-perf stage [20]
#   GL_RATE, GL_SECONDS, GL_PROMPT, GL_OUTPUT   guidellm's constant rate, its duration and
#                    its synthetic prompt/output tokens [1, 30, 64, 32]
#   OUT              where logs and reports go [/tmp/kvfleet-clients]
set -uo pipefail
cd "$(dirname "$0")/../.."
KVFLEET_BIN=${KVFLEET_BIN:-target/release/kvfleet}
GGUF=${GGUF:-${KVFLEET_SMOLLM2_GGUF:?set GGUF or KVFLEET_SMOLLM2_GGUF}}
WORKER_ARGS=${WORKER_ARGS:-}
PROMETHEUS=${PROMETHEUS:-}
IP_PY=${IP_PY:-}; GL_PY=${GL_PY:-}; TOK_PY=${TOK_PY:-$GL_PY}
read -r RATE1 RATE2 <<< "${RATES:-0.5 1}"
DURATION=${DURATION:-20}
OUT=${OUT:-/tmp/kvfleet-clients}; mkdir -p "$OUT"
work=$(mktemp -d /tmp/kvfleet-clients.XXXX)
WP=${WORKER_PORT:-18000}; PP=${PROM_PORT:-19090}
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; rm -rf "$work"; }
trap cleanup EXIT

step "tokenizer directory from the GGUF (transformers, gguf_file=)"
tok=$work/tokenizer
"$TOK_PY" bench/clients/tokenizer_from_gguf.py "$GGUF" "$tok" 2>&1 | grep -v Warning | tail -2 || exit 3

step "worker: $KVFLEET_BIN worker --model $(basename "$GGUF") $WORKER_ARGS"
# shellcheck disable=SC2086 # WORKER_ARGS is a list of flags
"$KVFLEET_BIN" worker --listen 127.0.0.1:$WP --model "$GGUF" $WORKER_ARGS > "$OUT/worker.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 600); do curl -sf 127.0.0.1:$WP/readyz >/dev/null && break; sleep 0.5; done
curl -sf 127.0.0.1:$WP/readyz >/dev/null || { echo "worker not ready"; tail -20 "$OUT/worker.log"; exit 3; }
model=$(curl -s 127.0.0.1:$WP/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "serving $model"

prom_url=""
if [ -n "$PROMETHEUS" ] && [ -x "$PROMETHEUS" ]; then
  step "prometheus scraping the worker every second"
  cat > "$work/prometheus.yml" <<EOF
global: {scrape_interval: 1s}
scrape_configs:
  - job_name: kvfleet-worker
    static_configs: [{targets: ['127.0.0.1:$WP']}]
EOF
  "$PROMETHEUS" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address=127.0.0.1:$PP > "$OUT/prometheus.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 120); do
    curl -s "127.0.0.1:$PP/api/v1/query?query=up" | grep -q '"value":\[[0-9.]*,"1"\]' && break; sleep 0.5
  done
  prom_url=http://127.0.0.1:$PP
fi

if [ -n "$IP_PY" ]; then
  step "inference-perf: constant $RATE1 then $RATE2 requests/s, ${DURATION} s each"
  mkdir -p "$OUT/inference-perf"
  cfg=bench/clients/inference-perf.yaml
  sed -e "s|__RATE1__|$RATE1|; s|__RATE2__|$RATE2|; s|__DURATION__|$DURATION|g; s|__MODEL__|$model|" \
      -e "s|__WORKER_PORT__|$WP|; s|__PROM_PORT__|$PP|; s|__TOKENIZER__|$tok|; s|__REPORTS__|$OUT/inference-perf|" \
      "$cfg" > "$work/inference-perf.yaml"
  if [ -z "$prom_url" ]; then
    # No Prometheus: drop the metrics and prometheus report blocks (client-side report only).
    python3 - "$work/inference-perf.yaml" <<'EOF'
import sys, yaml
p = sys.argv[1]; c = yaml.safe_load(open(p)); c.pop("metrics"); c["report"].pop("prometheus")
yaml.safe_dump(c, open(p, "w"))
EOF
  fi
  cp "$work/inference-perf.yaml" "$OUT/inference-perf/config.yaml"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout 900 "$IP_PY" -m inference_perf.main \
    --config_file "$work/inference-perf.yaml" > "$OUT/inference-perf.log" 2>&1
  echo "inference-perf exit: $?"; tail -5 "$OUT/inference-perf.log"
fi

if [ -n "$GL_PY" ]; then
  step "guidellm: constant ${GL_RATE:-1} requests/s for ${GL_SECONDS:-30} s, synthetic ${GL_PROMPT:-64}/${GL_OUTPUT:-32} tokens"
  mkdir -p "$OUT/guidellm"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL=WARNING timeout 600 \
    "$GL_PY" -m guidellm run \
    --backend "kind=openai_http,target=http://127.0.0.1:$WP,model=$model" \
    --tokenizer "kind=hf_auto,model=$tok" \
    --profile "kind=constant,rate=${GL_RATE:-1}" \
    --constraint "kind=max_duration,seconds=${GL_SECONDS:-30}" \
    --data "kind=synthetic_text,prompt_tokens=${GL_PROMPT:-64},output_tokens=${GL_OUTPUT:-32}" \
    --output "kind=json,path=$OUT/guidellm/benchmarks.json" \
    --disable-console-interactive > "$OUT/guidellm.log" 2>&1
  echo "guidellm exit: $?"; tail -30 "$OUT/guidellm.log"
fi

step "summary"
python3 bench/clients/summarize.py "$OUT" | tee "$OUT/summary.txt"
curl -s 127.0.0.1:$WP/metrics > "$OUT/metrics.txt"
step "done"
