"""The GPU kernel of a hyper-connected sub-layer's input side (`kernels_pallas.gpu_hyper`) against the model's
jnp path: interpreted on a CPU, compiled on a GPU; its gradient, its dispatch, the model's decode logits with it
(that it lowers to Triton at the model's shapes: tests/test_kernels_lowering.py).

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
from tests.kernel_checks import lower_for_h200

CONSTS = (20, 1e-6, 1e-20, 1e-20)  # Sinkhorn iterations, hc eps, the projection's and the norm's eps (released)
STATICS = dict(coefficients=hyper.coefficients, collapse_rows=hyper.collapse_rows, norm=layers.rms_apply, iters=20,
               hc_eps=1e-6, mix_eps=1e-20, norm_eps=1e-20)


@pytest.fixture(autouse=True)
def _exact_f32_dots():
    with jax.default_matmul_precision("highest"):  # TF32 otherwise on a GPU, in both paths' projection dot
        yield


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


kernel = jax.jit(hyper._input_kernel, static_argnums=0)
reference = jax.jit(hyper._input_reference, static_argnums=0)


@pytest.mark.parametrize("n,c,dim,dtype", [(1, 4, 64, jnp.float32), (3, 4, 128, jnp.bfloat16),
                                           (8, 4, 1024, jnp.bfloat16), (2, 2, 96, jnp.float32),
                                           (1, 4, 5120, jnp.bfloat16)])  # 96 = 3 x 32, 5120 = 5 x 1024 (v41-flash)
def test_kernel_matches_the_jnp_path(n, c, dim, dtype):
    args = _case(n, c, dim, dtype)
    (x, pre, post, comb), (x_r, pre_r, post_r, comb_r) = kernel(CONSTS, *args), reference(CONSTS, *args)
    assert x.shape == (n, dim) and x.dtype == dtype and comb.shape == (n, c, c)
    np.testing.assert_allclose(pre, pre_r, rtol=1e-6)
    np.testing.assert_allclose(post, post_r, rtol=1e-6)
    np.testing.assert_allclose(comb, comb_r, atol=1e-6)
    np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-4)  # doubly stochastic, as the model's
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(x_r, np.float32), rtol=ulp, atol=1e-6)


def test_gradient_is_the_jnp_paths():
    """The custom VJP's backward is the jnp path's: gradients of every input, all four outputs weighted."""
    args = _case(2, 4, 64, jnp.float32, seed=1)
    w = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(2, 64), (2, 4), (2, 4), (2, 4, 4)])]
    loss = lambda f: lambda *a: sum(jnp.sum(o * wi) for o, wi in zip(f(CONSTS, *a), w))
    got = jax.grad(loss(hyper._input_kernel), argnums=tuple(range(6)))(*args)
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
        gpu_hyper.hyper_in(jnp.ones((1, 4, 100)), jnp.ones((1, 24)), jnp.ones((1, 4)), jnp.ones(100), jnp.ones(3),
                           jnp.ones(24), **STATICS, interpret=True)


def _decode_error(monkeypatch, **dispatch) -> float:
    """tiny's first 3 layers, f32: the decode logits of a jnp step against the same step traced afresh with the
    `kernels` dispatch functions in `dispatch` replaced (everything else jnp), from one cache filled by jnp decode
    steps; max |difference| / logit scale."""
    cfg = truncated(d.preset("tiny").replace(dtype="float32"), 3)
    params = d.init_params(cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    cache = d.init_cache(cfg, 2, 32)
    for i in range(4):
        _, cache = d.decode_step(cfg, params, cache, ids[:, i])
    want, _ = d.decode_step(cfg, params, cache, ids[:, 4])
    for name, fn in dispatch.items():
        monkeypatch.setattr(kernels, name, fn)
    # a new jit of the api's forward: the api's own jitted step keeps its jnp program, and no other test's
    # compiled programs are dropped from the caches
    got, _ = jax.jit(functools.partial(d.forward, cfg))(params, cache, jnp.asarray(ids[:, 4:5]),
                                                         jnp.ones((2,), jnp.int32))
    want, got = np.asarray(want), np.asarray(got)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"max |dlogit| / scale {err:.2e}")
    return err


def test_model_decode_logits_with_the_kernel(monkeypatch):
    """Decode logits with the kernel forced on to 1e-5 of the logit scale (`_decode_error`)."""
    calls = []
    err = _decode_error(monkeypatch, hyper_in_on=lambda *a: calls.append(a) or True)
    assert len(calls) == 2 * 3  # both sub-layers of each block
    assert err <= 1e-5, err



def _expand_case(n, c, dim, dtype, seed=0):
    """(y, h, post, comb, pre_mix, fn, scale, base, norm weight): a sub-layer's output and coefficients, then
    `_case`'s next sub-layer."""
    h, pre_mix, fn, scale, base, norm_w = _case(n, c, dim, dtype, seed)
    k = jax.random.split(jax.random.key(seed + 100), 3)
    y = (3 * jax.random.normal(k[0], (n, dim))).astype(dtype)
    post = 2 * jax.random.uniform(k[1], (n, c))
    comb = jax.nn.softmax(jax.random.normal(k[2], (n, c, c)), axis=-1)
    return y, h, post, comb, pre_mix, fn, scale, base, norm_w


expand_kernel = jax.jit(hyper._expand_kernel, static_argnums=0)
expand_reference = jax.jit(hyper._expand_reference, static_argnums=0)


@pytest.mark.parametrize("n,c,dim,dtype", [(1, 4, 64, jnp.float32), (3, 4, 1024, jnp.bfloat16),
                                           (2, 2, 96, jnp.float32)])  # 1024: 4 programs a row; 96: 3 of 32
def test_expand_kernel_matches_the_jnp_path(n, c, dim, dtype):
    """The expand + input-side kernel against `expand` then the jnp input side. The stream h' is the same products
    and sums in the same order, rounded once to its dtype; the projection's hc x D products are summed in another
    order than XLA's dot (per program, then across programs), so pre, post and comb get 1e-5 where `hyper_in`'s
    test, fed XLA's dot in both paths, holds 1e-6 (measured here: 1.5e-6 relative)."""
    args = _expand_case(n, c, dim, dtype)
    got, want = expand_kernel(CONSTS, *args), expand_reference(CONSTS, *args)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6
    (h, x, pre, post, comb), (h_r, x_r, pre_r, post_r, comb_r) = got, want
    assert h.shape == (n, c, dim) and h.dtype == dtype and x.dtype == dtype
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_r, np.float32), rtol=ulp, atol=1e-6)
    np.testing.assert_allclose(pre, pre_r, rtol=1e-5)
    np.testing.assert_allclose(post, post_r, rtol=1e-5)
    np.testing.assert_allclose(comb, comb_r, atol=1e-5)
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(x_r, np.float32), rtol=ulp, atol=1e-6)


def test_expand_dispatch_and_gradient(monkeypatch):
    """Off by default (untimed); on, for few rows of a power-of-two hc >= 2; the backward is the jnp path's."""
    assert not kernels.expand_hyper_in_on("pallas", 1, 4, 5120)
    monkeypatch.setattr(kernels, "EXPAND_HYPER_IN_ROWS", 8)
    assert kernels.expand_hyper_in_on("pallas", 8, 4, 5120) and not kernels.expand_hyper_in_on("pallas", 9, 4, 5120)
    assert not kernels.expand_hyper_in_on("pallas", 1, 1, 1024) and not kernels.expand_hyper_in_on("jnp", 1, 4, 1024)
    args = _expand_case(2, 4, 64, jnp.float32, seed=1)
    w = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(2, 4, 64), (2, 64), (2, 4), (2, 4),
                                                                        (2, 4, 4)])]
    loss = lambda f: lambda *a: sum(jnp.sum(o * wi) for o, wi in zip(f(CONSTS, *a), w))  # noqa: E731
    got = jax.grad(loss(hyper._expand_kernel), argnums=tuple(range(9)))(*args)
    want = jax.grad(loss(hyper._expand_reference), argnums=tuple(range(9)))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_model_decode_logits_with_the_expand_kernel(monkeypatch):
    """The same with each expand that a sub-layer's input side follows as one kernel with it (`hyper_in` for the
    rest): within each block, and from a block into the next unless that one reads the stream (Engram)."""
    calls = []
    err = _decode_error(monkeypatch, hyper_in_on=lambda *a: True,
                        expand_hyper_in_on=lambda *a: calls.append(a) or True)
    # the forward's question, then 3 within the blocks and 1 across: tiny's layer 1 has Engram, so 0 -> 1 is not
    assert len(calls) == 1 + 3 + 1
    assert err <= 1e-5, err


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles it for real (the tests above)")
def test_expand_kernel_lowers_for_an_h200_at_the_v41_shapes():
    """Every operation of the expand kernel's body (its atomic ticket, volatile loads, masked shares) has a
    Triton lowering at the released stream (hc 4 x 5120, bf16; 20 programs a row)."""
    s = jax.ShapeDtypeStruct
    n, c, dim, m = 2, 4, 5120, 24
    args = (s((n, dim), jnp.bfloat16), s((n, c, dim), jnp.bfloat16), s((n, c), jnp.float32),
            s((n, c, c), jnp.float32), s((n, c), jnp.float32), s((m, c * dim), jnp.float32), s((dim,), jnp.float32),
            s((3,), jnp.float32), s((m,), jnp.float32))
    text = lower_for_h200(lambda *a: gpu_hyper.expand_hyper_in(*a, expand_rows=hyper.expand_rows, **STATICS), *args)
    assert "expand_hyper_in" in text and "xla.gpu.triton" in text
