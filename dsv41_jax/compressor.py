"""The compressor of a kv source: one compressed entry per group of `ratio` tokens, and the pending group.

Entry j of a ratio-m source stands for tokens [j*m, (j+1)*m). m == 1: entry = RMSNorm(wkv x).
m > 1: entry = RMSNorm(sum over the group of softmax_over_tokens(wgate x) * wkv x). A group that a
chunk leaves incomplete keeps its tokens' projections in the cache (`SourceCache.pend_kv` /
`pend_score`, f32 [B, m, hd]) until a later chunk completes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.cache import SourceCache
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import Linear, RMSNorm


def take_rows(a_bnd: jax.Array, rows_bk: jax.Array) -> jax.Array:
    """a[b, rows[b, k]]: [B, N, D] x int [B, K] -> [B, K, D]."""
    return jnp.take_along_axis(a_bnd, rows_bk[..., None], axis=1)


def scatter_rows(arr_bn: jax.Array, j_bg: jax.Array, rows_bg: jax.Array) -> jax.Array:
    """arr[b, j[b, g]] = rows[b, g]; rows past the end of arr are dropped. Written per sequence (vmap: the
    batch is a batching dimension of the scatter), so that a mesh splitting the sequences keeps it local
    (global batch indices made GSPMD gather indices and rows onto every device)."""
    return jax.vmap(lambda a, j, r: a.at[j].set(r, mode="drop"))(arr_bn, j_bg, rows_bg.astype(arr_bn.dtype))


def _ext_index(v_bk: jax.Array, lengths_b: jax.Array, m: int, t: int) -> jax.Array:
    """Virtual token v of (pending group ++ chunk) -> row of the compressor's [B, m + T, hd] extension
    (rows [0, m): the pending projections, of which lengths % m are real; rows m..: the chunk)."""
    held = (lengths_b % m)[:, None]
    return jnp.clip(jnp.where(v_bk < held, v_bk, m + v_bk - held), 0, m + t - 1)


def pending_rows(kv_ext_bkd: jax.Array, sc_ext_bkd: jax.Array, lengths_b: jax.Array, n_new_b: jax.Array, m: int):
    """(pend_kv, pend_score) f32 [B, m, hd] after appending n_new_b of a chunk's tokens to sequences of
    lengths_b: the projections of the group left filling up (rows past its fill are garbage by contract).
    kv_ext / sc_ext: [B, m + T, hd], the pending rows followed by the chunk's projections."""
    total = lengths_b % m + n_new_b
    rows = _ext_index((total - total % m)[:, None] + jnp.arange(m)[None, :], lengths_b, m, kv_ext_bkd.shape[1] - m)
    return take_rows(kv_ext_bkd, rows), take_rows(sc_ext_bkd, rows)


class Compressor(nnx.Module):
    """Compressed latents of a chunk for a ratio-`ratio` kv source (module docstring)."""

    def __init__(self, cfg: ModelConfig, ratio: int, *, rngs: nnx.Rngs):
        self.ratio = ratio
        self.wkv = Linear(cfg.dim, cfg.head_dim, rngs=rngs, dtype=cfg.param_dtype)
        if ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, rngs=rngs, dtype=cfg.param_dtype)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def __call__(self, x_btd: jax.Array, lengths_b: jax.Array, n_new_b: jax.Array, src: SourceCache):
        """x [B, T, dim] appended to sequences of lengths_b (n_new_b real tokens) with pending group `src`.

        Returns (latent [B, G, hd] before RoPE, entry index j int32 [B, G], pend_kv, pend_score f32
        [B, m, hd] after the chunk, ext): G = T (m == 1) or ceil((m - 1 + T) / m) groups (those past a
        sequence's reachable count are garbage), ext = (kv, score) f32 [B, m + T, hd] of the pending
        rows followed by the chunk (m > 1; None for m == 1).
        """
        m = self.ratio
        b, t, _ = x_btd.shape
        if m == 1:
            j_bg = lengths_b[:, None] + jnp.arange(t)
            return self.norm(self.wkv(x_btd)), j_bg, src.pend_kv, src.pend_score, None
        # the pooling runs in f32 (the release promotes these weights to f32)
        xf_btd = x_btd.astype(jnp.float32)
        kv_ext = jnp.concatenate([src.pend_kv, self.wkv(xf_btd)], axis=1)  # [B, m + T, hd]
        sc_ext = jnp.concatenate([src.pend_score, self.wgate(xf_btd)], axis=1)
        g = (m - 1 + t) // m
        rows_bk = _ext_index(jnp.arange(g * m)[None, :], lengths_b, m, t)  # [B, G*m]
        kv_bgmd = take_rows(kv_ext, rows_bk).reshape(b, g, m, -1)
        sc_bgmd = take_rows(sc_ext, rows_bk).reshape(b, g, m, -1)
        pooled_bgd = jnp.sum(jax.nn.softmax(sc_bgmd, axis=2) * kv_bgmd, axis=2)
        j_bg = (lengths_b // m)[:, None] + jnp.arange(g)
        pend_kv, pend_score = pending_rows(kv_ext, sc_ext, lengths_b, n_new_b, m)
        return self.norm(pooled_bgd.astype(x_btd.dtype)), j_bg, pend_kv, pend_score, (kv_ext, sc_ext)
