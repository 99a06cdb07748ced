"""Bad input is refused at the API boundary with a message that says what to do."""

import numpy as np
import pytest

import dsv41_jax as d

CFG = d.preset("tiny")


@pytest.fixture(scope="module")
def params():
    return d.init_params(CFG)


@pytest.mark.parametrize("tokens,lengths,exc,words", [
    (np.full((2, 5), 320), [5, 5], ValueError, "outside [0, 320)"),
    (np.full((2, 5), -1), [5, 5], ValueError, "outside"),
    (np.zeros((2, 0), np.int32), [0, 0], ValueError, "empty prompt"),
    (np.zeros((2, 5), np.int32), [5, 0], ValueError, "empty prompt"),
    (np.zeros((2, 5), np.float32), [5, 5], TypeError, "integer"),
    (np.zeros((2, 5), np.int32), [6, 5], ValueError, "exceed"),
    (np.zeros((2, 40), np.int32), [40, 33], ValueError, "capacity of 32"),
    (np.zeros((3, 5), np.int32), [5, 5, 5], ValueError, "batch"),
    (np.zeros((5,), np.int32), [5, 5], ValueError, "[batch, tokens]"),
])
def test_prefill_rejects(params, tokens, lengths, exc, words):
    with pytest.raises(exc) as e:
        d.prefill(CFG, params, d.init_cache(CFG, 2, 32), tokens, np.array(lengths))
    assert words in str(e.value)


def test_decode_rejects_full_cache_and_bad_ids(params):
    # a full cache: its 8 slots all taken (the room check reads lengths only; a prefill of 8 would be a compile
    # of its own just for this)
    cache = d.init_cache(CFG, 1, 8)
    cache = cache.replace(lengths=cache.lengths + 8)
    with pytest.raises(ValueError, match="cache full"):
        d.decode_step(CFG, params, cache, np.array([1]))
    with pytest.raises(ValueError, match="outside"):
        d.decode_step(CFG, params, cache, np.array([999]))
    with pytest.raises(ValueError, match="shape"):
        d.decode_step(CFG, params, cache, np.array([1, 2]))


def test_cache_larger_than_the_model_allows():
    with pytest.raises(ValueError, match="max_seq_len"):
        d.init_cache(CFG, 1, CFG.max_seq_len + 1)
