# Sourced by the device scripts (append.sh, rows.sh): load on workers listening at 127.0.0.1:8000 + I
# through bench/http_load.py, from $dev (the packed directory), logs under $OUT; names[I] labels
# worker I in what is printed.

# warm I ...: waits for each worker to be ready, then sends it 256 requests of 32 tokens.
warm() {
  for i in "$@"; do
    for _ in $(seq 1 150); do curl -sf 127.0.0.1:$((8000 + i))/readyz >/dev/null && break; sleep 1; done
    curl -sf 127.0.0.1:$((8000 + i))/readyz >/dev/null || { echo "${names[$i]} not ready"; tail -5 "$OUT/workers.log"; }
    timeout 60 python3 $dev/http_load.py --port $((8000 + i)) --concurrency 256 --prompt-tokens 130 --output-tokens 32 \
      --requests 256 --vocab 128000 > "$OUT/h.log" 2>&1
  done
}
# hl I CONCURRENCY REQUESTS LABEL: bench/http_load.py 130/512 against worker I, its JSON line
# kept in http.log and its figures printed under names[I].
hl() {
  timeout 90 python3 $dev/http_load.py --port $((8000 + $1)) --concurrency $2 --prompt-tokens 130 --output-tokens 512 \
    --requests $3 --vocab 128000 > "$OUT/h.log" 2>&1
  cat "$OUT/h.log" >> "$OUT/http.log"
  tail -1 "$OUT/h.log" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("'"${names[$1]} $4"'", {k: r[k] for k in ("errors","output_tok_per_s","ttft_p50_ms","itl_p50_ms")})'
}
