"""Small building blocks: Linear (weights stored [out, in] as in the checkpoint), RMSNorm, Embedding,
and the released weight formats.

Weight formats (what `ModelConfig.weight_format` selects; "float" is the default):

- "float": every weight a float array in `param_dtype`.
- "fp8": the projections the release ships in FP8 keep its format in the params: E4M3 values [out, in]
  plus one E8M0 scale per 32x32 block [ceil(out/32), ceil(in/32)] (uint8 biased exponents, as in
  dsv41_jax.quant), dequantized inside the computation. Routed experts (moe.py) and Engram tables
  (engram.py) keep their FP4 / FP8 formats the same way.

`ModelConfig.activation_quant` reproduces the release's `fp8` inference mode: the input of every
projection it ships in FP8/FP4 is rounded to FP8 E4M3 in groups of 32 with power-of-two scales
before the matmul. With exact dequantized weights this is the same product as its block-scaled GEMM,
up to f32 summation order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import kernels as kernels_mod
from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.grouped import FP8_BLOCK
from dsv41_jax.kernels import fp8_matmuls

ACT_FP8 = quant.Fp8Codec(block=FP8_BLOCK)  # the release's act_quant: E4M3, power-of-two scale, amax >= 1e-4


def weights_fp8(cfg: ModelConfig) -> bool:
    """True when params keep the release's FP8 / FP4 weight formats (config switch `weight_format`)."""
    return cfg.weight_format == "fp8"


def activation_quant(cfg: ModelConfig) -> bool:
    """True when FP8/FP4 projections round their inputs to FP8 first (the release's `fp8` mode)."""
    return cfg.activation_quant


def quantize_activation(x: jax.Array) -> jax.Array:
    """x [..., K] rounded to FP8 E4M3 with one power-of-two scale per 32 values along K (K % 32 == 0)."""
    return quant.fake_quant_ste(ACT_FP8, x)


class Buffer(nnx.Variable):
    """State that is part of the model but not trained by gradients (router bias, token maps)."""


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float | None = None) -> jax.Array:
    """Scaled normal init: std = fan_in^-0.5 over the last axis unless given."""
    std = shape[-1] ** -0.5 if std is None else std
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


# ----------------------------------------------------------------------------- dense FP8 blocks
def quantize_fp8_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 [out, in] -> (E4M3 [out, in], E8M0 exponents uint8 [ceil(out/32), ceil(in/32)]).

    One power-of-two scale 2^ceil(log2(amax/448)) per 32x32 block (amax >= 1e-4), values rounded to
    nearest even and saturated at +-448: the released checkpoint's dense format.
    """
    o, i = w.shape
    po, pi = -o % FP8_BLOCK, -i % FP8_BLOCK
    tiles = jnp.pad(w.astype(jnp.float32), ((0, po), (0, pi)))
    tiles = tiles.reshape((o + po) // FP8_BLOCK, FP8_BLOCK, (i + pi) // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(tiles), axis=(1, 3)), 1e-4)
    scale, exp = quant.e8m0_scale(amax, quant.FP8_MAX)
    q = jnp.clip(tiles / scale[:, None, :, None], -quant.FP8_MAX, quant.FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(o + po, i + pi)[:o, :i], exp


class Linear(nnx.Module):
    """y = x @ W.T with W [out, in]; computes in x's dtype with f32 accumulation.

    fp8=True stores W in the released FP8 block format (`weight` E4M3 + `scale`), read through
    `kernels.fp8_matmul` (the jnp reference dequantizes it);
    act_quant=True rounds x to FP8 groups of 32 first (see the module docstring).
    """

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype="float32", fp8: bool = False,
                 act_quant: bool = False):
        w = normal_init(rngs, (d_out, d_in), jnp.float32 if fp8 else dtype)
        if fp8:
            q, s = quantize_fp8_blocks(w)
            self.weight = nnx.Param(q)
            self.scale = nnx.Param(s)
        else:
            self.weight = nnx.Param(w)
        self.fp8 = fp8
        self.act_quant = act_quant

    def __call__(self, x: jax.Array, out_dtype=None, *, kernels: str = "jnp") -> jax.Array:
        """x [..., in] -> [..., out] in out_dtype (default x's). kernels: the `dsv41_jax.kernels` switch; an
        FP8 weight is then read in its stored bytes by the GPU kernel (no dequantized copy)."""
        return linears(x, [self], out_dtype, kernels=kernels)[0]


def linears(x: jax.Array, lins: list[Linear], out_dtype=None, *, kernels: str = "jnp") -> list[jax.Array]:
    """[lin(x, out_dtype) for lin in lins]; FP8 projections of the same input (wq_a and wkv, the shared
    expert's w1 and w3) share one weight-kernel launch instead of one each."""
    first = lins[0]
    if len(lins) > 1 and not all(lin.fp8 and lin.act_quant == first.act_quant for lin in lins):
        return [linears(x, [lin], out_dtype, kernels=kernels)[0] for lin in lins]
    if first.act_quant:
        x = quantize_activation(x)
    if first.fp8:
        ys = fp8_matmuls(x.reshape(-1, x.shape[-1]), [(lin.weight[...], lin.scale[...]) for lin in lins],
                         kernels=kernels)
        ys = [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]
    else:
        ys = [jnp.einsum("...i,oi->...o", x, first.weight[...].astype(x.dtype), preferred_element_type=jnp.float32)]
    return [y.astype(out_dtype or x.dtype) for y in ys]


def released_fp8_linear(cfg: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs) -> Linear:
    """A projection the release ships in FP8 (and runs W8A8 in its fp8 mode), formatted per `cfg`."""
    return Linear(d_in, d_out, rngs=rngs, dtype=cfg.param_dtype, fp8=weights_fp8(cfg),
                  act_quant=activation_quant(cfg))


class RMSNorm(nnx.Module):
    """Normalizes in f32 over the last axis; eps is added to the mean square (released norm_eps 1e-20)."""

    def __init__(self, dim: int, eps: float, *, dtype="float32"):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] normalized in f32 over D, times weight [D], in x's dtype (RMSNorm's math)."""
    xf = x.astype(jnp.float32)
    return rms_apply(xf, weight, jnp.mean(xf * xf, axis=-1, keepdims=True), eps, x.dtype)


def rms_apply(xf: jax.Array, weight: jax.Array, mean_sq: jax.Array, eps: float, dtype) -> jax.Array:
    """`rms_norm` of f32 xf given its mean square (broadcastable to xf), in `dtype`; also traced inside the
    GPU kernels of a sub-layer's input (`kernels_pallas.gpu_hyper`) and of `rms_norms` on slices of a row."""
    return (weight.astype(jnp.float32) * (xf * jax.lax.rsqrt(mean_sq + eps))).astype(dtype)


def rms_norms(xs: list[jax.Array], norms: list[RMSNorm], dtype, *, kernels: str = "jnp") -> list[jax.Array]:
    """[norm(x.astype(dtype))]: projections' outputs xs [..., D_i] (f32 as they leave their matmul) in the model's
    dtype, each through its RMSNorm. A GPU decode step's few rows (`kernels.rms_norms_on`) in one launch
    (`kernels_pallas.gpu_norm`) where XLA ran ~4 small kernels; values equal to f32 summation order."""
    lead = xs[0].shape[:-1]
    rows = math.prod(lead)
    if not kernels_mod.rms_norms_on(kernels, rows, [x.shape[-1] for x in xs]):
        return [norm(x.astype(dtype)) for x, norm in zip(xs, norms)]
    eps = tuple(norm.eps for norm in norms)
    out = _norms_kernel((eps, jnp.dtype(dtype)), [x.reshape(rows, x.shape[-1]) for x in xs],
                        [norm.weight[...] for norm in norms])
    return [y.reshape(*lead, y.shape[-1]) for y in out]


def _norms_reference(static, xs, weights):
    eps, dtype = static
    return [rms_norm(x.astype(dtype), w, e) for x, w, e in zip(xs, weights, eps)]


# differentiable through the jnp path: a training forward of few tokens on a GPU reaches the kernel
_norms_kernel = kernels_mod.twin_gradient(
    lambda static, xs, weights: kernels_mod.rms_norms(xs, weights, norm=rms_apply, eps=static[0], out_dtype=static[1]),
    _norms_reference)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype="float32"):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), dtype, std=1.0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)
