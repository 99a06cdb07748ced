"""Sparse attention for many decode sequences on Hopper's warpgroup MMA (Pallas, Mosaic GPU lowering).

The contract of `gpu_attention.sparse_attention` (`ops.sparse_attention_decode`) for the released head shape
(64 heads x 512 channels, K = V): out[b, h] = sum_s p[b, h, s] kv[b, s] over the sequence's window ring
(E4M3 bytes, E8M0 per 32 channels) and its selected entries (E2M1 pairs, E4M3 per 16 channels), one softmax
over both with the per-head sink in the denominator only. Issue 21 asks >= 40% of the copy bandwidth at batch
64; the Triton kernel's programs hold a [64, 512] f32 accumulator in one program (9.2%, docs/BENCHMARKS.md).
History (docs/BENCHMARKS.md): with both warpgroups working each tile in lockstep (each computing the whole
logits, each decoding half a tile) the batch-64 call took 47.3 us on the H200 (twenty-third session), 39.1 with
the ranges merged in a cluster, q read in bf16 and the prefetch in the order its data is needed (thirty-seventh).
The thirty-eighth session's ablations (H100, batch 64) found the decode (~14.5 us of 41) and the wgmmas (~10 us)
adding up instead of overlapping: the two roles, rows loaded a tile ahead, strided tiles and the merge through
distributed shared memory took the kernel 41.0 -> 29.6 us. The thirty-ninth (H100, one call against the
thirty-eighth's kernel): 29.39 -> 27.48 us (call 30.8 -> 28.9, 34.1% of the copy peak as then measured, 30.1%
of a copy timed as the kernel is: forty-second session), the model's call (bf16 q,
turned and cast output) 37.0 -> 29.2 us; the entry ids in shared memory took 28.15 -> 27.56 of that, the prefetch
in two bursts 29.26 -> 28.26, the output turned in the kernel 6 us off the model's call; the third warpgroup left
batch 64 where it was (5% off batch 8). Its timeline: ~6 us until q is in, ~1.4-2.5 per tile, ~5.3 for the
merge; without the decode the kernel takes 23.0 us, without the wgmmas 22.9, without both 16.9.
Timed and not kept (docs/BENCHMARKS.md): entry rows staged in shared memory a tile ahead by cp.async, the next
tile's decode split between the logits' and the p . v's wgmmas, and the logits over each warpgroup's channel
half summed through shared memory (all in the lockstep form); q loaded by warpgroup 0 alone with no early
prefetch burst (q in sooner, the second tile's rows later: no gain); the decoders holding two entry tiles' rows
in registers (batch 64: call 28.9 -> 30.2 us, with or without other `set_max_registers`), the merge's rows sent
to their owner as f16 (within noise; forty-second session, the forms at 538be34), sent by st.async counted on the
owner's mbarrier instead of a second cluster barrier (28.3 -> 28.2 us; forty-third session, d44c494). That
session's ablation (`skip`): without the merge and the store the batch-64 call takes 20.9 us of 28.6, without the
rows' exchange 26.4; its 16 B exchange stores and the late prefetch of the sink and cos / sin took the call
28.9 -> 28.5 us and the model's 29.5 -> 29.0. Forty-fourth (H100): the window's validity read as its bool bytes
(no conversion kernel before the call) 28.9 -> 27.3 us; not kept: the decode by warpgroup 2 alone (two rows a
thread) with warpgroup 1 on p . v alone, 27.2 -> 36.9 us (its decode ~4 us a tile where two warpgroups take ~1.6),
and a fourth warpgroup for it, which ptxas cannot compile (`REGISTERS`). Forty-eighth (H100): the merge's rows
owned by 8-row bands going round the cluster, so that every thread sends one row and adds one (3b8248f): 27.1 ->
27.5 us, the model's call 27.6 -> 27.3, the rows' exchange no faster (not kept). Fifty-fifth (H100): a sequence's
cluster split by output channels instead of keys (each CTA 256 channels of every tile, the partial logits exchanged
by st.async each tile, no merge; 824618b reverts it): 24.2 -> 31.0-32.6 us in every form, 21.3 us even without
the exchange and the tensor work (10 half-width tiles a CTA cost more than 5 whole ones).
Fifty-seventh (H100, bit-equal, at 893c1c5): the entry tiles' decode shared by channels so that warpgroup 1,
which also does its p . v, decodes 6 or 4 of a row's 16 chunks (`decode_share` 3 / 2) 23.81-24.17 -> 24.27-24.56
us (warpgroup 1's decode a tile unchanged at ~1.6 us with less work, its p . v waiting longer for warpgroup 2's
share), and the 2-range merge with one cluster barrier split around the kernel (`async_merge`, the peer's raw
rows sent into the owner's q by st.async) 24.45; neither kept; the decoders' entry rows loaded 2 or 3
tiles ahead (`rows_ahead`, 6ff9d25) 24.19-24.29 -> 24.75-27.67 us, warpgroup 2's decode a tile unchanged (~2.4 us):
the three warpgroups pace each other at every slot's hand-back, not at the rows' arrival. Fifty-ninth (H100, one
run, bit-equal, at ffc2743): a slot handed back to warpgroup 1 by warpgroup 0 alone, to warpgroup 2 by both
(`free_split`), 24.07 -> 24.08 us; not kept.

Per CTA (grid: sequence x key range, `splits`; one cluster a sequence up to MAX_SPLITS): range s takes the
sequence's 64-key tiles s, s + S, ... (window tiles first: with 2 ranges each starts with one, decoded while q
loads). At its start warpgroups 0 and 1 prefetch q and the rows of its first EARLY_TILES tiles to L2 and load q
in bf16 (`_load_query`; the model's q is bf16, an f32 q is rounded by the caller); once q is in, warpgroup 0
prefetches the other tiles' rows (`_prefetch`). The decoders (warpgroups 1 and 2) load the entry ids of their
rows in every tile of the range into shared memory (`_load_ids`). Then the three warpgroups take roles (as
FlashMLA's sparse decode gives one warpgroup the logits and shares p through shared memory), with
`plgpu.set_max_registers` giving each its REGISTERS:
- warpgroups 1 and 2 decode every tile into a bf16 [64 keys, 512] slot in shared memory (two slots), a tile ahead
  of warpgroup 0, rows 0..31 and 32..63 (4 threads a row): an entry tile's rows are loaded into registers an
  iteration before their decode (`_load_entries`, `_decode_entries`), a window tile's when it is decoded
  (`_decode_window`);
- warpgroup 1 also holds a [64 heads, 256] f32 accumulator (128 registers a thread) for output channels
  256..511: it takes warpgroup 0's p from shared memory, rescales its accumulator by the rows' factor and adds
  p . keys[:, 256:];
- warpgroup 0 computes the logits S [64 heads, 64 keys] = q . keys^T once (two wgmmas of K = 256), from the
  keys' validity as a bias (0 or -2**120, from warp ballots: no mask pass), the online softmax in exp2, hands p
  (bf16) and the rows' rescale factor to warpgroup 1 through shared memory, and adds p . keys[:, :256] into its
  own accumulator.
They meet at named barriers, one side arriving and the other waiting, each id used so that no side can arrive
twice before the other has waited: keys ready (one per slot, all three warpgroups), p ready, p free, a slot free
again (one per slot, all three), and the final rows' max and sum. Within a cluster the ranges' running maxima
and sums meet through distributed shared memory at a cluster barrier (the decoder meets the cluster's barriers
too), each range weighs its rows (`gpu_attention.combine`'s weights, the sink included), sends the rows another
CTA owns through distributed shared memory, and each CTA stores its 64 / S rows once (`_store_merged`; with
`unrotate`, turned back by the rope's angles and cast to out_dtype as they are stored, `_store_unrotated_rows`:
the model's call is one kernel); with more ranges each writes partials that `gpu_attention.combine` merges
(`_store_partials`). Both stage their rows in shared memory and write them whole (`_stage_row`,
`_staged_moves`).

Numbers, all exact until the MMA: an entry value E2M1 x E4M3 has at most 6 significant bits and a window
value E4M3 x 2**e at most 4, so both are exact in bf16; they are held as value x 2**-10 (`KEY_SHIFT`) so
that one bf16 fma scales the experts' decode (`gpu_wgmma.DECODE_PTX`: E2M1 x 2**-126) by E4M3 x 2**116
without leaving bf16's range (window scales up to 2**17). q and p are rounded to bf16 (2**-9 relative), so the
output agrees with the float32 reference to ~3e-3 relative as measured (tests use 5e-3, as for the Triton
kernel, whose float16 operands give ~1e-4).

Channel order: the decode writes each 8-channel group in the order `PERM8` (the experts' PTX emits its
pairs so; `channel_perm`), q is permuted alike as the kernel loads it, and the output's stores put the
channels back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import gpu_attention, gpu_timeline, gpu_wgmma
from kernels_pallas.gpu_wgmma import (DECODE_PTX, WORD_PAIRS, U32, i32_const, index_of, pow2_bf16x2, swizzled_offset,
                                     warpgroup_coords)

H = 64  # heads: the wgmma's M
D = 512  # channels of a key / value
HALF = D // 2  # channels of one warpgroup's accumulator (a wgmma's N is at most 256)
T = 64  # keys per tile: the logits wgmma's N
KEY_SHIFT = 10  # keys are held in bf16 as value * 2**-KEY_SHIFT
NEG = -(2.0 ** 120)  # bias of an invalid key: times the logit scale it stays finite in f32, exp2 gives 0
PERM8 = tuple(c for pair in WORD_PAIRS for c in pair)  # column 8u + p holds channel 8u + PERM8[p]
WINDOW_GROUP, ENTRY_GROUP = gpu_attention.WINDOW_SCALE_BLOCK, gpu_attention.ENTRY_SCALE_BLOCK
_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 [64, 256]
_SPLAT = plgpu.Layout.WG_SPLAT(shape=())
# Named barrier ids (0 is the CTA's, 1-3 the three warpgroups' own, Mosaic GPU's): warpgroups 0 and 1 meet at
# _CTA_BARRIER (the partials' store); the others pass a tile between the roles, one side arriving, the other
# waiting (the kernel body's hand-offs).
_CTA_BARRIER = 8
KEYS_READY, P_READY, P_FREE, STATS_READY, SLOT_FREE = 9, 11, 12, 13, 14  # KEYS_READY, SLOT_FREE: + slot

# E4M3 scale pair (one b16) -> two bf16x2, each both halves E4M3 x 2**116 (exact: 4 significant bits, and
# 2**116 keeps E4M3's range inside bf16's); the f32 route handles E4M3 subnormals with no special case.
SCALE_PTX = ("{ .reg .b32 h2, ta, tb; .reg .b16 a, b; .reg .f32 fa, fb; "
             "cvt.rn.f16x2.e4m3x2 h2, $2; mov.b32 {a, b}, h2; cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; "
             f"mul.f32 fa, fa, 0f{(116 + 127) << 23:08X}; mul.f32 fb, fb, 0f{(116 + 127) << 23:08X}; "
             "mov.b32 ta, fa; mov.b32 tb, fb; prmt.b32 $0, ta, 0, 0x3232; prmt.b32 $1, tb, 0, 0x3232; }")


def _window_selector(x: int, y: int) -> int:
    """prmt selector: bytes x, y of (A, B) into the two 16-bit lanes, each with its sign byte above."""
    return x | (8 | x) << 4 | y << 8 | (8 | y) << 12


# Two words of E4M3 bytes (channels 0..3 in $4, 4..7 in $5) -> four bf16x2 in the PERM8 pair order, each
# E4M3 x 2**-120 (the FP8 weights' decode, `gpu_wgmma.FP8_DECODE_PTX`) times $6 = 2**(E - 17): the window
# value x 2**-KEY_SHIFT for E8M0 byte E (exact while E <= 144, i.e. scales up to 2**17).
WINDOW_PTX = ("{ .reg .b32 t, m, z; mov.b32 z, 0x80008000; "
              + "".join(f"prmt.b32 t, $4, $5, {_window_selector(x, y):#06x}; shl.b32 m, t, 4; "
                        f"and.b32 m, m, 0x87F087F0; fma.rn.bf16x2 ${i}, m, $6, z; "
                        for i, (x, y) in enumerate(WORD_PAIRS)) + "}")


def channel_perm() -> np.ndarray:
    """p[c]: the channel that column c of the kernel's keys, q and output holds."""
    return (np.arange(D) // 8 * 8 + np.asarray(PERM8)[np.arange(D) % 8]).astype(np.int64)


def _i64(v):
    return arith.extui(ir.IntegerType.get_signless(64), v)


def _smem_offset(slot, half, row, col):
    """Byte offset of bf16 keys[slot, half, row, col] in the [2, 2, 64, 256] tile (`gpu_wgmma.swizzled_offset`),
    an i32 value."""
    u = U32.of
    return swizzled_offset(u(slot) * 2 + u(half), u(row), u(col), T).v


def _store16(k_ptr, off, words):
    vec = ir.VectorType.get((4,), ir.IntegerType.get_signless(32))
    v = llvm.mlir_undef(vec)
    for i, w in enumerate(words):
        v = llvm.insertelement(v, w, arith.constant(ir.IntegerType.get_signless(32), i))
    llvm.store(v, mgpu_utils.getelementptr(k_ptr, [off], ir.IntegerType.get_signless(8)), alignment=16)


def _load(ptr, off64, ty, align):
    return llvm.load(ty, mgpu_utils.getelementptr(ptr, [off64], ir.IntegerType.get_signless(8)), alignment=align)


def _thread_row():
    """(tile row this thread of warpgroups 1 and 2 decodes: 8 per warp, 4 threads a row = (thread - 128) // 4,
    warpgroup 1 rows 0..31, warpgroup 2 rows 32..63; q = thread % 4), i32."""
    tid = mgpu_utils.thread_idx()
    return arith.shrui(arith.subi(tid, i32_const(128)), i32_const(2)), arith.andi(tid, i32_const(3))


def _named_barrier(kind: str, bar, threads: int = 256):
    """bar.sync (wait until `threads` threads have arrived) or bar.arrive (count this warpgroup, go on) at named
    barrier `bar` (an int or an i32 value), inside an inline_mgpu body."""
    if isinstance(bar, int):
        mgpu_utils.inline_ptx(f"bar.{kind} {bar}, {threads};", has_side_effects=True)
    else:
        mgpu_utils.inline_ptx(f"bar.{kind} $0, {threads};", bar, has_side_effects=True)


@functools.cache
def _barrier(wait: bool, threads: int):
    """inline_mgpu (bar id i32): the calling warpgroup waits at (wait) or arrives at (not wait) named barrier
    `bar` of `threads` threads, from a kernel body (the roles' hand-offs)."""

    @plgpu.inline_mgpu(arg_types=(_SPLAT,))
    def bar(ctx, bar_id):
        del ctx
        _named_barrier("sync" if wait else "arrive", bar_id.registers.item(), threads)

    return lambda bar_id: bar(jnp.asarray(bar_id, jnp.int32))


def _publish_validity(mask_ptr, slot, valid, q):
    """Warp w's (of warpgroups 1 and 2: w = (thread - 128) // 32) ballot of its 8 rows' validity (bit 4r for row 8w
    + r, from the row's q = 0 thread) into mask[slot, w] (u32 [2, 8] in shared memory), for `_bias`."""
    pred = arith.andi(valid, arith.cmpi(arith.CmpIPredicate.eq, q, i32_const(0)))
    bits = mgpu_utils.inline_ptx("{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff; }",
                                 arith.extui(ir.IntegerType.get_signless(32), pred), result_types=ir.IntegerType.get_signless(32))
    tid = mgpu_utils.thread_idx()
    warp = arith.shrui(arith.subi(tid, i32_const(128)), i32_const(5))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, arith.andi(tid, i32_const(31)), i32_const(0))):
        off = arith.muli(arith.addi(arith.muli(slot, i32_const(8)), warp), i32_const(4))
        llvm.store(bits, mgpu_utils.getelementptr(mask_ptr, [off], ir.IntegerType.get_signless(8)), alignment=4)


def _prefetch_l2(ptr, off64, lines: int):
    """prefetch.L2 of `lines` 128 B lines from ptr + off64 (bytes)."""
    for j in range(lines):
        mgpu_utils.inline_ptx("prefetch.L2 [$0];", mgpu_utils.getelementptr(
            ptr, [arith.addi(off64, _i64(i32_const(128 * j)))], ir.IntegerType.get_signless(8)), has_side_effects=True)


def _write_tile(k_smem, masks, slot, wait, row, q, valid, passes, decode_chunk):
    """The common part of the decodes (warpgroups 1 and 2, each its rows): per pass, passes[p]() loads chunks
    [(chunk index, words, scale)]; after the first pass's loads are issued, the slot's last reader of warpgroup 0
    is waited for (wait != 0: `SLOT_FREE` + slot); each chunk goes through decode_chunk(chunk index, words, scale)
    -> [(channel half, column, four bf16x2)] into the slot's swizzled tile; the rows' validity is published, and
    after a fence that makes the writes visible to the tensor cores (wgmma), the warpgroup arrives at
    `KEYS_READY` + slot."""
    k_ptr = mgpu_utils.memref_ptr(k_smem)
    for p, load in enumerate(passes):
        loads = load()
        if p == 0:
            with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ne, wait, i32_const(0))):
                _named_barrier("sync", arith.addi(slot, i32_const(SLOT_FREE)), 384)
        for i, words, scale in loads:
            for half, col, outs in decode_chunk(i, words, scale):
                _store16(k_ptr, _smem_offset(slot, half, row, col), outs)
    _publish_validity(mgpu_utils.memref_ptr(masks), slot, valid, q)
    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
    _named_barrier("arrive", arith.addi(slot, i32_const(KEYS_READY)), 384)


# An entry tile's raw rows as warpgroup 1 holds them between their load and their decode (`_load_entries`): a
# thread's 4 chunks of 16 B, their 4 E4M3 scale pairs, and its row's entry id.
_RAW = (plgpu.ShapeDtypeStruct((128 * 4 * 4,), jnp.uint32, plgpu.Layout.WG_STRIDED((128 * 4 * 4,), vec_size=4)),
        plgpu.ShapeDtypeStruct((128 * 4,), jnp.int16, plgpu.Layout.WG_STRIDED((128 * 4,), vec_size=4)),
        plgpu.ShapeDtypeStruct((128,), jnp.int32, plgpu.Layout.WG_STRIDED((128,), vec_size=1)))


def _fragments(shape_dtype, registers):
    return mgpu.FragmentedArray(_registers=np.asarray(registers, dtype=object), _layout=shape_dtype.layout.to_mgpu(),
                                _is_signed=None if jnp.issubdtype(shape_dtype.dtype, jnp.floating) else False)


@functools.cache
def _load_ids(n_wt: int, per: int, splits: int):
    """inline_mgpu (warpgroups 1 and 2, at their start): (idx i32 [B, K], ids smem i32 [per, 256], b, key range s)
    -> ids[i, thread - 128] = the entry id of the row this thread decodes in its tile i (tile s + splits i; for a
    window tile or one past the range, the first entry tile's: unused), every index loaded before the first is
    stored. `_load_entries` reads its tile's ids from here: one round trip to L2 a tile for the rows, where there
    were two (the index, then the rows)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), _SPLAT, _SPLAT))
    def load(ctx, idx, ids, b, part):
        del ctx
        b, part = (a.registers.item() for a in (b, part))
        row, _ = _thread_row()
        me = arith.subi(mgpu_utils.thread_idx(), i32_const(128))
        kp = ir.MemRefType(idx.type).shape[1]
        vals = []
        for i in range(per):
            first = arith.muli(arith.subi(arith.addi(part, i32_const(splits * i)), i32_const(n_wt)), i32_const(T))
            first = arith.minsi(arith.maxsi(first, i32_const(0)), i32_const(kp - T))
            vals.append(memref.load(idx, [index_of(b), index_of(arith.addi(first, row))]))
        for i, v in enumerate(vals):
            memref.store(v, ids, [index_of(i32_const(i)), index_of(me)])

    return load


@functools.cache
def _load_entries(n_rows: int):
    """inline_mgpu (warpgroups 1 and 2): (entry values gmem u8 [B, N, 256], scales u8 [B, N, 32], ids smem i32
    [per, 256] (`_load_ids`), b, tile i) -> `_RAW` of the tile's rows r = entry ids[i, thread - 128] (row 0 for
    an id < 0: finite, and masked by the bias): the loads issued, not waited for, so that they land while the
    warpgroup does other work (its p . v and the wait for p) before `_decode_entries` uses them. n_rows: N."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3 + (_SPLAT,) * 2, return_type=_RAW)
    def load(ctx, ev, es, ids, b, i):
        del ctx
        i32, i16 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(16)
        b, i = (a.registers.item() for a in (b, i))
        _, q = _thread_row()
        ev_ptr, es_ptr = mgpu_utils.memref_ptr(ev), mgpu_utils.memref_ptr(es)
        ix = memref.load(ids, [index_of(i), index_of(arith.subi(mgpu_utils.thread_idx(), i32_const(128)))])
        entry = arith.addi(arith.muli(_i64(b), _i64(i32_const(n_rows))), _i64(arith.maxsi(ix, i32_const(0))))
        words, scales = [], llvm.mlir_undef(ir.VectorType.get((4,), i16))
        for k in range(4):  # raw 16 B chunk i = q + 4k: channels 32i .. 32i + 31, scale bytes 2i, 2i + 1
            i = arith.addi(q, i32_const(4 * k))
            v_off = arith.addi(arith.muli(entry, _i64(i32_const(D // 2))), _i64(arith.muli(i, i32_const(16))))
            s_off = arith.addi(arith.muli(entry, _i64(i32_const(D // ENTRY_GROUP))), _i64(arith.muli(i, i32_const(2))))
            words.append(_load(ev_ptr, v_off, ir.VectorType.get((4,), i32), 16))
            scales = llvm.insertelement(scales, _load(es_ptr, s_off, i16, 2), arith.constant(i32, k))
        ids = llvm.insertelement(llvm.mlir_undef(ir.VectorType.get((1,), i32)), ix, arith.constant(i32, 0))
        return tuple(_fragments(t, r) for t, r in zip(_RAW, (words, [scales], [ids])))

    return load


@functools.cache
def _decode_entries():
    """inline_mgpu (warpgroups 1 and 2): (keys smem, validity masks smem, `_RAW` of an entry tile (`_load_entries`),
    slot, wait) -> keys[slot] rows = the entries x 2**-KEY_SHIFT in PERM8 order, their validity (id >= 0) in
    masks[slot], as `_write_tile` (wait: whether warpgroup 0 still reads the slot)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(_TRANSFORMS), plgpu.RefType(), *(r.layout for r in _RAW), _SPLAT,
                                  _SPLAT))
    def decode(ctx, k_smem, masks, words, scales, ids, slot, wait):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        slot, wait = (a.registers.item() for a in (slot, wait))
        row, q = _thread_row()
        valid = arith.cmpi(arith.CmpIPredicate.sge, llvm.extractelement(ids.registers[0], arith.constant(i32, 0)),
                           i32_const(0))
        chunks = [(arith.addi(q, i32_const(4 * k)), words.registers[k],
                   llvm.extractelement(scales.registers[0], arith.constant(i32, k))) for k in range(4)]
        _write_tile(k_smem, masks, slot, wait, row, q, valid, [lambda: chunks], _entry_chunk)

    return decode


def _entry_chunk(i, words, sc):
    """`_write_tile`'s decode_chunk for entries: 4 words of 8 channels (raw 16 B chunk i: channels 32i .. 32i + 31),
    the first two under scale byte 2i, the last two 2i + 1 (the pair sc, i16)."""
    i32 = ir.IntegerType.get_signless(32)
    mults = mgpu_utils.inline_ptx(SCALE_PTX, sc, result_types=[i32, i32])
    for u in range(4):
        outs = mgpu_utils.inline_ptx(DECODE_PTX, llvm.extractelement(words, arith.constant(i32, u)), mults[u // 2],
                                     result_types=[i32] * 4)
        col = arith.addi(arith.muli(arith.remui(i, i32_const(8)), i32_const(32)), i32_const(8 * u))
        yield arith.divui(i, i32_const(8)), col, outs


@functools.cache
def _decode_window():
    """inline_mgpu (warpgroups 1 and 2): (keys smem, validity masks smem, window values gmem u8 [B, W, 512], E8M0
    scales u8 [B, W, 16], validity bool [B, W] (its bytes read as they are: no conversion kernel before the call), b,
    slot, wait, first row w0) -> keys[slot] rows r = window row w0 + r x 2**-KEY_SHIFT in PERM8 order, their
    validity in masks[slot], as `_decode_entries` (in two passes of 4 chunks a thread, to leave registers to the
    accumulator)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(_TRANSFORMS), plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                  plgpu.RefType(), _SPLAT, _SPLAT, _SPLAT, _SPLAT))
    def decode(ctx, k_smem, masks, wv, ws, wok, b, slot, wait, w0):
        del ctx
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        b, slot, wait, w0 = (a.registers.item() for a in (b, slot, wait, w0))
        row, q = _thread_row()
        w_rows = ir.MemRefType(wv.type).shape[1]
        wv_ptr, ws_ptr, ok_ptr = (mgpu_utils.memref_ptr(r) for r in (wv, ws, wok))
        rec = arith.addi(arith.muli(_i64(b), _i64(i32_const(w_rows))), _i64(arith.addi(w0, row)))
        valid = arith.cmpi(arith.CmpIPredicate.ne, _load(ok_ptr, rec, i8, 1), arith.constant(i8, 0))

        def loads(ks):
            out = []
            for k in ks:  # raw 16 B chunk i = q + 4k: channels 16i .. 16i + 15, E8M0 byte i // 2
                i = arith.addi(q, i32_const(4 * k))
                v_off = arith.addi(arith.muli(rec, _i64(i32_const(D))), _i64(arith.muli(i, i32_const(16))))
                s_off = arith.addi(arith.muli(rec, _i64(i32_const(D // WINDOW_GROUP))),
                                   _i64(arith.divui(i, i32_const(2))))
                out.append((i, _load(wv_ptr, v_off, ir.VectorType.get((4,), i32), 16), _load(ws_ptr, s_off, i8, 1)))
            return out

        def chunk(i, words, e):  # 4 words of 4 channels, one E8M0 byte: two 8-channel groups
            mult = pow2_bf16x2(arith.minui(arith.addi(arith.extui(i32, e), i32_const(127 - 17)), i32_const(254)))
            for p in range(2):
                a, b2 = (llvm.extractelement(words, arith.constant(i32, 2 * p + j)) for j in range(2))
                outs = mgpu_utils.inline_ptx(WINDOW_PTX, a, b2, mult, result_types=[i32] * 4)
                col = arith.addi(arith.muli(arith.remui(i, i32_const(16)), i32_const(16)), i32_const(8 * p))
                yield arith.divui(i, i32_const(16)), col, outs

        _write_tile(k_smem, masks, slot, wait, row, q, valid, [lambda: loads(range(4)), lambda: loads(range(4, 8))],
                    chunk)

    return decode


# Tiles of a range whose rows `_prefetch` asks for with q, before q is loaded (the decode of tile 0 and the load
# of tile 1 come first); the others' after. 1 and 3 timed slower than 2 on an H200 (24.4 / 24.8 us against 24.2 at
# batch 64, forty-fifth session); 0 faster than 2, 22.48 / 22.92 us on an H200 (fifty-third) and 23.98 / 24.36 on
# an H100 (fifty-fourth session; `issue21_timeline early`, docs/BENCHMARKS.md)
EARLY_TILES = 0


@functools.cache
def _prefetch(n_rows: int, w_rows: int, n_wt: int, n_t: int, splits: int, early: bool, merge_inputs: int = 0):
    """inline_mgpu: (entry values, scales, idx, window values, scales, q (gmem), [merge_inputs gmem refs], b, key
    range s) -> prefetch.L2 of key rows this CTA will decode (its tiles s, s + splits, ... < n_t of 64 keys: window
    tiles, then entry tiles): early, by both warpgroups, its first EARLY_TILES tiles' rows (warpgroup 0: a key a
    thread) and q[b]; else, by warpgroup 0 once q is in, every other tile's rows, and what the merge reads last
    (merge_inputs: the sink f32 [64], then the rope's cos and sin f32 [B, 256], of which row b), which each CTA
    would otherwise read from HBM at its end.

    The thirty-seventh session's form asked for every row at once (q and the first tile's first): a batch-64 CTA
    waited ~6.5 us for q and its first tile (H100 and H200, docs/BENCHMARKS.md), the ~20 MB all the CTAs asked
    for arriving together. Here the first burst is q and EARLY_TILES tiles a CTA (0 since the fifty-fourth
    session: q alone, ~8 MB at batch 64, while the decoders load their first tiles' rows themselves); the rest
    streams while the first tiles are computed."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (6 + merge_inputs) + (_SPLAT,) * 2)
    def prefetch(ctx, ev, es, idx, wv, ws, q_gmem, *refs):
        del ctx
        ends, (b, part) = refs[:merge_inputs], (a.registers.item() for a in refs[merge_inputs:])
        ev_ptr, es_ptr, wv_ptr, ws_ptr, q_ptr = (mgpu_utils.memref_ptr(r) for r in (ev, es, wv, ws, q_gmem))
        kp = ir.MemRefType(idx.type).shape[1]
        tid = arith.andi(mgpu_utils.thread_idx(), i32_const(127 if not early else 255))
        threads = 256 if early else 128
        cmp = lambda pred, x, y: arith.cmpi(getattr(arith.CmpIPredicate, pred), x, y)
        per = -(-n_t // splits)
        first_key, last_key = (0, EARLY_TILES * T) if early else (EARLY_TILES * T, per * T)
        for j in range(-(-(last_key - first_key) // threads)):
            key = arith.addi(tid, i32_const(first_key + threads * j))  # its tile i = key // 64: s + splits i
            tile = arith.addi(part, arith.muli(arith.divui(key, i32_const(T)), i32_const(splits)))
            pos = arith.addi(arith.muli(tile, i32_const(T)), arith.remui(key, i32_const(T)))
            mine = arith.andi(cmp("slt", key, i32_const(last_key)), cmp("slt", tile, i32_const(n_t)))
            with mgpu_utils.when(mine):
                with mgpu_utils.when(cmp("slt", tile, i32_const(n_wt))):
                    rec = arith.addi(arith.muli(_i64(b), _i64(i32_const(w_rows))), _i64(pos))
                    _prefetch_l2(wv_ptr, arith.muli(rec, _i64(i32_const(D))), D // 128)
                    _prefetch_l2(ws_ptr, arith.muli(rec, _i64(i32_const(D // WINDOW_GROUP))), 1)
                with mgpu_utils.when(cmp("sge", tile, i32_const(n_wt))):
                    e = arith.minsi(arith.subi(pos, i32_const(n_wt * T)), i32_const(kp - 1))
                    ix = memref.load(idx, [index_of(b), index_of(e)])
                    with mgpu_utils.when(cmp("sge", ix, i32_const(0))):
                        entry = arith.addi(arith.muli(_i64(b), _i64(i32_const(n_rows))), _i64(ix))
                        _prefetch_l2(ev_ptr, arith.muli(entry, _i64(i32_const(D // 2))), D // 256)
                        _prefetch_l2(es_ptr, arith.muli(entry, _i64(i32_const(D // ENTRY_GROUP))), 1)
        if early:
            q_base = arith.muli(_i64(b), _i64(i32_const(H * D * 2)))
            for i in range(H * D * 2 // 128 // 256):  # q[b]'s 128 B lines
                line = arith.addi(tid, i32_const(256 * i))
                _prefetch_l2(q_ptr, arith.addi(q_base, _i64(arith.muli(line, i32_const(128)))), 1)
        if ends:
            sink, *turn = ends
            with mgpu_utils.when(cmp("eq", tid, i32_const(0))):
                _prefetch_l2(mgpu_utils.memref_ptr(sink), _i64(i32_const(0)), H * 4 // 128)
                for ref in turn:  # row b of cos and of sin
                    _prefetch_l2(mgpu_utils.memref_ptr(ref), arith.muli(_i64(b), _i64(i32_const(D // 2 * 4))),
                                 D // 2 * 4 // 128)

    return prefetch


@functools.cache
def _bias():
    """inline_mgpu: (validity masks smem u32 [2, 8], slot) -> f32 [64, 64] WGMMA layout, column n 0 where key n
    of the slot's tile is valid, NEG where not (the logits accumulator's start)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SPLAT),
                       return_type=plgpu.ShapeDtypeStruct((H, T), jnp.float32, plgpu.Layout.WGMMA))
    def bias(ctx, masks, slot):
        del ctx
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        slot = slot.registers.item()
        q = arith.remui(mgpu_utils.thread_idx(), i32_const(4))
        ptr = mgpu_utils.memref_ptr(masks)
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((H, T)), dtype=object)
        zero, neg = arith.constant(f32, 0.0), arith.constant(f32, NEG)
        for c in range(T // 8):  # columns 8c + 2q + {0, 1}: keys of warp word c, bits 4 (2q + j)
            word = llvm.load(i32, mgpu_utils.getelementptr(
                ptr, [arith.muli(arith.addi(arith.muli(slot, i32_const(8)), i32_const(c)), i32_const(4))],
                ir.IntegerType.get_signless(8)), alignment=4)
            vec = llvm.mlir_undef(ir.VectorType.get((2,), f32))
            for j in range(2):
                at = arith.addi(arith.muli(q, i32_const(8)), i32_const(4 * j))
                bit = arith.andi(arith.shrui(word, at), i32_const(1))
                v = arith.select(arith.cmpi(arith.CmpIPredicate.ne, bit, i32_const(0)), zero, neg)
                vec = llvm.insertelement(vec, v, arith.constant(i32, j))
            for half in range(2):
                regs[0, c, 0, 0, half, 0, 0, 0, 0] = vec
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return bias


@functools.cache
def _load_query():
    """inline_mgpu: (q gmem bf16 [B, 64, 512], q smem bf16 [2, 64, 256] (channel halves), b) -> q[b] in the
    kernel's channel order (`channel_perm`): a thread reads 8 channels (one 16 B load, whole lines over a warp),
    puts their pairs in PERM8 order by byte permutes and writes the 16 B chunk."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(_TRANSFORMS), _SPLAT))
    def load(ctx, q_gmem, q_smem, b):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        b = b.registers.item()
        tid = mgpu_utils.thread_idx()
        g_ptr, s_ptr = mgpu_utils.memref_ptr(q_gmem), mgpu_utils.memref_ptr(q_smem)
        base = arith.muli(_i64(b), _i64(i32_const(H * D * 2)))
        groups = []
        for i in range(H * D // 8 // 256):  # 8-channel group g = tid + 256 i: row g // 64, channels 8 (g % 64) + ...
            g = arith.addi(tid, i32_const(256 * i))
            groups.append((g, _load(g_ptr, arith.addi(base, _i64(arith.muli(g, i32_const(16)))),
                                    ir.VectorType.get((4,), i32), 16)))
        for g, vals in groups:
            words = [llvm.extractelement(vals, arith.constant(i32, c)) for c in range(4)]  # channels (2c, 2c + 1)
            # PERM8's pairs (3, 7), (2, 6), (1, 5), (0, 4): the odd channels are the words' upper halves
            pairs = [mgpu_utils.inline_ptx(f"prmt.b32 $0, $1, $2, {sel:#06x};", words[lo], words[lo + 2],
                                           result_types=i32)
                     for lo, sel in ((1, 0x7632), (1, 0x5410), (0, 0x7632), (0, 0x5410))]
            row, u = arith.divui(g, i32_const(D // 8)), arith.remui(g, i32_const(D // 8))
            half = arith.divui(u, i32_const(HALF // 8))
            col = arith.muli(arith.remui(u, i32_const(HALF // 8)), i32_const(8))
            _store16(s_ptr, _smem_offset(0, half, row, col), pairs)

    return load


_CLUSTER_SYNC = "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;"
# setmaxnreg per warpgroup (scores, values, decoder). The launch holds 168 a thread (64K over 384 threads, in steps
# of 8), 504 x 128 in all: an increase past what the others gave back waits forever (232 / 208 / 72 hung the call,
# forty-fourth session). ptxas compiles each warpgroup's code at its count (232 / 192 / 80 spills 128 B in warpgroup
# 1, 224 / 208 / 72 none: no faster, docs/BENCHMARKS.md) but checks an instruction's registers against the launch's:
# with a fourth warpgroup (128 at launch) a wgmma with a [64, 256] f32 accumulator (158 needed) does not compile.
REGISTERS = (232, 192, 80)


@functools.cache
def _cluster_syncs(count: int):
    """inline_mgpu: `count` cluster barriers (release / acquire), as `_store_merged` meets its cluster: a
    warpgroup with no rows to store (the decoder) must arrive too."""

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        for _ in range(count):
            mgpu_utils.inline_ptx(_CLUSTER_SYNC, has_side_effects=True, convergent=True)

    return sync


LOG2E = math.log2(math.e)


def _ex2(x):
    return mgpu_utils.inline_ptx("ex2.approx.ftz.f32 $0, $1;", x, result_types=ir.F32Type.get())


def _my_rows():
    """(the two accumulator rows this thread holds, i32: 16 warp + r + 8 half; q; warpgroup; whether this thread
    publishes the rows' statistics: warpgroup 0's q = 0 thread, both warpgroups holding the same)."""
    warp, q, r = warpgroup_coords()
    rows = [arith.addi(arith.addi(arith.muli(warp, i32_const(16)), r), i32_const(8 * half)) for half in range(2)]
    wg = arith.shrui(mgpu_utils.thread_idx(), i32_const(7))
    publishes = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, wg, i32_const(0)),
                           arith.cmpi(arith.CmpIPredicate.eq, q, i32_const(0)))
    return rows, q, wg, publishes


def _row_value(v, half):
    """Row `half` of a thread's [64, 8] WGMMA array whose columns all hold the row's value."""
    return llvm.extractelement(v.registers[0, 0, 0, 0, half, 0, 0, 0, 0], arith.constant(ir.IntegerType.get_signless(32), 0))


def _weighted(acc, half, factor):
    """This thread's 64 values of accumulator row `half` (of its two; 32 f32 x 2: columns 8c + 2q + {0, 1}) times
    factor."""
    f = llvm.mlir_undef(ir.VectorType.get((2,), ir.F32Type.get()))
    for j in range(2):
        f = llvm.insertelement(f, factor, arith.constant(ir.IntegerType.get_signless(32), j))
    return [arith.mulf(acc.registers[0, c, 0, 0, half, 0, 0, 0, 0], f) for c in range(HALF // 8)]


def _stage_row(stage, row, q, vals):
    """This thread's values of a row (`_weighted`'s form) into the warpgroup's staging rows (1 KB each, f32 in
    channel order, 16 B chunk k at k ^ (row % 8): no bank conflicts either way) at `stage` (smem pointer), row
    `row` (i32)."""
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    row_off = arith.muli(row, i32_const(HALF * 4))
    for c, vec in enumerate(vals):
        for j in range(2):  # column 8c + 2q + j holds channel 8c + PERM8[2q + j] = 8c + (3 - q) + 4j
            ch = arith.subi(i32_const(8 * c + 3 + 4 * j), q)
            chunk = arith.xori(arith.shrui(ch, i32_const(2)), arith.andi(row, i32_const(7)))
            off = arith.addi(row_off, arith.addi(arith.muli(chunk, i32_const(16)),
                                                 arith.muli(arith.andi(ch, i32_const(3)), i32_const(4))))
            llvm.store(llvm.extractelement(vec, arith.constant(i32, j)), mgpu_utils.getelementptr(stage, [off], i8),
                       alignment=4)


def _staged_moves(stage, n_rows: int, out_row0):
    """After `_stage_row` of rows [0, n_rows) by the warpgroup: [(output row, first channel c, f32 x 4: channels c ..
    c + 3)], a thread's n_rows / 2 moves of 16 B, a warp's 512 contiguous bytes of one row: staged row r is output
    row out_row0 + r (of 512 channels), this warpgroup's 256 of them.

    The accumulator's registers hold 2 channels of a row each, 16 B of a row per 4 threads: stored to global
    memory directly (4-byte scatters once the channels are put back in order) the batch-64 kernel took 41.5 us;
    staged, with q's load moved into the kernel in the same change, 37.5 us (docs/BENCHMARKS.md, twenty-third
    session)."""
    i8, f32 = ir.IntegerType.get_signless(8), ir.F32Type.get()
    mgpu_utils.warpgroup_barrier()
    t = arith.andi(mgpu_utils.thread_idx(), i32_const(127))
    wg = arith.shrui(mgpu_utils.thread_idx(), i32_const(7))
    k = arith.andi(t, i32_const(63))
    moves = []
    for i in range(n_rows // 2):  # rows 2i + t // 64
        row = arith.addi(arith.shrui(t, i32_const(6)), i32_const(2 * i))
        src = arith.addi(arith.muli(row, i32_const(HALF * 4)),
                         arith.muli(arith.xori(k, arith.andi(row, i32_const(7))), i32_const(16)))
        v = llvm.load(ir.VectorType.get((4,), f32), mgpu_utils.getelementptr(stage, [src], i8), alignment=16)
        moves.append((arith.addi(out_row0, row), arith.addi(arith.muli(wg, i32_const(HALF)), arith.muli(k, i32_const(4))),
                      v))
    return moves


def _element(row, ch):
    """Element index (i64) of [row, ch] in rows of D channels."""
    return arith.addi(arith.muli(_i64(row), _i64(i32_const(D))), _i64(ch))


def _store_f32_rows(o, moves):
    """`_staged_moves` into o (gmem f32, rows of D channels), 16 B each."""
    o_ptr = mgpu_utils.memref_ptr(o)
    for row, ch, v in moves:
        llvm.store(v, mgpu_utils.getelementptr(o_ptr, [arith.muli(_element(row, ch), _i64(i32_const(4)))],
                                               ir.IntegerType.get_signless(8)), alignment=16)


# f32 pair -> packed 16-bit pair (round to nearest even), per output element type
_PACK_PTX = {"bf16": "cvt.rn.bf16x2.f32 $0, $2, $1;", "f16": "cvt.rn.f16x2.f32 $0, $2, $1;"}


def _store_unrotated_rows(o, cos, sin, b, moves):
    """`_staged_moves` of sequence b, each channel pair (2p, 2p + 1) = (e, o) turned back by the angle of cos / sin
    f32 [B, D/2] [b, p] ((e c + o s, o c - e s): `gpu_attention.unrotated`), into o (gmem f32, bf16 or f16, rows
    of D channels): the model's output, with no pass of XLA after the kernel."""
    i32, i8, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8), ir.F32Type.get()
    o_ptr, cos_ptr, sin_ptr = (mgpu_utils.memref_ptr(r) for r in (o, cos, sin))
    out_ty = ir.MemRefType(o.type).element_type
    width = 4 if out_ty == ir.F32Type.get() else 2
    pack = _PACK_PTX["bf16" if out_ty == ir.BF16Type.get() else "f16"]
    for row, ch, v in moves:
        pair = arith.addi(arith.muli(_i64(b), _i64(i32_const(D // 2))), _i64(arith.shrui(ch, i32_const(1))))
        c, sn = (_load(ptr, arith.muli(pair, _i64(i32_const(4))), ir.VectorType.get((2,), f32), 8)
                 for ptr in (cos_ptr, sin_ptr))
        x = [llvm.extractelement(v, arith.constant(i32, e)) for e in range(4)]
        turned = []
        for j in range(2):
            cj, sj = (llvm.extractelement(a, arith.constant(i32, j)) for a in (c, sn))
            ev, od = x[2 * j], x[2 * j + 1]
            turned += [arith.addf(arith.mulf(ev, cj), arith.mulf(od, sj)),
                       arith.subf(arith.mulf(od, cj), arith.mulf(ev, sj))]
        if width == 4:
            out = llvm.mlir_undef(ir.VectorType.get((4,), f32))
            for e, t in enumerate(turned):
                out = llvm.insertelement(out, t, arith.constant(i32, e))
        else:
            out = llvm.mlir_undef(ir.VectorType.get((2,), i32))
            for j in range(2):
                out = llvm.insertelement(out, mgpu_utils.inline_ptx(pack, turned[2 * j], turned[2 * j + 1],
                                                                    result_types=i32), arith.constant(i32, j))
        dst = arith.muli(_element(row, ch), _i64(i32_const(width)))
        llvm.store(out, mgpu_utils.getelementptr(o_ptr, [dst], i8), alignment=4 * width)


def _stage_base(smem, rows: int):
    """This warpgroup's staging rows (`_stage_row`) in `smem`: `rows` rows of 1 KB a warpgroup from its start."""
    wg = arith.shrui(mgpu_utils.thread_idx(), i32_const(7))
    return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(smem), [arith.muli(wg, i32_const(rows * HALF * 4))],
                                    ir.IntegerType.get_signless(8))


@functools.cache
def _store_partials():
    """inline_mgpu: (acc f32 [64, 256] WGMMA, m, l f32 [64, 8] WGMMA (every column the row's running max in log2
    units and sum), the keys' smem (free now), o gmem f32 [B, S, 64, 512], m / l gmem f32 [B, S, 64], b, s) ->
    o[b, s, :, this warpgroup's 256 channels] = acc in channel order (staged in the key slots); warpgroup 0 also
    m (in natural-log units), l: the partials `gpu_attention.combine` merges."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 3 + (plgpu.RefType(_TRANSFORMS),) + (plgpu.RefType(),) * 3
                       + (_SPLAT,) * 2)
    def store(ctx, acc, m, l, k_smem, o, m_out, l_out, b, s):
        del ctx
        b, s = (a.registers.item() for a in (b, s))
        seq = arith.addi(arith.muli(b, i32_const(ir.MemRefType(o.type).shape[1])), s)
        rows, q, _, publishes = _my_rows()
        ln2 = arith.constant(ir.F32Type.get(), math.log(2.0))
        with mgpu_utils.when(publishes):
            for half, row in enumerate(rows):
                memref.store(arith.mulf(_row_value(m, half), ln2), m_out, [index_of(x) for x in (b, s, row)])
                memref.store(_row_value(l, half), l_out, [index_of(x) for x in (b, s, row)])
        shift = arith.constant(ir.F32Type.get(), 2.0 ** KEY_SHIFT)
        stage = _stage_base(k_smem, H)
        _named_barrier("sync", _CTA_BARRIER)  # both done with the keys
        for half, row in enumerate(rows):
            _stage_row(stage, row, q, _weighted(acc, half, shift))
        _store_f32_rows(o, _staged_moves(stage, H, arith.muli(seq, i32_const(H))))

    return store


@functools.cache
def _store_merged(rotated: bool, splits: int, stamp_at: int | None = None, exchange: bool = True):
    """inline_mgpu: (acc, m, l as `_store_partials`, the keys' and q's smem (free now), stats smem f32 [MAX_SPLITS,
    2, 64], sink f32 [64] (natural-log units), [rotated: cos, sin f32 [B, 256]], o gmem [B, 64, 512], b, s) -> o[b] =
    the softmax-weighted sum over the cluster's S key ranges (S divides 64) with the sink, in channel order (f32;
    rotated: unrotated by cos / sin and cast to o's type, `_store_unrotated_rows`).

    The S CTAs of a sequence are one cluster. Each publishes its rows' (m, l) in stats[s] of every CTA of the
    cluster (warpgroup 0, both hold the same; st.shared::cluster: until the thirty-eighth session through global
    memory, a round trip to L2 after the barrier), all meet (a cluster barrier: release / acquire; every CTA's key
    slots are free from here), and
    each weighs its accumulator by exp2(m_s - M) / (sum_s' l_s' exp2(m_s' - M) + exp2(sink - M)), M the largest of
    the m_s' and the sink (`gpu_attention.combine`'s weights). CTA s owns rows [s R, s R + R), R = 64 / S: the
    others' weighted rows go to their owner's key slots through distributed shared memory (st.shared::cluster,
    16 B a store, in register order: each thread's values land where the same thread of the owner reads them),
    all meet again, and each owner adds them to its own, stages its rows and stores them once. Until the thirty-eighth session
    range 0 stored all 64 rows and the others added theirs with red.global.add after a second barrier.

    stamp_at: with a timeline (two more arguments: its gmem, the CTA's row), its points stamp_at, + 1, + 2 after
    the statistics' barrier, the rows' exchange and the staging (`timeline_groups`). exchange=False (an ablation,
    wrong output): the rows are neither sent nor added, the barriers kept."""
    timed = stamp_at is not None

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 3 + (plgpu.RefType(_TRANSFORMS),) * 2
                       + (plgpu.RefType(),) * (5 if rotated else 3) + (_SPLAT,) * 2
                       + ((plgpu.RefType(), _SPLAT) if timed else ()))
    def store(ctx, acc, m, l, k_smem, q_smem, stats, sink, *refs):
        del ctx
        refs, (tl, tl_row) = (refs[:-2], refs[-2:]) if timed else (refs, (None, None))
        cos, sin, o, b, s = refs if rotated else (None, None, *refs)
        i32, i8, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8), ir.F32Type.get()
        b, s = (a.registers.item() for a in (b, s))

        def stamp(k):  # point stamp_at + k, from thread 0 (warpgroup 0)
            if timed:
                gpu_timeline.emit_stamp(tl, tl_row.registers.item(), i32_const(stamp_at + k))
        own_rows = H // splits
        rows, q, wg, publishes = _my_rows()
        stats_ptr = mgpu_utils.memref_ptr(stats)
        stat_offset = lambda j, kind, row: arith.muli(arith.addi(  # noqa: E731
            arith.muli(arith.addi(arith.muli(j, i32_const(2)), i32_const(kind)), i32_const(H)), row), i32_const(4))
        with mgpu_utils.when(publishes):
            for j in range(splits):
                remote = mgpu_utils.get_cluster_ptr(stats_ptr, i32_const(j), generic=False)
                for half, row in enumerate(rows):
                    for kind, v in enumerate((m, l)):
                        llvm.store(_row_value(v, half), mgpu_utils.getelementptr(remote, [stat_offset(s, kind, row)], i8),
                                   alignment=4)
        mgpu_utils.inline_ptx(_CLUSTER_SYNC, has_side_effects=True, convergent=True)
        stamp(0)
        recv = mgpu_utils.memref_ptr(k_smem)

        def recv_offset(sender, row, k):  # f32 x 4 [S - 1 senders, 2 warpgroups, 16 k, R rows, 4 q] in the owner:
            idx = sender  # column groups 2k and 2k + 1 of a thread in one 16 B store, a warp's 512 B contiguous
            for stride, term in ((2, wg), (HALF // 16, i32_const(k)), (own_rows, row), (4, q)):
                idx = arith.addi(arith.muli(idx, i32_const(stride)), term)
            return arith.muli(idx, i32_const(16))

        vec4 = ir.VectorType.get((4,), f32)

        mine = []
        for half, row in enumerate(rows):
            ms, ls = ([llvm.load(f32, mgpu_utils.getelementptr(stats_ptr, [stat_offset(i32_const(j), kind, row)], i8),
                                 alignment=4) for j in range(splits)] for kind in range(2))
            sk = arith.mulf(memref.load(sink, [index_of(row)]), arith.constant(f32, LOG2E))
            top = sk
            for v in ms:
                top = arith.maximumf(top, v)
            den = _ex2(arith.subf(sk, top))
            for mv, lv in zip(ms, ls):
                den = arith.addf(den, arith.mulf(lv, _ex2(arith.subf(mv, top))))
            own = _ex2(arith.subf(_row_value(m, half), top))
            vals = _weighted(acc, half, arith.mulf(arith.divf(own, den), arith.constant(f32, 2.0 ** KEY_SHIFT)))
            owner, local = arith.divui(row, i32_const(own_rows)), arith.remui(row, i32_const(own_rows))
            is_mine = arith.cmpi(arith.CmpIPredicate.eq, owner, s)
            if splits > 1 and exchange:
                with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ne, owner, s)):
                    sender = arith.subi(s, arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ugt, s, owner)))
                    remote = mgpu_utils.get_cluster_ptr(recv, owner, generic=False)
                    for k in range(HALF // 16):  # two column groups a store (half the 8 B stores' count)
                        pair = vector.shuffle(vals[2 * k], vals[2 * k + 1], [0, 1, 2, 3])
                        llvm.store(pair, mgpu_utils.getelementptr(remote, [recv_offset(sender, local, k)], i8),
                                   alignment=16)
            mine.append((is_mine, local, vals))
        if splits > 1:
            mgpu_utils.inline_ptx(_CLUSTER_SYNC, has_side_effects=True, convergent=True)  # the others' rows are here
        stamp(1)
        stage = _stage_base(q_smem if splits > 1 else k_smem, own_rows)  # q: 64 KB, R rows for both warpgroups
        for is_mine, local, vals in mine:
            with mgpu_utils.when(is_mine):
                for sender in range(splits - 1 if exchange else 0):
                    got = [llvm.load(vec4, mgpu_utils.getelementptr(recv, [recv_offset(i32_const(sender), local, k)],
                                                                    i8), alignment=16) for k in range(HALF // 16)]
                    vals = [arith.addf(v, vector.shuffle(got[c // 2], got[c // 2], [2 * (c % 2), 2 * (c % 2) + 1]))
                            for c, v in enumerate(vals)]
                _stage_row(stage, local, q, vals)
        moves = _staged_moves(stage, own_rows, arith.addi(arith.muli(b, i32_const(H)), arith.muli(s, i32_const(own_rows))))
        stamp(2)
        if rotated:
            _store_unrotated_rows(o, cos, sin, b, moves)
        else:
            _store_f32_rows(o, moves)

    return store


# The dispatch (`kernels_pallas.sparse_attention_decode`) takes this kernel from MIN_BATCH sequences on. H200,
# 128K entries, from HBM, against the dispatch's Triton tiles (docs/BENCHMARKS.md, twenty-third session): batch 64
# 47.3 / 85.1 us, 32: 31.3 / 62.0, 16: 25.7 / 39.1, 8: 20.4 / 34.4, 4: 18.5 / 25.8, 2: 17.5 / 22.7; at batch 1 a
# tie then (18.0 / 17.8). Merged in clusters (twenty-fourth session): batch 64 44.3 / 84.6, 16 (5 ranges) 26.3 / 38.9.
# Batch 1 since (fifty-ninth session, H100, the model's call with bf16 q and out, MIN_BATCH 2 and 1 twice in one
# run, `issue21_timeline batch1`): 21.1-21.2 us with the Triton kernel, 11.8 with this one and its combine, the
# same error against the twin (1.7e-3: the bf16 output's rounding, not the Triton kernel's float16 operands).
# So every batch takes it; the threshold stays as the switch the device A/Bs set (`issue21_timeline batch1`,
# `issue12_decode`'s ATTENTION_OFF).
MIN_BATCH = 1


def supported(q_bhd: jax.Array, window_values: jax.Array, entry_values: jax.Array) -> bool:
    """True when `sparse_attention_decode` can run this kernel: 64 heads x 512 channels, a window of whole
    64-key tiles, an H100/H200."""
    _, h, d = q_bhd.shape
    return (h == H and d == D and window_values.shape[1] % T == 0 and entry_values.shape[-1] * 2 == D
            and gpu_wgmma.is_hopper())


# Up to MAX_SPLITS key ranges (1, 2, 4 or 8: each owns 64 / S output rows) a sequence's CTAs can be one cluster
# merging in the kernel (`_store_merged`, the largest portable cluster); by default only up to MERGED_SPLITS are,
# more write partials that `gpu_attention.combine` merges after the kernel. H200, 128K entries, from HBM, one call
# (docs/BENCHMARKS.md, twenty-fifth session, when range 0 stored and the others added with red.global.add): batch
# 64, 2 ranges: 44.2 us merged, 46.4 partials; batch 32, 4 ranges: 48.0 merged, 30.9 partials (clusters of 4 do
# not all fit one wave of SMs); batch 16, 5 ranges: 26.0 merged, 25.5 partials. The merge through distributed
# shared memory (thirty-eighth session) is timed at batch 64 only.
MAX_SPLITS = 8
MERGED_SPLITS = 2


# A CTA holds ~205 KB of shared memory and 1 KB of entry ids per tile of its range (`_load_ids`), of the 227 KB
# an H100 / H200 CTA may: at most this many tiles a range (1024 keys; the released top-k and window make 10)
MAX_TILES_PER_RANGE = 16


def default_splits(b: int, tiles: int, sms: int = 132) -> int:
    """Key ranges per sequence for `tiles` key tiles: as many as keep one wave of CTAs (one fits an SM), at most
    one per tile (none empty), and no more than the tiles' count per range needs; at least as many as keep a
    range within MAX_TILES_PER_RANGE."""
    splits = max(1, min(tiles, sms // b), -(-tiles // MAX_TILES_PER_RANGE))
    return -(-tiles // -(-tiles // splits))


# "decode1" / "decode2": one decoder's rows left undecoded; "rows": the entry rows loaded for the first tile alone
# (later tiles decode those registers again)
ABLATIONS = ("prefetch", "decode", "decode1", "decode2", "rows", "qk", "pv", "store", "exchange")


MERGE_POINTS = ("merge stats", "merge rows", "merge staged")


def timeline_groups(tiles: int) -> dict[str, list[str]]:
    """A CTA's points when timed (`gpu_timeline`), per warpgroup in the timeline's column order, for ranges of
    `tiles` key tiles. Warpgroup 0 (its thread 0): its start, q in shared memory, the first tile decoded, then per
    tile its logits (with the softmax and the wait for warpgroup 1's p . v of the tile before) and its p . v done
    (with the wait for the next tile's keys), every tile done, a merged cluster's MERGE_POINTS (the statistics'
    barrier, the rows' exchange, the staging; stamped with "tiles" where there is no merge), its rows stored.
    Warpgroup 1 (thread 128): its
    start, q loaded, tile 0 decoded, then per tile i the decode of tile i + 1 (with the wait for its slot and its
    rows), the wait for p, its p . v, then the wait for the rows' statistics and its rows stored. Warpgroup 2
    (thread 256): its start, then each tile decoded (with the waits), then its part of the merge's barriers. A
    range with fewer tiles stamps its missing tiles' points after its last (phases of 0)."""
    return {"warpgroup 0": ["start", "query", "first tile",
                            *[f"{name} {i}" for i in range(tiles) for name in ("logits", "p.v")], "tiles",
                            *MERGE_POINTS, "stored"],
            "warpgroup 1": ["start", "query", "decode 0",
                            *[f"{name} {j}" for i in range(tiles)
                              for name, j in (("decode", i + 1), ("p wait", i), ("p.v", i))], "stats", "stored"],
            "warpgroup 2": ["start", *[f"decode {i}" for i in range(tiles + 1)], "merged"]}


def timeline_names(tiles: int) -> list[str]:
    """Every column's point but the SM id's, `timeline_groups`' lists one after the other."""
    return [name for names in timeline_groups(tiles).values() for name in names]


@functools.partial(jax.jit, static_argnames=("scale", "splits", "merged", "skip", "out_dtype", "timeline"))
def sparse_attention_wgmma(q_bhd, window_values, window_scales, window_valid, entry_values, entry_scales, idx_bk,
                           sink_h, scale: float, *, splits: int | None = None, merged: bool | None = None,
                           skip: tuple[str, ...] = (), unrotate=None, out_dtype=jnp.float32, timeline: bool = False):
    """f32 [B, 64, 512] (`gpu_attention.sparse_attention`'s contract). Window records u8 [B, W, 512] + E8M0
    u8 [B, W, 16] with W % 64 == 0 and validity [B, W]; entries u8 [B, N, 256] + E4M3 u8 [B, N, 32] gathered
    by idx_bk int32 [B, K] (-1: none); sink_h [64]; scale: the logit scale. splits: key ranges per sequence
    (default `default_splits`; range s takes tiles s, s + splits, ...). merged: the ranges as one cluster
    merging in the kernel (1, 2, 4 or 8 of them), or partials merged by `gpu_attention.combine` (default: merged
    up to MERGED_SPLITS). skip: parts
    of ABLATIONS left out, for benchmarks that time the rest (the output is then wrong, but for the prefetch).
    unrotate, out_dtype: as `gpu_attention.sparse_attention`'s (partials merged and turned by
    `gpu_attention.combine_unrotated`). timeline: also return each CTA's `timeline_names(tiles per range)` points
    (`gpu_timeline`: u32 [B * splits, points + 1], CTA b * splits + range)."""
    if set(skip) - set(ABLATIONS):
        raise ValueError(f"skip takes parts of {ABLATIONS}, got {skip}")
    b, h, d = q_bhd.shape
    w, k, n = window_values.shape[1], idx_bk.shape[1], entry_values.shape[1]
    if (h, d) != (H, D) or w % T or window_values.shape != (b, w, D) or window_scales.shape != (b, w, D // WINDOW_GROUP):
        raise ValueError(f"the wgmma attention needs q [B, {H}, {D}] and a window [B, W % {T} == 0, {D}] + "
                         f"[B, W, {D // WINDOW_GROUP}]; got q {q_bhd.shape}, window {window_values.shape} / "
                         f"{window_scales.shape}")
    if entry_values.shape != (b, n, D // 2) or entry_scales.shape != (b, n, D // ENTRY_GROUP):
        raise ValueError(f"entries must be [B, N, {D // 2}] + [B, N, {D // ENTRY_GROUP}]; got {entry_values.shape} / "
                         f"{entry_scales.shape}")
    kp = -(-k // T) * T
    idx = idx_bk.astype(jnp.int32)
    idx = idx if kp == k else jnp.pad(idx, ((0, 0), (0, kp - k)), constant_values=-1)
    n_wt, n_t = w // T, (w + kp) // T
    splits = splits or default_splits(b, n_t)
    if splits < 1:
        raise ValueError(f"splits={splits}: a sequence needs at least one key range")
    merged = splits <= MERGED_SPLITS if merged is None else merged
    if merged and (splits > MAX_SPLITS or H % splits):
        raise ValueError(f"splits={splits}: merged in the kernel, a sequence's ranges are one cluster of at most "
                         f"{MAX_SPLITS} CTAs, each owning {H} / splits rows of the output (1, 2, 4 or 8 ranges); "
                         "pass merged=False")
    rotated = merged and unrotate is not None  # the merge turns the pairs back and casts in the kernel
    if rotated and jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"out_dtype={jnp.dtype(out_dtype)}: the merged kernel writes float32, bfloat16 or float16")
    per = -(-n_t // splits)
    if per > MAX_TILES_PER_RANGE:
        raise ValueError(f"{n_t} key tiles in {splits} range(s) make {per} a range, more than the "
                         f"{MAX_TILES_PER_RANGE} whose entry ids fit in shared memory (`_load_ids`); pass "
                         f"splits >= {-(-n_t // MAX_TILES_PER_RANGE)}")
    c = scale * 2.0 ** KEY_SHIFT * LOG2E  # logits in log2 units from q . (keys x 2**-KEY_SHIFT)

    def body(q_gmem, wv, ws, wok, ev, es, idx_gmem, *refs):
        if merged:
            sink_gmem, *refs = refs
            turn, refs = (refs[:2], refs[2:]) if rotated else ((), refs)
            o_gmem, *refs = refs
        else:
            o_gmem, m_gmem, l_gmem, *refs = refs
        tl_gmem, q_smem, k_smem, masks, p_smem, rows_smem, stats_smem, ids_smem = refs if timeline else (None, *refs)
        seq, part, wg = lax.axis_index("b"), lax.axis_index("s"), lax.axis_index("wg")
        wait, arrive = _barrier(True, 256), _barrier(False, 256)  # warpgroups 0 and 1
        wait3, arrive3 = _barrier(True, 384), _barrier(False, 384)  # all three: the key slots
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        first = np.cumsum([0] + [len(v) for v in timeline_groups(per).values()])  # each warpgroup's first column

        def stamp(point, group=0):  # from warpgroup `group`'s first thread
            gpu_timeline.stamp(tl_gmem, seq * splits + part, first[group] + point, thread=128 * group)

        def missing(group, at, points, done):  # a shorter range's missing tiles' points at, at + 1, ...: now
            for i in range(points if timeline else 0):
                pl.when(i >= done)(lambda i=i: stamp(at + i, group))

        for group in range(3):
            stamp(0, group)
        count = (n_t - part + splits - 1) // splits  # its tiles: part + splits i, i < count (tile_of)
        tile_of = lambda i: part + i * splits  # noqa: E731

        merge_inputs = (sink_gmem, *turn) if merged else ()  # prefetched with the late tiles
        prefetch = lambda early: None if "prefetch" in skip else _prefetch(  # noqa: E731
            n, w, n_wt, n_t, splits, early, 0 if early else len(merge_inputs))(
            ev, es, idx_gmem, wv, ws, q_gmem, *(() if early else merge_inputs), seq, part)

        @pl.when(wg < 2)
        def _():
            prefetch(True)
            _load_query()(q_gmem, q_smem, seq)  # each of the two fences its own writes before the wgmmas see them

        pl.when(wg == 0)(lambda: prefetch(False))  # once q is in: the burst before was q and the first tiles

        stamp(1)
        stamp(1, 1)

        # warpgroups 1 and 2: their rows of tile i into `slot` (an entry tile from raw, its rows as `load` gave
        # them), once warpgroup 0 is done with the slot if `after`
        def decode(i, slot, after, raw, group):
            t, after = tile_of(i), jnp.asarray(after, jnp.int32)
            if "decode" in skip or f"decode{group}" in skip:
                pl.when(after != 0)(lambda: wait3(SLOT_FREE + slot))
                plgpu.commit_smem()  # q
                arrive3(KEYS_READY + slot)
                return

            @pl.when(t < n_wt)
            def _():
                _decode_window()(k_smem, masks, wv, ws, wok, seq, slot, after, t * T)

            @pl.when(t >= n_wt)
            def _():
                _decode_entries()(k_smem, masks, *raw, slot, after)

        # warpgroups 1 and 2: their rows of entry tile i; past the last tile that one's again (in L2, unused), and
        # for a window tile entry tile 0's (unused)
        def load(i):
            return _load_entries(n)(ev, es, ids_smem, seq, jnp.clip(i, 0, count - 1))

        def start_decoding(group, point):  # warpgroup 1 or 2: its registers, its ids, tile 0; -> tile 1's rows
            plgpu.set_max_registers(REGISTERS[group], action="increase" if group == 1 else "decrease")
            _load_ids(n_wt, per, splits)(idx_gmem, ids_smem, seq, part)
            raw = load(0)
            pl.when(count > 0)(lambda: decode(0, 0, 0, raw, group))
            stamp(point, group)
            return raw if "rows" in skip else load(1)

        def decode_next(i, slot, raw, group, point):  # in tile i's (slot's) iteration: tile i + 1 from raw; -> tile
            pl.when(i + 1 < count)(lambda: decode(i + 1, 1 - slot, i > 0, raw, group))  # i + 2's rows
            stamp(point, group)
            return raw if "rows" in skip else load(i + 2)  # lands during this iteration's other work

        def pv(acc, a, slot, half):
            def run(acc_ref):
                if "pv" not in skip:
                    plgpu.wgmma(acc_ref, a, k_smem.at[slot, half])
            return pl.run_state(run)(plgpu.ACC.init(acc))

        def finish(acc, m, l):  # warpgroups 0 and 1; warpgroup 0 stamps the merge's points
            wide = lambda v: lax.broadcast_in_dim(v, (H, 8), [0])
            merge_points = 4 + 2 * per  # after "tiles"
            if "store" in skip or not merged:
                for k in range(len(MERGE_POINTS)):
                    stamp(merge_points + k)
            if "store" in skip:
                return
            if merged:
                timed = (tl_gmem, seq * splits + part) if timeline else ()
                _store_merged(rotated, splits, merge_points if timeline else None, "exchange" not in skip)(
                    acc, wide(m), wide(l), k_smem, q_smem, stats_smem, sink_gmem, *turn, o_gmem, seq, part, *timed)
            else:
                _store_partials()(acc, wide(m), wide(l), k_smem, o_gmem, m_gmem, l_gmem, seq, part)

        acc0 = plgpu.layout_cast(jnp.zeros((H, HALF), jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(wg == 0)
        def _scores():  # the logits, the softmax and p . keys[:, :256]; p and its rows' rescale to warpgroup 1
            plgpu.set_max_registers(REGISTERS[0], action="increase")
            plgpu.commit_smem()  # its part of q, for the wgmmas
            pl.when(count > 0)(lambda: wait3(KEYS_READY))
            stamp(2)

            def tile(i, carry):
                acc, m, l = carry
                slot = i % 2

                def qk(acc_ref):
                    for hf in range(0 if "qk" in skip else 2):
                        plgpu.wgmma(acc_ref, q_smem.at[hf], k_smem.at[slot, hf].transpose((1, 0)))

                s = pl.run_state(qk)(plgpu.ACC.init(_bias()(masks, slot))) * c
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p = p.astype(jnp.bfloat16)
                pl.when(i > 0)(lambda: wait(P_FREE))  # warpgroup 1 is done with the last tile's p
                p_smem[...] = p
                rows_smem.at[0][...] = alpha
                plgpu.commit_smem()
                arrive(P_READY)
                stamp(3 + 2 * i)
                acc = pv(acc, p, slot, 0)
                pl.when(i + 2 < count)(lambda: arrive3(SLOT_FREE + slot))  # tile i + 2 may take the slot
                pl.when(i + 1 < count)(lambda: wait3(KEYS_READY + 1 - slot))
                stamp(4 + 2 * i)
                return acc, m_new, l

            m = plgpu.layout_cast(jnp.full((H,), gpu_attention.M_FLOOR, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((H,), jnp.float32), row_layout)
            acc, m, l = lax.fori_loop(0, count, tile, (acc0, m, l))
            rows_smem.at[1][...] = m
            rows_smem.at[2][...] = l
            arrive(STATS_READY)
            missing(0, 3, 2 * per, 2 * count)
            stamp(3 + 2 * per)
            finish(acc, m, l)
            stamp(4 + 2 * per + len(MERGE_POINTS))

        @pl.when(wg == 1)
        def _values():  # every tile's rows 0..31, a tile ahead; p . keys[:, 256:] with warpgroup 0's p
            raw = start_decoding(1, 2)

            def tile(i, carry):
                acc, raw = carry
                slot = i % 2
                raw = decode_next(i, slot, raw, 1, 3 + 3 * i)
                wait(P_READY)
                stamp(4 + 3 * i, 1)
                acc = acc * lax.broadcast_in_dim(plgpu.load(rows_smem.at[0], layout=row_layout), acc.shape, [0])
                acc = pv(acc, p_smem, slot, 1)
                pl.when(i + 1 < count)(lambda: arrive(P_FREE))
                stamp(5 + 3 * i, 1)
                return acc, raw

            acc, _ = lax.fori_loop(0, count, tile, (acc0, raw))
            missing(1, 3, 3 * per, 3 * count)
            wait(STATS_READY)
            stamp(3 + 3 * per, 1)
            finish(acc, *(plgpu.load(rows_smem.at[i], layout=row_layout) for i in (1, 2)))
            stamp(4 + 3 * per, 1)

        @pl.when(wg == 2)
        def _decoder():  # every tile's rows 32..63, a tile ahead; the merge's cluster barriers with the others
            lax.fori_loop(0, count, lambda i, raw: decode_next(i, i % 2, raw, 2, 2 + i), start_decoding(2, 1))
            missing(2, 2, per, count)
            if merged and "store" not in skip:
                _cluster_syncs(2 if splits > 1 else 1)()
            stamp(2 + per, 2)

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    rows = gpu_attention.partial_rows(splits, unrotate)
    timed = (jax.ShapeDtypeStruct((b * splits, len(timeline_names(per)) + 1), jnp.uint32),) if timeline else ()
    out = jax.ShapeDtypeStruct((b, H, D), out_dtype if rotated else jnp.float32)
    launch = (dict(out_type=(out, *timed), grid=(b,), grid_names=("b",),
                   cluster=(splits,), cluster_names=("s",)) if merged else
              dict(out_type=(f32(b, rows, H, D), f32(b, rows, H), f32(b, rows, H), *timed), grid=(b, splits),
                   grid_names=("b", "s")))
    kernel = plgpu.kernel(
        body,
        **launch,
        num_threads=3,
        thread_name="wg",
        scratch_types=(plgpu.SMEM((2, H, HALF), jnp.bfloat16, transforms=_TRANSFORMS),
                       plgpu.SMEM((2, 2, T, HALF), jnp.bfloat16, transforms=_TRANSFORMS),
                       plgpu.SMEM((2, 8), jnp.uint32),  # the slots' validity words (`_publish_validity`)
                       plgpu.SMEM((H, T), jnp.bfloat16, transforms=_TRANSFORMS),  # p, warpgroup 0 -> 1
                       plgpu.SMEM((3, H), jnp.float32),  # rows' rescale (per tile), then m and l
                       plgpu.SMEM((MAX_SPLITS, 2, H), jnp.float32),  # the merge's (m, l) of every range
                       plgpu.SMEM((per, 256), jnp.int32)),  # the decoders' entry ids, `_load_ids`
        kernel_name="sparse_attention_wgmma",
    )
    args = (q_bhd.astype(jnp.bfloat16), window_values, window_scales, window_valid.astype(jnp.bool_), entry_values,
            entry_scales, idx)
    sink = sink_h.astype(jnp.float32)
    if merged:
        outs = kernel(*args, sink, *(jnp.asarray(a, jnp.float32) for a in (unrotate if rotated else ())))
        out = outs[0]
    else:
        outs = kernel(*args)
        out = gpu_attention.merge_partials(outs[:3], sink, splits=splits, h=H, unrotate=unrotate, out_dtype=out_dtype)
    return (out, outs[-1]) if timeline else out

