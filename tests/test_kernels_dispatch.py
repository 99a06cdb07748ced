"""The kernel switch in dsv41_jax.kernels: backend resolution, format checks, each dispatched op with
kernels="pallas" (interpret mode on CPU) against the jnp path on the tiny model's shapes, and the
candidate-pool decode path of a Reindex layer against the masked full scan it replaces."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax as d
import kernels_pallas
from dsv41_jax import kernels, ops, quant
from tests.configs import TINY5
from tests.kernel_checks import index_case
from tests.test_kernels_gpu import _attention_case


def test_resolve():
    assert kernels.resolve("jnp") == "jnp" and kernels.resolve("pallas") == "pallas"
    assert kernels.resolve("auto") == ("auto" if jax.default_backend() in ("gpu", "tpu") else "jnp")
    with pytest.raises(ValueError, match="auto|jnp|pallas"):
        kernels.resolve("triton")


def test_raw_formats_stay_on_jnp_unless_forced():
    raw = quant.RawCodec()
    q, w = jnp.ones((1, 4, 32)), jnp.ones((1, 4))
    rec = raw.encode(jnp.ones((1, 5, 32)))
    want = kernels.indexer_scores_decode(q, w, rec, jnp.array([3]), raw, kernels="jnp")
    np.testing.assert_array_equal(kernels.indexer_scores_decode(q, w, rec, jnp.array([3]), raw, kernels="auto"), want)
    with pytest.raises(ValueError, match="released packed formats"):
        kernels.indexer_scores_decode(q, w, rec, jnp.array([3]), raw, kernels="pallas")
    blocks = jnp.array([[0, -1]])
    np.testing.assert_array_equal(
        kernels.indexer_scores_pool_decode(q, w, rec, blocks, 4, jnp.array([3]), raw, kernels="auto"),
        ops.indexer_scores_pool_decode(q, w, rec, blocks, 4, jnp.array([3]), raw))
    with pytest.raises(ValueError, match="released packed formats"):
        kernels.indexer_scores_pool_decode(q, w, rec, blocks, 4, jnp.array([3]), raw, kernels="pallas")


def test_index_key_layout_follows_the_config_and_the_scan_that_reads_it(monkeypatch):
    """"auto" stores Hopper's words only where the dispatch's full scan is the wgmma scan (and SM90_KEYS); the dispatch takes
    either layout to the GPU kernels (interpreted here) with the same scores, and refuses them for the TPU's."""
    from dataclasses import replace

    from dsv41_jax import cache
    from kernels_pallas import gpu_indexer_wgmma
    cfg = TINY5
    assert kernels.index_key_layout(cfg) == "nibbles"  # no Hopper here
    assert kernels.index_key_layout(replace(cfg, index_key_layout="sm90")) == "sm90"
    assert cache.formats_of(replace(cfg, index_key_layout="sm90")).index_key == quant.INDEX_KEY_SM90
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpu_indexer_wgmma, "is_hopper", lambda: True)
    released = replace(cfg, index_n_heads=32, index_head_dim=128)
    assert kernels.index_key_layout(released) == ("sm90" if gpu_indexer_wgmma.SM90_KEYS else "nibbles")
    monkeypatch.setattr(gpu_indexer_wgmma, "SM90_KEYS", True)
    assert kernels.index_key_layout(released) == "sm90"
    assert kernels.index_key_layout(replace(released, index_key_layout="nibbles")) == "nibbles"
    assert kernels.index_key_layout(cfg) == "nibbles"  # the tiny heads / dims: not that scan's shapes
    monkeypatch.setattr(gpu_indexer_wgmma, "ON", False)
    assert kernels.index_key_layout(released) == "nibbles"
    monkeypatch.undo()
    q, w, rec = index_case(0, 2, 4, 128, 37)  # the Triton scans take words of head_dim >= 128 (K >= 16 a code slot)
    reach = jnp.array([37, 12], jnp.int32)
    words = {"values": quant.to_sm90_words(rec["values"]), "scales": rec["scales"]}
    want = kernels.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY, kernels="jnp")
    for k in ("jnp", "pallas"):
        got = kernels.indexer_scores_decode(q, w, words, reach, quant.INDEX_KEY_SM90, kernels=k)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="TPU index scans read the released nibbles"):
        kernels_pallas.indexer_scores_decode(q, w, words, reach, layout="sm90", family="tpu")
    # words narrower than the Triton scans take: "auto" stays on jnp on a GPU, "pallas" is refused first
    nq, nw, nrec = index_case(0, 2, 4, 64, 37)
    narrow = {"values": quant.to_sm90_words(nrec["values"]), "scales": nrec["scales"]}
    with pytest.raises(ValueError, match=r"released packed formats only .*head_dim >= 128"):
        kernels.indexer_scores_decode(nq, nw, narrow, reach, quant.INDEX_KEY_SM90, kernels="pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    np.testing.assert_array_equal(kernels.indexer_scores_decode(nq, nw, narrow, reach, quant.INDEX_KEY_SM90,
                                                                kernels="auto"),
                                  kernels.indexer_scores_decode(nq, nw, narrow, reach, quant.INDEX_KEY_SM90,
                                                                kernels="jnp"))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # the dispatch: "auto" falls back to jnp there
    np.testing.assert_array_equal(kernels.indexer_scores_decode(q, w, words, reach, quant.INDEX_KEY_SM90, kernels="auto"),
                                  kernels.indexer_scores_decode(q, w, words, reach, quant.INDEX_KEY_SM90, kernels="jnp"))
    with pytest.raises(ValueError, match="released packed formats only"):
        kernels.indexer_scores_decode(q, w, words, reach, quant.INDEX_KEY_SM90, kernels="pallas")


def test_pallas_backend_matches_jnp_on_tiny_shapes():
    q, w, rec = index_case(0, 2, 4, 32, 37)
    reach = jnp.array([37, 12], jnp.int32)
    run = lambda f, *a, **kw: (f(*a, **kw, kernels="pallas"), f(*a, **kw, kernels="jnp"))
    got, want = run(kernels.indexer_scores_decode, q, w, rec, reach, quant.INDEX_KEY, block=4)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    s, bmax = want[0][:, None], want[1][:, None]
    np.testing.assert_array_equal(*run(kernels.select_topk, s, 8))
    np.testing.assert_array_equal(*run(kernels.candidate_blocks, bmax, reach[:, None], 3, 4))
    q, window, valid, entries, idx, sink = _attention_case(1, 3, 4, 64, 16, 37, 8)
    pos, inv_freq = jnp.array([3, 700, 4095], jnp.int32), 1e4 ** -(np.arange(8, dtype=np.float32) / 8)
    for dtype in (jnp.float32, jnp.bfloat16):  # the output with the rope's rotation taken off, in dtype
        got, want = run(kernels.sparse_attention_decode, q, window, valid, quant.WINDOW_KV, entries, idx,
                        quant.MAIN_KV, sink, 0.125, pos, inv_freq, dtype)
        assert got.dtype == want.dtype == dtype
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 5e-3


def _pool_inputs():
    """Tiny-config index keys (N = 37, not a multiple of the block of 4) for five sequences: full context,
    a short one (all its blocks fit the pool), one entry, none, and one whose keys are all equal (every
    score ties)."""
    q, w, rec = index_case(3, 5, 4, 32, 37)
    rec = jax.tree.map(lambda a: a.at[4].set(a[4, :1]), rec)
    return q, w, rec, jnp.array([37, 10, 1, 0, 29], jnp.int32)


@pytest.mark.parametrize("kernels_", ["jnp", "pallas"])
def test_pool_selection_equals_masked_full_scan(kernels_):
    """The candidate source's scan maxima -> pool blocks -> pool scan -> top-k mapped back to positions
    selects exactly what the top-k over the full scan masked to the pool selects."""
    q, w, rec, reach = _pool_inputs()
    n, block, n_blocks, k = 37, 4, 3, 8
    scores, bmax = kernels.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY, block=block, kernels=kernels_)
    blocks = kernels.candidate_blocks(bmax, reach, n_blocks, block, kernels=kernels_)
    np.testing.assert_array_equal(blocks, ops.candidate_blocks(scores[:, None], reach[:, None], n_blocks, block)[:, 0])
    masked = jnp.where(ops.blocks_to_mask(blocks, n, block), scores, ops.NEG_INF)
    old = kernels.select_topk(masked, k, kernels=kernels_)
    pool = kernels.indexer_scores_pool_decode(q, w, rec, blocks, block, reach, quant.INDEX_KEY, kernels=kernels_)
    assert pool.shape == (5, n_blocks * block)
    new = kernels.select_pool_topk(pool, blocks, block, k, kernels=kernels_)
    np.testing.assert_array_equal(new, old)
    np.testing.assert_array_equal(new[2], [0] + [-1] * 7)  # one entry
    np.testing.assert_array_equal(new[3], -1)  # nothing reachable
    np.testing.assert_array_equal(new[4], [0, 1, 2, 3, 4, 5, 6, 7])  # all tied: the lowest positions


def test_decode_pool_path_equals_masked_full_scan(monkeypatch):
    """Model level (tiny's layer modes in 5 layers, packed cache): decode logits with the Reindex layer scoring
    only its pool equal those of the previous path, which scored every position and masked to the pool. Token by
    token from an empty cache, the second sequence starting 17 steps later (unequal lengths)."""
    cfg = TINY5.replace(quantize_cache=True)
    params = d.init_params(cfg, seed=1)
    steps, late = 40, 17
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (steps, 2)), jnp.int32)
    active = jnp.asarray(np.arange(steps)[:, None] >= np.array([0, late]), jnp.int32)
    pool_widths = []

    def decode():
        fwd = jax.jit(functools.partial(d.forward, cfg))  # a fresh trace sees the patched functions
        cache, out = d.init_cache(cfg, 2, 64), []
        for i in range(steps):
            logits, cache = fwd(params, cache, tok[i][:, None], active[i])
            out.append(np.asarray(logits))
        return np.stack(out)

    real_pool_scan = kernels.indexer_scores_pool_decode

    def spy(*args, **kw):
        out = real_pool_scan(*args, **kw)
        pool_widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(kernels, "indexer_scores_pool_decode", spy)
    new = decode()
    assert pool_widths == [cfg.candidate_topk_blocks * cfg.candidate_block_size]  # 12 of 64 positions

    def full_scan_masked(q, w, key_rec, blocks, block, reach, codec, **switch):
        n = jax.tree.leaves(key_rec)[0].shape[1]
        scores = kernels.indexer_scores_decode(q, w, key_rec, reach, codec, **switch)
        return jnp.where(ops.blocks_to_mask(blocks, n, block), scores, ops.NEG_INF)

    monkeypatch.setattr(kernels, "indexer_scores_pool_decode", full_scan_masked)
    monkeypatch.setattr(kernels, "select_pool_topk", lambda s, blocks, block, k, **switch:
                        kernels.select_topk(s, k, **switch))
    old = decode()
    live = np.asarray(active, bool)
    np.testing.assert_allclose(new[live], old[live], rtol=0, atol=1e-6 * np.abs(old[live]).max())
