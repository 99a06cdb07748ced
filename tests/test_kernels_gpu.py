"""GPU (Triton-lowered) kernels against the jnp reference: interpret mode on CPU, compiled on a GPU.

Shapes cover lengths that are not multiples of the block sizes, empty and one-entry sequences,
batches of unequal lengths, ties, -inf rows and signed zeros. Tolerances:
- indexer (full scan and candidate-pool scan): q and k on the FP4 grid make every product exact; only
  the f32 summation order differs, so |err| <= 1e-5 * max|score|.
- selection: exact equality (same top set, same tie order, same -1 padding).
- attention: float16 tensor-core operands (q rounded to 2**-11 after a per-head power of two, p to
  2**-11; keys exact), so <= 5e-3 relative (norm per sequence); measured ~4e-4.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ops, quant
from kernels_pallas import decode, gpu_attention, gpu_indexer, gpu_select
from tests.kernel_checks import assert_scan_matches, check_pool_scan, index_case

INTERPRET = jax.default_backend() == "cpu"

# Inputs and jnp references compiled whole, once per shape: run op by op, each of their ~100 ops compiles
# on its own for every new shape, which cost more than the interpreted kernels (~5 s of a new shape's
# case on the CPU). The references are the functions the model runs under jit.
jit_index_case = jax.jit(index_case, static_argnums=(1, 2, 3, 4))
indexer_ref = jax.jit(functools.partial(ops.indexer_scores_decode, codec=quant.INDEX_KEY))
topk_ref = jax.jit(ops.select_topk, static_argnums=1)


@functools.partial(jax.jit, static_argnums=6)
def attention_ref(q, window, valid, entries, idx, sink, scale):
    return ops.sparse_attention_decode(q, window, valid, quant.WINDOW_KV, entries, idx, quant.MAIN_KV, sink, scale)


@functools.partial(jax.jit, static_argnums=(2, 3))
def candidates_case(s, reach, n_blocks, block):
    """(the top-k kernel's input: block maxima of the masked scores with the newest reachable block pinned,
    ops.candidate_blocks of them)"""
    s = ops.mask_unreachable(s, reach)
    return ops.pin_newest_block(ops.block_maxima(s, block), reach, block), ops.candidate_blocks(s, reach, n_blocks, block)


@pytest.mark.parametrize("b,h,d,n,reach,block", [
    (3, 4, 32, 37, [37, 5, 0], 4),  # tiny-config heads/dims, N not a multiple of the tile, empty row
    (2, 32, 128, 1000, [1000, 517], 8),  # released heads/dims, unequal lengths
    (1, 16, 128, 1, [1], None),  # one entry
])
def test_indexer_scores(b, h, d, n, reach, block):
    q, w, rec = jit_index_case(n + h, b, h, d, n)
    reach = jnp.array(reach, jnp.int32)
    ref = indexer_ref(q, w, rec, reach)
    out = gpu_indexer.indexer_scores(q, w, rec["values"], rec["scales"], reach, block=block, block_n=64,
                                     interpret=INTERPRET)
    assert_scan_matches(out, ref, n, block)


@pytest.mark.parametrize("b,h,d,n,reach,block", [(3, 4, 128, 37, [37, 5, 0], 4), (2, 32, 128, 1000, [1000, 517], 8)])
def test_indexer_scores_of_keys_in_hopper_words(b, h, d, n, reach, block):
    """The same keys stored in Hopper's word layout (`quant.to_sm90_words`, what an H100/H200 caches): the
    same scores, full scan and pool scan (one dot a code slot); keys too narrow for a K >= 16 dot a slot refused
    (on an H100 head_dim 32's K = 4 dots came out 4x too large)."""
    q, w, rec = jit_index_case(n + h, b, h, d, n)
    reach = jnp.array(reach, jnp.int32)
    words = quant.to_sm90_words(rec["values"])
    narrow = jit_index_case(n + h, b, h, 64, n)
    with pytest.raises(ValueError, match="need head_dim >= 128"):
        gpu_indexer.indexer_scores(narrow[0], narrow[1], quant.to_sm90_words(narrow[2]["values"]),
                                   narrow[2]["scales"], reach, layout="sm90", interpret=INTERPRET)
    out = gpu_indexer.indexer_scores(q, w, words, rec["scales"], reach, block=block, block_n=64, layout="sm90",
                                     interpret=INTERPRET)
    assert_scan_matches(out, indexer_ref(q, w, rec, reach), n, block)
    pool = functools.partial(gpu_indexer.indexer_scores_pool, block=block, block_n=4 * block, layout="sm90",
                             interpret=INTERPRET)
    check_pool_scan(lambda q, w, v, *a: pool(q, w, quant.to_sm90_words(v), *a), b, h, d, n, reach, block, 3)


@pytest.mark.parametrize("b,h,d,n,reach,block,n_blocks,block_n", [
    (4, 4, 32, 37, [37, 13, 1, 0], 4, 3, 8),  # tiny config: partial last block, one-entry and empty rows
    (2, 32, 128, 1001, [1001, 517], 8, 40, 256),  # released heads and block; N % 8 != 0; partial program
])
def test_indexer_scores_pool(b, h, d, n, reach, block, n_blocks, block_n):
    scan = functools.partial(gpu_indexer.indexer_scores_pool, block=block, block_n=block_n, interpret=INTERPRET)
    check_pool_scan(scan, b, h, d, n, reach, block, n_blocks)


def _rows(name, rng):
    n = 3000  # one shape [3, n] for the cases that need no particular length: they share their compiles
    if name == "normal":
        return rng.normal(size=(3, n))
    if name == "two_levels":  # at k = 64 a top level of 625 block maxima: over a level's 512 candidates
        return rng.normal(size=(2, 5000))
    if name == "one_wide_level":  # at k = 64 one level of 900 entries (`top_capacity`: up to 1024)
        return np.round(rng.normal(size=(2, 900)) * 4) / 4
    if name == "three_levels":
        return rng.normal(size=(1, 30000))
    if name == "rounded_ties":
        return np.round(rng.normal(size=(2, 5000)) * 2) / 2
    if name == "all_equal":
        return np.zeros((3, n))
    if name == "block_ties":  # every block of 8 ties at the top: forces the in-order rescan
        x = np.ones((3, n))
        x[:, ::7] = 2.0
        return x
    if name == "neg_inf":
        x = rng.normal(size=(3, n))
        x[0, 5:] = -np.inf
        x[1] = -np.inf
        x[2, 100:2900] = -np.inf
        return x
    if name == "signed_zero":
        return np.where(rng.random((3, n)) < 0.5, 0.0, -0.0)
    if name == "short":
        return rng.normal(size=(2, 5))
    if name == "slice_row":  # the slice's top-512 at 4K: one level of 4352 entries, the threshold's search stops early
        return rng.normal(size=(2, 4352))
    if name == "slice_row_ties":  # ... and ties at the 512th: the search runs all 32 bits
        return np.round(rng.normal(size=(2, 4352)) * 2) / 2
    raise KeyError(name)


@pytest.mark.parametrize("name,k", [("normal", 8), ("two_levels", 64), ("one_wide_level", 64), ("three_levels", 64),
                                    ("rounded_ties", 8), ("rounded_ties", 64), ("all_equal", 8), ("block_ties", 64), ("neg_inf", 16),
                                    ("signed_zero", 64), ("short", 8), ("neg_inf", 4096), ("signed_zero", 4096),
                                    ("all_equal", 3000), ("slice_row", 512), ("slice_row_ties", 512)])
def test_select_topk(name, k):
    s = jnp.asarray(_rows(name, np.random.default_rng(k)), jnp.float32)
    np.testing.assert_array_equal(gpu_select.select_topk(s, k, interpret=INTERPRET), topk_ref(s, k))


@pytest.mark.parametrize("seed", range(4))
def test_threshold_search_stops_only_where_the_same_entries_are_selected(seed):
    """`decode.kth_key` returns the k-th largest key, or a smaller prefix x >= floor with exactly k keys >= x (the same
    k entries); on distinct scores it does stop early (x below the k-th largest)."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=4352).astype(np.float32)
    scores[: 40 * seed] = np.round(scores[: 40 * seed])  # seeds 1-3: some ties, none at the 512th below
    keys = decode.ordered_key(jnp.asarray(scores))
    sorted_keys = np.sort(np.asarray(keys))[::-1]
    exact = int(sorted_keys[511])
    assert sorted_keys[512] < exact  # no tie at the 512th: an early stop exists
    search = jax.jit(decode.kth_key, static_argnums=1)
    for floor in (decode.NEG_INF_KEY, int(sorted_keys[600]), exact - 1, exact):
        got = int(search(keys, 512, jnp.int32(floor)))
        assert floor <= got <= exact
        assert got == exact or int(jnp.sum(keys >= got)) == 512
    assert int(search(keys, 512, jnp.int32(decode.NEG_INF_KEY))) < exact
    ties = decode.ordered_key(jnp.asarray(np.round(scores * 2) / 2))
    sorted_ties = np.sort(np.asarray(ties))[::-1]
    assert sorted_ties[512] == sorted_ties[511]  # ties at the 512th: no early stop, the exact key
    assert int(search(ties, 512, jnp.int32(decode.NEG_INF_KEY))) == int(sorted_ties[511])


def test_select_topk_k1_and_leading_dims():
    s = jnp.asarray(np.random.default_rng(1).normal(size=(2, 1, 300)), jnp.float32)
    np.testing.assert_array_equal(gpu_select.select_topk(s, 1, interpret=INTERPRET), topk_ref(s, 1))


@pytest.mark.parametrize("n,block,n_blocks,reach", [
    (37, 4, 3, [37, 13, 0, 1]),  # tiny config: partial newest block, empty and one-entry rows
    (5000, 8, 64, [5000, 4999, 1234, 8]),
])
def test_candidate_blocks(n, block, n_blocks, reach):
    """The model's candidate selection: the top-k kernel over pinned block maxima == ops.candidate_blocks."""
    s = jnp.asarray(np.random.default_rng(n).normal(size=(4, 1, n)), jnp.float32)
    pinned, ref = candidates_case(s, jnp.array(reach, jnp.int32)[:, None], n_blocks, block)
    np.testing.assert_array_equal(gpu_select.select_topk(pinned, n_blocks, interpret=INTERPRET), ref)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _attention_case(seed, b, h, d, w, n, k):
    ks = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(ks[0], (b, h, d)) * 3
    window = quant.WINDOW_KV.encode(jax.random.normal(ks[1], (b, w, d)))
    entries = quant.MAIN_KV.encode(jax.random.normal(ks[2], (b, n, d)))
    valid = jax.random.uniform(ks[3], (b, w)) < 0.8
    idx = jnp.where(jax.random.uniform(ks[4], (b, k)) < 0.7, jax.random.randint(ks[5], (b, k), 0, n), -1)
    valid = valid.at[0].set(False)  # sequence 0 has no key at all: its output is zero
    idx = idx.at[0].set(-1)
    if b > 2:  # sequence 2: one window key, one entry
        valid = valid.at[2].set(jnp.arange(w) == 3)
        idx = idx.at[2].set(jnp.where(jnp.arange(k) == 0, n - 1, -1))
    sink = jax.random.normal(ks[6], (h,))
    return q, window, valid, entries, idx, sink


@pytest.mark.parametrize("b,h,d,w,n,k,splits,block_k,head_block", [
    # tiny config: K < the key tile, so its only entry tile is partial; 3 ranges over 2 tiles, one empty
    (3, 4, 64, 16, 37, 8, 1, 16, None),
    (3, 4, 64, 16, 37, 8, 3, 16, None),
    # released shapes: the kernel finishing the softmax itself and combined over ranges, both with head
    # blocks; all 64 heads in one block over 4 ranges of 64-key tiles
    (3, 64, 512, 128, 300, 512, 1, 32, 16),
    (3, 64, 512, 128, 300, 512, 3, 32, 32),
    (3, 64, 512, 128, 300, 512, 4, 64, None),
])
def test_sparse_attention(b, h, d, w, n, k, splits, block_k, head_block):
    q, window, valid, entries, idx, sink = _attention_case(d + splits, b, h, d, w, n, k)
    scale = d ** -0.5
    ref = attention_ref(q, window, valid, entries, idx, sink, scale)
    out = gpu_attention.sparse_attention(q, window["values"], window["scales"], valid, entries["values"],
                                         entries["scales"], idx, sink, scale, splits=splits, block_k=block_k,
                                         head_block=head_block, interpret=INTERPRET)
    np.testing.assert_array_equal(out[0], 0.0)
    for i in range(1, b):
        err = float(jnp.linalg.norm(out[i] - ref[i]) / jnp.linalg.norm(ref[i]))
        assert err < 5e-3, (i, err)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_combine_unrotated_merges_and_turns_back_as_its_reference(out_dtype):
    """The kernel merging split partials and undoing the rope's rotation == `unrotated(combine(...))` cast: 5
    ranges read from 8 rows (the 3 past them NaN: never read), 20 heads of 32 padded (the pad sliced off),
    channel pairs turned by angles of several turns (cos 1, sin 0 on the first half); sequence 1 has no key in
    any range (m at the floor, l 0: the sink takes it all, output 0). f32 to summation order; bf16 to one
    rounding of that (2**-8 relative)."""
    b, s_, hp, h, d = 2, 5, 32, 20, 64
    rows = gpu_attention.range_rows(s_)
    ks = jax.random.split(jax.random.key(7), 5)
    acc = jax.random.normal(ks[0], (b, s_, hp, d)) * 4
    m = jax.random.normal(ks[1], (b, s_, hp)) * 3
    l = jax.random.uniform(ks[2], (b, s_, hp), minval=0.5, maxval=30.0)
    m, l, acc = m.at[1].set(gpu_attention.M_FLOOR), l.at[1].set(0.0), acc.at[1].set(0.0)
    sink = jax.random.normal(ks[3], (hp,))
    ang = jax.random.uniform(ks[4], (b, d // 4), minval=-20.0, maxval=20.0)
    cos = jnp.concatenate([jnp.ones((b, d // 4)), jnp.cos(ang)], -1)
    sin = jnp.concatenate([jnp.zeros((b, d // 4)), jnp.sin(ang)], -1)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, rows - s_)] + [(0, 0)] * (x.ndim - 2), constant_values=jnp.nan)
    out = gpu_attention.combine_unrotated(pad(acc), pad(m), pad(l), sink, cos, sin, splits=s_, h=h,
                                          out_dtype=out_dtype, interpret=INTERPRET)
    ref = gpu_attention.unrotated(gpu_attention.combine(acc, m, l, sink)[:, :h], cos, sin)
    assert out.shape == (b, h, d) and out.dtype == out_dtype
    np.testing.assert_array_equal(out[1], 0.0)
    tol = 1e-6 if out_dtype == jnp.float32 else 2.0 ** -8
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=tol, atol=tol * float(jnp.abs(ref).max()))
    # the first half of each row's channels is not rotated: the plain merge
    np.testing.assert_allclose(np.asarray(out[..., : d // 2], np.float32),
                               gpu_attention.combine(acc, m, l, sink)[:, :h, : d // 2], rtol=tol,
                               atol=tol * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_attention_output_unrotated(splits):
    """With unrotate, both forms of the kernel (final, merged by `combine_unrotated`) give
    `unrotated` of its plain output in the dtype asked for (tiny shapes: 4 heads padded to 16)."""
    q, window, valid, entries, idx, sink = _attention_case(11 + splits, 3, 4, 64, 16, 37, 8)
    ang = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8) * 0.7
    cos = jnp.concatenate([jnp.ones((3, 24)), jnp.cos(ang)], -1)
    sin = jnp.concatenate([jnp.zeros((3, 24)), jnp.sin(ang)], -1)
    run = functools.partial(gpu_attention.sparse_attention, q, window["values"], window["scales"], valid,
                            entries["values"], entries["scales"], idx, sink, 0.125, splits=splits, block_k=16, interpret=INTERPRET)
    plain, out = run(), run(unrotate=(cos, sin), out_dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and out.shape == plain.shape
    ref = gpu_attention.unrotated(plain, cos, sin)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2.0 ** -8, atol=1e-6 * float(jnp.abs(ref).max()))


def test_select_steps_counts_an_early_stop_on_distinct_scores_and_32_on_ties(capsys):
    """`experiments.select_steps` (the numbers the docs cite): fewer than 32 steps on every row of distinct scores,
    all 32 on rows tied at the k-th."""
    from experiments import select_steps
    out = select_steps.main(["--n", "1000", "--k", "64", "--rows", "2"])
    ties = "normal rounded to 0.5 (ties)"
    assert all(s < 32 for kind, rows in out.items() if kind != ties for s in rows), out
    assert out[ties] == [32, 32]
    assert "| normal |" in capsys.readouterr().out
