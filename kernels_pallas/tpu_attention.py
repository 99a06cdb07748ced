"""Sparse attention decode for TPU (Pallas, Mosaic TPU lowering). Same contract as `gpu_attention`.

Checked in interpret mode and lowered by Mosaic for TPU v5e / v6e on the CPU (no TPU here); not tuned
on hardware.

One grid step per sequence. The selected entry rows are gathered from HBM by one small DMA each
(indices by scalar prefetch) into VMEM; the window ring arrives as ordinary VMEM blocks. Keys are
decoded with f32 arithmetic (`decode.*_arith`) and are exact in bf16; per-group scales are expanded
to channels with a 0/1 matmul (the MXU does the broadcast a TPU lane layout dislikes). Packed entries
stay de-interleaved: their logits use q's even/odd channels and their values produce the output's
even/odd channels, re-interleaved by the wrapper. q and p are split into bf16 hi + lo parts, so the
MXU products carry ~16 bits (like the f32 reference to ~1e-5). With at most 128 + 512 keys, one
dense softmax (sink in the denominator) replaces the online one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import decode

WINDOW_SCALE_BLOCK, ENTRY_SCALE_BLOCK = 32, 16


def _split(x):
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _dot_nt(a, b):  # a [M, C] . b [N, C]^T in f32 from bf16 hi/lo parts of a (b exact in bf16)
    hi, lo = _split(a)
    dims = (((1,), (1,)), ((), ()))
    return (jax.lax.dot_general(hi, b, dims, preferred_element_type=jnp.float32)
            + jax.lax.dot_general(lo, b, dims, preferred_element_type=jnp.float32))


def _dot(a, b):  # a [M, S] @ b [S, C], same splitting
    hi, lo = _split(a)
    return (jnp.dot(hi, b, preferred_element_type=jnp.float32) + jnp.dot(lo, b, preferred_element_type=jnp.float32))


def _expand(n_groups: int, width: int, per: int):
    """0/1 [n_groups, width]: column c belongs to group c // per."""
    g = jax.lax.broadcasted_iota(jnp.int32, (n_groups, width), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n_groups, width), 1)
    return (c // per == g).astype(jnp.bfloat16)


def _kernel(idx_smem, q_ref, qe_ref, qo_ref, qs_ref, sink_ref, wv_ref, ws_ref, wok_ref, idx_ref, ev_hbm, es_hbm,
            ow_ref, oe_ref, oo_ref, ev_buf, es_buf, sem, *, k: int):
    b = pl.program_id(0)

    def copies(i):
        row = jnp.maximum(idx_smem[b, i], 0)
        return (pltpu.make_async_copy(ev_hbm.at[b, pl.ds(row, 1)], ev_buf.at[pl.ds(i, 1)], sem.at[0]),
                pltpu.make_async_copy(es_hbm.at[b, pl.ds(row, 1)], es_buf.at[pl.ds(i, 1)], sem.at[1]))

    def start(i, c):
        for cp in copies(i):
            cp.start()
        return c

    def wait(i, c):
        for cp in copies(i):
            cp.wait()
        return c

    jax.lax.fori_loop(0, k, start, 0)
    d = wv_ref.shape[-1]
    # window keys [W, D] (natural channel order)
    wsc = jnp.dot(decode.e8m0_f32(ws_ref[...]).astype(jnp.bfloat16), _expand(d // WINDOW_SCALE_BLOCK, d,
                  WINDOW_SCALE_BLOCK), preferred_element_type=jnp.float32)
    kw = (decode.e4m3_f32_arith(wv_ref[...]) * wsc).astype(jnp.bfloat16)
    jax.lax.fori_loop(0, k, wait, 0)
    # entry keys, low nibbles = even channels [K, D/2], high = odd channels
    lo, hi = decode.nibbles(ev_buf[...])
    esc = jnp.dot(decode.e4m3_f32_arith(es_buf[...]).astype(jnp.bfloat16),
                  _expand(d // ENTRY_SCALE_BLOCK, d // 2, ENTRY_SCALE_BLOCK // 2), preferred_element_type=jnp.float32)
    klo = (decode.fp4_f32_arith(lo) * esc).astype(jnp.bfloat16)
    khi = (decode.fp4_f32_arith(hi) * esc).astype(jnp.bfloat16)

    qs = qs_ref[...]  # [Hp, 1] softmax scale
    s_w = _dot_nt(q_ref[...], kw) * qs
    s_e = (_dot_nt(qe_ref[...], klo) + _dot_nt(qo_ref[...], khi)) * qs
    s_w = jnp.where(wok_ref[...] != 0, s_w, -jnp.inf)
    s_e = jnp.where(idx_ref[...] >= 0, s_e, -jnp.inf)
    sink = sink_ref[...]  # [Hp, 1]
    m = jnp.maximum(jnp.maximum(jnp.max(s_w, axis=1, keepdims=True), jnp.max(s_e, axis=1, keepdims=True)), sink)
    p_w, p_e = jnp.exp(s_w - m), jnp.exp(s_e - m)
    den = (jnp.sum(p_w, axis=1, keepdims=True) + jnp.sum(p_e, axis=1, keepdims=True) + jnp.exp(sink - m))
    ow_ref[...] = _dot(p_w, kw) / den
    oe_ref[...] = _dot(p_e, klo) / den
    oo_ref[...] = _dot(p_e, khi) / den


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def sparse_attention(q_bhd, window_values, window_scales, window_valid, entry_values, entry_scales, idx_bk,
                     sink_h, scale: float, *, interpret: bool = False):
    """f32 [B, H, D] (see gpu_attention.sparse_attention for the record shapes)."""
    b, h, d = q_bhd.shape
    w, k = window_values.shape[1], idx_bk.shape[1]
    if entry_values.shape[-1] * 2 != d or window_values.shape[-1] != d:
        raise ValueError(f"records do not match head_dim {d}: window {window_values.shape}, "
                         f"entries {entry_values.shape}")
    hp = -(-h // 8) * 8
    q = jnp.pad(q_bhd.astype(jnp.float32), ((0, 0), (0, hp - h), (0, 0)))
    sink = jnp.pad(sink_h.astype(jnp.float32), (0, hp - h))[:, None]
    qs = jnp.full((hp, 1), scale, jnp.float32)
    idx = idx_bk.astype(jnp.int32)
    full = lambda *shape: pl.BlockSpec((None, *shape), lambda i, _: (i,) + (0,) * len(shape))
    const = lambda *shape: pl.BlockSpec(shape, lambda i, _: (0,) * len(shape))
    hbm = pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)
    ow, oe, oo = pl.pallas_call(
        functools.partial(_kernel, k=k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b,),
            in_specs=[full(hp, d), full(hp, d // 2), full(hp, d // 2), const(hp, 1), const(hp, 1),
                      full(w, d), full(w, d // WINDOW_SCALE_BLOCK), full(1, w), full(1, k), hbm, hbm],
            out_specs=[full(hp, d), full(hp, d // 2), full(hp, d // 2)],
            scratch_shapes=[pltpu.VMEM((k, d // 2), jnp.uint8), pltpu.VMEM((k, d // ENTRY_SCALE_BLOCK), jnp.uint8),
                            pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct((b, hp, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hp, d // 2), jnp.float32),
                   jax.ShapeDtypeStruct((b, hp, d // 2), jnp.float32)],
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        name="sparse_attention_tpu",
    )(idx, q, q[:, :, 0::2], q[:, :, 1::2], qs, sink, window_values, window_scales,
      window_valid.astype(jnp.int32)[:, None, :], idx[:, None, :], entry_values, entry_scales)
    entries = jnp.stack([oe, oo], axis=-1).reshape(b, hp, d)
    return (ow + entries)[:, :h]
