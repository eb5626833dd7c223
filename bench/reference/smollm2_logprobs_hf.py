#!/usr/bin/env python3
"""SmolLM2-135M-Instruct's log-probabilities from Hugging Face transformers, compared with
tests/fixtures/smollm2_logprobs_reference.json (issue 34).

The fixture comes from bench/reference/smollm2_logprobs_ref.py: numpy float64 over gguf-py's
dequantised weights, written because torch could not be installed where it was made. This script
asks transformers itself: it loads the same GGUF (`gguf_file=`, which dequantises through gguf-py
to float32 and runs transformers' own LlamaForCausalLM), feeds the fixture's token ids (no BOS, as
the fixture), and writes the same quantities in the fixture's format: each position's
log-probability of the next prompt token and the TOP most likely next tokens. It then prints the
largest difference to the fixture, so the float64 reference, transformers and the worker (which
tests/tools_support/openai_sdk_check.py holds to the fixture within 0.05) are tied together.

Needs torch, transformers and gguf (the device machine has torch and transformers; gguf travels
as a wheel, bench/device/clients.sh). CPU float32 is enough:

    python3 bench/reference/smollm2_logprobs_hf.py "$KVFLEET_SMOLLM2_GGUF" \
        tests/fixtures/smollm2_logprobs_reference.json /tmp/smollm2_logprobs_hf.json

HF_DTYPE=bfloat16 HF_DEVICE=cuda runs transformers as a bf16 GPU engine serves (weights and
activations bf16): how far bf16 itself moves these log-probabilities from the float reference,
and a reference in the same precision to hold a bf16 engine to (the output has the fixture's
format, so bench/reference/logprobs_vs_fixture.py --fixture takes it).
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

# The fixture's bound for the worker (tests/tools_support/openai_sdk_check.py): transformers'
# float32 is expected well inside it.
WORKER_BOUND = 0.05


def main():
    gguf, fixture_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(fixture_path) as f:
        fixture = json.load(f)
    top_n = int(fixture["top"])
    d, name = os.path.split(os.path.abspath(gguf))
    torch.manual_seed(0)
    dtype = getattr(torch, os.environ.get("HF_DTYPE", "float32"))
    device = os.environ.get("HF_DEVICE", "cpu")
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype).to(device)
    model.eval()

    cases = []
    worst_prompt, worst_top, top_id_mismatches, near_ties = 0.0, 0.0, 0, 0
    for ref in fixture["prompts"]:
        ids = ref["ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0].to("cpu", torch.float64)
        lp = torch.log_softmax(logits, dim=-1)
        prompt_lp = [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        values, indices = torch.topk(lp, top_n, dim=-1)
        top = [[[int(j), float(v)] for j, v in zip(ji.tolist(), vi.tolist())] for ji, vi in zip(indices, values)]
        cases.append({"text": ref["text"], "ids": ids, "prompt_logprobs": prompt_lp, "top": top})

        worst_prompt = max([worst_prompt] + [abs(a - b) for a, b in zip(prompt_lp, ref["prompt_logprobs"])])
        for row, ref_row in zip(top, ref["top"]):
            ref_lp = dict((int(j), v) for j, v in ref_row)
            for j, v in row:
                if j in ref_lp:
                    worst_top = max(worst_top, abs(v - ref_lp[j]))
            if [j for j, _ in row] != [j for j, _ in ref_row]:
                top_id_mismatches += 1
                # An order flip between two tokens whose log-probabilities are within the bound
                # is a near tie, not a different model.
                gaps = [abs(a[1] - b[1]) for a, b in zip(ref_row, ref_row[1:])]
                near_ties += int(min(gaps) <= WORKER_BOUND)
        print(f"{ref['text']!r}: greedy next {top[-1][0][0]} (fixture {ref['top'][-1][0][0]})")

    with open(out, "w") as f:
        json.dump({"model": fixture["model"], "reference": f"transformers {transformers.__version__} {str(dtype).removeprefix('torch.')} on {device} "
                   f"(torch {torch.__version__}), GGUF dequantised by gguf-py", "top": top_n, "prompts": cases},
                  f, indent=1)
        f.write("\n")
    print(f"max |transformers - fixture| prompt log-probabilities: {worst_prompt:.6f}")
    print(f"max |transformers - fixture| top-{top_n} log-probabilities (same token): {worst_top:.6f}")
    print(f"positions whose top-{top_n} ids differ: {top_id_mismatches} ({near_ties} near ties)")
    print(f"within the worker's bound {WORKER_BOUND}: {max(worst_prompt, worst_top) <= WORKER_BOUND}")
    return 0 if max(worst_prompt, worst_top) <= WORKER_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
