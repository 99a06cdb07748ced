"""TPU (Mosaic-lowered) kernels against the jnp reference, in interpret mode (no TPU here).

Same cases and tolerances as tests/test_kernels_gpu.py, except attention: the TPU kernel splits q and
p into bf16 hi + lo parts, so it agrees to 1e-4 (measured ~6e-6).
"""

from __future__ import annotations

import functools
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ops, quant
from kernels_pallas import tpu_attention, tpu_indexer, tpu_select
from tests.kernel_checks import assert_scan_matches, check_pool_scan, index_case
from tests.test_kernels_gpu import _attention_case, _rows


@pytest.mark.parametrize("b,h,d,n,reach,block,block_n", [
    (3, 4, 32, 37, [37, 5, 0], 4, 512),
    (2, 32, 128, 3000, [3000, 517], 8, 1024),  # partial last tile
    (1, 16, 128, 1, [1], None, 128),
])
def test_indexer_scores(b, h, d, n, reach, block, block_n):
    q, w, rec = index_case(n + h, b, h, d, n)
    reach = jnp.array(reach, jnp.int32)
    ref = ops.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY)
    out = tpu_indexer.indexer_scores(q, w, rec["values"], rec["scales"], reach, block=block, block_n=block_n,
                                     interpret=True)
    assert_scan_matches(out, ref, n, block)


@pytest.mark.parametrize("b,h,d,n,reach,block,n_blocks,block_n", [
    (4, 4, 32, 37, [37, 13, 1, 0], 4, 3, 512),  # one grid step holds the pool; per-row DMAs for block 9
    (2, 32, 128, 1001, [1001, 517], 8, 40, 128),  # 3 steps of 16 blocks, the last one padded
])
def test_indexer_scores_pool(b, h, d, n, reach, block, n_blocks, block_n):
    scan = functools.partial(tpu_indexer.indexer_scores_pool, block=block, block_n=block_n, interpret=True)
    check_pool_scan(scan, b, h, d, n, reach, block, n_blocks)


@pytest.mark.parametrize("name", ["normal", "rounded_ties", "all_equal", "block_ties", "neg_inf", "signed_zero",
                                  "short"])
def test_select_topk(name):
    s = jnp.asarray(_rows(name, np.random.default_rng(3)), jnp.float32)
    for k in (1, 16):
        np.testing.assert_array_equal(tpu_select.select_topk(s, k, interpret=True), ops.select_topk(s, k))


def test_candidate_blocks():
    reach = jnp.array([[37], [13], [0], [1]], jnp.int32)
    s = ops.mask_unreachable(jnp.asarray(np.random.default_rng(0).normal(size=(4, 1, 37)), jnp.float32), reach)
    got = tpu_select.select_topk(ops.pin_newest_block(ops.block_maxima(s, 4), reach, 4), 3, interpret=True)
    np.testing.assert_array_equal(got, ops.candidate_blocks(s, reach, 3, 4))


@pytest.mark.parametrize("b,h,d,w,n,k", [(3, 4, 64, 16, 37, 8), (3, 8, 128, 32, 50, 5)])
def test_sparse_attention(b, h, d, w, n, k):
    q, window, valid, entries, idx, sink = _attention_case(d, b, h, d, w, n, k)
    scale = d ** -0.5
    ref = ops.sparse_attention_decode(q, window, valid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink, scale)
    out = tpu_attention.sparse_attention(q, window["values"], window["scales"], valid, entries["values"],
                                         entries["scales"], idx, sink, scale, interpret=True)
    np.testing.assert_array_equal(out[0], 0.0)
    for i in range(1, b):
        assert float(jnp.linalg.norm(out[i] - ref[i]) / jnp.linalg.norm(ref[i])) < 1e-4
