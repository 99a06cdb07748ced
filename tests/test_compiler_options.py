"""The api's compiled programs carry `api.COMPILER_OPTIONS` (XLA's CONCURRENT command-buffer scheduling on a
GPU: docs/BENCHMARKS.md, twenty-first pass), and those options compile on this backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import dsv41_jax as d
from dsv41_jax import api
from tests.configs import TINY5

CFG = TINY5
B = 2


def _abstract():
    params = api.abstract_params(CFG)
    cache = jax.eval_shape(lambda: d.init_cache(CFG, B, 64))
    return params, cache


def _options(traced) -> dict:
    return dict(traced._params["compiler_options_kvs"])  # what jit hands the compile (jax 0.11)


@pytest.mark.parametrize("jitted", ["_forward_jit", "_forward_donating"])
def test_forward_programs_carry_the_options(jitted):
    params, cache = _abstract()
    traced = getattr(api, jitted).trace(CFG, params, cache, jax.ShapeDtypeStruct((B, 1), jnp.int32),
                                        jax.ShapeDtypeStruct((B,), jnp.int32), kernels="jnp")
    assert _options(traced) == api.COMPILER_OPTIONS


def test_generate_program_carries_the_options():
    params, cache = _abstract()
    row = lambda dt: jax.ShapeDtypeStruct((B,), dt)  # noqa: E731
    traced = api._generate_jit.trace(CFG, params, cache, row(jnp.int32), row(jnp.float32), row(jnp.uint32),
                                     row(jnp.int32), row(jnp.int32), jax.ShapeDtypeStruct((B, 1), jnp.int32),
                                     n_steps=2, kernels="jnp")
    assert _options(traced) == api.COMPILER_OPTIONS


def test_options_are_valid_for_this_backend():
    """An option XLA does not know, or a value it does not take, fails the compile: these compile."""
    jax.jit(lambda x: x + 1, compiler_options=api.COMPILER_OPTIONS).lower(jnp.ones(2)).compile()
    with pytest.raises(Exception, match="not a valid enum value"):
        bad = {k: "NOT_A_MODE" for k in api.COMPILER_OPTIONS}
        jax.jit(lambda x: x + 2, compiler_options=bad).lower(jnp.ones(2)).compile()
