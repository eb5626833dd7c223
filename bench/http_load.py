#!/usr/bin/env python3
"""HTTP load benchmark for a running `kvfleet worker` (or any OpenAI-compatible server).

N concurrent streaming `/v1/completions` requests, each with a prompt of exactly P token ids
and `max_tokens` O (greedy unless `--temperature`/`--top-p`/`--top-k` say otherwise, with
vLLM's `ignore_eos` so every request streams exactly O tokens). Reports output tok/s over the whole run, time to first token and
inter-token latency percentiles, errors and 429s; with `--metrics`, scrapes `/metrics` every
0.2 s while the load runs and reports the peaks of the KV and request gauges.

`--port 8001,8002` sends request i to the i-th port round-robin (what a Service in front of the
replicas does, the baseline a router is compared with); metrics are read from the first.

Standard library only (asyncio streams), so it runs on a bare device machine:

    python3 bench/http_load.py --port 8000 --concurrency 64 --prompt-tokens 130 \\
        --output-tokens 512 --requests 64 --metrics

Method: every request is sent at t0 (closed loop of `--concurrency` clients, each sending its
next request when the previous one ends, until `--requests` are done). Output tok/s is the
number of streamed tokens (one SSE chunk per token) over the wall time from the first
send to the last [DONE]. TTFT is send to first text chunk; ITL is the gap between consecutive
text chunks of one request. The last table line is machine-readable JSON.

Prefix caching workloads. Either replaces the random prompts above; both ask for
`stream_options: {"include_usage": true}`, read `usage.prompt_tokens_details.cached_tokens` from
each stream's usage chunk, and add TTFT p90, the cached prompt tokens and the hit rate (cached /
prompt tokens, both from the usage chunks) beside the workload's ideal hit rate. A usage without
`prompt_tokens_details` counts as 0 cached tokens and the output says how many there were (vLLM
sends the field only with `--enable-prompt-tokens-details`).

- Shared prefix: `--shared-prefix-groups G --shared-prefix-tokens P --unique-tokens U`, with
  `--requests N` (or `--num-requests N`), `--concurrency C`, `--output-tokens O`. Each of the G
  groups has its own P token ids (drawn from `--seed` and the group's index); request i is its
  group's prefix then U token ids of its own. Requests take the groups round-robin, or at random
  (seeded) with `--group-order random`, and are sent in that order by C clients.

      python3 bench/http_load.py --shared-prefix-groups 4 --shared-prefix-tokens 1024 \\
          --unique-tokens 128 --output-tokens 64 --num-requests 256 --concurrency 32

- Multi-turn: `--turns T --conversations K --turn-tokens U`, with `--output-tokens O`. K
  conversations run at once, each sending its T turns one after another. Turn t's prompt is
  turn t-1's prompt, then O token ids standing for turn t-1's answer, then U new token ids. The
  server streams text, not token ids, so the answer enters the history as seeded stand-in ids,
  not as the tokens generated: only what earlier turns sent as prompt can be found in the cache.
  TTFT, cached tokens and hit rates are also reported per turn.

      python3 bench/http_load.py --turns 8 --conversations 16 --turn-tokens 256 --output-tokens 128

Ideal hit rate: for each request, in the order sent, the longest prefix of its prompt that an
earlier request's prompt began with, summed and divided by all prompt tokens sent. It assumes a
cold cache at the start, counts requests in flight together as if each had finished before the
next began, and counts single tokens (a server that caches whole blocks of B tokens can find up
to B-1 fewer per request). With g groups used (min(G, N) round-robin):

    shared prefix:  ideal = 1 - (g*P + N*U) / (N*(P+U))
    multi-turn:     turn t sends t*U + (t-1)*O tokens, of which turn t-1's (t-1)*U + (t-2)*O can
                    hit (t >= 2): ideal = sum_{t=2..T} ((t-1)*U + (t-2)*O) / sum_{t=1..T} (t*U + (t-1)*O)

The script computes it exactly from the prompts it sends. A rerun with the same `--seed` and
`--cache-salt` against the same server finds its prompts already cached: change either for a
cold start. `--cache-salt S` is sent as the request field `cache_salt` (vLLM's; any mode).
With `--metrics`, the deltas of `vllm:prefix_cache_queries_total` and
`vllm:prefix_cache_hits_total` over the run are reported where /metrics has them.
`--dry-run` builds the workload and prints its figures without sending anything.
"""

import argparse
import asyncio
import collections
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


async def one_request(host, port, prompt_ids, max_tokens, model, sampling, extra=None):
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, **sampling}
    if model:
        body["model"] = model
    if extra:
        body.update(extra)
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
    usage = None
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
            if isinstance(v.get("usage"), dict):
                # The usage chunk (stream_options.include_usage) has no choices.
                usage = v["usage"]
            ch = v.get("choices") or []
            # One chunk per token (its text may be empty); the closing chunk has a finish_reason.
            if ch and ch[0].get("text") is not None and not ch[0].get("finish_reason"):
                times.append(time.perf_counter())
    writer.close()
    return {"status": status, "t0": t0, "times": times, "error": error, "usage": usage}


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
                    # vLLM's series carry labels (model_name, engine): `name{...} value`.
                    if line.startswith(n + " ") or line.startswith(n + "{"):
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

    extra = request_extra(a, usage=False)

    async def client():
        while queue:
            i = queue.pop()
            port = a.ports[i % len(a.ports)]
            results.append(await one_request(a.host, port, prompts[i], a.output_tokens, a.model, sampling, extra))

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


def request_extra(a, usage):
    """Request fields beyond the plain run's: the usage chunk, and `cache_salt` when given."""
    extra = {}
    if usage:
        extra["stream_options"] = {"include_usage": True}
    if a.cache_salt is not None:
        extra["cache_salt"] = a.cache_salt
    return extra or None


def seeded(seed, *parts):
    # A string seed is hashed with SHA-512: the same ids on every run and Python version.
    return random.Random(":".join(str(x) for x in (seed,) + parts))


def token_ids(rng, n, lo, hi):
    return [rng.randrange(lo, hi) for _ in range(n)]


class PrefixIndex:
    """The prompts sent so far, as the chained hashes of all their prefixes: `add` answers how
    many leading tokens of a prompt an earlier prompt began with (exact but for 64-bit hash
    collisions). Memory grows with the distinct prefixes, not with the tokens sent."""

    def __init__(self):
        self.seen = set()

    def add(self, ids):
        h, hit, matching = 0, 0, True
        for t in ids:
            h = hash((h, t))
            if matching and h in self.seen:
                hit += 1
            else:
                matching = False
                self.seen.add(h)
        return hit


def shared_prefix_workload(groups, prefix_tokens, unique_tokens, requests, order, seed, lo, hi):
    """The requests in sending order: {prompt, group, ideal_hit}. Group g's prefix depends only
    on (seed, g), request i's own tokens only on (seed, i)."""
    prefixes = [token_ids(seeded(seed, "prefix", g), prefix_tokens, lo, hi) for g in range(groups)]
    pick = seeded(seed, "groups")
    index = PrefixIndex()
    reqs = []
    for i in range(requests):
        g = i % groups if order == "round-robin" else pick.randrange(groups)
        ids = prefixes[g] + token_ids(seeded(seed, "unique", i), unique_tokens, lo, hi)
        reqs.append({"prompt": ids, "group": g, "ideal_hit": index.add(ids)})
    return reqs


def multi_turn_workload(conversations, turns, turn_tokens, answer_tokens, seed, lo, hi):
    """One list of turns per conversation: {prompt, conversation, turn (from 1), ideal_hit}.
    Turn t's prompt is turn t-1's, then `answer_tokens` stand-in ids for its answer, then
    `turn_tokens` new ids."""
    index = PrefixIndex()
    convs = [[] for _ in range(conversations)]
    history = [[] for _ in range(conversations)]
    for t in range(turns):
        for k in range(conversations):
            ids = history[k] + token_ids(seeded(seed, "turn", k, t), turn_tokens, lo, hi)
            convs[k].append({"prompt": ids, "conversation": k, "turn": t + 1, "ideal_hit": index.add(ids)})
            history[k] = ids + token_ids(seeded(seed, "answer", k, t), answer_tokens, lo, hi)
    return convs


PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def http_body(raw):
    """The body of a raw HTTP/1.1 response, de-chunked when it was sent chunked."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


def parse_counters(text, names):
    """Sums of the samples of each named metric (all label sets) in a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        for n in names:
            if not line.startswith(n) or line[len(n) : len(n) + 1] not in (" ", "{"):
                continue
            rest = line[len(n) :]
            if rest.startswith("{"):
                end = rest.rfind("}")
                if end < 0:
                    continue
                rest = rest[end + 1 :]
            try:
                out[n] = out.get(n, 0.0) + float(rest.split()[0])
            except (IndexError, ValueError):
                pass
    return out


async def scrape_counters(host, port, names):
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        raw = await reader.read()
        writer.close()
    except OSError:
        return {}
    return parse_counters(http_body(raw).decode(errors="replace"), names)


def ratio(num, den):
    return round(num / den, 4) if den else None


def pct_str(r):
    return f"{r * 100:.1f}%" if r is not None else "-"


def ms(xs, p):
    return round(pct(xs, p) * 1e3, 1)


def cache_figures(results, reqs):
    """Cached prompt tokens from the usage chunks of `results`, beside the ideal of `reqs`."""
    usages = [r["usage"] for r in results if r.get("usage")]
    prompt = sum(u.get("prompt_tokens") or 0 for u in usages)
    cached = 0
    no_details = 0
    for u in usages:
        d = u.get("prompt_tokens_details")
        if isinstance(d, dict) and isinstance(d.get("cached_tokens"), (int, float)):
            cached += int(d["cached_tokens"])
        else:
            no_details += 1
    sent = sum(len(q["prompt"]) for q in reqs)
    ideal = sum(q["ideal_hit"] for q in reqs)
    return {
        "prompt_tokens_sent": sent,
        "prompt_tokens_usage": prompt,
        "cached_tokens": cached,
        "hit_rate": ratio(cached, prompt),
        "ideal_cached_tokens": ideal,
        "ideal_hit_rate": ratio(ideal, sent),
        "responses_with_usage": len(usages),
        "usage_without_prompt_tokens_details": no_details,
    }


def plan(a):
    """The workload of a run: (requests in sending order, conversations or None)."""
    lo, hi = a.min_token_id, a.vocab
    if a.mode == "shared-prefix":
        reqs = shared_prefix_workload(
            a.shared_prefix_groups, a.shared_prefix_tokens, a.unique_tokens, a.requests, a.group_order, a.seed, lo, hi
        )
        return reqs, None
    if a.mode == "multi-turn":
        convs = multi_turn_workload(a.conversations, a.turns, a.turn_tokens, a.output_tokens, a.seed, lo, hi)
        return [q for t in range(a.turns) for c in convs for q in c[t : t + 1]], convs
    # The plain run's prompts, in the order its clients take them.
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(lo, hi) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]
    index = PrefixIndex()
    return [{"prompt": p, "ideal_hit": index.add(p)} for p in reversed(prompts)], None


def workload_fields(a):
    if a.mode == "shared-prefix":
        return {
            "groups": a.shared_prefix_groups,
            "shared_prefix_tokens": a.shared_prefix_tokens,
            "unique_tokens": a.unique_tokens,
            "group_order": a.group_order,
        }
    if a.mode == "multi-turn":
        return {"turns": a.turns, "conversations": a.conversations, "turn_tokens": a.turn_tokens}
    return {}


def dry_run(a):
    reqs, _ = plan(a)
    sent = sum(len(q["prompt"]) for q in reqs)
    ideal = sum(q["ideal_hit"] for q in reqs)
    out = {
        "mode": a.mode,
        **workload_fields(a),
        "requests": len(reqs),
        "concurrency": a.concurrency,
        "output_tokens": a.output_tokens,
        "prompt_tokens_sent": sent,
        "prompt_tokens_max": max((len(q["prompt"]) for q in reqs), default=0),
        "ideal_cached_tokens": ideal,
        "ideal_hit_rate": ratio(ideal, sent),
        "cache_salt": a.cache_salt,
    }
    if a.mode == "multi-turn":
        out["per_turn"] = [
            {
                "turn": t,
                "prompt_tokens": len(qs[0]["prompt"]),
                "ideal_hit_rate": ratio(sum(q["ideal_hit"] for q in qs), sum(len(q["prompt"]) for q in qs)),
            }
            for t in range(1, a.turns + 1)
            for qs in [[q for q in reqs if q["turn"] == t]]
        ]
    print(
        f"dry run, nothing sent: {len(reqs)} requests, {sent} prompt tokens, "
        f"ideal hit rate {pct_str(out['ideal_hit_rate'])}"
    )
    print(json.dumps(out))
    return 0


async def cache_workload_async(a):
    """The shared-prefix and multi-turn runs."""
    sampling = {"temperature": a.temperature}
    if a.top_p is not None:
        sampling["top_p"] = a.top_p
    if a.top_k is not None:
        sampling["top_k"] = a.top_k
    extra = request_extra(a, usage=True)
    reqs, convs = plan(a)
    results = []

    sent = [0]

    async def send(q):
        port = a.ports[sent[0] % len(a.ports)]
        sent[0] += 1
        r = await one_request(a.host, port, q["prompt"], a.output_tokens, a.model, sampling, extra)
        r["req"] = q
        results.append(r)

    if convs is None:
        queue = collections.deque(reqs)

        async def client():
            while queue:
                await send(queue.popleft())

        clients = [client for _ in range(a.concurrency)]
    else:

        def conversation(turns):
            async def run():
                for q in turns:
                    await send(q)

            return run

        clients = [conversation(c) for c in convs]

    before = await scrape_counters(a.host, a.port, PREFIX_COUNTERS) if a.metrics else {}
    peaks = {}
    stop = asyncio.Event()
    scraper = asyncio.create_task(scrape(a.host, a.port, stop, peaks)) if a.metrics else None
    t0 = time.perf_counter()
    await asyncio.gather(*(c() for c in clients))
    wall = time.perf_counter() - t0
    stop.set()
    if scraper:
        await scraper
    after = await scrape_counters(a.host, a.port, PREFIX_COUNTERS) if a.metrics else {}

    ok = [r for r in results if r["error"] is None]
    tokens = sum(len(r["times"]) for r in ok)
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    itl = [b - a_ for r in ok for a_, b in zip(r["times"], r["times"][1:])]
    prompt_mean = round(statistics.fmean(len(q["prompt"]) for q in reqs)) if reqs else 0
    summary = {
        "mode": a.mode,
        **workload_fields(a),
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "rejected_429": sum(1 for r in results if r["status"] == 429),
        "concurrency": a.concurrency,
        # Shared prefix: P+U. Multi-turn: the mean over all turns (per_turn has each turn's).
        "prompt_tokens": prompt_mean,
        "output_tokens": a.output_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_total": tokens,
        "output_tok_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p90_ms": ms(ttft, 90),
        "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": round(pct(itl, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(itl, 99) * 1e3, 2),
        "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 2) if itl else float("nan"),
        **cache_figures(results, reqs),
        "cache_salt": a.cache_salt,
        "peaks": peaks,
    }
    if a.metrics:
        if all(n in before and n in after for n in PREFIX_COUNTERS):
            q = after[PREFIX_COUNTERS[0]] - before[PREFIX_COUNTERS[0]]
            h = after[PREFIX_COUNTERS[1]] - before[PREFIX_COUNTERS[1]]
            summary["prefix_cache_metrics"] = {"queries": q, "hits": h, "hit_rate": ratio(h, q)}
        else:
            summary["prefix_cache_metrics"] = None
    per_turn = []
    if convs is not None:
        for t in range(1, a.turns + 1):
            rs = [r for r in results if r["req"]["turn"] == t]
            tt = [r["times"][0] - r["t0"] for r in rs if r["error"] is None and r["times"]]
            per_turn.append(
                {
                    "turn": t,
                    "prompt_tokens": len(convs[0][t - 1]["prompt"]),
                    "ok": sum(1 for r in rs if r["error"] is None),
                    "ttft_p50_ms": ms(tt, 50),
                    "ttft_p90_ms": ms(tt, 90),
                    "ttft_p99_ms": ms(tt, 99),
                    **{
                        k: v
                        for k, v in cache_figures(rs, [c[t - 1] for c in convs]).items()
                        if k in ("cached_tokens", "hit_rate", "ideal_hit_rate")
                    },
                }
            )
        summary["per_turn"] = per_turn

    errs = [r["error"] for r in results if r["error"]]
    if errs:
        print("first error:", errs[0], file=sys.stderr)
    print(
        f"{'conc':>5} {'prompt':>6} {'out':>5} {'ok':>5} {'err':>4} {'tok/s':>10} "
        f"{'ttft p50':>9} {'ttft p90':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}"
    )
    print(
        f"{a.concurrency:>5} {prompt_mean:>6} {a.output_tokens:>5} {len(ok):>5} {summary['errors']:>4} "
        f"{summary['output_tok_per_s']:>10.1f} {summary['ttft_p50_ms']:>7.1f}ms {summary['ttft_p90_ms']:>7.1f}ms "
        f"{summary['ttft_p99_ms']:>7.1f}ms {summary['itl_p50_ms']:>6.2f}ms {summary['itl_p99_ms']:>6.2f}ms"
    )
    print(f"{'prompt tok':>12} {'cached tok':>12} {'hit rate':>9} {'ideal':>9}")
    print(
        f"{summary['prompt_tokens_usage']:>12} {summary['cached_tokens']:>12} "
        f"{pct_str(summary['hit_rate']):>9} {pct_str(summary['ideal_hit_rate']):>9}"
    )
    if per_turn:
        print(
            f"{'turn':>5} {'prompt':>7} {'ok':>5} {'ttft p50':>9} {'ttft p90':>9} {'ttft p99':>9} "
            f"{'cached tok':>11} {'hit rate':>9} {'ideal':>9}"
        )
        for row in per_turn:
            print(
                f"{row['turn']:>5} {row['prompt_tokens']:>7} {row['ok']:>5} {row['ttft_p50_ms']:>7.1f}ms "
                f"{row['ttft_p90_ms']:>7.1f}ms {row['ttft_p99_ms']:>7.1f}ms {row['cached_tokens']:>11} "
                f"{pct_str(row['hit_rate']):>9} {pct_str(row['ideal_hit_rate']):>9}"
            )
    missing_usage = len(ok) - summary["responses_with_usage"]
    if missing_usage > 0:
        print(
            f"note: {missing_usage} of {len(ok)} streams ended without a usage chunk "
            "(stream_options.include_usage ignored?); the hit rate counts only the others"
        )
    if summary["usage_without_prompt_tokens_details"]:
        print(
            f"note: {summary['usage_without_prompt_tokens_details']} of {summary['responses_with_usage']} "
            "usages had no prompt_tokens_details.cached_tokens; counted as 0 cached tokens"
        )
    if a.metrics:
        pm = summary["prefix_cache_metrics"]
        if pm is None:
            print("prefix cache counters: /metrics has no " + " or ".join(PREFIX_COUNTERS))
        else:
            print(
                f"prefix cache counters over the run (/metrics): queries +{pm['queries']:.0f}, "
                f"hits +{pm['hits']:.0f} ({pct_str(pm['hit_rate'])})"
            )
    if peaks:
        print("metric peaks during the run:", json.dumps(peaks))
    print(json.dumps(summary))
    return 0 if summary["errors"] == 0 or a.allow_errors else 1


def check_args(p, a):
    """Picks the mode and fills the defaults that depend on it; p.error (exit 2) on a misuse."""
    if a.vocab <= a.min_token_id:
        p.error(f"--vocab ({a.vocab}) must be above --min-token-id ({a.min_token_id})")
    if a.cache_salt is not None and a.cache_salt == "":
        p.error("--cache-salt must not be empty (leave it out to send no salt)")
    sp = {
        "--shared-prefix-groups": a.shared_prefix_groups,
        "--shared-prefix-tokens": a.shared_prefix_tokens,
        "--unique-tokens": a.unique_tokens,
    }
    mt = {"--turns": a.turns, "--conversations": a.conversations, "--turn-tokens": a.turn_tokens}
    sp_given = [k for k, v in sp.items() if v is not None]
    mt_given = [k for k, v in mt.items() if v is not None]
    if sp_given and mt_given:
        p.error(f"{sp_given[0]} (shared-prefix workload) and {mt_given[0]} (multi-turn workload) exclude each other")
    for given, opts, what in ((sp_given, sp, "the shared-prefix workload"), (mt_given, mt, "the multi-turn workload")):
        if given and len(given) < len(opts):
            missing = [k for k in opts if k not in given]
            p.error(
                f"{', '.join(opts)} go together ({what}): "
                f"{' and '.join(given)} given without {' and '.join(missing)}"
            )
    if a.group_order is not None and not sp_given:
        p.error("--group-order applies only to the shared-prefix workload (--shared-prefix-groups ...)")
    a.mode = "shared-prefix" if sp_given else "multi-turn" if mt_given else "plain"
    if a.mode == "plain":
        a.concurrency = 64 if a.concurrency is None else a.concurrency
        a.prompt_tokens = 130 if a.prompt_tokens is None else a.prompt_tokens
        a.requests = a.requests or a.concurrency
        return
    if a.prompt_tokens is not None:
        size = "--shared-prefix-tokens + --unique-tokens"
        if a.mode == "multi-turn":
            size = "set by --turn-tokens, --output-tokens and the turn"
        p.error(f"--prompt-tokens does not apply to the {a.mode} workload: its prompt size is {size}")
    if a.output_tokens < 1:
        p.error("--output-tokens must be at least 1 (TTFT needs a first token)")
    if a.mode == "shared-prefix":
        for k, v, least in (("--shared-prefix-groups", a.shared_prefix_groups, 1),
                            ("--shared-prefix-tokens", a.shared_prefix_tokens, 1),
                            ("--unique-tokens", a.unique_tokens, 0)):
            if v < least:
                p.error(f"{k} must be at least {least}, not {v}")
        a.group_order = a.group_order or "round-robin"
        a.concurrency = 64 if a.concurrency is None else a.concurrency
        if a.concurrency < 1:
            p.error(f"--concurrency must be at least 1, not {a.concurrency}")
        if a.requests is not None and a.requests < 1:
            p.error(f"--requests/--num-requests must be at least 1, not {a.requests}")
        a.requests = a.requests or a.concurrency
        a.prompt_tokens = a.shared_prefix_tokens + a.unique_tokens
    else:
        for k, v in mt.items():
            if v < 1:
                p.error(f"{k} must be at least 1, not {v}")
        if a.concurrency is not None:
            p.error("--concurrency does not apply to the multi-turn workload: --conversations K runs K at once")
        if a.requests is not None:
            p.error(
                "--requests/--num-requests does not apply to the multi-turn workload: "
                "it sends --turns x --conversations requests"
            )
        a.concurrency = a.conversations
        a.requests = a.turns * a.conversations


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8000",
                   help="server port; several, comma-separated, take the requests round-robin in the "
                   "order sent (a Service spreading over replicas: the baseline of a router)")
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's)")
    p.add_argument("--concurrency", type=int, default=None, help="concurrent clients (default: 64)")
    p.add_argument("--requests", "--num-requests", dest="requests", type=int, default=None,
                   help="total requests (default: --concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt token ids per request (default: 130)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below this")
    p.add_argument("--min-token-id", type=int, default=100, help="and at or above this (skips special tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--metrics", action="store_true", help="scrape /metrics every 0.2 s during the run")
    p.add_argument("--allow-errors", action="store_true", help="exit 0 even when requests failed")
    p.add_argument("--cache-salt", default=None, metavar="STR",
                   help="send this as the request field `cache_salt` (any mode; default: none)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the workload, print its size and ideal hit rate as JSON, send nothing")
    g = p.add_argument_group("shared-prefix workload (all three together)")
    g.add_argument("--shared-prefix-groups", type=int, default=None, metavar="G",
                   help="groups, each with its own prefix")
    g.add_argument("--shared-prefix-tokens", type=int, default=None, metavar="P",
                   help="token ids of each group's prefix")
    g.add_argument("--unique-tokens", type=int, default=None, metavar="U",
                   help="token ids of each request's own, after its group's prefix")
    g.add_argument("--group-order", choices=("round-robin", "random"), default=None,
                   help="how requests take groups (default: round-robin; random is seeded by --seed)")
    g = p.add_argument_group("multi-turn workload (all three together; --output-tokens is each answer)")
    g.add_argument("--turns", type=int, default=None, metavar="T", help="requests per conversation, one after another")
    g.add_argument("--conversations", type=int, default=None, metavar="K", help="conversations at once")
    g.add_argument("--turn-tokens", type=int, default=None, metavar="U", help="new token ids each turn")
    return p


def main():
    p = parser()
    a = p.parse_args()
    a.ports = [int(x) for x in str(a.port).split(",") if x]
    a.port = a.ports[0]
    check_args(p, a)
    if a.dry_run:
        sys.exit(dry_run(a))
    if a.mode == "plain":
        sys.exit(asyncio.run(main_async(a)))
    sys.exit(asyncio.run(cache_workload_async(a)))


if __name__ == "__main__":
    main()
