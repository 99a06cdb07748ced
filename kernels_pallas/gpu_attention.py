"""Sparse attention for one decode query per sequence on GPU (Pallas, Triton lowering).

out[b, h] = sum_s p[b, h, s] kv[b, s] over the sequence's window ring (FP8 E4M3 bytes, E8M0 scale per
32 channels) and its selected compressed entries (FP4 packed, E4M3 scale per 16 channels), one softmax
over both with the per-head sink added to the denominator only (`ops.sparse_attention_decode`).

How it maps to the hardware:
- MQA with K = V: each key row is gathered and decoded once into a [TK, D] float16 tile that serves
  all heads twice (q.k and p.v) on the tensor cores. Entry rows are gathered in-kernel by index.
- Decoded keys are exact in float16: an entry is E2M1 x E4M3 (<= 6 significant bits, |x| <= 2688,
  >= 2**-10); a window value is E4M3 x 2**e, exact while |x| < 65504, which a 2**e chosen from the
  row's amax / 448 always gives for activations below ~6.5e4.
- q is scaled by one power of two per head to fit float16 (relative error 2**-11), the power of two
  goes back in with the softmax scale; p is rounded to float16 for the second dot (2**-11). So the
  output agrees with the float32 reference to ~1e-3 relative (tests use 5e-3).

The work is split so that no program holds a [64 heads x 512] f32 accumulator (128 KB: more than Triton
keeps in registers; the one-program form spilled and ran at 7% of the copy rate): flash-decoding. The key
list (window tiles, then entry tiles) is cut into `splits` contiguous ranges and the heads into blocks of
`head_block`, one program per (sequence, range, head block), each with an [head_block, D] accumulator; ranges
are combined outside with their (max, sum) and the sink. With one split the program finishes the softmax
itself. Every head block decodes the same keys again (from L2). A two-kernel form (logits over all channels
once, writing float16 p, then p.v per channel slice) measured slower at batch 1 and 64 on the H200 and was
removed (docs/BENCHMARKS.md, issue 21, 2026-12-01); on Hopper the dispatch takes `gpu_attention_wgmma` from
batch 2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import decode

WINDOW_SCALE_BLOCK = 32  # channels per E8M0 scale of a window record (quant.WINDOW_KV)
ENTRY_SCALE_BLOCK = 16  # channels per E4M3 scale of a main KV entry (quant.MAIN_KV)
M_FLOOR = -1e30  # finite running-max start: a fully masked tile then gives p = 0, never NaN


def padded_heads(h: int) -> int:
    """Heads as the kernels see them: padded to a multiple of 16 (the tensor cores' M), at least 16."""
    return max(16, -(-h // 16) * 16)


def scaled_query(q, scale: float):
    """Rows of q f32 [n, D] -> (q in float16, logit scale f32 [n]):
    each row times the power of two 2**-e that puts its max |q| in [0.5, 1) (e from the exponent bits of the
    max, as frexp; a zero row keeps e = 1), the logit scale 2**e * scale. Traced inside the kernels, on each
    program's heads: in XLA it was three kernels before each call; here each call takes ~3-4 us longer on the
    H200, less than those kernels and their idle (docs/BENCHMARKS.md, sixteenth pass; computing the exponent
    in one XLA reduction instead was slower)."""
    amax = jnp.max(jnp.abs(q), axis=1)
    bits = jax.lax.bitcast_convert_type(jnp.where(amax > 0, amax, 1.0), jnp.int32)
    e = jnp.clip(((bits >> 23) & 0xFF) - 126, -125, 126)  # amax = f * 2**e, f in [0.5, 1) (normal amax)
    down = jax.lax.bitcast_convert_type((127 - e) << 23, jnp.float32)  # 2**-e, exact
    up = jax.lax.bitcast_convert_type((127 + e) << 23, jnp.float32)  # 2**e
    return (q * down[:, None]).astype(jnp.float16), up * scale


def _window_tile(wv_ref, ws_ref, b, t0, tk):
    """Window rows t0..t0+tk decoded to float16 [tk, D]."""
    d = wv_ref.shape[-1]
    raw = wv_ref[b, pl.ds(t0, tk), :]
    sc = decode.e8m0_f32(ws_ref[b, pl.ds(t0, tk), :])
    v = decode.e4m3_f32(raw).reshape(tk, d // WINDOW_SCALE_BLOCK, WINDOW_SCALE_BLOCK) * sc[:, :, None]
    return v.reshape(tk, d).astype(jnp.float16)


def _entry_tile(ev_ref, es_ref, rows, tk):
    """Gathered entry rows (b, r[tk]) decoded to float16 [tk, D]."""
    d = ev_ref.shape[-1] * 2
    b, r = rows
    raw = ev_ref[b, r, :]
    sc = decode.e4m3_f32(es_ref[b, r, :])
    lo, hi = decode.nibbles(raw)
    codes = jnp.stack([lo, hi], axis=-1).reshape(tk, d)  # low nibble = even channel
    v = decode.fp4_as_f16(codes).astype(jnp.float32).reshape(tk, d // ENTRY_SCALE_BLOCK, ENTRY_SCALE_BLOCK)
    return (v * (sc * decode.FP4_F16_SHIFT)[:, :, None]).reshape(tk, d).astype(jnp.float16)


def _key_tiles(wv_ref, ws_ref, wok_ref, ev_ref, es_ref, idx_ref, b, tk: int, k: int):
    """(window, entry): for key tile t of sequence b, fn(t) -> (valid bool [tk], float16 [tk, D]). Window tiles
    are t in [0, n_wt), entry tiles t in [0, n_et) (gathered by idx)."""
    def window(t):
        return wok_ref[b, pl.ds(t * tk, tk)] != 0, _window_tile(wv_ref, ws_ref, b, t * tk, tk)

    def entry(t):
        pos = t * tk + jnp.arange(tk)
        ids = plt.load(idx_ref.at[b, pl.ds(t * tk, tk)], mask=pos < k, other=-1)
        return ids >= 0, _entry_tile(ev_ref, es_ref, (b, jnp.maximum(ids, 0)), tk)

    return window, entry


def _over_tiles(first, last, n_wt: int, n_et: int, window_fn, entry_fn, carry):
    """Runs fn(t, carry) over the key tiles [first, last) of the list (window tiles, then entry tiles)."""
    carry = jax.lax.fori_loop(jnp.minimum(first, n_wt), jnp.minimum(last, n_wt), window_fn, carry)
    return jax.lax.fori_loop(jnp.clip(first - n_wt, 0, n_et), jnp.clip(last - n_wt, 0, n_et), entry_fn, carry)


def _flash_kernel(q_ref, sink_ref, wv_ref, ws_ref, wok_ref, ev_ref, es_ref, idx_ref, *out_refs,
                  tk: int, n_wt: int, n_et: int, k: int, per_split: int, hb: int, final: bool, scale: float):
    b, s, hblk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = pl.ds(hblk * hb, hb)
    q, qs = scaled_query(q_ref[b, heads, :], scale)
    d = q.shape[1]
    window, entry = _key_tiles(wv_ref, ws_ref, wok_ref, ev_ref, es_ref, idx_ref, b, tk, k)

    def update(tile, carry):
        ok, kv = tile
        m, l, acc = carry
        logits = jnp.dot(q, kv.T, preferred_element_type=jnp.float32) * qs[:, None]
        logits = jnp.where(ok[None, :], logits, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        acc = acc * alpha[:, None] + jnp.dot(p.astype(jnp.float16), kv, preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    carry = (jnp.full((hb,), M_FLOOR, jnp.float32), jnp.zeros((hb,), jnp.float32), jnp.zeros((hb, d), jnp.float32))
    m, l, acc = _over_tiles(s * per_split, (s + 1) * per_split, n_wt, n_et,
                            lambda t, c: update(window(t), c), lambda t, c: update(entry(t), c), carry)
    if final:
        sink = sink_ref[heads]
        m_all = jnp.maximum(m, sink)
        c = jnp.exp(m - m_all)
        out_refs[0][b, heads, :] = acc * (c / (l * c + jnp.exp(sink - m_all)))[:, None]
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[b, s, heads, :] = acc
        m_ref[b, s, heads] = m
        l_ref[b, s, heads] = l


def range_weights(m: jax.Array, l: jax.Array, sink: jax.Array, axis: int) -> jax.Array:
    """f32 weights of key ranges along `axis` of their running max m and sum l: exp(m_r - M) / (sum_r l_r
    exp(m_r - M) + exp(sink - M)), M the max over the ranges and the sink (broadcast against m's other axes). One
    formula for `combine` (XLA) and `combine_unrotated` (inside its kernel)."""
    m_all = jnp.maximum(jnp.max(m, axis=axis), sink)
    c = jnp.exp(m - jnp.expand_dims(m_all, axis))
    return c / jnp.expand_dims(jnp.sum(l * c, axis=axis) + jnp.exp(sink - m_all), axis)


def combine(acc_bshd: jax.Array, m_bsh: jax.Array, l_bsh: jax.Array, sink_h: jax.Array) -> jax.Array:
    """Merge split partials (unnormalized acc, running max, running sum) with the sink. f32 [B, H, D].

    The splits' weights [B, S, H] are materialized before the weighted sum, so that a fusion of the sum
    cannot recompute the max over splits and S exponentials for every output element (batch 1 has 20
    splits; on the H200 the fusion that held the sum and the inverse rope of `small`'s output side went from
    6.4 to 2.6 us per layer; the weights' own kernels added 5 us per step)."""
    w_bsh = jax.lax.optimization_barrier(range_weights(m_bsh, l_bsh, sink_h, axis=1))
    return jnp.sum(acc_bshd * w_bsh[..., None], axis=1)


def unrotated(o_bhd: jax.Array, cos_bp: jax.Array, sin_bp: jax.Array) -> jax.Array:
    """o f32 [B, H, D] with each channel pair (2p, 2p + 1) = (e, o) turned back by the angle of cos / sin
    f32 [B, D/2]: (e c + o s, o c - e s), the inverse of the rope's rotation (`dsv41_jax.rope.pair_angles`:
    pairs it leaves alone have cos 1 and sin 0, and come back unchanged). f32."""
    e, od = o_bhd[..., 0::2], o_bhd[..., 1::2]
    c, s = cos_bp[:, None, :], sin_bp[:, None, :]
    return jnp.stack([e * c + od * s, od * c - e * s], axis=-1).reshape(o_bhd.shape)


def range_rows(splits: int) -> int:
    """Rows of the partials `combine_unrotated` reads, for `splits` key ranges: the next power of two (Triton
    blocks), the rows past `splits` left unwritten by the attention kernels and masked by the merge."""
    return 1 << max(0, (splits - 1).bit_length())


def _combine_unrotated_kernel(acc_ref, m_ref, l_ref, sink_ref, cos_ref, sin_ref, o_ref, *, splits: int, hb: int,
                              dc: int):
    """One (sequence, head block, channel block): `combine`'s weights for its heads and the weighted sum of all
    ranges' partials over its channels, each operand read as one block of all `range_rows` rows, the rows past the
    ranges masked (no loop: a loop over the ranges waited for each range's loads in turn), taken as even / odd
    channels (the pairs `unrotated` turns), cast."""
    b, heads, j = pl.program_id(0), pl.ds(pl.program_id(1) * hb, hb), pl.program_id(2)
    half = dc // 2
    ok = (jnp.arange(acc_ref.shape[1]) < splits)[:, None]  # rows past the ranges: allocated, never written
    m = jnp.where(ok, m_ref[b, :, heads], M_FLOOR)  # [rows, hb]
    l = jnp.where(ok, l_ref[b, :, heads], 0.0)
    w = range_weights(m, l, sink_ref[heads], axis=0)[:, :, None]
    part = lambda first: jnp.where(ok[:, :, None], acc_ref[b, :, heads, pl.ds(j * dc + first, half, stride=2)],  # noqa: E731
                                   0.0)
    e, od = jnp.sum(part(0) * w, axis=0), jnp.sum(part(1) * w, axis=0)  # [hb, half]
    pairs = pl.ds(j * half, half)
    cs, sn = cos_ref[b, pairs][None, :], sin_ref[b, pairs][None, :]
    o_ref[b, heads, pl.ds(j * dc, half, stride=2)] = (e * cs + od * sn).astype(o_ref.dtype)
    o_ref[b, heads, pl.ds(j * dc + 1, half, stride=2)] = (od * cs - e * sn).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("splits", "h", "out_dtype", "head_block", "channel_block", "interpret"))
def combine_unrotated(acc_bshd, m_bsh, l_bsh, sink_h, cos_bp, sin_bp, *, splits: int, h: int,
                      out_dtype=jnp.bfloat16, head_block: int = 16, channel_block: int = 16, interpret: bool = False):
    """[B, h, D] in out_dtype: `unrotated(combine(acc, m, l, sink)[:, :h], cos, sin)` over the first `splits` rows
    of the partials, as one kernel, where XLA made three of it on the H200 (the weights' max, their division, the
    sum with the inverse rope: 5.1-5.4 us from the attention kernel's end to wo_a's start in the H200's batch-1
    step, read from `python -m experiments.profile_step --from-events docs/bench_decode/h200_session29_call7_events.json.gz --timeline`). Partials acc f32 [B, R, Hp, D], running max m and sum l f32 [B, R, Hp] (natural-log
    units) with R = `range_rows(splits)` (rows past `splits`, unwritten, are masked); sink f32 [Hp]; cos, sin f32
    [B, D/2]. One program per (sequence, `head_block` heads, `channel_block` channels): 128 at batch 1, each
    reading R x 16 x 16 floats of the partials at once."""
    b, rows, hp, d = acc_bshd.shape
    hb, dc = head_block, channel_block
    if rows != range_rows(splits) or m_bsh.shape != (b, rows, hp) or l_bsh.shape != m_bsh.shape:
        raise ValueError(f"combine_unrotated: {splits} ranges are read from partials of range_rows(splits) = "
                         f"{range_rows(splits)} rows; got acc {acc_bshd.shape}, m {m_bsh.shape}, l {l_bsh.shape}")
    if hp % hb or d % dc or dc % 2 or cos_bp.shape != (b, d // 2) or sin_bp.shape != cos_bp.shape:
        raise ValueError(f"combine_unrotated: head_block {hb} must divide the {hp} padded heads, channel_block {dc} "
                         f"(even) the {d} channels, and cos / sin be [B, D/2] = {(b, d // 2)}; got {cos_bp.shape}")
    out = pl.pallas_call(
        functools.partial(_combine_unrotated_kernel, splits=splits, hb=hb, dc=dc), grid=(b, hp // hb, d // dc),
        out_shape=jax.ShapeDtypeStruct((b, hp, d), out_dtype), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), name="combine_unrotated",
    )(acc_bshd, m_bsh, l_bsh, sink_h.astype(jnp.float32), cos_bp.astype(jnp.float32), sin_bp.astype(jnp.float32))
    return out if hp == h else out[:, :h]


def finish(o_bhd: jax.Array, unrotate, out_dtype) -> jax.Array:
    """A final f32 attention output as `sparse_attention` returns it: unchanged without `unrotate`, else
    `unrotated` by its (cos, sin) and cast to out_dtype (by XLA: no partials to merge)."""
    return o_bhd if unrotate is None else unrotated(o_bhd, *unrotate).astype(out_dtype)


def partial_rows(splits: int, unrotate) -> int:
    """Rows the attention kernels allocate for the partials of `splits` key ranges: as many, or `range_rows` when
    `combine_unrotated` merges them."""
    return splits if unrotate is None else range_rows(splits)


def merge_partials(partials, sink_h, *, splits: int, h: int, unrotate, out_dtype, interpret: bool = False):
    """[B, h, D]: the attention kernels' partials (acc, m, l, of `partial_rows` rows) merged: f32 by `combine`
    without `unrotate`, else turned back and cast by `combine_unrotated`."""
    if unrotate is None:
        return combine(*partials, sink_h)[:, :h]
    return combine_unrotated(*partials, sink_h, *unrotate, splits=splits, h=h, out_dtype=out_dtype,
                             interpret=interpret)


def default_splits(b: int, programs: int = 132) -> int:
    """Key ranges per sequence for about `programs` programs in all (an H200 has 132 SMs), at most 8."""
    return max(1, min(8, -(-programs // b)))


_STATIC = ("scale", "splits", "block_k", "head_block", "num_warps", "num_stages", "out_dtype", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def sparse_attention(q_bhd, window_values, window_scales, window_valid, entry_values, entry_scales, idx_bk,
                     sink_h, scale: float, *, splits: int = 1, block_k: int = 32, head_block: int | None = None,
                     num_warps: int = 8, num_stages: int = 2, unrotate=None, out_dtype=jnp.float32,
                     interpret: bool = False):
    """f32 [B, H, D]. Window records [B, W, D] + [B, W, D/32]; entries [B, N, D/2] + [B, N, D/16].

    `splits` key ranges x heads in blocks of `head_block` (default all), keys in tiles of `block_k` (module
    doc). unrotate: (cos, sin) f32 [B, D/2]: the output `unrotated` by them, in out_dtype
    (with split key ranges, merged and turned in one kernel, `combine_unrotated`)."""
    b, h, d = q_bhd.shape
    w, k = window_values.shape[1], idx_bk.shape[1]
    tk = block_k
    if w % tk:
        raise ValueError(f"window size {w} must be a multiple of block_k {tk}")
    if entry_values.shape[-1] * 2 != d or window_values.shape[-1] != d:
        raise ValueError(f"records do not match head_dim {d}: window {window_values.shape}, "
                         f"entries {entry_values.shape}")
    hp = padded_heads(h)
    q = q_bhd.astype(jnp.float32)
    q = q if hp == h else jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))  # zero heads: never read back
    hb = head_block or hp
    if hp % hb or hb % 16:
        raise ValueError(f"head_block {hb} must be a multiple of 16 dividing the padded heads {hp}")
    sink = jnp.pad(sink_h.astype(jnp.float32), (0, hp - h))
    n_wt, n_et = w // tk, -(-k // tk)
    per_split = -(-(n_wt + n_et) // splits)
    keys = (window_values, window_scales, window_valid.astype(jnp.int8), entry_values, entry_scales,
            idx_bk.astype(jnp.int32))
    tiles = dict(tk=tk, n_wt=n_wt, n_et=n_et, k=k, per_split=per_split)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    final = splits == 1
    rows = partial_rows(splits, unrotate)
    if final:
        out_shape = [jax.ShapeDtypeStruct((b, hp, d), jnp.float32)]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, rows, hp, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, rows, hp), jnp.float32),
                     jax.ShapeDtypeStruct((b, rows, hp), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_flash_kernel, hb=hb, final=final, scale=scale, **tiles), grid=(b, splits, hp // hb),
        out_shape=out_shape, interpret=interpret, compiler_params=params, name="sparse_attention",
    )(q, sink, *keys)
    if final:
        return finish(outs[0][:, :h], unrotate, out_dtype)
    return merge_partials(outs, sink, splits=splits, h=h, unrotate=unrotate, out_dtype=out_dtype, interpret=interpret)
