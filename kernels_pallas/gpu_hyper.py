"""The hyper-connection coefficient projection (`HyperMix`) in one launch (Pallas, Triton lowering).

dot[r, m] = sum_k fn[m, k] x[r, k] and ss[r] = sum_k x[r, k]^2 for the few rows of a decode step, as
partial sums over K splits: grid (row, split), each program reads one row's chunk of x (its stored
dtype, widened in registers) and fn's M rows of that chunk (f32), and writes its partial dot and sum of
squares; the caller's sum over the splits fuses with what follows. Why: on the H200, XLA ran this
projection as ~5 kernels per sub-layer (a split-K dot and its reduction, a two-stage sum of squares,
the scaling; docs/bench_decode/h200_session9_profile_b1.log: 60 kernels of HyperMix's 72 per step of
the 6-layer slice), each a launch of ~2 us of work. Many programs stream fn's 1.5 MB (v41: 24 x 16,384
f32) at once; one program per row would read it on one SM. Rows are few (decode), so no tensor cores:
products and sums in f32, exact to f32 summation order against `jnp.einsum`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _pow2_parts(m: int) -> list[tuple[int, int]]:
    """(offset, size) of power-of-two pieces covering [0, m): Triton tiles are powers of two (24 = 16 + 8)."""
    parts, off = [], 0
    for bit in reversed(range(m.bit_length())):
        if m >> bit & 1:
            parts.append((off, 1 << bit))
            off += 1 << bit
    return parts


def _kernel(x_ref, fn_ref, dot_ref, ss_ref, *, m: int, bk: int):
    r, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(s * bk, bk)
    x = x_ref[pl.ds(r, 1), cols].astype(jnp.float32)  # [1, bk]
    for off, size in _pow2_parts(m):
        w = fn_ref[pl.ds(off, size), cols]  # [size, bk] f32
        dot_ref[r, s, pl.ds(off, size)] = jnp.sum(w * x, axis=1)
    ss_ref[r, pl.ds(s, 1)] = jnp.sum(x * x, axis=1)


def block_k(k: int) -> int:
    """The K chunk of one program: 256 (64 programs per row at v41's 16,384), or k's largest power-of-two
    divisor below that."""
    return min(256, k & -k)


@functools.partial(jax.jit, static_argnames=("interpret",))
def hyper_projection(x_rk: jax.Array, fn_mk: jax.Array, *, interpret: bool = False):
    """x [R, K] (any float dtype), fn [M, K] f32 -> (dot f32 [R, M] = x @ fn^T, ss f32 [R] = sum x^2)."""
    r, k = x_rk.shape
    m = fn_mk.shape[0]
    if fn_mk.shape[1] != k or fn_mk.dtype != jnp.float32:
        raise ValueError(f"fn {fn_mk.shape} {fn_mk.dtype} must be f32 [M, {k}] for x {x_rk.shape}")
    bk = block_k(k)
    splits = k // bk
    dot, ss = pl.pallas_call(
        functools.partial(_kernel, m=m, bk=bk), grid=(r, splits),
        out_shape=(jax.ShapeDtypeStruct((r, splits, m), jnp.float32), jax.ShapeDtypeStruct((r, splits), jnp.float32)),
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name=f"hyper_projection_{m}x{k}",
    )(x_rk, fn_mk)
    return dot.sum(axis=1), ss.sum(axis=1)
