"""Exact top-k selection on GPU (Pallas, Triton lowering): `ops.select_topk` without a sort.

No Pallas backend lowers `top_k`, and `lax.top_k` over 1M columns costs milliseconds. The scan has
already produced the row (level 0) and, cheaply, its maxima over blocks of 8, 64, 512, ... (level l =
max over 8 entries of level l-1). One program per row walks that pyramid from the top:

  at each level it holds at most 8k candidate entries (block maxima, ascending positions; the top level up
  to 16k, `top_capacity`: one search over 8k-16k entries costs less than two levels), finds the
  k-th largest key among them by a bitwise search of up to 32 steps (count >= candidate, a block reduction;
  it stops once exactly k keys are at or above its prefix: 13-26 steps on distinct scores, `python -m
  experiments.select_steps`), and
  keeps only the children of the blocks at or above it: fewer than k blocks when their maxima are
  strictly above it, at most k when ties are taken too. Any block holding a top-k element has its
  maximum at or above the true k-th largest value, so nothing of the answer is dropped.

At level 0 the candidates are elements; the threshold T = max(bound, k-th largest candidate). The
output is every element > T plus the lowest positions among those == T, written in position order by a
prefix sum. Only if ties at T were dropped on the way (more than k blocks tied at a bound) does the
program rescan the whole row in position order; that path is exact and slow, and real scores hit it
only on exact ties. Work per row: a few levels x <= 32 reductions over <= 8k entries, plus the pyramid
(1/7 of the row's bytes, written by the indexer kernel or by one XLA reduction).

A row of at most k entries (a single level) skips the search: every entry above -inf is kept. Ordering uses
`decode.ordered_key` (the float total order of `lax.top_k`): -inf is never selected,
-0 < +0, ties go to the lowest position. NaN scores are not supported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import decode

FANOUT = 8  # entries of level l-1 under one entry of level l


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def capacity(k: int) -> tuple[int, int]:
    """(parents kept per level, candidates per level) as the powers of two Triton tensors need."""
    kp = _pow2(k)
    return kp, kp * FANOUT


def top_capacity(k: int) -> int:
    """Entries the top level may hold: twice a level's candidates. H200, one row of 4352 (top-512 at 4K in the
    slice, twenty-fifth session): one level of 8192 took 17.4 us at 8 warps, two levels (544 block maxima, then
    4096 candidates) 24.6 us plus the XLA kernel that builds the second level."""
    return 2 * capacity(k)[1]


def build_levels(scores_rn: jax.Array, k: int, first: jax.Array | None = None) -> list[jax.Array]:
    """[scores, max over 8, max over 64, ...] until a level fits the top level's capacity (`top_capacity`).

    `first` may pass level 1 when the scan already wrote it (blocks of 8, -inf padded).
    """
    levels = [scores_rn]
    while levels[-1].shape[-1] > top_capacity(k):
        if len(levels) == 1 and first is not None:
            levels.append(first)
            continue
        x = levels[-1]
        n = x.shape[-1]
        nb = -(-n // FANOUT)
        x = jnp.pad(x, ((0, 0), (0, nb * FANOUT - n)), constant_values=-jnp.inf)
        levels.append(x.reshape(x.shape[0], nb, FANOUT).max(axis=-1))
    return levels


def _load_keys(ref, r, idx, valid):
    x = plt.load(ref.at[r, idx], mask=valid, other=-jnp.inf)
    return jnp.where(valid, decode.ordered_key(x), decode.EMPTY_KEY)


def _kernel(*refs, sizes: tuple[int, ...], k: int, kp: int, cap: int, top_width: int, interpret: bool):
    n_lv = len(sizes)
    lv_refs, out_ref, scratch_ref = refs[:n_lv], refs[n_lv], refs[n_lv + 1]
    r = pl.program_id(0)
    top = n_lv - 1
    ids = jnp.arange(top_width)  # the top level: at most 2 cap entries, often far fewer
    valid = ids < sizes[top]
    keys = _load_keys(lv_refs[top], r, ids, valid)
    ids = jnp.where(valid, ids, -1)
    bound = jnp.int32(decode.NEG_INF_KEY)
    complete = jnp.bool_(True)
    for lvl in range(top, 0, -1):
        _, x, n_x = decode.kth_search(keys, k, floor=bound)  # n_x = #(keys >= x)
        new_bound = jnp.maximum(bound, x)
        # ties taken when at most k keys are >= new_bound: x >= bound is counted by the search; below the bound,
        # x ran all 32 steps (an early stop is >= its floor) to the largest value with k keys >= it, so fewer
        # than k are >= the bound
        take_ties = (x < bound) | (n_x <= k)
        complete = ((new_bound > bound) | complete) & take_ties
        chosen = jnp.where(take_ties, keys >= new_bound, keys > new_bound)
        dest = jnp.cumsum(chosen.astype(jnp.int32)) - 1
        plt.store(scratch_ref.at[r, lvl - 1, jnp.where(chosen, dest, kp)], ids, mask=chosen)
        if not interpret:  # (interpret mode runs one thread and has no barrier rule)
            plt.debug_barrier()  # the compacted parents are read back by other threads
        slot = jnp.arange(kp)
        parents = plt.load(scratch_ref.at[r, lvl - 1, slot], mask=slot < jnp.sum(chosen.astype(jnp.int32)),
                           other=-1)
        child = (parents[:, None] * FANOUT + jnp.arange(FANOUT)[None, :]).reshape(cap)
        valid = (jnp.broadcast_to(parents[:, None] >= 0, (kp, FANOUT)).reshape(cap)
                 & (child < sizes[lvl - 1]))
        keys = _load_keys(lv_refs[lvl - 1], r, jnp.where(valid, child, 0), valid)
        ids = jnp.where(valid, child, -1)
        bound = new_bound

    # A row of at most k entries keeps every one above -inf: no threshold to search (a candidate-block row at
    # contexts up to k blocks, a top-k row up to k positions).
    thr = bound if top == 0 and sizes[0] <= k else jnp.maximum(bound, decode.kth_key(keys, k, floor=bound))
    quota = k - jnp.sum((keys > thr).astype(jnp.int32))
    ties_count = thr > decode.NEG_INF_KEY  # -inf is never selected
    rescan = (thr == bound) & jnp.logical_not(complete) & ties_count

    def pick(keys, pos, n_sel, n_eq):
        """Select > thr and the first `quota` == thr of a chunk in position order; returns counts."""
        gt = keys > thr
        eq = (keys == thr) & ties_count
        eq_rank = n_eq + jnp.cumsum(eq.astype(jnp.int32)) - 1
        sel = gt | (eq & (eq_rank < quota))
        rank = n_sel + jnp.cumsum(sel.astype(jnp.int32)) - 1
        plt.store(out_ref.at[r, jnp.where(sel, rank, kp)], pos, mask=sel)
        return n_sel + jnp.sum(sel.astype(jnp.int32)), n_eq + jnp.sum(eq.astype(jnp.int32))

    def from_candidates():
        return pick(keys, ids, jnp.int32(0), jnp.int32(0))[0]

    def from_row():
        def body(c, carry):
            pos = c * cap + jnp.arange(cap)
            ok = pos < sizes[0]
            return pick(_load_keys(lv_refs[0], r, jnp.where(ok, pos, 0), ok), pos, *carry)
        return jax.lax.fori_loop(0, pl.cdiv(sizes[0], cap), body, (jnp.int32(0), jnp.int32(0)))[0]

    # With a single level every element is a candidate and nothing can have been dropped.
    n_sel = from_candidates() if top == 0 else jax.lax.cond(rescan, from_row, from_candidates)
    slot = jnp.arange(kp)
    plt.store(out_ref.at[r, slot], jnp.full((kp,), -1, jnp.int32), mask=(slot >= n_sel) & (slot < k))


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret"))
def topk_from_levels(levels: list[jax.Array], k: int, *, num_warps: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """int32 [R, k]: `ops.select_topk(levels[0], k)` for each row, given `build_levels(levels[0], k)`."""
    kp, cap = capacity(k)
    rows = levels[0].shape[0]
    sizes = tuple(int(x.shape[-1]) for x in levels)
    if sizes[-1] > top_capacity(k):
        raise ValueError(f"top level has {sizes[-1]} entries, more than its capacity {top_capacity(k)}: use "
                         f"build_levels")
    top_width = _pow2(sizes[-1])
    if num_warps is None:  # by the widest tensor, the top level or the candidates below it. H200, one row
        # (twenty-fifth session): 8192 wide 17.4 us at 8 warps, 19.2 at 16; 4096 12.3 at 8, 12.2 at 4, 13.8 at 16
        widest = max(top_width, cap if len(levels) > 1 else 0)
        num_warps = 4 if widest <= 1024 else 8 if widest <= 8192 else 16
    kernel = functools.partial(_kernel, sizes=sizes, k=k, kp=kp, cap=cap, top_width=top_width, interpret=interpret)
    # Interpreted, both outputs carry one spare column: lanes a masked scatter skips point there, so that
    # interpret mode (which writes masked lanes back with their old value) cannot clobber a real slot. Compiled,
    # a masked lane writes nothing, and the output is [rows, k] itself: a slice to k columns would be materialized
    # by XLA before the attention kernel (a custom call) that reads it (perhaps one of the b1 step's memcpys there).
    width = kp + 1 if interpret else k
    out, _ = pl.pallas_call(
        kernel, grid=(rows,), interpret=interpret,
        out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.int32),
                   jax.ShapeDtypeStruct((rows, max(1, len(levels) - 1), kp + 1), jnp.int32)],  # scratch
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name="select_topk",
    )(*levels)
    return out if width == k else out[:, :k]


def select_topk(scores: jax.Array, k: int, *, interpret: bool = False, **options) -> jax.Array:
    """Same contract as `ops.select_topk` (any leading shape); options: of `topk_from_levels` (num_warps)."""
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, n).astype(jnp.float32)
    return topk_from_levels(build_levels(rows, k), k, interpret=interpret, **options).reshape(*lead, k)
