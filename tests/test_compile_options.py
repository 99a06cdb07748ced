"""`compile_options.jit`: the api's programs carry COMPILER_OPTIONS when called at top level (XLA's CONCURRENT
command-buffer scheduling on a GPU: docs/BENCHMARKS.md, twenty-first pass), the options compile on this backend,
and the api still runs inside a caller's jit / eval_shape / scan, where JAX refuses compiler options."""

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


def _abstract_cache():
    return jax.eval_shape(lambda: d.init_cache(CFG, B, 64))


@pytest.mark.parametrize("jitted", ["_forward_jit", "_forward_donating"])
def test_forward_programs_carry_the_options(jitted):
    traced = getattr(api, jitted).trace(CFG, api.abstract_params(CFG), _abstract_cache(),
                                        jax.ShapeDtypeStruct((B, 1), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
                                        kernels="jnp")
    assert _options(traced) == compile_options.COMPILER_OPTIONS


def test_generate_program_carries_the_options():
    row = lambda dt: jax.ShapeDtypeStruct((B,), dt)  # noqa: E731
    traced = api._generate_jit.trace(CFG, api.abstract_params(CFG), _abstract_cache(), row(jnp.int32),
                                     row(jnp.float32), row(jnp.uint32), row(jnp.int32), row(jnp.int32),
                                     jax.ShapeDtypeStruct((B, 1), jnp.int32), n_steps=2, kernels="jnp")
    assert _options(traced) == compile_options.COMPILER_OPTIONS


def test_options_are_valid_for_this_backend():
    """An option XLA does not know, or a value it does not take, fails the compile: these compile."""
    jax.jit(lambda x: x + 1, compiler_options=compile_options.COMPILER_OPTIONS).lower(jnp.ones(2)).compile()
    with pytest.raises(Exception, match="not a valid enum value"):
        bad = {k: "NOT_A_MODE" for k in compile_options.COMPILER_OPTIONS}
        jax.jit(lambda x: x + 2, compiler_options=bad).lower(jnp.ones(2)).compile()


def test_the_api_runs_inside_a_callers_trace():
    """JAX raises on compiler options in a nested jit: inside jit, eval_shape and a scan body the api's call is
    traced plainly into the caller's program, with the same logits as at top level."""
    ids = np.array([[3, 5, 7, 9], [2, 4, 6, 8]], np.int32)
    lengths = np.array([4, 3], np.int32)
    cache = d.init_cache(CFG, B, 64)
    want, _ = d.prefill(CFG, PARAMS, cache, ids, lengths)

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


def test_an_option_set_in_xla_flags_is_left_to_the_flag():
    key = next(iter(compile_options.DEFAULTS))
    assert compile_options.options("") == compile_options.DEFAULTS
    assert compile_options.options(f"--xla_dump_to=/tmp/x --{key}=LHS") == {k: v for k, v in
                                                                               compile_options.DEFAULTS.items() if k != key}
    assert compile_options.options(f"--{key}_other=1") == compile_options.DEFAULTS  # a longer name is another flag
