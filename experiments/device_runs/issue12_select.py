"""The top-k kernel's threshold search on one H200: its GPU tests, then each decode shape of the slice timed
(`gpu_select.select_topk`, L2 flushed, GPU time from a profiler trace) at several warp counts and search
widths (bits a step), each checked equal to `ops.select_topk`. Logs under $OUT.

    PYTHONPATH=. python3 -m experiments.device_runs.issue12_select     (~6 minutes)

Each variant costs ~8 s (its compile and a profiled loop): the twenty-fifth session's sweep of 1-16 warps x 1, 2, 4
bits ran out of its 480 s in the third shape; this sweeps 2-8 warps x 1, 2 bits.

The batch-1 step at 4K runs this kernel 4 times (~54 us, twenty-fifth session's profile): top-512 of 2048 and of
4096 compressed positions, of a 4096-position pool, and the candidate blocks (at most k entries: no search).
One program a row: the 32 one-bit steps of the search, each a block reduction, are its latency.
"""

import os
import time
import traceback

from experiments.device_runs._steps import OUT, logger, step

T0 = time.time()
say, LOG = logger("select.log")
rc = step("select_tests", ["-m", "pytest", "tests/test_kernels_gpu.py", "-q", "-x", "-p", "no:cacheprovider", "-k",
                           "select or candidate"], 150, {"JAX_PLATFORMS": "cuda"})
tail = open(os.path.join(OUT, "select_tests.log")).read().strip().splitlines()
say("TESTS rc", rc, "|", tail[-1] if tail else "")
if rc:
    say("\n".join(tail[-40:])[-4000:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv41_jax import ops  # noqa: E402
from experiments import bench_kernels as bk  # noqa: E402
from kernels_pallas import gpu_select  # noqa: E402

SHAPES = [(1, 2048, 512), (1, 4096, 512), (8, 131072, 512)]  # rows, row length, k
ROWS = []
for rows, n, k in SHAPES:
    scores = jax.random.normal(jax.random.key(n), (rows, n), jnp.float32)
    ref = jax.jit(ops.select_topk, static_argnums=1)(scores, k)
    for warps in (2, 4, 8):
        for bits in (1, 2):
            name = f"[{rows}, {n}] k={k}, {warps} warps, {bits} bit(s) a step"
            try:
                fn = jax.jit(lambda s, w=warps, b=bits: gpu_select.select_topk(s, k, num_warps=w, bits=b))
                exact = bool((fn(scores) == ref).all())
                t, info = bk.time_hbm(fn, (scores,), perturb=0)
                ROWS.append((rows, n, k, warps, bits, t * 1e6, info.get("kernels"), exact))
                say(f"  {name:50s} {t * 1e6:7.2f} us  exact {exact}  {info.get('by_kernel')}")
            except Exception as e:
                say(f"  {name:50s} FAILED {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(file=LOG)

say(f"\n[{time.time() - T0:.0f}s] select_topk, GPU us per call (L2 flushed), default num_warps / bits: "
    f"{gpu_select.BITS} bit(s)")
say("| rows | row | k | warps | bits a step | us | kernels | exact |")
say("|---|---|---|---|---|---|---|---|")
for r in ROWS:
    say("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r) + " |")
