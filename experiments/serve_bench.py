"""The serving load test in one command: start `experiments.serve`, run `experiments.load_test` against it
on loopback, stop the server, and write one JSON (the load test's numbers, the server's settings, its
/metrics and the tail of its log).

    python -m experiments.serve_bench --preset tiny --slots 16 --out runs/serve_tiny.json      # CPU table
    PYTHONPATH=.:.serve_deps python3 -m experiments.serve_bench --preset small --slots 32 --out $OUT/serve_small.json

The second line is the H200 `small` table of docs/BENCHMARKS.md ("HTTP serving under load"). That machine
has JAX but not the server's packages and cannot install any: build them here, with the exact versions,
into a folder the device tool carries (~30 MB; no JAX, no numpy):

    python3.12 -m pip install -q --target .serve_deps -c constraints.txt \\
        fastapi uvicorn prometheus-client jinja2 openai httpx2

This process never imports JAX (it would take the GPU's memory from the server). The whole run is bounded:
--startup-timeout for the server to answer (compiles happen later, in the load test's warm-up request)
and --deadline for the load test; past either it stops the server, writes what it has and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from experiments import _cli, load_test


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON to write (the server's log goes beside it, .log)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--decode-chunk", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt-chars", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for the server to answer /health")
    ap.add_argument("--deadline", type=float, default=180.0, help="seconds for the load test, warm-up included")
    ap.add_argument("--serve-arg", action="append", default=[], help="another flag for experiments.serve "
                    "(repeat; e.g. --serve-arg=--kernels=jnp)")
    return ap.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    _cli.output_file(args.out, "--out")
    log_path = os.path.splitext(args.out)[0] + ".log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "experiments.serve", "--preset", args.preset, "--slots", str(args.slots),
             "--capacity", str(args.capacity), "--decode-chunk", str(args.decode_chunk), "--max-queue",
             str(args.max_queue), "--port", str(port), *args.serve_arg]
    report = dict(serve_command=serve[1:], gpu=gpu_name(), load_test=None, error=None)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:  # the server answers once its weights are built; compiling comes with the first request
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with status {server.returncode}; see {log_path}")
            if time.perf_counter() - t0 > args.startup_timeout:
                raise TimeoutError(f"the server did not answer in {args.startup_timeout:.0f} s; see {log_path}")
            try:
                get(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        report["startup_s"] = time.perf_counter() - t0
        lt = argparse.Namespace(url=url, clients=args.clients, requests=args.requests,
                                prompt_chars=args.prompt_chars, max_tokens=args.max_tokens)
        report["load_test"] = asyncio.run(asyncio.wait_for(load_test.run(lt), args.deadline))
        report["metrics"] = get(url + "/metrics")
    except (RuntimeError, TimeoutError, asyncio.TimeoutError, _cli.UserError) as e:
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        report["total_s"] = time.perf_counter() - t0
        with open(log_path) as f:
            report["server_log_tail"] = f.read()[-3000:]
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    res = report["load_test"]
    if res:
        print(f"{args.preset}: {res['completed']}/{res['requests']} requests, {res['errors']} errors, TTFT p50 "
              f"{res['ttft_p50_s']:.3f} s p99 {res['ttft_p99_s']:.3f} s, {res['tokens_per_s']:.1f} tokens/s "
              f"({res['per_request_decode_tokens_per_s_p50']:.1f} per request p50), wall {res['wall_s']:.1f} s; "
              f"startup {report['startup_s']:.1f} s, total {report['total_s']:.1f} s -> {args.out}")
    if report["error"] or not res or res["errors"]:
        raise SystemExit(f"error: {report['error'] or 'the load test had errors'}; see {args.out}")
    return report


if __name__ == "__main__":
    main()
