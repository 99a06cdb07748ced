"""`compile_options.jit`: on a GPU the api's programs carry `compile_options.GPU_OPTIONS` when called at top level
(XLA's CONCURRENT command-buffer scheduling: docs/BENCHMARKS.md, twenty-first pass), other backends none; the
options compile; an option set in XLA_FLAGS is left to it; and the api still runs inside a caller's jit /
eval_shape / scan, where JAX refuses compiler options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import api, compile_options
from tests.configs import TINY5

CFG = TINY5
PARAMS = d.init_params(CFG, seed=0)
B = 2


def _options(traced) -> dict:
    return dict(traced._params["compiler_options_kvs"])  # what jit hands the compile (jax 0.11)


def _trace_forward(jitted):
    cache = jax.eval_shape(lambda: d.init_cache(CFG, B, 64))
    return jitted.trace(CFG, api.abstract_params(CFG), cache, jax.ShapeDtypeStruct((B, 1), jnp.int32),
                        jax.ShapeDtypeStruct((B,), jnp.int32), kernels="jnp")


def test_options_by_backend_and_xla_flags():
    key = next(iter(compile_options.GPU_OPTIONS))
    assert compile_options.options("gpu", "") == compile_options.GPU_OPTIONS
    assert compile_options.options("cpu", "") == {} and compile_options.options("tpu", "") == {}
    rest = {k: v for k, v in compile_options.GPU_OPTIONS.items() if k != key}
    assert compile_options.options("gpu", f"--xla_dump_to=/tmp/x --{key}=LHS") == rest
    assert compile_options.options("gpu", f"--{key}_other=1") == compile_options.GPU_OPTIONS  # another flag


def test_a_gpu_program_carries_the_options(monkeypatch):
    """The api's jit on a GPU (the backend stood in for): the forward program's options are GPU_OPTIONS; every
    one-device program of the api is such a jit."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(compile_options, "_backend", lambda: "gpu")
    as_on_gpu = compile_options.jit(api.forward, static_argnames=api._STATIC)
    assert _options(_trace_forward(as_on_gpu)) == compile_options.GPU_OPTIONS
    programs = ("_forward_jit", "_forward_donating", "_generate_jit", "_encode_jit", "_speculative_prefill_jit",
                "_speculative_generate_jit")
    assert all(isinstance(getattr(api, name), compile_options.jit) for name in programs)


def test_gpu_options_are_valid_options():
    """An option XLA does not know, or a value it does not take, fails the compile (XLA's DebugOptions are one
    message for every backend, so the CPU's compile checks the GPU's names and values): these compile."""
    jax.jit(lambda x: x + 1, compiler_options=compile_options.GPU_OPTIONS).lower(jnp.ones(2)).compile()
    with pytest.raises(Exception, match="not a valid enum value"):
        bad = {k: "NOT_A_MODE" for k in compile_options.GPU_OPTIONS}
        jax.jit(lambda x: x + 2, compiler_options=bad).lower(jnp.ones(2)).compile()


def test_the_api_runs_inside_a_callers_trace(monkeypatch):
    """JAX raises on compiler options in a nested jit: inside jit, eval_shape and a scan body the api's call is
    traced plainly into the caller's program, with the same logits as at top level (its programs built as on a
    GPU, so that they carry options)."""
    monkeypatch.setattr(compile_options, "_backend", lambda: "gpu")
    monkeypatch.setattr(api, "_forward_jit", compile_options.jit(api.forward, static_argnames=api._STATIC))
    ids = np.array([[3, 5, 7, 9], [2, 4, 6, 8]], np.int32)
    lengths = np.array([4, 3], np.int32)
    cache = d.init_cache(CFG, B, 64)
    want, _ = d.prefill(CFG, PARAMS, cache, ids, lengths)
    assert _options(_trace_forward(api._forward_jit)) == compile_options.GPU_OPTIONS

    def prefill(params, cache, ids, lengths):
        return d.prefill(CFG, params, cache, ids, lengths)

    got, _ = jax.jit(prefill)(PARAMS, cache, ids, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    shape, _ = jax.eval_shape(prefill, PARAMS, cache, ids, lengths)
    assert shape.shape == want.shape

    def body(c, _):
        logits, c = d.prefill(CFG, PARAMS, c, ids, lengths)
        return c, logits

    _, scanned = jax.lax.scan(body, cache, length=1)
    np.testing.assert_allclose(np.asarray(scanned[0]), np.asarray(want), rtol=1e-6, atol=1e-6)
