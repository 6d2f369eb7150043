# Generates the Wgmma<T, N> wrappers at the end of strobe/ops/cuda/flash_sm90.cuh (asm operand
# lists must be literal): python3 scripts/gen_flash_sm90_wgmma.py, then paste over the old ones.
def acc_list(n):
    return ", ".join(f"%{i}" for i in range(n // 2))
def acc_ops(n):
    return ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(n // 2))
out = []
for ty, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
    for n in (32, 64, 128):
        na = n // 2
        out.append(f"""template <>
struct Wgmma<{ty}, {n}> {{
  // D[64 x {n}] += A (shared, K-major) * B (shared, K-major).
  static __device__ __forceinline__ void ss(float (&d)[{n // 8}][4], uint64_t a, uint64_t b) {{
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} {{{acc_list(n)}}}, %{na}, %{na + 1}, 1, 1, 1, 0, 0;\\n"
        : {acc_ops(n)}
        : "l"(a), "l"(b));
  }}
  // D[64 x {n}] += A (registers) * B (shared, N-major: stored [k][n]).
  static __device__ __forceinline__ void rs_t(float (&d)[{n // 8}][4], const uint32_t (&a)[4], uint64_t b) {{
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} {{{acc_list(n)}}}, {{%{na}, %{na + 1}, %{na + 2}, %{na + 3}}}, %{na + 4}, 1, 1, 1, 1;\\n"
        : {acc_ops(n)}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }}
}};
""")
print("\n".join(out))
