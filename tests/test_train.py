"""Training support (dsv41_jax.train): loss goes down, the indexer learns from its KL only, expert
biases balance the load, checkpoints restore bit-exactly, and the training forward really quantizes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dsv41_jax as d
from dsv41_jax import train
from dsv41_jax.api import graphdef
from dsv41_jax.quant import MAIN_KV, WINDOW_KV, fake_quant

CFG = d.preset("tiny")
# every layer mode of tiny in 5 layers (half the compile time): 0 window, 1 Full m=2, 2 Reuse,
# 3 Full m=1 (candidate source), 4 Reindex inside the pool
MICRO = dataclasses.replace(CFG, n_layers=5, n_mtp_layers=0, compress_ratios=(0, 2, 2, 1, 1), kv_source_layers=(1, 3),
                            index_source_layers=(1, 3, 4), candidate_source_layer=3, engram_layer_ids=(1,),
                            engram_num_embeddings=()).with_derived_engram()
TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, 259, (2, 41)), jnp.int32)  # [B, T + 1]


def _flat(state) -> dict:
    return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def run():
    """Six adam steps on MICRO (every layer mode of tiny; tiny's 8 layers took ~1.6x as long to build the step),
    one compile shared by the tests below."""
    opt = optax.adam(3e-3)
    step = train.make_train_step(MICRO, opt, bias_rate=1e-2)
    params0 = d.init_params(MICRO, seed=0)
    params, state, history = params0, train.init_opt_state(opt, params0), []
    for _ in range(6):
        params, state, m = step(params, state, {"tokens": TOKENS})
        history.append(jax.tree.map(float, m))
    return {"opt": opt, "step": step, "params0": params0, "params": params, "state": state, "history": history}


def test_train_steps_reduce_loss(run):
    h = run["history"]
    assert all(np.isfinite(list(m.values())).all() for m in h), h
    assert h[-1]["lm_loss"] < h[0]["lm_loss"] - 1.0, [m["lm_loss"] for m in h]
    assert h[-1]["indexer_kl"] < h[0]["indexer_kl"], [m["indexer_kl"] for m in h]
    assert h[0]["indexer_kl"] > 0
    # the biases moved outside the optimizer (Buffers, not Params)
    moved = [k for k, v in _flat(run["params"]).items() if k.endswith("router/bias") and np.abs(v).sum() > 0]
    assert len(moved) == MICRO.n_layers, moved
    # every part the LM loss trains got gradient, so adam moved it: attention, compressor, MoE, mHC, Engram,
    # embedding (the indexer learns from its KL only: test_indexer_gets_gradient_from_kl_only)
    before, after = _flat(run["params0"]), _flat(run["params"])
    for name in ("layers/1/attn/compressor/wkv", "layers/3/ffn/w1", "layers/0/hc_attn/fn", "layers/1/engram/table",
                 "embed/weight", "layers/4/attn/wo_b"):
        keys = [k for k in after if k.startswith(name)]
        assert keys and any(not np.array_equal(before[k], after[k]) for k in keys), name


def test_checkpoint_round_trip_is_bit_exact(run, tmp_path):
    train.save_checkpoint(tmp_path / "ckpt", run["params"], run["state"], step=6)
    fresh = d.init_params(MICRO, seed=1)
    params, state, step = train.restore_checkpoint(tmp_path / "ckpt", fresh, train.init_opt_state(run["opt"], fresh))
    assert step == 6
    want, got = jax.tree.leaves((run["params"], run["state"])), jax.tree.leaves((params, state))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


@pytest.fixture(scope="module")
def micro():
    """Gradients of the LM loss and of the indexer KL of MICRO (seed 0) on TOKENS, separately, through the
    quantized training forward, and the LM loss itself (the dense test reads this sparse loss). Two programs: the
    forward with its VJP residuals, and the backward pass, compiled once and run for each cotangent (one program
    with both backward passes took ~40% longer to build; vmap over the two fails: ragged_dot batching)."""
    trainable, rest = train.split_trainable(d.init_params(MICRO, seed=0))
    f = lambda p: tuple(train.loss_fn(p, rest, MICRO, TOKENS)[1][k] for k in ("lm_loss", "indexer_kl"))
    (lm, _), vjp = jax.jit(lambda tr: jax.vjp(f, tr))(trainable)
    backward = jax.jit(lambda vjp, ct: vjp(ct)[0])
    one, zero = jnp.float32(1), jnp.float32(0)
    g_lm, g_kl = backward(vjp, (one, zero)), backward(vjp, (zero, one))
    return {"trainable": trainable, "rest": rest, "g_lm": _flat(g_lm), "g_kl": _flat(g_kl), "lm_loss": float(lm)}


def test_indexer_gets_gradient_from_kl_only(micro):
    """Gradients of the LM loss and of the indexer KL, separately, through the quantized forward."""
    g_lm, g_kl = micro["g_lm"], micro["g_kl"]
    indexer = [k for k in g_lm if "/attn/indexer/" in k]
    assert {"layers/1/attn/indexer/wk/weight", "layers/4/attn/indexer/wq_b/weight"} <= set(indexer)
    for k in indexer:
        assert not np.any(g_lm[k]), f"LM loss reached the indexer: {k}"
        assert np.any(g_kl[k]), f"indexer KL gives no gradient to {k}"
    for k in g_kl:
        if k not in indexer:
            assert not np.any(g_kl[k]), f"indexer KL reached the backbone: {k}"
    # the LM gradient passes straight through the FP8 window KV and the FP4 latent (the stored bytes
    # alone would give none) and reaches every part of the backbone
    for k in ("layers/0/attn/wkv/weight", "layers/1/attn/compressor/wkv/weight", "layers/1/attn/compressor/wgate/weight",
              "layers/3/attn/compressor/wkv/weight", "layers/2/ffn/router/weight", "layers/1/engram/table", "embed/weight"):
        assert np.any(g_lm[k]), k


def test_bias_update_moves_load_towards_balance():
    params = d.init_params(MICRO, seed=0)
    graph = graphdef(MICRO)

    @jax.jit
    def load(p):
        _, _, aux = nnx.merge(graph, p).forward(d.init_cache(MICRO, 2, 40), TOKENS[:, :-1], jnp.array([40, 40]),
                                                all_logits=False, with_aux=True)
        return aux.expert_load_le.astype(jnp.float32)  # [L, E]

    imbalance = lambda l: float(jnp.mean(jnp.abs(l - l.mean(-1, keepdims=True))))
    trainable, rest = train.split_trainable(params)
    l0 = load(params)
    seen = [imbalance(l0)]
    for _ in range(12):
        rest = train.update_expert_bias(rest, load(nnx.merge_state(trainable, rest)), 1e-2)
        seen.append(imbalance(load(nnx.merge_state(trainable, rest))))
    assert seen[0] > 0 and min(seen[-3:]) < 0.5 * seen[0], seen
    assert float(load(nnx.merge_state(trainable, rest)).sum()) == float(l0.sum())  # only where tokens go


def test_training_forward_quantizes_under_jit():
    """Layer 0 as a ratio-2 kv source (its input does not depend on quantization): its window KV and
    latent as the training forward uses them are the FP8 / FP4 round trips of the unquantized values."""
    small = CFG.replace(n_layers=2, n_mtp_layers=0, compress_ratios=(2, 2), kv_source_layers=(0,), index_source_layers=(0,),
                        candidate_source_layer=-1, engram_layer_ids=(), engram_num_embeddings=())
    params = d.init_params(small, seed=0)

    def views(cfg):
        @jax.jit
        def run(p):
            _, _, aux = nnx.merge(graphdef(cfg), p).forward(d.init_cache(cfg, 2, 40), TOKENS[:, :-1],
                                                            jnp.array([40, 40]), all_logits=True, training=True,
                                                            with_aux=True)
            return aux.layers[0].window_view_btd, aux.views[0][0]
        return run(params)

    (win_q, main_q), (win_raw, main_raw) = views(small), views(small.replace(quantize_cache=False))
    for got, raw, codec, lo, hi in ((win_q, win_raw, WINDOW_KV, 0.005, 0.05), (main_q, main_raw, MAIN_KV, 0.03, 0.2)):
        got, raw = np.asarray(got), np.asarray(raw)
        rel = np.sqrt(np.mean((got - raw) ** 2) / np.mean(raw ** 2))
        assert lo < rel < hi, (codec, rel)  # really quantized, by the format's error
        np.testing.assert_allclose(got, np.asarray(fake_quant(codec, jnp.asarray(raw))), rtol=1e-6, atol=1e-7)


def test_dense_training_config_attends_every_entry(micro):
    """train_small --train-attention dense trains with `dense_overrides`: on the same weights its loss
    differs from the sparse config's (MICRO, like tiny, keeps 8 of up to 40 compressed entries per query
    here; the sparse loss is the `micro` fixture's)."""
    from experiments import train_small

    assert train_small.parse_args(["--steps", "1", "--train-attention", "dense"]).train_attention == "dense"
    dense_cfg = MICRO.replace(**train_small.dense_overrides(40))
    assert MICRO.index_topk < 40 == dense_cfg.index_topk == TOKENS.shape[1] - 1
    dense = float(jax.jit(lambda tr: train.loss_fn(tr, micro["rest"], dense_cfg, TOKENS)[1]["lm_loss"])(
        micro["trainable"]))
    assert abs(micro["lm_loss"] - dense) > 1e-4


def test_weighted_loss_is_the_weighted_mean_of_the_targets_cross_entropy():
    """loss_fn's weights_bt: the weighted mean of the per-target cross entropies of the same forward; the aux
    lm_loss stays the unweighted mean and heavy_ce is the up-weighted targets' own mean."""
    trainable, rest = train.split_trainable(d.init_params(MICRO, seed=0))
    w_bt = jnp.ones(TOKENS[:, 1:].shape, jnp.float32).at[0, 7].set(30.0).at[1, 20:24].set(5.0)

    @jax.jit
    def losses(tr):  # two forwards only: each one is a compile of its own
        ce_bt = optax.softmax_cross_entropy_with_integer_labels(
            train.forward_logits(tr, rest, MICRO, TOKENS[:, :-1]), TOKENS[:, 1:])
        return ce_bt, train.loss_fn(tr, rest, MICRO, TOKENS, 0.0, w_bt)

    ce_bt, (weighted, aux) = losses(trainable)
    ce_bt = np.asarray(ce_bt)
    want = float((np.asarray(w_bt) * ce_bt).sum() / np.asarray(w_bt).sum())
    np.testing.assert_allclose(float(weighted), want, rtol=1e-6)
    assert abs(want - ce_bt.mean()) > 1e-3  # the weights move the term: the check above can fail
    np.testing.assert_allclose(float(aux["lm_loss"]), ce_bt.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(aux["heavy_ce"]), ce_bt[np.asarray(w_bt) > 1].mean(), rtol=1e-6)
