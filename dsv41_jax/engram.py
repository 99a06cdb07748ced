"""Engram: hashed n-gram embeddings gated into the residual stream (layers `engram_layer_ids`).

The lookups depend only on token ids (see engram_hash), so the tables need not live in accelerator
memory: a table placed in host memory (a `pinned_host` sharding, as `load_checkpoint(...,
engram_on_host=True)` does) is gathered on the host inside the jitted step (`compute_on("device_host")`)
and only the gathered rows [B, T, cols, head_dim] and their scales move to the device. The path is
chosen from where the table array lives, so params on either side run through the same code.

The gate is a normalized dot product between each hc copy of the stream and a per-copy key, through
a signed square root and a sigmoid, as the release does.

With `weight_format="fp8"` a table keeps the released format: E4M3 rows plus one E8M0 scale per 32
channels (`table_scale`, uint8 exponents), dequantized row by row on lookup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.compute_on import compute_on

from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import released_fp8_linear, normal_init, weights_fp8

TABLE_FP8 = quant.Fp8Codec(block=32)
HOST_MEMORY_KIND = "pinned_host"  # what jit types as host memory (an "unpinned_host" array is typed as device)


def in_host_memory(x) -> bool:
    """Whether `x` (an array or a tracer of one) lives in host memory (`jax.memory.Space.Host`)."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


@compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _gather_on_host(tables: tuple, ids: jax.Array) -> tuple:
    # ids come from the hash (always in range); "promise_in_bounds" keeps every operand of the gather
    # in host memory ("fill" would mix in device-memory mask constants, which jit refuses)
    return tuple(t.at[ids].get(mode="promise_in_bounds") for t in tables)


def host_rows(tables: tuple, ids: jax.Array) -> tuple:
    """Rows `ids` of each host-memory table, gathered on the host; the rows come back in device memory."""
    rows = _gather_on_host(tables, jax.device_put(ids, jax.memory.Space.Host))
    return jax.device_put(rows, jax.memory.Space.Device)


class Engram(nnx.Module):
    def __init__(self, cfg: ModelConfig, rows: int, *, rngs: nnx.Rngs):
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
        tables = (self.table[...],) + ((self.table_scale[...],) if self.fp8 else ())
        if in_host_memory(tables[0]):
            got = host_rows(tables, ids)
        else:
            got = tuple(jnp.take(t, ids, axis=0) for t in tables)
        if not self.fp8:
            return got[0]
        rows, scales = got
        return TABLE_FP8.decode({"values": jax.lax.bitcast_convert_type(rows, jnp.uint8), "scales": scales})

    def __call__(self, h_bthd: jax.Array, ids_btc: jax.Array, *, kernels: str = "jnp",
                 image_mask: jax.Array | None = None) -> jax.Array:
        """h: [B, T, hc, dim] stream; ids: int32 [B, T, n_cols] table rows. Returns the new stream.
        kernels: the `dsv41_jax.kernels` switch of the FP8 projection. image_mask: bool [B, T], True
        where the gate is shut (image positions pass through untouched, as released)."""
        b, t = ids_btc.shape[:2]
        emb = self.lookup(ids_btc).reshape(b, t, -1).astype(h_bthd.dtype)
        kv = self.wkv(emb, jnp.float32, kernels=kernels)
        key = kv[..., : self.hc * self.dim].reshape(b, t, self.hc, self.dim)
        value = kv[..., self.hc * self.dim:]
        h = h_bthd.astype(jnp.float32)
        weight = self.q_weight[...] * self.k_weight[...]
        rstd = (jax.lax.rsqrt(jnp.mean(h * h, -1) + self.eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + self.eps))
        dot = jnp.sum(h * weight * key, -1) * rstd * self.dim ** -0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
        if image_mask is not None:
            gate = jnp.where(image_mask[..., None], 0.0, gate)
        return (h + gate[..., None] * value[:, :, None, :]).astype(h_bthd.dtype)
