"""Issue 21 on one H200: the Hopper indexer scan (`kernels_pallas.gpu_indexer_wgmma`), its GPU tests, then
timed from HBM (L2 flushed before every call, `bench_kernels.time_hbm`) against the Triton scan
at 128K and 1M positions x batch 8, with the copy bandwidth of the same run. Table last; logs under $OUT. The
variants (VARIANTS): q as bf16 hi + lo or q alone (the model's FP4-grid queries, which `index_data` draws, are
exact in bf16), CTAs wanted (264 = 2 per SM of an H200), 64-position tiles per pipeline step, pipeline stages.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_wgmma_scan      (~2.5 min)
"""

import functools

from experiments.bench_kernels import hbm_copy_bandwidth
from experiments.device_runs.issue21_alu_decode import print_table, scan_table, tests
from kernels_pallas import gpu_indexer, gpu_indexer_wgmma

# (q parts, CTAs wanted, tiles per step, stages); the seventeenth session's default first. Eighteenth session
# (1M x 8): q x1 / 528 CTAs / 2 tiles / 2 stages 50.2% of the copy, 1056 CTAs / 4 tiles 54.5%, against 37.8%
# for the first; then the epilogue's fma (fewer instructions per tile: the kernel is issue-bound).
VARIANTS = [(2, 264, 1, 6), (1, 1056, 4, 2), (1, 1056, 2, 2), (1, 528, 4, 2), (1, 1056, 4, 3)]


def main() -> int:
    tests(["tests/test_indexer_wgmma.py"])
    peak = hbm_copy_bandwidth(1.0)
    calls = {f"wgmma q x{p}, {c} CTAs, {t} tile(s)/step, {st} stages": functools.partial(
        gpu_indexer_wgmma.indexer_scores_wgmma, q_parts=p, ctas=c, tiles_per_step=t, stages=st)
        for p, c, t, st in VARIANTS}
    calls["triton f16"] = gpu_indexer.indexer_scores
    print_table(peak, scan_table(peak, calls, check=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
