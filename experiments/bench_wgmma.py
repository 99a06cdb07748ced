"""The Hopper FP4 expert kernel (`kernels_pallas.gpu_wgmma`) against the Triton kernel, at the v41 shapes.

    python -m experiments.bench_wgmma              # H100/H200: checks, then the variant sweep and its table
    python -m experiments.bench_wgmma --reps 128
    python -m experiments.bench_wgmma --fp8-only
    python -m experiments.bench_wgmma --sweep --tokens 1 --fp8-rows 1   # every K split, pipeline depths 3 / 6

For w1-like ([E, 2304, 5120]) and w2-like ([E, 5120, 2304]) experts: first each variant's values against
the jnp twin (`grouped.rows_matmul`; x of one row, one row per assignment, one per 8 tokens' 6 assignments;
a -1 row), then the GPU time per call (a `jax.profiler` trace of a jitted loop of `--reps` calls, each on a
fresh random expert set: reps x 35 MB, far past the 60 MB L2) for one token's 6 rows and 8 tokens' 48, and
that as a fraction of the copy bandwidth measured in the same run (at 48 rows an expert that two tokens
share counts twice; its second read may come from the L2). Variants: pipeline depth, K split over CTAs, and
(diagnostic, wrong numbers by design) the kernel with its decode replaced by moves: what the decode costs. Then the FP8 projections of a layer
(`fp8_matmuls_wgmma` against the Triton `fp8_matmuls`), checked and timed. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax import grouped
from experiments.bench_decode import kernel_profile
from experiments.bench_kernels import hbm_copy_bandwidth, max_rel_err
from experiments.bench_weights import expert_data
from kernels_pallas import gpu_grouped, gpu_wgmma

SHAPES = {"w1-like": (2304, 5120), "w2-like": (5120, 2304)}  # (N, K) of the v41 routed experts
E, TOP_K = 384, 6
NO_DECODE = "{ mov.b32 $0, $4; mov.b32 $1, $5; mov.b32 $2, $4; mov.b32 $3, $5; }"  # words as weights


def variants(k: int, sweep: bool = False) -> dict[str, dict]:
    """The FP4 kernel's labelled arguments to time at K: pipeline depths, K splits (`sweep`: every divisor of
    the K steps up to 10, and 6 stages), the decode-less diagnostic."""
    steps = k // gpu_wgmma.TK
    splits = [s for s in (range(2, 11) if sweep else (2, 3, 4, 5)) if steps % s == 0]
    out = {"st4": {}, "st3": {"stages": 3}, "st2": {"stages": 2}, **({"st6": {"stages": 6}} if sweep else {})}
    out.update({f"split{s}": {"splits": s} for s in splits})
    out.update({"NO-DECODE": {"decode_ptx": NO_DECODE}, f"NO-DECODE split{splits[-1]}": {"decode_ptx": NO_DECODE,
                                                                                         "splits": splits[-1]}})
    return out


def check(name, label, kw, values, scales, key) -> bool:
    ok = True
    for rows, m in ((1, TOP_K), (TOP_K, TOP_K), (8, 8 * TOP_K)):
        x = jax.random.normal(jax.random.fold_in(key, rows), (rows, values.shape[2] * 2), jnp.bfloat16)
        ids = jax.random.randint(jax.random.fold_in(key, m), (m,), 0, E).at[TOP_K - 1].set(-1)
        try:
            (got,) = gpu_wgmma.rows_matmuls_fp4_wgmma(x, [(values, scales)], ids, **kw)
            want = grouped.rows_matmul(x, {"values": values, "scales": scales}, ids)
            err = max_rel_err(got, want)
            good = err <= 1e-5
            print(f"{name} {label} x[{rows}] {m} rows: max|diff| / max|ref| = {err:.2e} {'ok' if good else 'FAILED'}",
                  flush=True)
        except Exception as ex:  # noqa: BLE001 -- report and go on to the next case
            good = False
            print(f"{name} {label} x[{rows}]: FAILED {type(ex).__name__}: {str(ex)[:1500]}")
        ok &= good
    return ok


def time_loop(call, x, values, scales, ids_r, prefix):
    """(GPU us per call of the kernels named prefix*, of all kernels, wall us per call): a jitted scan over
    ids_r's rows (one expert set per call), wall time median of 5; GPU time from a profiler trace."""

    @jax.jit
    def loop(x, values, scales, ids_r):
        body = lambda acc, ids: (acc + call(x, values, scales, ids)[0, 0], None)  # noqa: E731
        return lax.scan(body, jnp.float32(0), ids_r)[0]

    reps = ids_r.shape[0]
    jax.block_until_ready(loop(x, values, scales, ids_r))  # compile + warm-up
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x, values, scales, ids_r))
        walls.append((time.perf_counter() - t0) / reps)
    with tempfile.TemporaryDirectory() as tmp:
        prof = kernel_profile(lambda: jax.block_until_ready(loop(x, values, scales, ids_r)), tmp, reps, top=20)
    mine = [r for r in prof[2:] if r["name"].startswith(prefix)]
    if not mine:
        raise RuntimeError(f"no kernel named {prefix}* in {[r['name'][:60] for r in prof[2:]]}")
    return sum(r["us_per_step"] for r in mine), prof[0]["us_per_step"], 1e6 * statistics.median(walls)


def fp8_variants(k: int, tiles: int) -> dict[str, dict]:
    """The FP8 kernel's labelled arguments for `--sweep`: every K split up to MAX_SPLITS other than the default's
    (the CTAs per SM and the last wave's size change with it), and 3 / 6 pipeline stages."""
    steps, default = k // gpu_wgmma.TK, gpu_wgmma.fp8_splits(k, tiles)
    out = {f"split{s} ({s * tiles} CTAs)": {"splits": s} for s in range(1, gpu_wgmma.MAX_SPLITS + 1)
           if steps % s == 0 and s != default}
    return {**out, "st3": {"stages": 3}, "st6": {"stages": 6}}


def fp8_section(key, peak: float, reps: int, variants=None, rows=(1, 8)) -> tuple[list[tuple[str, ...]], int]:
    """The FP8 projections of a v41 layer (`bench_weights.fp8_ops`) at `rows` rows of x: each launch checked
    against `grouped.fp8_matmul`, then timed (GPU time of all kernels per call, `reps` weight copies called
    in turn so that they come from HBM) against the Triton kernel. variants: fn(K, output tiles) -> more
    labelled wgmma kernel arguments to time (e.g. `fp8_variants`). Rows of the table, failed checks."""
    import dsv41_jax as d
    from experiments.bench_kernels import random_bytes
    from experiments.bench_weights import fp8_ops

    rows_out, failed = [], 0
    for op, ns, k in fp8_ops(d.preset("v41-flash")):
        copies = [[(random_bytes(jax.random.fold_in(key, 100 * r + i), (n, k)) & 0xFE,  # no NaN codes
                    jax.random.randint(jax.random.fold_in(key, r), (n // 32, k // 32), 114, 118).astype(jnp.uint8))
                   for i, n in enumerate(ns)] for r in range(reps)]
        for m in rows:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            if gpu_wgmma.fp8_scale_box(x.shape[1]) is None:
                rows_out.append((op, str(m), "wgmma: not supported (K)", "-", "-", "-"))
                continue
            got = gpu_wgmma.fp8_matmuls_wgmma(x, copies[0])
            for y, (q, e) in zip(got, copies[0]):
                want = grouped.fp8_matmul(x, jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn), e)
                err = max_rel_err(y, want)
                ok = err <= 1e-5
                failed += not ok
                print(f"FP8 {op} x[{m}]: max|diff| / max|ref| = {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
            moved = sum(n * k + (n // 32) * (k // 32) for n in ns)
            tiles = sum(n // gpu_wgmma.TN for n in ns)
            fns = {f"wgmma (split{gpu_wgmma.fp8_splits(k, tiles)})": gpu_wgmma.fp8_matmuls_wgmma,
                   "triton": gpu_grouped.fp8_matmuls}
            fns.update({label: functools.partial(gpu_wgmma.fp8_matmuls_wgmma, **kw)
                        for label, kw in (variants(k, tiles) if variants else {}).items()})
            for label, fn in fns.items():
                run = jax.jit(lambda x, cs, fn=fn: [fn(x, c) for c in cs])
                jax.block_until_ready(run(x, copies))
                with tempfile.TemporaryDirectory() as tmp:
                    total = kernel_profile(lambda: jax.block_until_ready(run(x, copies)), tmp, reps)[0]["us_per_step"]
                gbs = moved / (total * 1e-6) / 1e9
                rows_out.append((op, str(m), label, f"{total:.1f}", f"{gbs:.0f}", f"{100 * gbs * 1e9 / peak:.1f}%"))
                print(f"  FP8 {op} x[{m}] {label}: {total:.1f} us", flush=True)
    return rows_out, failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=64, help="calls per timed loop (one expert set each)")
    parser.add_argument("--fp8-only", action="store_true", help="only the FP8 projections")
    parser.add_argument("--sweep", action="store_true", help="every K split and 3 / 6 pipeline stages of both kernels")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="tokens of the experts' timings")
    parser.add_argument("--fp8-rows", type=int, nargs="+", default=[1, 8], help="rows of x of the FP8 timings")
    args = parser.parse_args(argv)
    if not gpu_wgmma.is_hopper():
        raise SystemExit(f"the wgmma kernel needs an H100/H200 (sm_90); this is {jax.devices()[0]}")
    peak = hbm_copy_bandwidth(1.0)
    print(f"{jax.devices()[0].device_kind}: device copy {peak / 1e9:.0f} GB/s", flush=True)
    key, failed, table = jax.random.key(0), 0, []
    for name, (n, k) in ({} if args.fp8_only else SHAPES).items():
        values, scales = expert_data(jax.random.fold_in(key, n), E, n, k)  # scale bytes 118..123
        vs = variants(k, args.sweep)
        for label, kw in vs.items():
            if "NO-DECODE" not in label:
                failed += not check(name, label, kw, values, scales, key)
        for tokens in args.tokens:
            rows = tokens * TOP_K
            ids_r = lax.top_k(jax.random.uniform(jax.random.fold_in(key, rows), (args.reps, tokens, E)),
                              TOP_K)[1].astype(jnp.int32).reshape(args.reps, rows)
            x = jax.random.normal(key, (tokens, k), jnp.bfloat16)
            moved = rows * n * (k // 2 + k // 32)  # an expert two tokens share counted twice (read twice)
            calls = {f"wgmma {lb}": (functools.partial(gpu_wgmma.rows_matmuls_fp4_wgmma, **kw), "fp4_rows_wgmma")
                     for lb, kw in vs.items()}
            xt = (lambda x: x) if tokens == 1 else (lambda x: jnp.repeat(x, TOP_K, axis=0))
            calls["triton rows"] = (lambda x, ws, i, xt=xt: gpu_grouped.rows_matmuls_fp4(xt(x), ws, i),
                                    "grouped_matmul_fp4")
            for label, (call, prefix) in calls.items():
                one = lambda x, v, s, i, call=call: call(x, [(v, s)], i)[0]  # noqa: E731
                try:
                    kern, total, wall = time_loop(one, x, values, scales, ids_r, prefix)
                except Exception as ex:  # noqa: BLE001
                    print(f"  {name} {rows} rows {label}: timing FAILED {type(ex).__name__}: {str(ex)[:1500]}")
                    continue
                table.append((name, rows, label, kern, total, wall, moved / (kern * 1e-6) / 1e9))
                print(f"  {name} {rows} rows {label}: {kern:.1f} us kernel, {total:.1f} us all kernels, "
                      f"{wall:.1f} us wall per call", flush=True)
        del values, scales
    fp8_table, failed_fp8 = fp8_section(key, peak, reps=16, variants=fp8_variants if args.sweep else None,
                                        rows=args.fp8_rows)
    failed += failed_fp8
    print("\n| FP8 op | rows | kernel | GPU us (all kernels) | GB/s | % of copy |\n|---|---|---|---|---|---|")
    for row in fp8_table:
        print("| " + " | ".join(row) + " |")
    print("\n| shape | rows | kernel | kernel us | all kernels us | wall us | GB/s | % of copy |\n|---|---|---|---|---|---|---|---|")
    for name, rows, label, kern, total, wall, gbs in table:
        print(f"| {name} | {rows} | {label} | {kern:.1f} | {total:.1f} | {wall:.1f} | {gbs:.0f} | "
              f"{100 * gbs * 1e9 / peak:.1f}% |")
    print("GB/s: the routed rows' values + scales bytes / GPU time of the kernel; 'all kernels' adds a K split's "
          "sum and the timing loop's own add (~1 us); NO-DECODE rows compute wrong numbers by design (the kernel "
          "without its decode)")
    print("ALL CHECKS OK" if not failed else f"{failed} CHECKS FAILED")
    return int(failed > 0)


if __name__ == "__main__":
    raise SystemExit(main())
