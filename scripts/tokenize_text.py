"""Text to a token file for `data: {name: token_file}` (docs/DATA.md, "Tokenizing text").

Usage:
  python scripts/tokenize_text.py --tokenizer MODEL_DIR_or_tokenizer.json --out train.bin
      [--eot-token "<|end_of_text|>" | --eot-id N] [--jsonl-key text] INPUT...

Each INPUT is a text file (one document) or a JSONL file (one document per line, its --jsonl-key
field). Every document is encoded with the Hugging Face tokenizer (a model directory's
tokenizer.json) without special tokens, then the end-of-text id is appended, as nanoGPT's prepare
scripts do. The tokens go to OUT as little-endian uint16 (a vocabulary of at most 65,536 ids) or
uint32, and OUT.json (the sidecar) records the dtype, vocabulary size, end-of-text id, the tokenizer
and each input's documents and tokens: token_file reads it, so the config need not repeat them, and
refuses a config that contradicts it. Both files are written through a temporary name and a rename.

Python, not C++: Hugging Face's `tokenizers` (Rust, already in the project's environment through
transformers) is the tokenizer the model was trained with; a C++ reimplementation of its
pre-tokenizers and normalizers would be a second source of truth for every model family.
"""
import argparse, json, os, sys

import numpy as np
from tokenizers import Tokenizer


def documents(path, key):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)[key]
                except (ValueError, KeyError, TypeError) as e:
                    sys.exit(f"tokenize_text: {path}:{n}: not a JSON object with a '{key}' string ({e})")
                if not isinstance(doc, str):
                    sys.exit(f"tokenize_text: {path}:{n}: '{key}' is not a string")
                yield doc
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def write_atomic(path, data):
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="a model directory holding tokenizer.json, or the file")
    p.add_argument("--out", required=True, help="the token file to write (OUT.json beside it)")
    p.add_argument("--eot-token", help="the end-of-text token's text (default: the tokenizer's <|endoftext|>-like token)")
    p.add_argument("--eot-id", type=int, help="the end-of-text id")
    p.add_argument("--jsonl-key", default="text", help="the field of a JSONL line that holds the document")
    p.add_argument("--batch", type=int, default=1000, help="documents encoded together")
    p.add_argument("inputs", nargs="+")
    a = p.parse_args()

    path = os.path.join(a.tokenizer, "tokenizer.json") if os.path.isdir(a.tokenizer) else a.tokenizer
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:
        sys.exit(f"tokenize_text: {path}: not a Hugging Face tokenizer.json ({e})")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if a.eot_id is not None:
        eot = a.eot_id
    else:
        names = [a.eot_token] if a.eot_token else ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"]
        ids = [tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if not found:
            sys.exit(f"tokenize_text: {path} has none of the end-of-text tokens {names}: give --eot-token or --eot-id")
        eot = found[0][1]
    if not 0 <= eot < vocab:
        sys.exit(f"tokenize_text: --eot-id {eot} is not below the vocabulary size {vocab}")
    dtype = np.uint16 if vocab <= 65536 else np.uint32

    chunks, sources = [], []
    for src in a.inputs:
        if not os.path.isfile(src):
            sys.exit(f"tokenize_text: {src}: no such file")
        docs, tokens, batch = 0, 0, []

        def flush():
            nonlocal tokens
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids + [eot], dtype=np.int64)
                chunks.append(ids.astype(dtype))
                tokens += len(ids)
            batch.clear()

        for doc in documents(src, a.jsonl_key):
            batch.append(doc)
            docs += 1
            if len(batch) >= a.batch:
                flush()
        flush()
        if docs == 0:
            sys.exit(f"tokenize_text: {src}: no document")
        sources.append({"path": src, "documents": docs, "tokens": tokens})

    data = np.concatenate(chunks).astype(np.dtype(dtype).newbyteorder("<"), copy=False)
    write_atomic(a.out, data.tobytes())
    side = {"format": "strobe token file", "dtype": "uint16" if dtype == np.uint16 else "uint32", "vocab_size": vocab,
            "eot_token": eot, "tokenizer": os.path.abspath(path), "documents": sum(s["documents"] for s in sources),
            "tokens": int(data.size), "sources": sources}
    write_atomic(a.out + ".json", (json.dumps(side, indent=1) + "\n").encode())
    print(f"tokenize_text: {side['documents']} documents, {side['tokens']} tokens ({side['dtype']}, vocabulary {vocab}, "
          f"end of text {eot}) -> {a.out}")


if __name__ == "__main__":
    main()
