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

from kernels_pallas import gpu_hyper
from kernels_pallas.gpu_ticket import last_program

_STATIC = ("k", "scores", "func", "weights", "scale", "interpret")


def _padded(e: int) -> int:
    return max(16, 1 << (e - 1).bit_length())  # Triton blocks are powers of two


def _route_row(l_ref, b_ref, w_ref, ids_ref, n, *, e, k, scores, func, weights, scale, volatile=False):
    """Row n's routing from its logits in l_ref (at least `_padded(e)` columns or masked past e); volatile: read
    them past the L1 (other programs of the launch wrote them)."""
    ep = _padded(e)
    idx = jnp.arange(ep)
    valid = idx < e
    # padded lanes: logit -inf (no share in a softmax), never selected
    s = scores(plt.load(l_ref.at[n, pl.ds(0, ep)], mask=valid, other=-jnp.inf, volatile=volatile), func)
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


def _kernel(l_ref, b_ref, w_ref, ids_ref, **statics):
    _route_row(l_ref, b_ref, w_ref, ids_ref, pl.program_id(0), **statics)


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


def _experts_per_program(e: int, most: int) -> int:
    """The largest power of two <= most dividing e: each program's block of router rows."""
    return min(e & -e, most)


def _logits_kernel(x_ref, wt_ref, b_ref, cnt_in_ref, w_ref, ids_ref, lg_ref, cnt_ref, *, e, eb, kc, interpret,
                   **statics):
    """Program (n, p): row n's logits of experts p * eb ... (its block of the router weight, read once); the
    row's last program to arrive (`gpu_ticket.last_program`) routes the row."""
    del cnt_in_ref  # aliased to cnt_ref
    n, p = pl.program_id(0), pl.program_id(1)
    d, programs = x_ref.shape[1], e // eb
    rows = pl.ds(p * eb, eb)
    logits = sum(jnp.sum(wt_ref[rows, pl.ds(c * kc, kc)] * x_ref[n, pl.ds(c * kc, kc)].astype(jnp.float32)[None, :],
                         axis=1) for c in range(d // kc))
    lg_ref[n, rows] = logits
    last_program(cnt_ref, n, programs,
                 lambda: _route_row(lg_ref, b_ref, w_ref, ids_ref, n, e=e, volatile=True, **statics), interpret=interpret)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "experts_per_program", "num_warps"))
def router_route(x_nd: jax.Array, w_ed: jax.Array, bias_e: jax.Array, *, k: int, scores, func: str, weights,
                 scale: float, experts_per_program: int = 4, num_warps: int = 4,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router's projection and `route` in one launch: (weights f32 [N, k], expert ids int32 [N, k], logits
    f32 [N, E]) of x [N, D] (any float dtype) and the router weight f32 [E, D]: logits = x . w^T as f32 products
    (XLA's dot on a GPU may use TF32), then `route`'s selection. Grid N x E / experts_per_program: a row's
    programs split the weight's 8 MB (v41-flash) and meet through an atomic counter, the last one routing."""
    n, d = x_nd.shape
    e = w_ed.shape[0]
    if w_ed.shape != (e, d) or bias_e.shape != (e,) or not 0 < k <= e or not gpu_hyper.supported(1, d):
        raise ValueError(f"router_route: x {x_nd.shape}, weight {w_ed.shape}, bias {bias_e.shape}, k={k}: the "
                         f"weight must be [E, D], bias [E], 0 < k <= E, D at most {gpu_hyper.MAX_CHUNKS} "
                         f"power-of-two slices of >= 16")
    kc = gpu_hyper.chunk(d)  # a row read in slices, as the hyper kernels read theirs
    eb = _experts_per_program(e, experts_per_program)
    bias_e = bias_e.astype(jnp.float32)
    if interpret:  # as in `route`: the interpreter would move a slice past the array back into it
        bias_e = jnp.pad(bias_e, (0, _padded(e) - e))
    kernel = functools.partial(_logits_kernel, e=e, eb=eb, kc=kc, k=k, scores=scores, func=func, weights=weights,
                               scale=scale, interpret=interpret)
    w, ids, logits, _ = pl.pallas_call(
        kernel, grid=(n, e // eb), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        out_shape=[jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32),
                   jax.ShapeDtypeStruct((n, _padded(e)), jnp.float32),  # the routing reads a power-of-two block
                   jax.ShapeDtypeStruct((n,), jnp.int32)],  # the row's counter, zero before and after
        input_output_aliases={3: 3},
        name="router_route",
    )(x_nd, w_ed.astype(jnp.float32), bias_e, jnp.zeros((n,), jnp.int32))
    return w, ids, logits[:, :e]
