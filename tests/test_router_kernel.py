"""The GPU routing kernel (`kernels_pallas.gpu_router`) against the model's jnp path: interpreted on a CPU,
compiled on a GPU; its gradient, its dispatch, the MoE layer with it, and (on a CPU) that it lowers to Triton
for an H200. Expert ids: exactly lax.top_k's (set and order, ties to the lower expert); weights: the same
operations except the sum over the k chosen scores (f32 summation order), <= 1e-6 relative."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv41_jax as d
from dsv41_jax import kernels, moe
from kernels_pallas import gpu_router
from tests.kernel_checks import lower_for_h200

kernel = jax.jit(moe._route_kernel, static_argnums=0)
reference = jax.jit(moe._route_reference, static_argnums=0)


def _case(n, e, seed=0, ties=True):
    """(logits [n, e], bias [e]); with ties, experts 5..8 copy expert 0's logit and bias (equal selections)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    logits, bias = 2 * jax.random.normal(k1, (n, e)), 0.1 * jax.random.normal(k2, (e,))
    if ties:
        logits, bias = logits.at[:, 5:9].set(logits[:, :1]), bias.at[5:9].set(bias[0])
    return logits, bias


@pytest.mark.parametrize("n,e,k,func", [(1, 384, 6, "sqrtsoftplus"), (8, 384, 6, "sqrtsoftplus"),
                                        (3, 16, 2, "softmax"), (2, 8, 2, "sigmoid"), (4, 24, 1, "sqrtsoftplus"),
                                        (1, 9, 9, "softmax")])
def test_kernel_matches_the_jnp_path(n, e, k, func):
    """Released (384, top-6), `small` (16, top-2) and tiny (8) widths, a width that is no power of two, top-1,
    all experts; experts 5..8 tie with expert 0."""
    logits, bias = _case(n, e, seed=e + n)
    (w, ids), (w_r, ids_r) = kernel((k, func, 1.5), logits, bias), reference((k, func, 1.5), logits, bias)
    assert ids.dtype == jnp.int32 and ids.shape == (n, k)
    np.testing.assert_array_equal(ids, ids_r)
    np.testing.assert_allclose(w, w_r, rtol=1e-6)


def test_ties_go_to_the_lower_expert():
    logits = jnp.zeros((1, 32)).at[0, [3, 7, 20]].set(1.0)
    _, ids = kernel((4, "sigmoid", 1.0), logits, jnp.zeros(32))
    np.testing.assert_array_equal(ids, [[3, 7, 20, 0]])


def test_gradient_is_the_jnp_paths():
    logits, bias = _case(3, 16, seed=1)
    g = jax.random.normal(jax.random.key(2), (3, 2))
    loss = lambda f: lambda lg: jnp.sum(f((2, "sqrtsoftplus", 1.5), lg, bias)[0] * g)
    got, want = jax.grad(loss(moe._route_kernel))(logits), jax.grad(loss(moe._route_reference))(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(want)).max() > 0


def test_dispatch():
    assert kernels.route_on("pallas", 8, 384)
    assert not kernels.route_on("pallas", 9, 384)  # prefill chunks and wide batches keep lax.top_k
    assert not kernels.route_on("jnp", 1, 384)
    assert kernels.route_on("auto", 1, 384) == (jax.default_backend() == "gpu")
    with pytest.raises(ValueError, match="bias must be"):
        gpu_router.route(jnp.zeros((1, 8)), jnp.zeros(7), k=2, scores=moe.router_scores, func="sigmoid",
                         weights=moe.routing_weights, scale=1.0, interpret=True)


def test_moe_layer_with_the_kernel():
    """A MoE layer (tiny, f32, random router bias) at decode rows: the same output and load with kernels
    "pallas" (only the routing dispatched: tiny's float experts have no kernel below it on a CPU) as with jnp;
    with an image mask the jnp path routes (bias_vl)."""
    cfg = d.preset("tiny").replace(dtype="float32", param_dtype="float32")
    layer = moe.MoE(cfg, rngs=nnx.Rngs(0))
    layer.router.bias.value = 0.3 * jax.random.normal(jax.random.key(1), layer.router.bias.value.shape)
    x = jax.random.normal(jax.random.key(2), (2, 1, cfg.dim))
    calls = []
    real = kernels.route

    def counted(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "route", counted)
        mp.setattr(kernels, "_weight_kernels", lambda kernels_, rows: False)
        (y, load), (y_r, load_r) = layer(x, kernels="pallas"), layer(x, kernels="jnp")
        assert len(calls) == 1
        layer(x, kernels="pallas", image_mask=jnp.ones((2, 1), bool))
        assert len(calls) == 1
    np.testing.assert_array_equal(load, load_r)
    np.testing.assert_allclose(y, y_r, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles the kernel in the tests above")
@pytest.mark.parametrize("e,k,func", [(384, 6, "sqrtsoftplus"), (16, 2, "softmax"), (8, 2, "sigmoid")])
def test_lowers_to_triton_for_an_h200(e, k, func):
    """Every operation of the kernel's body has a Triton lowering (v41-flash, `small`, tiny)."""
    text = lower_for_h200(
        lambda lg, b: gpu_router.route(lg, b, k=k, scores=moe.router_scores, func=func, weights=moe.routing_weights,
                                       scale=1.5),
        jax.ShapeDtypeStruct((8, e), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.float32))
    assert text.count("xla.gpu.triton") == 1
