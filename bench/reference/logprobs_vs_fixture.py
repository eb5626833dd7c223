#!/usr/bin/env python3
"""Log-probabilities a running worker returns against tests/fixtures/smollm2_logprobs_reference.json.

For each fixture prompt, one `/v1/completions` request with the prompt's token ids, `max_tokens`
1, temperature 0 and `logprobs` 5: the worker's top-5 log-probabilities of the first generated
token are compared, in rank order, with the fixture's top-5 at the prompt's last position (the
fixture is float64 over the GGUF's dequantised weights and equals Hugging Face transformers'
within 2.7e-5: bench/RESULTS.md). This is the check the CPU test makes through the openai SDK
(tests/tools_support/openai_sdk_check.py), for a worker on a GPU, which serves the generated
tokens' log-probabilities but refuses prompt log-probabilities.

    python3 bench/reference/logprobs_vs_fixture.py --port 8000 [--fixture PATH] [--bound 0.05]

Prints one line a prompt and the largest difference; exits 1 when it is over the bound or the
greedy token's log-probability is not the fixture's most likely one.
"""
import argparse
import json
import sys
import urllib.request


def complete(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--fixture", default="tests/fixtures/smollm2_logprobs_reference.json")
    ap.add_argument("--bound", type=float, default=0.05)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    a = ap.parse_args()
    fixture = json.load(open(a.fixture))
    worst = 0.0
    ok = True
    for case in fixture["prompts"]:
        want = case["top"][-1]  # [[id, logprob], ...] at the last prompt position, most likely first
        r = complete(a.port, {"model": a.model, "prompt": case["ids"], "max_tokens": 1,
                              "temperature": 0, "logprobs": len(want)})
        lp = r["choices"][0]["logprobs"]
        got = sorted(lp["top_logprobs"][0].values(), reverse=True)
        if len(got) < len(want):
            print(f"{case['text']!r}: {len(got)} top log-probabilities, {len(want)} wanted")
            ok = False
            continue
        diff = max(abs(g - w[1]) for g, w in zip(got, want))
        greedy = lp["token_logprobs"][0]
        worst = max(worst, diff, abs(greedy - want[0][1]))
        print(f"{case['text']!r}: greedy {r['choices'][0]['text']!r} logprob {greedy:.5f} "
              f"(fixture {want[0][1]:.5f}); top-{len(want)} max |diff| {diff:.5f}")
    print(f"max |worker - fixture| over {len(fixture['prompts'])} prompts: {worst:.5f} (bound {a.bound})")
    return 0 if ok and worst <= a.bound else 1


if __name__ == "__main__":
    sys.exit(main())
