"""The Hopper indexer scan (`kernels_pallas.gpu_indexer_wgmma`, the dispatch's full scan on an H100/H200): what
a CPU can check (the channel permutation, the q split, the CTA split, that it lowers for CUDA and that the
dispatch takes it) and, on an H100/H200, its scores against `ops.indexer_scores_decode` (the same bound as the
Triton scan's tests: ~1e-6 of the largest score, the same -inf pattern; and each row at its own scale)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ops, quant
from kernels_pallas import gpu_indexer_wgmma as scan
from kernels_pallas import gpu_wgmma
from tests.kernel_checks import index_case, run_decode_ptx


def test_key_permutation_gives_each_thread_its_own_scale_group():
    p = scan.key_perm()
    assert sorted(p) == list(range(scan.D))
    thread = (np.arange(scan.D) % 8) // 2
    assert np.all(p // scan.GROUP == thread)


def test_sm90_decode_gives_every_code_of_the_sm90_words_times_its_scale():
    """SM90_DECODE_PTX (run in numpy) on words that `quant.to_sm90_words` stored: output i holds codes
    WORD_PAIRS[i] of the `pack_nibbles` word (code j: byte j // 2, high nibble for odd j) times 2**(byte - 127),
    for every pair of codes in every position and E8M0 bytes 0 .. 128; and the layout is a bijection of bits."""
    assert sorted(quant.SM90_WORD_BITS) == list(range(32))
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (4096, 8)).astype(np.uint8)
    for j in range(0, 8, 2):  # all 256 pairs in each pair of positions
        codes[256 * j // 2:256 * (j // 2 + 1), j:j + 2] = np.stack(np.meshgrid(np.arange(16), np.arange(16)), -1).reshape(256, 2)
    packed = quant.pack_nibbles(jnp.asarray(codes))  # [4096, 4]: one word a row
    stored = quant.to_sm90_words(packed)
    np.testing.assert_array_equal(np.asarray(quant.from_sm90_words(stored)), np.asarray(packed))
    words = np.asarray(stored).view("<u4")[:, 0]
    exps = np.resize(np.arange(129, dtype=np.uint8), len(codes))
    got = run_decode_ptx(scan.SM90_DECODE_PTX, words, exps)
    e2m1 = quant.FP4_VALUES.astype(np.float64)
    for i, pair in enumerate(gpu_wgmma.WORD_PAIRS):
        for lane, j in enumerate(pair):
            want = e2m1[codes[:, j]] * np.exp2(exps.astype(np.float64) - 127)
            np.testing.assert_array_equal(got[:, i, lane], want)
            assert np.array_equal(np.signbit(got[:, i, lane]), np.signbit(e2m1[codes[:, j]]))  # -0 stays -0


def test_bf16_round_is_the_bf16_cast():
    """`bf16_round` (integer ops) rounds as the f32 -> bf16 cast does, ties to even included, bit for bit."""
    x = jax.random.normal(jax.random.key(3), (4096,)) * jnp.exp2(jax.random.randint(jax.random.key(4), (4096,), -60, 60))
    ties = jnp.asarray([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 2.0 ** -130 * (1 + 2.0 ** -8)], jnp.float32)
    x = jnp.concatenate([x, ties, jnp.zeros((1,))])
    np.testing.assert_array_equal(np.asarray(jax.jit(scan.bf16_round)(x)),
                                  np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)))


def test_split_query_keeps_q_to_bf16_hi_plus_lo():
    """Inside a jit, as the scan calls it: on the GPU XLA drops a plain f32 -> bf16 -> f32 round trip there, which
    left lo zero (found in the forty-seventh session)."""
    q = jax.random.normal(jax.random.key(0), (2, 8, scan.D)) * 3
    qs = jax.jit(scan.split_query)(q)
    assert qs.shape == (2, 16, scan.D) and qs.dtype == jnp.bfloat16
    back = (qs[:, :8].astype(jnp.float32) + qs[:, 8:].astype(jnp.float32))[:, :, np.argsort(scan.key_perm())]
    assert float(jnp.max(jnp.abs(back - q) / jnp.abs(q))) < 2.0 ** -16
    fp4_grid = quant.fake_quant(quant.INDEX_KEY, q)  # the model's queries: hi alone is exact, lo zero
    assert not np.any(np.asarray(jax.jit(scan.split_query)(fp4_grid)[:, 8:], np.float32))


@pytest.mark.parametrize("b,steps,want", [(8, 513, 1056), (8, 512, 1056), (1, 5, 3), (3, 1, 1056), (64, 7, 1056),
                                           (1, 4096, 1056)])
def test_split_steps_covers_every_step_with_equal_ranges(b, steps, want):
    """The model's caches give step counts like 513 (capacity 131328 / 256): a split into powers of two left
    8 CTAs for 8 sequences, 13x slower in the slice than the Triton scan (eighteenth session)."""
    c, n = scan.split_steps(b, steps, want)
    firsts = [min(i * n, steps - n) for i in range(c)]
    covered = {f + t for f in firsts for t in range(n)}
    assert covered == set(range(steps)) and min(firsts) >= 0
    assert c * n - steps < n  # fewer than one CTA's steps scanned twice
    per_seq = -(-want // b)
    assert c <= per_seq and c >= min(steps, per_seq) / 2  # about `want` CTAs over the batch, at least half


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles it for real")
def test_lowers_for_cuda():
    s = jax.ShapeDtypeStruct
    b, h, n = 2, 32, 8192
    args = (s((b, h, scan.D), jnp.float32), s((b, h), jnp.float32), s((b, n, scan.D // 2), jnp.uint8),
            s((b, n, scan.D // scan.GROUP), jnp.uint8), s((b,), jnp.int32))
    text = jax.jit(scan.indexer_scores_wgmma).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "indexer_scores_wgmma_32_2" in text
    one = jax.jit(lambda *a: scan.indexer_scores_wgmma(*a, q_parts=1, ctas=528))
    one_text = one.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "indexer_scores_wgmma_32_1" in one_text
    timed = jax.jit(lambda *a: scan.indexer_scores_wgmma(*a, q_parts=1, ctas=64, timeline=True)).trace(*args)
    c, _ = scan.split_steps(b, n // scan.TP // scan.tiles_per_step_for(n), 64)  # CTAs a sequence: a row each
    assert timed.out_info[1].shape == (b * c, len(scan.TIMELINE) + 1)
    assert "globaltimer_lo" in timed.lower(lowering_platforms=("cuda",)).as_text()
    assert "globaltimer_lo" not in text  # none without a timeline
    blocked = jax.jit(lambda *a: scan.indexer_scores_wgmma(*a, q_parts=1, block=scan.BLOCK, timeline=True)).trace(*args)
    assert [o.shape for o in blocked.out_info[:2]] == [(b, n), (b, n // scan.BLOCK)]  # then the timeline
    # the epilogue's block maxima: the one maximum of floats in the module (the e_max of the scale bytes is unsigned)
    assert "maximumf" in blocked.lower(lowering_platforms=("cuda",)).as_text() and "maximumf" not in one_text
    # fresh_product: its first wgmma's scale-d predicate false (no zeroed accumulator), absent with fresh=False
    plain = jax.jit(lambda *a: scan.indexer_scores_wgmma(*a, q_parts=1, ctas=528, fresh=False)).trace(*args)
    assert "setp.ne.b32 f, 0, 0" not in plain.lower(lowering_platforms=("cuda",)).as_text()
    assert "setp.ne.b32 f, 0, 0" in one_text  # the default
    zeros = [jnp.zeros(a.shape, a.dtype) for a in args]
    with pytest.raises(ValueError, match="q_parts"):
        scan.indexer_scores_wgmma(*zeros, q_parts=3)
    with pytest.raises(ValueError, match="block maxima over 8 positions, got block=16"):
        scan.indexer_scores_wgmma(*zeros, block=16)
    with pytest.raises(ValueError, match="tiles_per_step=8 must divide .* at most 4"):  # not the TMA's own error
        scan.indexer_scores_wgmma(*zeros, tiles_per_step=8)


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("b,h,n,reach,tiles_per_step,q_parts",
                         [(1, 32, 4096, [3000], 1, 2), (3, 32, 8192, [8192, 17, 5000], 1, 2), (2, 16, 1024, [0, 900], 1, 2),
                          (3, 32, 8192, [8192, 17, 5000], 2, 2), (1, 32, 4096, [4000], 4, 2),
                          (3, 32, 8192, [8192, 17, 5000], 1, 1), (2, 16, 1024, [0, 900], 2, 1),
                          (1, 32, 320, [300], 1, 1), (2, 32, 131328, [131328, 70001], 4, 1),
                          (2, 32, 131328, [131328, 70001], None, 1)])  # None: the default tiles and CTAs
def test_scores_match_the_twin_on_the_gpu(b, h, n, reach, tiles_per_step, q_parts):
    q, w, rec = index_case(n + b, b, h, scan.D, n)  # q on the FP4 grid, as the model's: exact in bf16
    reach = jnp.asarray(reach, jnp.int32)
    want = ops.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY)
    split = {"ctas": 3} if n == 320 else {}  # 320: 5 steps in 3 CTAs, the last range overlapping (`split_steps`)
    got = scan.indexer_scores_wgmma(q, w, rec["values"], rec["scales"], reach, tiles_per_step=tiles_per_step,
                                    q_parts=q_parts, **split)
    np.testing.assert_array_equal(np.isinf(np.asarray(got)), np.isinf(np.asarray(want)))
    fin = np.isfinite(np.asarray(want))
    if fin.any():
        err = np.abs(np.asarray(got)[fin] - np.asarray(want)[fin]).max() / np.abs(np.asarray(want)[fin]).max()
        assert err <= 1e-6, err


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("n,tiles_per_step,ctas,layout", [(8192, 1, 4224, "nibbles"), (8192, 2, 4224, "sm90"),
                                                          (320, 1, 3, "nibbles"), (131328, None, 4224, "nibbles")])
def test_epilogue_block_maxima_are_the_maxima_of_its_scores_on_the_gpu(n, tiles_per_step, ctas, layout):
    """The epilogue's block maxima equal, bit for bit, the maxima of the scores the same call wrote (blocks past
    reachable -inf, partly reachable ones the max of their reachable rows; 320: the last CTA's range overlapping
    its neighbour's), and the scores are those of the call without them."""
    b = 3
    q, w, rec = index_case(n, b, 32, scan.D, n)
    reach = jnp.asarray([n, 17, n // 2 + 3], jnp.int32)
    keys = quant.to_sm90_words(rec["values"]) if layout == "sm90" else rec["values"]
    kw = dict(tiles_per_step=tiles_per_step, q_parts=1, ctas=ctas, layout=layout)
    scores, bmax = scan.indexer_scores_wgmma(q, w, keys, rec["scales"], reach, block=scan.BLOCK, **kw)
    np.testing.assert_array_equal(np.asarray(scores),
                                  np.asarray(scan.indexer_scores_wgmma(q, w, keys, rec["scales"], reach, **kw)))
    np.testing.assert_array_equal(np.asarray(bmax), np.asarray(scores).reshape(b, -1, scan.BLOCK).max(-1))
    assert np.isneginf(np.asarray(bmax)[1, 3:]).all() and np.isfinite(np.asarray(bmax)[1, :2]).all()


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("n,tiles_per_step,q_parts,layout", [(8192, 1, 1, "nibbles"), (8192, 2, 1, "sm90"),
                                                             (8192, 4, 2, "nibbles"), (131328, None, 1, "sm90")])
def test_fresh_product_scores_equal_the_plgpu_wgmma_forms_on_the_gpu(n, tiles_per_step, q_parts, layout):
    """`fresh=True` (`gpu_wgmma.fresh_product`: the first wgmma of a tile does not read its accumulator) gives the
    scores of the default form bit for bit (the same products, summed in the same order), with 1, 2 and 4 tiles a
    step, q in one part and in two."""
    b = 3
    q, w, rec = index_case(n, b, 32, scan.D, n)
    reach = jnp.asarray([n, 17, n // 2 + 3], jnp.int32)
    keys = quant.to_sm90_words(rec["values"]) if layout == "sm90" else rec["values"]
    kw = dict(tiles_per_step=tiles_per_step, q_parts=q_parts, layout=layout)
    fresh = np.asarray(scan.indexer_scores_wgmma(q, w, keys, rec["scales"], reach, fresh=True, **kw))
    np.testing.assert_array_equal(fresh, np.asarray(scan.indexer_scores_wgmma(q, w, keys, rec["scales"], reach,
                                                                              fresh=False, **kw)))
    assert np.isfinite(fresh[0]).all() and np.isneginf(fresh[1, 17:]).all()


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("b,n,reach,q_parts", [(3, 8192, [8192, 17, 5000], 1), (2, 131328, [131328, 70001], 1),
                                              (1, 4096, [3000], 2)])
def test_scores_of_keys_in_hopper_words_match_the_twin_on_the_gpu(b, n, reach, q_parts):
    """The keys as an H100/H200 caches them (`quant.INDEX_KEY_SM90`), decoded by SM90_DECODE_PTX: the released
    keys' scores, as bounded above."""
    q, w, rec = index_case(n + b, b, 32, scan.D, n)
    reach = jnp.asarray(reach, jnp.int32)
    want = np.asarray(ops.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY))
    got = np.asarray(scan.indexer_scores_wgmma(q, w, quant.to_sm90_words(rec["values"]), rec["scales"], reach,
                                               q_parts=q_parts, layout="sm90"))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    assert np.abs(got[fin] - want[fin]).max() / np.abs(want[fin]).max() <= 1e-6


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
def test_every_row_exact_at_its_own_scale_on_the_gpu():
    """Rows at scales 2**-87 .. 2**72, groups up to 2**-30 below their row's largest and one row's 2**-149
    below (the decode scales each row by its own e_max, found across the row's 4 threads): each score
    within 1e-5 of its row's magnitude sum_h |w_h| |q_h| . |k_n| (an error relative to the largest score
    would hide the small rows)."""
    b, h, n = 2, 32, 1024
    q, w, rec = index_case(7, b, h, scan.D, n)
    rng = np.random.default_rng(7)
    base = rng.integers(40, 200, (b, n, 1))
    scales = base - rng.integers(0, 31, (b, n, scan.D // scan.GROUP))
    scales[0, 5] = [190, 41, 180, 100]
    rec = {"values": rec["values"], "scales": jnp.asarray(scales, jnp.uint8)}
    reach = jnp.full((b,), n, jnp.int32)
    want = np.asarray(ops.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY), np.float64)
    got = np.asarray(scan.indexer_scores_wgmma(q, w, rec["values"], rec["scales"], reach, q_parts=1), np.float64)
    k = np.asarray(quant.INDEX_KEY.decode(rec), np.float64)  # [B, N, D]
    mag = np.einsum("bh,bhd,bnd->bn", np.abs(np.asarray(w, np.float64)), np.abs(np.asarray(q, np.float64)), np.abs(k))
    assert np.all(np.isfinite(want)) and np.all(mag > 0)
    assert np.max(np.abs(got - want) / mag) <= 1e-5


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
def test_any_query_to_its_hi_plus_lo_on_the_gpu():
    """q_parts=2 with f32 q off the FP4 grid: each score within 2**-15 of its magnitude sum_h |w_h| |q_h| . |k_n|
    (hi + lo keeps q to ~2**-17; hi alone, what the jitted split gave before `bf16_round`, misses by ~2**-9)."""
    b, h, n = 2, 32, 1024
    _, w, rec = index_case(11, b, h, scan.D, n)
    q = jax.random.normal(jax.random.key(12), (b, h, scan.D), jnp.float32)
    reach = jnp.full((b,), n, jnp.int32)
    got = np.asarray(scan.indexer_scores_wgmma(q, w, rec["values"], rec["scales"], reach, q_parts=2), np.float64)
    # the reference in float64 (an f32 dot by XLA on the GPU may round q itself)
    w64, q64, k64 = (np.asarray(a, np.float64) for a in (w, q, quant.INDEX_KEY.decode(rec)))
    want = np.einsum("bh,bhn->bn", w64, np.maximum(np.einsum("bhd,bnd->bhn", q64, k64), 0))
    mag = np.einsum("bh,bhd,bnd->bn", np.abs(w64), np.abs(q64), np.abs(k64))
    assert np.max(np.abs(got - want) / mag) <= 2.0 ** -15


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles it for real")
@pytest.mark.parametrize("fused", [False, True])
def test_dispatch_takes_it_when_on_with_block_maxima(monkeypatch, fused):
    """`kernels_pallas.indexer_scores_decode` on an H100/H200 with ON: the wgmma scan, and the candidate
    source's block maxima (shapes) by an XLA reduce after it, or with FUSED_BLOCK_MAX from its epilogue (no
    reduce); off, the Triton scan."""
    import kernels_pallas
    from tests.kernel_checks import lower_for_h200

    s = jax.ShapeDtypeStruct
    b, h, n = 2, 32, 4096
    args = (s((b, h, scan.D), jnp.float32), s((b, h), jnp.float32),
            {"values": s((b, n, scan.D // 2), jnp.uint8), "scales": s((b, n, scan.D // scan.GROUP), jnp.uint8)},
            s((b,), jnp.int32))
    monkeypatch.setattr(kernels_pallas, "platform", lambda family=None: ("gpu", False))
    monkeypatch.setattr(scan, "is_hopper", lambda: True)
    def fn(q, w, rec, r):  # a new function per call: jit caches a function's traces
        return kernels_pallas.indexer_scores_decode(q, w, rec, r, block=8)

    monkeypatch.setattr(scan, "ON", False)
    assert "indexer_scores_wgmma" not in lower_for_h200(lambda *a: fn(*a), *args)
    monkeypatch.setattr(scan, "ON", True)
    monkeypatch.setattr(scan, "FUSED_BLOCK_MAX", fused)
    text = lower_for_h200(lambda *a: fn(*a), *args)
    assert "indexer_scores_wgmma" in text and ("stablehlo.reduce" in text) != fused
    scores, bmax = jax.eval_shape(lambda *a: fn(*a), *args)
    assert scores.shape == (b, n) and bmax.shape == (b, n // 8)


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("fused", [False, True])
def test_dispatch_with_block_maxima_on_the_gpu(monkeypatch, fused):
    """With ON, the dispatch's scores and block maxima (the candidate source's, by XLA or by the epilogue)
    equal the twin's."""
    import kernels_pallas

    monkeypatch.setattr(scan, "ON", True)
    monkeypatch.setattr(scan, "FUSED_BLOCK_MAX", fused)
    b, h, n = 2, 32, 4096
    q, w, rec = index_case(7, b, h, scan.D, n)
    reach = jnp.asarray([4000, 1234], jnp.int32)
    scores, bmax = kernels_pallas.indexer_scores_decode(q, w, rec, reach, block=8)
    want = ops.indexer_scores_decode(q, w, rec, reach, quant.INDEX_KEY)
    fin = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(scores)), fin)
    scale = np.abs(np.asarray(want)[fin]).max()
    np.testing.assert_allclose(np.asarray(scores)[fin], np.asarray(want)[fin], rtol=0, atol=1e-6 * scale)
    want_max = np.asarray(ops.block_maxima(want, 8))
    np.testing.assert_array_equal(np.isfinite(np.asarray(bmax)), np.isfinite(want_max))
    ok = np.isfinite(want_max)
    np.testing.assert_allclose(np.asarray(bmax)[ok], want_max[ok], rtol=0, atol=1e-6 * scale)
