#!/usr/bin/env python3
"""HTTP load benchmark for a running `kvfleet worker` (or any OpenAI-compatible server).

N concurrent streaming `/v1/completions` requests, each with a prompt of exactly P token ids
and `max_tokens` O (greedy unless `--temperature`/`--top-p`/`--top-k` say otherwise, with
vLLM's `ignore_eos` so every request streams exactly O tokens). Reports output tok/s over the whole run, time to first token and
inter-token latency percentiles, errors and 429s; with `--metrics`, scrapes `/metrics` every
0.2 s while the load runs and reports the peaks of the KV and request gauges.

Standard library only (asyncio streams), so it runs on a bare device machine:

    python3 bench/http_load.py --port 8000 --concurrency 64 --prompt-tokens 130 \\
        --output-tokens 512 --requests 64 --metrics

Method: every request is sent at t0 (closed loop of `--concurrency` clients, each sending its
next request when the previous one ends, until `--requests` are done). Output tok/s is the
number of streamed tokens (one SSE chunk per token) over the wall time from the first
send to the last [DONE]. TTFT is send to first text chunk; ITL is the gap between consecutive
text chunks of one request. The last table line is machine-readable JSON.
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(host, port, prompt_ids, max_tokens, model, sampling):
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, **sampling}
    if model:
        body["model"] = model
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    await writer.drain()
    status_line = await reader.readline()
    status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
    times = []
    error = None
    if status != 200:
        rest = await reader.read()
        error = f"{status}: {rest[-300:].decode(errors='replace')}"
    else:
        while True:
            line = await reader.readline()
            if not line:
                error = error or "stream ended without [DONE]"
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            try:
                v = json.loads(payload)
            except json.JSONDecodeError:
                continue
            if "error" in v:
                error = json.dumps(v["error"])[:300]
                continue
            ch = v.get("choices") or []
            # One chunk per token (its text may be empty); the closing chunk has a finish_reason.
            if ch and ch[0].get("text") is not None and not ch[0].get("finish_reason"):
                times.append(time.perf_counter())
    writer.close()
    return {"status": status, "t0": t0, "times": times, "error": error}


async def scrape(host, port, stop, peaks):
    names = [
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "kvfleet_kv_cache_capacity_tokens",
    ]
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            text = (await reader.read()).decode(errors="replace")
            writer.close()
            for line in text.splitlines():
                for n in names:
                    if line.startswith(n + " "):
                        val = float(line.split()[-1])
                        peaks[n] = max(peaks.get(n, float("-inf")), val)
        except OSError:
            pass
        await asyncio.sleep(0.2)


async def main_async(a):
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(a.min_token_id, a.vocab) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]
    results = []
    queue = list(range(a.requests))

    sampling = {"temperature": a.temperature}
    if a.top_p is not None:
        sampling["top_p"] = a.top_p
    if a.top_k is not None:
        sampling["top_k"] = a.top_k

    async def client():
        while queue:
            i = queue.pop()
            results.append(await one_request(a.host, a.port, prompts[i], a.output_tokens, a.model, sampling))

    peaks = {}
    stop = asyncio.Event()
    scraper = asyncio.create_task(scrape(a.host, a.port, stop, peaks)) if a.metrics else None
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(a.concurrency)))
    wall = time.perf_counter() - t0
    stop.set()
    if scraper:
        await scraper
    ok = [r for r in results if r["error"] is None]
    tokens = sum(len(r["times"]) for r in ok)
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    itl = [b - a_ for r in ok for a_, b in zip(r["times"], r["times"][1:])]
    summary = {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "rejected_429": sum(1 for r in results if r["status"] == 429),
        "concurrency": a.concurrency,
        "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_total": tokens,
        "output_tok_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
        "itl_p50_ms": round(pct(itl, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(itl, 99) * 1e3, 2),
        "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 2) if itl else float("nan"),
        "peaks": peaks,
    }
    errs = [r["error"] for r in results if r["error"]]
    if errs:
        print("first error:", errs[0], file=sys.stderr)
    print(
        f"{'conc':>5} {'prompt':>6} {'out':>5} {'ok':>5} {'err':>4} {'tok/s':>10} "
        f"{'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}"
    )
    print(
        f"{a.concurrency:>5} {a.prompt_tokens:>6} {a.output_tokens:>5} {len(ok):>5} {summary['errors']:>4} "
        f"{summary['output_tok_per_s']:>10.1f} {summary['ttft_p50_ms']:>7.1f}ms {summary['ttft_p99_ms']:>7.1f}ms "
        f"{summary['itl_p50_ms']:>6.2f}ms {summary['itl_p99_ms']:>6.2f}ms"
    )
    if peaks:
        print("metric peaks during the run:", json.dumps(peaks))
    print(json.dumps(summary))
    return 0 if summary["errors"] == 0 or a.allow_errors else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="total requests (default: --concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=130)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below this")
    p.add_argument("--min-token-id", type=int, default=100, help="and at or above this (skips special tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--metrics", action="store_true", help="scrape /metrics every 0.2 s during the run")
    p.add_argument("--allow-errors", action="store_true", help="exit 0 even when requests failed")
    a = p.parse_args()
    a.requests = a.requests or a.concurrency
    sys.exit(asyncio.run(main_async(a)))


if __name__ == "__main__":
    main()
