"""Benchmark of the decode kernels against the XLA jnp reference and cuDNN dense attention.

    python -m experiments.bench_kernels [--contexts 8192,131072,1048576] [--batches 1,8,64] [--out FILE.json]

Per (context, batch): the indexer scan over `context` compressed positions (a ratio-1 source, the
largest; by default the scan the model's dispatch takes on this GPU, `--scan-variant f16` for the Triton one),
the selection (top-512 positions + top-2048 candidate blocks of 8 from the scan's block maxima), a
Reindex layer's pool scan (only the 2048 x 8 pool positions of that context, gathered by
block) with its top-512, and the sparse attention (64 heads x 512, 512 selected entries + 128-entry
window). Bytes are counted from the arrays before timing. Peak bandwidth is a device copy measured in
the same run, timed as the scan and the attention are (`hbm_copy_bandwidth`). Dense reference:
`jax.nn.dot_product_attention` (cuDNN) over the uncompressed context, 64 heads x 128 dims MQA, bf16.

Scan and attention are timed from HBM (`time_hbm`): before every call a Pallas kernel rewrites a
256 MB buffer (over 4x the H200's L2), so no input is left in L2, and the time is the GPU time of the
call's own kernels in a profiler trace (the flush excluded). Selection and pool rows use `time_op`,
the median wall time per call of a jitted loop of calls (inputs may stay in L2 there).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsv41_jax import ops, quant
from experiments import _cli
import kernels_pallas
from kernels_pallas import decode, gpu_attention, gpu_attention_wgmma, gpu_indexer, gpu_select

H_IDX, D_IDX, TOPK, N_BLOCKS, BLOCK = 32, 128, 512, 2048, 8
H_ATT, D_ATT, WINDOW = 64, 512, 128
DENSE_HEADS, DENSE_DIM = 64, 128
KW = {}  # {"interpret": True} for the CPU smoke run (--smoke)


# ----------------------------------------------------------------------------- timing
def time_op(fn, args, perturb: int = 0, runs: int = 5, budget_s: float = 0.4):
    """Median seconds per call of fn(*args): a jitted loop of many calls, timed `runs` times.

    The loop carries args[perturb] and the whole output: each call's input gets one element rewritten
    from the previous output, so no call can be hoisted or skipped, and every output is materialized
    (the loop returns it). Pick a small args[perturb]: it is copied once per run, not per call.
    """
    out_struct = jax.eval_shape(fn, *args)

    def loop(n, *a):
        def body(i, carry):
            x, out = carry
            dep = (jax.tree.leaves(out)[0].reshape(-1)[0] * 0).astype(x.dtype)
            x = jax.lax.dynamic_update_slice(x, x[(slice(0, 1),) * x.ndim] + dep, (0,) * x.ndim)
            return x, fn(*a[:perturb], x, *a[perturb + 1:])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_struct)
        return jax.lax.fori_loop(0, n, body, (a[perturb], zeros))

    f = jax.jit(loop)
    jax.block_until_ready(f(1, *args))  # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(f(2, *args))
    one = max((time.perf_counter() - t0) / 2, 1e-6)
    iters = int(min(max(budget_s / runs / one, 3), 2000))
    jax.block_until_ready(f(iters, *args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(iters, *args))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


FLUSH_BYTES = 256 * 2**20  # > 4x the H200's 60 MB L2
_FLUSH_BLOCK = 8192  # uint32 per flush program


# How `l2_flush` evicts the L2: "read" (the buffer read and summed, 8 words written a program: the L2 left holding
# clean lines, as Nsight Compute's cache control leaves it; a decode step's earlier kernels write little, so
# likely closer to the step too, not measured there) or "rewrite" (buf ^ 1: the timed call starts with the L2 full
# of the flush's dirty lines, up to 50-60 MB whose write-backs share the DRAM with the call's reads: the flush's
# cost, not the call's). The rewrite
# was the default until the fifty-second session; then (H100) the scan at 128K x 8 took 37.29 us after it against
# 32.18 after the read (ncu, fiftieth: 33.2), at 1M x 8 227.18 against 219.52 (docs/BENCHMARKS.md).
FLUSH = "read"


def _flush_kernel(buf_ref, x_ref, buf_out, x_out):
    buf_out[...] = buf_ref[...] ^ jnp.uint32(1)
    x_out[...] = x_ref[...]


def _read_flush_kernel(buf_ref, x_ref, sums_out, x_out):
    sums_out[...] = jnp.broadcast_to(jnp.sum(buf_ref[...]), sums_out.shape)
    x_out[...] = x_ref[...]


def l2_flush(buf, x):
    """(buf after the flush, x): evicts the L2 by a pass over the uint32 buffer (`FLUSH`: "rewrite" returns
    buf ^ 1, "read" returns buf as it was) and passes the small array x through, so that a call that reads x runs
    after the flush. One Pallas kernel named l2_flush; x's dims must be powers of two (Triton blocks)."""
    if FLUSH not in ("rewrite", "read"):
        raise ValueError(f"bench_kernels.FLUSH must be 'rewrite' or 'read', got {FLUSH!r}")
    full = lambda i: (0,) * x.ndim
    chunk = pl.BlockSpec((_FLUSH_BLOCK,), lambda i: (i,))
    programs = buf.shape[0] // _FLUSH_BLOCK
    common = dict(grid=(programs,), in_specs=[chunk, pl.BlockSpec(x.shape, full)],
                  compiler_params=plt.CompilerParams(num_warps=4), name="l2_flush", **KW)
    if FLUSH == "read":  # the sums are never read: the kernel runs whole because its x is
        _, x = pl.pallas_call(
            _read_flush_kernel, out_specs=[pl.BlockSpec((8,), lambda i: (i,)), pl.BlockSpec(x.shape, full)],
            out_shape=[jax.ShapeDtypeStruct((programs * 8,), jnp.uint32), jax.ShapeDtypeStruct(x.shape, x.dtype)],
            **common)(buf, x)
        return buf, x
    return pl.pallas_call(
        _flush_kernel, out_specs=[chunk, pl.BlockSpec(x.shape, full)],
        out_shape=[jax.ShapeDtypeStruct(buf.shape, buf.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)],
        input_output_aliases={0: 0}, **common)(buf, x)


PALLAS_NAMES = ("indexer_scores", "sparse_attention", "scan_")  # kernel names (pallas_call name=) in "pallas_us"


KEPT_BYTES = 4 << 30  # `time_hbm` keeps every call's output: fewer calls where they would pass this


def flushed_calls(fn, args, perturb: int, reps: int):
    """(jitted program (buf, *args) -> (buf, [outputs]), calls in it): `reps` x (l2_flush, fn), unrolled, fn's
    args[perturb] passed through the flush, every call's args its own values (an optimization barrier with the
    flushed buffer: XLA merges no work of the calls), the next flush after the call, every output kept (fewer
    calls where they would pass KEPT_BYTES). `time_hbm`'s program; buf is donated."""
    out_bytes = sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(jax.eval_shape(fn, *args)))
    reps = max(2, min(reps, KEPT_BYTES // max(out_bytes, 1)))

    def calls(buf, *a):
        x, outs = a[perturb], []
        for _ in range(reps):
            buf, x = l2_flush(buf, x)
            buf, call_args = jax.lax.optimization_barrier((buf, (*a[:perturb], x, *a[perturb + 1:])))
            out = fn(*call_args)
            buf, out = jax.lax.optimization_barrier((buf, out))
            outs.append(out)
        return buf, outs

    return jax.jit(calls, donate_argnums=0), reps


def time_hbm(fn, args, perturb: int, reps: int = 20, top: int = 8) -> tuple[float, dict]:
    """(GPU seconds per call of fn(*args), details) with the L2 flushed before every call: `time_hbm_output`'s
    first two."""
    return time_hbm_output(fn, args, perturb, reps, top)[:2]


def time_hbm_output(fn, args, perturb: int, reps: int = 20, top: int = 8) -> tuple[float, dict, object]:
    """(GPU seconds per call of fn(*args), details, fn's output in the warm-up's first call) with the L2 flushed
    before every call: the output comes from the timed program, so a check of it compiles nothing more.

    `flushed_calls`' program (fn's args[perturb] passed through the flush: pick a small array with power-of-two
    dims); from a profiler trace: all GPU time except the flush's (the call's kernels: the Pallas kernels and
    XLA's small ones around them), per call. An unrolled program since the thirty-seventh session: a fori_loop's
    counter add and carry copies (~2.6 us a call in the H100's profile, 4 kernels) were counted as the call's.
    details: us of the kernels named in PALLAS_NAMES, kernels per call, us of the `top` longest kernels by name.
    With --smoke (CPU), wall time per call of the same program.
    """
    from experiments.bench_decode import kernel_profile  # imported here: bench_decode imports this module

    f, reps = flushed_calls(fn, args, perturb, reps)
    buf = jnp.zeros((FLUSH_BYTES // 4 if not KW else _FLUSH_BLOCK,), jnp.uint32)
    buf, outs = jax.block_until_ready(f(buf, *args))  # compile + warm-up
    out = outs[0]
    del outs
    if KW:  # smoke run on CPU: no GPU trace
        t0 = time.perf_counter()
        jax.block_until_ready(f(buf, *args))
        return (time.perf_counter() - t0) / reps, {}, out
    state = {"buf": buf}

    def run():
        state["buf"] = jax.block_until_ready(f(state["buf"], *args))[0]

    with tempfile.TemporaryDirectory() as tmp:
        rows = kernel_profile(run, tmp, reps, top=1000)[1:]
    mine = [r for r in rows if not r["name"].startswith("l2_flush")]
    us = sum(r["us_per_step"] for r in mine)
    pallas = sum(r["us_per_step"] for r in mine if r["name"].startswith(PALLAS_NAMES))
    return us * 1e-6, {"pallas_us": round(pallas, 2), "kernels": round(sum(r["calls_per_step"] for r in mine), 1),
                       "by_kernel": {r["name"][:48]: round(r["us_per_step"], 2) for r in mine[:top]}}, out


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a device copy (read + write) through XLA, timed as `time_op` times (wall time of a jitted loop:
    the peak for wall-timed rows, e.g. bench_decode's steps)."""
    n = int(gib * 2**30 // 4)
    x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
    t = time_op(lambda x: x ^ jnp.uint32(0x5A5A5A5A), (x,), perturb=0, runs=7)
    del x
    return 2 * n * 4 / t


def hbm_copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a device copy (read + write) of `gib` GiB timed as `time_hbm` times the kernels (the GPU time of
    its kernels in a profiler trace: no launch gaps, no loop counter): the peak for `time_hbm` rows. The H100 and
    H200 copy 10-17% faster timed so than `copy_bandwidth` says (docs/BENCHMARKS.md, forty-second session)."""
    x = jax.random.bits(jax.random.key(1), (int(gib * 2**30 // 4),), jnp.uint32)
    t, _ = time_hbm(lambda s, x: x ^ s[0], (jnp.full((8,), 0x5A5A5A5A, jnp.uint32), x), perturb=0)
    return 2 * x.nbytes / t


# ----------------------------------------------------------------------------- data
def random_bytes(key, shape):
    """Random uint8 drawn as uint32 words (drawing uint8 directly makes a 4x larger temporary)."""
    words = jax.random.bits(key, (*shape[:-1], shape[-1] // 4), jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


def random_bf16(key, shape):
    """Random bf16 in +-[1, 2) from raw bits (no f32 temporary at 16 GB sizes)."""
    bits = random_bytes(key, (*shape[:-1], shape[-1] * 2)).reshape(*shape, 2)
    bits = jax.lax.bitcast_convert_type(bits, jnp.uint16)
    return jax.lax.bitcast_convert_type((bits & 0x807F) | 0x3F80, jnp.bfloat16)


def index_data(key, b, n):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = quant.fake_quant(quant.INDEX_KEY, jax.random.normal(k1, (b, H_IDX, D_IDX)))
    w = jax.random.normal(k2, (b, H_IDX)) * H_IDX ** -0.5
    values = random_bytes(k3, (b, n, D_IDX // 2))
    scales = jax.random.randint(k4, (b, n, D_IDX // 32), 124, 130).astype(jnp.uint8)
    return q, w, {"values": values, "scales": scales}


def attention_data(key, b, n, q_dtype=jnp.bfloat16):
    """(q [b, 64, 512] in q_dtype: bf16 is what the model's attention feeds the kernels (f32 until the thirty-sixth
    session: the device scripts of issue 21 before it pass float32 to repeat their runs), the window records, their
    validity, n entry records, TOPK sorted entry ids per sequence, the sink)."""
    ks = jax.random.split(key, 7)
    q = jax.random.normal(ks[0], (b, H_ATT, D_ATT)).astype(q_dtype)
    window = {"values": random_bytes(ks[1], (b, WINDOW, D_ATT)) & 0xF7,  # E4M3 without the NaN bytes
              "scales": jax.random.randint(ks[2], (b, WINDOW, D_ATT // 32), 118, 124).astype(jnp.uint8)}
    entries = {"values": random_bytes(ks[3], (b, n, D_ATT // 2)),
               "scales": jax.random.randint(ks[4], (b, n, D_ATT // 16), 0x28, 0x40).astype(jnp.uint8)}
    idx = jnp.sort(jax.random.randint(ks[5], (b, TOPK), 0, n), axis=-1)
    sink = jax.random.normal(ks[6], (H_ATT,))
    return q, window, jnp.ones((b, WINDOW), bool), entries, idx.astype(jnp.int32), sink


def attention_args(q, window, wvalid, entries, idx, sink) -> tuple:
    """`attention_data`'s records as the attention kernels' positional arguments: (q, window values, window scales,
    validity, entry values, entry scales, idx, sink)."""
    return q, window["values"], window["scales"], wvalid, entries["values"], entries["scales"], idx, sink


def attention_bytes(q, window, wvalid, entries, idx, out_dtype=jnp.float32) -> int:
    """Bytes a sparse-attention call must move: q, the window and its validity, the TOPK gathered entry rows
    (values and scales), idx, and the output in out_dtype (f32: the kernels' contract; the model's call takes it
    in its dtype, with the rope's angles to turn it back, counted by the caller)."""
    rows_read = {"values": entries["values"][:, :TOPK], "scales": entries["scales"][:, :TOPK]}
    b = q.shape[0]
    return nbytes(q, window, wvalid, rows_read, idx) + b * H_ATT * D_ATT * jnp.dtype(out_dtype).itemsize


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| (L2 over all elements) in float32, out in any float dtype: the attention rows' error."""
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def max_rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| over all elements: the scans' and the weight matmuls' error."""
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


def nbytes(*trees) -> int:
    return sum(int(x.size) * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t))


# ----------------------------------------------------------------------------- one configuration
class Rows:
    """Collects result rows of one (context, batch) and prints each as it comes."""

    def __init__(self, ctx, b, peak):
        self.ctx, self.b, self.peak, self.rows = ctx, b, peak, []

    def add(self, piece, impl, t, moved, **extra):
        self.rows.append({"context": self.ctx, "batch": self.b, "piece": piece, "impl": impl, "us": t * 1e6,
                          "bytes": moved, "GBps": moved / t / 1e9, "frac_peak": moved / t / self.peak, **extra})
        print(f"  {piece:10s} {impl:24s} {t * 1e6:10.1f} us  {moved / 1e6:9.1f} MB  {moved / t / 1e9:7.0f} GB/s"
              f"  {100 * moved / t / self.peak:5.1f}% peak  {extra if extra else ''}", flush=True)
        return t

    def note(self, piece, impl, **extra):
        self.rows.append({"context": self.ctx, "batch": self.b, "piece": piece, "impl": impl, **extra})
        print(f"  {piece:10s} {impl:24s} {extra}", flush=True)


def bench_scan_and_select(rec_rows: Rows, key, args):
    ctx, b = rec_rows.ctx, rec_rows.b
    reach = jnp.full((b,), ctx, jnp.int32)
    q, w, rec = index_data(key, b, ctx)
    if args.scan_variant == "dispatch":  # what the model calls: the wgmma scan on an H100/H200, else Triton f16
        scan = lambda q, w, v, s, r: kernels_pallas.indexer_scores_decode(q, w, {"values": v, "scales": s}, r,
                                                                          block=BLOCK)
    else:
        scan = lambda q, w, v, s, r: gpu_indexer.indexer_scores(q, w, v, s, r, block=BLOCK, block_n=args.block_n,
                                                                 num_warps=args.warps, **KW)
    scan_args = (q, w, rec["values"], rec["scales"], reach)
    moved = nbytes(rec) + b * ctx * 4 + b * (ctx // BLOCK) * 4 + nbytes(q, w)
    t, info, (scores, bmax) = time_hbm_output(scan, scan_args, perturb=1)
    t_scan = rec_rows.add("indexer", f"pallas {args.scan_variant}", t, moved, **info)
    if b * ctx * (D_IDX * 4 + H_IDX * 4) < args.ref_limit_gb * 1e9:
        ref_fn = lambda q, w, v, s, r: ops.indexer_scores_decode(q, w, {"values": v, "scales": s}, r,
                                                                 quant.INDEX_KEY)
        t_ref, _, ref = time_hbm_output(ref_fn, scan_args, perturb=1)
        err = max_rel_err(scores, ref)
        del ref
        rec_rows.add("indexer", "xla-ref", t_ref, moved, speedup=t_ref / t_scan, max_rel_err=err)
    else:
        rec_rows.note("indexer", "xla-ref", skipped=f"jnp temporaries over {args.ref_limit_gb} GB")
    del rec, scan_args
    gc.collect()
    if "select" not in args.only:
        return

    def select_both(scores, bmax, r):
        lv = gpu_select.build_levels(scores, TOPK, first=bmax)
        top = gpu_select.topk_from_levels(lv, TOPK, **KW)
        blocks = gpu_select.select_topk(ops.pin_newest_block(bmax, r, BLOCK), N_BLOCKS, **KW)  # the scan's maxima
        return top, blocks[:, None]

    def select_ref(scores, r):
        return ops.select_topk(scores, TOPK), ops.candidate_blocks(scores[:, None], r[:, None], N_BLOCKS, BLOCK)

    got, ref = select_both(scores, bmax, reach), select_ref(scores, reach)
    exact = bool(jnp.array_equal(got[0], ref[0]) and jnp.array_equal(got[1][:, 0], ref[1][:, 0]))
    del got, ref
    moved = b * ctx * 4 + b * (ctx // BLOCK) * 4 + b * (TOPK + N_BLOCKS) * 4
    t_sel = time_op(select_both, (scores, bmax, reach))
    rec_rows.add("select", "pallas (512 + blocks)", t_sel, moved, frac_of_scan=t_sel / t_scan, exact=exact)
    t_one = time_op(lambda s: gpu_select.select_topk(s, TOPK, **KW), (scores,))
    rec_rows.add("select", "pallas top-512 alone", t_one, b * ctx * 4 + b * TOPK * 4, frac_of_scan=t_one / t_scan)
    t_ref = time_op(select_ref, (scores, reach), runs=3)
    rec_rows.add("select", "xla-ref (lax.top_k)", t_ref, moved, speedup=t_ref / t_sel)


def pool_data(key, b, ctx):
    """int32 [B, N_BLOCKS]: distinct random block ids of a `ctx`-position row, ascending, -1 padded (a
    pool as `ops.candidate_blocks` returns it; short contexts fill it only partly)."""
    nb = ctx // BLOCK
    take = min(N_BLOCKS, nb)
    ids = jax.vmap(lambda k: jnp.sort(jax.random.choice(k, nb, (take,), replace=False)))(jax.random.split(key, b))
    return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, N_BLOCKS - take)), constant_values=-1)


def bench_pool(rec_rows: Rows, key, args):
    """A Reindex layer's decode: scan only the candidate pool (N_BLOCKS x BLOCK positions gathered by block
    from a `ctx`-entry key cache) and select top-512 among them, vs the jnp reference (gather, then
    score) and vs the full scan of the same context timed above."""
    ctx, b = rec_rows.ctx, rec_rows.b
    reach = jnp.full((b,), ctx, jnp.int32)
    q, w, rec = index_data(key, b, ctx)
    blocks = pool_data(jax.random.fold_in(key, 1), b, ctx)
    scan = lambda q, w, v, s, bl, r: gpu_indexer.indexer_scores_pool(q, w, v, s, bl, r, block=BLOCK,
                                                                      block_n=args.block_n, num_warps=args.warps,
                                                                      **KW)
    ref_scan = lambda q, w, v, s, bl, r: ops.indexer_scores_pool_decode(q, w, {"values": v, "scales": s}, bl, BLOCK,
                                                                         r, quant.INDEX_KEY)
    args_ = (q, w, rec["values"], rec["scales"], blocks, reach)
    scores, ref = scan(*args_), ref_scan(*args_)
    fin = jnp.isfinite(ref)
    err = float(jnp.max(jnp.where(fin, jnp.abs(ref - scores), 0)) / jnp.max(jnp.where(fin, jnp.abs(ref), 0)))
    same_inf = bool(jnp.array_equal(fin, jnp.isfinite(scores)))
    pool_rows = b * N_BLOCKS * BLOCK  # score slots written; keys are read for the non-empty blocks only
    moved = int(jnp.sum(blocks >= 0)) * BLOCK * (D_IDX // 2 + D_IDX // 32) + pool_rows * 4 + nbytes(blocks, q, w)
    full = next((r for r in rec_rows.rows if r["piece"] == "indexer" and r["impl"].startswith("pallas")), {})
    t = time_op(scan, args_)
    rec_rows.add("pool-scan", "pallas", t, moved, max_rel_err=err, same_inf=same_inf,
                 frac_of_full_scan=t / full["us"] * 1e6 if full else None)
    t_ref = time_op(ref_scan, args_)
    rec_rows.add("pool-scan", "xla-ref", t_ref, moved, speedup=t_ref / t)

    def select(scores, bl):
        return ops.pool_topk_positions(gpu_select.select_topk(scores, TOPK, **KW), bl, BLOCK)

    exact = bool(jnp.array_equal(select(scores, blocks),
                                 ops.pool_topk_positions(ops.select_topk(scores, TOPK), blocks, BLOCK)))
    t_sel = time_op(select, (scores, blocks))
    rec_rows.add("pool-sel", "pallas top-512", t_sel, pool_rows * 4 + b * TOPK * 4, frac_of_pool_scan=t_sel / t,
                 exact=exact)
    del args_, rec, scores, ref
    gc.collect()


def bench_attention(rec_rows: Rows, key, args):
    ctx, b = rec_rows.ctx, rec_rows.b
    q, window, wvalid, entries, idx, sink = attention_data(key, b, ctx)
    scale = D_ATT ** -0.5
    moved = attention_bytes(q, window, wvalid, entries, idx)
    splits = args.splits or (gpu_attention_wgmma.default_splits(b, (WINDOW + TOPK) // gpu_attention_wgmma.T)
                             if args.att_variant == "wgmma" else gpu_attention.default_splits(b))
    # the dispatch picks its kernel and ranges by the batch: --splits is not used
    impl = "pallas dispatch" if args.att_variant == "dispatch" else f"pallas {args.att_variant} (splits={splits})"

    def attn(q, wv, ws, ok, ev, es, idx, sink):
        if args.att_variant == "dispatch":
            return kernels_pallas.sparse_attention_decode(q, {"values": wv, "scales": ws}, ok,
                                                          {"values": ev, "scales": es}, idx, sink, scale)
        if args.att_variant == "wgmma":
            return gpu_attention_wgmma.sparse_attention_wgmma(q, wv, ws, ok, ev, es, idx, sink, scale, splits=splits)
        return gpu_attention.sparse_attention(q, wv, ws, ok, ev, es, idx, sink, scale, splits=splits,
                                              block_k=args.block_k, head_block=args.head_block,
                                              num_warps=args.att_warps, **KW)

    def attn_ref(q, wv, ws, ok, ev, es, idx, sink):
        return ops.sparse_attention_decode(q, {"values": wv, "scales": ws}, ok, quant.WINDOW_KV,
                                           {"values": ev, "scales": es}, idx, quant.MAIN_KV, sink, scale)

    a_args = attention_args(q, window, wvalid, entries, idx, sink)
    t_att, info, out = time_hbm_output(attn, a_args, perturb=7)
    t_ref, _, ref = time_hbm_output(attn_ref, a_args, perturb=7)
    err = rel_err(out, ref)
    del ref, out
    rec_rows.add("attention", impl, t_att, moved, rel_err=err, **info)
    rec_rows.add("attention", "xla-ref", t_ref, moved, speedup=t_ref / t_att)
    del a_args, q, window, entries
    gc.collect()

    dense_bytes = 2 * b * ctx * DENSE_DIM * 2
    if dense_bytes > args.dense_limit_gb * 1e9:
        rec_rows.note("dense", "skipped", reason=f"K+V {dense_bytes / 1e9:.0f} GB over --dense-limit-gb")
        return
    kk = jax.random.split(key, 3)
    dq = random_bf16(kk[0], (b, 1, DENSE_HEADS, DENSE_DIM))
    dk = random_bf16(kk[1], (b, ctx, 1, DENSE_DIM))
    dv = random_bf16(kk[2], (b, ctx, 1, DENSE_DIM))
    for impl in ("xla",) if args.smoke else ("cudnn", "xla"):
        try:
            dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl)
            t_dense = time_op(dense, (dq, dk, dv), runs=3)
            rec_rows.add("dense", impl, t_dense, dense_bytes + nbytes(dq) * 2, sparse_speedup=t_dense / t_att)
            break
        except Exception as e:  # cuDNN refuses some shapes: record it and time XLA's instead
            rec_rows.note("dense", impl, error=str(e)[:200])


# ----------------------------------------------------------------------------- where the scan's time goes
STAGES = ("read", "decode", "split-dot")


def _stage_kernel(qe_ref, qo_ref, w_ref, kv_ref, ks_ref, s_ref, *, n: int, tn: int, stage: str):
    """The scan's tile loop cut after one stage, same grid, loads and output as `gpu_indexer`:
    read = load the key bytes and exponents and sum them; decode = also decode and scale them to float16
    as the scan does (interleave included) and sum; split-dot = the whole score without the interleave:
    even and odd channels (low and high nibbles) scaled in place and dotted with q's even and odd rows
    (two K = D/2 dots)."""
    b, t = pl.program_id(0), pl.program_id(1)
    n0 = t * tn
    in_range = n0 + jnp.arange(tn) < n
    kb = plt.load(kv_ref.at[b, pl.ds(n0, tn), :], mask=in_range[:, None], other=0)  # [TN, D/2]
    e = plt.load(ks_ref.at[b, pl.ds(n0, tn), :], mask=in_range[:, None], other=127).astype(jnp.int32)
    groups, half = e.shape[1], kb.shape[1]
    if stage == "read":
        s = (jnp.sum(kb.astype(jnp.int32), axis=1) + jnp.sum(e, axis=1)).astype(jnp.float32)
    elif stage == "decode":
        s = gpu_indexer._decoded_keys(kb, gpu_indexer._group_scales(e)[1], groups).astype(jnp.float32).sum(axis=1)
    else:
        e_max, rel = gpu_indexer._group_scales(e)
        rel = jnp.broadcast_to(rel[:, :, None], (tn, groups, half // groups)).reshape(tn, half)
        lo, hi = decode.nibbles(kb)
        logits = (jnp.dot(decode.fp4_as_f16(lo) * rel, qe_ref[b], preferred_element_type=jnp.float32)
                  + jnp.dot(decode.fp4_as_f16(hi) * rel, qo_ref[b], preferred_element_type=jnp.float32))
        s = jnp.sum(jnp.maximum(logits, 0.0) * w_ref[b, :][None, :], axis=1) * decode.e8m0_f32(e_max)
    plt.store(s_ref.at[b, pl.ds(n0, tn)], s, mask=in_range)


@functools.partial(jax.jit, static_argnames=("stage", "block_n", "num_warps", "interpret"))
def scan_stage(q, w, values, scales, *, stage: str, block_n: int, num_warps: int, interpret: bool = False):
    """f32 [B, N] from `_stage_kernel` (for stage split-dot: the scores, unmasked)."""
    b, n = values.shape[:2]
    qt, wn = gpu_indexer.prepare_query(q, w)
    return pl.pallas_call(
        functools.partial(_stage_kernel, n=n, tn=block_n, stage=stage), grid=(b, pl.cdiv(n, block_n)),
        out_shape=jax.ShapeDtypeStruct((b, n), jnp.float32), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=3), name=f"scan_{stage}",
    )(qt[:, 0::2], qt[:, 1::2], wn, values, scales)


def bench_scan_stages(rec_rows: Rows, key, args):
    """Each stage of the scan timed alone, against the full scan (`--only stages`)."""
    ctx, b = rec_rows.ctx, rec_rows.b
    q, w, rec = index_data(key, b, ctx)
    moved = nbytes(rec) + b * ctx * 4
    full = gpu_indexer.indexer_scores(q, w, rec["values"], rec["scales"], jnp.full((b,), ctx, jnp.int32),
                                      block_n=args.block_n, num_warps=args.warps, **KW)
    for stage in STAGES:
        fn = functools.partial(scan_stage, stage=stage, block_n=args.block_n, num_warps=args.warps, **KW)
        extra = {}
        if stage == "split-dot":
            extra["max_rel_err_vs_scan"] = max_rel_err(fn(q, w, rec["values"], rec["scales"]), full)
        rec_rows.add("scan-stage", stage, time_op(fn, (q, w, rec["values"], rec["scales"])), moved, **extra)


def bench_config(ctx: int, b: int, peak: float, args) -> list[dict]:
    rows = Rows(ctx, b, peak)
    key = jax.random.key(ctx + b)
    if "indexer" in args.only or "select" in args.only:
        bench_scan_and_select(rows, key, args)
        gc.collect()
    if "stages" in args.only:
        bench_scan_stages(rows, key, args)
        gc.collect()
    if "pool" in args.only:
        bench_pool(rows, key, args)
        gc.collect()
    if "attention" in args.only:
        bench_attention(rows, key, args)
        gc.collect()
    return rows.rows


PIECES = ("indexer", "select", "pool", "attention", "stages")


def positive_ints(text: str) -> list[int]:
    """argparse type: '8192,131072' -> [8192, 131072]."""
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8,64") from None
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return vals


def pieces(text: str) -> str:
    """argparse type: comma-separated names of PIECES."""
    bad = [x for x in text.split(",") if x not in PIECES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown piece(s) {bad}; choose from {','.join(PIECES)}")
    return text


@_cli.entry_point
def main(argv=None):
    global FLUSH
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default=None, type=positive_ints,
                   help="comma-separated (default 8192,131072,1048576; with --smoke 8192)")
    p.add_argument("--batches", default=None, type=positive_ints, help="comma-separated (default 1,8,64; with --smoke 1)")
    p.add_argument("--out", default=None, help="save every row as JSON")
    p.add_argument("--block-n", type=int, default=256)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--block-k", type=int, default=32)
    p.add_argument("--att-warps", type=int, default=8)
    p.add_argument("--splits", type=int, default=0, help="attention splits (0: fill the GPU)")
    p.add_argument("--scan-variant", default="dispatch", choices=("dispatch", "f16"),
                   help="dispatch: the scan kernels_pallas.indexer_scores_decode takes on this GPU (the wgmma "
                        "scan on an H100/H200); f16: the Triton scan, with --block-n / --warps")
    p.add_argument("--att-variant", default="flash", choices=("flash", "wgmma", "dispatch"),
                   help="flash: the Triton kernel (kernels_pallas.gpu_attention) with --block-k / --att-warps / "
                        "--head-block; wgmma: the Hopper kernel (kernels_pallas.gpu_attention_wgmma; --splits 0 = its "
                        "default); dispatch: what the model runs (kernels_pallas.sparse_attention_decode: on an "
                        "H100/H200 the wgmma kernel from batch 2, the Triton kernel with its batch's tiles below)")
    p.add_argument("--head-block", type=int, default=None, help="flash attention: heads per program")
    p.add_argument("--ref-limit-gb", type=float, default=40.0, help="skip the jnp indexer above this temp size")
    p.add_argument("--dense-limit-gb", type=float, default=40.0)
    p.add_argument("--only", default="indexer,select,pool,attention", type=pieces,
                   help="pieces to time (also: stages, the scan cut after each stage)")
    p.add_argument("--flush", default=FLUSH, choices=("read", "rewrite"),
                   help="how the L2 is evicted before each timed call (read: clean lines left, as ncu; rewrite: "
                        "dirty lines whose write-backs the call shares the DRAM with)")
    p.add_argument("--smoke", action="store_true", help="CPU check of this script (interpret mode, tiny)")
    args = p.parse_args(argv)
    _cli.output_file(args.out, "--out")
    FLUSH = args.flush
    if args.smoke:
        KW["interpret"] = True
    elif jax.default_backend() != "gpu":
        raise _cli.UserError(f"bench_kernels times the Triton kernels and this backend is {jax.default_backend()}: "
                             "run it on a GPU machine (or add --smoke for a CPU check of the script)")
    args.contexts = args.contexts or ([8192] if args.smoke else [8192, 131072, 1048576])
    args.batches = args.batches or ([1] if args.smoke else [1, 8, 64])
    dev = jax.devices()[0]
    peak = hbm_copy_bandwidth(0.05 if args.smoke else 1.0)
    print(f"device {dev.device_kind}; copy bandwidth {peak / 1e9:.0f} GB/s (read + write, timed as the kernels), "
          f"used as peak; the L2 flushed by a {FLUSH} before each call")
    rows = [{"piece": "copy", "GBps": peak / 1e9, "device": dev.device_kind}]
    for ctx in args.contexts:
        for b in args.batches:
            print(f"context {ctx}, batch {b}", flush=True)
            try:
                rows += bench_config(ctx, b, peak, args)
            except Exception as e:  # e.g. out of memory: record and go on
                rows.append({"context": ctx, "batch": b, "error": str(e)[:300]})
                print(f"  failed: {str(e)[:300]}")
            gc.collect()
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    print_table(rows, peak)


def print_table(rows, peak):
    print(f"\nsummary (peak = copy {peak / 1e9:.0f} GB/s)")
    print(f"{'ctx':>8} {'B':>3} | {'scan us':>8} {'%pk':>5} {'x ref':>6} | {'sel us':>7} {'sel/scan':>8} "
          f"{'x ref':>6} | {'pool us':>7} {'/scan':>5} | {'attn us':>7} {'%pk':>5} {'x ref':>6} {'x dense':>7}")
    key = lambda r: (r.get("context"), r.get("batch"))
    for ck in sorted({key(r) for r in rows if "context" in r}):
        rs = [r for r in rows if key(r) == ck]
        get = lambda piece, impl: next((r for r in rs if r.get("piece") == piece and
                                        str(r.get("impl", "")).startswith(impl)), {})
        sc, sl, dn = get("indexer", "pallas"), get("select", "pallas ("), \
            next((r for r in rs if r.get("piece") == "dense" and "us" in r), {})
        at = min((r for r in rs if r.get("piece") == "attention" and r["impl"].startswith("pallas")),
                 key=lambda r: r["us"], default={})
        pool = get("pool-scan", "pallas")
        f = lambda r, k, fmt: format(r[k], fmt) if k in r and r[k] is not None else "-"
        print(f"{ck[0]:>8} {ck[1]:>3} | {f(sc, 'us', '8.1f')} {f(sc, 'frac_peak', '5.2f')} "
              f"{f(get('indexer', 'xla'), 'speedup', '6.1f')} | {f(sl, 'us', '7.1f')} {f(sl, 'frac_of_scan', '8.2f')} "
              f"{f(get('select', 'xla'), 'speedup', '6.1f')} | {f(pool, 'us', '7.1f')} "
              f"{f(pool, 'frac_of_full_scan', '5.2f')} | {f(at, 'us', '7.1f')} {f(at, 'frac_peak', '5.2f')} "
              f"{f(get('attention', 'xla'), 'speedup', '6.1f')} {f(dn, 'sparse_speedup', '7.1f')}")


if __name__ == "__main__":
    main()
