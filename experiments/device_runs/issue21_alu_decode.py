"""Issues 21 and 12 on one H200 (nineteenth session): the FP4 decode off the ALU pipe.

The scan and the experts' kernel share `gpu_wgmma.DECODE_PTX`; the FP8 projections' decode got the same
treatment (`FP8_DECODE_PTX`: prmt with the sign byte, one shift, one mask) and K = 1280 / 2304 (`fp8` group). ptxas (sm_90a) turns the eighteenth session's
decode (PREVIOUS_PTX below: shift, shift, mask, lop3 per output) into 12 ALU ops, 3 IMAD and 4 HFMA2 per word
of 8 codes, the new one (mask, multiply, mask) into 9 ALU, 4 IMAD, 4 HFMA2; the ALU pipe issues at half rate.
The scan also finds a row's largest scale byte with two shuffles instead of in each of its 4 threads, and
hands it to the epilogue instead of recomputing it. This run: the GPU tests compiled; the scan at 128K and
1M x 8 (from HBM) with DECODE_PTX, PREVIOUS_PTX and no decode (moves: wrong numbers by design, what the
decode costs), against the Triton scan; the experts' kernel at the v41 shapes with both decodes; then the
scan's and the experts' PTX and ptxas report under $OUT/mgpu.
Table last; logs under $OUT.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_alu_decode [tests | scantests | fp8tests] [ab] [sweep] [fp8] [dump]  (~5 min)
"""

import functools
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax import lax

from experiments.bench_kernels import hbm_copy_bandwidth, index_data, nbytes, time_hbm
from experiments.bench_wgmma import E, NO_DECODE, SHAPES, TOP_K, check, fp8_section, time_loop
from experiments.bench_weights import expert_data
from kernels_pallas import gpu_indexer, gpu_indexer_wgmma, gpu_wgmma

OUT = os.environ.get("OUT") or "/tmp/i21a_out"
PREVIOUS_OUT = ("shr.b32 m, {q}, 6; and.b32 m, m, 0x01C001C0; lop3.b32 m, {q}, 0x80008000, m, 0xEA; "
                "fma.rn.bf16x2 ${i}, m, $5, z; ")
PREVIOUS_PTX = ("{ .reg .b32 q, m, z; mov.b32 z, 0x80008000; " + PREVIOUS_OUT.format(q="$4", i=0)
                + "".join(f"shl.b32 q, $4, {4 * i}; " + PREVIOUS_OUT.format(q="q", i=i) for i in (1, 2, 3)) + "}")
DECODES = {"new decode": gpu_wgmma.DECODE_PTX, "previous decode": PREVIOUS_PTX}
PREVIOUS_FP8_OUT = ("shl.b32 m, t, 4; and.b32 m, m, 0x07F007F0; shl.b32 s, t, 8; lop3.b32 m, s, 0x80008000, m, 0xEA; "
                    "fma.rn.bf16x2 ${i}, m, $3, z; ")
PREVIOUS_FP8_PTX = ("{ .reg .b32 t, m, s, z; mov.b32 z, 0x80008000; prmt.b32 t, $2, 0, 0x4140; "
                    + PREVIOUS_FP8_OUT.format(i=0) + "prmt.b32 t, $2, 0, 0x4342; " + PREVIOUS_FP8_OUT.format(i=1) + "}")
DUMP = """
import jax, jax.numpy as jnp
from experiments.bench_kernels import index_data
from experiments.bench_weights import expert_data
from kernels_pallas import gpu_indexer_wgmma as s, gpu_wgmma as g
q, w, rec = index_data(jax.random.key(0), 8, 1 << 17)
print(s.indexer_scores_wgmma(q, w, rec['values'], rec['scales'], jnp.full((8,), 5000, jnp.int32), q_parts=1).sum())
v, sc = expert_data(jax.random.key(1), 8, 2304, 5120)
x = jax.random.normal(jax.random.key(2), (1, 5120), jnp.bfloat16)
print(g.rows_matmuls_fp4_wgmma(x, [(v, sc)], jnp.arange(6, dtype=jnp.int32))[0].sum())
"""


def tests(paths: list[str]) -> None:
    """The GPU tests in `paths`, compiled (JAX_PLATFORMS=cuda): log under $OUT, tail printed."""
    os.makedirs(OUT, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "JAX_PLATFORMS": "cuda"})
    open(os.path.join(OUT, "tests.log"), "w").write(run.stdout + run.stderr)
    print("\n".join((run.stdout + run.stderr).strip().splitlines()[-8:]), flush=True)


def _row(kind: str, shape: str, variant: str, us: float, kernel_us, kernels, moved: int, peak: float, err="-"):
    """One table row (and its line on stdout): GB/s and % of the copy peak from the bytes moved per call."""
    gbs = moved / (us * 1e-6) / 1e9
    row = (kind, shape, variant, f"{us:.1f}", str(kernel_us), str(kernels), f"{gbs:.0f}", f"{100 * gbs * 1e9 / peak:.1f}%",
           err)
    print(" | ".join(row), flush=True)
    return row


def scan_error(got, ref) -> str:
    """Scores against the reference's: the largest difference over its finite scores, relative to their largest,
    and whether the -inf pattern is the same."""
    fin = jnp.isfinite(ref)
    rel = jnp.max(jnp.where(fin, jnp.abs(got - ref), 0)) / jnp.max(jnp.where(fin, jnp.abs(ref), 0))
    same = bool(jnp.array_equal(jnp.isinf(got), jnp.isinf(ref)))
    return f"{float(rel):.1e}, -inf {'same' if same else 'DIFFERENT'}"


def scan_table(peak: float, calls: dict, check: bool) -> list[tuple]:
    """Each scan of `calls` (name -> fn(q, w, values, scales, reachable)) at 128K and 1M positions x 8, timed from
    HBM (`time_hbm`); with `check`, first its max difference to the Triton f16 scan over the finite scores (of
    the largest) and whether its -inf pattern is the same (until 2026-12-05 the reference was the Triton FP8
    scan, since removed: exact to the same twin)."""
    rows = []
    for ctx, b in ((131072, 8), (1048576, 8)):
        q, w, rec = index_data(jax.random.key(ctx), b, ctx)
        args = (q, w, rec["values"], rec["scales"], jnp.full((b,), ctx - 5, jnp.int32))
        moved = nbytes(rec) + b * ctx * 4
        ref = gpu_indexer.indexer_scores(*args) if check else None
        for name, fn in calls.items():
            try:
                err = "-"
                if ref is not None:
                    err = scan_error(fn(*args), ref)
                t, info = time_hbm(fn, args, perturb=1)
                rows.append(_row("scan", f"{ctx} x {b}", name, t * 1e6, info["pallas_us"], info["kernels"], moved, peak,
                                 err))
            except Exception as ex:  # noqa: BLE001 -- report and go on
                print(f"scan {ctx} x {b} {name}: FAILED {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
        del q, w, rec, args, ref
    return rows


def scan_rows(peak: float) -> list[tuple]:
    """The scan with DECODE_PTX, PREVIOUS_PTX and no decode, and the Triton f16 scan, each checked."""
    calls = {f"wgmma, {name}": functools.partial(gpu_indexer_wgmma.indexer_scores_wgmma, q_parts=1, decode_ptx=ptx)
             for name, ptx in {**DECODES, "NO DECODE (moves)": NO_DECODE}.items()}
    calls["triton f16"] = gpu_indexer.indexer_scores
    return scan_table(peak, calls, check=True)


def expert_rows(peak: float, reps: int = 64) -> list[tuple]:
    rows, key = [], jax.random.key(0)
    for name, (n, k) in SHAPES.items():
        values, scales = expert_data(jax.random.fold_in(key, n), E, n, k)
        for label, ptx in DECODES.items():
            check(name, label, {"decode_ptx": ptx}, values, scales, key)
        for tokens in (1, 8):
            m = tokens * TOP_K
            ids_r = lax.top_k(jax.random.uniform(jax.random.fold_in(key, m), (reps, tokens, E)),
                              TOP_K)[1].astype(jnp.int32).reshape(reps, m)
            x = jax.random.normal(key, (tokens, k), jnp.bfloat16)
            moved = m * n * (k // 2 + k // 32)
            for label, ptx in DECODES.items():
                call = functools.partial(gpu_wgmma.rows_matmuls_fp4_wgmma, decode_ptx=ptx)
                one = lambda x, v, s, i, call=call: call(x, [(v, s)], i)[0]  # noqa: E731
                kern, _, _ = time_loop(one, x, values, scales, ids_r, "fp4_rows_wgmma")
                rows.append(_row("experts", f"{name} {m} rows", label, kern, f"{kern:.1f}", "-", moved, peak))
        del values, scales
    return rows


def dump() -> None:
    tmp = "/tmp/mgpu_dump"
    os.makedirs(tmp, exist_ok=True)  # the SASS needs nvdisasm, which the machine lacks: ptxas + nvdisasm here
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "MOSAIC_GPU_DUMP_PTX": "1",
           "MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": tmp, "PYTHONPATH": "."}
    run = subprocess.run([sys.executable, "-c", DUMP], capture_output=True, text=True, timeout=120, env=env)
    open(os.path.join(OUT, "dump.log"), "w").write(run.stdout + run.stderr[-20000:])
    print("dump:", run.returncode, (run.stdout + run.stderr)[-1500:], flush=True)
    os.makedirs(os.path.join(OUT, "mgpu"), exist_ok=True)
    names = sorted(os.listdir(tmp)) if os.path.isdir(tmp) else []
    print(f"dump: {len(names)} files, e.g. {names[:6]}", flush=True)
    ours = [f for f in names if "indexer_scores_wgmma" in f or "fp4_rows_wgmma" in f]
    for f in [f for f in (ours or names) if f.endswith((".ptx", ".ptxas"))][:8]:  # names without the kernel's: all
        shutil.copy(os.path.join(tmp, f), os.path.join(OUT, "mgpu", f))


def sweep_rows(peak: float) -> list[tuple]:
    """The scan (new decode) over CTAs wanted (third call: 1056 / 1312 / 2112 gave 68.2 / 69.7 / 69.6% at 1M x 8;
    one wave of 5 per SM, 656, and 528 no faster in the second) and tiles per step x stages: at 80 registers
    (ptxas, fourth call) shared memory limits an SM to 5 CTAs of 4 tiles x 2 stages (44 KB); 2 tiles x 2 or
    3 stages (26-35 KB) let 6 share it."""
    return scan_table(peak, {f"{ctas} CTAs, {tiles} tiles/step, {stages} stages": functools.partial(
        gpu_indexer_wgmma.indexer_scores_wgmma, q_parts=1, ctas=ctas, stages=stages, tiles_per_step=tiles)
        for ctas, tiles, stages in ((2112, 4, 2), (2112, 2, 2), (2112, 2, 3), (3168, 2, 2), (1584, 4, 2))}, check=False)


def fp8_rows(peak: float) -> list[tuple]:
    """The FP8 projections of a v41 layer (`bench_wgmma.fp8_section`: checked, then timed from HBM) with the new
    FP8 decode, the previous one, and Triton; K = 1280 and 2304 (wq_b, index wq_b, shared w2) now on wgmma."""
    table, failed = fp8_section(jax.random.key(0), peak, 16,
                                lambda k, tiles: {"wgmma, previous FP8 decode": {"decode_ptx": PREVIOUS_FP8_PTX}})
    print(f"FP8 checks failed: {failed}", flush=True)
    return [("fp8", f"{op} x{m}", label, us, us, "-", gbs, pct, "-") for op, m, label, us, gbs, pct in table]


GROUPS = {"ab": lambda peak: scan_rows(peak) + expert_rows(peak), "sweep": sweep_rows, "fp8": fp8_rows}


def print_table(peak: float, rows: list[tuple]) -> None:
    print(f"\ncopy peak {peak / 1e9:.0f} GB/s\n| kernel | shape | variant | GPU us | kernel us | kernels | GB/s | % of copy | "
          "max rel diff vs triton f16, -inf pattern |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main(argv: list[str]) -> int:
    """argv: groups to run (default: tests ab dump; scantests: the scan's tests alone)."""
    groups = argv or ["tests", "ab", "dump"]
    os.makedirs(OUT, exist_ok=True)
    if "tests" in groups or "scantests" in groups:
        tests(["tests/test_indexer_wgmma.py"] + (["tests/test_wgmma_kernel.py"] if "tests" in groups else []))
    if "fp8tests" in groups:
        tests(["tests/test_wgmma_kernel.py", "-k", "fp8"])
    peak = hbm_copy_bandwidth(1.0)
    rows = [r for g in groups if g in GROUPS for r in GROUPS[g](peak)]
    if "dump" in groups:
        dump()
    print_table(peak, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
