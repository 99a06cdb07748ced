"""A hyper-connected sub-layer's input side in two launches, for a decode step's few rows (Pallas, Triton lowering).

From the stream h [hc, D] of a row, each sub-layer (attention, MoE) needs
- its mHC coefficients pre [hc], post [hc], comb [hc, hc]: the projection of the flattened h, scaled by
  its RMS, through sigmoids, a softmax and the Sinkhorn normalizations (`dsv41_jax.hyper.coefficients`);
- its input x [D] = RMSNorm(collapse(h, pre of the previous sub-layer)) (`dsv41_jax.layers.rms_apply` on
  slices of the row).
XLA ran these as ~6 small kernels per sub-layer (the sum of squares, the scaling and sigmoids, the Sinkhorn
iterations, the collapse's statistic, the normalization; H200, `small` at batch 1: ~9.4 us per sub-layer,
24 sub-layers per step). Here two launches do them in registers, calling the model's own functions on the
loaded values, one program a row each: `hyper_input` the input, `hyper_coefficients` the coefficients. The
projection itself (x @ fn^T over hc * D inputs) stays XLA's dot: a program per row would read all of fn alone
(the removed projection kernel of the twelfth session measured no faster than XLA's dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_CHUNKS = 8  # a row is read in slices of the largest power of two (<= 1024) dividing D: 5120 = 5 x 1024


def chunk(d: int) -> int:
    """The slice of a row the kernel loads at once: the largest power of two dividing d, at most 1024."""
    return min(d & -d, 1024)


def row_supported(d: int) -> bool:
    """True when a row of d values can be read: in at most MAX_CHUNKS power-of-two slices of at least 16."""
    return d > 0 and chunk(d) >= 16 and d // chunk(d) <= MAX_CHUNKS


def supported(hc: int, d: int) -> bool:
    """True when the kernel takes this stream: power-of-two hc (its [hc, hc] blocks), rows of D (`row_supported`)."""
    return hc > 0 and hc & (hc - 1) == 0 and row_supported(d)


def row_slices(d: int) -> list:
    """The power-of-two slices (`chunk`) a row of d values is read in."""
    return [pl.ds(j * chunk(d), chunk(d)) for j in range(d // chunk(d))]


def store_normalized(n, xs, w_ref, out_ref, *, norm, eps: float) -> None:
    """out[n] = norm(row, w, its mean square, eps) in out's dtype, for a row given as f32 values on its
    `row_slices` (xs); `norm`: `dsv41_jax.layers.rms_apply`. Shared with `gpu_norm`."""
    d = out_ref.shape[1]
    mean_sq = sum(jnp.sum(v * v) for v in xs) / d  # RMSNorm's mean over the whole row
    for c, v in zip(row_slices(d), xs):
        out_ref[n, c] = norm(v, w_ref[c], mean_sq, eps, out_ref.dtype)


def _coefficients_row(n, h_ref, m_ref, s_ref, b_ref, pre_ref, post_ref, comb_ref, *, coefficients, iters, hc_eps,
                      mix_eps):
    """Row n's mHC coefficients from its stream and its projection (not yet scaled by the RMS)."""
    hc, d = h_ref.shape[1:]
    # the projection's RMS over the flattened [hc * D] row (HyperMix: mean of squares, + eps, rsqrt)
    wide = [h_ref[n, i, c].astype(jnp.float32) for i in range(hc) for c in row_slices(d)]
    rstd = jax.lax.rsqrt(sum(jnp.sum(v * v) for v in wide) / (hc * d) + mix_eps)
    pre, post, comb = coefficients(
        m_ref[n, 0, :] * rstd, m_ref[n, 1, :] * rstd, m_ref[n, pl.ds(2, hc), :] * rstd,
        (s_ref[0], s_ref[1], s_ref[2]), (b_ref[0, :], b_ref[1, :], b_ref[pl.ds(2, hc), :]),
        iters, hc_eps, False)  # a loop in the kernel (Triton lowers no unrolled scan)
    pre_ref[n, :] = pre
    post_ref[n, :] = post
    comb_ref[n, :, :] = comb


def _input_row(n, h_ref, pm_ref, w_ref, x_ref, *, collapse_rows, norm, norm_eps):
    """Row n's normalized input, RMSNorm(collapse(h, pre_mix))."""
    hc, d = h_ref.shape[1:]
    pm = [pm_ref[n, i] for i in range(hc)]
    xs = [collapse_rows([h_ref[n, i, c] for i in range(hc)], pm).astype(jnp.float32) for c in row_slices(d)]
    store_normalized(n, xs, w_ref, x_ref, norm=norm, eps=norm_eps)


def _check(h_ncd, mixes_nm=None, pre_mix_nc=None, norm_w_d=None) -> None:
    """The kernels' argument checks (an argument left None is not checked)."""
    n, hc, d = h_ncd.shape
    if not supported(hc, d):
        raise ValueError(f"the hyper-connection kernel needs a power-of-two hc and D in at most {MAX_CHUNKS} "
                         f"power-of-two slices of >= 16, got hc={hc}, dim={d}")
    for name, a, shape in (("mixes", mixes_nm, (n, (2 + hc) * hc)), ("pre_mix", pre_mix_nc, (n, hc)),
                           ("norm weight", norm_w_d, (d,))):
        if a is not None and a.shape != shape:
            raise ValueError(f"shapes do not match h {h_ncd.shape}: {name} {a.shape}, expected {shape}")


# Two launches, not one: the sub-layer waits for its input only; its coefficients (with XLA's projection dot
# before them) are read after the sub-layer (post, comb by the expand) and by the next sub-layer's input (pre), so
# in a graph ordered by data (compile_options) they run beside the sub-layer's weight streams instead of before
# them (H200: the slice's batch-1 loop 1.414 -> 1.379 ms/step against both parts in one launch of two programs a
# row, docs/BENCHMARKS.md, twenty-fourth pass).
@functools.partial(jax.jit, static_argnames=("collapse_rows", "norm", "norm_eps", "num_warps", "interpret"))
def hyper_input(h_ncd: jax.Array, pre_mix_nc: jax.Array, norm_w_d: jax.Array, *, collapse_rows, norm,
                norm_eps: float, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """A sub-layer's input RMSNorm(collapse(h, pre_mix)) for N rows, one program a row: x [N, D] in h's dtype.

    h [N, hc, D] (the stream, any float dtype; `supported(hc, D)`), pre_mix f32 [N, hc] (the previous sub-layer's
    pre), norm_w [D]; `collapse_rows`, `norm`: the model's functions (`hyper.collapse_rows`, `layers.rms_apply`),
    traced here on one row's values."""
    _check(h_ncd, pre_mix_nc=pre_mix_nc, norm_w_d=norm_w_d)
    n, _, d = h_ncd.shape

    def kernel(h_ref, pm_ref, w_ref, x_ref):
        _input_row(pl.program_id(0), h_ref, pm_ref, w_ref, x_ref, collapse_rows=collapse_rows, norm=norm,
                   norm_eps=norm_eps)

    return pl.pallas_call(
        kernel, grid=(n,), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        out_shape=jax.ShapeDtypeStruct((n, d), h_ncd.dtype), name="hyper_input",
    )(h_ncd, pre_mix_nc, norm_w_d)


@functools.partial(jax.jit, static_argnames=("coefficients", "iters", "hc_eps", "mix_eps", "num_warps", "interpret"))
def hyper_coefficients(h_ncd: jax.Array, mixes_nm: jax.Array, scale_3: jax.Array, base_m: jax.Array, *, coefficients,
                       iters: int, hc_eps: float, mix_eps: float, num_warps: int = 4,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A sub-layer's mHC coefficients for N rows, one program a row: (pre f32 [N, hc], post f32 [N, hc], comb f32
    [N, hc, hc]).

    h [N, hc, D] as `hyper_input`'s, mixes f32 [N, (2 + hc) * hc] = the flattened h in f32 @ fn^T (not yet scaled
    by the RMS), scale f32 [3], base f32 [(2 + hc) * hc]; `coefficients`: the model's (`hyper.coefficients`)."""
    _check(h_ncd, mixes_nm=mixes_nm)
    n, hc, _ = h_ncd.shape

    def kernel(h_ref, m_ref, s_ref, b_ref, pre_ref, post_ref, comb_ref):
        _coefficients_row(pl.program_id(0), h_ref, m_ref, s_ref, b_ref, pre_ref, post_ref, comb_ref,
                          coefficients=coefficients, iters=iters, hc_eps=hc_eps, mix_eps=mix_eps)

    f32 = jnp.float32
    return pl.pallas_call(
        kernel, grid=(n,), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        out_shape=[jax.ShapeDtypeStruct((n, hc), f32), jax.ShapeDtypeStruct((n, hc), f32),
                   jax.ShapeDtypeStruct((n, hc, hc), f32)],
        name="hyper_coefficients",
    )(h_ncd, mixes_nm.reshape(n, 2 + hc, hc), scale_3, base_m.reshape(2 + hc, hc))
