#!/usr/bin/env python3
"""Copy-heavy single-stream benchmark for speculative decoding (issue 36).

Asks a running `kvfleet worker` (or any OpenAI-compatible server) to repeat a provided text of
about 1,000 tokens (default: the first 4,400 characters of docs/security.md), greedy, streamed, one request at a time, and
reports per request: output tokens, time to first token, decode tok/s (tokens after the first
over the time from the first to the last), end-to-end tok/s, and, from `/metrics` before and
after, the speculative-decoding counters vLLM exports (`vllm:spec_decode_*`): proposals, proposed
and accepted tokens, acceptance per position. Standard library only (runs on a bare GPU
machine). The last line is machine-readable JSON (medians over `--runs`).

    python3 bench/spec_copy.py --port 8000 --text docs/security.md --runs 3
"""

import argparse
import json
import re
import statistics
import time
import urllib.request


def metrics(base):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:spec_decode_[a-z_]+?)(?:\{([^}]*)\})? ([0-9.e+-]+)$', line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2) or "", float(m.group(3))
        pos = re.search(r'position="(\d+)"', labels)
        key = f"{name}[{pos.group(1)}]" if pos else name
        out[key] = out.get(key, 0.0) + v
    return out


def one(base, model, prompt, max_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    n, usage, text = 0, None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1
                    text.append(piece)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else n
    return {
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "output_tokens": tokens,
        "ttft_ms": (first - t0) * 1e3 if first else None,
        "decode_tok_per_s": (tokens - 1) / (last - first) if first and last > first else None,
        "e2e_tok_per_s": tokens / (end - t0),
        "text": "".join(text),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="served model (default: the first of /v1/models)")
    ap.add_argument("--text", required=True, help="file with the text to copy (the first --chars characters)")
    ap.add_argument("--chars", type=int, default=4400, help="about 1,000 tokens of English")
    ap.add_argument("--max-tokens", type=int, default=1100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--save", default=None, help="write every run's text to this JSON file")
    a = ap.parse_args()
    base = f"http://{a.host}:{a.port}"
    model = a.model or json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
    with open(a.text, encoding="utf-8") as f:
        source = f.read()[: a.chars]
    prompt = "Repeat the following text exactly, word for word:\n\n" + source
    before = metrics(base)
    runs = []
    for i in range(a.runs):
        r = one(base, model, prompt, a.max_tokens)
        runs.append(r)
        print(f"run {i}: prompt {r['prompt_tokens']} output {r['output_tokens']} ttft {r['ttft_ms']:.1f} ms "
              f"decode {r['decode_tok_per_s']:.1f} tok/s e2e {r['e2e_tok_per_s']:.1f} tok/s", flush=True)
    after = metrics(base)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts = d.get("vllm:spec_decode_num_drafts_total", 0)
    per_pos = []
    p = 0
    while f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{p}]" in d:
        per_pos.append(d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{p}]"] / drafts if drafts else 0.0)
        p += 1
    med = lambda k: statistics.median(r[k] for r in runs)
    summary = {
        "runs": a.runs,
        "prompt_tokens": runs[0]["prompt_tokens"],
        "output_tokens": med("output_tokens"),
        "ttft_ms": med("ttft_ms"),
        "decode_tok_per_s": med("decode_tok_per_s"),
        "e2e_tok_per_s": med("e2e_tok_per_s"),
        "same_text_every_run": len({r["text"] for r in runs}) == 1,
        "drafts": drafts,
        "draft_tokens": d.get("vllm:spec_decode_num_draft_tokens_total", 0),
        "accepted_tokens": d.get("vllm:spec_decode_num_accepted_tokens_total", 0),
        "acceptance_per_position": [round(x, 3) for x in per_pos],
        "text_sha": __import__("hashlib").sha256(runs[0]["text"].encode()).hexdigest()[:16],
    }
    if a.save:
        with open(a.save, "w", encoding="utf-8") as f:
            json.dump([r["text"] for r in runs], f)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
