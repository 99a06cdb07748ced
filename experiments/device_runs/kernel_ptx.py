"""What the weight kernels compile to on this GPU: the PTX of each Pallas (Triton) kernel of the FP4 expert
and FP8 projection matmuls at the slice's batch-1 / batch-8 shapes, and its instruction mix per K step.

    PYTHONPATH=. python3 -m experiments.device_runs.kernel_ptx        # ~1 min; PTX under $OUT/ptx/

Why: the weight kernels reach 48-70% of the copy peak (bench_weights); whether the decoded tile goes
through shared memory before the tensor cores (st.shared / ldmatrix per weight), which MMA the dot became
(mma.sync or wgmma) and how many ALU instructions the decode costs is read here, not guessed.
"""

import collections
import os
import re
import shutil

OUT = os.environ.get("OUT") or "/tmp/kernel_ptx"
DUMP = os.path.join(OUT, "ptx")
shutil.rmtree(DUMP, ignore_errors=True)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}/xla --xla_dump_hlo_pass_re=^$"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dsv41_jax as d  # noqa: E402
from kernels_pallas import gpu_grouped  # noqa: E402

CLASSES = {  # instruction class -> opcode prefixes
    "wgmma": ("wgmma",), "mma.sync": ("mma.sync",), "ldmatrix": ("ldmatrix",), "st.shared": ("st.shared",),
    "ld.shared": ("ld.shared",), "cp.async": ("cp.async",), "ld.global": ("ld.global",), "prmt": ("prmt",),
    "lop/shift": ("and.", "or.", "xor.", "shl.", "shr.", "lop3."), "fma/mul bf16x2": ("fma.rn.bf16x2", "mul.rn.bf16x2"),
    "cvt": ("cvt.",), "bar/fence": ("bar.", "fence.", "mbarrier."), "shfl": ("shfl.",),
}


def instruction_mix(ptx: str) -> collections.Counter:
    c = collections.Counter()
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        if not op or op.startswith(("//", ".", "{", "}", "$", "@")) or op.endswith(":"):
            if op.startswith("@"):  # predicated: the opcode follows
                op = line.strip().split(None, 2)[1] if len(line.split()) > 1 else ""
            else:
                continue
        c["all"] += 1
        for name, prefixes in CLASSES.items():
            if op.startswith(prefixes):
                c[name] += 1
    return c


def main():
    cfg = d.preset("v41-flash")
    dim, inter, e = cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts
    key = jax.random.key(0)
    u8 = lambda shape: jax.random.randint(key, shape, 0, 255).astype(jnp.uint8)  # noqa: E731
    w13 = [(u8((e, inter, dim // 2)), u8((e, inter, dim // 32)) % 8 + 118) for _ in range(2)]
    x1 = jax.random.normal(key, (1, dim), jnp.bfloat16)
    ids = jnp.arange(6, dtype=jnp.int32)
    jax.block_until_ready(gpu_grouped.rows_matmuls_fp4(x1, w13, ids))  # batch 1: a token's 6 experts as rows
    jax.block_until_ready(gpu_grouped.rows_matmuls_fp4(x1, w13, ids, fast_decode="int", swap_ab=True))
    x8 = jax.random.normal(key, (48, dim), jnp.bfloat16)
    sizes = jnp.zeros(e, jnp.int32).at[:48].set(1)
    jax.block_until_ready(gpu_grouped.grouped_matmuls_fp4(x8, w13, sizes))  # batch 8: 48 experts, one row each
    q = u8((cfg.n_heads * cfg.head_dim, cfg.q_lora_rank)) & 0xFE
    s = u8((q.shape[0] // 32, q.shape[1] // 32)) % 4 + 114
    jax.block_until_ready(gpu_grouped.fp8_matmul(jax.random.normal(key, (1, q.shape[1]), jnp.bfloat16), q, s))
    seen = 0
    flat = os.path.join(OUT, "ptx_flat")
    os.makedirs(flat, exist_ok=True)
    for root, _, files in os.walk(f"{DUMP}/xla"):
        for f in files:
            path = os.path.join(root, f)
            text = open(path, errors="replace").read()
            rel = os.path.relpath(path, f"{DUMP}/xla")
            if "grouped_matmul" not in text and not (rel.endswith(".ptx") and "matmul" in rel):
                continue
            print(f"{rel}: {len(text)} chars, .entry {text.count('.entry')}, wgmma {text.count('wgmma')}, "
                  f"mma.sync {text.count('mma.sync')}", flush=True)
            if ".entry" in text or "tt.func" in text or "ttg." in text:
                seen += 1
                open(os.path.join(flat, re.sub(r"[^\w.]", "_", rel)[-120:]), "w").write(text)
                for m in re.finditer(r"\.entry\s+(\w+)", text):
                    body = text[m.start():text.find("\n}\n", m.start()) + 3]
                    mix = instruction_mix(body)
                    print(f"  {m.group(1)}: " + ", ".join(f"{k} {v}" for k, v in mix.most_common()), flush=True)
    if not seen:
        print("no PTX / Triton IR with a grouped_matmul kernel; dump tree:")
        for root, _, files in os.walk(f"{DUMP}/xla"):
            print(" ", os.path.relpath(root, DUMP), len(files), "files", sorted(files)[:6])

if __name__ == "__main__":
    main()
