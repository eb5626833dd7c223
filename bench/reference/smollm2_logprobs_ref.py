#!/usr/bin/env python3
"""Reference log-probabilities of SmolLM2-135M-Instruct (the embedded Q4_1 GGUF) for
tests/fixtures/smollm2_logprobs_reference.json (issue 34): what the worker's `logprobs` and
`echo` must report.

The reference that is fair to a Q4_1 model is the float model those quantised weights define: the
weights dequantised exactly (gguf-py's `gguf.quants.dequantize`, the code transformers itself calls
when it loads a GGUF with `gguf_file=`) and the Llama forward pass run in float64. This script does
that in numpy, independently of kvfleet's dequantisation and forward pass. It is what transformers'
`LlamaForCausalLM` computes on the same dequantised weights, up to its float32 rounding: transformers
un-permutes the GGUF's Q/K rows (llama.cpp stores them for interleaved-pair rotary embeddings) and
applies half-split rotary embeddings; here the GGUF rows keep llama.cpp's order and the pairs are
interleaved, the same function. (torch could not be installed on the machine that made the fixture:
the CPU wheel index is not reachable and PyPI's torch needs the CUDA libraries to import.)

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install gguf numpy
    /tmp/ref/bin/python bench/reference/smollm2_logprobs_ref.py "$KVFLEET_SMOLLM2_GGUF" \
        tests/fixtures/smollm2_logprobs_reference.json

Prompts are written as tokens of the vocabulary (so the fixture needs no tokenizer): for each the
fixture holds the ids, each position's log-probability of the next prompt token, and the TOP most
likely next tokens with their log-probabilities at every position (the last one's first entry is
the greedy next token).
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

TOP = 5
PROMPTS = [
    ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"],
    ["Once", "Ġupon", "Ġa", "Ġtime", ",", "Ġthere", "Ġwas", "Ġa"],
    ["def", "Ġadd", "(", "a", ",", "Ġb", "):", "Ċ", "ĠĠĠ", "Ġreturn"],
    ["The", "Ġquick", "Ġbrown", "Ġfox", "Ġjumps", "Ġover", "Ġthe", "Ġlazy"],
]


def field(r, name):
    return r.fields[name].contents()


def tensor(r, name):
    t = next(t for t in r.tensors if t.name == name)
    w = dequantize(t.data, t.tensor_type).astype(np.float64)
    # gguf-py gives numpy order: [rows, cols] with cols the fastest (ne[0]).
    return w.reshape([int(x) for x in reversed(t.shape.tolist())])


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    # x: [T, heads, hd]; llama.cpp's layout: pairs (2i, 2i + 1) rotate by pos * theta^(-2i/hd).
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def log_softmax(z):
    m = z.max(axis=-1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))


def main():
    path, out = sys.argv[1], sys.argv[2]
    r = GGUFReader(path)
    n_layers = int(field(r, "llama.block_count"))
    n_heads = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv"))
    eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
    theta = float(field(r, "llama.rope.freq_base"))
    vocab = [str(t) for t in field(r, "tokenizer.ggml.tokens")]
    ids_of = {t: i for i, t in enumerate(vocab)}
    embed = tensor(r, "token_embd.weight")
    d = embed.shape[1]
    hd = d // n_heads
    names = {t.name for t in r.tensors}
    head = tensor(r, "output.weight") if "output.weight" in names else embed
    layers = []
    for li in range(n_layers):
        g = lambda n: tensor(r, f"blk.{li}.{n}.weight")  # noqa: E731
        layers.append({n: g(n) for n in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                          "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]})
    out_norm = tensor(r, "output_norm.weight")

    cases = []
    for words in PROMPTS:
        ids = [ids_of[w] for w in words]
        t = len(ids)
        pos = np.arange(t, dtype=np.float64)
        x = embed[ids]
        mask = np.triu(np.full((t, t), -np.inf), 1)
        for L in layers:
            h = rms_norm(x, L["attn_norm"], eps)
            q = rope((h @ L["attn_q"].T).reshape(t, n_heads, hd), pos, theta)
            k = rope((h @ L["attn_k"].T).reshape(t, n_kv, hd), pos, theta)
            v = (h @ L["attn_v"].T).reshape(t, n_kv, hd)
            rep = n_heads // n_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            a = np.einsum("hqk,khd->qhd", p, v).reshape(t, d)
            x = x + a @ L["attn_output"].T
            h = rms_norm(x, L["ffn_norm"], eps)
            gate, up = h @ L["ffn_gate"].T, h @ L["ffn_up"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ L["ffn_down"].T
        lp = log_softmax(rms_norm(x, out_norm, eps) @ head.T)
        top = [[[int(j), float(row[j])] for j in np.argsort(-row, kind="stable")[:TOP]] for row in lp]
        cases.append({
            "text": "".join(words).replace("Ġ", " ").replace("Ċ", "\n"),
            "ids": ids,
            # prompt_logprobs[i]: log p(ids[i + 1] | ids[..=i]).
            "prompt_logprobs": [float(lp[i, ids[i + 1]]) for i in range(t - 1)],
            "top": top,
        })
        print(cases[-1]["text"].replace("\n", "\\n"), "->", repr(vocab[top[-1][0][0]]), top[-1][0][1])
    with open(out, "w") as f:
        json.dump({"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "reference": "numpy float64 on gguf-py dequantised weights",
                   "top": TOP, "prompts": cases}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
