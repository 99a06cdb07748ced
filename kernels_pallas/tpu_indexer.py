"""Decode-step indexer scan for TPU (Pallas, Mosaic TPU lowering). Same contract as `gpu_indexer`.

Checked in interpret mode and lowered by Mosaic for TPU v5e / v6e on the CPU (no TPU here); not tuned
on hardware.

Layout choices for the TPU: one grid step scores a tile of TN positions of one sequence from VMEM
blocks (the pipeline streams the key bytes from HBM once). The MXU takes int8 x int8 -> int32 (v5e and
later), so the FP4 decode is integer only and no value is scaled before the dot: a key nibble becomes
2 * E2M1, an integer in [-12, 12] (`_fp4_times2`, five int ops), and q (on the FP4 grid: the model
fake-quantizes it) becomes integers |q / s_q| < 64 with one power of two s_q per (head, 32-channel
group), exact for FP4-grid values (7 significant bits otherwise). Per group the int32 dot is exact; its
f32 value times the key's 2**(e - 127) / 2 and the query's s_q is exact too, so only the f32 sum over
the groups rounds, as in the reference. As on GPU the key bytes are not interleaved: even/odd channels
of q meet the low/high nibbles. Scores are
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


def _fp4_times2(code_i32: jax.Array) -> jax.Array:
    """E2M1 codes (int32 0..15) -> int32 2 * E2M1 in [-12, 12]: magnitudes 0..7 -> 0, 1, 2, 3, 4, 6, 8, 12."""
    mag = code_i32 & 0x7
    v = mag + jnp.maximum(mag - 4, 0) + 2 * jnp.maximum(mag - 6, 0)
    return jnp.where((code_i32 & 0x8) != 0, -v, v)


def _tile_scores(kv_ref, ks_ref, qe_ref, qo_ref, hs_ref) -> jax.Array:
    """Scores f32 [1, TN] (lane-dense) of the TN key rows in VMEM, before any masking: packed FP4 bytes
    kv_ref uint8 [TN, D/2], E8M0 exponents ks_ref uint8 [TN, D/32]; q's even / odd channels as integers
    qe_ref, qo_ref int8 [D/2, Hp]; per-head scalars hs_ref f32 [1 + D/32, Hp] (`_query_operands`)."""
    half = KEY_SCALE_BLOCK // 2
    acc = jnp.zeros((kv_ref.shape[0], hs_ref.shape[-1]), jnp.float32)
    for g in range(ks_ref.shape[-1]):
        lo, hi = decode.nibbles(kv_ref[:, g * half:(g + 1) * half])
        dot = jnp.dot(_fp4_times2(lo).astype(jnp.int8), qe_ref[g * half:(g + 1) * half, :],
                      preferred_element_type=jnp.int32)
        dot += jnp.dot(_fp4_times2(hi).astype(jnp.int8), qo_ref[g * half:(g + 1) * half, :],
                       preferred_element_type=jnp.int32)
        sk = decode.e8m0_f32(ks_ref[:, g:g + 1]) * 0.5  # [TN, 1]: the key's scale over the 2 in 2 * E2M1
        acc += dot.astype(jnp.float32) * sk * hs_ref[1 + g:2 + g, :]
    return jnp.sum(jnp.maximum(acc, 0.0) * hs_ref[0:1, :], axis=1)[None, :]


def _kernel(reach_ref, qe_ref, qo_ref, hs_ref, kv_ref, ks_ref, s_ref, *bmax_refs, n: int, tn: int,
            block: int | None):
    b, t = pl.program_id(0), pl.program_id(1)
    s = _tile_scores(kv_ref, ks_ref, qe_ref, qo_ref, hs_ref)
    pos = t * tn + jax.lax.broadcasted_iota(jnp.int32, (1, tn), 1)
    s = jnp.where(pos < reach_ref[b], s, -jnp.inf)
    s_ref[...] = s
    if block is not None:
        # positions past N (a partial last tile) must not leak into a block maximum
        s = jnp.where(pos < n, s, -jnp.inf)
        bmax_refs[0][...] = jnp.max(s.reshape(tn // block, block), axis=1)[None, :]


def _pool_kernel(reach_ref, blocks_smem, pos_ref, qe_ref, qo_ref, hs_ref, kv_hbm, ks_hbm, s_ref, kv_buf, ks_buf,
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
    s = _tile_scores(kv_buf, ks_buf, qe_ref, qo_ref, hs_ref)
    pos = pos_ref[...]  # [1, TN] absolute positions, negative in empty blocks
    s_ref[...] = jnp.where((pos >= 0) & (pos < jnp.minimum(reach_ref[b], n)), s, -jnp.inf)


def _check_keys(d: int, key_values) -> None:
    if d % KEY_SCALE_BLOCK or key_values.shape[-1] * 2 != d:
        raise ValueError(f"index keys must be FP4 packed with E8M0 per {KEY_SCALE_BLOCK} for head_dim {d}")


def _query_operands(q_bhd, w_bh):
    """(q even channels, q odd channels) int8 [B, D/2, Hp] of q / s_q, and per-head scalars f32
    [B, 1 + D/32, Hp]: the head weights, then s_q of each 32-channel group; heads padded to 128 lanes.

    s_q = 2**(e - 6) for the group's max |q| = f * 2**e, f in [0.5, 1): |q / s_q| < 64, and for FP4-grid q
    (each a multiple of half its group's scale, which is >= max / 6) an integer (module doc)."""
    b, h, d = q_bhd.shape
    hp = -(-h // 128) * 128  # heads on the lanes of the MXU result
    q = jnp.pad(q_bhd.astype(jnp.float32), ((0, 0), (0, hp - h), (0, 0)))
    g = q.reshape(b, hp, d // KEY_SCALE_BLOCK, KEY_SCALE_BLOCK)
    amax = jnp.max(jnp.abs(g), axis=-1)
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))
    sq = jnp.exp2(e.astype(jnp.float32) - 6)  # [B, Hp, G]
    qi = jnp.round(g / sq[..., None]).astype(jnp.int8).reshape(b, hp, d)
    w = jnp.pad(w_bh.astype(jnp.float32), ((0, 0), (0, hp - h)))[:, None, :]
    hs = jnp.concatenate([w, jnp.swapaxes(sq, 1, 2)], axis=1)
    return jnp.swapaxes(qi[:, :, 0::2], 1, 2), jnp.swapaxes(qi[:, :, 1::2], 1, 2), hs


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
    qe, qo, hs = _query_operands(q_bhd, w_bh)
    hp = qe.shape[-1]
    nt = pl.cdiv(n, tn)
    in_specs = [pl.BlockSpec((None, d // 2, hp), lambda i, j, r: (i, 0, 0)),
                pl.BlockSpec((None, d // 2, hp), lambda i, j, r: (i, 0, 0)),
                pl.BlockSpec((None, 1 + d // KEY_SCALE_BLOCK, hp), lambda i, j, r: (i, 0, 0)),
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
    )(reachable_b.astype(jnp.int32), qe, qo, hs, key_values, key_scales)
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
    qe, qo, hs = _query_operands(q_bhd, w_bh)
    hp = qe.shape[-1]
    per_seq = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j, *_: (i,) + (0,) * len(shape))
    hbm = pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)
    out = pl.pallas_call(
        functools.partial(_pool_kernel, n=n, block=block, per_program=per_program),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, nt),
            in_specs=[pl.BlockSpec((None, 1, tn), lambda i, j, *_: (i, 0, j)),
                      per_seq(d // 2, hp), per_seq(d // 2, hp), per_seq(1 + d // KEY_SCALE_BLOCK, hp), hbm, hbm],
            out_specs=pl.BlockSpec((None, 1, tn), lambda i, j, *_: (i, 0, j)),
            scratch_shapes=[pltpu.VMEM((tn, d // 2), jnp.uint8), pltpu.VMEM((tn, d // KEY_SCALE_BLOCK), jnp.uint8),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct((b, 1, nt * tn), jnp.float32),
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="indexer_scores_pool_tpu",
    )(reachable_b.astype(jnp.int32), blocks, pos, qe, qo, hs, key_values, key_scales)
    return out[:, 0, :k * block]
