"""The XLA options the project's programs compile with, decided in one place, and the jit that passes them.

On a GPU, XLA records each run of fusions between custom calls as a command buffer (a CUDA graph) and by default
chains its kernels in the order it scheduled them; CONCURRENT records only their data dependencies, so that a
decode step's small kernels (norms, routing, mHC, the attention's glue) run beside its weight streams. H200, the
v41 slice at batch 1: 1.63 -> 1.46 ms per step, the same tokens and cache bits (docs/BENCHMARKS.md, twenty-first
pass). Other backends compile without it, and so do programs on a mesh (api's `placement=`: not measured there).

JAX takes compiler options on top-level jits only (staging one inside another trace is an error), and the api's
functions also run inside a caller's jit, scan, eval_shape, vmap or grad: `jit` passes the options only when
called at top level; elsewhere the call is traced into the caller's program, which compiles with the caller's
options. An option the user's XLA_FLAGS set is left to the flag.
"""

from __future__ import annotations

import os

import jax
from jax._src import core as jax_core  # trace_state_clean: no public equivalent in jax 0.11

GPU_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def options(backend: str, xla_flags: str) -> dict:
    """The options of a compile for `backend` ("gpu", "cpu", "tpu": jax.default_backend()): GPU_OPTIONS on a GPU
    less those the user's XLA_FLAGS set (an option passed to a compile overrides the flag, and a flag given
    explicitly, e.g. `--xla_gpu_command_buffer_scheduling_mode=LHS` (XLA's default) to compare, wins); none on other
    backends, whose gain was never measured and whose compilers need not take xla_gpu_ options."""
    if backend not in ("gpu", "cuda", "rocm"):
        return {}
    given = {flag.split("=", 1)[0].lstrip("-") for flag in xla_flags.split()}
    return {k: v for k, v in GPU_OPTIONS.items() if k not in given}


_backend = jax.default_backend  # the backend a top-level program compiles for (tests stand a GPU in)


class jit:  # noqa: N801 - used as jax.jit is
    """`jax.jit(fn, **kwargs)` with `options(...)` for the default backend at top level (decided at the first use,
    once the backend is up), without them inside another trace. Attributes (`lower`, `trace`, `eval_shape`, ...)
    are the top-level program's."""

    def __init__(self, fn, **kwargs):
        self._fn, self._kwargs, self._top = fn, kwargs, None
        self.nested = jax.jit(fn, **kwargs)

    @property
    def top(self):
        if self._top is None:
            opts = options(_backend(), os.environ.get("XLA_FLAGS", ""))
            self._top = jax.jit(self._fn, compiler_options=opts, **self._kwargs)
        return self._top

    def __call__(self, *args, **kwargs):
        return (self.top if jax_core.trace_state_clean() else self.nested)(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.top, name)
