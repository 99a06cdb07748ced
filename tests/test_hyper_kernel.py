"""The GPU kernels of a hyper-connected sub-layer's input side (`kernels_pallas.gpu_hyper`: the input and the
coefficients), against the model's jnp path: interpreted on a CPU, compiled on a GPU; their gradient, their
dispatch, the model's decode logits with them (that they lower to Triton at the model's shapes:
tests/test_kernels_lowering.py).

Tolerances: pre, post, the normalized input: the same operations in the same order except the sums of squares
(f32 summation order), so <= 1e-6 relative; comb: 20 Sinkhorn normalizations of such values, <= 1e-6 absolute
(its entries are <= 1). A bf16 input: one bf16 rounding (2**-7 relative): compiled on a GPU, XLA leaves out the
jnp path's rounding of the collapsed row to bf16 before the norm (its default `xla_allow_excess_precision`),
the kernel keeps it, as the model is written (H200: 25% of the elements one bf16 ulp apart)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import hyper, kernels, layers
from experiments.bench_decode import truncated
from kernels_pallas import gpu_hyper
from tests.kernel_checks import dot_precisions

CONSTS = (20, 1e-6, 1e-20, 1e-20)  # Sinkhorn iterations, hc eps, the projection's and the norm's eps (released)


def _case(n, c, dim, dtype, seed=0):
    """(h, pre_mix, fn, scale, base, norm weight) of n rows, random, scaled like a trained model's."""
    k = jax.random.split(jax.random.key(seed), 6)
    m = (2 + c) * c
    return ((3 * jax.random.normal(k[0], (n, c, dim))).astype(dtype),
            jax.random.uniform(k[1], (n, c), minval=0.05, maxval=1.0),
            0.05 * jax.random.normal(k[2], (m, c * dim)),
            jax.random.uniform(k[3], (3,), minval=0.05, maxval=1.0),
            jax.random.normal(k[4], (m,)),
            1 + 0.1 * jax.random.normal(k[5], (dim,)))


kernel_path = jax.jit(hyper._input_kernels, static_argnums=0)
reference = jax.jit(hyper._input_reference, static_argnums=0)


@pytest.mark.parametrize("n,c,dim,dtype", [(1, 4, 64, jnp.float32), (3, 4, 128, jnp.bfloat16),
                                           (8, 4, 1024, jnp.bfloat16), (2, 2, 96, jnp.float32),
                                           (1, 4, 5120, jnp.bfloat16)])  # 96 = 3 x 32, 5120 = 5 x 1024 (v41-flash)
def test_kernel_matches_the_jnp_path(n, c, dim, dtype):
    args = _case(n, c, dim, dtype)
    (x, pre, post, comb), (x_r, pre_r, post_r, comb_r) = kernel_path(CONSTS, *args), reference(CONSTS, *args)
    assert x.shape == (n, dim) and x.dtype == dtype and comb.shape == (n, c, c)
    np.testing.assert_allclose(pre, pre_r, rtol=1e-6)
    np.testing.assert_allclose(post, post_r, rtol=1e-6)
    np.testing.assert_allclose(comb, comb_r, atol=1e-6)
    np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-4)  # doubly stochastic, as the model's
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(x_r, np.float32), rtol=ulp, atol=1e-6)


def test_projection_asks_for_ieee_f32():
    """hc_fn is f32 in the release, whose projection is an f32 linear: both paths' projection dots ask for
    HIGHEST, which a CPU always gives and a GPU otherwise replaces by TF32 (fn rounded to 10 mantissa bits)."""
    args = _case(1, 4, 64, jnp.bfloat16)
    h, pre_mix, fn, scale, base, norm_w = args
    jnp_path = jax.make_jaxpr(lambda h, fn: hyper.mix_coefficients(h[:, None], fn, scale, base, 20, 1e-6, 1e-20))
    kernel_path = jax.make_jaxpr(functools.partial(hyper._input_by_kernels, CONSTS))(*args)
    for jaxpr in (jnp_path(h, fn), kernel_path):
        precisions = dot_precisions(jaxpr.jaxpr)
        assert precisions and all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in precisions), precisions


def test_gradient_is_the_jnp_paths():
    """The custom VJP's backward is the jnp path's: gradients of every input, all four outputs weighted."""
    args = _case(2, 4, 64, jnp.float32, seed=1)
    w = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(2, 64), (2, 4), (2, 4), (2, 4, 4)])]
    loss = lambda f: lambda *a: sum(jnp.sum(o * wi) for o, wi in zip(f(CONSTS, *a), w))
    got = jax.grad(loss(hyper._input_kernels), argnums=tuple(range(6)))(*args)
    want = jax.grad(loss(hyper._input_reference), argnums=tuple(range(6)))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        assert np.abs(np.asarray(r)).max() > 0


def test_dispatch():
    assert kernels.hyper_in_on("pallas", 8, 4, 1024)
    assert not kernels.hyper_in_on("pallas", 9, 4, 1024)  # prefill chunks and wide batches keep XLA's kernels
    assert kernels.hyper_in_on("pallas", 1, 4, 5120)  # read in 5 slices of 1024
    assert not kernels.hyper_in_on("pallas", 1, 4, 100)  # Triton blocks are powers of two: slices of 4
    assert not kernels.hyper_in_on("pallas", 1, 3, 1024)
    assert not kernels.hyper_in_on("jnp", 1, 4, 1024)
    assert kernels.hyper_in_on("auto", 1, 4, 1024) == (jax.default_backend() == "gpu")
    with pytest.raises(ValueError, match="power-of-two"):
        gpu_hyper.hyper_coefficients(jnp.ones((1, 4, 100)), jnp.ones((1, 24)), jnp.ones(3), jnp.ones(24),
                                     coefficients=hyper.coefficients, iters=20, hc_eps=1e-6, mix_eps=1e-20,
                                     interpret=True)
    with pytest.raises(ValueError, match="power-of-two"):
        gpu_hyper.hyper_input(jnp.ones((1, 4, 100)), jnp.ones((1, 4)), jnp.ones(100), collapse_rows=hyper.collapse_rows,
                              norm=layers.rms_apply, norm_eps=1e-20, interpret=True)
    with pytest.raises(ValueError, match="pre_mix"):  # each part checks the arguments it takes
        gpu_hyper.hyper_input(jnp.ones((1, 4, 64)), jnp.ones((2, 4)), jnp.ones(64), collapse_rows=hyper.collapse_rows,
                              norm=layers.rms_apply, norm_eps=1e-20, interpret=True)
    with pytest.raises(ValueError, match="mixes"):
        gpu_hyper.hyper_coefficients(jnp.ones((1, 4, 64)), jnp.ones((1, 20)), jnp.ones(3), jnp.ones(24),
                                     coefficients=hyper.coefficients, iters=20, hc_eps=1e-6, mix_eps=1e-20,
                                     interpret=True)


def test_model_decode_logits_with_the_kernel(monkeypatch):
    """tiny's first 3 layers, f32: decode logits with the kernels forced on (everything else jnp) against the jnp path, to 1e-5 of the logit scale, from the same cache (filled
    by jnp decode steps)."""
    cfg = truncated(d.preset("tiny").replace(dtype="float32"), 3)
    params = d.init_params(cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    cache = d.init_cache(cfg, 2, 32)
    for i in range(4):
        _, cache = d.decode_step(cfg, params, cache, ids[:, i])
    want, _ = d.decode_step(cfg, params, cache, ids[:, 4])
    calls = []
    monkeypatch.setattr(kernels, "hyper_in_on", lambda *a: calls.append(a) or True)
    # the same decode step, traced afresh with the kernel in it (a new jit of the api's forward: the api's own
    # jitted step keeps its jnp program, and no other test's compiled programs are dropped from the caches)
    step = jax.jit(functools.partial(d.forward, cfg))
    got, _ = step(params, cache, jnp.asarray(ids[:, 4:5]), jnp.ones((2,), jnp.int32))
    assert len(calls) == 2 * 3  # both sub-layers of each block
    want, got = np.asarray(want), np.asarray(got)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"max |dlogit| / scale {err:.2e}")
    assert err <= 1e-5, err

