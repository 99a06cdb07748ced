"""Issue 21's attention on one H200: the wgmma kernel's GPU tests (ptxas' report of it saved), then the Triton
default and the wgmma kernel at several key splits, timed from HBM (L2 flushed before every call; GPU time of
the call's kernels from a profiler trace) against the copy bandwidth measured in the same run. Logs under $OUT.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_attention [BATCH ...]     (~2 minutes)

ABLATE=1 also times the wgmma kernel at batch 64 without each of its parts (`gpu_attention_wgmma.ABLATIONS`).
"""

import os
import sys
import time
import traceback

from experiments.device_runs._steps import OUT, logger, step

T0 = time.time()
say, LOG = logger("attention.log")
BATCHES = [int(a) for a in sys.argv[1:]] or [64]


dump = os.path.join(OUT, "mosaic")
os.makedirs(dump, exist_ok=True)
rc = step("tests", ["-m", "pytest", "tests/test_attention_wgmma.py", "-q", "-x", "-p", "no:cacheprovider"], 240,
          {"JAX_PLATFORMS": "cuda", "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": dump})
tail = open(os.path.join(OUT, "tests.log")).read().strip().splitlines()
say("TESTS rc", rc, "|", tail[-1] if tail else "")
if rc:
    say("\n".join(tail[-60:])[-5000:])
say(f"[{time.time() - T0:.0f}s] tests done")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv41_jax import ops, quant  # noqa: E402
from experiments import bench_kernels as bk  # noqa: E402
import kernels_pallas  # noqa: E402
from kernels_pallas import gpu_attention_wgmma  # noqa: E402

peak = bk.hbm_copy_bandwidth(1.0)
say(f"device {jax.devices()[0].device_kind}; copy {peak / 1e9:.0f} GB/s (read + write) = peak")
SCALE = bk.D_ATT ** -0.5
ROWS = []


def triton(q, wv, ws, ok, ev, es, idx, sink):
    """The dispatch's Triton kernel (its tiles for this batch), as before the wgmma kernel."""
    min_batch, gpu_attention_wgmma.MIN_BATCH = gpu_attention_wgmma.MIN_BATCH, 1 << 30
    try:
        return kernels_pallas.sparse_attention_decode(q, {"values": wv, "scales": ws}, ok, {"values": ev, "scales": es},
                                                      idx, sink, SCALE)
    finally:
        gpu_attention_wgmma.MIN_BATCH = min_batch


def wgmma(splits, skip=(), merged=None):
    return lambda q, wv, ws, ok, ev, es, idx, sink: gpu_attention_wgmma.sparse_attention_wgmma(
        q, wv, ws, ok, ev, es, idx, sink, SCALE, splits=splits, merged=merged, skip=skip)


for b in BATCHES:
    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, 1 << 17, jnp.float32)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx)
    args = bk.attention_args(q, window, wvalid, entries, idx, sink)
    ref = ops.sparse_attention_decode(q, window, wvalid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink, SCALE)
    default = gpu_attention_wgmma.default_splits(b, (bk.WINDOW + bk.TOPK) // gpu_attention_wgmma.T)
    variants = [("Triton (the dispatch's tiles)", triton), (f"wgmma, default ({default} splits)", wgmma(None))]
    variants += [(f"wgmma, {s} splits", wgmma(s))
                 for s in sorted({max(1, default // 2), min(gpu_attention_wgmma.MAX_SPLITS, default * 2)} - {default})]
    if default <= gpu_attention_wgmma.MAX_SPLITS:  # the default's ranges, stored in the other form
        merged = default > gpu_attention_wgmma.MERGED_SPLITS
        variants += [(f"wgmma, {default} splits, {'merged' if merged else 'partials'}", wgmma(default, merged=merged))]
    if b == 64 and os.environ.get("ABLATE"):  # what each part costs: the kernel without it (wrong numbers)
        variants += [(f"wgmma, 2 splits, no {part}", wgmma(2, (part,))) for part in gpu_attention_wgmma.ABLATIONS]
        variants += [("wgmma, 2 splits, loads + stores only", wgmma(2, ("qk", "pv", "decode")))]
    for name, fn in variants:
        try:
            t, info, out = bk.time_hbm_output(fn, args, perturb=7)
            err = bk.rel_err(jnp.nan_to_num(out), ref)
            ROWS.append((b, name, t * 1e6, info.get("pallas_us"), info.get("kernels"), moved / t / peak, err))
            say(f"  128K x{b} {name:32s} {t * 1e6:8.1f} us  {100 * moved / t / peak:5.1f}% of copy  {info}  "
                f"rel err {err:.2e}")
        except Exception as e:
            say(f"  128K x{b} {name:32s} FAILED {type(e).__name__}: {str(e)[:600]}")
            traceback.print_exc(file=LOG)
    del args, q, window, entries, ref

say(f"\n[{time.time() - T0:.0f}s] attention, 128K entries, from HBM; copy peak {peak / 1e9:.0f} GB/s; "
    f"bytes: q, window, 512 gathered entry rows, idx, f32 out")
say("| batch | kernel | us | Pallas us | kernels | % of copy | rel. error |")
say("|---|---|---|---|---|---|---|")
for b, name, us, pus, kern, frac, err in ROWS:
    say(f"| {b} | {name} | {us:.1f} | {pus} | {kern} | {100 * frac:.1f} | {err:.1e} |")
