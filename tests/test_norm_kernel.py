"""The GPU kernel of an attention layer's q / kv norms (`kernels_pallas.gpu_norm`, through `layers.rms_norms`) against
the model's jnp path: interpreted on a CPU, compiled on a GPU; its gradient and its dispatch (that it lowers to
Triton at the model's shapes: tests/test_kernels_lowering.py).

Tolerance: the same operations in the same order but the sum of squares (f32 summation order): <= 1e-6 relative in
f32; in bf16 one rounding of that, 2**-8 relative (a compiled GPU's XLA may also leave out the jnp path's rounding of
the projection to bf16 before the norm, `xla_allow_excess_precision`; the kernel keeps it, as the model is
written: one more bf16 rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import kernels, layers
from kernels_pallas import gpu_norm

ON_GPU = jax.default_backend() in ("gpu", "cuda")


def _case(rows, dims, seed=0):
    """Projections' f32 outputs [rows, 1, D] scaled like a trained model's, and their norms (random weights)."""
    ks = jax.random.split(jax.random.key(seed), 2 * len(dims))
    xs = [3 * jax.random.normal(ks[2 * i], (rows, 1, dim)) for i, dim in enumerate(dims)]
    norms = [layers.RMSNorm(dim, eps) for dim, eps in zip(dims, (1e-20, 1e-6))]
    for i, norm in enumerate(norms):
        norm.weight[...] = jax.random.uniform(ks[2 * i + 1], (norm.weight.shape[0],), minval=0.5, maxval=1.5)
    return xs, norms


@pytest.mark.parametrize("rows,dims", [(1, (1280, 512)), (5, (1280, 512)), (8, (32, 64))])  # released q / kv; tiny
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_the_jnp_path(rows, dims, dtype):
    xs, norms = _case(rows, dims)
    got = layers.rms_norms(xs, norms, dtype, kernels="pallas")
    want = layers.rms_norms(xs, norms, dtype, kernels="jnp")
    tol = 1e-6 if dtype == jnp.float32 else 2.0 ** -8 * (2 if ON_GPU else 1)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                                   atol=tol * float(jnp.abs(w.astype(jnp.float32)).max()))


def test_gradient_is_the_jnp_paths():
    """A training forward of few tokens on a GPU reaches the kernel: its gradient (inputs and weights) is the
    jnp path's, by `kernels.twin_gradient`."""
    xs, norms = _case(2, (1280, 512), seed=1)

    class Norm:  # an RMSNorm whose weight is a traced array
        def __init__(self, w, eps):
            self.weight, self.eps = w, eps

        def __call__(self, x):
            return layers.rms_norm(x, self.weight, self.eps)

    def loss(xs, weights, kernels_):
        ys = layers.rms_norms(xs, [Norm(w, n.eps) for w, n in zip(weights, norms)], jnp.float32, kernels=kernels_)
        return sum(jnp.sum(y * jnp.arange(y.shape[-1])) for y in ys)

    weights = [norm.weight[...] for norm in norms]
    got = jax.grad(loss, argnums=(0, 1))(xs, weights, "pallas")
    want = jax.grad(loss, argnums=(0, 1))(xs, weights, "jnp")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))


def test_dispatch_takes_few_rows_of_widths_the_kernel_reads():
    assert kernels.rms_norms_on("pallas", 8, (1280, 512)) and kernels.rms_norms_on("pallas", 1, (32,))
    assert not kernels.rms_norms_on("pallas", 9, (1280, 512))  # a prefill chunk: XLA's norms
    assert not kernels.rms_norms_on("pallas", 1, (1000,))  # 1000 = 125 x 8: slices too small
    assert not kernels.rms_norms_on("jnp", 1, (1280,))
    assert gpu_norm.supported(5120) and not gpu_norm.supported(9 * 1024)  # at most 8 slices


def test_kernel_refuses_rows_it_cannot_read():
    x, w = jnp.ones((2, 1000)), jnp.ones((1000,))
    with pytest.raises(ValueError, match="power-of-two slices"):
        gpu_norm.rms_norms((x,), (w,), norm=layers.rms_apply, eps=(1e-6,), out_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="one N"):
        gpu_norm.rms_norms((jnp.ones((2, 64)), jnp.ones((3, 64))), (jnp.ones(64), jnp.ones(64)),
                           norm=layers.rms_apply, eps=(1e-6, 1e-6), out_dtype=jnp.float32, interpret=True)
