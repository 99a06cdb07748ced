"""Greedy and temperature sampling, one request per row, reproducible per request.

Each row draws with key fold_in(key(seed), step) where step counts that request's generated tokens,
so a request's samples do not depend on its slot or on what else is running.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def sample(logits_bv, temperature_b, seed_b, step_b):
    """int32 [B] ids: argmax where temperature == 0, else a draw from softmax(logits / temperature).

    The draw is `jax.random.categorical`'s Gumbel-max, argmax(gumbel(key) + logits / t), written out so that one
    argmax over the vocabulary serves both cases (the row's values where t == 0): a decode step's sampling is
    one argmax on its serial path rather than two and a select (the same ids, tests/test_sampling.py)."""
    def one(logits, t, seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        drawn = jax.random.gumbel(key, logits.shape, logits.dtype) + logits / jnp.maximum(t, 1e-5)
        return jnp.argmax(jnp.where(t > 0, drawn, logits)).astype(jnp.int32)
    return jax.vmap(one)(logits_bv, temperature_b, seed_b, step_b)
