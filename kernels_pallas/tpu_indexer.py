"""Decode-step indexer scan for TPU (Pallas, Mosaic TPU lowering). Same contract as `gpu_indexer`.

Checked in interpret mode only (no TPU here); not tuned on hardware.

Layout choices for the TPU: one grid step scores a tile of TN positions of one sequence from VMEM
blocks (the pipeline streams the key bytes from HBM once). Keys are decoded with f32 arithmetic
(`decode.fp4_f32_arith`, no f16/fp8 on older TPUs) and scaled per 32-channel group; FP4 x 2**e is
exact in bf16, so the MXU runs bf16 x bf16 -> f32 on exact operands (q is on the FP4 grid too). As on
GPU the key bytes are not interleaved: even/odd channels of q meet the low/high nibbles. Scores are
written lane-dense as [B, 1, N]; the reachable counts arrive by scalar prefetch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import decode

KEY_SCALE_BLOCK = 32


def _kernel(reach_ref, qe_ref, qo_ref, w_ref, kv_ref, ks_ref, s_ref, *bmax_refs, n: int, tn: int, groups: int,
            block: int | None):
    b, t = pl.program_id(0), pl.program_id(1)
    half = KEY_SCALE_BLOCK // 2
    acc = jnp.zeros((tn, w_ref.shape[-1]), jnp.float32)
    for g in range(groups):
        lo, hi = decode.nibbles(kv_ref[:, g * half:(g + 1) * half])
        sc = decode.e8m0_f32(ks_ref[:, g:g + 1])  # [TN, 1]
        klo = (decode.fp4_f32_arith(lo) * sc).astype(jnp.bfloat16)
        khi = (decode.fp4_f32_arith(hi) * sc).astype(jnp.bfloat16)
        acc += jnp.dot(klo, qe_ref[g * half:(g + 1) * half, :], preferred_element_type=jnp.float32)
        acc += jnp.dot(khi, qo_ref[g * half:(g + 1) * half, :], preferred_element_type=jnp.float32)
    s = jnp.sum(jnp.maximum(acc, 0.0) * w_ref[...], axis=1)[None, :]  # [1, TN]
    pos = t * tn + jax.lax.broadcasted_iota(jnp.int32, (1, tn), 1)
    s = jnp.where(pos < reach_ref[b], s, -jnp.inf)
    s_ref[...] = s
    if block is not None:
        # positions past N (a partial last tile) must not leak into a block maximum
        s = jnp.where(pos < n, s, -jnp.inf)
        bmax_refs[0][...] = jnp.max(s.reshape(tn // block, block), axis=1)[None, :]


@functools.partial(jax.jit, static_argnames=("block", "block_n", "interpret"))
def indexer_scores(q_bhd, w_bh, key_values, key_scales, reachable_b, *, block: int | None = None,
                   block_n: int = 1024, interpret: bool = False):
    """Scores f32 [B, N] (and block maxima [B, ceil(N / block)] with `block`); see gpu_indexer."""
    b, h, d = q_bhd.shape
    n = key_values.shape[1]
    if d % KEY_SCALE_BLOCK or key_values.shape[-1] * 2 != d:
        raise ValueError(f"index keys must be FP4 packed with E8M0 per {KEY_SCALE_BLOCK} for head_dim {d}")
    tn = block_n
    if block is not None and (tn // block) % 128 and tn // block != -(-n // block):
        raise ValueError(f"block_n {tn} / block {block} must be a multiple of 128 lanes")
    hp = -(-h // 128) * 128  # heads on the lanes of the MXU result
    q = jnp.pad(q_bhd.astype(jnp.float32), ((0, 0), (0, hp - h), (0, 0))).astype(jnp.bfloat16)
    qe, qo = jnp.swapaxes(q[:, :, 0::2], 1, 2), jnp.swapaxes(q[:, :, 1::2], 1, 2)  # [B, D/2, Hp]
    w = jnp.pad(w_bh.astype(jnp.float32), ((0, 0), (0, hp - h)))[:, None, :]  # [B, 1, Hp]
    nt = pl.cdiv(n, tn)
    in_specs = [pl.BlockSpec((None, d // 2, hp), lambda i, j, r: (i, 0, 0)),
                pl.BlockSpec((None, d // 2, hp), lambda i, j, r: (i, 0, 0)),
                pl.BlockSpec((None, 1, hp), lambda i, j, r: (i, 0, 0)),
                pl.BlockSpec((None, tn, d // 2), lambda i, j, r: (i, j, 0)),
                pl.BlockSpec((None, tn, d // KEY_SCALE_BLOCK), lambda i, j, r: (i, j, 0))]
    out_specs = [pl.BlockSpec((None, 1, tn), lambda i, j, r: (i, 0, j))]
    out_shape = [jax.ShapeDtypeStruct((b, 1, n), jnp.float32)]
    if block is not None:
        nb = -(-n // block)
        out_specs.append(pl.BlockSpec((None, 1, tn // block), lambda i, j, r: (i, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((b, 1, nb), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, tn=tn, groups=d // KEY_SCALE_BLOCK, block=block),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(b, nt), in_specs=in_specs,
                                               out_specs=out_specs),
        out_shape=out_shape, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="indexer_scores_tpu",
    )(reachable_b.astype(jnp.int32), qe, qo, w, key_values, key_scales)
    outs = [o[:, 0] for o in outs]
    return outs[0] if block is None else tuple(outs)
