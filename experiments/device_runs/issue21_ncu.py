"""Issue 21 (fiftieth session): the scan's and the attention's hardware counters, read by Nsight Compute.

Forty-nine sessions placed the kernels' time by ablation and in-kernel timelines; the issue asks for "the profile
that says why" each target is met or not. This runs `ncu --set full` (caches flushed and invalidated before each
replay pass: clean, where the HBM benchmarks' `l2_flush` leaves dirty lines; clocks left alone) on one call of each case, after a warm-up call, and prints
per case the kernel's duration, its DRAM bytes and rate against the copy peak timed in the same run
(`bench_kernels.hbm_copy_bandwidth`), its issue-slot and pipe utilizations, and the warp stall reasons (cycles a
warp waits per issued instruction, by reason). The reports, their raw metrics and the per-SASS-instruction stall
samples come back compressed. First run (H100, fiftieth session; docs/BENCHMARKS.md): the scan at 1M x 8 bound by
instruction issue, at its memory without the decode; the attention latency-bound.

Cases: scan_128k8, scan_1m8 (the dispatch's q_parts 1), scan_1m8_nodecode (the decode replaced by moves:
wrong scores by design), scan_128k8_sm90 and scan_1m8_sm90 (the keys in Hopper's word layout, fifty-first
session), attention_b64 (bf16 q, the model's), or any subset as arguments.

    PYTHONPATH=. python3 -m experiments.device_runs.issue21_ncu [CASE ...]          (~30 s a case on an H100)
    PYTHONPATH=. python3 -m experiments.device_runs.issue21_ncu launch CASE        (what ncu runs)
    python -m experiments.device_runs.issue21_ncu summarize ncu_pages.tar.gz        (here: stall samples by SASS)
"""

import csv
import functools
import glob
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile

from experiments.device_runs._steps import OUT, logger

CASES = {"scan_1m8": (1048576, 8, {}), "attention_b64": None, "scan_128k8": (131072, 8, {}),
         "scan_1m8_nodecode": (1048576, 8, None), "scan_1m8_sm90": (1048576, 8, {"layout": "sm90"}),
         "scan_128k8_sm90": (131072, 8, {"layout": "sm90"})}
KERNEL = {"scan": "indexer_scores_wgmma", "attention": "sparse_attention_wgmma"}
# raw metrics worth a line in the log (the rest stay in the raw csv)
SHOWN = re.compile(r"^(gpu__time_duration\.sum|dram__bytes_(read|write)\.sum|gpu__dram_throughput\.avg\.pct_of_peak_sustained"
                   r"_elapsed|sm__throughput\.avg\.pct_of_peak_sustained_elapsed|smsp__issue_active\.avg\.pct_of_peak_"
                   r"sustained_active|sm__warps_active\.avg\.pct_of_peak_sustained_active|launch__registers_per_thread|"
                   r"launch__occupancy_limit_.*|sm__(inst_executed_)?pipe_.*\.avg\.pct_of_peak_sustained_active|"
                   r"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio)$")


def case_call(case: str):
    """(jitted fn, args, the bytes the call must move) of a case."""
    import jax
    import jax.numpy as jnp

    from experiments import bench_kernels as bk

    if case.startswith("scan"):
        from experiments.bench_wgmma import NO_DECODE
        from experiments.device_runs.issue21_timeline import in_words, scan_case
        from kernels_pallas import gpu_indexer_wgmma as scan

        ctx, b, kw = CASES[case]
        args, moved = scan_case(ctx, b)
        if kw and kw.get("layout") == "sm90":  # the keys as an H100/H200 caches them
            args = in_words(args)
        kw = {"decode_ptx": NO_DECODE} if kw is None else kw
        return jax.jit(functools.partial(scan.indexer_scores_wgmma, q_parts=1, **kw)), args, moved
    from kernels_pallas import gpu_attention_wgmma as att

    q, window, wvalid, entries, idx, sink = bk.attention_data(jax.random.key(64), 64, 1 << 17, jnp.bfloat16)
    args = bk.attention_args(q, window, wvalid, entries, idx, sink)
    fn = jax.jit(functools.partial(att.sparse_attention_wgmma, scale=bk.D_ATT ** -0.5))
    return fn, args, bk.attention_bytes(q, window, wvalid, entries, idx)


def launch(case: str) -> int:
    """Two calls of the case (ncu profiles the second: `--launch-skip 1`); prints the bytes the call must move."""
    import jax

    fn, args, moved = case_call(case)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    print(f"MOVED {moved}", flush=True)
    return 0


def ncu_binary() -> str:
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    if not found:
        raise SystemExit("ncu not found on PATH or under /opt/nvidia/nsight-compute")
    return found if isinstance(found, str) else found[-1]


def raw_rows(path: str) -> list[dict]:
    """An exported raw page (`--page raw --csv --print-units base`) as {metric: value} per profiled kernel, in base
    units (ns, bytes; ncu's csv: names, then units, then a row per kernel)."""
    rows = list(csv.reader(open(path)))
    return [dict(zip(rows[0], r)) for r in rows[2:]] if len(rows) > 2 else []


def as_float(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return float("nan")


def pack(tmp: str) -> None:
    """$OUT/ncu_reports.tar.gz (the reports) and $OUT/ncu_pages.tar.gz (their exported pages), apart: the reports
    may pass the 16 MB a file that comes back."""
    for name, reports in (("ncu_reports", True), ("ncu_pages", False)):
        with tarfile.open(os.path.join(OUT, f"{name}.tar.gz"), "w:gz") as tar:
            for f in sorted(os.listdir(tmp)):
                if f.endswith(".ncu-rep") == reports:
                    tar.add(os.path.join(tmp, f), arcname=f)


def main(cases: list[str]) -> int:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # leave the GPU's memory to the profiled processes
    import jax

    from experiments import bench_kernels as bk

    say, _ = logger("ncu.log")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {list(CASES)}")
    ncu = ncu_binary()
    say("ncu", ncu, subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:])
    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s ({jax.devices()[0].device_kind})")
    # the kernels launched one by one, not as nodes of XLA's command buffers
    env = {**os.environ, "PYTHONPATH": ".", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="}
    tmp = "/tmp/issue21_ncu"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    table = []
    for case in cases:
        rep = os.path.join(tmp, case)
        cmd = [ncu, "--set", "full", "--clock-control", "none", "--target-processes", "all", "--kernel-name",
               f"regex:{KERNEL[case.split('_')[0]]}", "--launch-skip", "1", "--launch-count", "1", "--export", rep,
               "--force-overwrite", sys.executable, "-m", "experiments.device_runs.issue21_ncu", "launch", case]
        say("$", " ".join(cmd[1:]))
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)  # a group: a timeout ends ncu and the program it profiles
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            say(f"[{case}] timed out after 120 s")
            continue
        say(f"[{case}] rc={p.returncode}", stdout[-1500:], stderr[-1500:])
        moved = re.findall(r"^MOVED (\d+)$", stdout, re.M)
        if not os.path.exists(rep + ".ncu-rep") or not moved:
            continue
        for page, extra in (("details", []), ("raw", ["--csv", "--print-units", "base"]),
                            ("source", ["--csv", "--print-source", "sass"])):
            out = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", page, *extra], capture_output=True,
                                 text=True)
            with open(f"{rep}.{page}.{'csv' if extra else 'txt'}", "w") as f:  # ncu's errors after the page
                f.write(out.stdout + (out.stderr[-2000:] if page == "details" else ""))
        for row in raw_rows(f"{rep}.raw.csv"):
            say(f"-- {case}: {row.get('Kernel Name', '?')[:60]}")
            for k in sorted(k for k in row if SHOWN.match(k)):
                say(f"   {k} = {row[k]}")
            ns = as_float(row.get("gpu__time_duration.sum", ""))  # ncu's default unit: ns
            dram = as_float(row.get("dram__bytes_read.sum", "")) + as_float(row.get("dram__bytes_write.sum", ""))
            stalls = sorted(((as_float(v), k) for k, v in row.items()
                             if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("_per_issue_active.ratio")),
                            reverse=True)[:4]
            table.append((case, f"{ns / 1e3:.1f}", f"{100 * int(moved[-1]) / (ns * 1e-9) / peak:.1f}%",
                           row.get("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "?"),
                           row.get("smsp__issue_active.avg.pct_of_peak_sustained_active", "?"),
                           ", ".join(f"{k.split('stalled_')[1].split('_per_issue')[0]} {v:.2f}" for v, k in stalls),
                           f"{dram / 1e6:.1f} MB"))
        pack(tmp)  # after each case: a run cut short keeps what it profiled
    say("\n| case | kernel us (ncu) | % of the copy peak | dram % of ncu's peak | issue active % | top stalls "
        "(cycles per issued instruction) | DRAM bytes |")
    say("|---|---|---|---|---|---|---|")
    for r in table:
        say("| " + " | ".join(r) + " |")
    return 0


def source_pages(pages: str) -> dict[str, list[dict]]:
    """The SASS source pages in a pages tarball (`main`'s ncu_pages.tar.gz): per case, a row per instruction
    ({column: text}; ncu's csv: a kernel-name line, then the header, then the rows)."""
    out = {}
    with tarfile.open(pages) as tar:
        for member in sorted(m.name for m in tar.getmembers() if m.name.endswith(".source.csv")):
            lines = tar.extractfile(member).read().decode(errors="replace").splitlines()
            head = next((i for i, line in enumerate(lines) if line.startswith('"Address","Source"')), None)
            if head is not None:
                out[member.removesuffix(".source.csv")] = list(csv.DictReader(io.StringIO("\n".join(lines[head:]))))
    return out


def opcode(sass: str) -> str:
    """`@!P1 BRA 0x7f..` -> BRA, `HGMMA.64x32x16.F32.BF16 R24, ..` -> HGMMA."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def by_opcode(rows: list[dict], column: str) -> dict[str, float]:
    """A source page's numeric column (e.g. "Instructions Executed": warp instructions) summed by opcode; blanks
    count 0."""
    total: dict[str, float] = {}
    for r in rows:
        v, op = as_float(r.get(column, "")), opcode(r["Source"])
        total[op] = total.get(op, 0.0) + (v if v == v else 0.0)
    return total


def summarize(pages: str, top: int = 25) -> int:
    """Per case in a pages tarball: the warp instructions executed and the stall samples summed by opcode, and the
    `top` instructions by samples with their sampled stall reasons."""
    total_col = "Warp Stall Sampling (All Samples)"
    for case, rows in source_pages(pages).items():
        reasons = [c for c in (rows[0] if rows else ()) if c.startswith("stall_") and "Not Issued" not in c]
        samples = by_opcode(rows, total_col)
        executed = by_opcode(rows, "Instructions Executed")
        everything = sum(samples.values()) or 1.0
        print(f"== {case}: {len(rows)} instructions, {everything:.0f} samples")
        print(f"  executed, warp instructions ({sum(executed.values()) / 1e6:.1f}M):",
              ", ".join(f"{op} {n / 1e6:.2f}M" for op, n in sorted(executed.items(), key=lambda kv: -kv[1])[:18]))
        print("  samples by opcode:", ", ".join(f"{op} {100 * v / everything:.1f}%" for op, v in
                                                 sorted(samples.items(), key=lambda kv: -kv[1])[:16]))
        for r in sorted(rows, key=lambda r: -(v if (v := as_float(r[total_col])) == v else 0))[:top]:
            why = sorted(((as_float(r[c]), c) for c in reasons), reverse=True)[:3]
            print(f"  {100 * as_float(r[total_col]) / everything:5.1f}%  {r['Source'][:70]:70s} "
                  + ", ".join(f"{c} {x:.0f}" for x, c in why if x == x and x > 0))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["launch"]:
        raise SystemExit(launch(argv[1]))
    if argv[:1] == ["summarize"]:
        raise SystemExit(summarize(argv[1]))
    raise SystemExit(main(argv or list(CASES)))
