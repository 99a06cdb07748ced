"""Engram: hashed n-gram embeddings gated into the residual stream (layers `engram_layer_ids`).

The lookups depend only on token ids (see engram_hash), so the tables could live in host memory and
be prefetched; here they are ordinary params. The gate is a normalized dot product between each hc copy
of the stream and a per-copy key, through a signed square root and a sigmoid, as the release does.

With `weight_format="fp8"` a table keeps the released format: E4M3 rows plus one E8M0 scale per 32
channels (`table_scale`, uint8 exponents), dequantized row by row on lookup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.layers import released_fp8_linear, normal_init, weights_fp8

TABLE_FP8 = quant.Fp8Codec(block=32)


class Engram(nnx.Module):
    def __init__(self, cfg, rows: int, *, rngs: nnx.Rngs):
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.fp8 = weights_fp8(cfg)
        table = normal_init(rngs, (rows, cfg.engram_head_dim), jnp.float32 if self.fp8 else cfg.param_dtype, std=1.0)
        if self.fp8:
            rec = TABLE_FP8.encode(table)
            self.table = nnx.Param(jax.lax.bitcast_convert_type(rec["values"], jnp.float8_e4m3fn))
            self.table_scale = nnx.Param(rec["scales"])
        else:
            self.table = nnx.Param(table)
        self.wkv = released_fp8_linear(cfg, n_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), rngs=rngs)
        self.q_weight = nnx.Param(jnp.ones((cfg.hc_mult, cfg.dim), jnp.float32))
        self.k_weight = nnx.Param(jnp.ones((cfg.hc_mult, cfg.dim), jnp.float32))
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps

    def lookup(self, ids: jax.Array) -> jax.Array:
        """Table rows [..., head_dim] for integer ids [...] (f32 when dequantized from FP8)."""
        rows = jnp.take(self.table[...], ids, axis=0)
        if not self.fp8:
            return rows
        scales = jnp.take(self.table_scale[...], ids, axis=0)
        return TABLE_FP8.decode({"values": jax.lax.bitcast_convert_type(rows, jnp.uint8), "scales": scales})

    def __call__(self, h_bthd: jax.Array, ids_btc: jax.Array) -> jax.Array:
        """h: [B, T, hc, dim] stream; ids: int32 [B, T, n_cols] table rows. Returns the new stream."""
        b, t = ids_btc.shape[:2]
        emb = self.lookup(ids_btc).reshape(b, t, -1).astype(h_bthd.dtype)
        kv = self.wkv(emb, jnp.float32)
        key = kv[..., : self.hc * self.dim].reshape(b, t, self.hc, self.dim)
        value = kv[..., self.hc * self.dim:]
        h = h_bthd.astype(jnp.float32)
        weight = self.q_weight[...] * self.k_weight[...]
        rstd = (jax.lax.rsqrt(jnp.mean(h * h, -1) + self.eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + self.eps))
        dot = jnp.sum(h * weight * key, -1) * rstd * self.dim ** -0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
        return (h + gate[..., None] * value[:, :, None, :]).astype(h_bthd.dtype)
