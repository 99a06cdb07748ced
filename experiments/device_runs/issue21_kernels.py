"""Issue 21 on one H200: the GPU kernel tests, then the Triton indexer scan's and sparse attention's tiles
timed from HBM (L2 flushed before every call; GPU time from a profiler trace), against the
copy bandwidth measured in the same run. Prints a short table last; logs under $OUT. (Its first run,
2026-12-01, also timed three FP8 forms of the scan and a two-kernel "split" attention, since removed:
docs/BENCHMARKS.md has that table.)

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_kernels          (< 5 minutes; each variant may fail alone)
"""

import json
import os
import subprocess
import sys
import time
import traceback

from experiments.device_runs._steps import OUT, logger

DRY = bool(os.environ.get("I21_DRY"))  # CPU check of this script: interpreted kernels, tiny shapes, no tests
T0 = time.time()
BUDGET_S = 330  # no new timing starts after this (one takes < 15 s); the GPU tests come first
say, LOG = logger("i21.log")


def left() -> float:
    return BUDGET_S - (time.time() - T0)


# ---------------------------------------------------------------- 1. tests
try:
    if DRY:
        raise RuntimeError("dry run")
    env = dict(os.environ, PYTHONPATH=".", JAX_PLATFORMS="cuda")  # conftest defaults to the CPU (interpreted)
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_kernels_gpu.py", "-q", "-p",
                        "no:cacheprovider"], capture_output=True, text=True, timeout=150, env=env)
    with open(os.path.join(OUT, "tests.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    tail = (r.stdout + r.stderr).strip().splitlines()
    say("TESTS rc", r.returncode, "|", tail[-1] if tail else "")
    if r.returncode:
        say("\n".join(l for l in tail if "FAILED" in l or "Error" in l)[-3000:])
except Exception as e:  # timeout or crash: go on to the timings
    say("TESTS did not finish:", repr(e)[:300])
say(f"[{time.time() - T0:.0f}s] tests done")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv41_jax import ops, quant  # noqa: E402
from experiments import bench_kernels as bk  # noqa: E402
from kernels_pallas import gpu_attention, gpu_indexer  # noqa: E402

ROWS = []
KW = {"interpret": True} if DRY else {}
if DRY:
    bk.KW.update(KW)


def record(piece, shape, name, fn, args, perturb, moved, peak, check=None, **extra):
    """Times fn(*args) with TIMER and adds check(output of the timed program) (a dict) to the row's extras."""
    if left() < 15:
        say(f"  skip {piece} {shape} {name}: out of time")
        return None
    t0 = time.time()
    try:
        t, info, got = TIMER(fn, args, perturb)
        if check is not None:
            try:
                extra.update(check(got))
            except Exception as e:
                extra["check_error"] = str(e)[:200]
        del got
        row = dict(piece=piece, shape=shape, variant=name, us=t * 1e6, frac_peak=moved / t / peak, MB=moved / 1e6,
                   **info, **extra)
        say(f"  {piece:9s} {shape:12s} {name:34s} {t * 1e6:9.1f} us  {100 * row['frac_peak']:5.1f}% of copy  "
            f"{info}  {extra}  ({time.time() - t0:.0f}s)")
    except Exception as e:
        row = dict(piece=piece, shape=shape, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}")
        say(f"  {piece:9s} {shape:12s} {name:34s} FAILED {row['error'][:400]}")
        traceback.print_exc(file=LOG)
    ROWS.append(row)
    with open(os.path.join(OUT, "rows.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    return row


try:  # the HBM timer (Pallas L2 flush + profiler); if it cannot run here, wall time of a loop (L2-hot)
    bk.time_hbm_output(lambda x, w: x + w[0, 0], (jnp.ones((8,)), jnp.ones((8, 32))), 1)
    TIMER = bk.time_hbm_output  # (seconds, details, the timed program's output)
except Exception as e:
    say(f"time_hbm FAILED ({type(e).__name__}: {str(e)[:300]}); timing with time_op (inputs may stay in L2)")
    TIMER = lambda fn, args, perturb: (bk.time_op(fn, args, perturb=perturb), {"timer": "time_op"},  # noqa: E731
                                       fn(*args))  # time_op keeps no output: one more call for the check
peak = (bk.hbm_copy_bandwidth if TIMER is bk.time_hbm_output else bk.copy_bandwidth)(0.05 if DRY else 1.0)  # as the rows
say(f"device {jax.devices()[0].device_kind}; copy {peak / 1e9:.0f} GB/s (read + write) = peak")

# ---------------------------------------------------------------- 2. indexer scan
SCAN = [(128, 4), (256, 8)]  # (positions per tile, warps)


def scan_fn(block_n, warps):
    return lambda q, w, v, s, r: gpu_indexer.indexer_scores(q, w, v, s, r, block=bk.BLOCK, block_n=block_n,
                                                             num_warps=warps, **KW)


def bench_scan(ctx, b, configs, ref_check):
    q, w, rec = bk.index_data(jax.random.key(ctx + b), b, ctx)
    reach = jnp.full((b,), ctx, jnp.int32)
    args = (q, w, rec["values"], rec["scales"], reach)
    moved = bk.nbytes(rec) + b * ctx * 4 + b * (ctx // bk.BLOCK) * 4 + bk.nbytes(q, w)
    if ref_check:
        ref = ops.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY)
    else:
        ref = scan_fn(128, 4)(*args)[0]
    out = []
    if not ref_check:  # the loads alone (same grid, no decode or dot): what the memory system gives this scan
        for bn, warps in ((128, 4), (256, 8)):
            fn = lambda q, w, v, s, r, bn=bn, warps=warps: bk.scan_stage(q, w, v, s, stage="read", block_n=bn,
                                                                          num_warps=warps, **KW)
            out.append(record("scan", f"{ctx // 1024}K x{b}", f"loads only, tile {bn} / {warps} warps", fn, args, 1,
                              bk.nbytes(rec) + b * ctx * 4, peak))

    def check(got):
        return {"max_rel_err": bk.max_rel_err(got[0], ref), "vs": "jnp" if ref_check else "f16 kernel"}

    for bn, warps in configs:
        out.append(record("scan", f"{ctx // 1024}K x{b}", f"f16 tile {bn} / {warps} warps",
                          scan_fn(bn, warps), args, 1, moved, peak, check=check))
    return [r for r in out if r and "us" in r]


say(f"[{time.time() - T0:.0f}s] scan")
bench_scan(1 << (8 if DRY else 20), 8, SCAN, ref_check=False)
bench_scan(1 << (7 if DRY else 17), 8, SCAN, ref_check=True)

# ---------------------------------------------------------------- 3. sparse attention, 128K entries
# (splits, key tile, head block, warps); the first of each batch was the default of that run
ATT = {64: [(3, 64, None, 8), (1, 32, 16, 4), (2, 32, 32, 8), (1, 64, 16, 4)],  # 2 + 2
       1: [(8, 64, None, 8), (20, 32, 16, 4), (10, 64, 16, 4)]}


def attention_case(b, ctx=1 << (10 if DRY else 17)):
    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(b), b, ctx, jnp.float32)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx)
    args = bk.attention_args(q, window, wvalid, entries, idx, sink)
    ref = ops.sparse_attention_decode(q, window, wvalid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink,
                                      bk.D_ATT ** -0.5)
    return args, moved, ref


def bench_attention(b, configs, case):
    args, moved, ref = case
    scale = bk.D_ATT ** -0.5
    for splits, tk, hb, warps in configs:
        def fn(q, wv, ws, ok, ev, es, idx, sink, splits=splits, tk=tk, hb=hb, warps=warps):
            return gpu_attention.sparse_attention(q, wv, ws, ok, ev, es, idx, sink, scale, splits=splits,
                                                  block_k=tk, head_block=hb, num_warps=warps, **KW)
        name = f"flash s{splits} tk{tk}" + (f" hb{hb}" if hb else "") + f" w{warps}"
        record("attention", f"128K x{b}", name, fn, args, 7, moved, peak,
               check=lambda got: {"rel_err": bk.rel_err(got, ref)})


cases = {}
for b in (64, 1):
    try:
        cases[b] = attention_case(b)
    except Exception as e:
        say(f"  attention batch {b} setup FAILED: {str(e)[:300]}")
for first in (True, False):  # the most telling configurations of both batches first, then the rest
    for b in cases:
        say(f"[{time.time() - T0:.0f}s] attention batch {b}")
        cut = 2
        configs = ATT[b][:cut] if first else ATT[b][cut:]
        bench_attention(b, configs[:2] if DRY else configs, cases[b])
        if DRY:
            break

# ---------------------------------------------------------------- 4. table
say(f"\n[{time.time() - T0:.0f}s] SUMMARY (peak = copy {peak / 1e9:.0f} GB/s; us = GPU time per call from HBM, "
    "all its kernels; pallas = its Pallas kernels only)")
say(f"{'piece':9s} {'shape':11s} {'variant':34s} {'us':>8s} {'pallas':>8s} {'%copy':>6s} {'err':>8s}")
for r in ROWS:
    if "us" not in r:
        say(f"{r['piece']:9s} {r['shape']:11s} {r['variant']:34s} FAILED {r['error'][:80]}")
        continue
    err = r.get("max_rel_err", r.get("rel_err"))
    say(f"{r['piece']:9s} {r['shape']:11s} {r['variant']:34s} {r['us']:8.1f} {r.get('pallas_us', 0):8.1f} "
        f"{100 * r['frac_peak']:6.1f} {err if err is None else format(err, '8.1e')}")
