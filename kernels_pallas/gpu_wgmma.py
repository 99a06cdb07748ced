"""Routed FP4 experts and FP8 projections on Hopper's warpgroup MMA, the weights decoded in registers (Pallas,
Mosaic GPU lowering).

`rows_matmuls_fp4_wgmma` has the row contract of `dsv41_jax.grouped.rows_matmul` (each row names its expert)
and `fp8_matmuls_wgmma` that of `gpu_grouped.fp8_matmuls`; `kernels_pallas.rows_matmuls_fp4` / `fp8_matmuls`
run them on an H100/H200 for decode-sized bf16 inputs (`supported`, `fp8_supported`), the Triton kernels of
`gpu_grouped` elsewhere. Triton must move its decoded tile through shared memory to reach the tensor cores;
here the decode writes the MMA's operand registers. H200 (docs/BENCHMARKS.md, eleventh pass): one token's
experts 52-63% of the copy peak (Triton 43-49%), 48 rows 79-86% (59-65%).

Per CTA (grid: weight x output tile of 64 x row x K split): one warpgroup. A = 64 output rows of the
expert's weights, decoded in registers straight into the wgmma's register-operand layout (`WGMMA_LAYOUT`);
B = x^T from shared memory, N = 8 rows of x (bf16 [8, 256] a step) of which the one holding this row's input
is kept. A TMA pipeline streams K in steps of 256 inputs (packed bytes [64, 128], 128 B swizzle). The CTA's
whole E8M0 block [64, K/32] is one contiguous run of bytes, fetched once by TMA: its rows are K/32 bytes
(72 for w2), which no TMA box can address, but a [E, N/64, K/128, 256] view of the same bytes can.

Decode (`_decode_tile`, inline PTX on the registers): a thread reads 16 B (one 32-input scale group of one
row) per load and turns each 32-bit word (8 codes) into four bf16x2 holding sign << 15 | mag << 6, which
is E2M1 * 2**-126 exactly (mask, multiply, mask), then one fma.rn.bf16x2 by 2**(E + 126) scales them, exactly
while the E8M0 byte is <= 128 (as `gpu_grouped`'s bf16 fast path; released expert scales are far below).
The K order inside a 256-input step is permuted (`k_perm`) so that each thread's decoded registers are
exactly its WGMMA_LAYOUT registers with no shuffle; x's columns take the same permutation (a sum over K does
not care about the order) as a CTA of at most X_STEPS_MAX steps loads its x range into shared memory
(`_fetch_x`, `_put_x`; the order by a formula: `x_column_input`), or, for longer CTAs, by XLA before a TMA pipeline.

The Mosaic GPU interpreter of jax 0.11.2 fails on a register-operand wgmma, so this kernel has no interpret
mode: its values are checked compiled on the GPU (tests/test_kernels_gpu.py), its lowering on the CPU
(tests/test_kernels_lowering.py), and its decode's bit arithmetic by a numpy model of the PTX
(tests/test_grouped.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import mma_utils
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import gpu_grouped

TN = 64  # output rows per CTA: the wgmma M of one warpgroup
TK = 256  # inputs per pipeline step: 128 packed bytes per row = one 128 B swizzle row; 8 scale groups
TM = 8  # rows of x per wgmma (its N): the smallest
SCALE_BLOCK = 32
_SPLAT = plgpu.Layout.WG_SPLAT(shape=())  # a scalar argument of an inline_mgpu function
_V_TRANSFORMS = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))  # uint8 [64, 128]
_X_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 [8, 256]

# One 32-bit word of packed codes (8 inputs: byte b holds inputs 2b (low nibble), 2b + 1) -> four bf16x2,
# output i = inputs WORD_PAIRS[i] (low, high half), each lane bf16 bits sign << 15 | mag << 6 = E2M1 * 2**-126
# (mag 1 a subnormal), exact. A mask keeps one nibble per 16-bit lane (of the word, or of the word >> 8 for
# bytes 1 and 3); one integer multiply writes two copies of it, shifted so that one copy's sign lands in bit
# 15 and the other's magnitude in bits 6..8 (y: nibble at bits 4..7, * (2**8 + 2**2); x: bits 0..3,
# * (2**12 + 2**6); the copies do not overlap, so the product is their OR); a mask keeps those 4 bits. One
# fma.rn.bf16x2 by $5 = 2**(E + 126) scales it exactly; the addend -0 keeps the sign of zeros. Per word 9 ALU
# ops, 4 IMAD and 4 HFMA2 (ptxas, sm_90a); the shift-mask-lop3 form before this took 12 ALU and 3 IMAD, and the
# ALU pipe, which issues at half rate, bound the kernels (docs/BENCHMARKS.md, thirteenth pass).
WORD_PAIRS = ((3, 7), (2, 6), (1, 5), (0, 4))
_NIBBLE = {"y": ("0x00F000F0", (1 << 8) + (1 << 2)), "x": ("0x000F000F", (1 << 12) + (1 << 6))}
DECODE_PTX = ("{ .reg .b32 v, l, t, z; mov.b32 z, 0x80008000; shr.b32 v, $4, 8; "
              + "".join(f"and.b32 l, {src}, {_NIBBLE[n][0]}; mul.lo.u32 t, l, {_NIBBLE[n][1]}; "
                        f"and.b32 t, t, 0x81C081C0; fma.rn.bf16x2 ${i}, t, $5, z; "
                        for i, (src, n) in enumerate((("v", "y"), ("v", "x"), ("$4", "y"), ("$4", "x"))))
              + "}")


def k_perm() -> np.ndarray:
    """p[c]: the input (of a 256-input step) that the wgmma's K column c holds, in every row.

    WGMMA_LAYOUT gives thread q = lane % 4 the column pairs 16n + 8b + 2q + {0, 1} (instruction n < 16,
    b < 2) of its two rows. It decodes words u < 8 (8 inputs each) of scale groups 2q (u < 4) and 2q + 1
    of those rows; word u's output i = 2a + b fills instruction n = 2u + a, pair b."""
    p = np.empty(TK, np.int64)
    for n in range(TK // 16):
        u, a = divmod(n, 2)
        for b in range(2):
            for q in range(4):
                for j in range(2):
                    p[16 * n + 8 * b + 2 * q + j] = 32 * (2 * q + u // 4) + 8 * (u % 4) + WORD_PAIRS[2 * a + b][j]
    return p


def i32_const(v):
    """An i32 MLIR constant (inside inline_mgpu functions)."""
    return arith.constant(ir.IntegerType.get_signless(32), v)


def index_of(v):
    """An i32 MLIR value as an index (memref subscripts)."""
    return arith.index_cast(ir.IndexType.get(), v)


def warpgroup_coords():
    """(warp < 4, q = lane % 4, r = lane // 4) of this thread, i32: in WGMMA_LAYOUT it holds rows 16 warp + r
    and 16 warp + r + 8, columns 8c + 2q + {0, 1}."""
    tid = mgpu_utils.thread_idx()
    lane = arith.remui(tid, i32_const(32))
    warp = arith.remui(arith.divui(tid, i32_const(32)), i32_const(4))
    return warp, arith.remui(lane, i32_const(4)), arith.divui(lane, i32_const(4))


def pow2_bf16x2(field):
    """i32 bits of a bf16x2 whose two halves are the power of two with exponent field `field` (i32, 0 .. 254;
    0 gives +0): the FMA factor of the PTX decodes."""
    return arith.muli(field, i32_const((1 << 23) + (1 << 7)))  # field << 23 | field << 7: an IMAD, not 3 ALU ops


class U32:
    """An i32 MLIR value under Python's integer operators (unsigned division and remainder), so that one formula
    serves numpy (tests) and a kernel."""

    def __init__(self, v):
        self.v = v

    @staticmethod
    def _of(o):
        return o.v if isinstance(o, U32) else i32_const(o)

    def __add__(self, o):
        return U32(arith.addi(self.v, self._of(o)))

    def __sub__(self, o):
        return U32(arith.subi(self.v, self._of(o)))

    def __rsub__(self, o):
        return U32(arith.subi(self._of(o), self.v))

    def __mul__(self, o):
        return U32(arith.muli(self.v, self._of(o)))

    def __floordiv__(self, o):
        return U32(arith.divui(self.v, self._of(o)))

    def __mod__(self, o):
        return U32(arith.remui(self.v, self._of(o)))

    def __xor__(self, o):
        return U32(arith.xori(self.v, self._of(o)))

    __radd__, __rmul__, __rxor__ = __add__, __mul__, __xor__

    @staticmethod
    def of(v):
        """v as a U32 if it is an MLIR value, else as it is (a Python int)."""
        return v if isinstance(v, (int, U32)) else U32(v)


def swizzled_offset(lead, row, col, rows: int):
    """Byte offset of bf16 element [lead, row, col] of a [L, rows, 256] shared-memory array tiled (8, 64) with the
    128 B swizzle (`_X_TRANSFORMS`; the attention's key tiles): 1 KB tiles [lead][row // 8][col // 64], 128 B a
    row, 16 B chunk j of row r at j ^ (r % 8). Ints, numpy arrays or U32s."""
    tile = (lead * (rows // 8) + row // 8) * 4 + col // 64
    return tile * 1024 + row % 8 * 128 + (col % 64 // 8 ^ row % 8) * 16 + col % 8 * 2


def x_column_input(t, fp8: bool):
    """The input (of a 256-input step) that K column 2t of a kernel's wgmma holds: `k_perm()[2t]` (FP4) or
    `fp8_k_perm()[2t]` (FP8), as a formula of t < 128 (an int, a numpy array or a U32); column 2t + 1 holds
    that + X_PAIR[fp8]."""
    if fp8:
        return 32 * (t % 4) + 16 * (t // 32 % 2) + 128 * (t // 64) + 2 * (t // 4 % 8)
    return 64 * (t % 4) + 32 * (t // 64) + 8 * (t // 16 % 4) + 3 - 2 * (t // 8 % 2) - t // 4 % 2


X_PAIR = {False: 4, True: 1}
# A CTA of at most X_STEPS_MAX pipeline steps loads its x range itself (`_fetch_x`, `_put_x`): x [R, K] as the caller
# has it, no permuted and padded copy by XLA before each launch. H200 slice, batch 1 (docs/BENCHMARKS.md,
# seventeenth pass, the first form: loads before the pipeline): 18 such kernels (36 us) fewer per step, the loading
# kernels +13 us, GPU time -18 to -24 us; this form (loads overlapping the first weight copies) timed at batch 8 only.
# Its smem, 4 KB a step, stays small beside the pipeline's 4 stages of 8-16 KB; longer CTAs (the routed experts'
# w2 at batch 1: 9 steps) take x by TMA, permuted and padded by XLA (`_x_for_tma`).
X_STEPS_MAX = 4


def _x_layout(rows: int, steps: int):
    """(layout, array type) of `_fetch_x`'s words: thread t's word for row r, step s is register r * steps + s."""
    n = rows * steps * 128
    layout = plgpu.Layout.WG_STRIDED((n,), 1)
    return layout, plgpu.ShapeDtypeStruct((n,), jnp.int32, layout)


@functools.cache
def _fetch_x(rows: int, steps: int, k: int, fp8: bool):
    """inline_mgpu: (x gmem bf16 [R, K], first row, first input) -> this thread's bf16x2 words (i32, `_x_layout`)
    of x[row0 + r, k0 + 256 s + input of column c] for its columns c = 2t, 2t + 1, r < rows, s < steps. Issued
    before the CTA's pipeline starts and stored by `_put_x` in its first step, so that the loads' latency
    overlaps the first weight copies."""
    pair = X_PAIR[fp8]
    layout, out = _x_layout(rows, steps)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SPLAT, _SPLAT), return_type=out)
    def fetch(ctx, x_gmem, row0, k0):
        del ctx
        i32, i16, i64, i8 = (ir.IntegerType.get_signless(w) for w in (32, 16, 64, 8))
        row0, k0 = (a.registers.item() for a in (row0, k0))
        col = x_column_input(U32(mgpu_utils.thread_idx()), fp8)
        g_ptr = mgpu_utils.memref_ptr(x_gmem)
        at = lambda off: mgpu_utils.getelementptr(g_ptr, [off], i8)  # noqa: E731
        regs = np.empty(layout.to_mgpu().registers_shape((rows * steps * 128,)), dtype=object)
        for r in range(rows):
            for st in range(steps):
                elem = (U32(row0) + r) * k + U32(k0) + (TK * st) + col  # bf16 elements: 2 bytes each
                off = arith.extui(i64, (elem * 2).v)
                if pair == 1:  # the two inputs are adjacent: one 4 B load
                    w = llvm.load(i32, at(off), alignment=4)
                else:
                    lo, hi = (arith.extui(i32, llvm.load(i16, at(arith.addi(off, arith.constant(i64, 2 * pair * j))),
                                                         alignment=2)) for j in range(2))
                    w = arith.ori(lo, arith.shli(hi, i32_const(16)))
                regs[r * steps + st] = vector.broadcast(ir.VectorType.get((1,), i32), w)
        return mgpu.FragmentedArray(_registers=regs, _layout=layout.to_mgpu(), _is_signed=True)

    return fetch


@functools.cache
def _put_x(rows: int, steps: int):
    """inline_mgpu: (`_fetch_x`'s words, x smem bf16 [steps, 8, 256] (_X_TRANSFORMS)) -> smem[s, r, 2t..2t+1] =
    the words (rows r >= `rows` are left as they are: their output columns are not kept); then a fence and a
    warpgroup barrier, so that the wgmmas read them."""
    layout, _ = _x_layout(rows, steps)

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(_X_TRANSFORMS)))
    def put(ctx, words, x_smem):
        del ctx
        t = U32(mgpu_utils.thread_idx())
        s_ptr = mgpu_utils.memref_ptr(x_smem)
        for r in range(rows):
            for st in range(steps):
                off = swizzled_offset(st, r, t * 2, TM)
                w = vector.extract(words.registers[r * steps + st], dynamic_position=[],
                                   static_position=ir.DenseI64ArrayAttr.get([0]))
                llvm.store(w, mgpu_utils.getelementptr(s_ptr, [off.v], ir.IntegerType.get_signless(8)), alignment=4)
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
        mgpu_utils.warpgroup_barrier()

    return put


def _x_for_tma(x_mk: jax.Array, perm: np.ndarray) -> jax.Array:
    """x [R, K] with each 256-input step's columns in the kernel's order `perm`, rows padded to a multiple of 8:
    the TMA operand of CTAs longer than X_STEPS_MAX steps (an XLA kernel before the launch)."""
    rows, k = x_mk.shape
    xp = x_mk.reshape(rows, k // TK, TK)[:, :, perm].reshape(rows, k)
    return jnp.pad(xp, ((0, -rows % TM), (0, 0)))


def fresh_product(k: int, n: int, b_transforms: tuple):
    """inline_mgpu: (a bf16 [64, k] in WGMMA_LAYOUT (registers, k % 64 == 0), b bf16 smem [n, k] with
    `b_transforms` (tiled (8, 64), 128 B swizzle)) -> f32 [64, n] = a . b^T in WGMMA_LAYOUT, complete.

    What `plgpu.wgmma` into a fresh `plgpu.ACC` and a wait give, but the first of its k / 16 instructions does
    not read the accumulator (scale-d false): Mosaic GPU 0.11.2's wgmma always accumulates, so a fresh
    accumulator is zeroed first, and ptxas zeroes a reused one with register moves (17 in a scan step's second
    tile: 8.5 of its 234 warp instructions a tile, docs/BENCHMARKS.md, fifty-third session; with this the scan
    executes 4.2% fewer, fifty-fourth). One asm block: fence, the wgmmas, commit and wait, so its outputs are
    final when it ends."""
    if k % 64 or n % 8 or not 8 <= n <= 256:
        raise ValueError(f"fresh_product needs k % 64 == 0 and n a multiple of 8 in [8, 256], got k={k}, n={n}")
    steps = k // 16  # wgmma instructions of K = 16
    outs = n // 2  # f32 accumulator registers a thread

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(b_transforms)),
                       return_type=plgpu.ShapeDtypeStruct((TN, n), jnp.float32, plgpu.Layout.WGMMA))
    def product(ctx, a, b):
        del ctx
        i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
        b_kn = mgpu.memref_transpose(b, (1, 0, 3, 2))  # tiled [k / 64, n / 8, 64, 8]: B = b^T, K-major
        (base, (k_tiling, k_strides)), (_, k_group_stride), fastest = mma_utils.create_descriptor(
            b_kn, swizzle=128, group_size=(64, n), logical_k_major=True)
        if k_tiling or len(k_strides) != 1:
            raise NotImplementedError(f"fresh_product: a B layout with K strides {k_tiling, k_strides}")
        a_regs, descs = [], []
        for j in range(steps):
            regs = a[:, 16 * j:16 * (j + 1)].registers.flat
            a_regs += [vector.extract(vector.bitcast(ir.VectorType.get((1,), i32), r), dynamic_position=[],
                                      static_position=ir.DenseI64ArrayAttr.get([0])) for r in regs]
            offset = (j // 4) * k_group_stride + (j % 4) * k_strides[0]
            descs.append(llvm.add(base, arith.constant(i64, mma_utils.encode_addr(offset)),
                                  overflow_flags=llvm.IntegerOverflowFlags.none))
        trans_b = int(fastest != mma_utils.Dim.K)
        acc = "{" + ", ".join(f"${i}" for i in range(outs)) + "}"
        instrs = "".join(
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {acc}, "
            f"{{${outs + 4 * j}, ${outs + 4 * j + 1}, ${outs + 4 * j + 2}, ${outs + 4 * j + 3}}}, "
            f"${outs + 4 * steps + j}, {'t' if j else 'f'}, 1, 1, {trans_b}; " for j in range(steps))
        ptx = ("{ .reg .pred f, t; setp.ne.b32 f, 0, 0; setp.eq.b32 t, 0, 0; wgmma.fence.sync.aligned; "
               f"{instrs}wgmma.commit_group.sync.aligned; wgmma.wait_group.sync.aligned 0; }}")
        vals = mgpu_utils.inline_ptx(ptx, *a_regs, *descs, result_types=[f32] * outs, has_side_effects=True,
                                     convergent=True)
        layout = mgpu_fa.WGMMA_LAYOUT_ACC_32BIT  # a register a value, in the wgmma's order
        regs = np.array([vector.broadcast(ir.VectorType.get((1,), f32), v) for v in vals], dtype=object)
        return mgpu.FragmentedArray(_registers=regs.reshape(layout.registers_shape((TN, n))), _layout=layout,
                                    _is_signed=None).to_layout(mgpu.WGMMA_LAYOUT)

    return product


def wgmma_operand(shape: tuple[int, int], arg_types: tuple, extra=None):
    """Decorator for the in-register decodes: fill(put, *args) computes a thread's bf16x2 words (i32 bits) and
    calls put(half, c, bits) for register c of its row half (rows 16 warp + r + 8 half in WGMMA_LAYOUT); the
    result is an inline_mgpu function of `arg_types` returning bf16 `shape` in WGMMA_LAYOUT (a wgmma's
    register operand), or, with `extra` (a plgpu.ShapeDtypeStruct), that and the FragmentedArray fill
    returns."""

    def wrap(fill):
        operand = plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, plgpu.Layout.WGMMA)

        @plgpu.inline_mgpu(arg_types=arg_types, return_type=operand if extra is None else (operand, extra))
        def decode(ctx, *args):
            del ctx
            bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
            regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)  # [1, C, 1, 1, 2, 1, ...]

            def put(half, c, bits):
                regs[0, c, 0, 0, half, 0, 0, 0, 0] = mgpu_utils.bitcast(bits, bf16x2)

            more = fill(put, *args)
            out = mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
            return out if extra is None else (out, more)

        return decode

    return wrap


def _decode_tile(k: int, ptx: str):
    """inline_mgpu: (packed SMEM tile [64, 128] u8, the CTA's scales [K/128, 256] u8, step) -> bf16 [64, 256]
    in WGMMA_LAYOUT, column c holding input k_perm()[c] of the step's 256 (`ptx`: DECODE_PTX)."""
    groups = k // SCALE_BLOCK  # scale bytes per row

    @wgmma_operand((TN, TK), (plgpu.RefType(_V_TRANSFORMS), plgpu.RefType(), _SPLAT))
    def decode(put, v_smem, s_smem, step):
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        step = step.registers.item()
        warp, q, r = warpgroup_coords()
        row0 = arith.addi(arith.muli(warp, i32_const(16)), r)
        v_ptr = mgpu_utils.memref_ptr(v_smem)  # tiled [8, 1, 8, 128]: row R at byte 128 R
        for half in range(2):  # rows R = row0 and row0 + 8 (a0/a2 and a1/a3 of each wgmma)
            row = arith.addi(row0, i32_const(8 * half))
            for h in range(2):  # scale group g = 2q + h of the step's 8
                g = arith.addi(arith.muli(q, i32_const(2)), i32_const(h))
                # 128 B swizzle: 16 B chunk g of row R sits at chunk g ^ (R % 8) = g ^ r
                off = arith.addi(arith.muli(row, i32_const(128)), arith.muli(arith.xori(g, r), i32_const(16)))
                words = llvm.load(ir.VectorType.get((4,), i32), mgpu_utils.getelementptr(v_ptr, [off], i8))
                flat = arith.addi(arith.muli(row, i32_const(groups)), arith.addi(arith.muli(step, i32_const(8)), g))
                e = memref.load(s_smem, [index_of(arith.divui(flat, i32_const(256))), index_of(arith.remui(flat, i32_const(256)))])
                mult = pow2_bf16x2(arith.addi(arith.extui(i32, e), i32_const(126)))  # 2**(byte - 1)
                for w in range(4):
                    word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([w]))
                    outs = mgpu_utils.inline_ptx(ptx, word, mult, result_types=[i32] * 4)
                    u = 4 * h + w  # output i -> instruction n = 2u + i // 2, pair b = i % 2: col block 2n + b
                    for i, reg in enumerate(outs):
                        put(half, 4 * u + i, reg)

    return decode


@functools.cache
def _store_columns(count: int):
    """inline_mgpu: o_gmem[row0 + c, n0 + i] = o_smem[i, col0 + c] for i < 64, c < count (threads 0..63:
    coalesced 256 B rows)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), _SPLAT, _SPLAT, _SPLAT))
    def store(ctx, o_smem, o_gmem, row0, n0, col0):
        del ctx
        row0, n0, col0 = (a.registers.item() for a in (row0, n0, col0))
        mgpu_utils.warpgroup_barrier()  # o_smem was written by other threads
        tid = mgpu_utils.thread_idx()
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, tid, i32_const(TN))):
            for c in range(count):
                v = memref.load(o_smem, [index_of(tid), index_of(arith.addi(col0, i32_const(c)))])
                memref.store(v, o_gmem, [index_of(arith.addi(row0, i32_const(c))), index_of(arith.addi(n0, tid))])

    return store


def supported(x_mk: jax.Array, weights, m: int) -> bool:
    """True when the model's dispatch runs `rows_matmuls_fp4_wgmma` on these arguments: ON, bf16 x whose rows
    divide the m rows of the call, K a multiple of 256 and N of 64, and an H100/H200 (the wgmma is sm_90's)."""
    values = weights[0][0]
    (rows, k), (_, n, half) = x_mk.shape, values.shape
    return (ON and x_mk.dtype == jnp.bfloat16 and rows >= 1 and m % rows == 0 and k == 2 * half and k % TK == 0
            and n % TN == 0 and is_hopper())


# The model's dispatch takes these kernels on a Hopper GPU while ON. The slice on the H200 (seventeenth session,
# docs/BENCHMARKS.md "Eleventh pass"): batch 8 GPU time 3,898 -> 3,326 us per step, loop 4.16-4.23 -> 3.72 ms;
# batch 1 GPU time 1,840 -> 1,713 us, loop unchanged (2.06 -> 2.08-2.10 ms: the GPU idles more between kernels).
ON = True


@functools.cache
def is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


@functools.partial(jax.jit, static_argnames=("splits", "stages", "decode_ptx"))
def rows_matmuls_fp4_wgmma(x_mk: jax.Array, weights, expert_m: jax.Array, *, splits: int | None = None, stages: int = 4,
                           decode_ptx: str = DECODE_PTX) -> list[jax.Array]:
    """[y f32 [M, N] per weight]: row m = x[m // (M / R)] @ W[expert_m[m]]^T, zero where expert_m[m] < 0.

    x bf16 [R, K] with R dividing M (R = 1: one token's k assignments read its one row; R = M: a row each;
    R = M / k: each token's k assignments); weights: (values uint8 [E, N, K/2] FP4 E2M1 pairs, low nibble
    = even input; scales uint8 [E, N, K/32] E8M0, bytes <= 128) pairs of one shape, one launch for all.
    splits: CTAs sharing one output tile's K (a divisor of K / 256; their partial sums are added after; default
    `fp4_splits`).
    stages: TMA pipeline depth. Each step's wgmma is waited for before the next step's decode: a wgmma reads
    its register operand while it runs, and overwriting those registers early (the decode of step t + 1
    overlapping the wgmma of step t, `wgmma_wait(1)`) gave wrong values on the H200. decode_ptx: the decode's
    PTX (its operands as DECODE_PTX's); benchmarks replace it to time the kernel without its decode
    (`experiments.bench_wgmma`)."""
    (e_count, n, half), k, m = weights[0][0].shape, x_mk.shape[1], expert_m.shape[0]
    rows, n_w, steps = x_mk.shape[0], len(weights), k // TK
    splits = splits or fp4_splits(k, n_w * (n // TN) * m)
    for values, scales in weights:
        if values.shape != (e_count, n, half) or scales.shape != (e_count, n, k // SCALE_BLOCK):
            raise ValueError(f"FP4 experts {values.shape} / scales {scales.shape} do not fit x {x_mk.shape}")
    if k != 2 * half or k % TK or n % TN or m % rows or steps % splits or x_mk.dtype != jnp.bfloat16:
        raise ValueError(f"the wgmma FP4 kernel needs bf16 x [R, K] with R | M, K % {TK} == 0, N % {TN} == 0 and "
                         f"splits | K / {TK}; got x {x_mk.shape} {x_mk.dtype}, M={m}, N={n}, splits={splits}")
    per, share, n_tiles = steps // splits, m // rows, n // TN
    direct = per <= X_STEPS_MAX  # the CTA loads its x (one row) itself; else x by TMA, prepared by XLA
    xp = x_mk if direct else _x_for_tma(x_mk, k_perm())
    s_views = [s.reshape(e_count, n_tiles, k // 128, 256) for _, s in weights]  # a CTA's scales: one box
    decode = _decode_tile(k, decode_ptx)

    def body(expert_ref, xp_gmem, *refs):
        v_gmems, s_gmems, (o_gmem, s_smem, s_bar, o_smem, *x_own) = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w:]
        wj, row, sp = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
        wi, j = wj // n_tiles, wj % n_tiles
        e = expert_ref[row]
        xrow = row // share
        words = _fetch_x(1, per, k, False)(xp_gmem, xrow, sp * per * TK) if direct else None

        def acc_scope(acc_ref):
            def run(v_gmem, s_gmem):
                plgpu.copy_gmem_to_smem(s_gmem.at[e, j], s_smem, s_bar)

                def step(idx, v_smem, *x_smem):
                    (t,) = idx

                    @pl.when(t == 0)
                    def _():
                        plgpu.barrier_wait(s_bar)  # once: a wait flips the phase
                        if direct:
                            _put_x(1, per)(words, x_own[0])

                    x_tile = x_own[0].at[t] if direct else x_smem[0]
                    plgpu.wgmma(acc_ref, decode(v_smem, s_smem, sp * per + t), x_tile.transpose((1, 0)))
                    plgpu.wgmma_wait(0)  # before the next decode overwrites the registers it reads

                plgpu.emit_pipeline(
                    step,
                    grid=(per,),
                    in_specs=[plgpu.BlockSpec((TN, TK // 2), lambda t: (j, sp * per + t), transforms=_V_TRANSFORMS)]
                    + ([] if direct else [plgpu.BlockSpec((TM, TK), lambda t: (xrow // TM, sp * per + t),
                                                          transforms=_X_TRANSFORMS)]),
                    max_concurrent_steps=stages,
                )(v_gmem.at[e], *([] if direct else [xp_gmem]))

            for w_idx in range(n_w):
                pl.when((e >= 0) & (wi == w_idx))(functools.partial(run, v_gmems[w_idx], s_gmems[w_idx]))
            return acc_ref[...]

        o_smem[...] = pl.run_scoped(acc_scope, plgpu.ACC((TN, TM), jnp.float32))  # zeros when e < 0
        _store_columns(1)(o_smem, o_gmem, (wi * splits + sp) * m + row, j * TN, 0 if direct else xrow % TM)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_w * splits * m, n), jnp.float32),
        grid=(n_w * n_tiles, m, splits),
        grid_names=("n", "m", "s"),
        scratch_types=(plgpu.SMEM((k // 128, 256), jnp.uint8), plgpu.Barrier(num_arrivals=1),
                       plgpu.SMEM((TN, TM), jnp.float32),
                       *([plgpu.SMEM((per, TM, TK), jnp.bfloat16, transforms=_X_TRANSFORMS)] if direct else [])),
        kernel_name=f"fp4_rows_wgmma_{n}x{k}",
    )
    out = kernel(expert_m.astype(jnp.int32), xp, *[v for v, _ in weights], *s_views)
    return list(out.reshape(n_w, splits, m, n).sum(1))


# ----------------------------------------------------------------------------- FP8 block-format projections
# As the experts' kernel, with one weight matrix per launch entry (no expert index), x of up to 8 rows all kept,
# 256 E4M3 bytes per row and step (two 128 B swizzle columns), and the 32 x 32 block scales of a CTA's 64 rows
# (2 rows of K/32 bytes, K/16 contiguous bytes) as one TMA box (`fp8_scale_box`).
# One 32-bit word of E4M3 bytes (inputs 0..3) -> two bf16x2 (inputs 0, 1 and 2, 3): prmt puts each of two bytes
# into the low byte of a 16-bit lane and its sign, replicated (prmt's sign mode, selector nibble 8 | byte), into
# the high byte; << 4 and one mask keep the byte's bits 0..6 in bits 4..10 and a sign copy in bit 15: bf16 bits
# whose value is E4M3 * 2**-120 exactly (subnormals included). One fma.rn.bf16x2 by $3 = 2**(E - 7) scales it
# exactly while the E8M0 byte is <= 134 (`gpu_grouped.FP8_FAST_MAX`, as its bf16 fast path). Per word 4 ALU ops,
# 2 shifts (SHF or IMAD, as ptxas balances its pipes), 2 HFMA2; the form with a second shift and a lop3 took
# 6 ALU ops and 4 shifts.
FP8_SELECTORS = (0x9180, 0xB3A2)  # lanes (byte 0, byte 1) and (byte 2, byte 3), each with its sign byte above
FP8_DECODE_PTX = ("{ .reg .b32 t, m, z; mov.b32 z, 0x80008000; "
                  + "".join(f"prmt.b32 t, $2, 0, {sel:#06x}; shl.b32 m, t, 4; and.b32 m, m, 0x87F087F0; "
                            f"fma.rn.bf16x2 ${i}, m, $3, z; " for i, sel in enumerate(FP8_SELECTORS)) + "}")
_W8_TRANSFORMS = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))  # uint8 [64, 256]
_FP8_CHUNKS = (0, 1, 8, 9)  # thread q's 16 B chunks of a row's 256 bytes: 2q + these (scale groups q, q + 4)


def fp8_k_perm() -> np.ndarray:
    """p[c]: the input (of a 256-input step) that the FP8 kernel's wgmma K column c holds, in every row.

    WGMMA_LAYOUT gives thread q = lane % 4 of a row the columns 8r + 2q + {0, 1} (register r < 32). It loads
    the row's 16 B chunks 2q + _FP8_CHUNKS[r // 8]; register r is output r % 2 of word (r % 8) // 2 of it."""
    p = np.empty(TK, np.int64)
    for r in range(TK // 8):
        for q in range(4):
            for j in range(2):
                p[8 * r + 2 * q + j] = 16 * (2 * q + _FP8_CHUNKS[r // 8]) + 2 * (r % 8) + j
    return p


def fp8_scale_box(k: int) -> tuple[int, int] | None:
    """The TMA box [rows, cols] u8 of a CTA's K/16 scale bytes: [K/1024, 64] when 1024 divides K, else [1, K/16]
    (a box row is at most 256 elements and a multiple of 16 bytes: K % 256 == 0, K <= 4096); None if neither."""
    if k % 1024 == 0:
        return k // 1024, 64
    return (1, k // 16) if k % 256 == 0 and k <= 4096 else None


def _decode_fp8_tile(k: int, ptx: str):
    """inline_mgpu: (E4M3 SMEM tile [64, 256] u8, the CTA's scales `fp8_scale_box(k)` u8 (2 rows of K/32),
    step) -> bf16 [64, 256] in WGMMA_LAYOUT, column c holding input fp8_k_perm()[c] of the step's 256."""
    cols = fp8_scale_box(k)[1]

    @wgmma_operand((TN, TK), (plgpu.RefType(_W8_TRANSFORMS), plgpu.RefType(), _SPLAT))
    def decode(put, w_smem, s_smem, step):
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        step, groups = step.registers.item(), i32_const(k // SCALE_BLOCK)
        warp, q, r = warpgroup_coords()
        w_ptr = mgpu_utils.memref_ptr(w_smem)  # tiled [8, 2, 8, 128]: (row // 8, col // 128, row % 8, col % 128)
        for half in range(2):  # rows 16 warp + r + 8 half: row // 8 = 2 warp + half, row % 8 = r, row // 32
            tile_row = arith.addi(arith.muli(warp, i32_const(2)), i32_const(half))
            s_row = arith.divui(warp, i32_const(2))
            for ci, chunk_off in enumerate(_FP8_CHUNKS):
                ch = arith.addi(arith.muli(q, i32_const(2)), i32_const(chunk_off))  # static ch // 8 = chunk_off // 8
                off = arith.addi(arith.addi(arith.muli(tile_row, i32_const(2048)), i32_const(1024 * (chunk_off // 8))),
                                 arith.addi(arith.muli(r, i32_const(128)),
                                            arith.muli(arith.xori(arith.remui(ch, i32_const(8)), r), i32_const(16))))
                words = llvm.load(ir.VectorType.get((4,), i32), mgpu_utils.getelementptr(w_ptr, [off], i8))
                group = arith.divui(ch, i32_const(2))
                flat = arith.addi(arith.muli(s_row, groups), arith.addi(arith.muli(step, i32_const(8)), group))
                e = memref.load(s_smem, [index_of(arith.divui(flat, i32_const(cols))),
                                         index_of(arith.remui(flat, i32_const(cols)))])
                mult = pow2_bf16x2(arith.addi(arith.extui(i32, e), i32_const(120)))  # 2**(byte - 7)
                for w in range(4):
                    word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([w]))
                    outs = mgpu_utils.inline_ptx(ptx, word, mult, result_types=[i32] * 2)
                    for o, reg in enumerate(outs):
                        put(half, 8 * ci + 2 * w + o, reg)

    return decode


def fp8_supported(x_mk: jax.Array, weights) -> bool:
    """True when the model's dispatch runs `fp8_matmuls_wgmma` on these arguments: ON, bf16 x of at most 8 rows,
    K with whole 256-input steps whose CTA scales make one TMA box (`fp8_scale_box`: K % 1024 == 0, or
    K % 256 == 0 up to 4096), every N a multiple of 64, an H100/H200."""
    m, k = x_mk.shape
    return (ON and x_mk.dtype == jnp.bfloat16 and 1 <= m <= TM and fp8_scale_box(k) is not None
            and all(q.shape == (q.shape[0], k) and q.shape[0] % TN == 0 for q, _ in weights) and is_hopper())


# CTAs a launch aims for (`gpu_grouped.k_splits`). One CTA per output tile leaves a batch-1 launch a few hundred CTAs: the
# H200's 132 SMs hold 2-3 of them each, and the last, partial round of CTAs runs with the HBM half idle. Splitting
# K over more CTAs evens the rounds out. H200, batch 1, every split up to 16 timed (docs/BENCHMARKS.md, sixteenth
# pass): FP8 wo_b 17.0 -> 14.1 us (2 -> 16 splits), shared w1 + w3 11.6 -> 9.7 (2 -> 10), wq_a + wkv 8.1 -> 7.3
# (5 -> 10), wq_b / shared w2 / the indexer's wq_b within 0.2 us of their best at the rule's choice; one FP8 step
# per CTA costs nothing there (and the indexer's wq_b at one CTA per tile lost 1.3 us in the slice), while an FP4
# CTA fetches its whole K's scales: FP4 w1 alone for one token's 6 experts 22.6 -> 19.8 us with the splits' sum (216 -> 2,160
# CTAs of 2 steps), w2 14.1 -> 18.2 us at 1 step per CTA. Launches already wide (batch 8's experts: 3,456
# CTAs) stay whole.
FP8_CTAS, FP4_CTAS = 1024, 3000
MAX_SPLITS = 16  # the sweep's range


def fp8_splits(k: int, tiles: int) -> int:
    """`fp8_matmuls_wgmma`'s default K splits for K inputs and `tiles` output tiles of 64."""
    return gpu_grouped.k_splits(k // TK, tiles, FP8_CTAS, max_splits=MAX_SPLITS)


def fp4_splits(k: int, ctas: int) -> int:
    """`rows_matmuls_fp4_wgmma`'s default K splits for K inputs and `ctas` CTAs of a whole K."""
    return gpu_grouped.k_splits(k // TK, ctas, FP4_CTAS, min_steps=2, max_splits=MAX_SPLITS)


@functools.partial(jax.jit, static_argnames=("splits", "stages", "decode_ptx"))
def fp8_matmuls_wgmma(x_mk: jax.Array, weights, *, splits: int | None = None, stages: int = 4,
                      decode_ptx: str = FP8_DECODE_PTX) -> list[jax.Array]:
    """[y f32 [M, N_i] = x [M, K] @ W_i^T] in one launch, for W_i in the released FP8 block format (E4M3 bytes
    uint8 or float8_e4m3fn [N_i, K], E8M0 uint8 [N_i/32, K/32], bytes <= 134). x bf16, M <= 8. splits: CTAs
    sharing one output tile's K (default `fp8_splits`); stages: TMA pipeline depth (each wgmma waited for
    before the next decode, as in `rows_matmuls_fp4_wgmma`)."""
    m, k = x_mk.shape
    ns = [q.shape[0] for q, _ in weights]
    for q, e in weights:
        if q.shape != (q.shape[0], k) or e.shape != (q.shape[0] // SCALE_BLOCK, k // SCALE_BLOCK) or q.shape[0] % TN:
            raise ValueError(f"FP8 weight {q.shape} / scales {e.shape} do not fit x {x_mk.shape} (N % {TN} == 0)")
    box = fp8_scale_box(k)
    if x_mk.dtype != jnp.bfloat16 or not 1 <= m <= TM or box is None:
        raise ValueError(f"the wgmma FP8 kernel needs bf16 x of 1..{TM} rows and K % 1024 == 0 or K % 256 == 0 "
                         f"up to 4096; got x "
                         f"{x_mk.shape} {x_mk.dtype}")
    starts = np.cumsum([0] + [n // TN for n in ns])  # weight i's output tiles: [starts[i], starts[i + 1])
    steps = k // TK
    splits = splits or fp8_splits(k, int(starts[-1]))
    if steps % splits:
        raise ValueError(f"splits={splits} must divide K / {TK} = {steps}")
    per = steps // splits
    direct = per <= X_STEPS_MAX  # the CTA loads its x (m rows) itself; else x by TMA, prepared by XLA
    xp = x_mk if direct else _x_for_tma(x_mk, fp8_k_perm())
    qs = [jax.lax.bitcast_convert_type(q, jnp.uint8) if q.dtype != jnp.uint8 else q for q, _ in weights]
    s_views = [e.reshape(n // TN, *box) for (_, e), n in zip(weights, ns)]  # a CTA's 2 scale rows
    decode = _decode_fp8_tile(k, decode_ptx)
    n_w = len(weights)

    def body(xp_gmem, *refs):
        q_gmems, s_gmems, (o_gmem, s_smem, s_bar, o_smem, *x_own) = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w:]
        tile, sp = lax.axis_index("n"), lax.axis_index("s")
        words = _fetch_x(m, per, k, True)(xp_gmem, 0, sp * per * TK) if direct else None

        def acc_scope(acc_ref):
            def run(i):
                j = tile - int(starts[i])
                plgpu.copy_gmem_to_smem(s_gmems[i].at[j], s_smem, s_bar)

                def step(idx, w_smem, *x_smem):
                    (t,) = idx

                    @pl.when(t == 0)
                    def _():
                        plgpu.barrier_wait(s_bar)
                        if direct:
                            _put_x(m, per)(words, x_own[0])

                    x_tile = x_own[0].at[t] if direct else x_smem[0]
                    plgpu.wgmma(acc_ref, decode(w_smem, s_smem, sp * per + t), x_tile.transpose((1, 0)))
                    plgpu.wgmma_wait(0)

                plgpu.emit_pipeline(
                    step,
                    grid=(per,),
                    in_specs=[plgpu.BlockSpec((TN, TK), lambda t: (j, sp * per + t), transforms=_W8_TRANSFORMS)]
                    + ([] if direct else [plgpu.BlockSpec((TM, TK), lambda t: (0, sp * per + t),
                                                          transforms=_X_TRANSFORMS)]),
                    max_concurrent_steps=stages,
                )(q_gmems[i], *([] if direct else [xp_gmem]))

            for i in range(n_w):
                pl.when((tile >= int(starts[i])) & (tile < int(starts[i + 1])))(functools.partial(run, i))
            return acc_ref[...]

        o_smem[...] = pl.run_scoped(acc_scope, plgpu.ACC((TN, TM), jnp.float32))
        _store_columns(m)(o_smem, o_gmem, sp * m, tile * TN, 0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits * m, int(starts[-1]) * TN), jnp.float32),
        grid=(int(starts[-1]), splits),
        grid_names=("n", "s"),
        scratch_types=(plgpu.SMEM(box, jnp.uint8), plgpu.Barrier(num_arrivals=1),
                       plgpu.SMEM((TN, TM), jnp.float32),
                       *([plgpu.SMEM((per, TM, TK), jnp.bfloat16, transforms=_X_TRANSFORMS)] if direct else [])),
        kernel_name=f"fp8_wgmma_{'_'.join(map(str, ns))}x{k}",
    )
    y = kernel(xp, *qs, *s_views).reshape(splits, m, -1).sum(0)
    return [y[:, TN * int(a):TN * int(b)] for a, b in zip(starts[:-1], starts[1:])]
