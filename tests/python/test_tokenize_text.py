"""scripts/tokenize_text.py (docs/DATA.md, "Tokenizing text"): a BPE trained here with Hugging Face's
`tokenizers` turns a text file and a JSONL file into a token file whose ids are exactly the
tokenizer's own encoding of each document followed by the end-of-text id, with a sidecar giving the
dtype, vocabulary, end-of-text id and each input's counts. `strobe fit` trains on it with none of
those in the config (the resolved config takes them from the sidecar); a config that contradicts the
sidecar is one line, exit 2; a JSONL line without the field is the script's one line.

Usage: test_tokenize_text.py (STROBE_SOURCE_DIR, STROBE_BIN). Needs tokenizers (scripts/setup.sh
installs it with transformers): without it the test fails under CI (CI=true), else it is skipped."""
import json, os, shutil, subprocess, sys, tempfile

SRC = os.environ.get("STROBE_SOURCE_DIR", os.getcwd())
STROBE = os.environ.get("STROBE_BIN", os.path.join(SRC, "build", "bin", "strobe"))
try:
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
except ImportError as e:
    print(f"test_tokenize_text: {e}")
    sys.exit(1 if os.environ.get("CI") else 77)

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


tmp = tempfile.mkdtemp(prefix="strobe_tokenize_")
words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex jolly boxing frogs".split()
corpus = [" ".join(words[(i * 7 + k) % len(words)] for k in range(5 + i % 9)) for i in range(400)]
tok = Tokenizer(models.BPE(unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", "<|endoftext|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
model_dir = os.path.join(tmp, "model")
os.makedirs(model_dir)
tok.save(os.path.join(model_dir, "tokenizer.json"))
eot, vocab = tok.token_to_id("<|endoftext|>"), tok.get_vocab_size(with_added_tokens=True)

docs_txt = ["the lazy dog jumps over seven jolly wizards, then boxing frogs hex the fox.\nA second line."]
docs_jsonl = corpus[:3] + ["quietly, the brown fox"]
with open(os.path.join(tmp, "a.txt"), "w") as f:
    f.write(docs_txt[0])
with open(os.path.join(tmp, "b.jsonl"), "w") as f:
    for d in docs_jsonl:
        f.write(json.dumps({"text": d, "id": 1}) + "\n")
out = os.path.join(tmp, "train.bin")
script = os.path.join(SRC, "scripts", "tokenize_text.py")
r = subprocess.run([sys.executable, script, "--tokenizer", model_dir, "--out", out, os.path.join(tmp, "a.txt"),
                    os.path.join(tmp, "b.jsonl")], capture_output=True, text=True)
check(r.returncode == 0, f"tokenize_text failed: {r.stderr}")
want = []
for d in docs_txt + docs_jsonl:
    want += tok.encode(d, add_special_tokens=False).ids + [eot]
got = np.fromfile(out, dtype="<u2").tolist() if os.path.exists(out) else []
check(got == want, f"the token file is not tokenizers' encoding: {got[:20]} against {want[:20]}")
side = json.load(open(out + ".json")) if os.path.exists(out + ".json") else {}
check(side.get("format") == "strobe token file" and side.get("dtype") == "uint16" and side.get("vocab_size") == vocab
      and side.get("eot_token") == eot and side.get("documents") == 5 and side.get("tokens") == len(want),
      f"sidecar: {side}")
check([s["documents"] for s in side.get("sources", [])] == [1, 4], f"sidecar sources: {side.get('sources')}")

cfg = os.path.join(tmp, "lm.yaml")
with open(cfg, "w") as f:
    f.write(f"""name: tokenized
seed: 1
trainer: {{max_steps: 2, num_sanity_val_steps: 0, enable_progress_bar: false, enable_model_summary: false, device: cpu}}
task: {{name: language_modeling}}
model: {{name: decoder_lm, vocab_size: {vocab}, max_seq_len: 16, embed_dim: 16, depth: 1, num_heads: 2}}
data: {{name: token_file, path: {out}, max_seq_len: 16, val_fraction: 0.0, batch_size: 2, num_workers: 0, collate: pack}}
optimizer: {{name: adamw, lr: 0.001}}
scheduler: {{name: none}}
""")
run_dir = os.path.join(tmp, "run")
r = subprocess.run([STROBE, "fit", "-c", cfg, "--run-dir", run_dir], capture_output=True, text=True)
check(r.returncode == 0, f"strobe fit on the token file: exit {r.returncode}: {r.stderr[-2000:]}")
resolved = open(os.path.join(run_dir, "config.yaml")).read() if os.path.exists(os.path.join(run_dir, "config.yaml")) else ""
for key, value in (("eot_token", eot), ("vocab_size", vocab), ("dtype", "uint16")):
    check(f"{key}: {value}" in resolved, f"the resolved config lacks {key}: {value} from the sidecar")
r = subprocess.run([STROBE, "fit", "-c", cfg, "--run-dir", os.path.join(tmp, "bad"), "--set", "data.eot_token=5"],
                   capture_output=True, text=True)
check(r.returncode == 2 and r.stderr.count("\n") == 1 and f"data.eot_token: 5, but {out}.json (the token file's sidecar) says {eot}"
      in r.stderr, f"a contradicting eot_token: exit {r.returncode}: {r.stderr}")
with open(os.path.join(tmp, "bad.jsonl"), "w") as f:
    f.write('{"body": "x"}\n')
r = subprocess.run([sys.executable, script, "--tokenizer", model_dir, "--out", os.path.join(tmp, "bad.bin"),
                    os.path.join(tmp, "bad.jsonl")], capture_output=True, text=True)
check(r.returncode != 0 and "bad.jsonl:1: not a JSON object with a 'text' string" in r.stderr, f"bad JSONL: {r.stderr}")

for f in failures:
    print("FAIL:", f)
print(f"test_tokenize_text: {len(want)} tokens of 5 documents; {len(failures)} failures")
if failures or os.environ.get("STROBE_KEEP_TEST_DIRS"):
    print("files kept in", tmp)
else:
    shutil.rmtree(tmp, ignore_errors=True)
sys.exit(1 if failures else 0)
