"""Issue 21 on one GPU (thirty-seventh session): the wgmma attention's L2 prefetch in the order its data is needed,
`bench_kernels.time_hbm` without a loop's kernels, and the scan at 128K x 8 over CTAs x pipeline stages.

Groups (default: tests attention scan sweep):
- tests: the scan's and the attention's GPU tests, compiled (`test_the_prefetch_changes_no_output`: the prefetch,
  its id loads clamped into idx, leaves the output exactly as without it);
- attention, scan: `issue21_timeline`'s groups (timed from HBM, with the CTAs' timelines);
- sweep: the scan at 128K x 8 and 1M x 8 over (CTAs wanted, tiles per step, pipeline stages): the default, one
  wave of 4 CTAs per SM, and deeper pipelines with the CTAs that fit (shared memory: q 16 KB + 17 KB per stage of
  4 tiles), each timed, at 128K with its timeline;
- ablate: the attention at batch 64 (q bf16) with parts left out (`skip`: the decode, each decoder's rows
  apart and the entry rows' loads since the forty-fourth session, the logits' wgmmas, the p . v's, both wgmmas, all
  three, the store, the merge's exchange), timed from HBM: what each part costs in the kernel as it is (first
  run in the thirty-eighth session's call 1, then by `issue21_roles`);
- ptx: the attention kernel's PTX and ptxas report at batch 64 and the scan's at 128K x 8 (since the fortieth
  session; Mosaic GPU's dumps, under $OUT/mgpu), for ptxas
  here (`ptxas -arch=sm_90a -v`: registers, spills, whether it serializes the wgmmas).
The group `before` (`attention`'s and `scan`'s timings in a copy of the tree with every row prefetched before q
and the timing loop a fori_loop) ran at d5eba4e; its revert list is in that commit. Two A/Bs of candidates not kept
ran at their commits (docs/BENCHMARKS.md): whole_decode (call 3, c6539c2: the next
tile's decode split, half under the logits' wgmmas and half under the p . v's) and both_logits (call 5, 92ac229:
each warpgroup's logits over its channel half, summed through shared memory; call 4 at 8bc8151 failed to launch).

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_prefetch [GROUP ...]     (~8 min)

Logs and a table per group under $OUT.
"""

import functools
import os
import shutil
import subprocess
import sys

from experiments.device_runs._steps import OUT
from experiments.device_runs.issue21_timeline import run_groups, timed_row, timeline

# the sweep's (CTAs wanted, tiles per step, stages): the default (2112: 16 a SM over the call, ~4 resident), one
# wave of 4 a SM, 3 stages (3 fit an SM), 4 stages of 2 tiles (4 fit), 5 stages (2 fit)
SWEEP = ((2112, 4, 2), (528, 4, 2), (396, 4, 3), (528, 2, 4), (264, 4, 5))


def sweep_group(say, rows) -> None:
    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_indexer_wgmma as scan

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    for ctx in (131072, 1048576):
        q, w, rec = bk.index_data(jax.random.key(ctx), 8, ctx)
        args = (q, w, rec["values"], rec["scales"], jnp.full((8,), ctx - 5, jnp.int32))
        moved = bk.nbytes(rec) + 8 * ctx * 4
        for ctas, tiles, stages in SWEEP:
            fn = functools.partial(scan.indexer_scores_wgmma, q_parts=1, ctas=ctas, tiles_per_step=tiles, stages=stages)
            timed_row(say, rows, "scan", f"{ctx} x 8, {ctas} CTAs, {tiles} tiles x {stages} stages", fn, args, 1,
                      moved, peak)
            if ctx == 131072:
                say("timeline", timeline(lambda *a, fn=fn: fn(*a, timeline=True)[1], args, scan.TIMELINE))
        del q, w, rec, args


# Each kernel compiled and run once (the attention at batch 64, the scan at 128K x 8, the dispatch's q_parts 1), in a
# process that dumps Mosaic GPU's PTX and ptxas report: {kernel: (the snippet, the dumps' name)}
PTX_SNIPPETS = {
    "attention": ("""
import functools, jax
from experiments import bench_kernels as bk
from kernels_pallas import gpu_attention_wgmma as att
q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(0), 64, 1 << 17)
fn = functools.partial(att.sparse_attention_wgmma, scale=bk.D_ATT ** -0.5)
print(float(fn(*bk.attention_args(q, window, wvalid, entries, idx, sink)).sum()))
""", "sparse_attention"),
    "scan": ("""
import jax, jax.numpy as jnp
from experiments import bench_kernels as bk
from kernels_pallas import gpu_indexer_wgmma as scan
q, w, keys = bk.index_data(jax.random.key(1), 8, 1 << 17)
reach = jnp.full((8,), (1 << 17) - 5, jnp.int32)
print(float(jnp.nan_to_num(scan.indexer_scores_wgmma(q, w, keys["values"], keys["scales"], reach, q_parts=1)).sum()))
""", "indexer_scores"),
}


# The logits' and the p . v's wgmmas also apart (fortieth session): whether the logits' (both operands read from
# shared memory, N = 64) cost more than their share of the tensor cores' work
ABLATED = ((), ("decode",), ("decode1",), ("decode2",), ("rows",), ("qk",), ("pv",), ("qk", "pv"), ("decode", "qk", "pv"),
           ("store",), ("exchange",))


def ablate_group(say, rows) -> None:
    import jax

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    peak = bk.hbm_copy_bandwidth(1.0)
    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(64), 64, 1 << 17)
    args = bk.attention_args(q, window, wvalid, entries, idx, sink)
    moved = bk.attention_bytes(q, window, wvalid, entries, idx)
    for skip in ABLATED:
        fn = functools.partial(att.sparse_attention_wgmma, scale=bk.D_ATT ** -0.5, skip=skip)
        timed_row(say, rows, "attention", f"128K x 64, q bf16, without {', '.join(skip) or 'nothing'}", fn, args, 7,
                  moved, peak)


def ptx_group(say, kernels=tuple(PTX_SNIPPETS)) -> None:
    """`kernels`' (of PTX_SNIPPETS) PTX and ptxas reports under $OUT/mgpu."""
    tmp = "/tmp/mgpu_dump"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "MOSAIC_GPU_DUMP_PTX": "1",
           "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": tmp, "PYTHONPATH": "."}
    snippet = "".join(PTX_SNIPPETS[k][0] for k in kernels)
    run = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=240, env=env)
    say("ptx dump rc", run.returncode, (run.stdout + run.stderr)[-1500:])
    os.makedirs(os.path.join(OUT, "mgpu"), exist_ok=True)
    for f in sorted(os.listdir(tmp)):
        if any(PTX_SNIPPETS[k][1] in f for k in kernels) and f.endswith((".ptx", ".ptxas")):
            shutil.copy(os.path.join(tmp, f), os.path.join(OUT, "mgpu", f))
            say("dumped", f)


def main(groups: list[str]) -> int:
    return run_groups(groups, {"sweep": sweep_group, "ablate": ablate_group, "ptx": lambda say, rows: ptx_group(say)})


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["tests", "attention", "scan", "sweep"]))
