#!/usr/bin/env python3
"""Overload benchmark for a running `kvfleet worker`: drives a multiple (default 10x) of what
its KV pool can hold at once, for a fixed time, and accounts for every request.

The pool's size comes from the worker itself (`GET /v1/capacity`: `maxConcurrency`, the number
of maxModelLen-long requests its pages hold; with the benchmark's shorter requests the pool holds
`kvTokens / (prompt + output)`, which is the figure multiplied). That many times `--factor`
clients each send streaming `/v1/completions` requests back to back (closed loop, no think
time) until `--duration` seconds have passed; every request then in flight is waited for (up to
`--grace` seconds).

Each request ends in exactly one class:
- completed: HTTP 200, `--output-tokens` token chunks, then `[DONE]`;
- rejected: HTTP 429 (the worker's bounded queue; `Retry-After` is checked to be present);
- failed: any other status, an error chunk, or a stream that ended without `[DONE]`;
- lost: sent and never answered within the grace (a hang). Must be 0.

With `--pid`, the worker's resident memory is sampled from /proc every 0.2 s and its peak
(`VmHWM`, the kernel's high-water mark) reported. Standard library only; the last line is JSON.

    python3 bench/overload.py --port 8000 --pid $(pgrep -f 'kvfleet worker') --duration 60
"""

import argparse
import asyncio
import json
import random
import sys
import time

from http_load import pct


async def request(host, port, prompt_ids, max_tokens, timeout):
    body = json.dumps(
        {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    ).encode()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        return {"class": "failed", "why": f"connect: {e}", "t0": t0}
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        return await asyncio.wait_for(read_answer(reader, max_tokens, t0), timeout)
    except asyncio.TimeoutError:
        return {"class": "lost", "why": f"no answer within {timeout} s", "t0": t0}
    except OSError as e:
        return {"class": "failed", "why": f"connection: {e}", "t0": t0}
    finally:
        writer.close()


async def read_answer(reader, max_tokens, t0):
    status_line = await reader.readline()
    parts = status_line.split()
    status = int(parts[1]) if len(parts) > 1 else 0
    headers = b""
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        headers += line.lower()
    if status == 429:
        await reader.read()
        after = [l for l in headers.splitlines() if l.startswith(b"retry-after:")]
        if not after:
            return {"class": "failed", "why": "429 without Retry-After", "t0": t0}
        return {"class": "rejected", "t0": t0, "retry_after": float(after[0].split(b":", 1)[1])}
    if status != 200:
        rest = await reader.read()
        return {"class": "failed", "why": f"{status}: {rest[-200:].decode(errors='replace')}", "t0": t0}
    tokens = 0
    while True:
        line = await reader.readline()
        if not line:
            return {"class": "failed", "why": "stream ended without [DONE]", "t0": t0}
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            break
        v = json.loads(payload)
        if "error" in v:
            return {"class": "failed", "why": json.dumps(v["error"])[:200], "t0": t0}
        ch = v.get("choices") or []
        if ch and ch[0].get("text") is not None and not ch[0].get("finish_reason"):
            tokens += 1
    if tokens != max_tokens:
        return {"class": "failed", "why": f"{tokens} tokens, not {max_tokens}", "t0": t0}
    return {"class": "completed", "t0": t0, "latency": time.perf_counter() - t0}


async def get_json(host, port, path):
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def memory_kib(pid):
    """(VmRSS, VmHWM) of `pid` in KiB."""
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


async def sample_memory(pid, stop, seen):
    while not stop.is_set():
        try:
            rss, hwm = memory_kib(pid)
            seen["rss_peak_kib"] = max(seen.get("rss_peak_kib", 0), rss)
            seen["hwm_kib"] = hwm
        except OSError:
            pass
        await asyncio.sleep(0.2)


async def main_async(a):
    cap = await get_json(a.host, a.port, "/v1/capacity")
    per_request = a.prompt_tokens + a.output_tokens
    pool_requests = max(1, cap["kvTokens"] // per_request)
    clients = a.clients or a.factor * pool_requests
    rng = random.Random(a.seed)
    memory = {}
    if a.pid:
        memory["rss_start_kib"] = memory_kib(a.pid)[0]
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(a.pid, stop_sampling, memory)) if a.pid else None
    results = []
    end = time.perf_counter() + a.duration

    async def client():
        while time.perf_counter() < end:
            prompt = [rng.randrange(a.min_token_id, a.vocab) for _ in range(a.prompt_tokens)]
            r = await request(a.host, a.port, prompt, a.output_tokens, a.duration + a.grace)
            results.append(r)
            if r["class"] == "rejected":
                # Clients honour Retry-After (as OpenAI's SDKs do), or wait --retry-pause.
                await asyncio.sleep(r["retry_after"] if a.retry_pause is None else a.retry_pause)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    stop_sampling.set()
    if sampler:
        await sampler
    counts = {k: sum(1 for r in results if r["class"] == k) for k in ("completed", "rejected", "failed", "lost")}
    lat = [r["latency"] for r in results if r["class"] == "completed"]
    after = await get_json(a.host, a.port, "/v1/capacity")
    summary = {
        "model": cap.get("modelName"),
        "backend": cap.get("backend"),
        "kv_tokens": cap["kvTokens"],
        "pool_requests": pool_requests,
        "clients": clients,
        "factor": round(clients / pool_requests, 2),
        "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens,
        "duration_s": a.duration,
        "wall_s": round(wall, 1),
        "sent": len(results),
        **counts,
        "latency_p50_s": round(pct(lat, 50), 3),
        "latency_p99_s": round(pct(lat, 99), 3),
        "output_tok_per_s": round(len(lat) * a.output_tokens / wall, 1) if wall else 0.0,
        "live_after": after.get("live"),
        **memory,
    }
    whys = [r["why"] for r in results if r["class"] in ("failed", "lost")]
    if whys:
        print("first failure:", whys[0], file=sys.stderr)
    print(json.dumps(summary))
    return 0 if counts["lost"] == 0 and counts["failed"] == 0 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--pid", type=int, default=None, help="the worker's pid, for its memory high-water mark")
    p.add_argument("--factor", type=int, default=10, help="clients = factor x requests the pool holds at once")
    p.add_argument("--clients", type=int, default=None, help="override the number of clients")
    p.add_argument("--duration", type=float, default=60.0, help="seconds during which requests are sent")
    p.add_argument("--grace", type=float, default=300.0, help="seconds a request may take after that")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--retry-pause", type=float, default=None, help="seconds a rejected client waits (default: Retry-After)")
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--min-token-id", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
