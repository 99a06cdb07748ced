"""Decode-step indexer scan on Hopper's warpgroup MMA, the FP4 keys decoded in registers (Pallas, Mosaic GPU).

It has the contract of `gpu_indexer.indexer_scores` without `block`: score[b, n] =
sum_h w[b, h] * relu(q[b, h] . k[b, n]), -inf at n >= reachable[b], over the packed FP4 index keys
(`quant.INDEX_KEY`: E2M1 pairs uint8 [B, N, D/2], E8M0 per 32 channels uint8 [B, N, D/32]), D = 128.
Issue 21 asks the scan for >= 70% of the copy bandwidth; the Triton scan's f16 / FP8 decode capped it at
~45% (docs/BENCHMARKS.md, issue 21 sections). Measured on the H200 (same sections, nineteenth session): exact
to the jnp twin (1e-7); at 1M x 8 69.6-71.7% of the copy peak of the same call (227 us), at 128K x 8 53-54%
(37.6 us: the kernel 33.6 us, the call's other ~3 kernels ~4 us; the kernel's 1M rate would give 27.8); the
Triton scan 31% / 27%. Those percentages are of a copy timed by wall time; against a copy timed as the kernel is
(GPU time in a trace) the H200's last numbers are 63.5% at 1M x 8 and 50.3% at 128K x 8, an H100's 86.0% and
60.0% (forty-second session); with 4224 CTAs of 2 tiles a step (forty-third) the H100's are 88.2% and 63.5%, and
at 128K x 8 the call with no decode at all reaches 65.8%: on an H100 the decode is not the bound there (the
timelines show each CTA ~3.2 us from its start to its first keys, its 4 tiles in ~2.5; the call's XLA kernel
before the scan ~2 us). On the H200 (forty-fifth session) the default takes nearly the H100's microseconds (1M x 8
221-222.5 us, 63% of the H200's peak; 128K x 8 50%) and the decode bounds it: without it 1M x 8 takes 166.9 us
(83.7%). A persistent, warp-specialized form (one CTA an SM, the loads in a memory warpgroup's ring, at ebfc01a)
ties the default at 1M x 8 on an H100, its timeline at 128K x 8 the same rate of tiles. Timed and not kept (the
forms at 538be34 and 69241da): the next tile decoded under the
current tile's wgmma (within noise), q permuted and split by each CTA instead of XLA, from global memory at the
first step (128K x 8: 41.3 -> 50.1 us) or copied beside the first keys and permuted in shared memory (39.0 ->
41.7 us; 1M x 8 224.8 -> 229.1); the epilogue's FADD a head replaced by 8 more wgmma columns (sum_h w x beside
the FFMA's sum_h w |x|; 06a9f37, forty-seventh session, H100: 1-3% slower at each point, the XLA kernels that
prepare those columns ~2 us more a call); one CTA an SM taking steps from a counter in global memory (dbf2f0d,
b25cdfb, f94ab96, a376940, bbc30ee, forty-eighth session, H100: its median CTA ends ~1 us before its last, but
each tile takes 5-11% longer: 128K x 8 39.0-39.6 us in each call's best configuration against 37.0-37.3, 1M x 8
230-252 against 225-229); each CTA asking the L2 for a later CTA's first keys (d5fb818, forty-ninth session,
H100: 1.5% faster at 128K x 8 with 264 CTAs ahead, 2-3% slower at the other points); one CTA an SM of 6
independent workers, each with its own ring, steps from one counter (cb0e16e, forty-ninth session, H100: 128K x 8
40.3 us against 37.2, and its scores wrong, not debugged). On an H100 the scan's time does not follow its compute
up to the model's 32 heads (forty-ninth session: 128K x 8 35.1 us with 8 heads and no decode, 36.9 with 32 and
the decode; 1M x 8 at 87.7-92.2% of the copy with 8-32 heads, with or without the decode): 128K x 8 is held by
the CTAs' structure.
SASS (`experiments.sass_mix`, forty-ninth session): 77 registers, 216-235 instructions a thread per 64 positions
in the loop body (136 of them the decode). In the model's dispatch while `ON`. This is the experts' form of
`gpu_wgmma` applied to keys:

Per CTA (grid: sequence x range of positions, `split_steps`): one warpgroup; q^T [D, q_parts H] (q in bf16,
or its hi and lo bf16 halves so that q . k keeps ~16 bits of any q) stays in shared memory, w in registers; a TMA
pipeline streams `tiles_per_step` tiles of 64 positions per step (a tile's 64 x 64 key bytes and 64 x 4 scale
bytes). Each tile: the keys decoded by the experts' PTX (`gpu_wgmma.DECODE_PTX`; keys in Hopper's word layout,
`layout="sm90"`, by SM90_DECODE_PTX, 12 instructions a word against 17) straight into the wgmma's
register operand, each row's groups scaled by 2**(e_g - e_max) (e_max: the row's largest scale byte; groups
2**-252 below it become 0; the 4 threads of a row each load their group's byte and take the row's largest
by two shuffles), one 64 x q_parts H x 128 product (`gpu_wgmma.fresh_product` unless fresh=False: its first wgmma
does not read the accumulator, so none is zeroed first), then the epilogue on the accumulator's registers: hi + lo
per head, 2 relu (x + |x|), times w, summed over the head columns a thread holds and across the 4 threads of
a row (shuffles), times 2**(e_max - 127) / 2 (e_max handed over by the decode), -inf past reachable, stored
by 2 of the row's threads (one half of the rows each). The channel order inside each row is permuted
(`key_perm`) so that a thread's decoded words are its own WGMMA-layout registers; q is permuted alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsv41_jax.quant import WORD_LAYOUTS
from kernels_pallas import gpu_timeline
from kernels_pallas.gpu_wgmma import (DECODE_PTX, WORD_PAIRS, fresh_product, i32_const, index_of, is_hopper,
                                     pow2_bf16x2, warpgroup_coords, wgmma_operand)

D = 128  # channels of an index key
TP = 64  # positions per step: the wgmma's M
GROUP = 32  # channels per E8M0 scale
MAX_TILES_PER_STEP = 4  # a step's keys are one TMA box, at most 256 rows
BLOCK = 8  # positions per block maximum the epilogue can give: the rows of one half of a warp's accumulator
_SPLAT = plgpu.Layout.WG_SPLAT(shape=())
_Q_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 [2H, 128]


# The decode of keys in Hopper's word layout (`quant.SM90_WORD_BITS`), with DECODE_PTX's operands ($4 the word,
# $5 the bf16x2 factor) and outputs ($0 .. $3: code pairs WORD_PAIRS, sign << 15 | e1 e0 m << 6 a lane): pair 0
# masked in place, pairs 1 and 2 after a rotate by 3 and by 6, pair 3 gathered from the rotate by 6 by a multiply
# whose three copies (<< 2, 7, 12) do not overlap (so no carry); then the same exact fma.rn.bf16x2 by $5 (-0 added).
# 8 integer ops and 4 HFMA2 a word against DECODE_PTX's 13 and 4.
SM90_DECODE_PTX = ("{ .reg .b32 r3, r6, t, z; mov.b32 z, 0x80008000; shf.l.wrap.b32 r3, $4, $4, 3; "
                   "shf.l.wrap.b32 r6, $4, $4, 6; "
                   "and.b32 t, $4, 0x81C081C0; fma.rn.bf16x2 $0, t, $5, z; "
                   "and.b32 t, r3, 0x81C081C0; fma.rn.bf16x2 $1, t, $5, z; "
                   "and.b32 t, r6, 0x81C081C0; fma.rn.bf16x2 $2, t, $5, z; "
                   "and.b32 t, r6, 0x001B001B; mul.lo.u32 t, t, 4228; and.b32 t, t, 0x81C081C0; "
                   "fma.rn.bf16x2 $3, t, $5, z; }")


def key_perm() -> np.ndarray:
    """p[c]: the channel that the wgmma's K column c holds, in every key row and in q.

    WGMMA_LAYOUT gives thread q = lane % 4 the columns 8r + 2q + {0, 1} (register r < 16) of its rows; it
    decodes the 4 words of its row's scale group q; word u's output i fills register 4u + i."""
    p = np.empty(D, np.int64)
    for r in range(D // 8):
        u, i = divmod(r, 4)
        for q in range(4):
            for j in range(2):
                p[8 * r + 2 * q + j] = GROUP * q + 8 * u + WORD_PAIRS[i][j]
    return p


@functools.cache
def _decode_keys(row0: int, ptx: str):
    """inline_mgpu: (a step's key bytes [64 T, 64] u8, its scale bytes [T, 256] u8 (64 T rows x 4)) -> (bf16
    [64, 128] of rows row0 .. row0 + 63 in WGMMA_LAYOUT (column c: channel key_perm()[c]), each group times
    2**(e_g - e_max of its row); i32 [64, 8] WGMMA_LAYOUT, every element of a row its e_max). ptx: DECODE_PTX,
    or a replacement with its operands (benchmarks)."""

    @wgmma_operand((TP, D), (plgpu.RefType(), plgpu.RefType()),
                   plgpu.ShapeDtypeStruct((TP, 8), jnp.int32, plgpu.Layout.WGMMA))
    def decode(put, k_smem, s_smem):
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        warp, q, r = warpgroup_coords()
        k_ptr, s_ptr = mgpu_utils.memref_ptr(k_smem), mgpu_utils.memref_ptr(s_smem)
        e_maxes = []
        for half in range(2):
            row = arith.addi(arith.addi(arith.muli(warp, i32_const(16)), r), i32_const(row0 + 8 * half))
            words = llvm.load(ir.VectorType.get((4,), i32),
                              mgpu_utils.getelementptr(k_ptr, [arith.addi(arith.muli(row, i32_const(64)),
                                                                         arith.muli(q, i32_const(16)))], i8))
            # thread q decodes group q of its row: its scale byte, and the row's largest over the row's 4 lanes
            e_q = arith.extui(i32, llvm.load(i8, mgpu_utils.getelementptr(
                s_ptr, [arith.addi(arith.muli(row, i32_const(4)), q)], i8)))
            e_max = mgpu_utils.warp_tree_reduce(e_q, arith.maxui, 4)
            e_maxes.append(e_max)
            # the PTX's E2M1 * 2**-126 times bf16 2**(e_q - e_max + 126) (exponent field e_q - e_max + 253)
            # = E2M1 * 2**(e_q - e_max), in [2**-1, 6] for the row's largest group; 0 for groups 2**-252 below it
            expo = arith.maxsi(arith.addi(arith.subi(e_q, e_max), i32_const(253)), i32_const(0))
            mult = pow2_bf16x2(expo)
            for u in range(4):
                word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([u]))
                outs = mgpu_utils.inline_ptx(ptx, word, mult, result_types=[i32] * 4)
                for i, reg in enumerate(outs):
                    put(half, 4 * u + i, reg)
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((TP, 8)), dtype=object)
        for half, e_max in enumerate(e_maxes):
            regs[0, 0, 0, 0, half, 0, 0, 0, 0] = vector.broadcast(ir.VectorType.get((2,), i32), e_max)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=False)

    return decode


@functools.cache
def _epilogue(h: int, row0: int, q_parts: int, block_max: bool = False):
    """inline_mgpu: (acc f32 [64, q_parts * H] WGMMA layout of the step's rows row0 .. row0 + 63 (q_parts 2:
    hi columns, then lo), the rows' e_max (`_decode_keys`), w f32 [64, H] WGMMA layout (`_head_weights`),
    out gmem f32 [B, N], [block_max: maxima gmem f32 [B, N / BLOCK]], b, the step's first position, reachable)
    -> stores the 64 scores [and their 8 block maxima]."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType(),
                                  *(plgpu.RefType(),) * block_max, _SPLAT, _SPLAT, _SPLAT))
    def epilogue(ctx, acc, e_maxes, w_regs, o_gmem, *refs):
        del ctx
        f32 = ir.F32Type.get()
        m_gmem, refs = (refs[0], refs[1:]) if block_max else (None, refs)
        b, p0, reach = (a.registers.item() for a in refs)
        warp, q, r = warpgroup_coords()
        totals = []
        for half in range(2):  # rows 16 warp + r + 8 half: every thread of the row ends with its total
            total = None
            for c in range(h // 8):  # head columns 8c + 2q + {0, 1}: hi at block c, lo at block c + H / 8
                parts = [acc.registers[0, c + p * h // 8, 0, 0, half, 0, 0, 0, 0] for p in range(q_parts)]
                for j in range(2):
                    pos = ir.DenseI64ArrayAttr.get([j])
                    x = functools.reduce(arith.addf, [vector.extract(v, dynamic_position=[], static_position=pos)
                                                      for v in parts])
                    w = vector.extract(w_regs.registers[0, c, 0, 0, 0, 0, 0, 0, 0], dynamic_position=[],
                                       static_position=pos)
                    # 2 relu(x) = x + |x| exactly: an FADD on the FMA pipe where a max would take the ALU pipe,
                    # which bounds the kernel; the 2 leaves with the row's scale
                    relu2 = arith.addf(x, mlir_math.absf(x))
                    total = arith.mulf(relu2, w) if total is None else mlir_math.fma(relu2, w, total)
            totals.append(mgpu_utils.warp_tree_reduce(total, arith.addf, 4))  # the row's lanes 4r .. 4r + 3
        # thread q < 2 of the row scales and stores half q: one predicated stretch of code for both halves
        half = arith.andi(q, i32_const(1))
        first = arith.cmpi(arith.CmpIPredicate.eq, half, i32_const(0))
        total = arith.select(first, totals[0], totals[1])
        e_max = arith.select(first, *(vector.extract(e_maxes.registers[0, 0, 0, 0, half, 0, 0, 0, 0],
                                                     dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
                                      for half in range(2)))
        row = arith.addi(arith.addi(arith.muli(warp, i32_const(16)), r),
                         arith.addi(arith.muli(half, i32_const(8)), i32_const(row0)))
        # * 2**(e_max - 127) / 2 in two exact f32 factors (each exponent within [-64, 64])
        e = arith.subi(e_max, i32_const(128))
        e1 = arith.shrsi(e, i32_const(1))
        for part in (e1, arith.subi(e, e1)):
            scale = arith.bitcast(f32, arith.addi(arith.muli(part, i32_const(1 << 23)), i32_const(127 << 23)))
            total = arith.mulf(total, scale)
        pos_n = arith.addi(p0, row)
        total = arith.select(arith.cmpi(arith.CmpIPredicate.slt, pos_n, reach), total,
                             arith.constant(f32, float("-inf")))
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, q, i32_const(2))):
            memref.store(total, o_gmem, [index_of(b), index_of(pos_n)])
        if block_max:  # the 8 rows 16 warp + 8 half + r of one half are one block: its lanes 4r + q, r < 8
            top = total
            for lanes in (4, 8, 16):
                top = arith.maximumf(top, nvvm.shfl_sync(i32_const(-1), top, i32_const(lanes), i32_const(0x1F),
                                                         nvvm.ShflKind.bfly))
            with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, arith.addi(arith.muli(r, i32_const(4)), q),
                                            i32_const(2))):  # r = 0, q < 2: half q's first row
                memref.store(top, m_gmem, [index_of(b), index_of(arith.divui(pos_n, i32_const(BLOCK)))])

    return epilogue


@functools.cache
def _head_weights(h: int):
    """inline_mgpu: (w gmem f32 [B, H], b) -> f32 [64, H] WGMMA layout, column j = w[b, j] in every row: each
    thread's 2 H / 8 head weights in registers, loaded once per CTA (the epilogue read them from shared memory
    at every tile)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SPLAT),
                       return_type=plgpu.ShapeDtypeStruct((TP, h), jnp.float32, plgpu.Layout.WGMMA))
    def load(ctx, w_gmem, b):
        del ctx
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        b = b.registers.item()
        _, q, _ = warpgroup_coords()
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((TP, h)), dtype=object)
        for c in range(h // 8):  # columns 8c + 2q + {0, 1}, the same in both of a thread's rows
            vec = llvm.mlir_undef(ir.VectorType.get((2,), f32))
            for j in range(2):
                head = arith.addi(arith.muli(q, i32_const(2)), i32_const(8 * c + j))
                vec = llvm.insertelement(vec, memref.load(w_gmem, [index_of(b), index_of(head)]), arith.constant(i32, j))
            for half in range(2):
                regs[0, c, 0, 0, half, 0, 0, 0, 0] = vec
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return load


# A CTA's points when timed (`gpu_timeline`): its start, q and its first keys in shared memory, done
TIMELINE = ("start", "waited", "end")


# The model's dispatch (`kernels_pallas.indexer_scores_decode`) takes this scan while ON, with q_parts=1 (the
# model's indexer queries are on the FP4 grid); on since its A/B in the slice (docs/BENCHMARKS.md, twelfth pass).
ON = True


# The model stores its index keys in Hopper's word layout where this scan runs (`kernels.index_key_layout`, "auto")
# only while SM90_KEYS. Off: the words are exact and this scan faster on them (H100 1-6%, fifty-second session;
# H200 7-8%, fifty-third, where the scan is bound by its instructions: docs/BENCHMARKS.md), but the Triton pool scan
# slower, and the slice's step at 128K x 8 no faster beyond noise on either GPU (1M untimed).
# `ModelConfig(index_key_layout="sm90")` asks for them either way.
SM90_KEYS = False


# The dispatch takes the block maxima of BLOCK positions from this scan's epilogue (3 shuffles and maxima a tile)
# only while FUSED_BLOCK_MAX; off, from one XLA reduce after it that reads the scores back (4-7% of the dispatch's
# call on the H200, fifty-third session, docs/BENCHMARKS.md). Bit-equal, but the epilogue's maxima add about what
# the reduce costs to the kernel: on an H100 the calls tie on the released nibbles, the words 1.6-3.2% faster at
# 128K x 32 and 1M x 8, 0.9-2.1% slower at 128K x 8 (fifty-fourth session); not timed on the H200.
FUSED_BLOCK_MAX = False


def takes(h: int, d: int) -> bool:
    """True when the dispatch would scan H heads of D-channel index keys with this kernel here (ON, an
    H100/H200, D = 128, H % 8 == 0): where `kernels.index_key_layout` stores Hopper's words."""
    return ON and d == D and h % 8 == 0 and is_hopper()


def supported(q_bhd: jax.Array, key_values: jax.Array, block: int | None) -> bool:
    """True when the dispatch runs this scan: ON, an H100/H200, D = 128, heads % 8 == 0, N % 64 == 0 and
    block maxima (if asked) over whole blocks that tile 64 positions."""
    _, h, d = q_bhd.shape
    return (key_values.shape[1] % TP == 0 and (block is None or TP % block == 0) and takes(h, d))


def split_steps(b: int, steps: int, want: int) -> tuple[int, int]:
    """(CTAs per sequence c, pipeline steps per CTA n) for `steps` steps of one sequence and about `want` CTAs
    over the batch: n = ceil(steps / ceil(want / b)), c = ceil(steps / n). CTA i scans steps from
    min(i * n, steps - n): when n does not divide steps, the last CTA's range overlaps its neighbour's by
    fewer than n steps, whose scores both write alike (any step count keeps the GPU full)."""
    n = -(-steps // -(-want // b))
    return -(-steps // n), n


def bf16_round(x: jax.Array) -> jax.Array:
    """f32 x rounded to the nearest bf16 (ties to even), as f32, by integer ops on its bits (finite x). A split
    x = hi + (x - hi) written with `x.astype(bf16).astype(f32)` loses its low part inside a jit on the GPU: XLA
    drops an f32 -> bf16 -> f32 round trip (`--xla_allow_excess_precision`, ../shared/GPU_NOTES.md), so the
    remainder comes out 0 there and hi + lo keeps bf16's 2**-9 instead of ~2**-17."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def split_query(q_bhd: jax.Array, q_parts: int = 2) -> jax.Array:
    """bf16 [B, q_parts * H, D], channels in key_perm order: q's hi and lo bf16 parts (q = hi + lo to
    ~2**-17, on every backend: `bf16_round`), or (q_parts 1) hi alone: q itself where q is exact in bf16, as
    FP4-grid queries are."""
    q = q_bhd.astype(jnp.float32)[:, :, key_perm()]
    if q_parts == 1:
        return q.astype(jnp.bfloat16)
    hi = bf16_round(q)
    return jnp.concatenate([hi.astype(jnp.bfloat16), (q - hi).astype(jnp.bfloat16)], axis=1)


def tiles_per_step_for(n: int) -> int:
    """64-position tiles per pipeline step by default: 2 where they divide N's tiles, else 1."""
    return 2 if (n // TP) % 2 == 0 else 1


# fresh=True (the default): each tile's product by `gpu_wgmma.fresh_product` (its first wgmma does not read the
# accumulator) instead of `plgpu.wgmma` into a fresh accumulator, which ptxas zeroes by moves in a step's later tiles
# (fifty-third session). Bit-equal, 4.2% fewer instructions executed; on an H100 0.8-3.1% faster at 128K x 8 / 32
# and 1M x 8, 0.4-0.8% slower where the words' scan is at its memory (1M x 8; fifty-fourth session,
# docs/BENCHMARKS.md).
# Defaults: 4224 CTAs of 2 tiles a step, 2 stages, the fastest of an H100 sweep at 128K x 8 / 32 and 1M x 8
# (forty-third session: 63.5 / 82.0 / 88.2% of the copy peak against 59.8 / 79.9 / 86.4% for the H200's earlier
# choice, 2112 CTAs of 4 tiles; docs/BENCHMARKS.md).
@functools.partial(jax.jit, static_argnames=("stages", "tiles_per_step", "q_parts", "ctas", "layout", "decode_ptx",
                                             "block", "fresh", "timeline"))
def indexer_scores_wgmma(q_bhd: jax.Array, w_bh: jax.Array, key_values: jax.Array, key_scales: jax.Array,
                         reachable_b: jax.Array, *, stages: int = 2, tiles_per_step: int | None = None, q_parts: int = 2,
                         ctas: int = 4224, layout: str = "nibbles", decode_ptx: str | None = None,
                         block: int | None = None, fresh: bool = True, timeline: bool = False):
    """Scores f32 [B, N] (`gpu_indexer.indexer_scores` without `block`): q f32/bf16 [B, H, 128] with H % 8 == 0,
    w [B, H], key_values uint8 [B, N, 64], key_scales uint8 [B, N, 4], N % 64 == 0; -inf at n >= reachable.
    stages: TMA pipeline depth; tiles_per_step: 64-position tiles per pipeline step (one wgmma each; must
    divide N / 64; default `tiles_per_step_for(N)`, 2 where it divides); q_parts: 2 = q as bf16 hi + lo (any q), 1 = q rounded to bf16
    (exact for the model's FP4-grid queries; half the MMA work); ctas: CTAs wanted over the batch
    (`split_steps`); layout: the keys' word layout (`quant.Fp4Codec.word_layout`: "nibbles" as released, decoded
    by DECODE_PTX, or "sm90", by SM90_DECODE_PTX); decode_ptx: a replacement for that decode (its operands;
    benchmarks); block: also return the scores' maxima over blocks of BLOCK positions (f32 [B, N / BLOCK],
    `gpu_indexer.indexer_scores`' second output), taken in the epilogue; fresh: each tile's product by
    `gpu_wgmma.fresh_product` (no accumulator zeroed first) instead of `plgpu.wgmma` into a fresh accumulator
    (False: the earlier form, for A/B); timeline: also
    return each CTA's `TIMELINE` points (`gpu_timeline`: u32 [CTAs, 4], CTA seq * per_seq + part)."""
    if q_parts not in (1, 2):
        raise ValueError(f"q_parts must be 1 (q exact in bf16) or 2 (bf16 hi + lo), got {q_parts}")
    if layout not in WORD_LAYOUTS:
        raise ValueError(f"layout must be the keys' word layout, one of {WORD_LAYOUTS}, got {layout!r}")
    if block not in (None, BLOCK):
        raise ValueError(f"the wgmma scan's epilogue gives block maxima over {BLOCK} positions, got block={block}: "
                         "take other blocks' maxima from its scores")
    decode_ptx = decode_ptx or (SM90_DECODE_PTX if layout == "sm90" else DECODE_PTX)
    b, h, d = q_bhd.shape
    n = key_values.shape[1]
    if d != D or h % 8 or n % TP or key_values.shape != (b, n, D // 2) or key_scales.shape != (b, n, D // GROUP):
        raise ValueError(f"the wgmma scan needs q [B, H % 8 == 0, {D}], keys [B, N % {TP} == 0, {D // 2}] and "
                         f"scales [B, N, {D // GROUP}]; got {q_bhd.shape}, {key_values.shape}, {key_scales.shape}")
    tiles, tiles_per_step = n // TP, tiles_per_step or tiles_per_step_for(n)
    if tiles % tiles_per_step or tiles_per_step > MAX_TILES_PER_STEP:
        raise ValueError(f"tiles_per_step={tiles_per_step} must divide the {tiles} tiles of {TP} positions and be at "
                         f"most {MAX_TILES_PER_STEP} (a step's keys are one TMA box of <= 256 rows)")
    all_steps, rows = tiles // tiles_per_step, TP * tiles_per_step
    per_seq, steps = split_steps(b, all_steps, ctas)
    qs = split_query(q_bhd, q_parts)
    w = w_bh.astype(jnp.float32)
    s_view = key_scales.reshape(b, tiles, TP * D // GROUP)  # a tile's 256 scale bytes; a step's: one TMA box

    def body(reach_gmem, q_gmem, w_gmem, k_gmem, s_gmem, *refs):
        outs, (q_smem, q_bar) = refs[:-2], refs[-2:]
        o_gmem, m_gmem, tl_gmem = outs[0], outs[1] if block else None, outs[-1] if timeline else None
        seq, part = lax.axis_index("b"), lax.axis_index("c")
        cta = seq * per_seq + part
        gpu_timeline.stamp(tl_gmem, cta, 0)
        first = jnp.minimum(part * steps, all_steps - steps)  # this CTA's first step (`split_steps`)
        plgpu.copy_gmem_to_smem(q_gmem.at[seq], q_smem, q_bar)
        w_regs = _head_weights(h)(w_gmem, seq)
        reach = reach_gmem[seq]

        def step(idx, k_smem, s_smem):
            (t,) = idx

            @pl.when(t == 0)
            def _():  # once: a wait flips the barrier's phase
                plgpu.barrier_wait(q_bar)
                gpu_timeline.stamp(tl_gmem, cta, 1)

            for i in range(tiles_per_step):
                keys, e_max = _decode_keys(TP * i, decode_ptx)(k_smem, s_smem)
                if fresh:
                    acc = fresh_product(D, q_parts * h, _Q_TRANSFORMS)(keys, q_smem)
                else:
                    def acc_scope(acc_ref, keys=keys):
                        plgpu.wgmma(acc_ref, keys, q_smem.transpose((1, 0)))
                        plgpu.wgmma_wait(0)
                        return acc_ref[...]

                    acc = pl.run_scoped(acc_scope, plgpu.ACC((TP, q_parts * h), jnp.float32))
                _epilogue(h, TP * i, q_parts, bool(block))(acc, e_max, w_regs, o_gmem, *(m_gmem,) * bool(block), seq,
                                                           (first + t) * rows, reach)

        plgpu.emit_pipeline(
            step,
            grid=(steps,),
            in_specs=[plgpu.BlockSpec((rows, D // 2), lambda t: (first + t, 0)),
                      plgpu.BlockSpec((tiles_per_step, TP * D // GROUP), lambda t: (first + t, 0))],
            max_concurrent_steps=stages,
        )(k_gmem.at[seq], s_gmem.at[seq])
        gpu_timeline.stamp(tl_gmem, cta, 2)

    out_type = (jax.ShapeDtypeStruct((b, n), jnp.float32),
                *(jax.ShapeDtypeStruct((b, n // BLOCK), jnp.float32),) * bool(block),
                *(jax.ShapeDtypeStruct((b * per_seq, len(TIMELINE) + 1), jnp.uint32),) * timeline)
    kernel = plgpu.kernel(
        body,
        out_type=out_type if len(out_type) > 1 else out_type[0],
        grid=(b, per_seq),
        grid_names=("b", "c"),
        scratch_types=(plgpu.SMEM((q_parts * h, D), jnp.bfloat16, transforms=_Q_TRANSFORMS),
                       plgpu.Barrier(num_arrivals=1)),
        kernel_name=f"indexer_scores_wgmma_{h}_{q_parts}",
    )
    return kernel(reachable_b.astype(jnp.int32), qs, w, key_values, s_view)
