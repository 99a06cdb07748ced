"""A decode step's expert routing in one launch (Pallas, Triton lowering).

From the router logits of a row: scores (the model's score function), the top-k of scores + the selection
bias, and the chosen experts' weights (their scores, normalized over the k and scaled, the model's
`routing_weights`). XLA ran the top-k of the 384 experts of v41-flash as a kernel of 5.6 us per call on the
H200 (the slice at batch 1: 6 calls, 34 us per step), plus a fusion for the scores and weights. Here one
program per row, one warp (every reduction stays within the warp's shuffles), picks the k largest by k
rounds of a max and the lowest index attaining it: lax.top_k's set and order (descending, ties to the lower
index).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_STATIC = ("k", "scores", "func", "weights", "scale", "interpret")


def _padded(e: int) -> int:
    return max(16, 1 << (e - 1).bit_length())  # Triton blocks are powers of two


def _kernel(l_ref, b_ref, w_ref, ids_ref, *, e, k, scores, func, weights, scale):
    n = pl.program_id(0)
    ep = _padded(e)
    idx = jnp.arange(ep)
    valid = idx < e
    # padded lanes: logit -inf (no share in a softmax), never selected
    s = scores(plt.load(l_ref.at[n, pl.ds(0, ep)], mask=valid, other=-jnp.inf), func)
    sel = jnp.where(valid, s + plt.load(b_ref.at[pl.ds(0, ep)], mask=valid, other=0.0), -jnp.inf)
    chosen = []
    for j in range(k):
        i = jnp.min(jnp.where(sel == jnp.max(sel), idx, e - 1))  # (e - 1: in range even for NaN scores)
        chosen.append(jnp.sum(jnp.where(idx == i, s, 0.0)))  # exact: the one score, plus zeros
        ids_ref[n, j] = i
        sel = jnp.where(idx == i, -jnp.inf, sel)
    total = sum(chosen)
    for j, c in enumerate(chosen):
        w_ref[n, j] = weights(c, total, k, scale)


@functools.partial(jax.jit, static_argnames=_STATIC)
def route(logits_ne: jax.Array, bias_e: jax.Array, *, k: int, scores, func: str, weights, scale: float,
          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(weights f32 [N, k], expert ids int32 [N, k]) of router logits f32 [N, E] with the selection bias f32
    [E]: ids the top-k of scores(logits, func) + bias, in descending order, ties to the lower expert;
    weights(chosen scores, their sum, k, scale) their weights. `scores`, `weights`: the model's functions
    (`moe.router_scores`, `moe.routing_weights`), traced here on one row's values."""
    n, e = logits_ne.shape
    if bias_e.shape != (e,) or not 0 < k <= e:
        raise ValueError(f"route: logits {logits_ne.shape}, bias {bias_e.shape}, k={k}: bias must be [E], 0 < k <= E")
    if interpret:  # the interpreter clamps a slice past the array back into it (moving it): pad instead
        logits_ne = jnp.pad(logits_ne, ((0, 0), (0, _padded(e) - e)))
        bias_e = jnp.pad(bias_e, (0, _padded(e) - e))
    kernel = functools.partial(_kernel, e=e, k=k, scores=scores, func=func, weights=weights, scale=scale)
    return pl.pallas_call(
        kernel, grid=(n,), interpret=interpret, compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        out_shape=[jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32)],
        name="route",
    )(logits_ne.astype(jnp.float32), bias_e.astype(jnp.float32))
