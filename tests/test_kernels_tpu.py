"""TPU (Mosaic-lowered) kernels against the jnp reference, in interpret mode (no TPU here).

Same cases and tolerances as tests/test_kernels_gpu.py and tests/test_grouped.py, except attention: the
TPU kernel splits q and p into bf16 hi + lo parts, so it agrees to 1e-4 (measured ~6e-6).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from dsv41_jax import grouped
from dsv41_jax.layers import quantize_fp8_blocks
from kernels_pallas import tpu_attention, tpu_grouped, tpu_indexer, tpu_select
from tests.kernel_checks import assert_scan_matches, check_pool_scan
from tests.test_grouped import SIZES, _close, _experts
from tests.test_kernels_gpu import (_attention_case, _rows, attention_ref, candidates_case, indexer_ref,
                                    jit_index_case, topk_ref)


@pytest.mark.parametrize("b,h,d,n,reach,block,block_n", [
    (3, 4, 32, 37, [37, 5, 0], 4, 512),
    (2, 32, 128, 3000, [3000, 517], 8, 1024),  # partial last tile
    (1, 16, 128, 1, [1], None, 128),
])
def test_indexer_scores(b, h, d, n, reach, block, block_n):
    q, w, rec = jit_index_case(n + h, b, h, d, n)
    reach = jnp.array(reach, jnp.int32)
    ref = indexer_ref(q, w, rec, reach)
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
        np.testing.assert_array_equal(tpu_select.select_topk(s, k, interpret=True), topk_ref(s, k))


def test_candidate_blocks():
    s = jnp.asarray(np.random.default_rng(0).normal(size=(4, 1, 37)), jnp.float32)
    pinned, ref = candidates_case(s, jnp.array([[37], [13], [0], [1]], jnp.int32), 3, 4)
    np.testing.assert_array_equal(tpu_select.select_topk(pinned, 3, interpret=True), ref)


@pytest.mark.parametrize("b,h,d,w,n,k", [(3, 4, 64, 16, 37, 8), (3, 8, 128, 32, 50, 5)])
def test_sparse_attention(b, h, d, w, n, k):
    q, window, valid, entries, idx, sink = _attention_case(d, b, h, d, w, n, k)
    scale = d ** -0.5
    ref = attention_ref(q, window, valid, entries, idx, sink, scale)
    out = tpu_attention.sparse_attention(q, window["values"], window["scales"], valid, entries["values"],
                                         entries["scales"], idx, sink, scale, interpret=True)
    np.testing.assert_array_equal(out[0], 0.0)
    for i in range(1, b):
        assert float(jnp.linalg.norm(out[i] - ref[i]) / jnp.linalg.norm(ref[i])) < 1e-4


GROUPED_SIZES = SIZES | {"no_rows": [0] * 8}
# the jnp twins compiled whole (op by op, each new M compiled a few dozen small programs)
grouped_ref = jax.jit(grouped.grouped_matmul)
fp8_ref = jax.jit(grouped.fp8_matmul)


@functools.cache
def _fp4_experts():
    return _experts(k=512, n=256)


# Every case in f32; bf16 (its own row tiles) for the two cases whose rows meet several groups: with no
# rows, one token or one expert, bf16 changes no more than the dots' operand type, which these check.
@pytest.mark.parametrize("dtype,case", [(jnp.float32, c) for c in sorted(GROUPED_SIZES)]
                         + [(jnp.bfloat16, "long_groups"), (jnp.bfloat16, "unequal_with_empty")])
def test_grouped_fp4(dtype, case):
    """Against the jnp twin: decoded weights are exact, so only f32 summation order differs."""
    sizes = jnp.asarray(GROUPED_SIZES[case], jnp.int32)
    w = _fp4_experts()
    m = int(sizes.sum()) + 3  # trailing rows no group owns: zero in both
    x = jnp.asarray(np.random.default_rng(1).normal(size=(m, 512)), dtype)
    with jax.default_matmul_precision("highest"):
        ref = grouped_ref(x, w, sizes)
    # the chosen tiles (one K chunk, one column tile) through the dispatcher
    (out,) = kernels_pallas.grouped_matmuls_fp4(x, [(w["values"], w["scales"])], sizes, family="tpu")
    _close(out, ref)
    if dtype == jnp.float32:  # two K chunks, two column tiles, groups sharing row tiles (1 s per compile)
        _close(tpu_grouped.grouped_matmul_fp4(x, w["values"], w["scales"], sizes, tiles=(16, 256, 128),
                                              interpret=True), ref)


@pytest.mark.parametrize("case", sorted(GROUPED_SIZES))
def test_grouped_visits_fetch_only_experts_with_rows(case):
    """The visit list covers every row once, by its group; the weight blocks the grid walks through (the
    pipeline fetches one whenever its index changes) are each non-empty expert's once per column tile."""
    sizes = np.asarray(GROUPED_SIZES[case])
    m, tm, n_cols = int(sizes.sum()) + 3, 8, 3
    grp, tile, count = jax.jit(tpu_grouped.tile_map, static_argnums=(1, 2))(jnp.asarray(sizes), m, tm)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = int(count[0])
    owner = -np.ones(m, int)
    for g, t in zip(np.asarray(grp[:n]), np.asarray(tile[:n])):
        rows = np.arange(max(t * tm, offsets[g]), min(t * tm + tm, offsets[g + 1]))
        assert rows.size and (owner[rows] == -1).all()  # a visit owns rows, nobody else's
        owner[rows] = g
    np.testing.assert_array_equal(owner, np.concatenate([np.repeat(np.arange(8), sizes), [-1] * 3]))
    last = max(n - 1, 0)
    assert (np.asarray(grp[n:]) == int(grp[last])).all() and (np.asarray(tile[n:]) == int(tile[last])).all()
    blocks = [tuple(int(i) for i in tpu_grouped._expert_block(j, t, grp, tile, count, offsets))
              for j in range(n_cols) for t in range(grp.shape[0])]
    fetched = [b for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1]]
    want = [(int(g), j, 0) for j in range(n_cols) for g in np.flatnonzero(sizes)] or [(0, 0, 0)]
    assert fetched == want


@pytest.mark.parametrize("m,n,k,dtype,tiles,as_bytes", [
    (1, 512, 256, jnp.float32, None, False),  # two column tiles
    (5, 96, 128, jnp.bfloat16, None, True),  # N taken whole; E4M3 given as uint8 bytes
    (70, 512, 256, jnp.float32, (16, 128, 512), False),  # five row tiles, two K chunks
])
def test_fp8_matmul(m, n, k, dtype, tiles, as_bytes):
    rng = np.random.default_rng(m)
    q, s = quantize_fp8_blocks(jnp.asarray(rng.normal(size=(n, k)).astype(np.float32)))
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    with jax.default_matmul_precision("highest"):
        ref = fp8_ref(x, q, s)
    q = jax.lax.bitcast_convert_type(q, jnp.uint8) if as_bytes else q
    _close(tpu_grouped.fp8_matmul(x, q, s, tiles=tiles, interpret=True), ref)
