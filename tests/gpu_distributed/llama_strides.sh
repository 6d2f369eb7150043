# The llama task of the two-GPU check scripts (torchrun_fit_check.sh llama, two_node_check.sh), sourced
# by them: a llama (GQA 4 heads over 2, tied embeddings, math attention) on full-length windows of a
# learnable token file (documents counting up by a stride, one token in ten random), so the
# validation loss tells weights apart; every window is full length, as the union-batch equivalence
# needs (each rank's mean is over the same number of tokens).

# write_llama_strides DIR: writes DIR/strides.bin (~2070 training windows of 65 tokens: an epoch is 8
# steps of 2 x 2 x 64).
write_llama_strides() {
  python3 - "$1/strides.bin" <<'PY'
import random, struct, sys
random.seed(7)
toks = []
while len(toks) < 150000:
    s, k, n = random.randint(1, 255), random.choice([1, 2, 3, 5]), random.randint(30, 200)
    toks += [random.randint(1, 255) if random.random() < 0.1 else 1 + (s - 1 + i * k) % 255 for i in range(n)] + [0]
open(sys.argv[1], "wb").write(struct.pack(f"<{len(toks)}H", *toks))
PY
}

# llama_strides_yaml DIR: the model and data sections over DIR/strides.bin.
llama_strides_yaml() {
  cat <<YAML
model: {name: llama, vocab_size: 256, embed_dim: 128, depth: 2, num_heads: 4, num_kv_heads: 2, ffn_dim: 256,
        max_seq_len: 64, rope_theta: 500000, tie_embeddings: true, attention: math}
data: {name: token_file, path: $1/strides.bin, dtype: uint16, mode: windows, vocab_size: 256, max_seq_len: 64,
       val_fraction: 0.1, collate: pad_to_max, batch_size: 64, num_workers: 2}
YAML
}
