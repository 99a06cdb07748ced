"""DSpark speculative decoding: the commit is the chunk replay bit for bit, greedy speculative decoding
emits exactly the plain decode's tokens, sampling keeps the target's distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv41_jax as d
from dsv41_jax import api, dspark
from tests.configs import TINY5

# tiny's layer modes in 5 layers (what is checked is the draft/verify/commit machinery, not tiny's depth): f32,
# FP4/FP8 cache on, 2 draft stages, blocks of K = 3, window 16, ratios 2 and 1
CFG = TINY5
K = CFG.dspark_block_size
PARAMS = d.init_params(CFG, seed=0)
LENS = np.array([13, 5, 8])  # unequal prompts; decoding crosses ratio-2 groups and the 16-slot ring
B, T0, N, CAP = 3, 13, 26, 64  # CAP: test_generate.py's, so plain decode here is its donated decode program


def _prompt():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T0)).astype(np.int32)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.fixture(scope="module")
def plain():
    """(first token, the N greedy tokens plain decode emits after it per row, the prefilled (cache, draft
    window)). The speculative prefill's cache is the plain prefill's (the same forward)."""
    window = api.init_draft_window(CFG, B)
    logits, cache, window = api.speculative_prefill(CFG, PARAMS, d.init_cache(CFG, B, CAP), window, _prompt(), LENS)
    tok = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)
    prefilled, toks, c, t = (_copy(cache), _copy(window)), [], cache, tok
    for _ in range(N):
        logits, c = d.decode_step(CFG, PARAMS, c, t, validate=False, donate=True)
        t = jnp.argmax(logits, -1).astype(jnp.int32)
        toks.append(np.asarray(t))
    return tok, np.stack(toks, 1), prefilled


def _model(params):
    return nnx.merge(api.graphdef(CFG), params)


@jax.jit
def _verify(params, cache, window, tok, drafts, budget):
    zeros = jnp.zeros((B,), jnp.int32)
    q_logits = jax.nn.one_hot(drafts, CFG.vocab_size) * 30.0  # a greedy draft: q is one-hot on the drafts
    return dspark.verify(_model(params), cache, window, tok, drafts, q_logits, jnp.zeros((B,), jnp.float32),
                         zeros.astype(jnp.uint32), zeros, budget, jnp.full((B, 1), -1, jnp.int32))


@jax.jit
def _replay(params, cache, window, block, n_new):
    """What the commit must equal: the accepted tokens appended as one chunk, rings from its own hidden."""
    model = _model(params)
    _, after, aux = model.forward(cache, block, n_new, all_logits=True, with_aux=True)
    return after, dspark.write_rings(model, window, aux.hidden_btf, cache.lengths, n_new)


def test_commit_is_the_chunk_replay_and_greedy_tokens_are_plain_decode(plain):
    """Oracle drafts (plain decode's tokens, one slot corrupted at a random place, or none) make every
    acceptance count 0..K happen; each step's cache and draft rings must equal the replay bit for bit,
    and the emitted tokens must be the plain decode's."""
    tok0, want, prefilled = plain
    rng = np.random.default_rng(1)
    cache, window = _copy(prefilled)
    tok, count, got, seen = jnp.asarray(tok0), np.zeros(B, int), [[] for _ in range(B)], set()
    padded = np.pad(want, ((0, 0), (0, K + 1)))
    while (count < N).any():
        drafts = np.stack([padded[b, count[b]:count[b] + K] for b in range(B)]).astype(np.int32)
        bad = rng.integers(0, K + 1, B)  # corrupt slot `bad` (K: keep all)
        for b in range(B):
            if bad[b] < K:
                drafts[b, bad[b]] = (drafts[b, bad[b]] + 1 + rng.integers(0, 50)) % CFG.vocab_size
        before_cache, before_window, block = cache, window, np.concatenate([np.asarray(tok)[:, None], drafts], 1)
        out, n_out, tok, _, cache, window, stats = _verify(PARAMS, cache, window, tok, drafts,
                                                           jnp.asarray(N - count, jnp.int32))
        n_out, out = np.asarray(n_out), np.asarray(out)
        want_cache, want_window = _replay(PARAMS, before_cache, before_window, block, jnp.asarray(n_out))
        for a, w in zip(jax.tree.leaves((cache, window)), jax.tree.leaves((want_cache, want_window))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
        for b in range(B):
            if count[b] < N:
                seen.add(int(np.asarray(stats["accepted"])[b]))
            got[b] += out[b, :n_out[b]].tolist()
        count += n_out
    assert seen == set(range(K + 1)), seen
    np.testing.assert_array_equal(np.array(got), want)
    np.testing.assert_array_equal(np.asarray(cache.lengths), LENS + N)


def test_speculative_generate_equals_generate_with_budgets_and_stops(plain):
    """The real draft end to end (random weights: it rarely guesses right), against `generate`."""
    tok0, want, prefilled = plain
    stop_at = want[1, 4]
    stops = np.array([[-1], [stop_at], [-1]], np.int32)
    budget = np.array([N, N, 7], np.int32)
    cache, window = _copy(prefilled)
    out, n_out, accepted, _, after, _ = api.speculative_generate(CFG, PARAMS, cache, window, tok0, N,
                                                                 budget_b=budget, stop_ids_bs=stops)
    out, n_out = np.asarray(out), np.asarray(n_out)
    rows = [np.concatenate([out[b, s, :n_out[b, s]] for s in range(N)]) for b in range(B)]
    first_stop = int(np.argmax(want[1] == stop_at))
    np.testing.assert_array_equal(rows[0], want[0])
    np.testing.assert_array_equal(rows[1], want[1, :first_stop + 1])
    np.testing.assert_array_equal(rows[2], want[2, :7])
    np.testing.assert_array_equal(np.asarray(after.lengths), LENS + [N, first_stop + 1, 7])
    assert (np.asarray(accepted) <= K).all()


def test_speculative_sampling_keeps_the_target_distribution():
    """accept + emit on a synthetic Markov target and a different Markov draft (vocabulary 4, K = 3,
    temperature 0.7): the first three emitted tokens of 20,000 rows follow the target's joint law (chi-square),
    and would visibly not if drafts were accepted blindly."""
    v, k, n, temp = 4, 3, 20000, 0.7
    rng = np.random.default_rng(3)
    target, drafter = rng.normal(0, 1.5, (v, v)).astype(np.float32), rng.normal(0, 1.5, (v, v)).astype(np.float32)
    tok = jnp.zeros((n,), jnp.int32)
    seeds = jnp.arange(n, dtype=jnp.uint32)
    temps = jnp.full((n,), temp, jnp.float32)
    step = jnp.zeros((n,), jnp.int32)
    budget = jnp.full((n,), 3, jnp.int32)
    stops = jnp.full((n, 1), -1, jnp.int32)
    got = []
    for s in range(3):
        keys = jax.random.split(jax.random.key(100 + s), k)
        prev, drafts, q = tok, [], []
        for i in range(k):
            logits = jnp.asarray(drafter)[prev]
            prev = jax.random.categorical(keys[i], logits / temp).astype(jnp.int32)
            drafts.append(prev)
            q.append(logits)
        drafts = jnp.stack(drafts, 1)
        block = jnp.concatenate([tok[:, None], drafts], 1)
        acc, nxt = dspark.accept(drafts, jnp.stack(q, 1), jnp.asarray(target)[block], temps, seeds, step)
        out, n_out, tok, budget = dspark.emit(drafts, acc, nxt, tok, budget, stops)
        got.append(np.asarray(out))
        step = step + n_out
    seqs = np.concatenate(got, 1)
    seqs = np.stack([row[row >= 0][:3] for row in seqs])
    counts = np.bincount(seqs[:, 0] * v * v + seqs[:, 1] * v + seqs[:, 2], minlength=v ** 3)

    def joint(m):
        p = np.exp(m / temp) / np.exp(m / temp).sum(-1, keepdims=True)
        return (p[0][:, None, None] * p[:, :, None] * p[None, :, :]).reshape(-1)  # P(a|0) P(b|a) P(c|b)

    def chi2(expected):
        e = expected * n
        return float(((counts - e) ** 2 / np.maximum(e, 1e-9)).sum())

    # 63 degrees of freedom: mean 63, sd 11.2; the 1e-4 quantile is about 117
    assert chi2(joint(target)) < 117, chi2(joint(target))
    assert chi2(joint(drafter)) > 1000



def test_training_forward_is_the_inference_forward_on_an_empty_cache():
    """Draft distillation reads the target's training forward (it compiles faster): for one chunk from an
    empty cache its logits and hidden streams must be the inference forward's. (Equal to the bit here;
    the two paths quantize the cache by different ops, so a 1-ulp difference on another CPU may flip an
    FP4/FP8 code and move a few positions: at most 5% of them, by at most a quarter of the scale.)"""
    params = PARAMS  # seed 0
    tokens = jnp.asarray(np.random.default_rng(7).integers(3, CFG.vocab_size, (2, 24)), jnp.int32)

    @jax.jit
    def both(p, tok):  # one program for the two forwards: one compile
        model = nnx.merge(api.graphdef(CFG), p)
        return [model.forward(d.init_cache(CFG, 2, 24), tok, jnp.full((2,), 24, jnp.int32), all_logits=True,
                              training=training, with_aux=True) for training in (False, True)]

    (inf_logits, _, inf), (tr_logits, _, tr) = both(params, tokens)
    for got, want in ((tr_logits, inf_logits), (tr.hidden_btf, inf.hidden_btf)):
        err = np.abs(np.asarray(got) - np.asarray(want)).reshape(2, 24, -1).max(-1) / np.abs(np.asarray(want)).max()
        assert np.mean(err > 1e-5) <= 0.05 and err.max() <= 0.25, (np.mean(err > 1e-5), err.max())


def test_draft_training_raises_acceptance_on_a_frozen_target():
    """Self-distillation on the frozen tiny target: the draft's greedy acceptance on the training batch
    rises from chance, only draft params move, and the backbone's LM step leaves the draft alone."""
    import optax

    from dsv41_jax import train

    cfg = d.preset("tiny", quantize_cache=False)  # tiny's 8 layers: the acceptance below was measured on them
    params = d.init_params(cfg, seed=0)
    opt = optax.adam(3e-2)
    anchors = (4, 9, 14, 19, 24, 28)
    step = train.make_draft_train_step(cfg, opt, anchors)
    state = train.init_draft_opt_state(opt, params)
    tokens = jnp.asarray(np.random.default_rng(5).integers(3, CFG.vocab_size, (2, 32)), jnp.int32)
    before = params
    accs = []
    for _ in range(20):
        params, state, m = step(params, state, {"tokens": tokens})
        accs.append(float(m["greedy_acceptance"]))
    # greedy slots accepted per anchor (of K = 3): chance is ~1/320 per slot; measured 0 -> 0.75 in 20 steps
    assert accs[0] < 0.1 and np.mean(accs[-3:]) > 0.5, accs
    moved = {k for k, a, b in _diff(before, params)}
    assert moved and all(k.startswith("mtp/") for k in moved), sorted(moved)[:5]
    assert train.split_trainable(params)[0] and not any(
        k.startswith("mtp/") for k in _flat(train.split_trainable(params)[0]))


def _flat(state):
    from dsv41_jax.checkpoint.orbax_io import flat_params

    return flat_params(state)


def _diff(a, b):
    fa, fb = _flat(a), _flat(b)
    return [(k, fa[k], fb[k]) for k in fa if not np.array_equal(np.asarray(fa[k]), np.asarray(fb[k]))]
