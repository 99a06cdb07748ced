"""Does this XLA launch its fusions with Programmatic Dependent Launch (PDL) under the XLA_FLAGS it was given?

    PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_pdl=true python3 -m experiments.device_runs.issue12_pdl_probe DIR

Compiles a chain of small dependent fusions (a decode step's shape of work: reductions and elementwise ops on
one row) with the compiled modules dumped to DIR, then counts `griddepcontrol` instructions in the PTX (the
kernel side of PDL: a wait before the first dependent read) and times the chain: GPU microseconds per call from
a profiler trace would need the trace parser, so this prints the wall time of many calls of the chain, median.
In its one run (twenty-fifth session) the dump directory held no `.ptx` files, so its count read 0: where this
XLA writes PTX, if anywhere, is still to be found.
"""

import glob
import os
import statistics
import sys
import time

dump = sys.argv[1]
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


@jax.jit
def chain(x, w):
    """48 dependent small steps: norm-like reductions and elementwise ops on [8, 4096] (each its own kernel)."""
    for i in range(48):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w[i]
        x = jnp.tanh(x) + x[:, ::-1] * 0.5
    return x


x = jax.random.normal(jax.random.key(0), (8, 4096), jnp.float32)
w = jax.random.normal(jax.random.key(1), (48, 4096), jnp.float32)
chain(x, w).block_until_ready()
ptx = "".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptx")))
print(f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}: {len(glob.glob(os.path.join(dump, '*.ptx')))} PTX files, "
      f"{ptx.count('.entry')} kernels, {ptx.count('griddepcontrol.wait')} griddepcontrol.wait, "
      f"{ptx.count('griddepcontrol.launch_dependents')} launch_dependents")
times = []
for _ in range(30):
    t = time.perf_counter()
    for _ in range(20):
        x = chain(x, w)
    x.block_until_ready()
    times.append((time.perf_counter() - t) / 20)
print(f"chain of 48 steps: {statistics.median(times) * 1e6:.1f} us per call (median of 30 x 20 calls)")
