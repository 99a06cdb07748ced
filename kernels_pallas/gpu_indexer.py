"""Decode-step indexer scan on GPU (Pallas, Triton lowering).

score[b, n] = sum_h w[b, h] * relu(q[b, h] . k[b, n]) over the packed FP4 index keys (E8M0 scale per
32 channels), -inf at n >= reachable[b]. One pass over the keys; optionally the same pass writes the
max of every block of `block` positions (the candidate source's block scores).

How it maps to the hardware (why it is shaped like this):
- The key bytes are never interleaved: byte j holds channels 2j (low nibble) and 2j+1 (high nibble),
  so q is split into its even and odd channels outside the kernel and each 32-channel scale group is
  two tensor-core dots (low nibbles x even q, high nibbles x odd q), K = 16 each.
- Keys are decoded with `decode.fp4_as_f16` (two integer ops, exact). q is scaled by one power of
  two per row so that it fits float16 (exact for FP4-grid queries, 2**-11 relative otherwise); the
  power of two and the 2**-14 of the key decode are folded into w, since relu(c x) = c relu(x), c > 0.
- Per-group key scales multiply the [TN, H] partial products (one FMA per element and group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import decode

KEY_SCALE_BLOCK = 32  # channels per E8M0 scale of the released index key (quant.INDEX_KEY)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prepare_query(q_bhd: jax.Array, w_bh: jax.Array, min_heads: int = 16):
    """q [B, H, D] -> (q_even [B, D/2, Hp] f16, q_odd [B, D/2, Hp] f16, w' [B, Hp] f32).

    Hp pads the heads to a tensor-core width (padded heads have w' = 0). w' carries the per-row power
    of two taken out of q and the 2**-14 of the key decode.
    """
    b, h, d = q_bhd.shape
    hp = max(min_heads, _round_up(h, 16))
    q = q_bhd.astype(jnp.float32)
    amax = jnp.max(jnp.abs(q), axis=(1, 2))
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax = f * 2**e, f in [0.5, 1)
    qn = q * jnp.exp2(-e.astype(jnp.float32))[:, None, None]
    wn = w_bh.astype(jnp.float32) * jnp.exp2(e.astype(jnp.float32))[:, None] * decode.FP4_F16_SHIFT
    qn = jnp.pad(qn, ((0, 0), (0, hp - h), (0, 0))).astype(jnp.float16)
    wn = jnp.pad(wn, ((0, 0), (0, hp - h)))
    return (jnp.swapaxes(qn[:, :, 0::2], 1, 2), jnp.swapaxes(qn[:, :, 1::2], 1, 2), wn)


def _kernel(reach_ref, qe_ref, qo_ref, w_ref, kv_ref, ks_ref, s_ref, *bmax_refs, n: int, tn: int,
            groups: int, block: int | None):
    b, t = pl.program_id(0), pl.program_id(1)
    n0 = t * tn
    rows = n0 + jnp.arange(tn)
    in_range = rows < n
    half = KEY_SCALE_BLOCK // 2  # bytes per scale group
    hp = w_ref.shape[-1]
    acc = jnp.zeros((tn, hp), jnp.float32)
    for g in range(groups):
        kb = plt.load(kv_ref.at[b, pl.ds(n0, tn), pl.ds(g * half, half)], mask=in_range[:, None], other=0)
        lo, hi = decode.nibbles(kb)
        qe = qe_ref[b, pl.ds(g * half, half), :]
        qo = qo_ref[b, pl.ds(g * half, half), :]
        part = (jnp.dot(decode.fp4_as_f16(lo), qe, preferred_element_type=jnp.float32)
                + jnp.dot(decode.fp4_as_f16(hi), qo, preferred_element_type=jnp.float32))
        sc = decode.e8m0_f32(plt.load(ks_ref.at[b, pl.ds(n0, tn), jnp.int32(g)], mask=in_range, other=127))
        acc += part * sc[:, None]
    w = w_ref[b, :]
    s = jnp.sum(jnp.maximum(acc, 0.0) * w[None, :], axis=1)
    s = jnp.where(rows < reach_ref[b], s, -jnp.inf)
    plt.store(s_ref.at[b, pl.ds(n0, tn)], s, mask=in_range)
    if block is not None:
        nb = tn // block
        bm = jnp.max(s.reshape(nb, block), axis=1)
        bidx = t * nb + jnp.arange(nb)
        plt.store(bmax_refs[0].at[b, pl.ds(t * nb, nb)], bm, mask=bidx < pl.cdiv(n, block))


@functools.partial(jax.jit, static_argnames=("block", "block_n", "num_warps", "num_stages", "interpret"))
def indexer_scores(q_bhd: jax.Array, w_bh: jax.Array, key_values: jax.Array, key_scales: jax.Array,
                   reachable_b: jax.Array, *, block: int | None = None, block_n: int = 256,
                   num_warps: int = 8, num_stages: int = 3, interpret: bool = False):
    """Scores f32 [B, N]; with `block`, also the block maxima f32 [B, ceil(N / block)].

    key_values uint8 [B, N, D/2], key_scales uint8 [B, N, D/32] (quant.INDEX_KEY records).
    """
    b, h, d = q_bhd.shape
    n = key_values.shape[1]
    if d % KEY_SCALE_BLOCK or key_values.shape[-1] * 2 != d or key_scales.shape[-1] * KEY_SCALE_BLOCK != d:
        raise ValueError(f"index keys must be FP4 packed with one E8M0 scale per {KEY_SCALE_BLOCK} channels "
                         f"for head_dim {d}; got values {key_values.shape}, scales {key_scales.shape}")
    if block is not None and block_n % block:
        raise ValueError(f"block_n {block_n} must be a multiple of the candidate block {block}")
    qe, qo, wn = prepare_query(q_bhd, w_bh)
    tn = block_n
    out_shape = [jax.ShapeDtypeStruct((b, n), jnp.float32)]
    if block is not None:
        out_shape.append(jax.ShapeDtypeStruct((b, -(-n // block)), jnp.float32))
    kernel = functools.partial(_kernel, n=n, tn=tn, groups=d // KEY_SCALE_BLOCK, block=block)
    outs = pl.pallas_call(
        kernel, grid=(b, pl.cdiv(n, tn)), out_shape=out_shape, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="indexer_scores",
    )(reachable_b.astype(jnp.int32), qe, qo, wn, key_values, key_scales)
    return outs[0] if block is None else tuple(outs)
