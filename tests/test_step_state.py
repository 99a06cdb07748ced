"""The step state of a chunk forward (dsv41_jax/step.py): frozen inputs, layers that return what they
write, and a forward whose cache is exactly what its layers returned."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv41_jax as d
from dsv41_jax.api import graphdef
from dsv41_jax.attention import Attention
from dsv41_jax.cache import formats_of
from dsv41_jax.plan import Mode, build_plan
from dsv41_jax.step import ForwardAux, Published, StepInputs
from tests.configs import TINY5

CFG = TINY5  # every layer mode of tiny, in 5 layers: the contracts checked here are per layer and per mode
B, CAP = 2, 48
TOKENS = np.random.default_rng(3).integers(0, CFG.vocab_size, (B, 21)).astype(np.int32)
PARAMS = d.init_params(CFG, seed=4)


def _model():
    return nnx.merge(graphdef(CFG), PARAMS)


def _prefilled():
    _, cache = d.prefill(CFG, PARAMS, d.init_cache(CFG, B, CAP), TOKENS, np.array([21, 14]))
    return cache


def test_inputs_and_published_are_frozen():
    cache = d.init_cache(CFG, B, CAP)
    inp = StepInputs(pos_bt=cache.lengths[:, None], lengths_b=cache.lengths, n_new_b=jnp.ones((B,), jnp.int32),
                     window_start_lb=cache.window_start, fmt=formats_of(CFG), decode=True)
    pub = Published(sources=cache.sources, views=(None,) * len(cache.sources))
    for obj, field in ((inp, "decode"), (inp, "pos_bt"), (inp, "kernels"), (pub, "topk_btk"), (pub, "sources")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)


def _record_layers(monkeypatch):
    """Wrap Attention.__call__ so that every call's inputs and returns are kept (tracers under jit)."""
    calls = []
    real = Attention.__call__

    def spy(self, x_btd, inp, ring, pub):
        out = real(self, x_btd, inp, ring, pub)
        calls.append((self.plan, inp, ring, pub, out))
        return out

    monkeypatch.setattr(Attention, "__call__", spy)
    return calls


@pytest.fixture(scope="module")
def chunk():
    """5 tokens on the prefilled cache (n_new 5 and 4) in one program, so one compile for two tests: the forward
    with its layers' calls recorded (test_cache_is_what_the_layers_return[chunk]) and the same forward with
    with_aux=True (test_forward_aux). Returns (the first forward's calls, (logits, cache) of the first, its
    layers' returned rings, the sources its last layer publishes, (logits, cache, aux) of the second)."""
    cache, model, tok, n_new = _prefilled(), _model(), jnp.asarray(TOKENS[:, :5]), jnp.array([5, 4])
    with pytest.MonkeyPatch.context() as mp:
        calls = _record_layers(mp)

        @jax.jit
        def run(cache):
            plain = model.forward(cache, tok, n_new, all_logits=True)
            mine = list(calls)  # the first forward's layers
            with_aux = model.forward(cache, tok, n_new, all_logits=True, with_aux=True)
            return plain, [c[4][1] for c in mine], mine[-1][4][2].sources, with_aux

        plain, rings, sources, with_aux = run(cache)
    return calls[:CFG.n_layers], plain, rings, sources, with_aux


@pytest.mark.parametrize("t", [1, 5], ids=["decode", "chunk"])
def test_cache_is_what_the_layers_return(monkeypatch, request, t):
    """Each layer's returned ring is the forward's window[l]; the sources the last layer publishes are the
    forward's sources; a layer leaves the `Published` it was given as it was, and replaces only what it owns."""
    if t == 5:  # the chunk form: the `chunk` fixture's program
        calls, (_, new), rings, sources, _ = request.getfixturevalue("chunk")
    else:
        cache = _prefilled()
        calls = _record_layers(monkeypatch)

        @jax.jit
        def run(cache, tok):
            _, new = _model().forward(cache, tok, jnp.array([t, t - 1 if t > 1 else 1]), all_logits=False)
            rings = [c[4][1] for c in calls]
            return new, rings, calls[-1][4][2].sources

        new, rings, sources = run(cache, jnp.asarray(TOKENS[:, :t]))
    plans = [c[0] for c in calls]
    assert [p.layer for p in plans] == list(range(CFG.n_layers))
    for layer, ring in enumerate(rings):
        for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(new.window)):
            np.testing.assert_array_equal(got, np.asarray(want)[layer])
    for got, want in zip(jax.tree.leaves(sources), jax.tree.leaves(new.sources)):
        np.testing.assert_array_equal(got, want)
    # the input step state is the same object for every layer, and a layer's Published is new only in
    # the parts it owns: a kv source its slot, an indexing layer the top-k (and pool, as the candidate source)
    assert all(c[1] is calls[0][1] for c in calls)
    for plan, _, _, pub_in, (_, _, pub_out, _) in calls:
        changed = {f.name for f in dataclasses.fields(Published) if getattr(pub_in, f.name) is not getattr(pub_out, f.name)}
        want = set()
        if plan.compresses:
            want |= {"sources"}
        if plan.has_indexer:
            want |= {"topk_btk"} | ({"pool_btn"} if plan.is_candidate_source else set())
        assert changed == want, (plan.layer, changed, want)
        if plan.compresses:
            others = [s for i, s in enumerate(pub_in.sources) if i != plan.source_slot]
            assert all(a is b for a, b in zip(others, [s for i, s in enumerate(pub_out.sources)
                                                        if i != plan.source_slot]))


def test_decode_equals_the_prefill_form():
    """One token through the decode path (T == 1: packed reads, pool scan, decode kernels' jnp twins)
    and through the chunk path (the same token right-padded to T == 2): same cache writes, logits
    within float rounding (quantization off so that no code can flip). The prompt goes in as chunks of
    the chunk form's width (one program for both)."""
    cfg = CFG.replace(quantize_cache=False)
    params = d.init_params(cfg, seed=4)
    chunks = d.prefill_chunks(cfg, params, d.init_cache(cfg, B, CAP), TOKENS, 0, 17, 2)  # 17: a group pending
    cache = [c for *_, c in chunks][-1]
    tok = np.array([7, 11], np.int32)
    dec_logits, dec = d.decode_step(cfg, params, cache, tok)
    pre_logits, pre = d.prefill(cfg, params, cache, np.stack([tok, tok], 1), np.array([1, 1]))
    np.testing.assert_array_equal(dec.lengths, pre.lengths)
    scale = np.abs(np.asarray(pre_logits)).max()
    np.testing.assert_allclose(dec_logits, pre_logits, rtol=0, atol=1e-5 * scale)
    def close(got, want):
        want = np.asarray(want, np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=1e-5 * np.abs(want).max(initial=0))

    jax.tree.map(close, dec.window, pre.window)
    # entries at or past a sequence's reachable count (and pending rows past the group's fill) are garbage
    # by the cache's contract: the padding token of the chunk form went into them
    new_len = np.asarray(dec.lengths)
    for m, got, want in zip([p.ratio for p in build_plan(cfg) if p.compresses], dec.sources, pre.sources):
        for b in range(B):
            rows = lambda tree, n: jax.tree.map(lambda a: np.asarray(a)[b, :n], tree)
            jax.tree.map(close, rows((got.entries, got.index_keys), new_len[b] // m),
                         rows((want.entries, want.index_keys), new_len[b] // m))
            jax.tree.map(close, rows((got.pend_kv, got.pend_score), new_len[b] % m),
                         rows((want.pend_kv, want.pend_score), new_len[b] % m))


def test_forward_aux(chunk):
    """with_aux=True: the same logits and cache, plus the by-products: one routed load per layer that
    counts every token's k assignments, the pending extension of each ratio > 1 kv source, and the
    DSpark target layers' hidden streams."""
    # one program for both (the `chunk` fixture): a with_aux that changed the computation would not fold into
    # the other
    (logits, new), (logits_aux, new_aux, aux) = chunk[1], chunk[4]
    assert isinstance(aux, ForwardAux)
    np.testing.assert_array_equal(logits, logits_aux)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_aux)):
        np.testing.assert_array_equal(a, b)
    load = np.asarray(aux.expert_load_le)
    assert load.shape == (CFG.n_layers, CFG.n_routed_experts)
    np.testing.assert_array_equal(load.sum(-1), B * 5 * CFG.n_activated_experts)  # padding rows are routed too
    ratios = [p.ratio for p in build_plan(CFG) if p.compresses]
    assert len(aux.pending_ext) == sum(m > 1 for m in ratios)
    assert aux.indexer == [] and aux.layers[0].window_view_btd is None  # training records only when training
    assert aux.hidden_btf.shape == (B, 5, CFG.dim * len(CFG.dspark_target_layer_ids))


def test_training_views_are_what_the_cache_stores():
    """The training forward's straight-through views of the sources are the decoded records it writes
    (up to f32 rounding of the STE sum), and each indexing layer returns one record for the KL loss."""
    cfg = CFG.replace(weight_format="float")
    params = d.init_params(cfg, seed=4)
    model = nnx.merge(graphdef(cfg), params)
    fwd = jax.jit(lambda c, tok: model.forward(c, tok, jnp.array([21, 21]), all_logits=True, training=True,
                                               with_aux=True))
    _, new, aux = fwd(d.init_cache(cfg, B, CAP), jnp.asarray(TOKENS))
    fmt = formats_of(cfg)
    for slot, (main_view, keys_view) in enumerate(aux.views):
        src = new.sources[slot]
        for view, codec, rec in ((main_view, fmt.main_kv, src.entries), (keys_view, fmt.index_key, src.index_keys)):
            want = np.asarray(codec.decode(rec))
            np.testing.assert_allclose(view, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    indexing = [p.layer for p in build_plan(cfg) if p.has_indexer]
    assert [r.layer for r in aux.indexer] == indexing
    assert all(p.mode is not Mode.WINDOW for p in build_plan(cfg) if p.layer in indexing)
