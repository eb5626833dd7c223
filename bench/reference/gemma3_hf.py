#!/usr/bin/env python3
"""Reference token ids and greedy continuations of Gemma 3 270M (Q4_K_M GGUF) from Hugging Face
transformers, for tests/model_gemma3.rs (issue 20).

transformers dequantises the GGUF (`gguf_file=`) to float32 and runs its own Gemma 3 code, so the
fixture is independent of kvfleet's dequantisation, tokenizer and forward pass. Not run by CI:
it needs torch + transformers (CPU wheels are enough), e.g.

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers accelerate gguf sentencepiece protobuf
    /tmp/ref/bin/python bench/reference/gemma3_hf.py "$KVFLEET_GEMMA3_GGUF" tests/fixtures/gemma3_270m_reference.json

For each prompt the fixture holds the ids the tokenizer gives (BOS included, as the model asks),
the greedy continuation of `steps` tokens, and at each step the margin between the top two
logits, so a test can tell a real divergence from a near tie that float order may flip.
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

STEPS = 16

# ASCII prose, code with runs of spaces and newlines (user-defined tokens), non-ASCII (Latin
# accents, CJK, Cyrillic), byte fallback (characters outside the vocabulary), and a prompt longer
# than the 512-token window of the local layers.
LONG = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'old'][i % 4]} box holds {i * 7 % 31} stones." for i in range(60))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n\n    return",
    "Der Bär läuft über die Straße, und 東京は日本の首都です。 Москва —",
    "Rare glyphs: \U000F0041\U0010FFFD \U00012000 end",
    LONG + " Count the stones in the red boxes:",
]


def main():
    gguf = sys.argv[1] if len(sys.argv) > 1 else os.environ["KVFLEET_GEMMA3_GGUF"]
    out = sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/gemma3_270m_reference.json"
    d, f = os.path.split(os.path.abspath(gguf))
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    cases = []
    for p in PROMPTS:
        ids = tok(p).input_ids
        seq = list(ids)
        cont, margins = [], []
        with torch.no_grad():
            for _ in range(STEPS):
                logits = model(torch.tensor([seq])).logits[0, -1]
                top = torch.topk(logits, 2)
                nxt = int(top.indices[0])
                margins.append(float(top.values[0] - top.values[1]))
                cont.append(nxt)
                seq.append(nxt)
        byte_tokens = [i for i in ids if tok.convert_ids_to_tokens(i).startswith("<0x")]
        cases.append(
            {
                "prompt": p,
                "ids": ids,
                "byte_fallback_tokens": len(byte_tokens),
                "greedy": cont,
                "top2_margin": margins,
                "text": tok.decode(cont),
            }
        )
        print(len(ids), "ids;", repr(tok.decode(cont)), "min margin", round(min(margins), 3), file=sys.stderr)
    meta = {
        "model": f,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "steps": STEPS,
        "generator": "bench/reference/gemma3_hf.py",
    }
    with open(out, "w") as fh:
        json.dump({"meta": meta, "cases": cases}, fh, ensure_ascii=False, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
