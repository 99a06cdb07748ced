"""One step of a device session script: a python command under a timeout, its output in $OUT/<name>.log."""

import os
import shutil
import subprocess
import sys
import time

OUT = os.environ.get("OUT") or "/tmp/device_run_out"


def logger(name: str):
    """(say, file): say(*parts) prints a line and writes it to $OUT/name, flushed (a run killed at its timeout keeps
    its lines); file, for tracebacks."""
    os.makedirs(OUT, exist_ok=True)
    file = open(os.path.join(OUT, name), "w")

    def say(*parts):
        msg = " ".join(str(p) for p in parts)
        print(msg, flush=True)
        file.write(msg + "\n")
        file.flush()

    return say, file


def step(name: str, argv: list[str], timeout_s: float, env: dict | None = None, cwd: str | None = None) -> int:
    """Run `python argv` (PYTHONPATH=., plus `env`) in `cwd` (default: here) with stdout and stderr in
    $OUT/name.log; returns its exit code (124: killed at timeout_s, so that a slow step leaves the later ones
    their time)."""
    return steps_together([(name, argv, env or {})], timeout_s, cwd)[0]


def tree_before(reverts: list[tuple[str, str, str]], dest: str = "/tmp/tree_before") -> str:
    """A copy of this tree's packages with changes taken back, for an A/B in one call on one machine: each
    (file, text now, text before) must occur once. Returns the copy's root (a `step` cwd)."""
    shutil.rmtree(dest, ignore_errors=True)
    for package in ("dsv41_jax", "kernels_pallas", "experiments"):
        shutil.copytree(package, os.path.join(dest, package), ignore=shutil.ignore_patterns("__pycache__"))
    for path, now, before in reverts:
        text = open(os.path.join(dest, path)).read()
        if text.count(now) != 1:
            raise ValueError(f"{path}: {now!r} occurs {text.count(now)} times, not once: update the revert list")
        open(os.path.join(dest, path), "w").write(text.replace(now, before))
    return dest


def steps_together(jobs: list[tuple[str, list[str], dict]], timeout_s: float, cwd: str | None = None) -> list[int]:
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
                                                   env={**os.environ, "PYTHONPATH": ".", **share, **env}, cwd=cwd)))
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
