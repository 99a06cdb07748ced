"""Small building blocks: Linear (weights stored [out, in] as in the checkpoint), RMSNorm, Embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Buffer(nnx.Variable):
    """State that is part of the model but not trained by gradients (router bias, token maps)."""


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float | None = None) -> jax.Array:
    """Scaled normal init: std = fan_in^-0.5 over the last axis unless given."""
    std = shape[-1] ** -0.5 if std is None else std
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ W.T with W [out, in]; computes in x's dtype with f32 accumulation."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype="float32"):
        self.weight = nnx.Param(normal_init(rngs, (d_out, d_in), dtype))

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        w = self.weight[...].astype(x.dtype)
        y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)


class RMSNorm(nnx.Module):
    """Normalizes in f32 over the last axis; eps is added to the mean square (released norm_eps 1e-20)."""

    def __init__(self, dim: int, eps: float, *, dtype="float32"):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype="float32"):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), dtype, std=1.0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)
