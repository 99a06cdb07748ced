"""Issue 21 on one H200: the Hopper indexer scan (`kernels_pallas.gpu_indexer_wgmma`), its GPU tests, then
timed from HBM (L2 flushed before every call, `bench_kernels.time_hbm`) against the Triton scan's variants
at 128K and 1M positions x batch 8, with the copy bandwidth of the same run. Table last; logs under $OUT. The
variants (VARIANTS): q as bf16 hi + lo or q alone (the model's FP4-grid queries, which `index_data` draws, are
exact in bf16), CTAs wanted (264 = 2 per SM of an H200), 64-position tiles per pipeline step, pipeline stages.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_wgmma_scan      (~2.5 min)
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from experiments.bench_kernels import copy_bandwidth, index_data, nbytes, time_hbm
from kernels_pallas import gpu_indexer, gpu_indexer_wgmma

OUT = os.environ.get("OUT") or "/tmp/i21w_out"
# (q parts, CTAs wanted, tiles per step, stages); the seventeenth session's default first. Eighteenth session
# (1M x 8): q x1 / 528 CTAs / 2 tiles / 2 stages 50.2% of the copy, 1056 CTAs / 4 tiles 54.5%, against 37.8%
# for the first; then the epilogue's fma (fewer instructions per tile: the kernel is issue-bound).
VARIANTS = [(2, 264, 1, 6), (1, 1056, 4, 2), (1, 1056, 2, 2), (1, 528, 4, 2), (1, 1056, 4, 3)]


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_indexer_wgmma.py"], capture_output=True, text=True, timeout=150,
                           env={**os.environ, "JAX_PLATFORMS": "cuda"})
    open(os.path.join(OUT, "tests.log"), "w").write(tests.stdout + tests.stderr)
    print("\n".join((tests.stdout + tests.stderr).strip().splitlines()[-12:]), flush=True)
    peak = copy_bandwidth(1.0)
    rows = []
    for ctx, b in ((131072, 8), (1048576, 8)):
        q, w, rec = index_data(jax.random.key(ctx), b, ctx)
        reach = jnp.full((b,), ctx - 5, jnp.int32)
        args = (q, w, rec["values"], rec["scales"], reach)
        moved = nbytes(rec) + b * ctx * 4
        ref = gpu_indexer.indexer_scores(*args, variant="fp8-asm-gl")
        calls = {f"wgmma q x{p}, {c} CTAs, {t} tile(s)/step, {st} stages": functools.partial(
            gpu_indexer_wgmma.indexer_scores_wgmma, q_parts=p, ctas=c, tiles_per_step=t, stages=st)
            for p, c, t, st in VARIANTS}
        calls.update({f"triton {v}": (lambda *a, v=v: gpu_indexer.indexer_scores(*a, variant=v))
                      for v in ("f16", "fp8-asm-gl")})
        for name, fn in calls.items():
            try:
                got = fn(*args)
                fin = jnp.isfinite(ref)
                err = float(jnp.max(jnp.where(fin, jnp.abs(got - ref), 0)) / jnp.max(jnp.where(fin, jnp.abs(ref), 0)))
                same_inf = bool(jnp.array_equal(jnp.isinf(got), jnp.isinf(ref)))
                t, info = time_hbm(fn, args, perturb=1)
                gbs = moved / t / 1e9
                rows.append((ctx, b, name, t * 1e6, gbs, 100 * gbs * 1e9 / peak, err, same_inf, info.get("kernels")))
                print(f"{ctx} x {b} {name}: {t * 1e6:.1f} us, {gbs:.0f} GB/s, err {err:.1e}, -inf same {same_inf}",
                      flush=True)
            except Exception as ex:  # noqa: BLE001 -- report and go on
                print(f"{ctx} x {b} {name}: FAILED {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
        del q, w, rec, args, ref
    print(f"\ncopy peak {peak / 1e9:.0f} GB/s\n| context | batch | scan | us | GB/s | % of copy | max rel diff vs "
          "triton fp8-asm-gl | -inf same | kernels |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| {} | {} | {} | {:.1f} | {:.0f} | {:.1f}% | {:.1e} | {} | {} |".format(*r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
