"""Expert parallelism by all-to-all (dsv41_jax/expert_parallel.py) on 8 simulated CPU devices: the MoE
layer and the whole model give the single-device result (float32) in every layout and transport."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dsv41_jax as d
from dsv41_jax import expert_parallel as EP
from dsv41_jax import partitioning as S
from dsv41_jax.moe import MoE
from dsv41_jax.sequence_split import split_over
from dsv41_jax.sharding import greedy, shard_model
from tests.configs import covered_elsewhere

# released packed FP4 experts (E8M0 / 32) and FP8 shared expert; 16 experts, top-4: the routing spreads
MOE_CFG = d.preset("tiny").replace(weight_format="fp8", n_routed_experts=16, n_activated_experts=4)
# a 2-layer cut of tiny (window, Full m=1 candidate source): short compiles for whole-model checks
TWO_LAYERS = d.preset("tiny").replace(n_layers=2, n_mtp_layers=0, compress_ratios=(0, 1), kv_source_layers=(1,),
                                      index_source_layers=(1,), candidate_source_layer=1, engram_layer_ids=(),
                                      engram_num_embeddings=())


@pytest.fixture(autouse=True)
def _eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` as its docstring specifies it, from dense all_to_all (XLA:CPU has no
    ragged-all-to-all): slice i of the operand goes to device i and lands at that device's
    output_offsets[i]; what device s sent is written at all_to_all(output_offsets)[s], recv_sizes[s] rows."""
    assert axis_index_groups is None
    m, rows = operand.shape[0], jnp.arange(operand.shape[0])
    keep = lambda r, size: (r < size).reshape(-1, *(1,) * (operand.ndim - 1))
    blocks = jnp.stack([jnp.where(keep(rows, send_sizes[i]), jnp.roll(operand, -input_offsets[i], axis=0), 0)
                        for i in range(send_sizes.shape[0])])
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    for s in range(send_sizes.shape[0]):
        idx = jnp.where(rows < recv_sizes[s], where[s] + rows, output.shape[0])
        output = output.at[idx].set(got[s][:m], mode="drop")
    return output


@pytest.fixture(params=["dense", "ragged"])
def transport(request, monkeypatch):
    monkeypatch.setattr(EP, "TRANSPORT", request.param)
    if request.param == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", ragged_all_to_all_reference)
    return request.param


@pytest.fixture(scope="module")
def moe_reference():
    graphdef, state = nnx.split(MoE(MOE_CFG, rngs=nnx.Rngs(3)))
    x = jax.random.normal(jax.random.key(0), (8, 5, MOE_CFG.dim), jnp.float32)
    run = lambda state, x: nnx.merge(graphdef, state)(x)[0]  # (y, routed load)
    return graphdef, state, x, np.asarray(jax.jit(run)(state, x)), run


@pytest.mark.parametrize("shape,names,token_axes", [
    ((8,), ("expert",), ("data", "expert")),  # dp_ep: every device its own sequences
    ((2, 4), ("data", "expert"), ("data", "expert")),  # dp_ep over two expert groups
    ((2, 4), ("data", "expert"), ("data",)),  # tp_ep: tokens whole on every expert shard
    ((2, 2, 2), ("data", "tensor", "expert"), ("data",)),
])
def test_moe_layer_equals_one_device(moe_reference, transport, shape, names, token_axes):
    graphdef, state, x, want, run = moe_reference
    mesh = Mesh(np.asarray(jax.devices()).reshape(shape), names)
    experts = lambda path: any(getattr(p, "key", None) in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")
                               for p in path)
    placed = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, NamedSharding(mesh, P("expert") if experts(path) else P())), state)
    split = tuple(a for a in token_axes if a in names)
    with jax.set_mesh(mesh), split_over(token_axes):  # a new function: traced for this transport
        got = jax.jit(lambda s, x: run(s, x))(placed, jax.device_put(x, NamedSharding(mesh, P(split))))
    scale = np.abs(want).max()
    assert np.abs(np.asarray(got) - want).max() <= 1e-5 * scale


def test_per_sender_calls_equal_one_call(moe_reference, monkeypatch):
    """A receive buffer beyond the weight kernels' rows is computed one sender block at a time."""
    from dsv41_jax import kernels

    graphdef, state, x, want, run = moe_reference
    monkeypatch.setattr(kernels, "WEIGHT_KERNEL_ROWS", 20)  # 5 tokens x 4 slots per block; 8 blocks
    mesh = Mesh(np.asarray(jax.devices()), ("expert",))
    with jax.set_mesh(mesh), split_over(("data", "expert")):
        got = jax.jit(lambda s, x: run(s, x))(state, x)
    assert np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max()


def test_padding_tokens_go_nowhere(moe_reference, transport):
    """5 tokens on 8 devices: three padding rows, routed to no expert, cost no dispatch and vanish."""
    graphdef, state, x, want, run = moe_reference
    mesh = Mesh(np.asarray(jax.devices()), ("expert",))
    with jax.set_mesh(mesh), split_over(("data", "expert")):
        got = jax.jit(lambda s, x: run(s, x))(state, x[:1])
    assert np.abs(np.asarray(got) - want[:1]).max() <= 1e-5 * np.abs(want).max()


def test_dispatch_sends_each_token_once_per_shard_it_needs():
    """A token goes to each shard owning one of its experts, once, whatever number of its experts that
    shard owns; padding (id -1) goes nowhere. 8 experts on 2 shards: shard 0 owns 0-3."""
    ids = jnp.array([[0, 1], [0, 5], [6, 7], [-1, -1], [2, 3]], jnp.int32)
    send, order = EP.dispatch_plan(ids, n_local=4, ep=2)
    np.testing.assert_array_equal(np.asarray(send), [3, 2])
    np.testing.assert_array_equal(np.asarray(order)[0, :3], [0, 1, 4])
    np.testing.assert_array_equal(np.asarray(order)[1, :2], [1, 2])


# tp_ep and dp_ep are tests/test_sharding.py's default meshes (on 8 devices); dp is the case of it only here.
_EP = covered_elsewhere("tests/test_sharding.py's tp_ep and dp_ep meshes")


@pytest.mark.parametrize("layout,mesh", [("dp", "data=2"), pytest.param("tp_ep", "expert=2", marks=_EP),
                                         pytest.param("dp_ep", "expert=2", marks=_EP)])
def test_greedy_tokens_and_logits_equal_one_device(layout, mesh):
    """float32, a 2-layer cut of tiny: on 2 devices -- data=2 (dp), expert=2 (tp_ep) and expert=2
    (dp_ep) -- the prefill logits agree with one device's to 1e-5 x scale and greedy generation emits
    the single-device tokens."""
    cfg = TWO_LAYERS.replace(quantize_cache=False)
    b, cap, steps = 4, 24, 6
    params = d.init_params(cfg, seed=5)
    tok = np.random.default_rng(1).integers(0, cfg.vocab_size, (b, 7))
    lens = np.array([7, 3, 5, 6])

    want_logits, want_toks = greedy(cfg, params, tok, lens, cap, steps)
    m = shard_model(cfg, params, S.make_mesh(cfg, mesh, batch=b, devices=jax.devices()[:2], layout=layout),
                    layout, batch=b)
    logits, toks = greedy(cfg, params, tok, lens, cap, steps, m)
    np.testing.assert_array_equal(toks, want_toks)
    assert np.abs(logits - want_logits).max() <= 1e-5 * np.abs(want_logits).max()


def test_dp_ep_places_sequences_on_every_device_and_checks_the_batch():
    cfg = d.preset("tiny")
    mesh = S.make_mesh(cfg, "data=2,expert=4", batch=8, layout="dp_ep")
    cache = S.place(cfg, d.abstract_params(cfg), mesh, "dp_ep", batch=8).cache
    assert cache.lengths.spec == P(("data", "expert"))
    with pytest.raises(S.MeshError, match=r"data\*expert=8 does not divide batch=4.*layout dp_ep splits"):
        S.check_mesh(cfg, {"data": 2, "expert": 4}, batch=4, n_devices=8, layout="dp_ep")
    S.check_mesh(cfg, {"data": 2, "expert": 4}, batch=4, n_devices=8, layout="tp_ep")  # only data splits it


def test_kernels_run_per_device_on_their_own_sequences(monkeypatch):
    """dp_ep, kernels="pallas" (interpret mode on CPU), 2 devices: every Pallas kernel is entered with
    one device's sequences (a custom call under GSPMD would get the gathered batch) and the step's
    logits match one device's. An empty cache keeps the compile short."""
    import kernels_pallas

    cfg = TWO_LAYERS.replace(weight_format="fp8")
    b = 4
    params = d.init_params(cfg, seed=5)
    nxt = np.arange(b, dtype=np.int32) + 3
    rows: dict[str, set] = {}

    def spy(name, fn):
        def entry(*args, **kwargs):
            rows.setdefault(name, set()).add(jax.tree.leaves(args[0])[0].shape[0])  # at trace time: its rows
            return fn(*args, **kwargs)
        return entry

    for name in kernels_pallas.__all__:
        if name != "platform":
            monkeypatch.setattr(kernels_pallas, name, spy(name, getattr(kernels_pallas, name)))
    want, _ = d.decode_step(cfg, params, d.init_cache(cfg, b, 16), nxt, kernels="pallas")
    assert {"sparse_attention_decode", "indexer_scores_decode", "select_topk", "fp8_matmuls", "rms_norms"} <= set(rows)
    rows.clear()
    m = shard_model(cfg, params, S.make_mesh(cfg, "expert=2", batch=b, devices=jax.devices()[:2], layout="dp_ep"),
                    "dp_ep", batch=b)
    got, _ = m.decode_step(m.init_cache(16), nxt, kernels="pallas")
    for name in ("sparse_attention_decode", "indexer_scores_decode", "select_topk", "fp8_matmuls", "rms_norms"):
        assert rows[name] == {b // 2}, (name, rows[name])
    assert rows["grouped_matmuls_fp4"] <= {b // 2 * cfg.n_activated_experts * 2}  # a shard's receive buffer
    # the combine's summation order may round the next layer's FP8 window record differently (as in
    # test_sharding's kernel test): a loose, honest bound
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-2 * np.abs(np.asarray(want)).max()


@pytest.mark.parametrize("layout,mesh,want", [("dp_ep", "expert=2", {"all-to-all": 8}), ("dp", "data=2", {})])
def test_data_parallel_decode_moves_only_routed_tokens(layout, mesh, want):
    """The compiled decode step of `dp_ep` has no collective but the MoE's all-to-alls (per layer: the
    counts, the rows, their routing, the combine); `dp` has none at all. GSPMD's own choices (a top-k or
    a scatter with global batch indices) would add all-gathers of the batch."""
    import re
    from collections import Counter

    from dsv41_jax import api

    b = 4
    m = shard_model(TWO_LAYERS, d.init_params(TWO_LAYERS),
                    S.make_mesh(TWO_LAYERS, mesh, batch=b, devices=jax.devices()[:2], layout=layout), layout, batch=b)
    cache, tok = m.init_cache(16), m.placement.put_rows(np.zeros(b, np.int32))
    step = jax.jit(api.forward, static_argnames=api._STATIC, out_shardings=(m.placement.rows, m.placement.cache))
    with m.placement.active():
        text = step.lower(TWO_LAYERS, m.params, cache, tok[:, None], jnp.ones(b, jnp.int32),
                          kernels="jnp").compile().as_text()
    ops = r" (all-to-all|ragged-all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
    assert dict(Counter(re.findall(ops, text))) == want
