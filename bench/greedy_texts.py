#!/usr/bin/env python3
"""Greedy completions of fixed prompts from a running worker, saved for comparison between runs
(speculation off against on, issue 36). Standard library only.

    python3 bench/greedy_texts.py --port 8000 --save off.json [--compare other.json]

Each prompt is one request at a time (`/v1/completions`, temperature 0, `--max-tokens`), and a
second pass sends them all at once. With --compare, prints per prompt how many leading
characters equal the other file's text, and whether the whole text does; the last line is JSON.
"""

import argparse
import concurrent.futures
import json
import urllib.request

PROMPTS = [
    "The capital of France is",
    "Here is a list of the planets of the solar system, in order from the sun: Mercury, Venus,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


def complete(base, model, prompt, max_tokens):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    r = json.loads(urllib.request.urlopen(req, timeout=300).read())
    return r["choices"][0]["text"], r["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--save", required=True)
    ap.add_argument("--compare", default=None)
    a = ap.parse_args()
    base = f"http://{a.host}:{a.port}"
    model = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
    alone = [complete(base, model, p, a.max_tokens) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        batched = list(ex.map(lambda p: complete(base, model, p, a.max_tokens), PROMPTS))
    out = {"model": model, "alone": [t for t, _ in alone], "batched": [t for t, _ in batched],
           "tokens": [n for _, n in alone]}
    json.dump(out, open(a.save, "w"), indent=1)
    if a.compare:
        other = json.load(open(a.compare))
        rows = []
        for kind in ("alone", "batched"):
            for i, (x, y) in enumerate(zip(out[kind], other[kind])):
                same = next((k for k, (c, d) in enumerate(zip(x, y)) if c != d), min(len(x), len(y)))
                rows.append({"pass": kind, "prompt": i, "equal": x == y, "same_chars": same, "chars": len(x)})
                print(f"{kind} prompt {i}: {'equal' if x == y else 'differs at char %d of %d' % (same, len(x))}")
        print(json.dumps({"equal": sum(r["equal"] for r in rows), "of": len(rows), "rows": rows}))


if __name__ == "__main__":
    main()
