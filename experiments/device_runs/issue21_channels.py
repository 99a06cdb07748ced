"""Issue 21's channel-split attention (`kernels_pallas.gpu_attention_channels`) on one H100/H200: its GPU tests
(ptxas' report saved), then it and the key-split wgmma kernel (the dispatch's default) timed from HBM (L2 flushed
before every call; GPU time of the call's kernels from a profiler trace) against the copy bandwidth measured in
the same run, at 128K entries. Logs under $OUT.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_channels [BATCH ...]     (~3 minutes; default 64 32)
"""

import os
import sys
import time
import traceback

from experiments.device_runs._steps import OUT, logger, step

T0 = time.time()
say, LOG = logger("channels.log")
BATCHES = [int(a) for a in sys.argv[1:]] or [64, 32]

dump = os.path.join(OUT, "mosaic")
os.makedirs(dump, exist_ok=True)
rc = 0 if os.environ.get("TESTS") == "0" else step("tests", ["-m", "pytest", "tests/test_attention_channels.py", "-q", "-x", "-p", "no:cacheprovider"], 300,
          {"JAX_PLATFORMS": "cuda", "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": dump})
tail = [] if os.environ.get("TESTS") == "0" else open(os.path.join(OUT, "tests.log")).read().strip().splitlines()
say("TESTS rc", rc, "|", tail[-1] if tail else "(not run: TESTS=0)")
if rc:
    say("\n".join(tail[-60:])[-6000:])
    sys.exit(1)  # a wrong or hung kernel is not timed
say(f"[{time.time() - T0:.0f}s] tests done")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv41_jax import ops, quant  # noqa: E402
from experiments import bench_kernels as bk  # noqa: E402
from kernels_pallas import gpu_attention_channels, gpu_attention_wgmma  # noqa: E402

peak = bk.hbm_copy_bandwidth(1.0)
say(f"device {jax.devices()[0].device_kind}; copy {peak / 1e9:.0f} GB/s (read + write) = peak")
SCALE = bk.D_ATT ** -0.5
ROWS = []

def channels(**kw):
    return lambda *a: gpu_attention_channels.sparse_attention_channels(*a, SCALE, **kw)


VARIANTS = {  # batch 64 also times the ablations (`gpu_attention_channels.ABLATIONS`: wrong outputs)
    "wgmma (key split, default)": lambda *a: gpu_attention_wgmma.sparse_attention_wgmma(*a, SCALE),
    "channels": channels(),
    "channels, ahead": channels(ahead=True),
    "channels, rows 2 ahead": channels(rows_ahead=2),
    "channels, rows 3 ahead": channels(rows_ahead=3),
    "channels, ahead, rows 2 ahead": channels(ahead=True, rows_ahead=2),
    "channels, ahead, rows 3 ahead": channels(ahead=True, rows_ahead=3),
}
ABLATED = {
    "channels, rows 3 ahead, no exchange": channels(rows_ahead=3, skip=("exchange",)),
    "channels, rows 3 ahead, no exchange / qk / pv": channels(rows_ahead=3, skip=("exchange", "qk", "pv")),
}

for b in BATCHES:
    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, 1 << 17)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx)
    args = (q, window["values"], window["scales"], wvalid, entries["values"], entries["scales"], idx, sink)
    ref = ops.sparse_attention_decode(q, window, wvalid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink, SCALE)
    first = None  # the first channel-split output: every exact variant must give it bit for bit
    for name, fn in {**VARIANTS, **(ABLATED if b == 64 else {})}.items():
        try:
            out = fn(*args)
            err = float(jnp.linalg.norm(jnp.nan_to_num(out) - ref) / jnp.linalg.norm(ref))
            if name.startswith("channels") and name in VARIANTS:
                first = out if first is None else first
                say(f"  128K x{b} {name}: bit-equal to the first channel-split form: {bool((out == first).all())}")
            t, info = bk.time_hbm(fn, args, perturb=7)
            ROWS.append((b, name, t * 1e6, info.get("pallas_us"), moved / t / peak, err))
            say(f"  128K x{b} {name:34s} {t * 1e6:8.2f} us  {100 * moved / t / peak:5.1f}% of copy  {info}  "
                f"rel err {err:.2e}")
        except Exception as e:
            say(f"  128K x{b} {name:34s} FAILED {type(e).__name__}: {str(e)[:600]}")
            traceback.print_exc(file=LOG)
    del args, q, window, entries, ref

say(f"\n[{time.time() - T0:.0f}s] attention, 128K entries, from HBM (read flush); copy peak {peak / 1e9:.0f} GB/s; "
    "bytes: q (bf16), window, 512 gathered entry rows, idx, f32 out")
say("| batch | kernel | us | Pallas us | % of copy | rel. error |")
say("|---|---|---|---|---|---|")
for b, name, us, pus, frac, err in ROWS:
    say(f"| {b} | {name} | {us:.2f} | {pus} | {100 * frac:.1f} | {err:.1e} |")
