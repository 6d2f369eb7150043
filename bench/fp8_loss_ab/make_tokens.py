"""Token files for the float8 loss A/B (docs/PERFORMANCE.md, "Float8 training: the loss of bf16"): the
Debian fortune files (/usr/share/games/fortunes, package fortunes / fortunes-min), each fortune one
document, tokenized by a byte-level BPE of 4,096 tokens trained on the same text (HF `tokenizers`,
offline), every document ended by token 0 (`<eot>`). One fortune in 20 goes to val.bin. Writes
OUT/train.bin, OUT/val.bin (flat uint16) and OUT/tokenizer.json; prints the counts.

Usage: python3 bench/fp8_loss_ab/make_tokens.py OUT [FORTUNE_DIR]"""
import os
import sys

import numpy as np
from tokenizers import ByteLevelBPETokenizer

out = sys.argv[1]
src = sys.argv[2] if len(sys.argv) > 2 else "/usr/share/games/fortunes"
os.makedirs(out, exist_ok=True)
docs = []
for name in sorted(os.listdir(src)):
    path = os.path.join(src, name)
    if not os.path.isfile(path) or name.endswith((".dat", ".u8")) or os.path.islink(path):
        continue
    text = open(path, encoding="utf-8", errors="replace").read()
    docs += [d.strip("\n") for d in text.split("\n%\n") if d.strip()]
tok = ByteLevelBPETokenizer()
tok.train_from_iterator(docs, vocab_size=4096, min_frequency=2, special_tokens=["<eot>"], show_progress=False)
assert tok.token_to_id("<eot>") == 0
tok.save(os.path.join(out, "tokenizer.json"))
train, val = [], []
for i, enc in enumerate(tok.encode_batch(docs)):
    (val if i % 20 == 0 else train).extend(enc.ids + [0])
for name, ids in (("train.bin", train), ("val.bin", val)):
    np.asarray(ids, dtype=np.uint16).tofile(os.path.join(out, name))
chars = sum(len(d) for d in docs)
print(f"{len(docs)} fortunes, {chars} characters; train {len(train)} tokens, val {len(val)} tokens "
      f"({chars / (len(train) + len(val)):.2f} characters a token)")
