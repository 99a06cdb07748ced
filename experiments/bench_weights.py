"""The weight matmuls alone at the released shapes: routed experts (packed FP4) and FP8 projections.

    python -m experiments.bench_weights                      # batch 1 / 8 / 64, the chosen tiles
    python -m experiments.bench_weights --sweep              # also tile / warp / stage / decode variants
    python -m experiments.bench_weights --batch 64 --out w.json
    python -m experiments.bench_weights --batch 1 --fp8-only --sweep   # every FP8 projection, K splits too

Each row is one op at one batch under one variant: GPU time per call of the kernel itself (from a
`jax.profiler` trace of a jitted loop of `--reps` calls) and wall time per call of the whole loop body
(the kernel plus its small index computations), the bytes the call must move (the stored bytes of the
experts it was routed to, activations in and out), and that over the copy bandwidth measured in the
same run. Every call of the loop routes its tokens to fresh random experts (the experts of one v41
layer, 2.4 GB per matrix, are far larger than the 60 MB L2), so the bytes come from HBM. Ops:
`w13` (w1 and w3 in one launch: [E, 2304, 5120] each), `w2` ([E, 5120, 2304]), and the FP8 projections of
a layer as the model launches them (`FP8_OPS`: wq_a and wkv in one launch, wq_b, wo_b, the shared
expert's w1 + w3 and w2, the indexer's wq_b). For FP8 ops "GPU us (all)" also counts the small kernels
of the call (the sum over K splits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

import dsv41_jax as d
from experiments import _cli
from experiments.bench_decode import kernel_profile
from experiments.bench_kernels import hbm_copy_bandwidth, random_bytes
from kernels_pallas import gpu_grouped

SWEEP = [  # (label, kernel keywords): tiles are (tm, tk, tn)
    ("f32 decode", dict(fast_decode=False)),
    ("tn32", dict(tiles=(16, 256, 32))),
    ("tn128", dict(tiles=(16, 256, 128))),
    ("tk512", dict(tiles=(16, 512, 64))),
    ("tk512 tn128", dict(tiles=(16, 512, 128))),
    ("stages2", dict(num_stages=2)),
    ("stages4", dict(num_stages=4)),
    ("warps8 tn128", dict(tiles=(16, 256, 128), num_warps=8)),
    ("warps2 tn32", dict(tiles=(16, 256, 32), num_warps=2)),
    ("splits2", dict(splits=2)),
    ("splits4", dict(splits=4)),
]
FP8_SWEEP = [("f32 decode", dict(fast_decode=False)), ("tn32", dict(tiles=(16, 128, 32))),
             ("tn128", dict(tiles=(16, 128, 128))), ("tk256", dict(tiles=(16, 256, 64))),
             ("warps2", dict(num_warps=2)), ("warps8", dict(num_warps=8)), ("stages2", dict(num_stages=2)),
             ("stages4", dict(num_stages=4))] + [(f"splits{s}", dict(splits=s)) for s in (1, 2, 4, 8, 16)]


def fp8_ops(cfg) -> list[tuple[str, list[int], int]]:
    """(name, output widths launched together, K) of each FP8 projection launch of a v41 layer."""
    return [("wq_a+wkv", [cfg.q_lora_rank, cfg.head_dim], cfg.dim),
            ("wq_b", [cfg.n_heads * cfg.head_dim], cfg.q_lora_rank),
            ("wo_b", [cfg.dim], cfg.o_groups * cfg.o_lora_rank),
            ("shared w1+w3", [cfg.moe_inter_dim] * 2, cfg.dim),
            ("shared w2", [cfg.dim], cfg.moe_inter_dim),
            ("index wq_b", [cfg.index_n_heads * cfg.index_head_dim], cfg.q_lora_rank)]


def expert_data(key, e: int, n: int, k: int):
    """Random packed FP4 experts uint8 [E, N, K/2] with E8M0 scales near 2**-8 (real layers' range)."""
    values = random_bytes(key, (e, n, k // 2))
    scales = jax.random.randint(jax.random.fold_in(key, 1), (e, n, k // 32), 118, 124).astype(jnp.uint8)
    return values, scales


def routed_sizes(key, reps: int, tokens: int, e: int, top_k: int) -> jax.Array:
    """int32 [reps, E]: rows per expert of `tokens` tokens routed to top_k distinct random experts."""
    scores = jax.random.uniform(key, (reps, tokens, e))
    ids = jax.lax.top_k(scores, top_k)[1]
    return jax.vmap(lambda i: jnp.bincount(i.reshape(-1), length=e))(ids).astype(jnp.int32)


def time_loop(call, sizes_re, x, weights, reps: int, kernel_prefix: str, profile_dir: str):
    """(GPU us per kernel call, wall us per loop iteration) of `call(x, weights, sizes)` over the reps."""

    @jax.jit
    def loop(x, weights, sizes_re):
        def body(acc, sizes):
            ys = call(x, weights, sizes)
            return acc + sum(y[0, 0] for y in ys), None
        return jax.lax.scan(body, jnp.float32(0), sizes_re)[0]

    jax.block_until_ready(loop(x, weights, sizes_re))
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(loop(x, weights, sizes_re))
        walls.append((time.perf_counter() - t) / reps)
    prof = kernel_profile(lambda: jax.block_until_ready(loop(x, weights, sizes_re)), profile_dir, reps, top=50)
    gpu = sum(r["us_per_step"] for r in prof[1:] if r["name"].startswith(kernel_prefix))
    return gpu, 1e6 * statistics.median(walls)


def splits_fit(kw: dict, m: int, k: int, n: int, groups: int) -> bool:
    """False for a sweep entry whose K split does not divide the K chunks of its tiles (explicit, or
    `choose_tiles`'), which the kernel refuses (w2: 2304 / 256 = 9 chunks)."""
    tk = (kw.get("tiles") or gpu_grouped.choose_tiles(m, k, n, groups))[1]
    return (k // tk) % kw.get("splits", 1) == 0


def fp8_rows(cfg, batches, reps: int, sweep: list, peak: float, tmp: str) -> list[dict]:
    """Rows of the FP8 projections (`fp8_ops`), a different random weight per call (reps x the weight: HBM)."""
    key, rows = jax.random.key(7), []
    for op, ns, k in fp8_ops(cfg):
        ws = [[(random_bytes(jax.random.fold_in(key, 100 * r + i), (n, k)) & 0xFE,  # no NaN codes
                jax.random.randint(key, (n // 32, k // 32), 114, 118).astype(jnp.uint8)) for i, n in enumerate(ns)]
              for r in range(reps)]
        for b in batches:
            x = jax.random.normal(jax.random.fold_in(key, b), (b, k), jnp.bfloat16)
            moved = sum(n * k + (n // 32) * (k // 32) for n in ns) + b * k * 2 + b * sum(ns) * 4
            for label, kw in [("chosen", {})] + sweep:
                if not splits_fit(kw, b, k, min(ns), 1):
                    continue

                @jax.jit
                def loop(x, ws, kw=kw):
                    return sum(y[0, 0] for w in ws for y in gpu_grouped.fp8_matmuls(x, w, **kw))
                jax.block_until_ready(loop(x, ws))
                prof = kernel_profile(lambda: jax.block_until_ready(loop(x, ws)), f"{tmp}/{op}{b}{label}", reps, top=50)
                gpu = sum(r["us_per_step"] for r in prof[2:] if r["name"].startswith("grouped_matmul_fp8"))
                rows.append(dict(op=op, batch=b, variant=label, gpu_us=gpu, gpu_all_us=prof[0]["us_per_step"],
                                 wall_us=float("nan"), bytes=moved, experts_hit=0, frac_peak=moved / (gpu * 1e-6) / peak))
                r = rows[-1]
                print(f"  {op:12s} b{b:<3d} {label:10s} {gpu:7.1f} us kernel {r['gpu_all_us']:7.1f} us all "
                      f"{moved / 1e6:7.1f} MB {100 * r['frac_peak']:5.1f}% of peak", flush=True)
    return rows


def run(batches, reps: int, sweep: bool, peak: float, fp8_only: bool = False, only=None,
        experts_only: bool = False) -> list[dict]:
    cfg = d.preset("v41-flash")
    pick = lambda variants: [v for v in variants if only is None or v[0] in only] if sweep else []
    rows = [] if fp8_only else expert_rows(cfg, batches, reps, pick(SWEEP), peak)
    if experts_only:
        return rows
    with tempfile.TemporaryDirectory() as tmp:
        return rows + fp8_rows(cfg, batches, reps, pick(FP8_SWEEP), peak, tmp)


def expert_rows(cfg, batches, reps: int, sweep: list, peak: float) -> list[dict]:
    """Rows of the routed experts' w1 + w3 and w2 (fresh random experts per call)."""
    e, top_k, dim, inter = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    key = jax.random.key(0)
    w1, w3 = expert_data(jax.random.fold_in(key, 1), e, inter, dim), expert_data(jax.random.fold_in(key, 3), e, inter, dim)
    w2 = expert_data(jax.random.fold_in(key, 2), e, dim, inter)
    per_expert = lambda n, k: n * (k // 2 + k // 32)
    rows = []
    variants = [("chosen", {})] + sweep
    with tempfile.TemporaryDirectory() as tmp:
        for b in batches:
            m = b * top_k
            sizes = routed_sizes(jax.random.fold_in(key, b), reps, b, e, top_k)
            hit = float(jnp.mean(jnp.sum(sizes > 0, axis=1)))
            x_d = jax.random.normal(key, (m, dim), jnp.bfloat16)
            x_i = jax.random.normal(key, (m, inter), jnp.bfloat16)
            ops = [
                ("w13", x_d, [w1, w3], 2 * hit * per_expert(inter, dim) + m * dim * 2 + 2 * m * inter * 4,
                 lambda kw: (lambda x, ws, s: gpu_grouped.grouped_matmuls_fp4(x, ws, s, **kw))),
                ("w2", x_i, [w2], hit * per_expert(dim, inter) + m * inter * 2 + m * dim * 4,
                 lambda kw: (lambda x, ws, s: gpu_grouped.grouped_matmuls_fp4(x, ws, s, **kw))),
            ]
            for op, x, ws, moved, make in ops:
                for label, kw in variants:
                    if not splits_fit(kw, m, x.shape[1], ws[0][0].shape[1], e):
                        continue
                    gpu, wall = time_loop(make(kw), sizes, x, ws, reps, "grouped_matmul_fp4", f"{tmp}/{op}{b}{label}")
                    rows.append(dict(op=op, batch=b, variant=label, gpu_us=gpu, wall_us=wall, bytes=moved,
                                     experts_hit=hit, frac_peak=moved / (gpu * 1e-6) / peak))
            for r in (r for r in rows if r["batch"] == b):
                print(f"  {r['op']:9s} b{r['batch']:<3d} {r['variant']:13s} {r['gpu_us']:9.1f} us GPU "
                      f"{r['wall_us']:9.1f} us wall {r['bytes'] / 1e6:8.1f} MB {100 * r['frac_peak']:5.1f}% of peak",
                      flush=True)
    return rows


@_cli.entry_point
def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=16, help="calls per timed loop, each routed to fresh experts")
    p.add_argument("--sweep", action="store_true", help="also time the tile / decode variants")
    p.add_argument("--fp8-only", action="store_true", help="only the FP8 projections")
    p.add_argument("--experts-only", action="store_true", help="only the routed experts")
    p.add_argument("--variants", nargs="+", default=None, metavar="LABEL",
                   help="with --sweep: only these variants (labels of SWEEP / FP8_SWEEP)")
    p.add_argument("--copy-gb", type=float, default=1.0,
                   help="GiB of the copy whose rate is the peak (timed as the kernels are: GPU time in a trace)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise _cli.UserError(f"bench_weights times the GPU kernels and this backend is {jax.default_backend()}: "
                             "run it on a GPU machine")
    peak = hbm_copy_bandwidth(args.copy_gb)
    print(f"copy bandwidth (read+write, this run): {peak / 1e9:.0f} GB/s", flush=True)
    rows = run(args.batch, args.reps, args.sweep, peak, args.fp8_only, args.variants, args.experts_only)
    print("\n| op | batch | variant | GPU us (kernel) | GPU us (all) | wall us/call | MB | % of copy peak |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['batch']} | {r['variant']} | {r['gpu_us']:.1f} | {r.get('gpu_all_us', float('nan')):.1f} | "
              f"{r['wall_us']:.1f} | {r['bytes'] / 1e6:.1f} | {100 * r['frac_peak']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(peak_bw=peak, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
