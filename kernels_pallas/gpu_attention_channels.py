"""Sparse attention for many decode sequences, each sequence's pair of CTAs split by output channels (issue 21).

The contract of `gpu_attention_wgmma.sparse_attention_wgmma` (and its numbers: keys exact in bf16 as value x
2**-KEY_SHIFT, q and p rounded to bf16), for the released head shape, 64 heads x 512 channels, K = V. That
kernel splits a sequence's keys between the two CTAs of a cluster and merges their [64, 512] partial outputs at
its end: on an H100 at batch 64 the merge took ~6 of its 24 us (docs/BENCHMARKS.md, fifty-fourth session), and
each CTA loaded all of q (64 KB) before its first tile. Here CTA c of a sequence's cluster of two owns output
channels [256c, 256c + 256) of every key tile instead:
- q: its half of each head's channels (32 KB; `_load_query(split=True)`);
- each tile's keys: its half of the channels, decoded by warpgroups 1 and 2 into one of SLOTS bf16 [64 keys,
  256] slots (`_decode_entries` / `_decode_window(split=True)`), a tile ahead of warpgroup 0;
- warpgroup 0: the partial logits q[:, half] . keys[:, half]^T (one wgmma of K = 256), sent to the peer by
  st.async counted on its mbarrier, the peer's received alike and added (`_exchange`: f32 addition commutes, so
  both CTAs hold the same logits bit for bit, and compute the same softmax), the validity bias, the online softmax
  (exp2), p (bf16) and the rows' rescale into shared memory for warpgroup 1 (two slots: it runs a tile ahead);
- warpgroup 1: a [64 heads, 256] f32 accumulator of p . keys[:, half] (besides its half of the decode); at the
  end it weighs its rows by the sink and the sum (`gpu_attention.combine`'s weights with one range) and stores
  its channels of every row (`_store_channels`; unrotated and cast as the wgmma kernel's merge).
No merge: the two CTAs' outputs are disjoint channels. Each tile costs a 16 KB exchange of partial logits through
distributed shared memory; the softmax runs in both CTAs over every tile.

Hand-offs as in the wgmma kernel (named barriers, one side arriving, the other waiting), ids from 4 (0 is Mosaic
GPU's CTA barrier, 1..3 its warpgroups'): keys ready and slot free (one per slot, all three warpgroups), p ready
and p free (one per p slot, warpgroups 0 and 1), the rows' statistics. The logits' receive slots need no "free"
barrier: a CTA sends tile i + 1's logits only after it has read tile i's, so the peer's tile i + 2 (same slot)
comes after that read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import gpu_attention_wgmma as att
from kernels_pallas.gpu_wgmma import i32_const, index_of

H, D, HALF, T = att.H, att.D, att.HALF, att.T
SLOTS = 3  # key slots: warpgroup 1's p . v of tile i, warpgroup 0's logits of i + 1, the decode of i + 2
KEYS_READY, SLOT_FREE, P_READY, P_FREE, STATS_READY = 4, 4 + SLOTS, 4 + 2 * SLOTS, 6 + 2 * SLOTS, 8 + 2 * SLOTS
# setmaxnreg per warpgroup (logits, values, decoder): 504 x 128 in all (`att.REGISTERS`); warpgroup 1 holds the
# [64, 256] accumulator (128 a thread) and decodes
REGISTERS = (136, 232, 136)
LOGITS_BYTES = H * T * 4  # a tile's partial logits, f32 [64, 64]
# Key tiles a sequence may have: its entry ids take 1 KB of shared memory a tile (`_load_ids`) beside ~181 KB
# (2 receive slots) or ~213 KB (4, `ahead`), of the 227 KB a CTA may hold
MAX_TILES = 32
MAX_TILES_AHEAD = 14
# The dispatch (`kernels_pallas.sparse_attention_decode`) takes this kernel from MIN_BATCH sequences on (two CTAs a
# sequence: at batch 64, 128 of the 132 SMs)
MIN_BATCH = 32

_SPLAT = plgpu.Layout.WG_SPLAT(shape=())
_MAPA = "mapa.shared::cluster.u32 $0, $1, $2;"
_ST_ASYNC = "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [$0], {$1, $2, $3, $4}, [$5];"
_EXPECT = "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"
_WAIT_PARITY = ("{ .reg .pred p; LAB_WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; @p bra DONE; "
                "bra LAB_WAIT; DONE: }")


def _u32(ref, offset=0):
    """shared::cta address (u32) of a shared-memory ref, plus `offset` bytes (an int or i32 value)."""
    off = i32_const(offset) if isinstance(offset, int) else offset
    return arith.addi(llvm.ptrtoint(ir.IntegerType.get_signless(32), mgpu_utils.memref_ptr(ref)), off)


@functools.cache
def _init_barriers(slots: int):
    """inline_mgpu (warpgroup 0, at the start): (barriers smem) -> its first thread initializes the receive slots'
    mbarriers for one arrival each and fences the inits for the cluster (every thread then arrives at the cluster
    barrier, `_cluster_arrive`, and waits there before the peer's barriers are used, `_cluster_wait`)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, bars):
        del ctx
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), i32_const(0))):
            for slot in range(slots):
                mgpu_utils.inline_ptx("mbarrier.init.shared::cta.b64 [$0], 1;", _u32(bars, 8 * slot),
                                      has_side_effects=True)
            mgpu_utils.inline_ptx("fence.mbarrier_init.release.cluster;", has_side_effects=True)

    return init


@plgpu.inline_mgpu()
def _cluster_arrive(ctx):
    """Every thread: arrive at the cluster barrier (release: after warpgroup 0's barrier inits)."""
    del ctx
    mgpu_utils.inline_ptx("barrier.cluster.arrive.release.aligned;", has_side_effects=True, convergent=True)


@plgpu.inline_mgpu()
def _cluster_wait(ctx):
    """Every thread, once after `_cluster_arrive`: wait for the whole cluster's arrivals (acquire)."""
    del ctx
    mgpu_utils.inline_ptx("barrier.cluster.wait.acquire.aligned;", has_side_effects=True, convergent=True)


def _slot_parts(i, slots: int):
    """(receive slot i % slots, its mbarrier's phase parity (i // slots) % 2), i32, for tile i."""
    shift = slots.bit_length() - 1
    return (arith.andi(i, i32_const(slots - 1)),
            arith.andi(arith.shrui(i, i32_const(shift)), i32_const(1)))


def _chunk(k, t):
    """Byte offset of thread t's 16 B chunk k (of 8) in a receive slot: a warp's 512 B contiguous."""
    return arith.muli(arith.addi(i32_const(128 * k), t), i32_const(16))


@functools.cache
def _send(slots: int):
    """inline_mgpu (warpgroup 0): (own partial logits f32 [64, 64] WGMMA, receive smem f32 [slots, 64 x 64],
    barriers smem, tile i, peer) -> each thread's 32 values into the peer's receive slot i % slots (8 st.async of
    16 B, in register order: the peer's same thread reads them), counted on the peer's mbarrier of that slot."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(), _SPLAT, _SPLAT))
    def send(ctx, own, recv, bars, i, peer):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i, peer = (a.registers.item() for a in (i, peer))
        slot, _ = _slot_parts(i, slots)
        t = arith.andi(mgpu_utils.thread_idx(), i32_const(127))
        regs = list(own.registers.flat)  # 16 x f32 x 2
        to, to_bar = (mgpu_utils.inline_ptx(_MAPA, a, peer, result_types=i32)
                      for a in (_u32(recv, arith.muli(slot, i32_const(LOGITS_BYTES))),
                                _u32(bars, arith.muli(slot, i32_const(8)))))
        for k in range(len(regs) // 2):
            x = [llvm.extractelement(regs[2 * k + a], arith.constant(i32, j)) for a in range(2) for j in range(2)]
            mgpu_utils.inline_ptx(_ST_ASYNC, arith.addi(to, _chunk(k, t)), *x, to_bar, has_side_effects=True)

    return send


@functools.cache
def _receive(slots: int):
    """inline_mgpu (warpgroup 0): (own partial logits, receive smem, barriers smem, tile i) -> own + the peer's
    partial logits of tile i (`_send`'s): thread 0 arrives at the slot's mbarrier with the 16 KB it expects, all
    wait for its phase, read their values and add them."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(), _SPLAT),
                       return_type=plgpu.ShapeDtypeStruct((H, T), jnp.float32, plgpu.Layout.WGMMA))
    def receive(ctx, own, recv, bars, i):
        del ctx
        i8, f32 = ir.IntegerType.get_signless(8), ir.F32Type.get()
        slot, parity = _slot_parts(i.registers.item(), slots)
        t = arith.andi(mgpu_utils.thread_idx(), i32_const(127))
        regs = list(own.registers.flat)
        base = arith.muli(slot, i32_const(LOGITS_BYTES))
        bar = _u32(bars, arith.muli(slot, i32_const(8)))
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, t, i32_const(0))):
            mgpu_utils.inline_ptx(_EXPECT, bar, i32_const(LOGITS_BYTES), has_side_effects=True)
        mgpu_utils.inline_ptx(_WAIT_PARITY, bar, parity, has_side_effects=True)
        mine = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(recv), [base], i8)
        out = []
        for k in range(len(regs) // 2):
            got = llvm.load(ir.VectorType.get((4,), f32), mgpu_utils.getelementptr(mine, [_chunk(k, t)], i8),
                            alignment=16)
            out += [arith.addf(regs[2 * k + a], vector.shuffle(got, got, [2 * a, 2 * a + 1])) for a in range(2)]
        return mgpu.FragmentedArray(_registers=np.asarray(out, dtype=object).reshape(own.registers.shape),
                                    _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return receive


@functools.cache
def _store_channels(rotated: bool):
    """inline_mgpu (warpgroup 1): (acc f32 [64, 256] WGMMA, m, l f32 [64, 8] WGMMA (every column the row's
    running max in log2 units and sum), the keys' smem (free now: the staging rows), sink f32 [64] (natural-log
    units), [rotated: cos, sin f32 [B, 256]], o gmem [B, 64, 512], b, channel half c) -> o[b, :, 256c:256c + 256] =
    acc x exp2(m - M) / (l exp2(m - M) + exp2(sink - M)), M = max(m, sink) (`gpu_attention.combine` of one range),
    in channel order (f32; rotated: unrotated and cast to o's type), staged and stored as the wgmma kernel's
    merge."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 3 + (plgpu.RefType(att._TRANSFORMS),)
                       + (plgpu.RefType(),) * (4 if rotated else 2) + (_SPLAT,) * 2)
    def store(ctx, acc, m, l, k_smem, sink, *refs):
        del ctx
        cos, sin, o, b, c = refs if rotated else (None, None, *refs)
        f32 = ir.F32Type.get()
        b, c = (a.registers.item() for a in (b, c))
        rows, q, _, _ = att._my_rows()
        stage = mgpu_utils.memref_ptr(k_smem)
        for half, row in enumerate(rows):
            sk = arith.mulf(memref.load(sink, [index_of(row)]), arith.constant(f32, att.LOG2E))
            mv = att._row_value(m, half)
            top = arith.maximumf(sk, mv)
            own = att._ex2(arith.subf(mv, top))
            den = arith.addf(att._ex2(arith.subf(sk, top)), arith.mulf(att._row_value(l, half), own))
            weight = arith.mulf(arith.divf(own, den), arith.constant(f32, 2.0 ** att.KEY_SHIFT))
            att._stage_row(stage, row, q, att._weighted(acc, half, weight))
        moves = att._staged_moves(stage, H, arith.muli(b, i32_const(H)), arith.muli(c, i32_const(HALF)))
        if rotated:
            att._store_unrotated_rows(o, cos, sin, b, moves)
        else:
            att._store_f32_rows(o, moves)

    return store


def supported(q_bhd: jax.Array, window_values: jax.Array, entry_values: jax.Array, idx_bk: jax.Array) -> bool:
    """True when `sparse_attention_decode` takes this kernel: the wgmma kernel's shapes (`att.supported`), at
    least MIN_BATCH sequences, at most MAX_TILES key tiles."""
    tiles = window_values.shape[1] // T + -(-idx_bk.shape[1] // T)
    return q_bhd.shape[0] >= MIN_BATCH and tiles <= MAX_TILES and att.supported(q_bhd, window_values, entry_values)


# Parts `skip` can leave out (an ablation for benchmarks: the output is then wrong)
ABLATIONS = ("exchange", "decode", "qk", "pv")


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype", "ahead", "rows_ahead", "skip"))
def sparse_attention_channels(q_bhd, window_values, window_scales, window_valid, entry_values, entry_scales, idx_bk,
                              sink_h, scale: float, *, unrotate=None, out_dtype=jnp.float32, ahead: bool = False,
                              rows_ahead: int = 1, skip: tuple[str, ...] = ()):
    """f32 [B, 64, 512] (or, with unrotate = (cos, sin) f32 [B, 256], the output turned back by those angles and
    cast to out_dtype: f32, bf16 or f16), `att.sparse_attention_wgmma`'s contract and inputs: window records u8
    [B, W, 512] + E8M0 u8 [B, W, 16] with W % 64 == 0 and validity [B, W]; entries u8 [B, N, 256] + E4M3 u8
    [B, N, 32] gathered by idx_bk int32 [B, K] (-1: none); sink_h [64]; scale: the logit scale. ahead: warpgroup 0
    computes and sends tile i + 1's partial logits before it waits for the peer's of tile i (four receive slots
    instead of two: a CTA may then be three tiles behind its peer's sends). rows_ahead: entry tiles whose rows
    each decoder holds in registers, loaded and not yet decoded (bytes in flight: the decode waits on DRAM's
    latency). skip: parts of ABLATIONS left out."""
    if set(skip) - set(ABLATIONS):
        raise ValueError(f"skip takes parts of {ABLATIONS}, got {skip}")
    if rows_ahead < 1:
        raise ValueError(f"rows_ahead={rows_ahead}: the decoders hold at least the next tile's rows")
    recv_slots = 4 if ahead else 2
    b, w, n, idx, n_wt, n_t = att.checked_tiles(q_bhd, window_values, window_scales, entry_values, entry_scales,
                                                idx_bk)
    most = MAX_TILES_AHEAD if ahead else MAX_TILES
    if n_t > most:
        raise ValueError(f"{n_t} key tiles of {T}: the channel-split kernel holds the entry ids of at most {most} "
                         f"in shared memory{' with ahead=True' if ahead else ''}; use "
                         "`gpu_attention_wgmma.sparse_attention_wgmma`")
    rotated = unrotate is not None
    if rotated and jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"out_dtype={jnp.dtype(out_dtype)}: the kernel writes float32, bfloat16 or float16")
    c = scale * 2.0 ** att.KEY_SHIFT * att.LOG2E  # logits in log2 units from q . (keys x 2**-KEY_SHIFT)
    bars = (SLOT_FREE, KEYS_READY)

    def body(q_gmem, wv, ws, wok, ev, es, idx_gmem, sink_gmem, *refs):
        turn, refs = (refs[:2], refs[2:]) if rotated else ((), refs)
        o_gmem, q_smem, k_smem, masks, p_smem, rows_smem, recv_smem, bars_smem, ids_smem = refs
        seq, half, wg = lax.axis_index("b"), lax.axis_index("c"), lax.axis_index("wg")
        wait, arrive = att._barrier(True, 256), att._barrier(False, 256)  # warpgroups 0 and 1
        wait3, arrive3 = att._barrier(True, 384), att._barrier(False, 384)  # all three: the key slots
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        pl.when(wg == 0)(lambda: _init_barriers(recv_slots)(bars_smem))
        _cluster_arrive()

        def prefetch(early):
            ends = () if early else (sink_gmem, *turn)  # what the store reads last
            att._prefetch(n, w, n_wt, n_t, 1, early, len(ends), split=True)(ev, es, idx_gmem, wv, ws, q_gmem, *ends,
                                                                            seq, jnp.int32(0), half)

        @pl.when(wg < 2)
        def _():
            prefetch(True)
            att._load_query(split=True)(q_gmem, q_smem, seq, half)

        pl.when(wg == 0)(lambda: prefetch(False))

        def decode(i, after, raw):  # warpgroups 1 and 2: their rows of tile i into slot i % SLOTS
            slot, after = i % SLOTS, jnp.asarray(after, jnp.int32)
            if "decode" in skip:
                pl.when(after != 0)(lambda: wait3(SLOT_FREE + slot))
                plgpu.commit_smem()  # q
                arrive3(KEYS_READY + slot)
                return
            pl.when(i < n_wt)(lambda: att._decode_window(True, bars)(k_smem, masks, wv, ws, wok, seq, slot, after,
                                                                     i * T, half))
            pl.when(i >= n_wt)(lambda: att._decode_entries(True, bars)(k_smem, masks, *raw, slot, after))

        def load(i):  # the rows of entry tile i (past the last, the last's again: unused)
            return att._load_entries(n, True)(ev, es, ids_smem, seq, jnp.minimum(i, n_t - 1), half)

        def start_decoding(group):  # -> the rows of tiles 1 .. rows_ahead
            plgpu.set_max_registers(REGISTERS[group], action="increase" if group == 1 else "decrease")
            att._load_ids(n_wt, n_t, 1)(idx_gmem, ids_smem, seq, jnp.int32(0))
            decode(jnp.int32(0), False, load(0))
            return tuple(load(1 + j) for j in range(rows_ahead))

        def decode_next(i, raws):  # in tile i's iteration: tile i + 1 from raws[0] (its slot free once warpgroup 0
            pl.when(i + 1 < n_t)(lambda: decode(i + 1, i + 1 >= SLOTS, raws[0]))  # has read tile i + 1 - SLOTS);
            return (*raws[1:], load(i + 1 + rows_ahead))  # -> the rows of tiles i + 2 .. i + 1 + rows_ahead

        @pl.when(wg == 0)
        def _scores():
            plgpu.set_max_registers(REGISTERS[0], action="decrease")
            plgpu.commit_smem()  # its part of q, for the wgmmas
            _cluster_wait()  # the peer's barriers are initialized
            zero = plgpu.layout_cast(jnp.zeros((H, T), jnp.float32), plgpu.Layout.WGMMA)

            def logits(i):  # once tile i's keys are in: its partial logits, sent, and its bias; the slot given back
                slot = i % SLOTS
                wait3(KEYS_READY + slot)
                bias = att._bias()(masks, slot)

                def qk(acc_ref):
                    if "qk" not in skip:
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))

                own = pl.run_state(qk)(plgpu.ACC.init(zero))
                pl.when(i + SLOTS < n_t)(lambda: arrive3(SLOT_FREE + slot))
                if "exchange" not in skip:
                    _send(recv_slots)(own, recv_smem, bars_smem, i, 1 - half)
                return own, bias

            def softmax(i, own, bias, m, l):  # tile i's logits summed with the peer's; p and the rescale to warpgroup 1
                ps = i % 2
                if "exchange" not in skip:
                    own = _receive(recv_slots)(own, recv_smem, bars_smem, i)
                s = (own + bias) * c
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                pl.when(i >= 2)(lambda: wait(P_FREE + ps))  # warpgroup 1 is done with tile i - 2's p
                p_smem.at[ps][...] = p.astype(jnp.bfloat16)
                rows_smem.at[ps][...] = alpha
                plgpu.commit_smem()
                arrive(P_READY + ps)
                return m_new, l

            m = plgpu.layout_cast(jnp.full((H,), att.gpu_attention.M_FLOOR, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((H,), jnp.float32), row_layout)
            if ahead:  # tile i + 1's logits computed and sent before tile i's are received
                def tile(i, carry):
                    own, bias, m, l = carry
                    nxt = logits(i + 1)
                    return (*nxt, *softmax(i, own, bias, m, l))

                own, bias, m, l = lax.fori_loop(0, n_t - 1, tile, (*logits(0), m, l))
                m, l = softmax(n_t - 1, own, bias, m, l)
            else:
                m, l = lax.fori_loop(0, n_t, lambda i, ml: softmax(i, *logits(i), *ml), (m, l))
            rows_smem.at[2][...] = m
            rows_smem.at[3][...] = l
            arrive(STATS_READY)

        @pl.when(wg == 1)
        def _values():
            raws = start_decoding(1)
            acc0 = plgpu.layout_cast(jnp.zeros((H, HALF), jnp.float32), plgpu.Layout.WGMMA)

            def tile(i, carry):
                acc, raws = carry
                slot, ps = i % SLOTS, i % 2
                raws = decode_next(i, raws)
                wait(P_READY + ps)
                acc = acc * lax.broadcast_in_dim(plgpu.load(rows_smem.at[ps], layout=row_layout), acc.shape, [0])

                def pv(acc_ref):
                    if "pv" not in skip:
                        plgpu.wgmma(acc_ref, p_smem.at[ps], k_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                pl.when(i + 2 < n_t)(lambda: arrive(P_FREE + ps))
                return acc, raws

            acc, _ = lax.fori_loop(0, n_t, tile, (acc0, raws))
            wait(STATS_READY)
            wide = lambda r: lax.broadcast_in_dim(plgpu.load(rows_smem.at[r], layout=row_layout), (H, 8), [0])  # noqa: E731
            _store_channels(rotated)(acc, wide(2), wide(3), k_smem, sink_gmem, *turn, o_gmem, seq, half)
            _cluster_wait()

        @pl.when(wg == 2)
        def _decoder():
            lax.fori_loop(0, n_t, decode_next, start_decoding(2))
            _cluster_wait()

    out = jax.ShapeDtypeStruct((b, H, D), out_dtype if rotated else jnp.float32)
    kernel = plgpu.kernel(
        body,
        out_type=out,
        grid=(b,),
        grid_names=("b",),
        cluster=(2,),
        cluster_names=("c",),
        num_threads=3,
        thread_name="wg",
        scratch_types=(plgpu.SMEM((H, HALF), jnp.bfloat16, transforms=att._TRANSFORMS),  # q[:, half]
                       plgpu.SMEM((SLOTS, T, HALF), jnp.bfloat16, transforms=att._TRANSFORMS),  # keys[:, half]
                       plgpu.SMEM((SLOTS, 8), jnp.uint32),  # validity, `att._publish_validity`
                       plgpu.SMEM((2, H, T), jnp.bfloat16, transforms=att._TRANSFORMS),  # p, warpgroup 0 -> 1
                       plgpu.SMEM((4, H), jnp.float32),  # rows' rescale (two slots), then m and l
                       plgpu.SMEM((recv_slots, H * T), jnp.float32),  # the peer's partial logits (`_send`)
                       plgpu.SMEM((2 * recv_slots,), jnp.uint32),  # their mbarriers
                       plgpu.SMEM((n_t, 256), jnp.int32)),  # the decoders' entry ids, `att._load_ids`
        kernel_name="sparse_attention_channels",
    )
    args = (q_bhd.astype(jnp.bfloat16), window_values, window_scales, window_valid.astype(jnp.bool_), entry_values,
            entry_scales, idx, sink_h.astype(jnp.float32))
    return kernel(*args, *(jnp.asarray(a, jnp.float32) for a in (unrotate if rotated else ())))
