"""The data and scoring of the quality study (experiments/corpus.py, experiments/quality.py): no model
needed, so these run in milliseconds."""

import json

import numpy as np
import pytest

from experiments import quality, train_small
from experiments._cli import UserError
from experiments.corpus import KEY_DIGITS, TOK, passkey, passkey_batch, training_batches

FILLER = np.asarray(np.random.default_rng(0).integers(3 + 97, 3 + 123, 5000), np.int32)  # lowercase letters


def _text(ids) -> str:
    return TOK.decode(ids)


@pytest.mark.parametrize("length,depth", [(64, 0.0), (300, 0.1), (1025, 0.9)])
def test_passkey_layout(length, depth):
    ids, ans = passkey(FILLER, length, depth, np.random.default_rng(1))
    assert ids.shape == (length,) and ids.dtype == np.int32 and ids[0] == TOK.bos_id
    text = _text(ids)
    key = text[text.index("# passkey: ") + 11:][:KEY_DIGITS]
    assert key.isdigit() and len(key) == KEY_DIGITS
    assert _text(ids[ans:ans + KEY_DIGITS]) == key  # the answer is the recalled key, at the end
    assert text.endswith(f"# recall passkey: {key}\n")
    assert text.index("# passkey: ") <= depth * length + 2  # planted `depth` of the way in


def test_passkey_too_short_is_refused():
    with pytest.raises(ValueError, match="too short"):
        passkey(FILLER, 40, 0.5, np.random.default_rng(0))


def test_training_batches_mix_retrieval_rows():
    rng = np.random.default_rng(0)
    gen = training_batches(FILLER, 64, 127, 0.25, rng, answer_weight=5.0)
    batch = next(gen)
    rows = batch["tokens"]
    assert rows.shape == (64, 128) and batch["weights"].shape == (64, 127)
    keyed = ["# recall passkey: " in _text(r) for r in rows]
    assert 6 <= sum(keyed) <= 28, sum(keyed)  # ~16 expected
    for r, w, k in zip(rows, batch["weights"], keyed):  # the answer digits' targets weigh 5, all else 1
        heavy = np.flatnonzero(w == 5.0)
        assert np.all((w == 1.0) | (w == 5.0)) and len(heavy) == (KEY_DIGITS if k else 0)
        if k:
            assert _text(r[heavy + 1]) == _text(r[-1 - KEY_DIGITS:-1])  # the recalled key
    assert not any("# recall passkey: " in _text(r) for r in next(training_batches(FILLER, 64, 127, 0.0, rng))["tokens"])


def test_key_scores_count_whole_keys_and_digits():
    ids, ans = passkey_batch(FILLER, 3, 100, 0.2, np.random.default_rng(2))
    logits = np.zeros((3, KEY_DIGITS, TOK.size), np.float32)
    truth = ids[:, ans:ans + KEY_DIGITS]
    for b in range(3):
        logits[b, np.arange(KEY_DIGITS), truth[b]] = 1.0
    logits[1, 2] = 0
    logits[1, 2, (truth[1, 2] + 1) % TOK.size] = 1.0  # one wrong digit in row 1
    whole, digits, nll = quality.key_scores(logits, ids, ans)
    assert whole.tolist() == [True, False, True]
    assert digits.sum() == 3 * KEY_DIGITS - 1
    # a right digit costs log(1 + (V - 1) / e) nats here, the wrong one log(e + V - 1)
    v = TOK.size
    np.testing.assert_allclose(nll[0], np.log(np.e + v - 1) - 1.0, rtol=1e-5)
    np.testing.assert_allclose(nll[1, 2], np.log(np.e + v - 1), rtol=1e-5)


def test_merge_and_markdown(tmp_path):
    row = lambda model, v, p: {"model": model, "variant": v, "ppl": p,
                               "retrieval": {"512": {"key_acc": 0.5, "digit_acc": 0.9, "key_nll": 1.2}}}
    a = {"retrieval_lengths": [512], "rows": [row("CSA2", "as trained", {"nll": 1.0, "bits_per_byte": 1.4427, "ppl": 2.718})],
         "replay": [{"model": "CSA2", "prefix": 768, "tail": 256, "nll_cold": 1.1, "nll_replay": 1.2,
                     "max_abs_dlogit": 0.5, "argmax_agreement": 0.99}]}
    b = {"retrieval_lengths": [512], "rows": [row("all-Full", "as trained", None)], "replay": []}
    for name, r in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    table = quality.markdown(quality.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")]))
    assert "| CSA2: as trained | 2.718 (1.4427) | 0.50 (1.20) |" in table
    assert "| all-Full: as trained | see below | 0.50 (1.20) |" in table
    assert "| CSA2 | 256 tokens after 768 | 1.1 | 1.2 | 0.5 | 0.99 |" in table
    b["retrieval_lengths"] = [1024]
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(UserError, match="retrieval-lengths"):
        quality.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def test_study_plans_differ_from_csa2_only_where_they_say():
    """all-full: every compressing layer Full; deep-full: the Reindex layers become Full (own compressor,
    still scoring inside the candidate pool), every other layer's mode as in the preset's CSA2 plan."""
    from dsv41_jax.plan import Mode, build_plan
    from experiments.train_small import study_config

    csa2, deep, full = (build_plan(study_config("small", p, True)) for p in ("csa2", "deep-full", "all-full"))
    assert any(p.mode is Mode.REINDEX for p in csa2)
    for c, dp, f in zip(csa2, deep, full):
        assert dp.mode is (Mode.FULL if c.mode is Mode.REINDEX else c.mode)
        assert dp.uses_candidates == c.uses_candidates
        assert f.mode is (Mode.WINDOW if c.mode is Mode.WINDOW else Mode.FULL)


def test_study_dtype_is_a_model_flag():
    """--dtype changes the compute dtype only (master weights stay f32) and, like the plan, is fixed for a run."""
    from experiments.train_small import MODEL_FLAGS, parse_args, study_config

    args = parse_args(["--preset", "small", "--dtype", "float32", "--steps", "1"])
    cfg = study_config(args.preset, args.plan, args.study, args.dtype)
    assert (cfg.dtype, cfg.param_dtype) == ("float32", "float32")
    assert study_config("small", "csa2", False).dtype == "bfloat16"
    assert study_config("tiny", "csa2", False, "bfloat16").replace(dtype="float32") == study_config("tiny", "csa2", False)
    assert "dtype" in MODEL_FLAGS


def test_optimizer_rate_is_a_value_of_its_state():
    """make_optimizer is AdamW on a linear warm-up then a constant rate; the rate is in the state, so one
    compiled update serves every rate and `with_lr` (a resumed call's --lr) changes it."""
    import jax
    import jax.numpy as jnp
    import optax

    from experiments.train_small import make_optimizer, with_lr

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)} for _ in range(6)]
    sched = optax.join_schedules([optax.linear_schedule(0.0, 1e-2, 3), optax.constant_schedule(1e-2)], [3])
    ref_opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.95, weight_decay=0.1))
    opt, traces = make_optimizer(1e-2, 3), []

    @jax.jit
    def update(g, state, p):
        traces.append(1)
        u, state = opt.update(g, state, p)
        return optax.apply_updates(p, u), state

    p, state, ref_p, ref_state = params, opt.init(params), params, ref_opt.init(params)
    for g in grads:
        p, state = update(g, state, p)
        u, ref_state = ref_opt.update(g, ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    np.testing.assert_allclose(p["w"], ref_p["w"], rtol=1e-6, atol=1e-7)
    assert not np.allclose(p["w"], params["w"])

    # past the warm-up an AdamW step is linear in the rate: twice the rate, twice the step
    step_at = lambda s: update(grads[0], s, p)[0]["w"] - p["w"]
    np.testing.assert_allclose(step_at(with_lr(state, 2e-2)), 2 * step_at(state), rtol=1e-5, atol=1e-8)
    assert len(traces) == 1


def test_lr_note_warns_where_retrieval_was_not_learned():
    # small (width 1024) at 2e-3 stayed at chance on retrieval; at 3e-4 it learned; tiny (64) at 3e-3 learned
    assert "try --lr 3.0e-04" in train_small.lr_note(2e-3, 1024, retrieval=True)
    assert train_small.lr_note(3e-4, 1024, retrieval=True) is None
    assert train_small.lr_note(3e-3, 64, retrieval=True) is None
    assert train_small.lr_note(2e-3, 1024, retrieval=False) is None  # plain LM training: nothing to say
