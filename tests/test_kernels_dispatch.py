"""The kernel switch in dsv41_jax.kernels: backend resolution, format checks, and each dispatched op with
backend="pallas" (interpret mode on CPU) against the jnp path on the tiny model's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import kernels, quant
from tests.test_kernels_gpu import _attention_case, _index_case


def test_resolve():
    assert kernels.resolve("jnp") == "jnp" and kernels.resolve("pallas") == "pallas"
    assert kernels.resolve("auto") == ("auto" if jax.default_backend() in ("gpu", "tpu") else "jnp")
    with pytest.raises(ValueError, match="auto|jnp|pallas"):
        kernels.resolve("triton")


def test_raw_formats_stay_on_jnp_unless_forced():
    raw = quant.RawCodec()
    q, w = jnp.ones((1, 4, 32)), jnp.ones((1, 4))
    rec = raw.encode(jnp.ones((1, 5, 32)))
    want = kernels.indexer_scores_decode(q, w, rec, jnp.array([3]), raw, backend="jnp")
    np.testing.assert_array_equal(kernels.indexer_scores_decode(q, w, rec, jnp.array([3]), raw, backend="auto"), want)
    with pytest.raises(ValueError, match="released packed formats"):
        kernels.indexer_scores_decode(q, w, rec, jnp.array([3]), raw, backend="pallas")


def test_pallas_backend_matches_jnp_on_tiny_shapes():
    q, w, rec = _index_case(0, 2, 4, 32, 37)
    reach = jnp.array([37, 12], jnp.int32)
    run = lambda f, *a: (f(*a, backend="pallas"), f(*a, backend="jnp"))
    got, want = run(kernels.indexer_scores_decode, q, w, rec, reach, quant.INDEX_KEY)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    s = want[:, None]
    np.testing.assert_array_equal(*run(kernels.select_topk, s, 8))
    np.testing.assert_array_equal(*run(kernels.candidate_blocks, s, reach[:, None], 3, 4))
    q, window, valid, entries, idx, sink = _attention_case(1, 3, 4, 64, 16, 37, 8)
    got, want = run(kernels.sparse_attention_decode, q, window, valid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV,
                    sink, 0.125)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 5e-3
