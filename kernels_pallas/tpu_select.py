"""Exact top-k selection for TPU (Pallas, Mosaic TPU lowering). Same contract as `ops.select_topk`.

Checked in interpret mode and lowered by Mosaic for TPU v5e / v6e on the CPU (no TPU here); not tuned
on hardware.

A TPU has no cheap scatter or gather inside a kernel, so this is the dense variant of the GPU
algorithm: one grid step holds a whole row in VMEM (a 1M-position row is 4 MiB), finds the k-th
largest key with the same bitwise count search over the row (`decode.kth_key`: VPU compares + reductions,
up to 32 passes, 13-26 on distinct scores: `python -m experiments.select_steps`), and
then compacts the selected positions in position order chunk by chunk with the MXU: an upper
triangular matmul gives in-chunk prefix counts, and a one-hot [k, C] matrix times the chunk's
positions scatters them to their output slots (positions < 2**24 are exact in f32). Chunks holding
no selected position are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import decode

CHUNK = 512  # positions compacted per MXU step


def _kernel(s_ref, o_ref, *, n: int, k: int, kpad: int):
    keys_all = decode.ordered_key(s_ref[...])  # [1, Np]

    thr = jnp.maximum(decode.kth_key(keys_all, k, decode.NEG_INF_KEY), decode.NEG_INF_KEY)  # -inf never selected
    quota = k - jnp.sum((keys_all > thr).astype(jnp.int32))
    ties_count = thr > decode.NEG_INF_KEY
    upper = (jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
             <= jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)).astype(jnp.float32)
    slots = jax.lax.broadcasted_iota(jnp.int32, (kpad, CHUNK), 0)

    def prefix(x):  # inclusive prefix sum of a [1, CHUNK] 0/1 row, exact in f32
        return jnp.dot(x.astype(jnp.float32), upper, preferred_element_type=jnp.float32).astype(jnp.int32)

    def chunk(c, carry):
        n_sel, n_eq, out = carry
        keys = decode.ordered_key(s_ref[:, pl.ds(c * CHUNK, CHUNK)])
        eq = (keys == thr) & ties_count
        sel = (keys > thr) | (eq & (n_eq + prefix(eq) - 1 < quota))
        rank = n_sel + prefix(sel) - 1
        pos = (c * CHUNK + jax.lax.broadcasted_iota(jnp.int32, (1, CHUNK), 1)).astype(jnp.float32)
        onehot = ((slots == rank) & sel).astype(jnp.float32)  # [kpad, CHUNK]
        hit = jax.lax.dot_general(pos, onehot, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (n_sel + jnp.sum(sel.astype(jnp.int32)), n_eq + jnp.sum(eq.astype(jnp.int32)), out + hit)

    init = (jnp.int32(0), jnp.int32(0), jnp.zeros((1, kpad), jnp.float32))
    n_sel, _, out = jax.lax.fori_loop(0, pl.cdiv(n, CHUNK), chunk, init)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, kpad), 1)
    o_ref[...] = jnp.where(lane < n_sel, out.astype(jnp.int32), -1)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def select_topk(scores: jax.Array, k: int, *, interpret: bool = False) -> jax.Array:
    """int32 [..., k]: the k best positions of each row, ascending, -1 padded (`ops.select_topk`)."""
    lead, n = scores.shape[:-1], scores.shape[-1]
    if n >= 2 ** 24:
        raise ValueError(f"rows of {n} positions: the MXU compaction is exact below 2**24 only")
    rows = scores.reshape(-1, n).astype(jnp.float32)
    npad = -(-n // CHUNK) * CHUNK
    rows = jnp.pad(rows, ((0, 0), (0, npad - n)), constant_values=-jnp.inf)[:, None, :]
    kpad = -(-k // 128) * 128
    out = pl.pallas_call(
        functools.partial(_kernel, n=n, k=k, kpad=kpad),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec((None, 1, npad), lambda r: (r, 0, 0))],
        out_specs=pl.BlockSpec((None, 1, kpad), lambda r: (r, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], 1, kpad), jnp.int32),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        name="select_topk_tpu",
    )(rows)
    return out[:, 0, :k].reshape(*lead, k)
