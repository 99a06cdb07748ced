"""`api.generate` (N decode steps per compiled call, sampling and stops on device) against the one-step
loop it replaces, and cache donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax.sampling import sample
from tests.configs import TINY5

CFG = TINY5  # tiny's layer modes in 5 layers: what is checked is the loop on device, not the depth
PARAMS = d.init_params(CFG, seed=0)
B, T = 3, 9
N = 6  # generate steps: every test here asks for N, so the tests share one compiled generate program


def _prefilled():
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    logits, cache = d.prefill(CFG, PARAMS, d.init_cache(CFG, B, 64), ids, np.array([9, 4, 6]))
    return logits, cache


def _step_loop(cache, tok, n, temp, seed, budget, stops):
    """The reference: one decode_step per token, sampling on the host side of the call."""
    out = []
    count = np.zeros(B, np.int32)
    for _ in range(n):
        live = count < budget
        logits, cache = d.decode_step(CFG, PARAMS, cache, tok, live)
        nxt = np.asarray(sample(logits, temp, seed, jnp.asarray(count)))
        nxt = np.where(live, nxt, tok)
        out.append(np.where(live, nxt, -1))
        stop = np.isin(nxt, stops)
        count = np.where(live, np.where(stop, budget, count + 1), count)
        tok = nxt
    return np.stack(out, 1), cache


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_equals_the_step_loop(temperature):
    logits, cache = _prefilled()
    tok = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)
    temp = jnp.full((B,), temperature, jnp.float32)
    seed = jnp.asarray([5, 6, 7], jnp.uint32)
    budget = np.array([6, 2, 0], np.int32)  # unequal budgets; the last sequence idles
    want, want_cache = _step_loop(cache, tok, N, temp, seed, budget, [])
    toks, emitted, got_cache = d.generate(CFG, PARAMS, cache, tok, N, temperature_b=temp, seed_b=seed,
                                          budget_b=budget)
    np.testing.assert_array_equal(np.where(np.asarray(emitted), np.asarray(toks), -1), want)
    np.testing.assert_array_equal(np.asarray(emitted).sum(1), budget)
    np.testing.assert_array_equal(got_cache.lengths, want_cache.lengths)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)


def test_stop_token_ends_a_sequence_on_device():
    logits, cache = _prefilled()
    tok = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)
    free, _, _ = d.generate(CFG, PARAMS, cache, tok, N)
    _, cache = _prefilled()  # generate donated the first one
    stop_at = np.asarray(free)[0, 1]  # sequence 0's second token becomes its stop id
    stops = np.array([[stop_at], [-1], [-1]], np.int32)
    toks, emitted, after = d.generate(CFG, PARAMS, cache, tok, N, stop_ids_bs=stops)
    emitted = np.asarray(emitted)
    first_stop = int(np.argmax(np.asarray(toks)[0] == stop_at))
    assert emitted[0, :first_stop + 1].all() and not emitted[0, first_stop + 1:].any()  # the stop id is emitted
    assert emitted[1:].all()
    np.testing.assert_array_equal(np.asarray(after.lengths), np.array([9, 4, 6]) + emitted.sum(1))


def test_generate_checks_its_inputs():
    _, cache = _prefilled()
    with pytest.raises(ValueError, match="capacity"):
        d.generate(CFG, PARAMS, cache, np.zeros(B, np.int32), 60)
    with pytest.raises(ValueError, match="shape"):
        d.generate(CFG, PARAMS, cache, np.zeros(B + 1, np.int32), 2)
    with pytest.raises(ValueError, match="outside"):
        d.generate(CFG, PARAMS, cache, np.full(B, CFG.vocab_size, np.int32), 2)


def test_donated_decode_consumes_the_cache_and_matches():
    _, cache = _prefilled()
    tok = np.zeros(B, np.int32)
    want, _ = d.decode_step(CFG, PARAMS, cache, tok)
    got, new = d.decode_step(CFG, PARAMS, cache, tok, donate=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert cache.lengths.is_deleted() and not new.lengths.is_deleted()


def test_scalar_arguments_keep_their_buffers_and_validate_false_changes_nothing():
    # the same device buffers from call to call let the GPU replay its recorded command buffers
    from dsv41_jax import api
    assert api._per_seq(0.0, B, "float32") is api._per_seq(0.0, B, "float32")
    assert api._per_seq(np.int64(3), B, "int32") is api._per_seq(3, B, "int32")
    np.testing.assert_array_equal(api._per_seq(np.array([1, 2, 3]), B, "uint32"), [1, 2, 3])
    logits, cache = _prefilled()
    tok = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)
    checked, _, _ = d.generate(CFG, PARAMS, cache, tok, N)
    _, cache = _prefilled()
    unchecked, _, _ = d.generate(CFG, PARAMS, cache, tok, N, validate=False)
    np.testing.assert_array_equal(np.asarray(checked), np.asarray(unchecked))


def test_frozen_params_flatten_as_one_node_and_generate_the_same_tokens():
    """`d.freeze`: the params as one pytree node over their arrays (a jitted call then walks no nnx.Variable),
    the same compiled program (no retrace per call) and the same tokens as the nnx.State."""
    from dsv41_jax import api

    frozen = d.freeze(PARAMS)
    assert d.freeze(frozen) is frozen
    leaves = jax.tree.leaves(PARAMS)
    assert jax.tree_util.tree_structure(frozen).num_nodes == len(leaves) + 1  # vs one node per Variable
    assert all(a is b for a, b in zip(jax.tree.leaves(frozen), leaves))
    with pytest.raises(TypeError, match="nnx.State"):
        d.freeze({"embed": np.zeros(3)})
    logits, cache = _prefilled()
    tok = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)
    want, _, _ = d.generate(CFG, PARAMS, cache, tok, N, validate=False)
    _, cache = _prefilled()
    got, _, cache = d.generate(CFG, frozen, cache, tok, N, validate=False)
    n_programs = api._generate_jit._cache_size()
    d.generate(CFG, frozen, cache, tok, N, validate=False)
    assert api._generate_jit._cache_size() == n_programs
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
