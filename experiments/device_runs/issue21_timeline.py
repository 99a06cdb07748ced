"""Issue 21 on one H200 (thirty-sixth session): where the scan's and the attention's time goes inside the kernel,
from per-CTA timelines (`kernels_pallas.gpu_timeline`); the scan's head weights held in registers, the attention's
q read in bf16.

Groups (default: tests scan attention before):
- tests: the scan's and the attention's GPU tests, compiled;
- scan: a copy of the scan's bytes (72 MB moved) and of 2 GiB, from HBM (what a copy of this size reaches); the
  scan (q_parts 1, the dispatch's) at 128K x 8 / 32 and 1M x 8 from HBM; the CTAs' timelines at 128K x 8 and
  1M x 8;
- attention: the wgmma attention at batch 64 (2 ranges merged) and 8 (10 ranges, partials) from HBM, q in f32
  and in bf16 (the model's), and the CTAs' timelines (with per-tile points since call 2: each tile's logits, the
  next tile's decode beside them, and its p . v; "logits *" / "p.v *" sum them per CTA);
- sweep: the scan at 128K x 8 over CTAs and tiles per step, the attention at batch 64 over key ranges, each
  timed and with its timeline;
- query_first: `attention` in a copy of the tree with q loaded before the rows' L2 prefetch (`TREES`: a candidate);
- staged (with attention): the attention also with `staged=True` (entry rows copied into shared memory by cp.async
  a tile ahead of their decode), timed and with its timeline; its GPU test is in `tests`.
- before: `scan`'s and `attention`'s timings in a copy of the tree as before this session (`TREES["before"]`:
  the scan's head weights read from shared memory at every tile, the attention's q read in f32).

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_timeline [GROUP ...]     (~6 min; sweep ~2 more)

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
ATTENTION = "kernels_pallas/gpu_attention_wgmma.py"
# q read by the attention in f32 and rounded to bf16 in the kernel, as before
TREES["before"] = TREES.pop("scan_before") + [
    (ATTENTION, """    args = (q_bhd.astype(jnp.bfloat16), window_values,""", """    args = (q_bhd.astype(jnp.float32), window_values,"""),
    (ATTENTION, '''@functools.cache
def _load_query():
    """inline_mgpu: (q gmem bf16 [B, 64, 512], q smem bf16 [2, 64, 256] (channel halves), b) -> q[b] in the
    kernel's channel order (`channel_perm`): a thread reads 8 channels (one 16 B load, whole lines over a warp),
    puts their pairs in PERM8 order by byte permutes and writes the 16 B chunk."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(_TRANSFORMS), _SPLAT))
    def load(ctx, q_gmem, q_smem, b):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        b = b.registers.item()
        tid = mgpu_utils.thread_idx()
        g_ptr, s_ptr = mgpu_utils.memref_ptr(q_gmem), mgpu_utils.memref_ptr(q_smem)
        base = arith.muli(_i64(b), _i64(i32_const(H * D * 2)))
        groups = []
        for i in range(H * D // 8 // 256):  # 8-channel group g = tid + 256 i: row g // 64, channels 8 (g % 64) + ...
            g = arith.addi(tid, i32_const(256 * i))
            groups.append((g, _load(g_ptr, arith.addi(base, _i64(arith.muli(g, i32_const(16)))),
                                    ir.VectorType.get((4,), i32), 16)))
        for g, vals in groups:
            words = [llvm.extractelement(vals, arith.constant(i32, c)) for c in range(4)]  # channels (2c, 2c + 1)
            # PERM8's pairs (3, 7), (2, 6), (1, 5), (0, 4): the odd channels are the words' upper halves
            pairs = [mgpu_utils.inline_ptx(f"prmt.b32 $0, $1, $2, {sel:#06x};", words[lo], words[lo + 2],
                                           result_types=i32)
                     for lo, sel in ((1, 0x7632), (1, 0x5410), (0, 0x7632), (0, 0x5410))]
            row, u = arith.divui(g, i32_const(D // 8)), arith.remui(g, i32_const(D // 8))
            half = arith.divui(u, i32_const(HALF // 8))
            col = arith.muli(arith.remui(u, i32_const(HALF // 8)), i32_const(8))
            _store16(s_ptr, _smem_offset(0, half, row, col), pairs)

    return load''',
     '''@functools.cache
def _load_query():
    """inline_mgpu: (q gmem f32 [B, 64, 512], q smem bf16 [2, 64, 256] (channel halves), b) -> q[b] rounded to
    bf16 in the kernel's channel order (`channel_perm`): a thread reads 8 channels (two 16 B loads, whole lines
    over a warp) and writes their 16 B chunk."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(_TRANSFORMS), _SPLAT))
    def load(ctx, q_gmem, q_smem, b):
        del ctx
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        b = b.registers.item()
        tid = mgpu_utils.thread_idx()
        g_ptr, s_ptr = mgpu_utils.memref_ptr(q_gmem), mgpu_utils.memref_ptr(q_smem)
        base = arith.muli(_i64(b), _i64(i32_const(H * D * 4)))
        groups = []
        for i in range(H * D // 8 // 256):  # 8-channel group g = tid + 256 i: row g // 64, channels 8 (g % 64) + ...
            g = arith.addi(tid, i32_const(256 * i))
            off = arith.addi(base, _i64(arith.muli(g, i32_const(32))))
            vals = [_load(g_ptr, arith.addi(off, _i64(i32_const(16 * h))), ir.VectorType.get((4,), f32), 16)
                    for h in range(2)]
            groups.append((g, vals))
        for g, vals in groups:
            ch = [llvm.extractelement(vals[c // 4], arith.constant(i32, c % 4)) for c in range(8)]
            words = [mgpu_utils.inline_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", ch[PERM8[2 * j + 1]], ch[PERM8[2 * j]],
                                           result_types=i32) for j in range(4)]
            row, u = arith.divui(g, i32_const(D // 8)), arith.remui(g, i32_const(D // 8))
            half = arith.divui(u, i32_const(HALF // 8))
            col = arith.muli(arith.remui(u, i32_const(HALF // 8)), i32_const(8))
            _store16(s_ptr, _smem_offset(0, half, row, col), words)

    return load'''),
]
# a candidate, not yet timed: the attention's q loaded before the rows' L2 prefetch, whose addresses wait on idx loads
# (the timeline's "q loaded" phase, 5.9 us at batch 64, holds both)
TREES["query_first"] = [
    (ATTENTION, """        if "prefetch" not in skip:
            _prefetch(n, w, n_wt, per, staged)(ev, es, idx_gmem, wv, ws, seq, first, last,
                                               *((idx_s,) if staged else ()))

        def stage(t):""", """        def stage(t):"""),
    (ATTENTION, """        if staged and "decode" not in skip:  # idx_s seen by every thread, then the first tile's copies under q's load
            _both_warpgroups_meet()
            stage(first)
        _load_query()(q_gmem, q_smem, seq)  # made visible to the wgmmas by the first decode's fence and barrier
        stamp(1)
""", """        _load_query()(q_gmem, q_smem, seq)  # made visible to the wgmmas by the first decode's fence and barrier
        stamp(1)
        if "prefetch" not in skip:
            _prefetch(n, w, n_wt, per, staged)(ev, es, idx_gmem, wv, ws, seq, first, last,
                                               *((idx_s,) if staged else ()))
        if staged and "decode" not in skip:
            _both_warpgroups_meet()
            stage(first)
"""),
]
# what each tree's step runs (its own process in that tree; its table lands in its log)
TREE_GROUPS = {"before": ["scan_untimed", "attention_untimed"], "query_first": ["attention"]}
SCAN_POINTS = ((131072, 8), (131072, 32), (1048576, 8))


def attention_points(columns: int) -> list[str]:
    """The wgmma attention's timeline points for a timeline of `columns` columns (its tiles per range from it)."""
    from kernels_pallas import gpu_attention_wgmma as att
    fixed = len(att.timeline_names(0)) + 1  # the points around the tiles, and the SM column
    return att.timeline_names((columns - fixed) // 2)


def scan_group(say, rows, timelines: bool) -> None:
    import functools

    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from experiments.device_runs.issue21_alu_decode import scan_error
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
        err = scan_error(fn(*args), gpu_indexer.indexer_scores(*args))
        timed_row(say, rows, "scan", f"{ctx} x {b}", fn, args, 1, moved, peak, err)
        if timelines and b == 8:
            say(f"timeline {ctx} x {b}:", timeline(lambda *a: fn(*a, timeline=True)[1], args, scan.TIMELINE))
        del q, w, rec, args


def timed_row(say, rows, kind, shape, fn, args, perturb, moved, peak, err="-") -> None:
    """fn(*args) timed from HBM (`bench_kernels.time_hbm`, args[perturb] passed through the flush): a table row
    (GPU us, kernel us, % of the copy peak for `moved` bytes, err) appended to rows and said with its details."""
    from experiments import bench_kernels as bk

    t, info = bk.time_hbm(fn, args, perturb=perturb)
    rows.append((kind, shape, f"{t * 1e6:.1f}", str(info["pallas_us"]), f"{100 * moved / t / peak:.1f}%", err))
    say(" | ".join(rows[-1]), info)


def timeline(fn, args, names) -> dict:
    """gpu_timeline.phases of the last of 5 calls of fn (-> the timeline), each after an L2 flush. names: the
    points, or a function of the timeline's column count that gives them."""
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
    tl = jax.device_get(tl)
    return gpu_timeline.phases(tl, list(names(tl.shape[1]) if callable(names) else names))


def attention_group(say, rows, timelines: bool, staged: bool = False) -> None:
    import functools

    import jax
    import jax.numpy as jnp

    from dsv41_jax import ops, quant
    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    peak = bk.copy_bandwidth(2.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    scale = bk.D_ATT ** -0.5
    for b in (64, 8):
        q32, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, 1 << 17, jnp.float32)
        for q in (q32, q32.astype(jnp.bfloat16)):  # the model's q is bf16
            moved = bk.attention_bytes(q, window, wvalid, entries, idx)
            args = (q, window["values"], window["scales"], wvalid, entries["values"], entries["scales"], idx, sink)
            ref = ops.sparse_attention_decode(q.astype(jnp.float32), window, wvalid, quant.WINDOW_KV, entries, idx,
                                              quant.MAIN_KV, sink, scale)
            bf16 = q.dtype == jnp.bfloat16
            # the default, and with the model's q the candidate: entry rows staged by cp.async a tile ahead
            for kw in [{}] + [{"staged": True}] * (staged and bf16):
                fn = functools.partial(att.sparse_attention_wgmma, scale=scale, **kw)
                err = float(jnp.linalg.norm(fn(*args) - ref) / jnp.linalg.norm(ref))
                shape = f"128K x {b}, q {q.dtype}" + (", staged" if kw else "")
                timed_row(say, rows, "attention", shape, fn, args, 7, moved, peak, f"{err:.1e}")
                if timelines and bf16:
                    say(f"timeline {shape}:", timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args,
                                                       attention_points))
        del q, q32, window, entries, args, ref


def sweep_group(say, rows) -> None:
    """The scan at 128K x 8 over CTAs x tiles per step, the attention at batch 64 over key ranges (merged and
    partials): each timed from HBM, with its CTAs' timeline."""
    import functools

    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att, gpu_indexer_wgmma as scan

    peak = bk.copy_bandwidth(2.0)
    q, w, rec = bk.index_data(jax.random.key(0), 8, 131072)
    args = (q, w, rec["values"], rec["scales"], jnp.full((8,), 131072 - 5, jnp.int32))
    moved = bk.nbytes(rec) + 8 * 131072 * 4
    for ctas, tiles in ((1056, 4), (2112, 4), (4224, 4), (2112, 2), (4224, 2), (8448, 2)):
        fn = functools.partial(scan.indexer_scores_wgmma, q_parts=1, ctas=ctas, tiles_per_step=tiles)
        timed_row(say, rows, "scan", f"131072 x 8, {ctas} CTAs, {tiles} tiles/step", fn, args, 1, moved, peak)
        say("timeline", timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args, scan.TIMELINE))
    del q, w, rec, args
    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(64), 64, 1 << 17)
    args = (q, window["values"], window["scales"], wvalid, entries["values"], entries["scales"], idx, sink)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx)
    for splits, merged in ((1, True), (2, False), (4, False)):
        fn = functools.partial(att.sparse_attention_wgmma, scale=bk.D_ATT ** -0.5, splits=splits, merged=merged)
        timed_row(say, rows, "attention", f"128K x 64, q bf16, {splits} ranges {'merged' if merged else 'partials'}",
                  fn, args, 7, moved, peak)
        say("timeline", timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args, attention_points))


def main(groups: list[str]) -> int:
    say, _ = logger(f"{'_'.join(groups)}.log")
    if "tests" in groups:
        rc = step("tests", ["-m", "pytest", "tests/test_indexer_wgmma.py", "tests/test_attention_wgmma.py", "-q",
                            "-p", "no:cacheprovider"], 330, {"JAX_PLATFORMS": "cuda"})
        say("TESTS rc", rc, "|", open(os.path.join(OUT, "tests.log")).read().strip().splitlines()[-1:])
    rows = []
    if "scan" in groups or "scan_untimed" in groups:
        scan_group(say, rows, timelines="scan" in groups)
    if "attention" in groups or "attention_untimed" in groups:
        attention_group(say, rows, timelines="attention" in groups, staged="staged" in groups)
    for tree in [g for g in groups if g in TREES]:
        step(tree, ["-m", "experiments.device_runs.issue21_timeline", *TREE_GROUPS[tree]], 240,
             cwd=tree_before(TREES[tree], f"/tmp/tree_{tree}"))
        say(open(os.path.join(OUT, f"{tree}.log")).read()[-2500:])
    if "sweep" in groups:
        sweep_group(say, rows)
    say("| kernel | shape | GPU us | kernel us | % of copy | error vs twin |\n|---|---|---|---|---|---|")
    for r in rows:
        say("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["tests", "scan", "attention", "before"]))
