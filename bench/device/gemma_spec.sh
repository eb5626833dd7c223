#!/usr/bin/env bash
# Gemma 3 270M served on the GPU with speculation off, n-gram, EAGLE-3 and DFlash (issue 36):
# greedy texts of bench/greedy_texts.py compared with speculation off. The GGUF (253 MB) travels
# in five calls to one warm machine (.device/gemma-N/, N = 1..5, a fifth each, xz-compressed:
# `bench/device/gemma_spec.sh pack` here); part 5 carries the worker too and runs.
#   bash bench/device/gemma_spec.sh pack       # here: the five folders
#   bash bench/device/gemma_spec.sh 1|2|3|4    # there: stash a fifth
#   bash bench/device/gemma_spec.sh 5          # there: the last fifth, join, run
set -uo pipefail
part=${1:?usage: gemma_spec.sh pack|1|2|3|4|5}
if [ "$part" = pack ]; then
  gguf=${KVFLEET_GEMMA3_GGUF:-.tools/models/gemma-3-270m-q4_k_m.gguf}
  size=$(stat -Lc %s "$gguf"); fifth=$(( (size + 4) / 5 ))
  for i in 1 2 3 4 5; do
    rm -rf .device/gemma-$i; mkdir -p .device/gemma-$i
    tail -c +$(( (i - 1) * fifth + 1 )) "$gguf" | head -c $fifth | xz -T2 -6 > .device/gemma-$i/gguf.part$i.xz
  done
  sha256sum "$gguf" | cut -d' ' -f1 > .device/gemma-5/gguf.sha256
  strip -o /tmp/kvfleet.strip target/release/kvfleet && xz -T2 -6 -c /tmp/kvfleet.strip > .device/gemma-5/kvfleet.xz
  du -sh .device/gemma-*
  exit 0
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dev=.device/gemma-$part
stash=/root/kvfleet-stash; mkdir -p "$stash"
cp $dev/gguf.part$part.xz "$stash/"
[ "$part" = 5 ] || { ls -la "$stash"; exit 0; }
for i in 1 2 3 4 5; do xz -dc "$stash/gguf.part$i.xz"; done > "$stash/gemma.gguf"
echo "$(cat $dev/gguf.sha256)  $stash/gemma.gguf" | sha256sum -c - || exit 3
xz -dc $dev/kvfleet.xz > "$stash/kvfleet" && chmod +x "$stash/kvfleet"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
# Random drafters of Gemma 3 270M's geometry (hidden 640, 4 query heads over 1 KV head of 256,
# 18 layers), a draft vocabulary of 8 common tokens.
for kind in eagle3 dflash; do
  python3 tests/fixtures/eagle3/generate.py --kind $kind --out "$stash/$kind" --hidden 640 --vocab 262144 \
    --target-layers 18 --heads 4 --kv-heads 1 --head-dim 256 --ff 2048 --draft-tokens 236761,506,496,529,563,107,108,236764 \
    > /dev/null || echo "drafter $kind: generate failed"
done
for mode in off ngram eagle3 dflash; do
  args=()
  case $mode in
    ngram) args=(--speculative-config '{"method":"ngram","num_speculative_tokens":4}') ;;
    eagle3|dflash) args=(--speculative-config '{"method":"'$mode'","num_speculative_tokens":3,"model":"'$stash/$mode'"}') ;;
  esac
  "$stash/kvfleet" worker --listen 127.0.0.1:8000 --attention-backend KVFLEET_CUDA --model "$stash/gemma.gguf" "${args[@]}" \
    > "$OUT/worker_$mode.log" 2>&1 &
  wpid=$!
  ok=0; for _ in $(seq 1 120); do curl -sf 127.0.0.1:8000/readyz >/dev/null && { ok=1; break; }; sleep 1; done
  [ $ok = 1 ] || { echo "worker $mode did not start"; tail -5 "$OUT/worker_$mode.log"; kill $wpid; continue; }
  cmp=(); [ $mode = off ] || cmp=(--compare "$OUT/texts_off.json")
  echo "== Gemma 3 270M on the GPU, speculation $mode"
  timeout 200 python3 bench/greedy_texts.py --port 8000 --max-tokens 128 --save "$OUT/texts_$mode.json" "${cmp[@]}" | tail -13
  curl -s 127.0.0.1:8000/v1/capacity | python3 -c 'import json,sys; c=json.load(sys.stdin); print("kvTokens", c.get("kvTokens"), "drafterBytes", (c.get("gpuMemory") or {}).get("drafterBytes"), "speculative", (c.get("live") or {}).get("speculative"))'
  kill $wpid; wait $wpid 2>/dev/null
done
