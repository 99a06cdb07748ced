"""Issue 12 at batch 1 on one H200: do weights prefetched to the L2 during small kernels shorten the weight kernel
after them? (`prefetch_l2` below: tried, not kept, docs/BENCHMARKS.md "Seventeenth pass".)

    PYTHONPATH=. python3 -m experiments.device_runs.issue12_l2_prefetch     (~2 minutes)

Per call, L2 flushed first: [prefetch of the weight's first P MB] -> a chain of G small dependent kernels (the
"glue" of a step: 512 x 512 f32 mat-vecs) -> the weight kernel at one row (the slice's wo_b and wq_b in FP8,
one token's 6 routed experts' w1 + w3 in FP4). GPU time per kernel kind from a profiler trace. The outputs
with and without prefetch are compared (they must be equal).
"""

import functools
import time
import traceback
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments import bench_kernels as bk
from experiments.device_runs._steps import logger
from kernels_pallas import gpu_wgmma
from kernels_pallas.gpu_wgmma import i32_const, is_hopper

# ----------------------------------------------------------------------------- the prefetch launch
# One launch whose threads each issue `cp.async.bulk.prefetch.L2` for chunks of the given arrays' leading bytes.
# The hope: it exits at once and the copies proceed while the next small kernels run. Measured: the launch lasts
# as long as its copies take (32 MB: ~10 us), so on XLA's one stream it delays the small kernels as much as it
# saves the weight kernel (less: 16 -> 12.7 us for wo_b with 32 of its 42 MB prefetched). The launch's output is
# a 0.0 added to `after`: a bare token, or one tied by lax.optimization_barrier, was dropped by XLA as unused.

CHUNK = 1 << 14  # bytes per prefetch instruction (a multiple of 16)
THREADS = 128  # one warpgroup per CTA
_SPLAT = plgpu.Layout.WG_SPLAT(shape=())


def plan(sizes: Sequence[int], chunk: int = CHUNK) -> list[tuple[int, int, int]]:
    """[(first chunk, chunks, bytes of the last chunk)] per array of `sizes` bytes (each rounded down to 16 B):
    chunk c of the launch, if first <= c < first + chunks, prefetches bytes [(c - first) chunk, ...) of it."""
    out, first = [], 0
    for size in sizes:
        size -= size % 16
        n = -(-size // chunk)
        out.append((first, n, size - (n - 1) * chunk if n else 0))
        first += n
    return out


@functools.cache
def _issue(layout: tuple[tuple[int, int, int], ...], ctas: int, chunk: int):
    """inline_mgpu: (arrays (gmem), CTA index) -> prefetches of the chunks `layout` (`plan`) gives this thread:
    chunks tid + THREADS (cta + ctas j)."""
    total = sum(n for _, n, _ in layout)
    rounds = -(-total // (THREADS * ctas))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (len(layout) + 1) + (_SPLAT,))
    def issue(ctx, *args):
        del ctx
        *refs, zero_out, cta = args
        i64 = ir.IntegerType.get_signless(64)
        cta = cta.registers.item()
        g = arith.addi(mgpu_utils.thread_idx(), arith.muli(cta, i32_const(THREADS)))
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, g, i32_const(0))):
            memref.store(arith.constant(ir.F32Type.get(), 0.0), zero_out, [arith.constant(ir.IndexType.get(), 0)])
        ge = lambda x, y: arith.cmpi(arith.CmpIPredicate.sge, x, y)
        for j in range(rounds):
            c = arith.addi(g, i32_const(THREADS * ctas * j))
            for ref, (first, n, last_bytes) in zip(refs, layout):
                if not n:
                    continue
                inside = arith.andi(ge(c, i32_const(first)), arith.cmpi(arith.CmpIPredicate.slt, c, i32_const(first + n)))
                with mgpu_utils.when(inside):
                    local = arith.subi(c, i32_const(first))
                    size = arith.select(arith.cmpi(arith.CmpIPredicate.eq, local, i32_const(n - 1)),
                                        i32_const(last_bytes), i32_const(chunk))
                    ptr = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref),
                                                   [arith.muli(arith.extui(i64, local), arith.constant(i64, chunk))],
                                                   ir.IntegerType.get_signless(8))
                    mgpu_utils.inline_ptx("cp.async.bulk.prefetch.L2.global [$0], $1;", ptr, size,
                                          has_side_effects=True)

    return issue


def prefetch_l2(after: jax.Array, arrays: Sequence[tuple[jax.Array, int]], *, chunk: int = CHUNK,
                per_thread: int = 1) -> jax.Array:
    """`after` (+ 0.0), sequenced after one kernel that asks the L2 for the first `nbytes` of each (array, nbytes)
    (clipped to the array; whole 16 B). On an H100/H200 only; elsewhere `after` unchanged. The launch was meant to
    exit once its copies are issued; measured, it lasts about as long as they take (the comment above)."""
    arrays = [(a, min(int(nb), a.size * a.dtype.itemsize)) for a, nb in arrays if nb > 0]
    if not arrays or not is_hopper():
        return after
    layout = tuple(plan([nb for _, nb in arrays], chunk))
    total = sum(n for _, n, _ in layout)
    ctas = max(1, -(-total // (THREADS * per_thread)))
    issue = _issue(layout, ctas, chunk)

    def body(*refs):
        issue(*refs[1:], lax.axis_index("c"))  # the arrays, the output

    zero = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1,), jnp.float32), grid=(ctas,), grid_names=("c",),
                        kernel_name="l2_prefetch")(after, *[a for a, _ in arrays])
    return after + zero[0].astype(after.dtype)


T0 = time.time()
say, LOG = logger("l2_prefetch.log")
MB = 1 << 20
peak = bk.hbm_copy_bandwidth(1.0)
say(f"device {jax.devices()[0].device_kind}; copy {peak / 1e9:.0f} GB/s (read + write)")
key = jax.random.key(0)
ks = iter(jax.random.split(key, 16))


def fp8(n, k):
    return (bk.random_bytes(next(ks), (n, k)) & 0xF7,  # E4M3 without NaN bytes
            jax.random.randint(next(ks), (n // 32, k // 32), 118, 128).astype(jnp.uint8))


def fp4(e, n, k):
    return (bk.random_bytes(next(ks), (e, n, k // 2)),
            jax.random.randint(next(ks), (e, n, k // 32), 118, 128).astype(jnp.uint8))


MATS = jax.random.normal(next(ks), (12, 512, 512), jnp.float32) * 512 ** -0.5
V0 = jax.random.normal(next(ks), (1, 512), jnp.float32)
E, ROUTED = 16, 6
WEIGHTS = {
    "FP8 wo_b 5120 x 8192": ("fp8", [fp8(5120, 8192)], 8192),
    "FP8 wq_b 32768 x 1280": ("fp8", [fp8(32768, 1280)], 1280),
    "FP4 w1 + w3, 6 experts": ("fp4", [fp4(E, 2304, 5120), fp4(E, 2304, 5120)], 5120),
}
EXPERTS = jnp.arange(ROUTED, dtype=jnp.int32)  # experts 0..5: the leading 6/16 of each array


def make(kind, n_w, k, pf_mb, glue, chunk=CHUNK, per_thread=1):
    def fn(v, x, mats, *flat):
        weights = [tuple(flat[2 * i:2 * i + 2]) for i in range(n_w)]
        if pf_mb:
            # the leading bytes of the weights (FP4: experts 0..5 lead each array), then the scales they use
            share = 1 if kind == "fp8" else ROUTED / E
            arrays = [(w, pf_mb * MB // n_w) for w, _ in weights] + [(s, int(s.size * share)) for _, s in weights]
            v = prefetch_l2(v, arrays, chunk=chunk, per_thread=per_thread)
        for i in range(glue):
            v = jnp.tanh(v @ mats[i])
        x = x + (v[0, :1] * 0).astype(x.dtype)  # the weight kernel after the glue
        if kind == "fp8":
            return gpu_wgmma.fp8_matmuls_wgmma(x, weights)
        return gpu_wgmma.rows_matmuls_fp4_wgmma(x, weights, EXPERTS)
    return fn


ROWS = []
for name, (kind, weights, k) in WEIGHTS.items():
    flat = [a for w in weights for a in w]
    total = sum(int(a.nbytes) for a in flat) * (ROUTED / E if kind == "fp4" else 1)
    x = bk.random_bf16(next(ks), (1, k))
    args = (V0, x, MATS, *flat)
    ref = None
    cap = int(total // MB)
    hot = bk.time_op(make(kind, len(weights), k, 0, 0), args, perturb=0)
    say(f"{name}: hot L2 (no flush, wall per call of a loop) {hot * 1e6:.1f} us")
    for glue, pf, chunk, per_thread in [(12, 0, 0, 0), (12, 16, 1 << 14, 1), (12, 32, 1 << 14, 1), (12, 32, 1 << 12, 1),
                                        (12, 32, 1 << 16, 1), (12, 32, 1 << 14, 4), (12, cap, 1 << 14, 1),
                                        (0, 32, 1 << 14, 1), (24, 32, 1 << 14, 1)]:
        pf = min(pf, cap)
        try:
            fn = make(kind, len(weights), k, pf, glue, chunk or CHUNK, per_thread or 1)
            out = jax.jit(fn)(*args)
            ref = out if ref is None else ref
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(out, ref))
            t, info = bk.time_hbm(fn, args, perturb=0, top=40)
            byk = info["by_kernel"]
            wk = sum(us for n, us in byk.items() if n.startswith(("fp8_wgmma", "fp4_rows_wgmma")))
            pk = sum(us for n, us in byk.items() if n.startswith("l2_prefetch"))
            ROWS.append((name, glue, pf, chunk >> 10, per_thread, t * 1e6, wk, pk, t * 1e6 - wk - pk, total / (wk * 1e-6) / peak, same))
            say(f"{name:26s} glue {glue:2d} prefetch {pf:3d} MB chunk {chunk >> 10} KB x{per_thread}: {t * 1e6:7.1f} us  weight kernel {wk:6.1f}  "
                f"prefetch kernel {pk:5.1f}  equal {same}  {dict(list(byk.items())[:6])}")
        except Exception as e:
            say(f"{name} glue {glue} prefetch {pf}: FAILED {type(e).__name__}: {str(e)[:800]}")
            traceback.print_exc(file=LOG)
    del args, flat, weights

say(f"\n[{time.time() - T0:.0f}s] copy peak {peak / 1e9:.0f} GB/s; GPU us per call (L2 flushed before each)")
say("| weight (MB read) | glue kernels | prefetched MB | chunk KB | chunks per thread | all us | weight kernel us | prefetch kernel us | rest us | "
    "weight kernel % of copy | same output |")
say("|---|---|---|---|---|---|---|---|---|---|---|")
for name, glue, pf, chunk, per_thread, t, wk, pk, rest, frac, same in ROWS:
    say(f"| {name} | {glue} | {pf} | {chunk} | {per_thread} | {t:.1f} | {wk:.1f} | {pk:.1f} | {rest:.1f} | {100 * frac:.0f}% | {same} |")
