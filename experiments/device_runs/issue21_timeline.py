"""Issue 21 on one H200 (thirty-sixth session): where the scan's and the attention's time goes inside the kernel,
from per-CTA timelines (`kernels_pallas.gpu_timeline`); the scan's head weights held in registers, the attention's
q read in bf16.

Groups (default: tests scan attention):
- tests: the scan's and the attention's GPU tests, compiled;
- scan: a copy of the scan's bytes (72 MB moved) and of 2 GiB, from HBM (what a copy of this size reaches); the
  scan (q_parts 1, the dispatch's) at 128K x 8 / 32 and 1M x 8 from HBM; the CTAs' timelines at 128K x 8 and
  1M x 8;
- attention: the wgmma attention at batch 64 (2 ranges merged) and 8 (10 ranges, partials) from HBM, q in f32
  and in bf16 (the model's), and the CTAs' timelines (with per-tile points since call 2: each tile's logits, the
  next tile's decode beside them, and its p . v; "logits *" / "p.v *" sum them per CTA); attention_b64 (since
  the fortieth session): batch 64 with bf16 q alone, with its timeline, to screen candidates in `before`;
- sweep: the scan at 128K x 8 over CTAs, tiles per step and stages, the attention at batch 64 over key ranges,
  each timed and with its timeline;
- configs (forty-third session): the scan at 128K x 8 / 32 and 1M x 8 over the sweep's best CTA counts and tiles
  per step, and with no decode (moves) at 128K x 8;
- decode_bound (forty-fifth session): the scan group at 128K x 8 and 1M x 8, with and without its decode (moves;
  its error column then says how wrong the scores are by design);
- linear (forty-sixth session; run at 06a9f37 in the forty-seventh, then removed with its form): the scan group
  with the default and `linear=True` (the epilogue's FADD a head taken by 8 more wgmma columns);
- defaults: the scan group with the scan's default and the earlier one (2112 CTAs of 4 tiles, DEFAULTS) at each
  point (the forty-third session's call 4 ran it as its own function, without the copies; call 3 at 69241da as
  `own_query`, with q permuted in the kernel);
- prefetch (forty-ninth session, at d5fb818; removed with its form): the scan group with each CTA asking the L2
  for a later CTA's keys (`prefetch_ahead`), and each variant's tail at 128K x 8 (the last tenth of the CTAs by
  start);
- heads (forty-ninth session): the same keys scanned for 8, 16, 32 and 64 heads, with and without the decode (does
  the per-tile time follow the tensor and epilogue work, which grows with the heads, or the decode?);
- mulhi (fiftieth session; removed after its run): the default decode against its word >> 8 as a mul.hi (IMAD.HI)
  at 128K x 8 and 1M x 8 (slower: docs/BENCHMARKS.md, fiftieth session);
- flush (fiftieth session; folded into sm90 in the fifty-second): the copy peak, the scan and the attention at
  batch 64 after each kind of L2 flush (`bench_kernels.FLUSH`: the rewrite leaves dirty lines, the read clean ones);
- sm90 (fifty-first session): the scan at SCAN_POINTS on the released nibbles and on the same keys in Hopper's
  word layout (`quant.to_sm90_words`, SM90_DECODE_PTX) after each kind of flush, the attention at batch 64 after
  each, and the Triton pool scan on both layouts at 128K (its error column: against the jnp twin on the nibbles);
- early (fifty-second session; run in the fifty-third and fifty-fourth): the attention at batch 64 with its first
  prefetch burst of the default's tiles (0 since the fifty-fourth), then 0-3, with timelines, after the read flush;
- words_configs (fifty-third session; run in the fifty-fourth): the scan on Hopper's words at SCAN_POINTS over (CTAs, tiles per
  step, stages), after the read flush: on the H200 the words' scan is bound by instruction issue (fifty-third
  session's counters), and more tiles a step spread each step's bookkeeping over more tiles (the fifty-fourth's
  run was on an H100, with fresh_product);
- blockmax (fifty-third session; run in the fifty-fourth): the scan as the dispatch calls it with block maxima of 8 (the
  candidate source's), the maxima by XLA after the kernel (the default) against the kernel's epilogue
  (`FUSED_BLOCK_MAX`), at SCAN_POINTS on both word layouts after the read flush, each pair checked bit for bit;
- fresh (fifty-fourth session): the scan at SCAN_POINTS on both word layouts with each tile's product by
  `plgpu.wgmma` into a fresh accumulator (ptxas zeroes a step's later tiles' accumulators by 17 moves on the
  H200) against `gpu_wgmma.fresh_product` (its first wgmma's scale-d false), after the read flush, each pair checked
  bit for bit;
- share, merge, candidates, quick (fifty-sixth session; run in the fifty-seventh at 893c1c5, then removed with their
  forms): the attention at batch 64 as the default and with `decode_share` (the entry tiles' decode shared by
  channels) and `async_merge` (one cluster barrier), each with its timeline, outputs checked bit for bit;
- ahead (fifty-seventh session; run at 6ff9d25, then removed with its form): the attention at batch 64 as the
  default and with `rows_ahead` (the decoders' entry rows loaded 2 or 3 tiles ahead) and other `registers`;
- free (fifty-seventh session; run in the fifty-ninth at 484cb3d, then removed with its form): the attention at
  batch 64 as the default and with `free_split` (a key slot handed back to warpgroup 1 by warpgroup 0 alone, to
  warpgroup 2 by both), each with its timeline, outputs checked bit for bit, the default again last;
- batch1 (fifty-eighth session; run in the fifty-ninth: MIN_BATCH 1 taken): the model's attention call at batch 1
  with the dispatch's MIN_BATCH 2 (Triton) and 1 (wgmma) in turn, twice, in one process;
- workers (forty-ninth session, at cb0e16e; removed with its form): the default against `indexer_scores_workers`
  (one CTA an SM, each warpgroup a worker with its own ring, steps from a counter) at 128K x 8 and 1M x 8, with
  both timelines at 128K x 8.

The groups that ran copies of the tree (before: the thirty-sixth session's changes taken back; query_first) and
the attention's `staged=True` candidate (staged) ran at commit bad4179 (thirty-sixth and thirty-seventh sessions,
docs/BENCHMARKS.md); the candidates were not kept, `experiments.device_runs.issue21_prefetch` holds the next A/B.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_timeline [GROUP ...]     (~4 min; sweep ~2 more)

Logs and a table per group under $OUT.
"""

import os
import sys

from experiments.device_runs._steps import OUT, logger, step

SCAN_POINTS = ((131072, 8), (131072, 32), (1048576, 8))


def attention_points(columns: int) -> dict[str, list[str]] | list[str]:
    """The wgmma attention's timeline points per warpgroup for a timeline of `columns` columns (its tiles per range
    from it)."""
    from kernels_pallas import gpu_attention_wgmma as att
    fixed = len(att.timeline_names(0)) + 1  # the points around the tiles, and the SM column
    per_tile = len(att.timeline_names(1)) + 1 - fixed
    tiles = (columns - fixed) // per_tile
    # a kernel from before the thirty-ninth session's end (`issue21_roles before`) stamps warpgroup 0's points only
    return att.timeline_groups(tiles) if hasattr(att, "timeline_groups") else att.timeline_names(tiles)


def scan_case(ctx: int, b: int):
    """(the scan's arguments at ctx positions x b sequences, reachable ctx - 5; the bytes it must move: the keys,
    their scales and the f32 scores)."""
    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk

    q, w, rec = bk.index_data(jax.random.key(ctx + b), b, ctx)
    return (q, w, rec["values"], rec["scales"], jnp.full((b,), ctx - 5, jnp.int32)), bk.nbytes(rec) + b * ctx * 4


def in_words(args):
    """The scan's arguments (`scan_case`) with the keys in Hopper's word layout (`quant.to_sm90_words`)."""
    from dsv41_jax import quant

    return (*args[:2], quant.to_sm90_words(args[2]), *args[3:])


def guarded(say, rows, kind: str, shape: str, run) -> None:
    """run() (a variant's check and timed row); if it fails (say, at its first GPU compile) the error is said and
    the table gets a 'failed' row, and the group's other variants still run."""
    import traceback

    try:
        run()
    except Exception as e:  # noqa: BLE001 - one failed variant must not cost the call the others
        say(f"[{kind} {shape}] FAILED: {type(e).__name__}: {str(e)[:2000]}", traceback.format_exc()[-3000:])
        rows.append((kind, shape, "failed", "-", "-", type(e).__name__))


# The defaults group's variants: the scan's default, and the default until the forty-third session
DEFAULTS = {"default": {}, "2112 CTAs, 4 tiles/step (the earlier default)": {"ctas": 2112, "tiles_per_step": 4}}


def scan_group(say, rows, timelines: bool, variants: dict | None = None, points=SCAN_POINTS) -> None:
    """Copies of 72 MB and 2 GiB moved from HBM; the scan (q_parts 1, the dispatch's) at each of `points`,
    each of `variants` (label -> keyword arguments; default: the kernel's defaults alone) with its error against
    the Triton twin, and (timelines) the first variant's CTA timeline at batch 8."""
    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_indexer_wgmma as scan

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    for mb in (36, 1024):  # a copy from HBM of this many MB (read + write: twice the bytes moved)
        big = jax.random.bits(jax.random.key(mb), (mb * 2**20 // 4,), jnp.uint32)
        t, _ = bk.time_hbm(lambda s, x: x ^ s[0], (jnp.ones((8,), jnp.uint32), big), perturb=0)
        rows.append(("copy", f"{2 * mb} MB moved", f"{t * 1e6:.1f}", "-", f"{100 * 2 * big.nbytes / t / peak:.1f}%", "-"))
        say(" | ".join(rows[-1]))
        del big
    for ctx, b in points:
        args, moved = scan_case(ctx, b)
        fns = scan_rows(say, rows, f"{ctx} x {b}", args, moved, peak, variants or {"": {}})
        if timelines and b == 8:
            say(f"timeline {ctx} x {b}:", timeline(lambda *a, fn=fns[0]: fn(*a, timeline=True)[1], args, scan.TIMELINE))
        del args


def scan_rows(say, rows, shape: str, args, moved: int, peak: float, variants: dict) -> list:
    """Each of `variants` (label -> keyword arguments of the scan, q_parts 1) on args timed from HBM, a row each
    with its error against the Triton twin (a variant without the decode: how wrong its scores are by design).
    Returns the variants' functions."""
    import functools

    from experiments.device_runs.issue21_alu_decode import scan_error
    from kernels_pallas import gpu_indexer, gpu_indexer_wgmma as scan

    twin, fns = gpu_indexer.indexer_scores(*args), []
    for name, kw in variants.items():
        fns.append(functools.partial(scan.indexer_scores_wgmma, q_parts=1, **kw))
        timed_row(say, rows, "scan", shape + (f", {name}" if name else ""), fns[-1], args, 1, moved, peak,
                  lambda out: scan_error(out, twin))
    return fns


def timed_row(say, rows, kind, shape, fn, args, perturb, moved, peak, err="-"):
    """fn(*args) timed from HBM (`bench_kernels.time_hbm_output`, args[perturb] passed through the flush): a table
    row (GPU us, kernel us, % of the copy peak for `moved` bytes, err) appended to rows and said with its details.
    err: the column's text, or a function of fn's output (the timed program's: no second compile) that gives it.
    Returns fn's output."""
    from experiments import bench_kernels as bk

    t, info, out = bk.time_hbm_output(fn, args, perturb=perturb)
    err = err(out) if callable(err) else err
    rows.append((kind, shape, f"{t * 1e6:.1f}", str(info["pallas_us"]), f"{100 * moved / t / peak:.1f}%", err))
    say(" | ".join(rows[-1]), info)
    return out


def timeline(fn, args, names) -> dict:
    """gpu_timeline.phases of the last of 5 calls of fn (-> the timeline), each after an L2 flush. names: the
    points (or {group: points}: `phases_by_group`), or a function of the timeline's column count that gives them."""
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
    names = names(tl.shape[1]) if callable(names) else names
    return gpu_timeline.phases_by_group(tl, names) if isinstance(names, dict) else gpu_timeline.phases(tl, names)


def say_timeline(say, label: str, phases: dict) -> None:
    """A timeline's phases (`timeline`'s result): one line, or one line per warpgroup when it has groups."""
    if all(isinstance(v, dict) for v in phases.values()):
        for group, of_group in phases.items():
            say(f"{label} {group}:", of_group)
    else:
        say(f"{label}:", phases)


def attention_group(say, rows, timelines: bool, batches=(64, 8), q_dtypes=("float32", "bfloat16"), peak=None,
                    label: str = "", options=None) -> list:
    """The wgmma attention at 128K entries for each batch and q dtype, timed from HBM with its error against the
    float32 twin, and (timelines) its CTAs' timeline with bf16 q. peak: the copy peak (default: timed here);
    label: appended to each row's shape; options: keyword arguments of the kernel. Returns the outputs."""
    import functools

    import jax
    import jax.numpy as jnp

    from dsv41_jax import ops, quant
    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    if peak is None:
        peak = bk.hbm_copy_bandwidth(1.0)
        say(f"copy peak {peak / 1e9:.0f} GB/s")
    scale = bk.D_ATT ** -0.5
    outs = []
    for b in batches:
        q32, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, 1 << 17, jnp.float32)
        for q in (q32.astype(dt) for dt in q_dtypes):  # the model's q is bf16
            moved = bk.attention_bytes(q, window, wvalid, entries, idx)
            args = bk.attention_args(q, window, wvalid, entries, idx, sink)
            ref = ops.sparse_attention_decode(q.astype(jnp.float32), window, wvalid, quant.WINDOW_KV, entries, idx,
                                              quant.MAIN_KV, sink, scale)
            bf16 = q.dtype == jnp.bfloat16
            fn = functools.partial(att.sparse_attention_wgmma, scale=scale, **(options or {}))
            shape = f"128K x {b}, q {q.dtype}{label}"
            outs.append(timed_row(say, rows, "attention", shape, fn, args, 7, moved, peak,
                                  lambda out, ref=ref: f"{bk.rel_err(out, ref):.1e}"))
            if timelines and bf16:
                say_timeline(say, f"timeline {shape}",
                             timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args, attention_points))
        del q, q32, window, entries, args, ref
    return outs


def model_call_case(b: int):
    """The attention as the model calls it at 128K entries x b sequences (bf16 q, the rope taken off its output by
    angles cos / sin f32 [b, 256], bf16 out): (the kernels' positional arguments with cos and sin last, the bytes
    the call must move, the float32 jnp twin's output)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax import ops, quant
    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention

    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, 1 << 17)
    angle_bp = jax.random.uniform(jax.random.key(b + 1), (b, bk.D_ATT // 2), maxval=6.3)
    cos, sin = jnp.cos(angle_bp), jnp.sin(angle_bp)
    args = (*bk.attention_args(q, window, wvalid, entries, idx, sink), cos, sin)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx, jnp.bfloat16) + bk.nbytes(cos, sin)
    ref = gpu_attention.unrotated(ops.sparse_attention_decode(
        q.astype(jnp.float32), window, wvalid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink, bk.D_ATT ** -0.5),
        cos, sin)
    return args, moved, ref


def batch1_group(say, rows, min_batches=(2, 1, 2, 1)) -> None:
    """The model's attention call at batch 1 (`model_call_case`; `kernels_pallas.sparse_attention_decode` as
    `dsv41_jax.kernels` calls it) with the dispatch's MIN_BATCH set to each of `min_batches` in turn (2: the Triton
    kernel, 20 ranges of 16 heads; 1: the wgmma kernel, 10 ranges, the partials merged by `combine_unrotated`),
    timed from HBM in one process, each with its error against the jnp twin."""
    import jax.numpy as jnp

    import kernels_pallas
    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"flush {bk.FLUSH}: copy peak {peak / 1e9:.0f} GB/s")
    args, moved, ref = model_call_case(1)

    def call(q, wv, ws, ok, ev, es, idx, sink, cos, sin):
        return kernels_pallas.sparse_attention_decode(q, {"values": wv, "scales": ws}, ok, {"values": ev, "scales": es},
                                                      idx, sink, bk.D_ATT ** -0.5, unrotate=(cos, sin),
                                                      out_dtype=jnp.bfloat16)

    default = att.MIN_BATCH
    try:
        for min_batch in min_batches:
            att.MIN_BATCH = min_batch  # read by the dispatch when it is traced: each timed program traces anew
            timed_row(say, rows, "attention", f"128K x 1, the model's call, MIN_BATCH {min_batch}", call, args, 7,
                      moved, peak, lambda out: f"{bk.rel_err(out, ref):.1e}")
    finally:
        att.MIN_BATCH = default


def sweep_group(say, rows) -> None:
    """The scan at 128K x 8 over CTAs x tiles per step, the attention at batch 64 over key ranges (merged and
    partials): each timed from HBM, with its CTAs' timeline."""
    import functools

    import jax

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att, gpu_indexer_wgmma as scan

    peak = bk.hbm_copy_bandwidth(1.0)
    args, moved = scan_case(131072, 8)
    # (CTAs wanted, tiles per step, stages): 660 / 528 = one wave of 5 / 4 CTAs an SM (42 KB of shared memory each)
    for ctas, tiles, stages in ((264, 4, 2), (528, 4, 2), (528, 4, 3), (660, 4, 2), (1056, 4, 2), (1320, 4, 2),
                                (2112, 4, 2), (4224, 4, 2), (2112, 2, 2), (2112, 2, 3), (4224, 2, 2), (8448, 2, 2)):
        fn = functools.partial(scan.indexer_scores_wgmma, q_parts=1, ctas=ctas, tiles_per_step=tiles, stages=stages)
        timed_row(say, rows, "scan", f"131072 x 8, {ctas} CTAs, {tiles} tiles/step, {stages} stages", fn, args, 1,
                  moved, peak)
        say("timeline", timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args, scan.TIMELINE))
    del args
    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(64), 64, 1 << 17)
    args = bk.attention_args(q, window, wvalid, entries, idx, sink)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx)
    for splits, merged in ((1, True), (2, False), (4, False)):
        fn = functools.partial(att.sparse_attention_wgmma, scale=bk.D_ATT ** -0.5, splits=splits, merged=merged)
        timed_row(say, rows, "attention", f"128K x 64, q bf16, {splits} ranges {'merged' if merged else 'partials'}",
                  fn, args, 7, moved, peak)
        say_timeline(say, "timeline", timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args, attention_points))


def configs_group(say, rows) -> None:
    """The scan at each of SCAN_POINTS over (CTAs, tiles per step, stages) around the sweep's best at 128K x 8, and
    with the decode replaced by moves (wrong numbers: what the kernel takes without it) at 128K x 8."""
    import functools

    from experiments import bench_kernels as bk
    from experiments.bench_wgmma import NO_DECODE
    from kernels_pallas import gpu_indexer_wgmma as scan

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    configs = ((2112, 4, 2), (3168, 2, 2), (4224, 2, 2), (6336, 2, 2), (4224, 1, 2), (4224, 1, 4), (8448, 1, 2))
    for ctx, b in SCAN_POINTS:
        args, moved = scan_case(ctx, b)
        for ctas, tiles, stages in configs if ctx * b <= 131072 * 8 else configs[:3]:
            for decode in ("decode", "moves") if ctx * b == 131072 * 8 and ctas in (2112, 4224) else ("decode",):
                fn = functools.partial(scan.indexer_scores_wgmma, q_parts=1, ctas=ctas, tiles_per_step=tiles,
                                       stages=stages, **({"decode_ptx": NO_DECODE} if decode == "moves" else {}))
                timed_row(say, rows, "scan", f"{ctx} x {b}, {ctas} CTAs, {tiles} tiles/step, {stages} stages"
                          + (", moves (no decode)" if decode == "moves" else ""), fn, args, 1, moved, peak)
        del args


def gpu_tests(say, files=("tests/test_indexer_wgmma.py", "tests/test_attention_wgmma.py"), timeout_s=330) -> int:
    """The GPU tests of `files`, compiled (`tests.log`); on a failure the log's tail is said too. Returns the exit
    code (124: a hang, killed at timeout_s)."""
    rc = step("tests", ["-m", "pytest", *files, "-q", "-p", "no:cacheprovider"], timeout_s, {"JAX_PLATFORMS": "cuda"})
    log = open(os.path.join(OUT, "tests.log")).read()
    say("TESTS rc", rc, "|", log.strip().splitlines()[-1:])
    if rc:
        say(log[-4000:])
    return rc


def say_table(say, rows) -> None:
    say("| kernel | shape | GPU us | kernel us | % of copy | error vs twin |\n|---|---|---|---|---|---|")
    for r in rows:
        say("| " + " | ".join(r) + " |")


# Groups every issue-21 device script takes: fn(say, rows)
SHARED_GROUPS = {
    "scan": lambda say, rows: scan_group(say, rows, timelines=True),
    "scan_untimed": lambda say, rows: scan_group(say, rows, timelines=False),
    "attention": lambda say, rows: attention_group(say, rows, timelines=True),
    "attention_untimed": lambda say, rows: attention_group(say, rows, timelines=False),
    # candidates screened at the target's shape alone (batch 64, the model's bf16 q, with the timeline)
    "attention_b64": lambda say, rows: attention_group(say, rows, timelines=True, batches=(64,),
                                                       q_dtypes=("bfloat16",)),
}


def run_groups(groups: list[str], own: dict, tests=gpu_tests) -> int:
    """A device script's run: its log named by the groups; "tests" first (`tests(say)`; a failure ends the run:
    timings of a kernel that fails its tests would be wasted device time), then each other group in the order
    given (SHARED_GROUPS and the script's own {name: fn(say, rows)}), the rows' table last. An unknown group is
    an error before anything runs."""
    handlers = {**SHARED_GROUPS, **own}
    unknown = [g for g in groups if g != "tests" and g not in handlers]
    if unknown:
        raise SystemExit(f"unknown groups {unknown}; known: tests, {', '.join(handlers)}")
    say, _ = logger(f"{'_'.join(groups)}.log")
    if "tests" in groups and (rc := tests(say)):
        return rc
    rows = []
    for g in groups:
        if g != "tests":
            handlers[g](say, rows)
    say_table(say, rows)
    return 0


def decode_bound_variants() -> dict:
    """The scan as it is and with its decode replaced by moves (wrong scores: what the kernel takes without its
    decode; forty-fifth session: on an H200 the scan takes the H100's microseconds, is the decode what bounds it?)."""
    from experiments.bench_wgmma import NO_DECODE

    return {"default": {}, "moves (no decode, wrong scores)": {"decode_ptx": NO_DECODE}}


def heads_group(say, rows) -> None:
    """Whether the scan's per-tile time follows its tensor and epilogue work (both grow with the heads) or its
    decode (which does not): the same keys with q and w of 8, 16, 32 (the model's) and 64 heads, at 1M x 8 and
    128K x 8, with the decode and without it (moves: wrong scores)."""
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from experiments.bench_wgmma import NO_DECODE

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    for ctx, b in ((1048576, 8), (131072, 8)):
        (q, w, values, scales, reach), moved = scan_case(ctx, b)
        for h in (8, 16, 32, 64):
            qh = jnp.concatenate([q, q[:, ::-1]], axis=1) if h > q.shape[1] else q[:, :h]
            wh = jnp.concatenate([w, -w], axis=1) if h > w.shape[1] else w[:, :h]
            scan_rows(say, rows, f"{ctx} x {b}, {h} heads", (qh, wh, values, scales, reach), moved, peak,
                      {"": {}, "moves (no decode)": {"decode_ptx": NO_DECODE}})


def sm90_group(say, rows) -> None:
    """The scan at SCAN_POINTS (128K x 8 / 32, 1M x 8) with the released nibbles (DECODE_PTX) and with the keys in
    Hopper's word layout (`quant.to_sm90_words`, decoded by SM90_DECODE_PTX: 12 instructions a word against 17),
    each with its error against the Triton twin on the released bytes, after each kind of L2 flush
    (`bench_kernels.FLUSH`), and the attention at batch 64 after each; the Triton pool scan on both layouts at
    128K after the rewrite. A variant that fails is said with its error and the others still run (`guarded`)."""
    import contextlib
    import functools

    import jax

    from dsv41_jax import ops, quant
    from experiments import bench_kernels as bk
    from experiments.device_runs.issue21_alu_decode import scan_error
    from kernels_pallas import gpu_indexer, gpu_indexer_wgmma as scan

    def row(kind, shape, fn, a, moved, want, peak):
        guarded(say, rows, kind, shape,
                lambda: timed_row(say, rows, kind, shape, fn, a, 1, moved, peak, lambda out: scan_error(out, want)))

    @contextlib.contextmanager
    def flushing(mode):
        before, bk.FLUSH = bk.FLUSH, mode
        try:
            yield
        finally:
            bk.FLUSH = before

    modes = ("rewrite", "read")
    peaks = {}
    for mode in modes:
        with flushing(mode):
            peaks[mode] = bk.hbm_copy_bandwidth(1.0)
        say(f"flush {mode}: copy peak {peaks[mode] / 1e9:.0f} GB/s")
    for ctx, b in SCAN_POINTS:  # each point's data, twin and words made once, timed after each flush
        args, moved = scan_case(ctx, b)
        twin = gpu_indexer.indexer_scores(*args)
        sm90 = in_words(args)
        for mode in modes:
            with flushing(mode):
                for name, a, layout in (("released nibbles", args, "nibbles"), ("sm90 words", sm90, "sm90")):
                    row("scan", f"{ctx} x {b}, {name}, {mode} flush",
                        functools.partial(scan.indexer_scores_wgmma, q_parts=1, layout=layout), a, moved, twin,
                        peaks[mode])
        if ctx == 131072:  # the Triton pool scan (a Reindex layer's) on the same words, after the rewrite
            blocks = bk.pool_data(jax.random.key(1), b, ctx)
            pool_moved = b * bk.N_BLOCKS * bk.BLOCK * 72  # keys, scales, scores
            q, w, values, scales, reach = args
            want = ops.indexer_scores_pool_decode(q, w, {"values": values, "scales": scales}, blocks, bk.BLOCK,
                                                  reach, quant.INDEX_KEY)
            with flushing("rewrite"):
                for name, a, layout in (("released nibbles", args, "nibbles"), ("sm90 words", sm90, "sm90")):
                    row("pool scan", f"{ctx} x {b}, {name}",
                        functools.partial(gpu_indexer.indexer_scores_pool, block=bk.BLOCK, layout=layout),
                        (*a[:4], blocks, a[4]), pool_moved, want, peaks["rewrite"])
        del args, sm90, twin
    for mode in modes:
        with flushing(mode):
            attention_group(say, rows, timelines=False, batches=(64,), q_dtypes=("bfloat16",), peak=peaks[mode],
                            label=f", {mode} flush")


# (CTAs, tiles per step, stages) of the words_configs group, the default first. A step's bookkeeping is shared by
# its tiles; 8 tiles a step (1056 CTAs) were asked for in the fifty-fourth session, but a step's keys are one TMA box
# of <= 256 rows (`MAX_TILES_PER_STEP`).
WORDS_CONFIGS = ((4224, 2, 2), (4224, 4, 2), (2112, 4, 2), (4224, 1, 2))


def words_configs_group(say, rows) -> None:
    """The scan (q_parts 1) on the keys in Hopper's words at SCAN_POINTS for each of WORDS_CONFIGS, after the
    read flush, each with its error against the Triton twin on the released nibbles."""
    import functools

    from experiments import bench_kernels as bk
    from experiments.device_runs.issue21_alu_decode import scan_error
    from kernels_pallas import gpu_indexer, gpu_indexer_wgmma as scan

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"flush {bk.FLUSH}: copy peak {peak / 1e9:.0f} GB/s")
    for ctx, b in SCAN_POINTS:
        args, moved = scan_case(ctx, b)
        twin = gpu_indexer.indexer_scores(*args)
        words = in_words(args)
        for ctas, tiles, stages in WORDS_CONFIGS:
            fn = functools.partial(scan.indexer_scores_wgmma, q_parts=1, layout="sm90", ctas=ctas,
                                   tiles_per_step=tiles, stages=stages)
            shape = f"{ctx} x {b}, sm90 words, {ctas} CTAs, {tiles} tiles/step, {stages} stages"
            guarded(say, rows, "scan", shape, lambda fn=fn, shape=shape, words=words, twin=twin: timed_row(
                say, rows, "scan", shape, fn, words, 1, moved, peak, lambda out: scan_error(out, twin)))
        del args, words, twin


def paired_group(say, rows, kind: str, forms: dict, extra_bytes=lambda ctx, b: 0) -> None:
    """The scan's `forms` (label -> f(q, w, values, scales, reach, layout) -> a tuple, its scores first) at
    SCAN_POINTS on the released nibbles and on Hopper's words, after the read flush, each timed, its scores
    scored against the Triton twin, and each form after the first checked bit for bit against the first (the
    err column says so, or at how many places they differ). extra_bytes(ctx, b): bytes moved beyond the scan's."""
    import jax.numpy as jnp
    import numpy as np

    from experiments import bench_kernels as bk
    from experiments.device_runs.issue21_alu_decode import scan_error
    from kernels_pallas import gpu_indexer

    first = next(iter(forms))
    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"flush {bk.FLUSH}: copy peak {peak / 1e9:.0f} GB/s")
    for ctx, b in SCAN_POINTS:
        args, moved = scan_case(ctx, b)
        moved += extra_bytes(ctx, b)
        twin = gpu_indexer.indexer_scores(*args)
        for layout in ("nibbles", "sm90"):
            a, outs = in_words(args) if layout == "sm90" else args, {}

            def run(name, shape, f, a=a, outs=outs, twin=twin):
                def err(out):
                    outs[name] = [np.asarray(x) for x in out]
                    text = f"twin {scan_error(jnp.asarray(outs[name][0]), twin)}"
                    if name != first and first in outs:
                        differ = sum(int(np.sum(x != y)) for x, y in zip(outs[name], outs[first]))
                        text += f"; bit-equal to {first}" if not differ else f"; DIFFERS from {first} at {differ} places"
                    return text

                timed_row(say, rows, kind, shape, f, a, 1, moved, peak, err)

            for name, form in forms.items():
                shape = f"{ctx} x {b}, {layout}, {name}"
                f = lambda *x, form=form, layout=layout: form(*x, layout)  # noqa: E731
                guarded(say, rows, kind, shape, lambda name=name, f=f, shape=shape: run(name, shape, f))
            del a, outs
        del args, twin


def blockmax_group(say, rows) -> None:
    """The scan with the candidate source's block maxima (8 positions) (`paired_group`): the maxima by one XLA
    reduce after the kernel (what the dispatch does while FUSED_BLOCK_MAX is off) against the kernel's epilogue
    (`block=BLOCK`); the scores and the maxima must be equal bit for bit."""
    from kernels_pallas import gpu_indexer_wgmma as scan

    def after(q, w, v, s, r, layout):  # the dispatch's form: the kernel, then XLA's maxima
        out = scan.indexer_scores_wgmma(q, w, v, s, r, q_parts=1, layout=layout)
        return out, out.reshape(out.shape[0], -1, scan.BLOCK).max(axis=-1)

    def fused(q, w, v, s, r, layout):
        return scan.indexer_scores_wgmma(q, w, v, s, r, q_parts=1, layout=layout, block=scan.BLOCK)

    paired_group(say, rows, "scan + maxima", {"XLA maxima after": after, "epilogue maxima": fused},
                 lambda ctx, b: b * ctx // scan.BLOCK * 4)  # the maxima written


def fresh_group(say, rows) -> None:
    """The scan (q_parts 1) with each tile's product by `plgpu.wgmma` into a fresh accumulator (the default)
    against `gpu_wgmma.fresh_product` (its first wgmma does not read the accumulator: no zeroing moves)
    (`paired_group`); the scores must be equal bit for bit."""
    from kernels_pallas import gpu_indexer_wgmma as scan

    def form(fresh: bool):
        return lambda q, w, v, s, r, layout: (scan.indexer_scores_wgmma(q, w, v, s, r, q_parts=1, layout=layout,
                                                                        fresh=fresh),)

    paired_group(say, rows, "scan", {"plgpu.wgmma": form(False), "fresh_product": form(True)})


def early_group(say, rows) -> None:
    """The attention at batch 64 (bf16 q) with its first burst (`gpu_attention_wgmma.EARLY_TILES` tiles' rows and
    q, prefetched at the CTA's start) of the default's tiles, then 0, 1, 2 and 3, each with its timeline, after the read
    flush: there q arrives at 7.7 us of ~24.5 (fifty-second session, H100), the kernel's first third its memory
    phase. The thirty-ninth session's burst of q alone was no faster after the rewrite flush."""
    import jax

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    def use(tiles: int) -> None:  # read when the prefetch is built: its builder's cache and the jit caches go
        att.EARLY_TILES = tiles
        att._prefetch.cache_clear()
        jax.clear_caches()

    before = att.EARLY_TILES
    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"flush {bk.FLUSH}: copy peak {peak / 1e9:.0f} GB/s")
    try:
        for tiles in dict.fromkeys((before, 0, 1, 2, 3)):  # the default first
            use(tiles)
            attention_group(say, rows, timelines=True, batches=(64,), q_dtypes=("bfloat16",), peak=peak,
                            label=f", first burst {tiles} tiles")
    finally:
        use(before)


def main(groups: list[str]) -> int:
    return run_groups(groups, {"sweep": sweep_group, "configs": configs_group, "heads": heads_group,
                               "sm90": sm90_group, "early": early_group, "blockmax": blockmax_group, "fresh": fresh_group,
                               "words_configs": words_configs_group, "batch1": batch1_group,
                               "decode_bound": lambda say, rows: scan_group(
                                   say, rows, timelines=False, variants=decode_bound_variants(),
                                   points=((131072, 8), (1048576, 8))),
                               "defaults": lambda say, rows: scan_group(say, rows, timelines=True, variants=DEFAULTS)})


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["tests", "scan", "attention"]))
