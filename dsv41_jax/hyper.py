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

from dsv41_jax import kernels as kernels_mod
from dsv41_jax.layers import RMSNorm, normal_init, rms_apply, rms_norm


def projection(x_flat: jax.Array, fn: jax.Array) -> jax.Array:
    """The coefficient projection: x [..., hc * D] (the stream, any float dtype) . fn [(2+hc)*hc, hc * D] ->
    [..., (2+hc)*hc] f32, in IEEE f32 as the release's f32 linear: hc_fn is stored in f32, and XLA runs f32 dots
    in TF32 on a GPU unless asked (its 10-bit mantissa would round fn; the stream's bf16 values are exact either
    way; what the rounding did to logits: experiments.tf32_effect)."""
    return jnp.einsum("...i,mi->...m", x_flat.astype(jnp.float32), fn, precision=jax.lax.Precision.HIGHEST)


def coefficients(pre_c, post_c, comb_cc, scale, base, iters: int, eps: float, unroll: bool):
    """The mHC coefficients from the RMS-scaled projections: pre_c, post_c [..., hc], comb_cc [..., hc, hc]
    (rows -> cols); scale (s_pre, s_post, s_comb) scalars, base (b_pre [hc], b_post [hc], b_comb [hc, hc]).
    -> pre, post [..., hc], comb [..., hc, hc] (doubly stochastic by `iters` Sinkhorn normalizations), f32.
    Also traced inside the GPU kernel of a sub-layer's input (`kernels_pallas.gpu_hyper`)."""
    pre = jax.nn.sigmoid(pre_c * scale[0] + base[0]) + eps
    post = 2 * jax.nn.sigmoid(post_c * scale[1] + base[1])
    comb = jax.nn.softmax(comb_cc * scale[2] + base[2], axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    comb = jax.lax.fori_loop(0, iters - 1, body, comb, unroll=True if unroll else 1)
    return pre, post, comb


def sinkhorn_split(mixes: jax.Array, scale: jax.Array, base: jax.Array, hc: int, iters: int, eps: float,
                   unroll: str = "auto"):
    """mixes [..., (2+hc)*hc] f32 -> pre [..., hc], post [..., hc], comb [..., hc, hc] (`coefficients`).

    unroll: "auto" | "unrolled" | "rolled" (ModelConfig.sinkhorn_unroll)."""
    # "auto": rolled on CPU (20 unrolled iterations per sub-layer dominate compile time there); unrolled
    # on accelerators, where a rolled loop costs a host round trip per iteration and unrolled ones fuse.
    if unroll == "auto":
        unroll = "unrolled" if jax.default_backend() != "cpu" else "rolled"
    comb_shape = (*mixes.shape[:-1], hc, hc)
    return coefficients(mixes[..., :hc], mixes[..., hc:2 * hc], mixes[..., 2 * hc:].reshape(comb_shape),
                        (scale[0], scale[1], scale[2]), (base[:hc], base[hc:2 * hc], base[2 * hc:].reshape(hc, hc)),
                        iters, eps, unroll == "unrolled")


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
        return mix_coefficients(x_btcd, self.fn[...], self.scale[...], self.base[...], self.iters, self.eps,
                                self.norm_eps, self.unroll)


def mix_coefficients(x_btcd, fn, scale, base, iters: int, eps: float, norm_eps: float, unroll: str = "auto"):
    """`HyperMix`'s math on its parameters: x [B, T, hc, D] -> pre, post [B, T, hc], comb [B, T, hc, hc]."""
    x = x_btcd.reshape(*x_btcd.shape[:-2], -1).astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    mixes = projection(x, fn) * rstd
    # materialized once: XLA otherwise fuses the (cheap-looking, serial) Sinkhorn iterations into every
    # element of the [B, T, hc, D] collapse / expand that reads them (H200 profile: 4.8 us per expand)
    return jax.lax.optimization_barrier(sinkhorn_split(mixes, scale, base, x_btcd.shape[-2], iters, eps, unroll))


def sublayer_input(mix: HyperMix, norm: RMSNorm, h_btcd: jax.Array, pre_mix_btc: jax.Array, kernels: str):
    """A sub-layer's input side: (pre, post, comb) of `mix` from the stream h [B, T, hc, D], and its input
    norm(collapse(h, pre_mix)) [B, T, D] in h's dtype (pre_mix [B, T, hc]: the previous sub-layer's pre).
    A GPU decode step's few rows (`kernels.hyper_in_on`) take two kernels and XLA's projection dot
    (`kernels_pallas.gpu_hyper`) where XLA ran ~6 small ones; values equal to f32 summation order (the input kernel
    rounds a bf16 stream's collapsed row to bf16 before the norm, as written here; XLA on a GPU skips that rounding
    in this jnp path: tests/test_hyper_kernel.py)."""
    b, t, c, dim = h_btcd.shape
    if not kernels_mod.hyper_in_on(kernels, b * t, c, dim):
        return (*mix(h_btcd), norm(collapse(h_btcd, pre_mix_btc)))
    consts = (mix.iters, mix.eps, mix.norm_eps, norm.eps)
    x_nd, pre, post, comb = _input_kernels(consts, h_btcd.reshape(b * t, c, dim), pre_mix_btc.reshape(b * t, c),
                                           mix.fn[...], mix.scale[...], mix.base[...], norm.weight[...])
    return pre.reshape(b, t, c), post.reshape(b, t, c), comb.reshape(b, t, c, c), x_nd.reshape(b, t, dim)


def _input_reference(consts, h_ncd, pre_mix_nc, fn, scale, base, norm_w):
    """(x, pre, post, comb) of N rows by the model's jnp path: the kernel's twin."""
    iters, eps, mix_eps, norm_eps = consts
    pre, post, comb = mix_coefficients(h_ncd[:, None], fn, scale, base, iters, eps, mix_eps)
    x = rms_norm(collapse(h_ncd[:, None], pre_mix_nc[:, None]), norm_w, norm_eps)
    return x[:, 0], pre[:, 0], post[:, 0], comb[:, 0]


def _input_by_kernels(consts, h_ncd, pre_mix_nc, fn, scale, base, norm_w):
    """`_input_reference` by two launches: the input, which the sub-layer waits for, and XLA's projection dot and
    the coefficients, which only the expand after the sub-layer and the next sub-layer's input read."""
    iters, eps, mix_eps, norm_eps = consts
    x_nd = kernels_mod.hyper_input(h_ncd, pre_mix_nc, norm_w, collapse_rows=collapse_rows, norm=rms_apply,
                                   norm_eps=norm_eps)
    mixes_nm = projection(h_ncd.reshape(h_ncd.shape[0], -1), fn)
    return (x_nd, *kernels_mod.hyper_coefficients(h_ncd, mixes_nm, scale, base, coefficients=coefficients,
                                                  iters=iters, hc_eps=eps, mix_eps=mix_eps))


# differentiable through the jnp path: a training forward of few tokens on a GPU reaches the kernels
_input_kernels = kernels_mod.twin_gradient(_input_by_kernels, _input_reference)


# collapse and expand contract over the hc = 4 copies: written as products and sums, not einsums, so that
# XLA fuses them with their neighbours (a dot over 4 is a kernel of its own: 4 per layer per decode step
# on the GPU, each reading and writing the whole stream)
def collapse(x_btcd: jax.Array, pre_btc: jax.Array) -> jax.Array:
    """[B, T, hc, D] x [B, T, hc] -> [B, T, D]."""
    return collapse_rows([x_btcd[:, :, i] for i in range(x_btcd.shape[2])],
                         [pre_btc[:, :, i, None] for i in range(x_btcd.shape[2])])


def collapse_rows(rows, weights):
    """sum_i rows[i] * weights[i] in f32, in the rows' dtype (`collapse` on its hc slices; also traced inside
    the GPU kernel of a sub-layer's input, `kernels_pallas.gpu_hyper`)."""
    return sum(r.astype(jnp.float32) * w for r, w in zip(rows, weights)).astype(rows[0].dtype)


def expand(y_btd: jax.Array, residual_btcd: jax.Array, post_btc: jax.Array, comb_btcc: jax.Array) -> jax.Array:
    """out[j] = post[j] * y + sum_i comb[i, j] * residual[i]: [B, T, D] -> [B, T, hc, D] (comb: copy i -> j)."""
    out = post_btc[..., None] * y_btd[:, :, None, :].astype(jnp.float32)
    res = residual_btcd.astype(jnp.float32)
    for i in range(res.shape[2]):
        out = out + comb_btcc[:, :, i, :, None] * res[:, :, i, None, :]
    return out.astype(y_btd.dtype)
