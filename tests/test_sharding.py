"""Multi-device decode on 8 simulated CPU devices: same logits as one device, every array where its
rule puts it (golden files per layout and mesh), bad meshes refused before compiling."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import dsv41_jax as d
from dsv41_jax import partitioning as S
from dsv41_jax.pytree_paths import path_str
from dsv41_jax.sharding import init_model, shard_model
from tests.configs import covered_elsewhere

# Cache quantization off: partitioned reductions change float summation order, and with the FP4/FP8
# cache a value on a rounding boundary can flip a code and then a top-k choice (SPEC: ties), which would
# blur what this test checks -- that the partitioned program computes the same function.
# A 4-layer cut of tiny (window, Full m=2, Full m=1 candidate source, Reindex; Engram; 8 experts) keeps
# every sharded array kind while halving compile time on 8 simulated devices.
_TINY = d.preset("tiny")
CFG = _TINY.replace(n_layers=4, n_mtp_layers=0, compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2), index_source_layers=(1, 2, 3),
                    candidate_source_layer=2, engram_layer_ids=(0,),
                    engram_num_embeddings=_TINY.engram_num_embeddings[:1], quantize_cache=False)
GOLDEN = Path(__file__).parent / "golden_sharding"
# tp_ep's expert=8 and dp's data=8 only with DSV41_FULL=1 (the suite's time, ~67 s on the 2-core CI machine): their
# axes are the three-axis tp_ep case's and test_expert_parallel's dp layout; their golden files stay checked then.
_FULL = covered_elsewhere("the three-axis tp_ep case and test_expert_parallel's dp layout")
MESHES = [("tp_ep", "data=2,tensor=2,expert=2"), pytest.param("tp_ep", "expert=8", marks=_FULL),
          pytest.param("dp", "data=8", marks=_FULL), ("dp_ep", "data=2,expert=4")]
B, T, CAP = 8, 21, 32


@pytest.fixture(scope="module")
def reference():
    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    params = d.init_params(CFG, seed=2)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, CFG.vocab_size, (B, T))
    lens = rng.integers(5, T + 1, B)
    full, cache = d.prefill(CFG, params, d.init_cache(CFG, B, CAP), tok, lens, all_logits=True)
    nxt = rng.integers(0, CFG.vocab_size, B)
    step, _ = d.decode_step(CFG, params, cache, nxt)
    return params, tok, lens, nxt, np.asarray(full), np.asarray(step)


def _specs(tree) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(p): str(leaf.sharding.spec) for p, leaf in flat}


@pytest.mark.parametrize("layout,mesh", MESHES)
def test_sharded_matches_one_device_and_golden_placement(reference, layout, mesh):
    params, tok, lens, nxt, full, step = reference
    m = shard_model(CFG, params, S.make_mesh(CFG, mesh, batch=B, layout=layout), layout, batch=B)
    cache = m.init_cache(CAP)
    logits, cache = m.prefill(cache, tok, lens, all_logits=True)
    out, cache = m.decode_step(cache, nxt)
    scale = np.abs(full).max()
    valid = np.arange(T)[None, :] < lens[:, None]
    got = np.asarray(logits)
    assert np.abs(got - full)[valid].max() <= 1e-5 * scale
    np.testing.assert_array_equal(got.argmax(-1)[valid], full.argmax(-1)[valid])
    assert np.abs(np.asarray(out) - step).max() <= 1e-5 * scale
    np.testing.assert_array_equal(np.asarray(out).argmax(-1), step.argmax(-1))
    placed = {"params": _specs(m.params), "cache_after_decode": _specs(cache)}
    path = GOLDEN / f"{layout}_{mesh.replace(',', '_').replace('=', '')}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(placed, indent=1, sort_keys=True))
    assert placed == json.loads(path.read_text())


def test_rules_shard_what_they_say():
    """Spot checks of the golden files' meaning, independent of them."""
    g = json.loads((GOLDEN / "tp_ep_data2_tensor2_expert2.json").read_text())["params"]
    assert g["layers/2/ffn/w1"] == "P('expert', None, None)"
    assert g["layers/2/attn/wq_b/weight"] == "P('tensor', None)"
    assert g["layers/2/attn/wo_b/weight"] == "P(None, 'tensor')"
    assert g["layers/3/attn/indexer/wq_b/weight"] == "P('tensor', None)"
    assert g["layers/0/engram/table"] == "P('expert', None)"
    assert g["layers/2/attn/wkv/weight"] == "P()"
    c = json.loads((GOLDEN / "tp_ep_data2_tensor2_expert2.json").read_text())["cache_after_decode"]
    assert c["window/values"] == "P(None, 'data', None, None)"
    assert c["sources/0/entries/values"] == "P('data', None, None)"


def test_params_carry_logical_axes_metadata():
    """Every param listed in PARAM_AXES carries its logical axes as NNX `out_sharding` metadata, written
    when the model is built; the others carry none (replicated)."""
    listed = 0
    for path, var in nnx.to_flat_state(d.abstract_params(CFG)):
        axes = S.param_logical_axes("/".join(map(str, path)))
        assert var.get_metadata().get("out_sharding") == axes, path
        if axes is not None:
            listed += 1
            assert var.get_metadata()["eager_sharding"] is False  # logical names: nothing placed at build
    assert listed == 49
    assert d.abstract_params(CFG)["layers"][2]["attn"]["wq_b"]["weight"].get_metadata()["out_sharding"] == ("heads", None)


def test_model_structure_builds_inside_a_mesh_context():
    """A `placement=` call traces under jax.set_mesh; the model's structure (api.graphdef, first built lazily
    there) must not try to place the logical-axis metadata on that mesh."""
    from dsv41_jax import api

    cfg = CFG.replace(window_size=CFG.window_size * 2)  # a config not cached by other tests
    api.graphdef.cache_clear()
    built = []

    def trace():  # what a `placement=` call's jitted prefill does first
        built.append((api.graphdef(cfg), d.abstract_params(cfg)))
        return 0

    with jax.set_mesh(S.make_mesh(cfg, "data=2,tensor=2,expert=2")):
        jax.jit(trace)()
    assert len(jax.tree.leaves(built[0][1])) == len(jax.tree.leaves(d.abstract_params(CFG)))


def test_shardings_come_from_the_metadata_and_the_layout_rules():
    mesh = AbstractMesh((2, 2, 2), S.MESH_AXES)
    params = d.abstract_params(CFG)
    spec = lambda p: p["layers"][2]["attn"]["wkv"]["weight"]
    assert spec(S.param_specs(params, mesh)).get_value() == jax.P()  # no metadata: replicated
    spec(params).set_metadata(out_sharding=("heads", None))  # the table is not consulted again
    assert spec(S.param_specs(params, mesh)).get_value() == jax.P("tensor", None)
    assert spec(S.param_specs(params, mesh, "dp")).get_value() == jax.P(None, None)
    assert spec(S.param_shardings(params, mesh)).get_value().spec == jax.P("tensor", None)
    spec(params).set_metadata(out_sharding=("experts", None))  # rules of the layout, not of the path
    assert spec(S.param_specs(params, mesh)).get_value() == jax.P("expert", None)
    spec(params).set_metadata(out_sharding=("nonesuch", None))
    with pytest.raises(ValueError, match="'nonesuch' has no rule"):
        S.param_specs(params, mesh)


def test_every_layout_has_a_rule_for_every_logical_axis():
    used = {a for table in (S.PARAM_AXES, S.CACHE_AXES) for _, axes in table for a in axes if a}
    for layout, rules in S.LAYOUTS.items():
        assert {logical for logical, _ in rules} == used, layout
        for _, m in rules:
            assert m is None or set((m,) if isinstance(m, str) else m) <= set(S.MESH_AXES), layout


@pytest.mark.parametrize("mesh,words", [
    ("data=2,expert=2", "4 devices but 8 are available"),
    ("tensor=8", "tensor=8 does not divide n_heads=4"),
    ("expert=8,data=1,tensor=1", None),  # fine
    ("data=8", None),
    ("tensor=4,data=2", "does not divide o_groups=2"),
    ("expert=3", "3 devices"),
    ("pipeline=8", "bad mesh entry"),
    ("data=16", "16 devices"),
])
def test_bad_meshes_are_refused_before_compiling(mesh, words):
    if words is None:
        S.make_mesh(CFG, mesh, batch=8, devices=jax.devices()[:8] if len(jax.devices()) >= 8 else None)
        return
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        S.check_mesh(CFG, S.parse_mesh(mesh), batch=8, n_devices=8)


def test_batch_must_divide_the_data_axis():
    with pytest.raises(ValueError, match="data=4 does not divide batch=6"):
        S.check_mesh(CFG, {"data": 4, "expert": 2}, batch=6, n_devices=8)


def test_mesh_decode_calls_the_same_kernels_as_one_device(reference, monkeypatch):
    """`kernels=` reaches the model on a mesh as on one device: a decode step with kernels="pallas"
    (interpret mode on CPU) enters the same Pallas kernels -- checked by spying on every kernel entry
    that `dsv41_jax.kernels` dispatches to -- and gives the same logits. Two devices splitting the
    attention heads (the kernels' inputs) and an empty cache keep the compiles short."""
    import kernels_pallas

    cfg = CFG.replace(quantize_cache=True)  # the released record formats, which the kernels read
    params, nxt = reference[0], reference[3]  # the params do not depend on the cache format
    calls: list[str] = []

    def spy(name, fn):
        def entry(*args, **kwargs):
            calls.append(name)  # at trace time: each kernel the traced step enters
            return fn(*args, **kwargs)
        return entry

    for name in kernels_pallas.__all__:
        if name != "platform":
            monkeypatch.setattr(kernels_pallas, name, spy(name, getattr(kernels_pallas, name)))
    cache = d.init_cache(cfg, B, CAP)  # the first token: a prefill would only add a compile
    plain, _ = d.decode_step(cfg, params, cache, nxt, kernels="pallas")
    on_one, calls[:] = sorted(calls), []
    m = shard_model(cfg, params, S.make_mesh(cfg, "tensor=2", batch=B, devices=jax.devices()[:2]), batch=B)
    sharded, _ = m.decode_step(m.place_cache(cache), nxt, kernels="pallas")
    assert {"sparse_attention_decode", "indexer_scores_decode", "select_topk"} <= set(on_one)
    assert sorted(calls) == on_one
    # partitioned sums may round the new token's FP8 window record differently: a loose, honest bound
    scale = np.abs(np.asarray(plain)).max()
    assert np.abs(np.asarray(sharded) - np.asarray(plain)).max() <= 1e-2 * scale


def test_mesh_calls_are_checked_like_one_device(reference):
    """The mesh path is the api's checked call: bad inputs are refused with the api's messages, and a
    cache of another batch than the placement's is refused, before anything is compiled."""
    params = reference[0]
    m = shard_model(CFG, params, S.make_mesh(CFG, "data=2", batch=B, devices=jax.devices()[:2]), batch=B)
    cache = m.init_cache(CAP)
    assert cache.window["values"].sharding.spec == jax.P(None, "data", None, None)
    with pytest.raises(ValueError, match="outside"):
        m.decode_step(cache, np.full(B, CFG.vocab_size))
    with pytest.raises(ValueError, match="exceeds its capacity"):
        m.prefill(cache, np.zeros((B, CAP + 1), np.int32), np.full(B, CAP + 1))
    with pytest.raises(ValueError, match="placed for batch 8"):
        m.decode_step(d.init_cache(CFG, 2, CAP), np.zeros(2, np.int32))


def test_decode_cli_takes_one_path_with_or_without_a_mesh(monkeypatch, capsys):
    """`experiments.decode --mesh` runs the api entry points the plain run does (prefill, then generate
    in chunks), with the same `kernels`, plus the placement on the mesh asked for. The entry points
    are recorded and stubbed: what they compute is checked above."""
    from experiments import decode

    seen = []

    def prefill(cfg, params, cache, tokens_bt, lengths_b, **kw):
        seen.append(("prefill", kw["kernels"], kw["placement"]))
        return jax.numpy.zeros((cache.batch, cfg.vocab_size)), cache

    def generate(cfg, params, cache, tokens_b, n_steps, **kw):
        seen.append(("generate", kw["kernels"], kw["placement"]))
        return jax.numpy.zeros((cache.batch, n_steps), np.int32), None, cache

    monkeypatch.setattr(d, "prefill", prefill)
    monkeypatch.setattr(d, "generate", generate)
    # the random weights placed as drawn on one device (drawing them into their shards compiles ~85 programs,
    # ~15 s; test_random_params_are_drawn_into_their_shards checks that path)
    monkeypatch.setattr("dsv41_jax.sharding.init_model", lambda cfg, mesh, layout, batch, seed: shard_model(
        cfg, d.init_params(cfg, seed=seed), mesh, layout, batch=batch))
    argv = ["--preset", "tiny", "--prompt", "hello", "--batch", "8", "--max-new-tokens", "5", "--decode-chunk", "2",
            "--kernels", "pallas"]
    decode.main(argv)
    plain, seen[:] = list(seen), []
    decode.main(argv + ["--mesh", "data=2,expert=4"])
    assert [(name, k) for name, k, _ in seen] == [(name, k) for name, k, _ in plain] == \
        [("prefill", "pallas"), ("generate", "pallas"), ("generate", "pallas")]
    assert all(p is None for *_, p in plain)
    assert all(dict(p.mesh.shape) == {"data": 2, "expert": 4} and p.layout == "tp_ep" for *_, p in seen)


def test_random_params_are_drawn_into_their_shards():
    """`init_model` (what `experiments.decode --mesh` draws random weights with): every param already where
    `shard_model` would put it, a routed expert weight split over `expert` (a device holds a quarter), the values
    those of `init_params` with the same seed up to a few f32 ulps of the leaf's largest value (one XLA program
    instead of op by op rounds some draws differently; 8 allowed, for other CPUs' code generation)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    mesh = S.make_mesh(CFG, "data=2,expert=4", batch=B, layout="tp_ep")
    drawn = init_model(CFG, mesh, "tp_ep", batch=B, seed=2)
    placed = shard_model(CFG, d.init_params(CFG, seed=2), mesh, "tp_ep", batch=B)
    assert _specs(drawn.params) == _specs(placed.params)
    w1 = drawn.params["layers"][1]["ffn"]["w1"][...]
    assert w1.addressable_shards[0].data.shape[0] * 4 == w1.shape[0]
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(drawn.params)[0], jax.tree.leaves(placed.params),
                            strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -20 * float(np.abs(b).max(initial=0.0)),
                                   err_msg=path_str(path))


# The engine's DSpark steps on a mesh (tests/test_engine_mesh.py) run the same sharded api programs.
@covered_elsewhere("tests/test_engine_mesh.py's DSpark case")
def test_sharded_speculative_steps_emit_the_one_device_greedy_tokens():
    """`ShardedModel.speculative_prefill` / `speculative_generate` (DSpark through `api` on a mesh: data=2 x
    expert=4, tp_ep) emit at temperature 0 the tokens one device's prefill + `generate` do, with the draft
    rings split like the cache's window. tiny's layer modes in 5 layers, float32, raw cache (nothing quantized
    whose code a partitioned sum's order could flip)."""
    from tests.configs import TINY5

    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    cfg, b, n, cap = TINY5.replace(quantize_cache=False), 2, 12, 64
    params = d.init_params(cfg, seed=0)
    rng = np.random.default_rng(5)
    tok, lens = rng.integers(0, cfg.vocab_size, (b, 19)), np.array([19, 6])
    logits, cache = d.prefill(cfg, params, d.init_cache(cfg, b, cap), tok, lens)
    first = np.asarray(logits).argmax(-1).astype(np.int32)
    want = np.asarray(d.generate(cfg, params, cache, first, n)[0])
    m = shard_model(cfg, params, S.make_mesh(cfg, "data=2,expert=4", batch=b), batch=b)
    logits, cache, window = m.speculative_prefill(m.init_cache(cap), m.init_draft_window(), tok, lens)
    np.testing.assert_array_equal(np.asarray(logits).argmax(-1), first)
    out, n_out, _, _, cache, window = m.speculative_generate(cache, window, first, n, budget_b=n)
    out, n_out = np.asarray(out), np.asarray(n_out)
    for row in range(b):
        np.testing.assert_array_equal(np.concatenate([out[row, s, :n_out[row, s]] for s in range(n)]), want[row])
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens + n)
    assert cache.window["values"].sharding.spec[1] == "data"
    assert all(a.sharding.spec[1] == "data" and len(a.sharding.device_set) == 8 for a in jax.tree.leaves(window))


def test_empty_draft_rings_are_made_on_the_mesh():
    """`Placement.new_window` (the engine's and `ShardedModel.init_draft_window`'s): zero rings split like the
    cache's window rings, made where they live: no transfer (made on one device and then placed, rings sized to the
    devices' memory would not fit the first)."""
    from tests.configs import TINY5

    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    cfg, b = TINY5, 4
    mesh = S.make_mesh(cfg, "data=2,expert=4", batch=b)
    placement = shard_model(cfg, d.init_params(cfg, seed=0), mesh, batch=b).placement
    placement.new_window(cfg)  # compiled here: the transfer guard below watches the call alone
    with jax.transfer_guard("disallow"):  # made on one device and then split, the rings would be transferred
        window = placement.new_window(cfg)
    want = placement.window_shardings(window)
    ref = d.api.init_draft_window(cfg, b)
    for got, sharding, zeros in zip(jax.tree.leaves(window), jax.tree.leaves(want), jax.tree.leaves(ref), strict=True):
        assert got.sharding.is_equivalent_to(sharding, got.ndim) and got.shape == zeros.shape
        assert got.addressable_shards[0].data.shape[1] * 2 == got.shape[1]  # a device holds its half of the batch
        assert not np.any(np.asarray(got))
    bare = TINY5.replace(n_mtp_layers=0)
    with pytest.raises(ValueError, match="no DSpark draft stages"):
        shard_model(bare, d.init_params(bare, seed=0), mesh, batch=b).init_draft_window()
