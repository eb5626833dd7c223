"""Writes a Hugging Face tokenizer directory from a GGUF (transformers converts the GGUF's
tokenizer when given `gguf_file=`), so the clients count tokens offline with the served
model's own vocabulary.  Usage: python tokenizer_from_gguf.py MODEL.gguf OUT_DIR"""
import os
import sys

from transformers import AutoTokenizer

gguf, out = sys.argv[1], sys.argv[2]
d, name = os.path.split(os.path.abspath(gguf))
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
tok.save_pretrained(out)
print(f"{out}: {type(tok).__name__}, {len(tok)} tokens")
