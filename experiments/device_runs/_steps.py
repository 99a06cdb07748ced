"""One step of a device session script: a python command under a timeout, its output in $OUT/<name>.log."""

import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT") or "/tmp/device_run_out"


def step(name: str, argv: list[str], timeout_s: float, env: dict | None = None) -> int:
    """Run `python argv` (PYTHONPATH=., plus `env`) with stdout and stderr in $OUT/name.log; returns its exit
    code (124: killed at timeout_s, so that a slow step leaves the later ones their time)."""
    return steps_together([(name, argv, env or {})], timeout_s)[0]


def steps_together(jobs: list[tuple[str, list[str], dict]], timeout_s: float) -> list[int]:
    """Run several `python argv` (name, argv, env) at once on the one machine, each logged as `step` does, the
    GPU memory split between them (JAX would otherwise reserve 75% of it in each process); returns their exit
    codes (124: killed at timeout_s). A GPU time-slices between processes: this overlaps their compiles and
    fills the gaps a single small program leaves, it does not add compute."""
    os.makedirs(OUT, exist_ok=True)
    share = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / len(jobs):.2f}"} if len(jobs) > 1 else {}
    t, procs = time.time(), []
    for name, argv, env in jobs:
        log = open(os.path.join(OUT, f"{name}.log"), "w")
        procs.append((name, log, subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                                   env={**os.environ, "PYTHONPATH": ".", **share, **env})))
    rcs = []
    for name, log, p in procs:
        try:
            rc = p.wait(timeout=max(1.0, timeout_s - (time.time() - t)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = 124
        log.close()
        print(f"[{name}] rc={rc} in {time.time() - t:.0f} s (log {name}.log)", flush=True)
        rcs.append(rc)
    return rcs
