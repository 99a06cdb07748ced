"""Manifold-constrained hyper-connections (mHC): the residual stream is `hc` parallel copies.

Shape letters: c = the hc copies of the stream (h is kept for attention heads everywhere else), d = dim.

Each sub-layer (attention, FFN) derives three coefficient sets from its normalized input stream:
`pre` [hc] (how to collapse the copies into one input), `post` [hc] (how to spread the output back),
`comb` [hc, hc] (how copies mix into each other: made doubly stochastic by Sinkhorn iterations).
As in the release, the `pre` a sub-layer computes is used by the *next* sub-layer: attention of layer
l collapses with the FFN-`pre` of layer l-1 (one-hot for layer 0), the FFN with attention's `pre`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.layers import normal_init


def sinkhorn_split(mixes: jax.Array, scale: jax.Array, base: jax.Array, hc: int, iters: int, eps: float,
                   unroll: str = "auto"):
    """mixes [..., (2+hc)*hc] f32 -> pre [..., hc], post [..., hc], comb [..., hc, hc] (rows -> cols).

    unroll: "auto" | "unrolled" | "rolled" (ModelConfig.sinkhorn_unroll)."""
    pre = jax.nn.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * jax.nn.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*mixes.shape[:-1], hc, hc)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    # "auto": rolled on CPU (20 unrolled iterations per sub-layer dominate compile time there); unrolled
    # on accelerators, where a rolled loop costs a host round trip per iteration and unrolled ones fuse.
    if unroll == "auto":
        unroll = "unrolled" if jax.default_backend() != "cpu" else "rolled"
    comb = jax.lax.fori_loop(0, iters - 1, body, comb, unroll=True if unroll == "unrolled" else 1)
    return pre, post, comb


class HyperMix(nnx.Module):
    """Coefficient projection of one sub-layer: fn [(2+hc)*hc, hc*dim], base [(2+hc)*hc], scale [3]."""

    def __init__(self, dim: int, hc: int, iters: int, eps: float, norm_eps: float, *, rngs: nnx.Rngs,
                 unroll: str = "auto"):
        mix = (2 + hc) * hc
        self.fn = nnx.Param(normal_init(rngs, (mix, hc * dim), jnp.float32))
        self.base = nnx.Param(jnp.zeros((mix,), jnp.float32))
        self.scale = nnx.Param(jnp.full((3,), 0.1, jnp.float32))
        self.hc, self.iters, self.eps, self.norm_eps, self.unroll = hc, iters, eps, norm_eps, unroll

    def __call__(self, x_btcd: jax.Array):
        """x [B, T, hc, D] -> pre [B, T, hc], post [B, T, hc], comb [B, T, hc, hc] (f32)."""
        x = x_btcd.reshape(*x_btcd.shape[:-2], -1).astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.norm_eps)
        mixes = jnp.einsum("...i,mi->...m", x, self.fn[...]) * rstd
        # materialized once: XLA otherwise fuses the (cheap-looking, serial) Sinkhorn iterations into every
        # element of the [B, T, hc, D] collapse / expand that reads them (H200 profile: 4.8 us per expand)
        return jax.lax.optimization_barrier(
            sinkhorn_split(mixes, self.scale[...], self.base[...], self.hc, self.iters, self.eps, self.unroll))


# collapse and expand contract over the hc = 4 copies: written as products and sums, not einsums, so that
# XLA fuses them with their neighbours (a dot over 4 is a kernel of its own: 4 per layer per decode step
# on the GPU, each reading and writing the whole stream)
def collapse(x_btcd: jax.Array, pre_btc: jax.Array) -> jax.Array:
    """[B, T, hc, D] x [B, T, hc] -> [B, T, D]."""
    x = x_btcd.astype(jnp.float32)
    return sum(x[:, :, i] * pre_btc[:, :, i, None] for i in range(x.shape[2])).astype(x_btcd.dtype)


def expand(y_btd: jax.Array, residual_btcd: jax.Array, post_btc: jax.Array, comb_btcc: jax.Array) -> jax.Array:
    """out[j] = post[j] * y + sum_i comb[i, j] * residual[i]: [B, T, D] -> [B, T, hc, D] (comb: copy i -> j)."""
    out = post_btc[..., None] * y_btd[:, :, None, :].astype(jnp.float32)
    res = residual_btcd.astype(jnp.float32)
    for i in range(res.shape[2]):
        out = out + comb_btcc[:, :, i, :, None] * res[:, :, i, None, :]
    return out.astype(y_btd.dtype)
