"""Matmuls that read low-precision weights once, in their stored bytes (Pallas, Triton lowering).

`grouped_matmul_fp4`: the routed experts. Rows of x are sorted by expert (`dsv41_jax.grouped`
contract); the grid runs over (row tile, output tile), where a row tile is at most `tm` rows of one
expert. Only tiles that hold rows load their expert's bytes: a decode step with B tokens x top-k reads
at most B*k experts, never all of them. `rows_matmuls_fp4`: the same kernel with one row per row tile
and each row's own expert (the row contract of `dsv41_jax.grouped`): no tile map to compute, for one
token's distinct experts (`rows_matmuls_float`: the same for float experts, input-major). `fp8_matmul`:
a dense projection in the released FP8 format (E4M3 + E8M0 per 32x32 block), the same body with one group.

Per program: acc[tm, tn] f32 += x[rows, k-chunk] @ W[e, cols, k-chunk]^T over K in chunks of tk.
Weights are decoded in registers: FP4 codes with `decode.fp4_as_f16` (exact) times their power-of-two
scale, in f32, cast to the compute dtype (exact: two significant bits); FP8 bytes by a bitcast. The
packed FP4 bytes hold even and odd inputs in their low and high nibbles, so x comes split into its
even and odd columns and each chunk is two dots, never an interleave in registers.

Tiles (`choose_tiles`): decode (few rows per expert) wants tm = 16, the smallest tensor-core tile,
so no expert is read twice and few rows are wasted; long prefill chunks want tm = 64 so that a
weight tile is reused across many rows. tn = 64 and tk = 256 (128 packed bytes per row) keep a weight
tile at 16 KB per stage; decode-sized FP8 projections stream tk = 128 (measured faster, `choose_tiles`).
Projections with few output tiles split K across programs (`k_splits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import decode

SCALE_BLOCK = 32  # inputs per E8M0 scale (experts) and the FP8 block edge (projections)


def _pick(n: int, options) -> int | None:
    return next((t for t in options if n % t == 0), None)


def choose_tiles(m: int, k: int, n: int, n_groups: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for an [M, K] x [K, N] grouped matmul over `n_groups` groups (see the module doc)."""
    if n_groups == 1:  # a dense projection: the smallest row tile that holds the rows
        tm = next(t for t in (16, 32, 64) if m <= t or t == 64)
    else:
        tm = 16 if m <= 4 * n_groups else 64
    # a decode-sized projection streams narrower K chunks (H200, `experiments.bench_weights --fp8-only --sweep`
    # at batch 1: tk 128 vs 256 within noise for wo_b / shared w1+w3, 4-11% faster for wq_b, wq_a+wkv, w2)
    tk = _pick(k, (128, 64, 32) if n_groups == 1 and m <= 16 else (256, 128, 64, 32))
    # wide output tiles once there are programs enough to fill the GPU (H200, `experiments.bench_weights
    # --sweep`: w2 at batch 64 70% of the copy peak with 128, 67% with 64; at batch 1, 128 leaves SMs idle)
    wide = min(n_groups, m) * (n // 128) >= 1024 or (n_groups == 1 and m > 16)  # FP8 at batch 64: 45% vs 32%
    tn = _pick(n, (128, 64, 32, 16) if wide else (64, 32, 16))
    if tk is None or tn is None:
        raise ValueError(f"the GPU grouped matmul needs K % 32 == 0 and N % 16 == 0, got K={k}, N={n}")
    return tm, tk, tn


MIN_PROGRAMS = 264  # 2 per SM of an H200: below that, K is split across programs


def k_splits(k_steps: int, programs: int, target: int = MIN_PROGRAMS, min_steps: int = 1,
             max_splits: int | None = None) -> int:
    """How many programs share one output tile's K chunks: the fewest (a divisor of k_steps, so every split has
    the same trip count, leaving each at least `min_steps` chunks, at most `max_splits`) that give `target`
    programs, else the most such. A projection with few output tiles (wq_a: 1024 outputs = 16 tiles of 64)
    otherwise streams its whole weight through 16 of 132 SMs. (The Hopper kernels' targets: `gpu_wgmma`.)"""
    top = min(max_splits or k_steps, k_steps // min_steps)
    ok = [s for s in range(1, top + 1) if k_steps % s == 0] or [1]
    return next((s for s in ok if s * programs >= target), ok[-1])


def inclusive_sum(x_g: jax.Array) -> jax.Array:
    """jnp.cumsum(x_g) of a short int vector as one parallel reduction (no scan)."""
    i = jnp.arange(x_g.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], x_g[None, :], 0), axis=1, dtype=x_g.dtype)


def tile_map(sizes_g: jax.Array, m: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row tiles of the sorted rows: (group int32 [T] (-1: no tile), first row [T], end row [T]).

    T = m // tm + min(G, m) + 1 bounds the tiles any sizes can need (each non-empty group adds at most
    one partial tile)."""
    g = sizes_g.shape[0]
    n_tiles = m // tm + min(g, m) + 1
    sizes = sizes_g.astype(jnp.int32)
    per_group = (sizes + tm - 1) // tm
    # Cumulative sums as [G, G] masked row sums: XLA's GPU cumsum over G = 384 is a two-level reduce-window
    # that ran 19 us per call on the H200 (a serial scan); behind a barrier so that they are computed once,
    # not fused into every element of the [T, G] count below.
    last, ends = jax.lax.optimization_barrier((inclusive_sum(per_group), inclusive_sum(sizes)))
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    # searchsorted(last, t, side="right") as one compare-and-count fusion: jnp.searchsorted's default is a
    # loop, which on a GPU is a while loop per call (kernels per iteration and a predicate read by the host)
    grp = jnp.sum(last[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    valid = grp < g
    grp = jnp.minimum(grp, g - 1)
    offsets = ends - sizes
    row0 = offsets[grp] + (t - (last[grp] - per_group[grp])) * tm
    return jnp.where(valid, grp, -1), row0, offsets[grp] + sizes[grp]


def _fp4_weights(vb, sb, dtype):
    """Packed bytes uint8 [tn, tk/2] and E8M0 bytes [tn, tk/32] -> (even inputs, odd inputs) `dtype` [tn, tk/2]."""
    tn, half = vb.shape
    scale = decode.e8m0_f32(sb) * decode.FP4_F16_SHIFT  # [tn, tk/32]; fp4_as_f16 is value * 2**-14

    def values(code):
        v = decode.fp4_as_f16(code).astype(jnp.float32).reshape(tn, half // 16, 16) * scale[:, :, None]
        return v.reshape(tn, half).astype(dtype)

    lo, hi = decode.nibbles(vb)
    return values(lo), values(hi)


def _fp8_weights(vb, sb, dtype):
    """E4M3 bytes uint8 [tn, tk] and the block exponents [tn/32, tk/32] -> `dtype` [tn, tk]."""
    tn, tk = vb.shape
    s = decode.e8m0_f32(sb)
    s = jnp.broadcast_to(s[:, None, :], (tn // SCALE_BLOCK, SCALE_BLOCK, tk // SCALE_BLOCK)).reshape(tn, tk // SCALE_BLOCK)
    v = decode.e4m3_f32(vb).reshape(tn, tk // SCALE_BLOCK, SCALE_BLOCK) * s[:, :, None]
    return v.reshape(tn, tk).astype(dtype)


# -- bf16 activations on the GPU: the decode in packed integer ops (PTX), scales folded in one bf16x2 FMA -----
# Every weight byte is spread into a 16-bit lane (prmt), its code bits are moved to where they make a bf16
# whose value is the decoded weight times a fixed power of two (subnormals included: an E2M1 code c placed
# as sign << 15 | mag << 6 is E2M1(c) * 2**-126; an E4M3 byte as sign << 15 | rest << 4 is E4M3 * 2**-120),
# and one fma.rn.bf16x2 by 2**(E + 126) (resp. 2**(E + 120)) applies the block scale 2**E: 15 PTX
# instructions per four weights as written (before ptxas merges mask/shift/or into LOP3), where the f32 path
# spends ~9 per weight counted the same way; measured: 1.8-2x faster on the H200, 48-70% of the copy peak
# (`python -m experiments.bench_weights --sweep`, docs/BENCHMARKS.md). The
# product is exact; its factor must be a finite bf16, so the fast path needs E8M0 bytes <= FP4_FAST_MAX
# (weights below 12 in magnitude) / FP8_FAST_MAX (below 57344); released checkpoints are far inside
# (`dsv41_jax.grouped.check_fast_scales` checks at load time). Only compiled on the GPU (interpret mode
# cannot run PTX, and XLA on the CPU flushes bf16 subnormals); the jnp twins check it there.
FP4_FAST_MAX = 128  # E8M0 byte 128 = 2**1: 2**(1 + 126) is the largest power of two a bf16 holds
FP8_FAST_MAX = 134  # 2**(7 + 120)

_ASM_REGS = "{ .reg .b32 t0, t1, m, s, z; mov.b32 z, 0x80008000; "  # z = bf16x2 -0.0: fma(a, b, -0) = a * b


def _bits_to_bf16x2(out: str, word: str, mult: str, mask_m: str, shift_m: int, mask_s: str, shift_s: int) -> str:
    """PTX: out = bf16x2((word & mask_m) << shift_m | (word & mask_s) << shift_s) * mult."""
    return (f"and.b32 m, {word}, {mask_m}; shl.b32 m, m, {shift_m}; and.b32 s, {word}, {mask_s}; "
            f"shl.b32 s, s, {shift_s}; or.b32 m, m, s; fma.rn.bf16x2 {out}, m, {mult}, z; ")


_SPREAD = "prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "  # bytes 0, 1 / 2, 3 -> 16-bit lanes


def _decode_asm(mask_m: str, shift_m: int, mask_s: str, shift_s: int) -> str:
    """PTX for four bytes ($2) -> four bf16 ($0, $1 as bf16x2) times $3/$4. Elementwise: output i comes
    from byte i only (Triton may group any four elements of a thread into one call)."""
    return (_ASM_REGS + _SPREAD + _bits_to_bf16x2("$0", "t0", "$3", mask_m, shift_m, mask_s, shift_s)
            + _bits_to_bf16x2("$1", "t1", "$4", mask_m, shift_m, mask_s, shift_s) + "}")


_FP4_ASM = {"low": _decode_asm("0x00070007", 6, "0x00080008", 12),  # E2M1 code in bits 0..3
            "high": _decode_asm("0x00700070", 2, "0x00800080", 8)}  # in bits 4..7
_FP8_ASM = _decode_asm("0x007F007F", 4, "0x00800080", 8)  # E4M3: sign bit 7 -> 15, bits 0..6 -> 4..10


def _pow2_bf16(exp_u8, bias: int):
    """E8M0 bytes -> bfloat16 2**(byte - 127 + bias), as bits (valid while byte + bias <= 254)."""
    bits = (exp_u8.astype(jnp.int32) + bias) << 7
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _fp4_weights_fast(vb, sb):
    """`_fp4_weights` for bf16 through PTX (see above): (even, odd inputs) bf16 [tn, tk/2]."""
    tn, half = vb.shape
    mult = jnp.broadcast_to(_pow2_bf16(sb, 126)[:, :, None], (tn, half // 16, 16)).reshape(tn, half)
    out = [jax.ShapeDtypeStruct((tn, half), jnp.bfloat16)]
    return tuple(plt.elementwise_inline_asm(_FP4_ASM[nib], args=[vb, mult], constraints="=r,=r,r,r,r", pack=4,
                                            result_shape_dtypes=out)[0] for nib in ("low", "high"))


def _fp8_weights_fast(vb, sb):
    """`_fp8_weights` for bf16 through PTX (see above): bf16 [tn, tk]."""
    tn, tk = vb.shape
    s = _pow2_bf16(sb, 120)
    s = jnp.broadcast_to(s[:, None, :], (tn // SCALE_BLOCK, SCALE_BLOCK, tk // SCALE_BLOCK)).reshape(tn, tk // SCALE_BLOCK)
    mult = jnp.broadcast_to(s[:, :, None], (tn, tk // SCALE_BLOCK, SCALE_BLOCK)).reshape(tn, tk)
    (w,) = plt.elementwise_inline_asm(_FP8_ASM, args=[vb, mult], constraints="=r,=r,r,r,r", pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct((tn, tk), jnp.bfloat16)])
    return w


def _kernel(grp_ref, row0_ref, end_ref, xrow_ref, *refs, fmt: str, col0: tuple[int, ...], tm: int, tk: int, tn: int,
            k: int, splits: int, fast: bool, precision):
    """One program: row tile t x output tile j x K split s: its partial sum over K chunks [s, s + 1) * K /
    splits goes to o[s]. The weights (sharing x and the tiles) sit side by side in the output, weight i
    at columns [col0[i], col0[i + 1]): tile j is columns [j * tn, j * tn + tn) of the weight they fall in."""
    n_w = len(col0) - 1
    per_w = 1 if fmt == "float" else 2  # arrays per weight: float [E, K, N]; else (values, scales)
    x_refs, w_refs, o_ref = refs[:-1 - per_w * n_w], refs[-1 - per_w * n_w:-1], refs[-1]
    t, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    steps = k // tk // splits
    g = grp_ref[t]
    which = sum((j >= c // tn).astype(jnp.int32) for c in col0[1:-1]) if n_w > 1 else 0

    def body(i, wv_ref, ws_ref=None):
        n0 = j * tn - col0[i]
        r0 = row0_ref[t]
        rows_ok = (r0 + jnp.arange(tm)) < end_ref[t]
        dt = x_refs[0].dtype

        def step(i, acc):
            i = split * steps + i
            w_k = 1  # the weight tile's K axis: [tn, tk] stored output-major, [tk, tn] input-major (float)
            if fmt == "float":
                parts = [(x_refs[0], wv_ref[g, pl.ds(i * tk, tk), pl.ds(n0, tn)].astype(dt))]
                cols, w_k = pl.ds(i * tk, tk), 0
            elif fmt == "fp4":
                kb = i * (tk // 2)
                vb = wv_ref[g, pl.ds(n0, tn), pl.ds(kb, tk // 2)]
                sb = ws_ref[g, pl.ds(n0, tn), pl.ds(i * (tk // SCALE_BLOCK), tk // SCALE_BLOCK)]
                parts = zip(x_refs, _fp4_weights_fast(vb, sb) if fast else _fp4_weights(vb, sb, dt))
                cols = pl.ds(kb, tk // 2)
            else:
                vb = wv_ref[pl.ds(n0, tn), pl.ds(i * tk, tk)]
                sb = ws_ref[pl.ds(n0 // SCALE_BLOCK, tn // SCALE_BLOCK), pl.ds(i * (tk // SCALE_BLOCK), tk // SCALE_BLOCK)]
                parts = [(x_refs[0], _fp8_weights_fast(vb, sb) if fast else _fp8_weights(vb, sb, dt))]
                cols = pl.ds(i * tk, tk)
            for x_ref, w in parts:
                xs = plt.load(x_ref.at[pl.ds(xrow_ref[t], tm), cols], mask=rows_ok[:, None], other=0)
                acc += jax.lax.dot_general(xs, w, (((1,), (w_k,)), ((), ())), precision=precision,
                                           preferred_element_type=jnp.float32)
            return acc

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((tm, tn), jnp.float32))
        plt.store(o_ref.at[split, pl.ds(r0, tm), pl.ds(j * tn, tn)], acc, mask=rows_ok[:, None])

    for i in range(n_w):
        pl.when((g >= 0) & (which == i))(functools.partial(body, i, *w_refs[per_w * i:per_w * (i + 1)]))


def dense_tile_map(m: int, tm: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`tile_map` of one group of m rows, as constants: a dense projection's rows need no device work."""
    t = np.arange(-(-m // tm), dtype=np.int32)
    return np.zeros_like(t), t * tm, np.full_like(t, m)


def _call(fmt, x_parts, weights, sizes_g, k, ns, tiles, num_warps, num_stages, fast, interpret, splits=None,
          rows_expert=None):
    """[f32 [M, N_i] per (values, scales) (fmt "float": (array,)) in `weights`, N_i = ns[i], multiples of tn],
    all read with the same rows and tile map in one launch. sizes_g None: one dense group of all M rows (a
    projection), or with rows_expert (int32 [M], -1: none) one tile per row, row m of expert rows_expert[m];
    there x may be one row that every row reads (one token's k assignments: no broadcast copy of it)."""
    m = x_parts[0].shape[0] if rows_expert is None else rows_expert.shape[0]
    tm, tk, tn = tiles
    if any(n % tn for n in ns):
        raise ValueError(f"output widths {ns} must be multiples of the output tile {tn}")
    col0 = tuple(sum(ns[:i]) for i in range(len(ns) + 1))
    if rows_expert is not None:  # row m is tile m: constants (as device arrays, an iota kernel per call)
        row0 = np.arange(m, dtype=np.int32)
        grp, end = rows_expert.astype(jnp.int32), row0 + 1
        xrow = row0 if x_parts[0].shape[0] == m else np.zeros_like(row0)
        if x_parts[0].shape[0] not in (1, m):
            raise ValueError(f"x has {x_parts[0].shape[0]} rows for {m} row experts: give one row per expert or one")
    else:
        grp, row0, end = dense_tile_map(m, tm) if sizes_g is None else tile_map(sizes_g, m, tm)
        xrow = row0
    # Compiled, a tile's rows past the arrays are masked off in its loads and stores (never touched).
    # Interpreted, a slice that would run past an array is clamped back into it (moving the valid rows
    # too), so there the rows are padded by a tile first: a pad kernel per call saved on the GPU.
    pad = tm if interpret else 0
    x_parts = [jnp.pad(x, ((0, pad), (0, 0))) for x in x_parts] if pad else x_parts
    dt = x_parts[0].dtype
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    busy_tiles = m if rows_expert is not None else -(-m // tm) if sizes_g is None else min(sizes_g.shape[0], m)
    splits = splits or k_splits(k // tk, busy_tiles * (col0[-1] // tn))
    if (k // tk) % splits:
        raise ValueError(f"splits={splits} must divide the {k // tk} K chunks of {tk}")
    kernel = functools.partial(_kernel, fmt=fmt, col0=col0, tm=tm, tk=tk, tn=tn, k=k, splits=splits,
                               fast=fast, precision=precision)
    y = pl.pallas_call(
        kernel, grid=(grp.shape[0], col0[-1] // tn, splits),
        out_shape=jax.ShapeDtypeStruct((splits, m + pad, col0[-1]), jnp.float32),
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"grouped_matmul_{fmt}_{col0[-1]}x{k}",  # the shape in the name: profiles tell the calls apart
    )(grp, row0, end, xrow, *x_parts, *[a for w in weights for a in w])
    y = jnp.sum(y[:, :m], axis=0) if splits > 1 else y[0, :m]
    if rows_expert is not None:  # rows no tile writes are uninitialized in the kernel's output
        y = jnp.where((rows_expert >= 0)[:, None], y, 0.0)
    elif sizes_g is not None:
        y = jnp.where((jnp.arange(m) < jnp.sum(sizes_g))[:, None], y, 0.0)
    return [y[:, a:b] for a, b in zip(col0[:-1], col0[1:])]


def _fp4(x_mk, weights, tiles, num_warps, num_stages, fast_decode, interpret, splits, *, sizes_g=None,
         rows_expert=None) -> list[jax.Array]:
    """The FP4 expert launch of `grouped_matmuls_fp4` (sizes_g) and `rows_matmuls_fp4` (rows_expert)."""
    g, n, half = weights[0][0].shape
    k = 2 * half
    for values, scales in weights:
        if x_mk.shape[1] != k or values.shape != (g, n, half) or scales.shape != (g, n, k // SCALE_BLOCK):
            raise ValueError(f"FP4 experts {values.shape} / scales {scales.shape} do not fit x {x_mk.shape}")
    m = x_mk.shape[0] if rows_expert is None else rows_expert.shape[0]
    tiles = tiles or choose_tiles(m, k, n, g)
    fast = fast_decode and x_mk.dtype == jnp.bfloat16 and not interpret
    return _call("fp4", [x_mk[:, 0::2], x_mk[:, 1::2]], list(weights), sizes_g, k, (n,) * len(weights), tiles,
                 num_warps, num_stages, fast, interpret, splits, rows_expert=rows_expert)


def _float(x_mk, weights, tiles, num_warps, num_stages, interpret, splits, *, rows_expert) -> list[jax.Array]:
    """The float-expert launch of `rows_matmuls_float`."""
    g, k, n = weights[0].shape
    for w in weights:
        if w.shape != (g, k, n) or x_mk.shape[1] != k:
            raise ValueError(f"float experts {w.shape} (all [E, K, N] alike) do not fit x {x_mk.shape}")
    tm, tk, tn = tiles or choose_tiles(rows_expert.shape[0], k, n, g)
    tk = min(tk, 128) if tiles is None else tk  # [tk, tn] tiles of 2-4 byte weights: 16-32 KB per stage
    return _call("float", [x_mk], [(w,) for w in weights], None, k, (n,) * len(weights), (tm, tk, tn),
                 num_warps, num_stages, False, interpret, splits, rows_expert=rows_expert)


_STATIC = ("tiles", "num_warps", "num_stages", "fast_decode", "interpret", "splits")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmuls_fp4(x_mk: jax.Array, weights, sizes_g: jax.Array, *, tiles: tuple[int, int, int] | None = None,
                        num_warps: int = 4, num_stages: int = 3, fast_decode: bool = True,
                        interpret: bool = False, splits: int | None = None) -> list[jax.Array]:
    """[y f32 [M, N] per weight]: rows of x [M, K] (bf16 or f32, sorted by group) times their expert's FP4
    weight, for each (values uint8 [G, N, K/2], scales uint8 [G, N, K/32] E8M0) in `weights` (same shapes;
    one launch and one tile map for all, e.g. w1 and w3). sizes_g int [G]; rows past sum(sizes) are zero.
    fast_decode: the PTX decode for bf16 x (see above; False: the f32 decode, for comparison). splits: programs
    sharing one output tile's K chunks (default `k_splits`; a divisor of K / tk)."""
    return _fp4(x_mk, weights, tiles, num_warps, num_stages, fast_decode, interpret, splits, sizes_g=sizes_g)


def grouped_matmul_fp4(x_mk: jax.Array, values: jax.Array, scales: jax.Array, sizes_g: jax.Array,
                       **kw) -> jax.Array:
    """`grouped_matmuls_fp4` for one weight."""
    return grouped_matmuls_fp4(x_mk, [(values, scales)], sizes_g, **kw)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def rows_matmuls_fp4(x_mk: jax.Array, weights, expert_m: jax.Array, *, tiles: tuple[int, int, int] | None = None,
                     num_warps: int = 4, num_stages: int = 3, fast_decode: bool = True, interpret: bool = False,
                     splits: int | None = None) -> list[jax.Array]:
    """`grouped_matmuls_fp4` with each row's expert given (expert_m int32 [M], -1: a zero row) instead of
    sorted rows and group sizes: one row tile per row, its expert's bytes read once per row. x: [M, K], or
    [1, K] read by every row (one token's k assignments)."""
    return _fp4(x_mk, weights, tiles, num_warps, num_stages, fast_decode, interpret, splits, rows_expert=expert_m)


@functools.partial(jax.jit, static_argnames=("tiles", "num_warps", "num_stages", "interpret", "splits"))
def rows_matmuls_float(x_mk: jax.Array, weights, expert_m: jax.Array, *, tiles: tuple[int, int, int] | None = None,
                       num_warps: int = 4, num_stages: int = 3, interpret: bool = False,
                       splits: int | None = None) -> list[jax.Array]:
    """`rows_matmuls_fp4` for float experts (`weight_format="float"`): [y f32 [M, N] per weight], row m of x
    [M, K] times expert expert_m[m] (-1: a zero row) of each [E, K, N] array in `weights` (same shapes, one
    launch), the weights cast to x's dtype as the jnp twin does. XLA computes one token's few experts as a
    reduction over K, the middle axis of the gathered [k, K, N] weights (`small` on the H200: 7.9 us per
    call for 1.5 MB); the kernel reads [tk, tn] tiles along N and splits K across programs."""
    return _float(x_mk, weights, tiles, num_warps, num_stages, interpret, splits, rows_expert=expert_m)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_matmuls(x_mk: jax.Array, weights, *, tiles: tuple[int, int, int] | None = None, num_warps: int = 4,
                num_stages: int = 3, fast_decode: bool = True, interpret: bool = False,
                splits: int | None = None) -> list[jax.Array]:
    """[y f32 [M, N_i] = x [M, K] @ W_i^T] in one launch, for W_i in the released FP8 block format: E4M3 bytes
    uint8 (or float8_e4m3fn) [N_i, K], E8M0 exponents uint8 [N_i/32, K/32], one pair per entry of `weights`
    (projections of the same input: wq_a and wkv, the shared expert's w1 and w3). N_i and K multiples of 32."""
    m, k = x_mk.shape
    ns = tuple(q.shape[0] for q, _ in weights)
    for q, e in weights:
        n = q.shape[0]
        if n % SCALE_BLOCK or k % SCALE_BLOCK or q.shape[1] != k or e.shape != (n // SCALE_BLOCK, k // SCALE_BLOCK):
            raise ValueError(f"the GPU FP8 matmul needs N, K multiples of 32 matching x; got W {q.shape}, "
                             f"scales {e.shape}, x {x_mk.shape}")
    tm, tk, tn = tiles or choose_tiles(m, k, min(ns), 1)
    tn = max(next(t for t in (tn, 64, 32) if all(n % t == 0 for n in ns)), SCALE_BLOCK)  # whole scale blocks
    weights = [(jax.lax.bitcast_convert_type(q, jnp.uint8) if q.dtype != jnp.uint8 else q, e) for q, e in weights]
    fast = fast_decode and x_mk.dtype == jnp.bfloat16 and not interpret
    return _call("fp8", [x_mk], weights, None, k, ns, (tm, tk, tn), num_warps, num_stages, fast, interpret, splits)


def fp8_matmul(x_mk: jax.Array, q_nk: jax.Array, exp: jax.Array, **kw) -> jax.Array:
    """`fp8_matmuls` for one weight."""
    return fp8_matmuls(x_mk, [(q_nk, exp)], **kw)[0]
