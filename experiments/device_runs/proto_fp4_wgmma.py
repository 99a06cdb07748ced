"""PROTOTYPE (unvalidated until run on an H200): the FP4 routed-expert "rows" matmul as a Mosaic GPU
(Pallas `plgpu`) kernel whose weights are the wgmma's A operand in REGISTERS, decoded there.

`kernels_pallas.gpu_grouped.rows_matmuls_fp4` (Pallas Triton) decodes in registers, then Triton moves
the bf16 tile through shared memory to the MMA (48-70% of the copy bandwidth). Hopper's wgmma takes A
from registers, so here: A = weights, 64 output rows n per warpgroup; B = x^T from shared memory, its N
= tm = 8 or 16 rows of x (one token's row padded; every row is computed, one is kept).

Per CTA (grid: row m x output tile j of 64): one warpgroup; a TMA pipeline over K in chunks of tk = 256
(packed bytes [64, 128], swizzled 128 B, and x [tm, 256] bf16); the CTA's whole E8M0 block [64, K/32]
is one contiguous run of bytes, fetched once by TMA (its rows are K/32 bytes, e.g. 72: no TMA box
fits them, but [E, N/64, K/128, 256] does). Decode (`_decode_tile`, inline PTX on registers, no SMEM
round trip): each thread reads 16 B (one 32-input scale group of one row) per load, turns each
32-bit word (8 codes) into four bf16x2 holding sign << 15 | mag << 6 (= E2M1 * 2**-126, exact; shift,
mask, lop3) and scales them with one fma.rn.bf16x2 by 2**(E + 126) (exact while the E8M0 byte <= 128,
as gpu_grouped's fast path): one FMA per two weights. The K order inside a 256 chunk is permuted
(`k_perm`) so that each thread's decoded registers are exactly its WGMMA_LAYOUT registers (no shuffle);
x's columns get the same permutation in the wrapper (a sum over K ignores the order; x is 10 KB).

Run (repo root):
    PYTHONPATH=. python -m experiments.device_runs.proto_fp4_wgmma --lower-only   # CPU: lowers, prints OK
    PYTHONPATH=. timeout 600 python -m experiments.device_runs.proto_fp4_wgmma    # H200: check + timing
(under a timeout: a wrong barrier phase would hang the kernel). Not yet done: K split across CTAs (w1
gives 216 CTAs for 132 SMs), tk > 256, overlapping the decode of step t + 1 with the wgmma of step t.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

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

TN = 64  # output rows per CTA: the wgmma M of one warpgroup
TK = 256  # inputs per pipeline step: 128 packed bytes per row = one 128 B swizzle row; 8 scale groups
SCALE_BLOCK = 32
SPLAT = plgpu.Layout.WG_SPLAT(shape=())  # a scalar argument of an inline_mgpu function
V_TRANSFORMS = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))  # uint8 [64, 128]
X_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 [tm, 256]


# One 32-bit word of packed codes (8 inputs: byte b holds inputs 2b (low nibble), 2b + 1) -> four
# bf16x2, output i = inputs WORD_PAIRS[i] (low, high half). Shifting the word left by 4i puts the codes
# of inputs 3 - i and 7 - i in the top nibble of each 16-bit lane; there the sign is already bit 15 and
# the magnitude (bits 12..14) >> 6 lands in bits 6..8: bf16 bits sign << 15 | mag << 6 = E2M1 * 2**-126
# (mag 1 a subnormal), exact. One fma.rn.bf16x2 by $5 = 2**(E + 126) (E = byte - 127) scales it
# exactly; the addend -0 keeps the sign of zeros. 3 ALU ops + 1 FMA per two weights (ptxas: ~19 SASS
# per word against ~22 for gpu_grouped's prmt form, counted on CPU from the cubin's .text size).
WORD_PAIRS = ((3, 7), (2, 6), (1, 5), (0, 4))
_OUT = ("shr.b32 m, {q}, 6; and.b32 m, m, 0x01C001C0; lop3.b32 m, {q}, 0x80008000, m, 0xEA; "  # (q & S) | m
        "fma.rn.bf16x2 ${i}, m, $5, z; ")
_DECODE_PTX = ("{ .reg .b32 q, m, z; mov.b32 z, 0x80008000; " + _OUT.format(q="$4", i=0)
               + "".join(f"shl.b32 q, $4, {4 * i}; " + _OUT.format(q="q", i=i) for i in (1, 2, 3)) + "}")


def k_perm() -> np.ndarray:
    """p[c]: the input (of a 256 chunk) that the wgmma's K column c holds, in every row.

    WGMMA_LAYOUT gives thread q = lane % 4 the column pairs 16n + 8b + 2q + {0, 1} (instruction n < 16,
    b < 2) of its two rows. It decodes words u < 8 (8 inputs each) of scale groups 2q (u < 4) and
    2q + 1 of those rows; word u's output i = 2a + b fills instruction n = 2u + a, pair b."""
    p = np.empty(TK, np.int64)
    for n in range(TK // 16):
        u, a = divmod(n, 2)
        for b in range(2):
            for q in range(4):
                for j in range(2):
                    p[16 * n + 8 * b + 2 * q + j] = 32 * (2 * q + u // 4) + 8 * (u % 4) + WORD_PAIRS[2 * a + b][j]
    assert sorted(p) == list(range(TK))
    return p


def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _index(v):
    return arith.index_cast(ir.IndexType.get(), v)


def _decode_tile(k: int):
    """inline_mgpu: (packed SMEM tile [64, 128] u8, the CTA's scales [K/128, 256] u8, step) -> bf16 [64, 256]
    in WGMMA_LAYOUT, column c holding input k_perm()[c] of the step's 256."""
    groups = k // SCALE_BLOCK  # scale bytes per row

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(V_TRANSFORMS), plgpu.RefType(), SPLAT),
        return_type=plgpu.ShapeDtypeStruct((TN, TK), jnp.bfloat16, plgpu.Layout.WGMMA),
    )
    def decode(ctx, v_smem, s_smem, step):
        del ctx
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        step = step.registers.item()
        tid = mgpu_utils.thread_idx()
        lane = arith.remui(tid, _i32(32))
        warp = arith.remui(arith.divui(tid, _i32(32)), _i32(4))
        q, r = arith.remui(lane, _i32(4)), arith.divui(lane, _i32(4))
        row0 = arith.addi(arith.muli(warp, _i32(16)), r)
        v_ptr = mgpu_utils.memref_ptr(v_smem)  # tiled [8, 1, 8, 128]: row R at byte 128 R
        regs_shape = mgpu.WGMMA_LAYOUT.registers_shape((TN, TK))
        assert regs_shape == (1, TK // 8, 1, 1, 2, 1, 1, 1, 1), regs_shape
        regs = np.empty(regs_shape, dtype=object)
        for half in range(2):  # rows R = row0 and row0 + 8 (a0/a2 and a1/a3 of each wgmma)
            row = arith.addi(row0, _i32(8 * half))
            for h in range(2):  # scale group g = 2q + h of the step's 8
                g = arith.addi(arith.muli(q, _i32(2)), _i32(h))
                # 128 B swizzle: 16 B chunk g of row R sits at chunk g ^ (R % 8) = g ^ r
                off = arith.addi(arith.muli(row, _i32(128)), arith.muli(arith.xori(g, r), _i32(16)))
                words = llvm.load(ir.VectorType.get((4,), i32), mgpu_utils.getelementptr(v_ptr, [off], i8))
                flat = arith.addi(arith.muli(row, _i32(groups)), arith.addi(arith.muli(step, _i32(8)), g))
                e = memref.load(s_smem, [_index(arith.divui(flat, _i32(256))), _index(arith.remui(flat, _i32(256)))])
                mult = arith.shli(arith.addi(arith.extui(i32, e), _i32(126)), _i32(7))  # bf16 2**(E + 126)
                mult = arith.ori(mult, arith.shli(mult, _i32(16)))
                for w in range(4):
                    word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([w]))
                    outs = mgpu_utils.inline_ptx(_DECODE_PTX, word, mult, result_types=[i32] * 4)
                    u = 4 * h + w  # output i -> instruction n = 2u + i // 2, pair b = i % 2: col block 2n + b
                    for i, reg in enumerate(outs):
                        regs[0, 4 * u + i, 0, 0, half, 0, 0, 0, 0] = mgpu_utils.bitcast(reg, bf16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return decode


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), SPLAT, SPLAT, SPLAT))
def _store_column(ctx, o_smem, o_gmem, m, n0, col):
    """o_gmem[m, n0 + i] = o_smem[i, col] for i < 64 (threads 0..63: one coalesced 256 B row)."""
    del ctx
    m, n0, col = (a.registers.item() for a in (m, n0, col))
    mgpu_utils.warpgroup_barrier()  # o_smem was written by other threads
    tid = mgpu_utils.thread_idx()
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, tid, _i32(TN))):
        v = memref.load(o_smem, [_index(tid), _index(col)])
        memref.store(v, o_gmem, [_index(m), _index(arith.addi(n0, tid))])


def fp4_rows_matmul_wgmma(x_mk, values, scales, expert_m, *, tm=None, tk=TK, max_concurrent_steps=4):
    """y f32 [M, N]: row m = x[m] (or x[0] when x is [1, K]) @ W[expert_m[m]]^T, zero where expert_m[m] < 0.

    values uint8 [E, N, K/2] (FP4 E2M1 pairs, low nibble = even input), scales uint8 [E, N, K/32] (E8M0,
    bytes <= 128); x bf16 [M or 1, K], M <= 16. tm: x rows per wgmma (B's N), default 8 or 16."""
    e_count, n, half = values.shape
    k, m = 2 * half, expert_m.shape[0]
    rows = x_mk.shape[0]
    if tk != TK or k % TK or n % TN or scales.shape != (e_count, n, k // SCALE_BLOCK) or rows not in (1, m):
        raise ValueError(f"unsupported shapes x {x_mk.shape} values {values.shape} scales {scales.shape} tk {tk}")
    tm = tm or (8 if rows <= 8 else 16)
    if rows > tm or tm % 8:
        raise ValueError(f"tm={tm} must be a multiple of 8 holding the {rows} rows of x")
    # x's columns in the wgmma's K order, rows padded to tm (B = xp^T is [K, tm])
    xp = x_mk.astype(jnp.bfloat16).reshape(rows, k // TK, TK)[:, :, k_perm()].reshape(rows, k)
    xp = jnp.pad(xp, ((0, tm - rows), (0, 0)))
    s_view = scales.reshape(e_count, n // TN, k // 128, 256)  # CTA (e, j)'s scales: one contiguous box
    decode = _decode_tile(k)

    def body(expert_ref, xp_gmem, v_gmem, s_gmem, o_gmem, s_smem, s_bar, o_smem):
        row, j = lax.axis_index("m"), lax.axis_index("n")
        e = expert_ref[row]

        def acc_scope(acc_ref):
            @pl.when(e >= 0)
            def _():
                plgpu.copy_gmem_to_smem(s_gmem.at[e, j], s_smem, s_bar)

                def step(idx, v_smem, x_smem):
                    (t,) = idx
                    pl.when(t == 0)(lambda: plgpu.barrier_wait(s_bar))  # once: a wait flips the phase
                    a = decode(v_smem, s_smem, t)
                    plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)  # the pipeline refills x_smem's slot right after the body

                plgpu.emit_pipeline(
                    step,
                    grid=(k // TK,),
                    in_specs=[plgpu.BlockSpec((TN, TK // 2), lambda t: (j, t), transforms=V_TRANSFORMS),
                              plgpu.BlockSpec((tm, TK), lambda t: (0, t), transforms=X_TRANSFORMS)],
                    max_concurrent_steps=max_concurrent_steps,
                )(v_gmem.at[e], xp_gmem)

            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((TN, tm), jnp.float32))  # zeros when e < 0
        o_smem[...] = acc
        _store_column(o_smem, o_gmem, row, j * TN, row if rows > 1 else 0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m, n // TN),
        grid_names=("m", "n"),
        scratch_types=(plgpu.SMEM((k // 128, 256), jnp.uint8), plgpu.Barrier(num_arrivals=1),
                       plgpu.SMEM((TN, tm), jnp.float32)),
        kernel_name=f"fp4_rows_wgmma_{n}x{k}",
    )
    return kernel(expert_m.astype(jnp.int32), xp, values, s_view)


# ----------------------------------------------------------------------------- checks and timing
SHAPES = {"w1-like": (2304, 5120), "w2-like": (5120, 2304)}  # (N, K) of the v41 routed experts
E, TOP_K = 384, 6


def lower_only() -> None:
    """CPU: lower for CUDA at the v41 shapes (catches most API / layout errors; PTX is not compiled here)."""
    s = jax.ShapeDtypeStruct
    for name, (n, k) in SHAPES.items():
        for rows in (1, TOP_K):
            args = (s((rows, k), jnp.bfloat16), s((E, n, k // 2), jnp.uint8), s((E, n, k // 32), jnp.uint8),
                    s((TOP_K,), jnp.int32))
            text = jax.jit(fp4_rows_matmul_wgmma).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text, name
            print(f"lowered {name} N={n} K={k} x [{rows}, {k}]")
    print("OK")


def gpu_main(reps: int) -> int:
    from dsv41_jax import grouped
    from experiments.bench_kernels import copy_bandwidth
    from experiments.bench_weights import expert_data
    from kernels_pallas import gpu_grouped

    print(jax.devices())
    peak = copy_bandwidth(1.0)
    print(f"device copy: {peak / 1e9:.0f} GB/s")
    key, failed, table = jax.random.key(0), 0, []
    for name, (n, k) in SHAPES.items():
        values, scales = expert_data(jax.random.fold_in(key, n), E, n, k)  # scale bytes 118..123
        ids_r = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 5), (reps, E)), TOP_K)[1].astype(jnp.int32)
        # 1) exactness against the jnp reference (x one row and x one row per expert; a -1 row)
        for rows in (1, TOP_K):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.bfloat16)
            ids = ids_r[0].at[TOP_K - 1].set(-1)
            try:
                got = jax.jit(fp4_rows_matmul_wgmma)(x, values, scales, ids)
                want = grouped.rows_matmul(x, {"values": values, "scales": scales}, ids)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                ok = err <= 1e-5
                print(f"{name} x[{rows}]: max|diff| / max|ref| = {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
            except Exception as ex:  # noqa: BLE001 -- report and go on to the next case
                ok = False
                print(f"{name} x[{rows}]: FAILED {type(ex).__name__}: {str(ex)[:2000]}")
            failed += not ok
        # 2) timing: a fresh set of 6 experts per call (reps x 35 MB, far past the 60 MB L2)
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        moved = TOP_K * n * (k // 2 + k // SCALE_BLOCK)
        calls = {f"wgmma stages={st}": (functools.partial(fp4_rows_matmul_wgmma, max_concurrent_steps=st),
                                        "fp4_rows_wgmma") for st in (2, 4, 6)}
        calls["triton rows_matmuls_fp4"] = (lambda x, v, s, i: gpu_grouped.rows_matmuls_fp4(x, [(v, s)], i)[0],
                                            "grouped_matmul_fp4")
        for label, (call, prefix) in calls.items():
            try:
                gpu_us, wall_us, names = time_loop(call, x, values, scales, ids_r, prefix)
                table.append((name, label, gpu_us, wall_us, moved / (gpu_us * 1e-6) / 1e9 if gpu_us else 0.0))
                print(f"  {name} {label}: {gpu_us:.1f} us GPU ({names}), {wall_us:.1f} us wall per call", flush=True)
            except Exception as ex:  # noqa: BLE001
                print(f"  {name} {label}: timing FAILED {type(ex).__name__}: {str(ex)[:2000]}")
        del values, scales
    print(f"\n{'shape':8s} {'kernel':24s} {'GPU us':>8s} {'wall us':>8s} {'GB/s':>7s} {'% copy':>7s}")
    for name, label, gpu_us, wall_us, gbs in table:
        print(f"{name:8s} {label:24s} {gpu_us:8.1f} {wall_us:8.1f} {gbs:7.0f} {100 * gbs * 1e9 / peak:6.1f}%")
    print("GB/s: the 6 experts' values + scales bytes / GPU time of the kernel (profiler trace)")
    print("ALL CHECKS OK" if not failed else f"{failed} CHECKS FAILED")
    return int(failed > 0)


def time_loop(call, x, values, scales, ids_r, prefix):
    """(GPU us per call of the kernels named prefix*, wall us per call, their names): a jitted scan over
    ids_r's rows (one expert set per call), wall time median of 5; GPU time from a profiler trace."""
    from experiments.bench_decode import kernel_profile

    @jax.jit
    def loop(x, values, scales, ids_r):
        body = lambda acc, ids: (acc + call(x, values, scales, ids)[0, 0], None)  # noqa: E731
        return lax.scan(body, jnp.float32(0), ids_r)[0]

    reps = ids_r.shape[0]
    jax.block_until_ready(loop(x, values, scales, ids_r))  # compile + warm-up
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x, values, scales, ids_r))
        walls.append((time.perf_counter() - t0) / reps)
    with tempfile.TemporaryDirectory() as tmp:
        prof = kernel_profile(lambda: jax.block_until_ready(loop(x, values, scales, ids_r)), tmp, reps, top=20)
    mine = [r for r in prof[2:] if r["name"].startswith(prefix)]
    if not mine:  # kernel names differ from what was expected: show them all, count them all
        print("    kernels in the trace:", [(r["name"][:60], round(r["us_per_step"], 2)) for r in prof[2:]])
        mine = prof[:1]
    return sum(r["us_per_step"] for r in mine), 1e6 * statistics.median(walls), [r["name"][:40] for r in mine]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lower-only", action="store_true", help="CPU: lower for CUDA and stop")
    parser.add_argument("--reps", type=int, default=64, help="calls per timed loop (one expert set each)")
    cli = parser.parse_args()
    if cli.lower_only:
        lower_only()
    else:
        raise SystemExit(gpu_main(cli.reps))
