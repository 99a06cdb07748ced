"""End-to-end numerics of the tiny preset: decode == prefill, chunking, batching (gradients: test_train.py)."""

import numpy as np
import pytest

import dsv41_jax as d

T, CAP = 45, 64
LENS = np.array([45, 30])  # neither a multiple of 2, of the pool block (4), nor of the window (16)
SPLIT = np.array([13, 7])  # prefill this many, decode the rest


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, 320, (2, T))


@pytest.fixture(scope="module", params=[False, True], ids=["quant_off", "quant_on"])
def setup(request):
    cfg = d.preset("tiny", quantize_cache=request.param)
    params = d.init_params(cfg, seed=1)
    full, _ = d.prefill(cfg, params, d.init_cache(cfg, 2, CAP), _tokens(), LENS, all_logits=True)
    return cfg, params, np.asarray(full)


def _decode_rest(cfg, params, cache, tok, start, lens):
    """Greedy-free teacher-forced decode of tok[b, start[b]:lens[b]]; returns per-row logits lists."""
    out = [[] for _ in lens]
    pos = start.copy()
    while (pos < lens).any():
        act = pos < lens
        logits, cache = d.decode_step(cfg, params, cache, tok[np.arange(len(lens)), np.minimum(pos, T - 1)], act)
        for b in np.flatnonzero(act):
            out[b].append(np.asarray(logits[b]))
        pos = pos + act
    return out, cache


def test_decode_matches_prefill(setup):
    cfg, params, full = setup
    tok = _tokens()
    logits, cache = d.prefill(cfg, params, d.init_cache(cfg, 2, CAP), tok, SPLIT, all_logits=True)
    rest, cache = _decode_rest(cfg, params, cache, tok, SPLIT, LENS)
    np.testing.assert_array_equal(np.asarray(cache.lengths), LENS)
    for b in range(2):
        got = np.concatenate([np.asarray(logits[b, :SPLIT[b]]), np.stack(rest[b])])
        ref = full[b, :LENS[b]]
        scale = np.abs(ref).max()
        err = np.abs(got - ref).max()
        # Off: same math, different summation order -> float rounding only.
        # On: the quantizers see inputs that differ by that rounding; a value sitting exactly on an FP4/FP8
        # rounding boundary can flip one code (one step of one channel group), so allow 1% of the logit
        # scale and demand identical greedy tokens.
        tol = 1e-5 * scale if not cfg.quantize_cache else 1e-2 * scale
        assert err <= tol, (b, err, scale)
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_matches_one_prefill(setup):
    cfg, params, full = setup
    tok = _tokens()
    _, cache = d.prefill(cfg, params, d.init_cache(cfg, 2, CAP), tok, SPLIT, all_logits=True)
    # second chunk: the remaining tokens, left-aligned in a same-shaped array
    rest = np.stack([np.roll(tok[b], -SPLIT[b]) for b in range(2)])
    logits, cache = d.prefill(cfg, params, cache, rest, LENS - SPLIT, all_logits=True)
    for b in range(2):
        got = np.asarray(logits[b, : LENS[b] - SPLIT[b]])
        ref = full[b, SPLIT[b]:LENS[b]]
        assert np.abs(got - ref).max() <= (1e-5 if not cfg.quantize_cache else 1e-2) * np.abs(ref).max()


def test_sequences_in_a_batch_do_not_interact(setup):
    cfg, params, full = setup
    tok = _tokens()
    other = tok.copy()
    other[1] = _tokens(seed=7)[1]
    logits, _ = d.prefill(cfg, params, d.init_cache(cfg, 2, CAP), other, LENS, all_logits=True)
    np.testing.assert_array_equal(np.asarray(logits[0]), full[0])
    assert np.abs(np.asarray(logits[1, :LENS[1]]) - full[1, :LENS[1]]).max() > 0


def test_decode_reads_compressed_entries_and_only_reachable_ones(setup):
    """Scrambling a source's reachable entries changes the next token's logits (the CSA2 path is live);
    scrambling the slots past each sequence's reachable count changes nothing (the garbage contract)."""
    cfg, params, _ = setup
    # all_logits: the program of `setup`'s prefill (the cache does not depend on it), so no compile of its own
    _, cache = d.prefill(cfg, params, d.init_cache(cfg, 2, CAP), _tokens(), LENS, all_logits=True)
    nxt = np.array([5, 6])
    base, _ = d.decode_step(cfg, params, cache, nxt)
    ratios = [p.ratio for p in d.build_plan(cfg) if p.mode is d.Mode.FULL]
    for s, m in enumerate(ratios):
        reach = (LENS + 1) // m  # entries reachable by the decoded token at position LENS
        n = cache.sources[s].entries["values"].shape[1]
        for region, expect_change in (("reachable", True), ("beyond", False)):
            cols = np.arange(n)[None, :]
            hit = cols < reach[:, None] if region == "reachable" else cols >= reach[:, None]

            def scramble(a, hit=hit):
                noise = np.random.default_rng(9).integers(0, 255, a.shape).astype(a.dtype)
                return np.where(hit.reshape(*hit.shape, *([1] * (a.ndim - 2))), noise, np.asarray(a))

            src = cache.sources[s]
            bad = type(src)(entries={k: scramble(v) for k, v in src.entries.items()},
                            index_keys={k: scramble(v) for k, v in src.index_keys.items()},
                            pend_kv=src.pend_kv, pend_score=src.pend_score)
            sources = list(cache.sources)
            sources[s] = bad
            out, _ = d.decode_step(cfg, params, cache.replace(sources=tuple(sources)), nxt)
            changed = np.abs(np.asarray(out) - np.asarray(base)).max(-1) > 1e-4
            assert changed.all() == expect_change and changed.any() == expect_change, (s, region, changed)
