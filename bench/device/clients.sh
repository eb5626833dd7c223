#!/usr/bin/env bash
# Runs on the device machine after `bench/device/pack.sh clients` here (carry .device/clients):
# inference-perf against the release worker serving SmolLM2 on the GPU, its server-side report
# read through a real Prometheus scraping the worker (bench/clients/run.sh, issue 34), and
# SmolLM2's log-probabilities from Hugging Face transformers compared with the committed fixture
# (bench/reference/smollm2_logprobs_hf.py).
#   bash bench/device/clients.sh              # everything (about 4 minutes)
#   KVFLEET_CLIENTS_PARTS="hf" bash ...       # some of: hf inference-perf
# The SmolLM2 GGUF (94 MiB) does not fit one call beside the rest: the script reads
# $KVFLEET_SMOLLM2_GGUF, else the copy `bench/device/run.sh model-b` assembles in its stash on
# the same warm machine. guidellm needs Hugging Face datasets (pyarrow, pandas: 70 MB of
# wheels) and does not fit this call; bench/clients.md has its CPU run.
# Logs, reports and the summary go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
dev=.device/clients
bin=/tmp/kvfleet-bin; mkdir -p "$bin"
for f in $dev/bin/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)" && chmod +x "$bin/$(basename "$f" .xz)"; done
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
parts=${KVFLEET_CLIENTS_PARTS:-hf inference-perf}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 --version

gguf=${KVFLEET_SMOLLM2_GGUF:-/root/kvfleet-stash/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$gguf" ] || { echo "no SmolLM2 GGUF at $gguf: set KVFLEET_SMOLLM2_GGUF or run run.sh model-a/model-b first"; exit 3; }

step "wheels into /tmp/site; placeholders for what inference-perf imports and this run never uses"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $dev/whl/*.whl || exit 3
python3 bench/device/import_stubs.py /tmp/stubs
export PYTHONPATH=/tmp/site:/tmp/stubs
python3 -c 'import importlib.metadata as m; print({p: m.version(p) for p in ("inference-perf", "transformers", "torch", "gguf", "pydantic")})'

if [[ " $parts " == *" hf "* ]]; then
  step "log-probabilities: transformers (float32, CPU) against tests/fixtures/smollm2_logprobs_reference.json"
  timeout 300 python3 bench/reference/smollm2_logprobs_hf.py "$gguf" tests/fixtures/smollm2_logprobs_reference.json \
    "$OUT/smollm2_logprobs_hf.json" 2>&1 | grep -v Warning | tee "$OUT/hf_logprobs.log" | tail -12
fi

if [[ " $parts " == *" inference-perf "* ]]; then
  # The GPU takes far more than the CPU's 0.5 and 1 requests/s: 8 then 32, 30 s each.
  step "inference-perf + Prometheus against the GPU worker"
  KVFLEET_BIN="$bin/kvfleet" GGUF="$gguf" PROMETHEUS="$bin/prometheus" IP_PY=python3 TOK_PY=python3 GL_PY= \
    WORKER_ARGS="--attention-backend KVFLEET_CUDA --max-num-seqs 256 --max-num-batched-tokens 2048" \
    RATES="${KVFLEET_CLIENTS_RATES:-8 32}" DURATION="${KVFLEET_CLIENTS_DURATION:-30}" OUT=/tmp/clients \
    timeout 420 bash bench/clients/run.sh 2>&1 | tee "$OUT/clients.log" | grep -v "^20..-..-.. " | tail -40
  # At most 8 files come back: the summary, both reports of the run and the logs, tarred.
  cp /tmp/clients/summary.txt "$OUT/" 2>/dev/null
  tar -C /tmp/clients -czf "$OUT/clients-reports.tgz" . 2>/dev/null
fi
step "done"
