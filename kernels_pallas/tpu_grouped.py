"""Matmuls that read low-precision weights once, in their stored bytes (Pallas, Mosaic TPU lowering).

Same contracts as `gpu_grouped`. Checked in interpret mode and lowered by Mosaic for TPU v5e / v6e on the CPU
(no TPU here); not tuned on hardware.

`grouped_matmul_fp4`: the routed experts. Rows of x are sorted by expert (`dsv41_jax.grouped`
contract). The grid is (output column tile j, visit t): a visit is one row tile of tm aligned rows met
by one expert that owns rows in it, visits in row order, so a row tile shared by two experts is
visited twice in a row and its output block stays in VMEM between the visits (each stores only the
rows its expert owns). The visit list (`tile_map`) arrives by scalar prefetch and drives the
BlockSpec index maps: the weight block of visit t is its expert's slab, so only experts with rows are
ever fetched (a decode step with B tokens x top-k reads at most B*k experts, never all of them), an
expert with several row tiles is fetched once per column tile (consecutive visits keep the block
index, so the pipeline issues no new DMA), and the static grid's spare visits past the real count
repeat the last real visit's blocks and skip compute (`pl.when`). `fp8_matmul`: a dense projection in
the released FP8 format (E4M3 + E8M0 per 32x32 block), the same body with one group.

Per grid step: y[tm, tn] f32 = x[row tile, :] @ W[e, cols, :]^T over all of K, in static chunks of
tk inputs. Weights are decoded with f32 arithmetic (`decode.*_arith`: no f16/fp8 arithmetic on v5e
and older), times their power-of-two scales, cast to x's dtype (exact in bf16: FP4 has two
significant bits, E4M3 four) and multiplied on the MXU with f32 accumulation (f32 x: precision
HIGHEST). Per-block scales are spread over their 16 or 32 inputs with a 0/1 matmul (exact, and the MXU
does the lane broadcast a TPU layout dislikes). The packed FP4 bytes hold even and odd inputs in their
low and high nibbles, so x comes split into its even and odd columns and each chunk is two dots,
never an interleave in registers.

Tiles (`choose_tiles`), within Mosaic's rule that a block's last two dims are multiples of (8, 128)
or the whole dim:
- tm: decode (few rows per expert) uses one native sublane tile of x's dtype, 8 rows of f32 or 16 of
  bf16: the smallest block that needs no padding, so little MXU work is spent on rows an expert does
  not own; prefill uses 128 (the v5e MXU edge) so that a fetched weight slab serves many rows (fewer
  rows: all of them, rounded up to a sublane tile).
- tn: 256 (or 128) output columns: the output block is lane-dense and a weight block of
  tn x K/2 bytes (512 KB at K = 4096) is a large DMA, double-buffered well inside the scoped VMEM.
  A weight block spans all of K because the scale block must (K/32 = 72 or 128 lanes is the whole
  dim, not a multiple of 128 in general); N without a 128-multiple divisor is taken whole.
- tk: 512 (or 256) inputs per chunk: 256 (or 128) packed bytes, so chunks of x and of the weight bytes
  are lane-aligned static slices; the decoded chunk stays a few hundred KB and the 0/1 spreading matmul
  costs tk / (64 tm) of the main dots.
The FP8 matmul takes tn = 256 (its [tn/32, K/32] scale block needs tn/32 rows, a multiple of 8) or
the whole N (the released shapes are multiples of 256, so only small projections are taken whole).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import decode

SCALE_BLOCK = 32  # inputs per E8M0 scale (experts) and the FP8 block edge (projections)


def _pick(n: int, options) -> int | None:
    return next((t for t in options if n % t == 0), None)


def choose_tiles(m: int, k: int, n: int, n_groups: int, dtype) -> tuple[int, int, int]:
    """(tm, tk, tn) for an [M, K] x [K, N] grouped matmul over `n_groups` groups (see the module doc)."""
    if k % SCALE_BLOCK:
        raise ValueError(f"the TPU grouped matmul needs K % 32 == 0, got K={k}")
    sub = 8 * 4 // jnp.dtype(dtype).itemsize  # rows in one native sublane tile of x
    tm = sub if m <= 4 * n_groups else min(128, pl.cdiv(m, sub) * sub)
    tk = _pick(k, (512, 256)) or k
    tn = _pick(n, (256, 128)) or n
    return tm, tk, tn


def tile_map(sizes_g: jax.Array, m: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Visits of the row tiles of m sorted rows: (group int32 [T], row tile int32 [T], count int32 [1]).

    Visit t < count is row tile `tile[t]` (rows [tile * tm, tile * tm + tm)) seen by group `group[t]`,
    which owns rows in it; visits run in row order (group-major, tiles ascending within a group). A
    group visits every tile its rows touch, so T = ceil(m / tm) + min(G, m) - 1 bounds the visits of
    any sizes (each non-empty group after the first adds at most one shared tile). Visits past count
    repeat the last real one (no rows at all: group 0, tile 0).
    """
    g = sizes_g.shape[0]
    sizes = sizes_g.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    first = (ends - sizes) // tm
    per_group = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)
    done = jnp.cumsum(per_group)  # visits of groups <= g
    count = done[-1]
    t = jnp.minimum(jnp.arange(pl.cdiv(m, tm) + min(g, m) - 1, dtype=jnp.int32), jnp.maximum(count - 1, 0))
    # searchsorted(done, t, side="right") without jnp.searchsorted's loop (gpu_grouped.tile_map says why)
    grp = jnp.minimum(jnp.sum(done[None, :] <= t[:, None], axis=1, dtype=jnp.int32), g - 1)
    tile = first[grp] + t - (done[grp] - per_group[grp])
    empty = count == 0
    return jnp.where(empty, 0, grp), jnp.where(empty, 0, tile), count[None]


# Index maps of the grid (j, t); the scalar-prefetch refs follow: visit group [T], row tile [T],
# visit count [1], group row offsets [G + 1]. With no visits the weight maps stay on column block 0,
# so a call without rows fetches one block, not a whole expert.
def _rows_block(j, t, grp, tile, count, offsets):
    return tile[t], 0


def _expert_block(j, t, grp, tile, count, offsets):
    return grp[t], j * jnp.minimum(count[0], 1), 0


def _dense_block(j, t, grp, tile, count, offsets):
    return j * jnp.minimum(count[0], 1), 0


def _out_block(j, t, grp, tile, count, offsets):
    return tile[t], j


def _spread_cols(n_groups: int, width: int, per: int) -> jax.Array:
    """0/1 bf16 [n_groups, width]: s @ it repeats each of s's columns `per` times (exact for powers of two)."""
    g = jax.lax.broadcasted_iota(jnp.int32, (n_groups, width), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n_groups, width), 1)
    return (c // per == g).astype(jnp.bfloat16)


def _spread_rows(width: int, n_groups: int, per: int) -> jax.Array:
    """0/1 bf16 [width, n_groups]: it @ s repeats each of s's rows `per` times."""
    r = jax.lax.broadcasted_iota(jnp.int32, (width, n_groups), 0)
    g = jax.lax.broadcasted_iota(jnp.int32, (width, n_groups), 1)
    return (r // per == g).astype(jnp.bfloat16)


def _fp4_chunk(wv_ref, ws_ref, c: int, tk: int, dtype) -> list[jax.Array]:
    """Chunk c of an expert tile: packed bytes uint8 [tn, K/2] and E8M0 bytes [tn, K/32] ->
    (even inputs, odd inputs) `dtype` [tn, tk/2]."""
    half, groups = tk // 2, tk // SCALE_BLOCK
    lo, hi = decode.nibbles(wv_ref[:, c * half:(c + 1) * half])
    s = decode.e8m0_f32(ws_ref[:, c * groups:(c + 1) * groups]).astype(jnp.bfloat16)
    s = jnp.dot(s, _spread_cols(groups, half, SCALE_BLOCK // 2), preferred_element_type=jnp.float32)
    return [(decode.fp4_f32_arith(code) * s).astype(dtype) for code in (lo, hi)]


def _fp8_chunk(wv_ref, ws_ref, c: int, tk: int, dtype) -> list[jax.Array]:
    """Chunk c of a projection tile: E4M3 bytes uint8 [tn, K] and the block exponents [tn/32, K/32] ->
    `dtype` [tn, tk]."""
    tn, groups = wv_ref.shape[0], tk // SCALE_BLOCK
    v = decode.e4m3_f32_arith(wv_ref[:, c * tk:(c + 1) * tk])
    s = decode.e8m0_f32(ws_ref[:, c * groups:(c + 1) * groups]).astype(jnp.bfloat16)
    s = jnp.dot(_spread_rows(tn, tn // SCALE_BLOCK, SCALE_BLOCK), s, preferred_element_type=jnp.float32)
    s = jnp.dot(s.astype(jnp.bfloat16), _spread_cols(groups, tk, SCALE_BLOCK), preferred_element_type=jnp.float32)
    return [(v * s).astype(dtype)]


def _kernel(grp_ref, tile_ref, count_ref, offsets_ref, *refs, fmt: str, tm: int, tk: int, k: int):
    *x_refs, wv_ref, ws_ref, o_ref = refs
    t = pl.program_id(1)

    @pl.when(t < count_ref[0])
    def _():
        dt = x_refs[0].dtype
        precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
        chunk, width = (_fp4_chunk, tk // 2) if fmt == "fp4" else (_fp8_chunk, tk)
        acc = jnp.zeros(o_ref.shape, jnp.float32)
        for c in range(k // tk):
            for x_ref, w in zip(x_refs, chunk(wv_ref, ws_ref, c, tk, dt)):
                acc += jax.lax.dot_general(x_ref[:, c * width:(c + 1) * width], w, (((1,), (1,)), ((), ())),
                                           precision=precision, preferred_element_type=jnp.float32)
        g = grp_ref[t]
        rows = tile_ref[t] * tm + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
        own = (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])
        o_ref[...] = jnp.where(own, acc, o_ref[...])


def _call(fmt, x_parts, wv, ws, sizes_g, k, n, tiles, interpret):
    m = x_parts[0].shape[0]
    tm, tk, tn = tiles
    width = tk // 2 if fmt == "fp4" else tk  # bytes of a chunk
    if tm % 8 or n % tn or tn % 128 and tn != n or k % tk or width % 128 and tk != k:
        raise ValueError(f"tiles {tiles} do not fit Mosaic's (8, 128) rule for K={k}, N={n}")
    grp, tile, count = tile_map(sizes_g, m, tm)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes_g.astype(jnp.int32))])
    mp = pl.cdiv(m, tm) * tm
    x_parts = [jnp.pad(x, ((0, mp - m), (0, 0))) for x in x_parts]
    if fmt == "fp4":  # [G, N, K/2] bytes, [G, N, K/32] scales; the expert axis squeezed
        w_specs = [pl.BlockSpec((None, tn, k // 2), _expert_block),
                   pl.BlockSpec((None, tn, k // SCALE_BLOCK), _expert_block)]
    else:  # [N, K] bytes, [N/32, K/32] scales
        w_specs = [pl.BlockSpec((tn, k), _dense_block),
                   pl.BlockSpec((tn // SCALE_BLOCK, k // SCALE_BLOCK), _dense_block)]
    y = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, tm=tm, tk=tk, k=k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(n // tn, grp.shape[0]),
            in_specs=[pl.BlockSpec((tm, x.shape[1]), _rows_block) for x in x_parts] + w_specs,
            out_specs=pl.BlockSpec((tm, tn), _out_block)),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32),
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name=f"grouped_matmul_{fmt}_tpu",
    )(grp, tile, count, offsets, *x_parts, wv, ws)
    # rows no visit writes (past sum(sizes)) are uninitialized in the kernel's output
    return jnp.where((jnp.arange(m) < offsets[-1])[:, None], y[:m], 0.0)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_matmul_fp4(x_mk: jax.Array, values: jax.Array, scales: jax.Array, sizes_g: jax.Array, *,
                       tiles: tuple[int, int, int] | None = None, interpret: bool = False) -> jax.Array:
    """y f32 [M, N]: rows of x [M, K] (bf16 or f32, sorted by group) times their expert's FP4 weight.

    values uint8 [G, N, K/2], scales uint8 [G, N, K/32] (E8M0), sizes_g int [G]; rows past
    sum(sizes) are zero. tiles = (tm, tk, tn), `choose_tiles` by default.
    """
    g, n, half = values.shape
    k = 2 * half
    if x_mk.shape[1] != k or scales.shape != (g, n, k // SCALE_BLOCK):
        raise ValueError(f"FP4 experts {values.shape} / scales {scales.shape} do not fit x {x_mk.shape}")
    tiles = tiles or choose_tiles(x_mk.shape[0], k, n, g, x_mk.dtype)
    return _call("fp4", [x_mk[:, 0::2], x_mk[:, 1::2]], values, scales, sizes_g, k, n, tiles, interpret)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def fp8_matmul(x_mk: jax.Array, q_nk: jax.Array, exp: jax.Array, *, tiles: tuple[int, int, int] | None = None,
               interpret: bool = False) -> jax.Array:
    """y f32 [M, N] = x [M, K] @ W^T for W in the released FP8 block format: E4M3 bytes uint8 (or
    float8_e4m3fn) [N, K], E8M0 exponents uint8 [N/32, K/32]. N and K must be multiples of 32."""
    n, k = q_nk.shape
    m = x_mk.shape[0]
    if n % SCALE_BLOCK or k % SCALE_BLOCK or x_mk.shape[1] != k:
        raise ValueError(f"the TPU FP8 matmul needs N, K multiples of 32 matching x; got W {q_nk.shape}, "
                         f"x {x_mk.shape}")
    if tiles is None:
        tm, tk, _ = choose_tiles(m, k, n, 1, x_mk.dtype)
        tiles = (tm, tk, 256 if n % 256 == 0 else n)
    if tiles[2] % 256 and tiles[2] != n:
        raise ValueError(f"the TPU FP8 matmul needs N tiles that are multiples of 256 (or all of N), got {tiles}")
    q = jax.lax.bitcast_convert_type(q_nk, jnp.uint8) if q_nk.dtype != jnp.uint8 else q_nk
    return _call("fp8", [x_mk], q, exp, jnp.full((1,), m, jnp.int32), k, n, tiles, interpret)
