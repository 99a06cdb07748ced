"""One step of a device session script: a python command under a timeout, its output in $OUT/<name>.log."""

import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT") or "/tmp/device_run_out"


def step(name: str, argv: list[str], timeout_s: float, env: dict | None = None) -> int:
    """Run `python argv` (PYTHONPATH=., plus `env`) with stdout and stderr in $OUT/name.log; returns its exit
    code (124: killed at timeout_s, so that a slow step leaves the later ones their time)."""
    os.makedirs(OUT, exist_ok=True)
    t = time.time()
    with open(os.path.join(OUT, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": ".", **(env or {})}, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{name}] rc={rc} in {time.time() - t:.0f} s (log {name}.log)", flush=True)
    return rc
