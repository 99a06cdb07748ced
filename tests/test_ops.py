"""Reference CSA2 ops: selection rules, candidate pool, sparse == dense, Engram hashing."""

import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import ops, quant
from dsv41_jax.engram_hash import EngramHashLayout, ngram_hash_ids, reference_hash_ids_np


def test_select_topk_sorted_ties_lowest_position_and_empty_slots():
    s = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0, -jnp.inf], [-jnp.inf] * 6, [0.5, -jnp.inf, 0.1, 0.2, 0.3, 0.4]])
    idx = np.asarray(ops.select_topk(s, 2))
    np.testing.assert_array_equal(idx[0], [1, 2])  # three-way tie at 3.0: the two lowest positions
    np.testing.assert_array_equal(idx[1], [-1, -1])  # nothing reachable
    idx = np.asarray(ops.select_topk(s, 8))  # k larger than the row: -inf never selected, -1 padded
    np.testing.assert_array_equal(idx[0], [0, 1, 2, 3, 4, -1, -1, -1])
    np.testing.assert_array_equal(idx[2], [0, 2, 3, 4, 5, -1, -1, -1])


def test_candidate_pool_pins_newest_block_and_respects_limit():
    rng = np.random.default_rng(0)
    n, block, keep = 50, 4, 3
    scores = jnp.asarray(rng.normal(size=(2, 5, n)).astype(np.float32))
    reach = jnp.asarray([[1, 9, 23, 37, 50], [0, 2, 4, 50, 49]])
    masked = ops.mask_unreachable(scores, reach)
    # make the newest block the worst one so that only the pin can keep it
    newest = (np.asarray(reach) - 1) // block
    blocks = np.asarray(ops.candidate_blocks(masked, reach, keep, block))
    for b in range(2):
        for t in range(5):
            r = int(reach[b, t])
            got = blocks[b, t][blocks[b, t] >= 0]
            reachable_blocks = -(-r // block)
            assert len(got) == min(keep, reachable_blocks)
            assert np.all(np.diff(got) > 0)
            if r > 0:
                assert newest[b, t] in got
            # the others are the best-scoring reachable blocks
            sc = np.asarray(masked[b, t])
            bs = np.array([sc[i * block:(i + 1) * block].max() for i in range(reachable_blocks)])
            others = sorted(set(got) - {newest[b, t]})
            rest = sorted(set(range(reachable_blocks)) - set(got))
            if others and rest:
                assert bs[others].min() >= bs[rest].max()
    mask = np.asarray(ops.blocks_to_mask(jnp.asarray(blocks), n, block))
    assert mask.sum(-1).max() <= keep * block


def test_sparse_attention_equals_dense_when_topk_covers_everything():
    rng = np.random.default_rng(1)
    b, h, dim, w, n = 2, 4, 64, 8, 20
    q = jnp.asarray(rng.normal(size=(b, h, dim)).astype(np.float32))
    sink = jnp.asarray(rng.normal(size=(h,)).astype(np.float32))
    window = jnp.asarray(rng.normal(size=(b, w, dim)).astype(np.float32))
    entries = jnp.asarray(rng.normal(size=(b, n, dim)).astype(np.float32))
    reach = np.array([20, 13])
    idx = ops.select_topk(ops.mask_unreachable(jnp.asarray(rng.normal(size=(b, n)).astype(np.float32)),
                                               jnp.asarray(reach)), 32)  # k >= entries
    valid = jnp.asarray(np.arange(w)[None] < np.array([[8], [5]]))
    raw = quant.RawCodec("float32")
    sparse = ops.sparse_attention_decode(q, {"values": window}, valid, raw, {"values": entries}, idx, raw, sink, 0.125)
    # dense: every reachable entry, no selection at all
    keys = jnp.concatenate([window, entries], axis=1)
    mask = jnp.concatenate([valid, jnp.asarray(np.arange(n)[None] < reach[:, None])], axis=1)
    dense = ops.attend(q[:, None], keys, mask[:, None], sink, 0.125)[:, 0]
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), rtol=1e-5, atol=1e-6)
    # and a sink-only query (nothing allowed) returns zeros
    none = ops.attend(q[:, None], keys, jnp.zeros_like(mask)[:, None], sink, 0.125)
    assert float(jnp.abs(none).max()) == 0.0


def test_reindex_layer_is_limited_by_the_pool():
    """In the tiny preset, a Reindex layer's selections all fall inside the candidate pool."""
    rng = np.random.default_rng(2)
    n, block, keep, k = 40, 4, 3, 8
    scores = ops.mask_unreachable(jnp.asarray(rng.normal(size=(1, 1, n)).astype(np.float32)), jnp.array([[n]]))
    pool = ops.blocks_to_mask(ops.candidate_blocks(scores, jnp.array([[n]]), keep, block), n, block)
    other = jnp.asarray(rng.normal(size=(1, 1, n)).astype(np.float32))
    idx = np.asarray(ops.select_topk(jnp.where(pool, other, ops.NEG_INF), k))[0, 0]
    assert np.all(np.asarray(pool)[0, 0][idx[idx >= 0]])
    unconstrained = np.asarray(ops.select_topk(other, k))[0, 0]
    assert set(unconstrained) != set(idx)  # the pool really changed the choice


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_engram_hash_matches_int64_arithmetic(preset):
    cfg = d.preset(preset)
    layout = EngramHashLayout.from_config(cfg)
    rng = np.random.default_rng(3)
    win = rng.integers(0, cfg.engram_compressed_vocab_size, (3, 17, cfg.engram_max_ngram_size)).astype(np.int32)
    win[0, 0, 1:] = cfg.engram_pad_id
    ours = np.asarray(ngram_hash_ids(layout, jnp.asarray(win)))
    ref = reference_hash_ids_np(layout, win)
    np.testing.assert_array_equal(ours, ref)
    assert ours.max() < max(cfg.engram_num_embeddings)


def test_query_chunked_attention_equals_whole():
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(2, 37, 4, 16)).astype(np.float32))  # 37: not a multiple of the chunk
    kv = jnp.asarray(rng.normal(size=(2, 50, 16)).astype(np.float32))
    mask = jnp.asarray(rng.random((2, 37, 50)) > 0.6)
    sink = jnp.asarray(rng.normal(size=(4,)).astype(np.float32))
    whole = ops.attend(q, kv, mask, sink, 0.25, q_chunk=64)
    chunked = ops.attend(q, kv, mask, sink, 0.25, q_chunk=8)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_query_chunked_indexer_scores_equal_whole():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(2, 37, 4, 16)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(2, 37, 4)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(2, 50, 16)).astype(np.float32))
    whole = ops.indexer_scores(q, w, k, q_chunk=64)
    chunked = ops.indexer_scores(q, w, k, q_chunk=8)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-5)
