"""Issue 21 on one H200 (thirty-sixth session): where the scan's and the attention's time goes inside the kernel,
from per-CTA timelines (`kernels_pallas.gpu_timeline`), and the scan's head weights held in registers.

Groups (default: tests scan scan_before attention):
- tests: the scan's and the attention's GPU tests, compiled;
- scan: a copy of the scan's bytes (72 MB moved) and of 2 GiB, from HBM (what a copy of this size reaches); the
  scan (q_parts 1, the dispatch's) at 128K x 8 / 32 and 1M x 8 from HBM; the CTAs' timelines at 128K x 8 and
  1M x 8;
- scan_before: `scan`'s timings in a copy of the tree with the head weights read from shared memory at every
  tile, as before (`TREES["scan_before"]`);
- attention: the wgmma attention at batch 64 (2 ranges merged) and 8 (10 ranges, partials) from HBM, and the
  CTAs' timelines.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_timeline [GROUP ...]     (~6 min)

Logs and a table per group under $OUT.
"""

import os
import sys

from experiments.device_runs._steps import OUT, logger, step, tree_before

SCAN = "kernels_pallas/gpu_indexer_wgmma.py"
# the head weights as before: TMA into shared memory, one load per head and tile in the epilogue
TREES = {"scan_before": [
    (SCAN, '''    def epilogue(ctx, acc, e_maxes, w_regs, o_gmem, b, p0, reach):''',
     '''    def epilogue(ctx, acc, e_maxes, w_smem, o_gmem, b, p0, reach):'''),
    (SCAN, '''    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType(), _SPLAT,
                                  _SPLAT, _SPLAT))''',
     '''    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(), _SPLAT,
                                  _SPLAT, _SPLAT))'''),
    (SCAN, '''                    w = vector.extract(w_regs.registers[0, c, 0, 0, 0, 0, 0, 0, 0], dynamic_position=[],
                                       static_position=pos)
''', '''                    head = arith.addi(arith.muli(q, i32_const(2)), i32_const(8 * c + j))
                    w = memref.load(w_smem, [index_of(head)])
'''),
    (SCAN, '''        o_gmem, tl_gmem, q_smem, q_bar = refs if timeline else (refs[0], None, *refs[1:])''',
     '''        o_gmem, tl_gmem, q_smem, w_smem, q_bar, w_bar = refs if timeline else (refs[0], None, *refs[1:])'''),
    (SCAN, '''        w_regs = _head_weights(h)(w_gmem, seq)
''', '''        plgpu.copy_gmem_to_smem(w_gmem.at[seq], w_smem, w_bar)
'''),
    (SCAN, '''                plgpu.barrier_wait(q_bar)
''', '''                plgpu.barrier_wait(q_bar)
                plgpu.barrier_wait(w_bar)
'''),
    (SCAN, '''(acc, e_max, w_regs, o_gmem,''', '''(acc, e_max, w_smem, o_gmem,'''),
    (SCAN, '''        scratch_types=(plgpu.SMEM((q_parts * h, D), jnp.bfloat16, transforms=_Q_TRANSFORMS),
                       plgpu.Barrier(num_arrivals=1)),''',
     '''        scratch_types=(plgpu.SMEM((q_parts * h, D), jnp.bfloat16, transforms=_Q_TRANSFORMS),
                       plgpu.SMEM((h,), jnp.float32), plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)),'''),
]}
SCAN_POINTS = ((131072, 8), (131072, 32), (1048576, 8))


def scan_group(say, rows, timelines: bool) -> None:
    import functools

    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_indexer, gpu_indexer_wgmma as scan

    peak = bk.copy_bandwidth(2.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    for mb in (36, 1024):  # a copy from HBM of this many MB (read + write: twice the bytes moved)
        big = jax.random.bits(jax.random.key(mb), (mb * 2**20 // 4,), jnp.uint32)
        t, _ = bk.time_hbm(lambda s, x: x ^ s[0], (jnp.ones((8,), jnp.uint32), big), perturb=0)
        rows.append(("copy", f"{2 * mb} MB moved", f"{t * 1e6:.1f}", "-", f"{100 * 2 * big.nbytes / t / peak:.1f}%", "-"))
        say(" | ".join(rows[-1]))
        del big
    for ctx, b in SCAN_POINTS:
        q, w, rec = bk.index_data(jax.random.key(ctx + b), b, ctx)
        args = (q, w, rec["values"], rec["scales"], jnp.full((b,), ctx - 5, jnp.int32))
        moved = bk.nbytes(rec) + b * ctx * 4
        fn = functools.partial(scan.indexer_scores_wgmma, q_parts=1)
        ref = gpu_indexer.indexer_scores(*args)
        got, fin = fn(*args), jnp.isfinite(ref)
        rel = float(jnp.max(jnp.where(fin, jnp.abs(got - ref), 0)) / jnp.max(jnp.where(fin, jnp.abs(ref), 0)))
        same = bool(jnp.array_equal(jnp.isinf(got), jnp.isinf(ref)))
        t, info = bk.time_hbm(fn, args, perturb=1)
        rows.append(("scan", f"{ctx} x {b}", f"{t * 1e6:.1f}", str(info["pallas_us"]), f"{100 * moved / t / peak:.1f}%",
                     f"{rel:.1e}, -inf {'same' if same else 'DIFFERENT'}"))
        say(" | ".join(rows[-1]), info)
        if timelines and b == 8:
            say(f"timeline {ctx} x {b}:", timeline(lambda *a: fn(*a, timeline=True)[1], args, scan.TIMELINE))
        del q, w, rec, args, ref, got


def timeline(fn, args, names) -> dict:
    """gpu_timeline.phases of the last of 5 calls of fn (-> the timeline), each after an L2 flush."""
    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_timeline

    @jax.jit
    def flushed(buf, *a):
        buf, _ = bk.l2_flush(buf, jnp.zeros((8,), jnp.uint32))
        return buf, fn(*a)

    buf = jnp.zeros((bk.FLUSH_BYTES // 4,), jnp.uint32)
    for _ in range(5):
        buf, tl = flushed(buf, *args)
    return gpu_timeline.phases(jax.device_get(tl), list(names))


def attention_group(say, rows) -> None:
    import jax
    import jax.numpy as jnp

    from dsv41_jax import ops, quant
    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    peak = bk.copy_bandwidth(2.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    scale = bk.D_ATT ** -0.5
    for b in (64, 8):
        q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, 1 << 17)
        moved = bk.attention_bytes(q, window, wvalid, entries, idx)
        args = (q, window["values"], window["scales"], wvalid, entries["values"], entries["scales"], idx, sink)
        ref = ops.sparse_attention_decode(q, window, wvalid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink, scale)
        fn = lambda *a: att.sparse_attention_wgmma(*a, scale=scale)  # noqa: E731
        err = float(jnp.linalg.norm(fn(*args) - ref) / jnp.linalg.norm(ref))
        t, info = bk.time_hbm(fn, args, perturb=7)
        rows.append(("attention", f"128K x {b}", f"{t * 1e6:.1f}", str(info["pallas_us"]), f"{100 * moved / t / peak:.1f}%",
                     f"{err:.1e}"))
        say(" | ".join(rows[-1]), info)
        say(f"timeline 128K x {b}:", timeline(lambda *a: att.sparse_attention_wgmma(*a, scale=scale, timeline=True)[1], args,
                                               att.TIMELINE))
        del q, window, entries, args, ref


def main(groups: list[str]) -> int:
    say, _ = logger(f"{'_'.join(groups)}.log")
    if "tests" in groups:
        rc = step("tests", ["-m", "pytest", "tests/test_indexer_wgmma.py", "tests/test_attention_wgmma.py", "-q",
                            "-p", "no:cacheprovider"], 330, {"JAX_PLATFORMS": "cuda"})
        say("TESTS rc", rc, "|", open(os.path.join(OUT, "tests.log")).read().strip().splitlines()[-1:])
    if "scan_before" in groups:  # its own process in the before tree; its table lines land in its log
        step("scan_before", ["-m", "experiments.device_runs.issue21_timeline", "scan_untimed"], 200,
             cwd=tree_before(TREES["scan_before"]))
        say(open(os.path.join(OUT, "scan_before.log")).read()[-3000:])
    rows = []
    if "scan" in groups or "scan_untimed" in groups:
        scan_group(say, rows, timelines="scan" in groups)
    if "attention" in groups:
        attention_group(say, rows)
    say("| kernel | shape | GPU us | kernel us | % of copy | error vs twin |\n|---|---|---|---|---|---|")
    for r in rows:
        say("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["tests", "scan", "scan_before", "attention"]))
