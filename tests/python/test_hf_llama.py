"""Hugging Face's LlamaForCausalLM and Strobe's llama, both ways (docs/MODELS.md, "Hugging Face weights").

- Random tiny LlamaConfigs (GQA 4 heads over 2, rope_theta 5e5, Llama-3 rope_scaling; tied and untied)
  saved by transformers load through `model.init_from: {path: DIR, names: hf}` and give transformers'
  logits in fp32 (relative error < 1e-5) on padded batches and on packed ones (per document).
- The same checkpoint saved in shards (model.safetensors.index.json) loads the same (a shard path
  outside the directory, or a tensor in two shards, is refused); the bare
  model.safetensors without config.json loads and says it was checked by names and shapes only; a
  config.json that disagrees with the model (hidden_size) is exit 2 naming both values.
- `strobe fit` trains from that checkpoint; `strobe export --names hf -o DIR` of the run writes a
  directory that transformers' AutoModelForCausalLM.from_pretrained loads, with the logits of the
  run's weights as Strobe computes them (read through a `--names strobe` export). Its config.json
  keeps the source's fields (max_position_embeddings 128 over the run's max_seq_len 64, bos/eos token
  ids), after a resume too, and generation_config.json lets transformers generate.
- 200 AdamW steps on learnable documents give the loss curve of a PyTorch loop over the transformers
  model (the first 5 losses to 1e-5, all to 1e-3), falling in both. The logits are checked on the
  ATen path and on the fused one (`fused_ops: true`: strobe::add_rms_norm, its CPU reference here);
  the curve runs the fused one.
- On a CUDA machine (torch.cuda.is_available()), the same on the GPU in fp32 with TF32 off on both
  sides: the logits of both paths against transformers' on the GPU (relative error < 1e-5), and 200
  steps of Strobe on CUDA with every fused op and the fused LM head (strobe::linear_cross_entropy)
  against the PyTorch loop on CUDA (the first 5 losses to 1e-5, all to 1e-3). Without CUDA this part
  says so and is left out.

Usage: test_hf_llama.py (STROBE_SOURCE_DIR, STROBE_BUILD_DIR). Needs transformers and safetensors
(scripts/setup.sh installs them): without them the test fails under CI (CI=true), else it is skipped."""
import json, os, re, shutil, subprocess, sys, tempfile

BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))
STROBE = os.environ.get("STROBE_BIN", os.path.join(BUILD, "bin", "strobe"))
CHECK = os.path.join(BUILD, "bin", "strobe_model_check")
failures, compared = [], []

try:
    import torch
    from safetensors.torch import save_file, load_file
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, AutoModelForCausalLM, GenerationConfig
except ImportError as e:
    print(f"test_hf_llama: {e}")
    sys.exit(1 if os.environ.get("CI") else 77)
transformers.logging.set_verbosity_error()
# The PyTorch loops are tiny: a few threads, so that tests running beside this one (ctest -j) on a
# many-core machine do not starve each other's thread pools.
torch.set_num_threads(min(4, os.cpu_count() or 1))


def check(ok, what):
    if not ok:
        failures.append(what)
    return ok


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}


# The untied source carries fields the model does not: a longer context than the run trains with and
# its own token ids; an export of the run must keep them.
SOURCE_FIELDS = {"max_position_embeddings": 128, "bos_token_id": 5, "eos_token_id": 6}


def hf_model(tied, seed):
    torch.manual_seed(seed)
    fields = {"max_position_embeddings": 64} if tied else dict(SOURCE_FIELDS)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=dict(ROPE), tie_word_embeddings=tied, attention_bias=False, mlp_bias=False, **fields)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms too, so a swapped norm weight shows
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def model_yaml(tied, init_path=None, names="hf", fused=False):
    y = (f"name: llama\nfused_ops: {'true' if fused else 'false'}\n"
         "vocab_size: 97\nembed_dim: 32\ndepth: 2\nnum_heads: 4\nnum_kv_heads: 2\nffn_dim: 48\n"
         "max_seq_len: 64\nnorm_eps: 1.0e-5\nrope_theta: 500000\n"
         "rope_scaling: {rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
         "original_max_position_embeddings: 16}\n"
         f"tie_embeddings: {'true' if tied else 'false'}\n")
    if init_path:
        y += f"init_from: {{path: {init_path}, names: {names}}}\n"
    return y


def strobe_logits(tmp, yaml, batch, device="cpu"):
    inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    save_file({k: v.contiguous() for k, v in batch.items()}, inp)
    r = subprocess.run([CHECK, yaml, "--logits", inp, out, "--device", device], capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr.strip()
    return load_file(out)["logits"], ""


def batches():
    g = torch.Generator().manual_seed(5)
    lengths = [13, 5, 9]
    docs = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    padded = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    for i, d in enumerate(docs):
        padded[i, :len(d)] = d
    pos = torch.arange(max(lengths)).expand(len(docs), -1).contiguous()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    packed = {"tokens": torch.cat(docs), "cu_seqlens": cu, "position_ids": torch.cat([torch.arange(n) for n in lengths])}
    return docs, {"tokens": padded, "position_ids": pos}, packed


def check_flops(tag, hf, tmp, yaml):
    """The llama's declared training FLOPs (PaLM's count, what throughput_monitor and `strobe bench`
    report) against torch.utils.flop_counter over transformers' forward and backward: the packed
    batch against each document on its own (each attends within itself), the padded batch as it is."""
    from torch.utils.flop_counter import FlopCounterMode
    docs, padded, packed = batches()
    hf.config._attn_implementation = "eager"  # attention's two products as matmuls the counter sees
    for name, batch, runs in (("packed", packed, [d.unsqueeze(0) for d in docs]), ("padded", padded, [padded["tokens"]])):
        inp, out = os.path.join(tmp, "flops.in.safetensors"), os.path.join(tmp, "flops.out.safetensors")
        save_file({k: v.contiguous() for k, v in batch.items()}, inp)
        r = subprocess.run([CHECK, yaml, "--logits", inp, out], capture_output=True, text=True)
        if not check(r.returncode == 0, f"{tag} {name}: strobe_model_check failed: {r.stderr.strip()}"):
            return
        declared = load_file(out)["training_flops"].item()
        counted = 0
        for tokens in runs:
            with FlopCounterMode(display=False) as counter:
                hf(tokens, labels=tokens).loss.backward()
            counted += counter.get_total_flops()
        check(abs(declared - counted) < 1e-3 * counted,
              f"{tag} {name}: declared training FLOPs {declared:.6g}, torch.utils.flop_counter {counted:.6g}")
        compared.append(f"{tag} {name} flops {declared:.4g} vs {counted:.4g}")


def compare(tag, hf, tmp, yaml, device="cpu"):
    """Strobe's logits from `yaml` against `hf` on padded and packed batches, per document, both on
    `device`."""
    docs, padded, packed = batches()
    hf = hf.to(device)
    with torch.no_grad():
        want = [hf(d.unsqueeze(0).to(device)).logits[0].cpu() for d in docs]
    got, err = strobe_logits(tmp, yaml, padded, device)
    if not check(got is not None, f"{tag}: strobe_model_check failed: {err}"):
        return
    e = max(rel(got[i, :len(d)], want[i]) for i, d in enumerate(docs))
    check(e < 1e-5, f"{tag} padded: relative error {e:.2e}")
    got, err = strobe_logits(tmp, yaml, packed, device)
    if not check(got is not None, f"{tag} packed: strobe_model_check failed: {err}"):
        return
    at, ep = 0, 0.0
    for i, d in enumerate(docs):
        ep = max(ep, rel(got[at:at + len(d)], want[i]))
        at += len(d)
    check(ep < 1e-5, f"{tag} packed: relative error {ep:.2e}")
    compared.append(f"{tag} {max(e, ep):.1e}")


def main():
    tmp = tempfile.mkdtemp(prefix="strobe-hf-llama-")
    for tied in (True, False):
        tag = "tied" if tied else "untied"
        hf = hf_model(tied, seed=1 if tied else 2)
        d = os.path.join(tmp, f"hf_{tag}")
        hf.save_pretrained(d, safe_serialization=True)
        compare(f"transformers {tag} -> strobe", hf, tmp, model_yaml(tied, d))
        check_flops(f"{tag} llama", hf_model(tied, 3), tmp, model_yaml(tied))
        compare(f"transformers {tag} -> strobe fused", hf, tmp, model_yaml(tied, d, fused=True))

    # Shards; the bare file; a config.json that disagrees.
    hf = hf_model(True, seed=3)
    shards = os.path.join(tmp, "hf_shards")
    hf.save_pretrained(shards, safe_serialization=True, max_shard_size="20KB")
    check(os.path.exists(os.path.join(shards, "model.safetensors.index.json")), "transformers wrote no shard index")
    compare("transformers sharded -> strobe", hf, tmp, model_yaml(True, shards))
    # The index decides: a shard path outside the directory, and a tensor in two shards (another
    # shard's values would load), are refused naming the problem.
    with open(os.path.join(shards, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    first = sorted(weight_map)[0]
    named = weight_map[first]
    other = next(s for s in sorted(set(weight_map.values())) if s != named)

    def refused(tag, edit, want):
        d = os.path.join(tmp, tag)
        shutil.copytree(shards, d)
        edit(d)
        got, err = strobe_logits(tmp, model_yaml(True, d), batches()[1])
        check(got is None and want in err and err.count("\n") == 0, f"{tag}: {err!r}; want {want!r}")

    def shard_path(bad):
        def edit(d):
            index = os.path.join(d, "model.safetensors.index.json")
            with open(index) as f:
                text = json.load(f)
            text["weight_map"][first] = bad
            with open(index, "w") as f:
                json.dump(text, f)
        return edit

    def in_two_shards(d):
        t = load_file(os.path.join(d, other))
        t[first] = load_file(os.path.join(d, named))[first] + 1
        save_file(t, os.path.join(d, other))

    # Hugging Face's names read as Strobe's: the error says which name set the file is in.
    got, err = strobe_logits(tmp, model_yaml(True, os.path.join(tmp, "hf_tied"), names="strobe"), batches()[1])
    check(got is None and "the file's names start with 'model.', as a Hugging Face checkpoint's do: set "
          "model.init_from.names: hf" in err and err.count("\n") == 0, f"names: strobe on a transformers directory: {err!r}")
    refused("shard_up", shard_path("../x.safetensors"), "names '../x.safetensors', which is not a file of")
    refused("shard_abs", shard_path("/tmp/x.safetensors"), "names '/tmp/x.safetensors', which is not a file of")
    refused("shard_twice", in_two_shards, f"'{first}' is in ")
    bare = os.path.join(tmp, "bare")
    os.makedirs(bare)
    single = os.path.join(tmp, "hf_tied", "model.safetensors")
    shutil.copy(single, os.path.join(bare, "model.safetensors"))
    cfg = os.path.join(tmp, "fit.yaml")
    base = ("name: hf_llama\nseed: 0\ntrainer: {max_steps: 4, max_epochs: -1, log_every_n_steps: 1, num_sanity_val_steps: 0, "
            "limit_val_batches: 0, enable_progress_bar: false, device: cpu}\ntask: {name: language_modeling}\n"
            "data: {name: synthetic_tokens, vocab_size: 97, max_seq_len: 32, num_samples: 64, num_val_samples: 0, "
            "batch_size: 8, collate: pack, num_workers: 1}\noptimizer: {name: adamw, lr: 1.0e-3}\nmodel:\n")

    def fit(model_yaml_text, run, head=None):
        with open(cfg, "w") as f:
            f.write((head or base) + "".join("  " + l + "\n" for l in model_yaml_text.splitlines()))
        return subprocess.run([STROBE, "fit", "-c", cfg, "--run-dir", run], capture_output=True, text=True)

    r = fit(model_yaml(True, os.path.join(bare, "model.safetensors")), os.path.join(tmp, "run_bare"))
    check(r.returncode == 0 and "no config.json beside it: checked by names and shapes only" in r.stdout,
          f"the bare file: exit {r.returncode}: {r.stdout}{r.stderr}")
    # The run's model summary counts the tied embedding and head once, as PyTorch's parameters() does.
    check_summary(os.path.join(tmp, "run_bare"), hf_model(True, 1), "tied llama")
    wrong = os.path.join(tmp, "wrong")
    shutil.copytree(os.path.join(tmp, "hf_tied"), wrong)
    with open(os.path.join(wrong, "config.json")) as f:
        text = f.read()
    with open(os.path.join(wrong, "config.json"), "w") as f:
        f.write(text.replace('"hidden_size": 32', '"hidden_size": 64'))
    r = fit(model_yaml(True, wrong), os.path.join(tmp, "run_wrong"))
    check(r.returncode == 2 and "hidden_size: 64 in config.json, model.embed_dim: 32" in r.stderr
          and r.stderr.count("\n") == 1, f"a disagreeing config.json: exit {r.returncode}: {r.stderr}")

    # Train from the checkpoint, export both ways, load the hf export in transformers.
    run = os.path.join(tmp, "run")
    r = fit(model_yaml(False, os.path.join(tmp, "hf_untied")), run)
    if check(r.returncode == 0 and "config.json agrees" in r.stdout, f"fit from the HF checkpoint: {r.stdout}{r.stderr}"):
        check_summary(run, hf_model(False, 2), "untied llama")
        ckpt = os.path.join(run, "checkpoints", "last.ckpt")
        out_hf, out_strobe = os.path.join(tmp, "export_hf"), os.path.join(tmp, "export.safetensors")
        r1 = subprocess.run([STROBE, "export", ckpt, "--names", "hf", "-o", out_hf], capture_output=True, text=True)
        r2 = subprocess.run([STROBE, "export", ckpt, "-o", out_strobe], capture_output=True, text=True)
        if check(r1.returncode == 0 and r2.returncode == 0, f"export: {r1.stderr}{r2.stderr}"):
            loaded = AutoModelForCausalLM.from_pretrained(out_hf, torch_dtype=torch.float32).eval()
            trained = load_file(out_strobe)
            check(not torch.equal(trained["embed_tokens.weight"], hf_model(False, 2).model.embed_tokens.weight.detach()),
                  "the run did not change the weights: the export comparison would prove nothing")
            compare("strobe run -> transformers", loaded, tmp, model_yaml(False, out_strobe, "strobe"))
            check_source_fields(loaded, out_hf, "the export")
            # A resumed run keeps the source config.json in its checkpoints.
            r = subprocess.run([STROBE, "fit", "-c", cfg, "--ckpt", ckpt, "--set", "trainer.max_steps=6"],
                               capture_output=True, text=True)
            out_resumed = os.path.join(tmp, "export_hf_resumed")
            r1 = subprocess.run([STROBE, "export", ckpt, "--names", "hf", "-o", out_resumed], capture_output=True, text=True)
            if check(r.returncode == 0 and r1.returncode == 0, f"resume and export: {r.stderr}{r1.stderr}"):
                check_source_fields(AutoModelForCausalLM.from_pretrained(out_resumed, torch_dtype=torch.float32).eval(),
                                    out_resumed, "the export after a resume")

    train_curve(tmp, fit, base)
    if torch.cuda.is_available():
        on_cuda(tmp, fit, base)
    else:
        print("test_hf_llama: no CUDA device here: the GPU part (fp32 logits and the 200-step curve on CUDA) is left out")

    for f in failures:
        print("FAIL:", f)
    if failures or os.environ.get("STROBE_KEEP_TEST_DIRS"):
        print("files kept in", tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"test_hf_llama: transformers {transformers.__version__}; {'; '.join(compared)}; {len(failures)} failures")
    return 1 if failures else 0


def check_summary(run, hf, what):
    """model_summary.txt's totals are transformers' sum(p.numel()) over the same model's parameters."""
    try:
        with open(os.path.join(run, "model_summary.txt")) as f:
            text = f.read()
    except OSError as e:
        check(False, f"{what}: no model summary: {e}")
        return
    want = sum(p.numel() for p in hf.parameters())
    m = re.search(r"Total params: (\d+)\n", text)
    t = re.search(r"Trainable params: (\d+)\n", text)
    check(m is not None and int(m.group(1)) == want and t is not None and int(t.group(1)) == want,
          f"{what}: model_summary.txt says {m and m.group(1)} total, {t and t.group(1)} trainable; transformers {want}")
    compared.append(f"{what}: summary {want} parameters")


def check_source_fields(loaded, out, what):
    """The source's config.json fields as transformers reads them back, and generate() working."""
    got = {k: getattr(loaded.config, k) for k in SOURCE_FIELDS}
    check(got == SOURCE_FIELDS, f"{what}: config.json {got}, the source had {SOURCE_FIELDS}")
    gen = GenerationConfig.from_pretrained(out)
    check(gen.bos_token_id == 5 and gen.eos_token_id == 6, f"{what}: generation_config.json bos {gen.bos_token_id}, "
          f"eos {gen.eos_token_id}")
    prompt = torch.tensor([[5, 10, 11]])
    with torch.no_grad():
        tokens = loaded.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    check(tuple(tokens.shape) == (1, 7) and torch.equal(tokens[:, :3], prompt), f"{what}: generate gave {tokens}")


def stride_documents(n, seed):
    """Learnable documents over tokens 1..95 (96 ends each): a random start, a stride of 1, 2, 3 or 5,
    one token in ten replaced by a random one; 6 to 19 tokens each."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length, start = int(torch.randint(6, 20, (1,), generator=g)), int(torch.randint(1, 96, (1,), generator=g))
        stride = [1, 2, 3, 5][int(torch.randint(0, 4, (1,), generator=g))]
        toks = [1 + (start - 1 + i * stride) % 95 for i in range(length)]
        noise = torch.rand(length, generator=g) < 0.1
        rand = torch.randint(1, 96, (length,), generator=g)
        docs.append(torch.tensor([int(rand[i]) if noise[i] else t for i, t in enumerate(toks)] + [96]))
    return docs


def on_cuda(tmp, fit, base):
    """The logits and the curve again on the GPU, fp32 with TF32 off on both sides (Strobe keeps
    libtorch's default, full fp32 matmuls: a TF32 matmul would miss these bounds)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for tied in (True, False):
        tag = "tied" if tied else "untied"
        d = os.path.join(tmp, f"hf_{tag}")
        hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        compare(f"transformers {tag} -> strobe on cuda", hf, tmp, model_yaml(tied, d), "cuda")
        compare(f"transformers {tag} -> strobe fused on cuda", hf, tmp, model_yaml(tied, d, fused=True), "cuda")
    train_curve(tmp, fit, base.replace("device: cpu", "device: cuda"), "cuda")


def train_curve(tmp, fit, base, device="cpu"):
    """200 AdamW steps of Strobe from the untied checkpoint beside a PyTorch loop over the transformers
    model on the same packed batches (a token file of learnable documents read in order, 4 a step):
    the first 5 losses equal to 1e-5, all 200 to 1e-3 (fp32 rounding compounds over the steps), and
    both curves fall below 70% of their start. On CUDA Strobe runs the fused LM head as well."""
    import numpy as np
    steps, eot = 200, 96
    docs = stride_documents(4 * steps, seed=9)
    path = os.path.join(tmp, "tokens.bin")
    np.concatenate([d.numpy() for d in docs]).astype(np.uint16).tofile(path)
    run = os.path.join(tmp, "run_curve_" + device)
    data = (f"data: {{name: token_file, path: {path}, dtype: uint16, mode: documents, eot_token: {eot}, vocab_size: 97, "
            "max_seq_len: 32, val_fraction: 0.0, collate: pack, batch_size: 4, shuffle: false, num_workers: 1}\n")
    text = base.replace(base[base.index("data:"):base.index("optimizer:")], data)
    text = text.replace("max_steps: 4", f"max_steps: {steps}").replace("{name: adamw, lr: 1.0e-3}",
                                                                       "{name: adamw, lr: 3.0e-3, weight_decay: 0.1}")
    if device == "cuda":  # the fused head too (at this vocabulary auto would keep the logits path)
        text = text.replace("task: {name: language_modeling}", "task: {name: language_modeling, fused_linear_loss: true}")
    r = fit(model_yaml(False, os.path.join(tmp, "hf_untied"), fused=True), run, text)
    if not check(r.returncode == 0, f"the curve run failed: {r.stderr}"):
        return
    with open(os.path.join(run, "config.yaml")) as f:  # the run trained where it was asked to
        resolved = f.read()
    check(f"device: {device}" in resolved, f"the {device} curve run's config.yaml does not say device: {device}")
    import csv
    with open(os.path.join(run, "metrics.csv")) as f:
        strobe_losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "hf_untied"), torch_dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    torch_losses = []
    for step in range(steps):
        batch = [d.to(device) for d in docs[4 * step:4 * step + 4]]
        total = sum(len(d) - 1 for d in batch)
        loss = sum(torch.nn.functional.cross_entropy(hf(d[:-1].unsqueeze(0)).logits[0], d[1:], reduction="sum")
                   for d in batch) / total
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    if not check(len(strobe_losses) == steps, f"strobe logged {len(strobe_losses)} losses, not {steps}"):
        return
    diffs = [abs(a - b) / abs(b) for a, b in zip(strobe_losses, torch_losses)]
    check(max(diffs[:5]) < 1e-5, f"{device}: the first 5 losses differ (worst relative {max(diffs[:5]):.1e})")
    check(max(diffs) < 1e-3, f"{device}: the 200-step curves part (worst relative {max(diffs):.1e} at step {diffs.index(max(diffs)) + 1})")
    def mean(v):
        return sum(v) / len(v)
    start, end_strobe, end_torch = mean(torch_losses[:10]), mean(strobe_losses[-10:]), mean(torch_losses[-10:])
    check(end_strobe < 0.7 * mean(strobe_losses[:10]) and end_torch < 0.7 * start,
          f"the loss did not fall: strobe {mean(strobe_losses[:10]):.3f} -> {end_strobe:.3f}, torch {start:.3f} -> {end_torch:.3f}")
    compared.append(f"{device}: {steps} AdamW steps vs a PyTorch loop: loss {start:.3f} -> {end_torch:.3f} (torch), "
                    f"{end_strobe:.3f} (strobe), first 5 within {max(diffs[:5]):.1e}, all within {max(diffs):.1e}")


if __name__ == "__main__":
    sys.exit(main())
