"""Decode-step indexer scan for TPU (Pallas, Mosaic TPU lowering). Same contract as `gpu_indexer`.

Checked in interpret mode only (no TPU here); not tuned on hardware.

Layout choices for the TPU: one grid step scores a tile of TN positions of one sequence from VMEM
blocks (the pipeline streams the key bytes from HBM once). Keys are decoded with f32 arithmetic
(`decode.fp4_f32_arith`, no f16/fp8 on older TPUs) and scaled per 32-channel group; FP4 x 2**e is
exact in bf16, so the MXU runs bf16 x bf16 -> f32 on exact operands (q is on the FP4 grid too). As on
GPU the key bytes are not interleaved: even/odd channels of q meet the low/high nibbles. Scores are
written lane-dense as [B, 1, N]; the reachable counts arrive by scalar prefetch. The pool scan
(`indexer_scores_pool`) runs the same tile body on rows it gathers from HBM by DMA, block by block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import decode

KEY_SCALE_BLOCK = 32


def _tile_scores(kv_ref, ks_ref, qe_ref, qo_ref, w_ref) -> jax.Array:
    """Scores f32 [1, TN] (lane-dense) of the TN key rows in VMEM, before any masking: packed FP4 bytes
    kv_ref uint8 [TN, D/2], E8M0 exponents ks_ref uint8 [TN, D/32]; q's even / odd channels qe_ref,
    qo_ref bf16 [D/2, Hp]; head weights w_ref f32 [1, Hp]."""
    half = KEY_SCALE_BLOCK // 2
    acc = jnp.zeros((kv_ref.shape[0], w_ref.shape[-1]), jnp.float32)
    for g in range(ks_ref.shape[-1]):
        lo, hi = decode.nibbles(kv_ref[:, g * half:(g + 1) * half])
        sc = decode.e8m0_f32(ks_ref[:, g:g + 1])  # [TN, 1]
        klo = (decode.fp4_f32_arith(lo) * sc).astype(jnp.bfloat16)
        khi = (decode.fp4_f32_arith(hi) * sc).astype(jnp.bfloat16)
        acc += jnp.dot(klo, qe_ref[g * half:(g + 1) * half, :], preferred_element_type=jnp.float32)
        acc += jnp.dot(khi, qo_ref[g * half:(g + 1) * half, :], preferred_element_type=jnp.float32)
    return jnp.sum(jnp.maximum(acc, 0.0) * w_ref[...], axis=1)[None, :]


def _kernel(reach_ref, qe_ref, qo_ref, w_ref, kv_ref, ks_ref, s_ref, *bmax_refs, n: int, tn: int,
            block: int | None):
    b, t = pl.program_id(0), pl.program_id(1)
    s = _tile_scores(kv_ref, ks_ref, qe_ref, qo_ref, w_ref)
    pos = t * tn + jax.lax.broadcasted_iota(jnp.int32, (1, tn), 1)
    s = jnp.where(pos < reach_ref[b], s, -jnp.inf)
    s_ref[...] = s
    if block is not None:
        # positions past N (a partial last tile) must not leak into a block maximum
        s = jnp.where(pos < n, s, -jnp.inf)
        bmax_refs[0][...] = jnp.max(s.reshape(tn // block, block), axis=1)[None, :]


def _pool_kernel(reach_ref, blocks_smem, pos_ref, qe_ref, qo_ref, w_ref, kv_hbm, ks_hbm, s_ref, kv_buf, ks_buf,
                 sem, *, n: int, block: int, per_program: int):
    b, t = pl.program_id(0), pl.program_id(1)

    def copies(i, whole: bool):
        """DMAs of pool block i of this program into rows [i * block, (i + 1) * block) of the buffers:
        one per block, or one per row (clamped to row N - 1) for a block that runs past N."""
        first = jnp.maximum(blocks_smem[b, t * per_program + i], 0) * block
        spans = [(first, i * block, block)] if whole else [
            (jnp.minimum(first + r, n - 1), i * block + r, 1) for r in range(block)]
        return [pltpu.make_async_copy(src.at[b, pl.ds(row, size)], dst.at[pl.ds(at, size)], sem.at[j])
                for row, at, size in spans for j, (src, dst) in enumerate(((kv_hbm, kv_buf), (ks_hbm, ks_buf)))]

    def each_block(action):
        def body(i, carry):
            bid = blocks_smem[b, t * per_program + i]
            whole = (bid + 1) * block <= n

            @pl.when((bid >= 0) & whole)  # empty blocks (-1) are not read: their scores are masked
            def _():
                for cp in copies(i, True):
                    action(cp)

            @pl.when((bid >= 0) & jnp.logical_not(whole))
            def _():
                for cp in copies(i, False):
                    action(cp)
            return carry
        jax.lax.fori_loop(0, per_program, body, 0)

    each_block(lambda cp: cp.start())
    each_block(lambda cp: cp.wait())
    s = _tile_scores(kv_buf, ks_buf, qe_ref, qo_ref, w_ref)
    pos = pos_ref[...]  # [1, TN] absolute positions, negative in empty blocks
    s_ref[...] = jnp.where((pos >= 0) & (pos < jnp.minimum(reach_ref[b], n)), s, -jnp.inf)


def _check_keys(d: int, key_values) -> None:
    if d % KEY_SCALE_BLOCK or key_values.shape[-1] * 2 != d:
        raise ValueError(f"index keys must be FP4 packed with E8M0 per {KEY_SCALE_BLOCK} for head_dim {d}")


def _query_operands(q_bhd, w_bh):
    """(q even channels, q odd channels) bf16 [B, D/2, Hp] and w f32 [B, 1, Hp], heads padded to 128 lanes."""
    b, h, _ = q_bhd.shape
    hp = -(-h // 128) * 128  # heads on the lanes of the MXU result
    q = jnp.pad(q_bhd.astype(jnp.float32), ((0, 0), (0, hp - h), (0, 0))).astype(jnp.bfloat16)
    w = jnp.pad(w_bh.astype(jnp.float32), ((0, 0), (0, hp - h)))[:, None, :]
    return jnp.swapaxes(q[:, :, 0::2], 1, 2), jnp.swapaxes(q[:, :, 1::2], 1, 2), w


@functools.partial(jax.jit, static_argnames=("block", "block_n", "interpret"))
def indexer_scores(q_bhd, w_bh, key_values, key_scales, reachable_b, *, block: int | None = None,
                   block_n: int = 1024, interpret: bool = False):
    """Scores f32 [B, N] (and block maxima [B, ceil(N / block)] with `block`); see gpu_indexer."""
    b, h, d = q_bhd.shape
    n = key_values.shape[1]
    _check_keys(d, key_values)
    tn = block_n
    if block is not None and (tn // block) % 128 and tn // block != -(-n // block):
        raise ValueError(f"block_n {tn} / block {block} must be a multiple of 128 lanes")
    qe, qo, w = _query_operands(q_bhd, w_bh)
    hp = w.shape[-1]
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
        functools.partial(_kernel, n=n, tn=tn, block=block),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(b, nt), in_specs=in_specs,
                                               out_specs=out_specs),
        out_shape=out_shape, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="indexer_scores_tpu",
    )(reachable_b.astype(jnp.int32), qe, qo, w, key_values, key_scales)
    outs = [o[:, 0] for o in outs]
    return outs[0] if block is None else tuple(outs)


@functools.partial(jax.jit, static_argnames=("block", "block_n", "interpret"))
def indexer_scores_pool(q_bhd, w_bh, key_values, key_scales, blocks_bk, reachable_b, *, block: int,
                        block_n: int = 1024, interpret: bool = False) -> jax.Array:
    """Scores f32 [B, K * block] of the candidate pool's positions only; see gpu_indexer.indexer_scores_pool.

    One grid step gathers block_n / block pool blocks (ids by scalar prefetch) from HBM by DMA, one per
    block (one per row for a block running past N; empty blocks are skipped), and scores them like the
    full scan. The slots' positions arrive as a lane-dense [1, block_n] int32 block (4 B per position
    next to the 68 B of its key). block_n must be a multiple of 128 unless one step holds the whole pool.
    """
    b, h, d = q_bhd.shape
    n, k = key_values.shape[1], blocks_bk.shape[1]
    _check_keys(d, key_values)
    if block_n % block:
        raise ValueError(f"block_n {block_n} must be a multiple of the candidate block {block}")
    per_program = min(block_n // block, k)
    tn, nt = per_program * block, pl.cdiv(k, per_program)
    if nt > 1 and tn % 128:
        raise ValueError(f"block_n {block_n} must be a multiple of 128 lanes")
    blocks = jnp.pad(blocks_bk.astype(jnp.int32), ((0, 0), (0, nt * per_program - k)), constant_values=-1)
    pos = blocks[:, :, None] * block + jnp.arange(block, dtype=jnp.int32)
    pos = jnp.where(blocks[:, :, None] >= 0, pos, -1).reshape(b, 1, nt * tn)
    qe, qo, w = _query_operands(q_bhd, w_bh)
    hp = w.shape[-1]
    per_seq = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j, *_: (i,) + (0,) * len(shape))
    hbm = pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)
    out = pl.pallas_call(
        functools.partial(_pool_kernel, n=n, block=block, per_program=per_program),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, nt),
            in_specs=[pl.BlockSpec((None, 1, tn), lambda i, j, *_: (i, 0, j)),
                      per_seq(d // 2, hp), per_seq(d // 2, hp), per_seq(1, hp), hbm, hbm],
            out_specs=pl.BlockSpec((None, 1, tn), lambda i, j, *_: (i, 0, j)),
            scratch_shapes=[pltpu.VMEM((tn, d // 2), jnp.uint8), pltpu.VMEM((tn, d // KEY_SCALE_BLOCK), jnp.uint8),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct((b, 1, nt * tn), jnp.float32),
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="indexer_scores_pool_tpu",
    )(reachable_b.astype(jnp.int32), blocks, pos, qe, qo, w, key_values, key_scales)
    return out[:, 0, :k * block]
