"""Prefill under the api's command-buffer scheduling (`compile_options.GPU_OPTIONS`, CONCURRENT) against XLA's
default order: time and values. The v41 slice with random weights in the released formats, batch 1, a 256-token
chunk (the engine's default width) onto a random 2048-token cache. Run once per order (the order by XLA_FLAGS,
which `compile_options` leaves to the flag; each run writes $OUT/prefill_logits_<tag>.npz), then `--compare`
says whether two runs' logits are bit-identical (on any machine: the files come back from the device).
The first run (twenty-ninth session) also had a 2048-token prompt: its compile and first call passed 200 s.

    PYTHONPATH=. python3 -m experiments.device_runs.concurrent_prefill api       # the api's default
    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=LHS PYTHONPATH=. python3 -m experiments.device_runs.concurrent_prefill lhs
    python -m experiments.device_runs.concurrent_prefill --compare api.npz lhs.npz
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import api, compile_options
from experiments.bench_decode import random_cache, random_params, slice_config
from experiments.device_runs._steps import OUT

NAME, CHUNK, CACHED = "chunk256_on_2048", 256, 2048  # random_cache leaves 256 positions of room after CACHED
REPS = 10


def run(tag: str) -> None:
    cfg = slice_config(weight_format="fp8")
    params = api.freeze(random_params(cfg))
    print(f"{tag}: options {compile_options.options(jax.default_backend(), os.environ.get('XLA_FLAGS', ''))}",
          flush=True)
    print(f"{NAME}: compiling and running once ...", flush=True)
    cache = random_cache(cfg, 1, CACHED)
    ids = jax.random.randint(jax.random.key(3), (1, CHUNK), 0, cfg.vocab_size)
    n = jnp.full((1,), CHUNK, jnp.int32)
    call = lambda: api.prefill(cfg, params, cache, ids, n, kernels="auto")[0]  # not donated: the same input each time
    t0 = time.perf_counter()
    out = call().block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        call().block_until_ready()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    print(f"| {tag} | {NAME} | {ms:.2f} ms | {CHUNK / ms * 1e3:.0f} tokens/s | first call {compile_s:.1f} s |", flush=True)
    np.savez(os.path.join(OUT, f"prefill_logits_{tag}.npz"), **{NAME: np.asarray(out)})


def compare(a: str, b: str) -> int:
    """Bit-compare two runs' saved logits (paths of their .npz files)."""
    x, y = np.load(a), np.load(b)
    bad = 0
    for name in x.files:
        diff = int(np.sum(x[name] != y[name]))
        bad += diff > 0
        print(f"{name}: {diff} of {x[name].size} logits differ between {a} and {b}"
              f" (max abs {float(np.max(np.abs(x[name] - y[name]))):.3g})")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(*sys.argv[2:4]))
    run(sys.argv[1])
