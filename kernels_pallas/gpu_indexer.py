"""Decode-step indexer scan on GPU (Pallas, Triton lowering).

score[b, n] = sum_h w[b, h] * relu(q[b, h] . k[b, n]) over the packed FP4 index keys (E8M0 scale per
32 channels), -inf at n >= reachable[b]. One pass over the keys; optionally the same pass writes the
max of every block of `block` positions (the candidate source's block scores). `indexer_scores_pool`
scores only the positions of a candidate pool (a Reindex layer's decode): the same tile body on rows
gathered by block id.

How it maps to the hardware (why it is shaped like this):
- One tensor-core dot per tile: keys [TN, D] float16 x q^T [D, H]. FP4 keys are decoded with
  `decode.fp4_as_f16` (two integer ops, exact), interleaved back to channel order in registers, and
  multiplied by 2**(14 + e_g - e_max): their group exponent relative to the row's largest, so the
  float16 values stay exact (down to 2**-23 below the row's largest group; smaller groups round at
  ~1e-7 of the score) and the row's own 2**(e_max - 127) is applied to the final score, since
  relu(c x) = c relu(x) for c > 0.
- q is scaled by one power of two per sequence to fit float16 (exact for FP4-grid queries, 2**-11
  relative otherwise); that power of two is folded into w.

The FP4 decode, not the loads, limits this form (`experiments.bench_kernels --only stages`); on Hopper
the dispatch takes `gpu_indexer_wgmma` instead. Three forms that fed the tensor cores FP8 E5M2 bytes (the
nibbles moved into E5M2 bits in jnp or PTX, one K = 32 dot per scale group) were exact but measured slower
than this one on the H200 and were removed (docs/BENCHMARKS.md, issue 21, 2026-12-01).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsv41_jax.quant import WORD_LAYOUTS
from kernels_pallas import decode

KEY_SCALE_BLOCK = 32  # channels per E8M0 scale of the released index key (quant.INDEX_KEY)
# Keys in Hopper's words are scored by one dot a code slot of K = head_dim / 8, and Triton's dots need K >= 16 (on
# an H100 head_dim 32's K = 4 dots came out 4x too large, fifty-second session)
WORDS_MIN_HEAD_DIM = 128


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prepare_query(q_bhd: jax.Array, w_bh: jax.Array, min_heads: int = 16):
    """q [B, H, D] -> (q^T [B, D, Hp] float16 with max |q| in [0.5, 1), w' [B, Hp] float32).

    Hp pads the heads to a tensor-core width (padded heads have w' = 0); w' carries the power of two
    taken out of q.
    """
    b, h, d = q_bhd.shape
    hp = max(min_heads, _round_up(h, 16))
    q = q_bhd.astype(jnp.float32)
    amax = jnp.max(jnp.abs(q), axis=(1, 2))
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax = f * 2**e, f in [0.5, 1)
    qn = q * jnp.exp2(-e.astype(jnp.float32))[:, None, None]
    wn = w_bh.astype(jnp.float32) * jnp.exp2(e.astype(jnp.float32))[:, None]
    qn = jnp.pad(qn, ((0, 0), (0, hp - h), (0, 0))).astype(jnp.float16)
    return jnp.swapaxes(qn, 1, 2), jnp.pad(wn, ((0, 0), (0, hp - h)))


def _tile_scores(kb, e, q_ref, b, w, groups: int) -> jax.Array:
    """Scores f32 [TN] of TN key rows, before any masking: packed FP4 kb (uint8 [TN, D/2] bytes, or uint32
    [TN, D/8] words in Hopper's layout), E8M0 exponents e int32 [TN, D/32], the queries q_ref of which sequence
    b's (`prepare_query`: f16 q^T [B, D, Hp], or [B, 8, D/8, Hp] for words) and its w' f32 [Hp]."""
    e_max, rel = _group_scales(e)
    if kb.dtype == jnp.uint32:  # one K = D/8 dot a code slot: code c of word u is channel 8u + c
        tn, words = kb.shape
        rel_w = jnp.broadcast_to(rel[:, :, None], (tn, groups, words // groups)).reshape(tn, words)
        logits = functools.reduce(operator.add, (jnp.dot(k16 * rel_w, q_ref[b, c], preferred_element_type=jnp.float32)
                                                 for c, k16 in enumerate(decode.sm90_f16(kb))))
    else:
        logits = jnp.dot(_decoded_keys(kb, rel, groups), q_ref[b], preferred_element_type=jnp.float32)
    return jnp.sum(jnp.maximum(logits, 0.0) * w[None, :], axis=1) * decode.e8m0_f32(e_max)


def _layout_args(qt: jax.Array, key_values: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
    """(queries, keys) as the kernels read them for a word layout (`quant.Fp4Codec.word_layout`): "nibbles" as
    given; "sm90" the keys as uint32 words [B, N, D/8] (a bitcast) and q^T [B, D, Hp] as [B, 8, D/8, Hp] (slot c
    holds channels 8u + c)."""
    if layout not in WORD_LAYOUTS:
        raise ValueError(f"index key word_layout must be one of {WORD_LAYOUTS}, got {layout!r}")
    if layout == "nibbles":
        return qt, key_values
    b, n, half = key_values.shape
    if 2 * half < WORDS_MIN_HEAD_DIM:
        raise ValueError(f"index keys in Hopper's word layout need head_dim >= {WORDS_MIN_HEAD_DIM} here (each code "
                         f"slot's dot has K = head_dim / 8 and Triton's dots need K >= 16); got head_dim {2 * half}: "
                         "store these keys as 'nibbles' (ModelConfig.index_key_layout)")
    words = jax.lax.bitcast_convert_type(key_values.reshape(b, n, half // 4, 4), jnp.uint32)
    return jnp.swapaxes(qt.reshape(b, half // 4, 8, qt.shape[-1]), 1, 2), words


def _group_scales(e) -> tuple[jax.Array, jax.Array]:
    """(row's largest exponent int32 [TN], float16 [TN, D/32] 2**(14 + group exponent - that largest))."""
    e_max = jnp.max(e, axis=1)
    rel = jax.lax.bitcast_convert_type(jnp.maximum(e - e_max[:, None] + 127 + 14, 1) << 23, jnp.float32)
    return e_max, rel.astype(jnp.float16)


def _decoded_keys(kb, rel, groups: int) -> jax.Array:
    """Keys float16 [TN, D] in channel order, each group times its `_group_scales` factor."""
    tn = kb.shape[0]
    lo, hi = decode.nibbles(kb)
    k16 = jnp.stack([decode.fp4_as_f16(lo), decode.fp4_as_f16(hi)], axis=-1).reshape(tn, groups, KEY_SCALE_BLOCK)
    return (k16 * rel[:, :, None]).reshape(tn, groups * KEY_SCALE_BLOCK)


def _kernel(reach_ref, qt_ref, w_ref, kv_ref, ks_ref, s_ref, *bmax_refs, n: int, tn: int, groups: int,
            block: int | None):
    b, t = pl.program_id(0), pl.program_id(1)
    n0 = t * tn
    rows = n0 + jnp.arange(tn)
    in_range = rows < n
    kb = plt.load(kv_ref.at[b, pl.ds(n0, tn), :], mask=in_range[:, None], other=0)  # [TN, D/2] bytes or D/8 words
    e = plt.load(ks_ref.at[b, pl.ds(n0, tn), :], mask=in_range[:, None], other=127).astype(jnp.int32)
    s = _tile_scores(kb, e, qt_ref, b, w_ref[b, :], groups)
    s = jnp.where(rows < reach_ref[b], s, -jnp.inf)
    plt.store(s_ref.at[b, pl.ds(n0, tn)], s, mask=in_range)
    if block is not None:
        nb = tn // block
        bm = jnp.max(s.reshape(nb, block), axis=1)
        bidx = t * nb + jnp.arange(nb)
        plt.store(bmax_refs[0].at[b, pl.ds(t * nb, nb)], bm, mask=bidx < pl.cdiv(n, block))


def _pool_kernel(reach_ref, blocks_ref, qt_ref, w_ref, kv_ref, ks_ref, s_ref, *, n: int, n_blocks: int, block: int,
                 per_program: int, groups: int):
    b, t = pl.program_id(0), pl.program_id(1)
    tn = per_program * block
    slot = t * per_program + jnp.arange(per_program)
    bid = plt.load(blocks_ref.at[b, slot], mask=slot < n_blocks, other=-1)  # [G] pool block ids
    pos = (bid[:, None] * block + jnp.arange(block)[None, :]).reshape(tn)
    ok = jnp.broadcast_to(bid[:, None] >= 0, (per_program, block)).reshape(tn) & (pos < n)
    rows = jnp.where(ok, pos, 0)  # a gather of whole blocks of consecutive rows
    s = _tile_scores(kv_ref[b, rows, :], ks_ref[b, rows, :].astype(jnp.int32), qt_ref, b, w_ref[b, :], groups)
    s = jnp.where(ok & (pos < reach_ref[b]), s, -jnp.inf)
    out = t * tn + jnp.arange(tn)
    plt.store(s_ref.at[b, pl.ds(t * tn, tn)], s, mask=out < n_blocks * block)


def _check_keys(d: int, key_values: jax.Array, key_scales: jax.Array) -> None:
    if d % KEY_SCALE_BLOCK or key_values.shape[-1] * 2 != d or key_scales.shape[-1] * KEY_SCALE_BLOCK != d:
        raise ValueError(f"index keys must be FP4 packed with one E8M0 scale per {KEY_SCALE_BLOCK} channels "
                         f"for head_dim {d}; got values {key_values.shape}, scales {key_scales.shape}")


_STATIC = ("block", "block_n", "num_warps", "num_stages", "layout", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def indexer_scores(q_bhd: jax.Array, w_bh: jax.Array, key_values: jax.Array, key_scales: jax.Array,
                   reachable_b: jax.Array, *, block: int | None = None, block_n: int = 128,
                   num_warps: int = 4, num_stages: int = 3, layout: str = "nibbles", interpret: bool = False):
    """Scores f32 [B, N]; with `block`, also the block maxima f32 [B, ceil(N / block)].

    key_values uint8 [B, N, D/2], key_scales uint8 [B, N, D/32] (quant.INDEX_KEY records; layout: their
    word_layout, "nibbles" or "sm90").
    """
    b, h, d = q_bhd.shape
    n = key_values.shape[1]
    _check_keys(d, key_values, key_scales)
    if block is not None and block_n % block:
        raise ValueError(f"block_n {block_n} must be a multiple of the candidate block {block}")
    qt, wn = prepare_query(q_bhd, w_bh)
    qt, key_values = _layout_args(qt, key_values, layout)
    tn = block_n
    out_shape = [jax.ShapeDtypeStruct((b, n), jnp.float32)]
    if block is not None:
        out_shape.append(jax.ShapeDtypeStruct((b, -(-n // block)), jnp.float32))
    kernel = functools.partial(_kernel, n=n, tn=tn, groups=d // KEY_SCALE_BLOCK, block=block)
    outs = pl.pallas_call(
        kernel, grid=(b, pl.cdiv(n, tn)), out_shape=out_shape, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="indexer_scores",
    )(reachable_b.astype(jnp.int32), qt, wn, key_values, key_scales)
    return outs[0] if block is None else tuple(outs)


@functools.partial(jax.jit, static_argnames=_STATIC)
def indexer_scores_pool(q_bhd: jax.Array, w_bh: jax.Array, key_values: jax.Array, key_scales: jax.Array,
                        blocks_bk: jax.Array, reachable_b: jax.Array, *, block: int, block_n: int = 128,
                        num_warps: int = 4, num_stages: int = 3, layout: str = "nibbles",
                        interpret: bool = False) -> jax.Array:
    """Scores f32 [B, K * block] of the candidate pool's positions only (`ops.indexer_scores_pool_decode`).

    blocks_bk int32 [B, K]: pool block ids (-1 = empty); slot j scores position
    blocks[b, j // block] * block + j % block, -inf in empty blocks and at positions >= min(reachable, N).
    Each program gathers block_n / block whole blocks (block_n rows of keys) and scores them like the
    full scan; the keys outside the pool are never read. `block` and block_n must be powers of two
    (Triton tensor shapes). layout: the keys' word_layout, as in `indexer_scores`.
    """
    b, h, d = q_bhd.shape
    n, k = key_values.shape[1], blocks_bk.shape[1]
    _check_keys(d, key_values, key_scales)
    if block & (block - 1) or block_n & (block_n - 1) or block_n < block:
        raise ValueError(f"the GPU pool scan needs power-of-two block {block} <= block_n {block_n}")
    qt, wn = prepare_query(q_bhd, w_bh)
    qt, key_values = _layout_args(qt, key_values, layout)
    per_program = block_n // block
    kernel = functools.partial(_pool_kernel, n=n, n_blocks=k, block=block, per_program=per_program,
                               groups=d // KEY_SCALE_BLOCK)
    return pl.pallas_call(
        kernel, grid=(b, pl.cdiv(k, per_program)), out_shape=jax.ShapeDtypeStruct((b, k * block), jnp.float32),
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="indexer_scores_pool",
    )(reachable_b.astype(jnp.int32), blocks_bk.astype(jnp.int32), qt, wn, key_values, key_scales)
