"""Engram: hashed n-gram embeddings gated into the residual stream (layers `engram_layer_ids`).

The lookups depend only on token ids (see engram_hash), so the tables could live in host memory and
be prefetched; here they are ordinary params. The gate is a normalized dot product between each hc copy
of the stream and a per-copy key, through a signed square root and a sigmoid, as the release does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.layers import Linear, normal_init


class Engram(nnx.Module):
    def __init__(self, cfg, rows: int, *, rngs: nnx.Rngs):
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.table = nnx.Param(normal_init(rngs, (rows, cfg.engram_head_dim), cfg.param_dtype, std=1.0))
        self.wkv = Linear(n_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), rngs=rngs,
                          dtype=cfg.param_dtype)
        self.q_weight = nnx.Param(jnp.ones((cfg.hc_mult, cfg.dim), jnp.float32))
        self.k_weight = nnx.Param(jnp.ones((cfg.hc_mult, cfg.dim), jnp.float32))
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps

    def __call__(self, h_bthd: jax.Array, ids_btc: jax.Array) -> jax.Array:
        """h: [B, T, hc, dim] stream; ids: int32 [B, T, n_cols] table rows. Returns the new stream."""
        b, t = ids_btc.shape[:2]
        emb = jnp.take(self.table[...], ids_btc, axis=0).reshape(b, t, -1).astype(h_bthd.dtype)
        kv = self.wkv(emb, jnp.float32)
        key = kv[..., : self.hc * self.dim].reshape(b, t, self.hc, self.dim)
        value = kv[..., self.hc * self.dim:]
        h = h_bthd.astype(jnp.float32)
        weight = self.q_weight[...] * self.k_weight[...]
        rstd = (jax.lax.rsqrt(jnp.mean(h * h, -1) + self.eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + self.eps))
        dot = jnp.sum(h * weight * key, -1) * rstd * self.dim ** -0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
        return (h + gate[..., None] * value[:, :, None, :]).astype(h_bthd.dtype)
