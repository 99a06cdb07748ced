"""Matmuls over weights in their stored formats: routed experts (grouped) and FP8 projections.

Plain-jnp references, the CPU path and the contracts of the kernels in `kernels_pallas.gpu_grouped`.

Stored formats (`dsv41_jax.layers`):
- routed experts, `weight_format="fp8"`: {"values": uint8 [E, N, K/2] (E2M1 codes, two per byte along
  the input axis, even element in the low nibble), "scales": uint8 [E, N, K/32] (E8M0 per 32 inputs)}
  in the checkpoint's output-major orientation;
- routed experts, `weight_format="float"`: one float array [E, K, N] (input-major);
- FP8 projections: E4M3 values [N, K] and E8M0 exponents [ceil(N/32), ceil(K/32)] (one per 32x32 block).

Grouped matmul contract: rows x[m] are sorted by expert, group g holding rows
[sum(sizes[:g]), sum(sizes[:g + 1])); y[m] = x[m] @ W[g(m)] in f32, and rows past sum(sizes) are zero.
The reference decodes only the experts that have rows (at most min(E, M) of them, a static bound):
a decode step with B tokens routed top-k reads B*k experts' bytes, not all E.

Row matmul contract (`rows_matmul`): no sorting, each row names its expert, y[m] = x[m] @ W[expert[m]]
(zero where expert[m] = -1; x may be a single row that all rows read). For one token's top-k
assignments, whose experts are distinct: the same bytes as the grouped form without the sort, counts and
scatter around it (a batch-1 decode step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import quant

EXPERT_FP4 = quant.Fp4Codec(block=32, scale_format="e8m0")  # routed experts: one E8M0 scale per 32 inputs


def is_packed(w) -> bool:
    """True for FP4 expert records {"values", "scales"}, False for a float [E, K, N] array."""
    return isinstance(w, dict)


def grouped_shape(w) -> tuple[int, int, int]:
    """(E, K, N) of a stored expert weight."""
    if is_packed(w):
        e, n, half_k = w["values"].shape
        return e, 2 * half_k, n
    return tuple(w.shape)


def active_groups(sizes_e: jax.Array, max_groups: int) -> tuple[jax.Array, jax.Array]:
    """The groups that own rows, in order: (ids int32 [max_groups], their sizes int32 [max_groups]).

    Slots past the number of non-empty groups get id 0 and size 0 (they own no rows)."""
    ids = jnp.nonzero(sizes_e > 0, size=max_groups, fill_value=0)[0].astype(jnp.int32)
    n_active = jnp.sum(sizes_e > 0)
    sizes = jnp.where(jnp.arange(max_groups) < n_active, sizes_e[ids], 0).astype(jnp.int32)
    return ids, sizes


def dequantize_experts(w, dtype) -> jax.Array:
    """Stored expert weights -> `dtype` [E', K, N] (input-major)."""
    if not is_packed(w):
        return w.astype(dtype)
    return EXPERT_FP4.decode(w).transpose(0, 2, 1).astype(dtype)


def grouped_matmul(x_mk: jax.Array, w, sizes_e: jax.Array) -> jax.Array:
    """y f32 [M, N] = x [M, K] (rows sorted by group) @ each row's expert of `w` (stored format).

    Computes in x's dtype with f32 accumulation. Only the experts with rows are gathered and
    dequantized: when M < E that is at most M of them (every decode step); otherwise all E.
    """
    e, _, _ = grouped_shape(w)
    m = x_mk.shape[0]
    if m < e:
        ids, sizes = active_groups(sizes_e, m)
        w = jax.tree.map(lambda a: a[ids], w)
    else:
        sizes = sizes_e.astype(jnp.int32)
    return jax.lax.ragged_dot(x_mk, dequantize_experts(w, x_mk.dtype), sizes, preferred_element_type=jnp.float32)


def sort_by_group(group_m: jax.Array, n_groups: int) -> tuple[jax.Array, jax.Array]:
    """Rows in the grouped contract's order: (order int32 [M], stable, rows of groups outside [0, n_groups)
    last; sizes int32 [n_groups], rows per group). x[order] is then the grouped matmul's input."""
    key = jnp.where((group_m >= 0) & (group_m < n_groups), group_m, n_groups)
    order = jnp.argsort(key, stable=True)
    return order, jnp.bincount(key, length=n_groups + 1)[:n_groups].astype(jnp.int32)


def rows_matmul(x_mk: jax.Array, w, expert_m: jax.Array) -> jax.Array:
    """y f32 [M, N] = x row m @ expert expert_m[m] (int32 [M], -1: none, zero row) of `w`. x: [M, K], or
    [R, K] with R | M whose row r every row of r's M / R read (R = 1: one token's k assignments; R = M / k:
    each token's k assignments).

    Computes in x's dtype with f32 accumulation; gathers and dequantizes one expert per row (an expert
    named by several rows is read once per row: meant for distinct experts)."""
    m, rows = expert_m.shape[0], x_mk.shape[0]
    if m % rows:
        raise ValueError(f"x has {rows} rows, which do not divide the {m} rows of expert_m")
    w_mkn = dequantize_experts(jax.tree.map(lambda a: a[jnp.maximum(expert_m, 0)], w), x_mk.dtype)
    x_mk = jnp.repeat(x_mk, m // rows, axis=0)
    y = jnp.einsum("mk,mkn->mn", x_mk, w_mkn, preferred_element_type=jnp.float32)
    return jnp.where((expert_m >= 0)[:, None], y, 0.0)


# ----------------------------------------------------------------------------- dense FP8 blocks
FP8_BLOCK = 32  # dense FP8 weights: one E8M0 scale per 32x32 block


def dequantize_fp8_blocks(q_nk: jax.Array, exp: jax.Array, dtype=jnp.float32) -> jax.Array:
    """E4M3 [N, K] x E8M0 [ceil(N/32), ceil(K/32)] -> `dtype` [N, K] (exact in bf16 and f32)."""
    n, k = q_nk.shape
    s = quant.e8m0_decode(exp)
    s = jnp.repeat(jnp.repeat(s, FP8_BLOCK, axis=0)[:n], FP8_BLOCK, axis=1)[:, :k]
    return (q_nk.astype(jnp.float32) * s).astype(dtype)


def fp8_matmul(x_mk: jax.Array, q_nk: jax.Array, exp: jax.Array) -> jax.Array:
    """y f32 [M, N] = x [M, K] @ dequantized(W)^T, in x's dtype with f32 accumulation."""
    return jnp.einsum("mk,nk->mn", x_mk, dequantize_fp8_blocks(q_nk, exp, x_mk.dtype),
                      preferred_element_type=jnp.float32)
