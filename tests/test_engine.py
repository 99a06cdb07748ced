"""Serving engine: slots join and leave without recompiling, prefix reuse through the tiers is exact
with the window in the host pool and bounded with replay, decoder-side bounded prefill keeps the global
KV exact and drifts within a measured bound, and every tier failure is a correct recompute.

One module-scoped model; every engine shares the compiled programs (prefill chunk [1, 32] through all
layers and through the layers up to the last kv source, decode [2, 1]), so only the first request pays
for compiling.
"""

import errno
import os

import jax
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import api
from dsv41_jax.plan import build_plan, encoder_depth
from dsv41_jax.sampling import sample
from dsv41_jax.serving import Engine, EngineConfig, Request, slots as rows, slots_for_budget
from dsv41_jax.tiers import block_chain

PT, CHUNK, CAP, NEW = 32, 32, 160, 12


@pytest.fixture(scope="module")
def model():
    cfg = d.preset("tiny")
    return cfg, d.init_params(cfg, seed=0)


def engine(model, cache_dir=None, **kw):
    cfg, params = model
    return Engine(cfg, params, EngineConfig(slots=2, capacity=CAP, prefill_chunk=CHUNK, page_tokens=PT,
                                            cache_dir=cache_dir, progress=False, **kw))


PROMPT = np.random.default_rng(1).integers(0, 320, 90)  # 2 full pages before the last token


@pytest.fixture(scope="module")
def cold(model):
    """Greedy tokens of PROMPT with no cache tier at all."""
    return engine(model).generate([Request(PROMPT, max_new_tokens=NEW)])[0]


def run(eng, prompt=PROMPT, **kw):
    return eng.generate([Request(prompt, max_new_tokens=NEW, **kw)])[0]


def test_warm_with_window_is_exact_and_replay_is_bounded(model, cold, tmp_path):
    first = engine(model, tmp_path)
    r1 = run(first)
    assert r1.tokens == cold.tokens and r1.metrics["disk_bytes_written"] > 0 and r1.metrics["host_bytes_written"] > 0
    r2 = run(first)  # same engine: window rings of the prefix are in its host pool
    assert r2.metrics["host_window_hit"] and r2.metrics["reused_tokens"] == 2 * PT
    assert r2.metrics["prefilled_tokens"] == PROMPT.size - 2 * PT
    assert r2.tokens == cold.tokens
    np.testing.assert_array_equal(r2.first_logits, cold.first_logits)
    # a second engine on the same directory has an empty host pool: disk hit + bounded replay
    r3 = run(engine(model, tmp_path))
    assert r3.metrics["disk_pages_hit"] == 2 and not r3.metrics["host_window_hit"]
    assert r3.metrics["replayed_tokens"] == model[0].window_size
    assert r3.metrics["decoder_prefill_tokens"] == model[0].window_size + PROMPT.size - 2 * PT
    # measured for this seed: max |dlogit| 0.41 on a logit scale of 2.8 (random weights amplify drift)
    scale = np.abs(cold.first_logits).max()
    assert np.abs(r3.first_logits - cold.first_logits).max() < 0.2 * scale
    assert r3.tokens[0] == cold.tokens[0]
    # replay-derived state is never published: the directory still serves exact restores to `first`
    assert run(first).tokens == cold.tokens
    off = run(engine(model, tmp_path, replay=False))
    assert off.tokens == cold.tokens and off.metrics["reused_tokens"] == 0


def test_bounded_prefill_runs_the_decoder_layers_on_the_last_window_only(model, cold, monkeypatch):
    cfg, params = model
    depth, w = encoder_depth(build_plan(cfg)), cfg.window_size
    assert depth < cfg.n_layers  # tiny: layers 5-7 come after the last kv source (4)
    tokens = {}  # layers argument of api.prefill -> real tokens it processed
    real = api.prefill

    def spy(*a, layers=None, **kw):
        tokens[layers] = tokens.get(layers, 0) + int(a[4][0])
        return real(*a, layers=layers, **kw)

    monkeypatch.setattr(api, "prefill", spy)
    n, split = PROMPT.size, (PROMPT.size - 1) // PT * PT
    lb, bounded, mb = engine(model).prefill(PROMPT.astype(np.int32))
    assert tokens == {depth: split - w, None: n - (split - w)} and mb["decoder_prefill_tokens"] == n - split + w
    tokens.clear()
    _, exact, me = engine(model, bounded_prefill=False).prefill(PROMPT.astype(np.int32))
    assert tokens == {None: n} and me["decoder_prefill_tokens"] == n
    # the global KV (and everything the layers up to the last kv source hold) is the exact path's, bit for bit
    for a, b in zip(jax.tree.leaves(bounded.sources), jax.tree.leaves(exact.sources)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(bounded.window), jax.tree.leaves(exact.window)):
        np.testing.assert_array_equal(np.asarray(a)[:depth], np.asarray(b)[:depth])
    assert np.asarray(bounded.window_start)[depth:].tolist() == [[split - w]] * (cfg.n_layers - depth)
    # drift: measured for this prompt 1.2e-3 on a logit scale of 2.8 (0.0009..0.077 over 18 random
    # prompts of 40-140 tokens, greedy agreement 11-12 of 12 tokens); the exact path is unchanged
    np.testing.assert_array_equal(np.asarray(lb[0]), cold.first_logits)
    exact_run = run(engine(model, bounded_prefill=False))
    assert np.abs(exact_run.first_logits - cold.first_logits).max() < 0.005 * np.abs(cold.first_logits).max()
    assert exact_run.tokens == cold.tokens


def test_bounded_prefill_off_is_the_plain_chunked_prefill(model):
    cfg, params = model
    cache, logits = d.init_cache(cfg, 1, CAP), None
    for a in range(0, PROMPT.size, CHUNK):
        n = min(CHUNK, PROMPT.size - a)
        t = np.zeros((1, CHUNK), np.int32)
        t[0, :n] = PROMPT[a:a + n]
        logits, cache = api.prefill(cfg, params, cache, t, np.array([n]))
    first = run(engine(model, bounded_prefill=False)).first_logits
    np.testing.assert_array_equal(first, np.asarray(logits[0]))
    short = PROMPT[:PT]  # nothing before the last window: bounded prefill skips nothing and is exact
    np.testing.assert_array_equal(run(engine(model), short).first_logits,
                                  run(engine(model, bounded_prefill=False), short).first_logits)


def test_skipped_layers_restart_with_an_empty_ring(model):
    """After a forward through the first layers only, the later layers' rings hold nothing before the
    new length: whatever bytes are left in them are masked, never read."""
    cfg, params = model
    depth = encoder_depth(build_plan(cfg))
    tok = PROMPT[None, :64].astype(np.int32)  # two chunks of the engine's shape: its compiled programs
    none, cache = api.prefill(cfg, params, d.init_cache(cfg, 1, CAP), tok[:, :32], np.array([32]), layers=depth)
    assert none is None and np.asarray(cache.window_start)[:, 0].tolist() == [0] * depth + [32] * (cfg.n_layers - depth)
    rng = np.random.default_rng(0)  # FP8 rows of magnitude ~1..240: scale exponent 127 (1.0), random codes
    junk = {k: a.at[depth:].set(127 if k == "scales" else rng.integers(1, 120, a[depth:].shape).astype(a.dtype))
            for k, a in cache.window.items()}
    want, _ = api.prefill(cfg, params, cache, tok[:, 32:], np.array([32]))
    got, _ = api.prefill(cfg, params, cache.replace(window=junk), tok[:, 32:], np.array([32]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="layers must be"):
        api.prefill(cfg, params, cache, tok[:, 32:], np.array([32]), layers=0)


def page_files(root):
    return [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".page")]


def damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) - 7]
    else:
        data[len(data) // 3] ^= 0x10
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "fingerprint", "expired", "missing_dir", "full_disk", "killed"])
def test_tier_failures_are_a_miss_and_a_correct_recompute(model, cold, tmp_path, how, monkeypatch):
    eng = engine(model, tmp_path)
    assert run(eng).tokens == cold.tokens
    files = page_files(tmp_path)
    assert len(files) == 2
    first = eng.prefix.store.path(block_chain(eng.prefix.fp, PROMPT, PT)[0])  # page 0 (the listing order is arbitrary)
    assert first in files
    if how in ("truncate", "flip"):
        damage(first, how)
    elif how == "fingerprint":
        eng = engine(model, tmp_path, weights_revision="another-revision")
    elif how == "expired":
        for f in files:
            os.utime(f, (1.0, 1.0))
    elif how == "missing_dir":
        for f in files:
            os.unlink(f)
        os.rmdir(os.path.dirname(files[0]))
    elif how == "killed":  # a writer killed mid-write: a temp file, and a torn final page from a non-atomic tool
        open(os.path.join(os.path.dirname(first), ".tmp-999-x"), "wb").write(open(first, "rb").read()[:50])
        damage(first, "truncate")
    eng = engine(model, tmp_path, weights_revision=eng.ecfg.weights_revision)  # fresh host pool: disk only
    if how == "full_disk":
        for f in files:
            os.unlink(f)
        def enospc(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(eng.prefix.store, "_write_all", enospc)
    r = run(eng)
    assert r.error is None and r.tokens == cold.tokens
    assert r.metrics["reused_tokens"] == 0 and r.metrics["replayed_tokens"] == 0
    if how == "full_disk":
        assert eng.prefix.store.stats["write_errors"] == 1 and page_files(tmp_path) == []


def test_slots_join_and_leave_without_recompiling(model, cold):
    eng = engine(model)
    short = PROMPT[:20]
    alone = run(eng, short)
    compiled = api._forward_jit._cache_size()
    reqs = [Request(PROMPT, max_new_tokens=NEW), Request(short, max_new_tokens=4),
            Request(short, max_new_tokens=NEW, temperature=0.8, seed=3), Request(PROMPT, max_new_tokens=6),
            Request([], max_new_tokens=3), Request(PROMPT, max_new_tokens=CAP),
            Request(short, temperature=-1.0), Request(short, temperature=float("nan")), Request(short, max_new_tokens=0),
            Request([5, 400])]
    out = eng.generate(reqs)
    assert api._forward_jit._cache_size() == compiled  # 3 requests over 2 slots, no new program
    assert out[0].tokens == cold.tokens and out[1].tokens == alone.tokens[:4] and out[3].tokens == cold.tokens[:6]
    sampled_again = engine(model).generate([Request(short, max_new_tokens=NEW, temperature=0.8, seed=3)])[0]
    assert out[2].tokens == sampled_again.tokens and out[2].tokens != alone.tokens
    errors = [r.error for r in out[4:]]
    for msg, want in zip(errors, ["empty prompt", "too long", "temperature", "temperature", "max_new_tokens", "outside"]):
        assert msg and want in msg, (want, msg)
    assert all(r.error is None and r.metrics["ttft_s"] > 0 for r in out[:4])


def one_call_at_a_time(eng: Engine, req: Request, chunk: int) -> list[int]:
    """A request's tokens by the engine's prefill, then `api.generate` calls of `chunk` steps on its slot of the
    engine's 2 (the other idle), each call's tokens read back before the next call (what the engine computed before
    it queued its calls; the engine's decode program, so no compile of its own)."""
    cfg = eng.cfg
    logits, row, _ = eng.prefill(np.asarray(req.prompt, np.int32))
    cache = rows.put_row(eng.cache, 0, row)
    temp, seed = np.array([req.temperature, 0], np.float32), np.array([req.seed, 0], np.uint32)
    toks = [int(np.asarray(sample(logits, temp[:1], seed[:1], np.zeros(1, np.int32)))[0])]
    stops = np.full((2, 4), -1, np.int32)
    stops[0, :len(req.stop_tokens)] = req.stop_tokens
    while toks[-1] not in req.stop_tokens and len(toks) < req.max_new_tokens:
        budget = min(req.max_new_tokens - len(toks), chunk)
        out, emitted, cache = api.generate(cfg, eng.params, cache, np.array([toks[-1], 0], np.int32), chunk,
                                           temperature_b=temp, seed_b=seed, step_b=np.array([len(toks), 0], np.int32),
                                           budget_b=np.array([budget, 0], np.int32), stop_ids_bs=stops)
        toks += [int(t) for t in np.asarray(out)[0][np.asarray(emitted)[0]]]
    return toks


def test_queued_calls_give_the_tokens_of_one_call_at_a_time(model, cold):
    """Four requests over 2 slots, 3 steps per call: sampled and greedy, a stop token, budgets that end inside
    a call, requests admitted while a call is in flight. Each request's tokens equal those of its prompt run
    alone with each call read back before the next."""
    stop = cold.tokens[7]
    reqs = [Request(PROMPT, max_new_tokens=NEW), Request(PROMPT[:20], max_new_tokens=7, temperature=0.8, seed=3),
            Request(PROMPT, max_new_tokens=NEW, stop_tokens=(stop,)),
            Request(PROMPT[:30], max_new_tokens=5, temperature=1.0, seed=9)]
    out = engine(model, decode_chunk=3).generate(reqs)
    want = [one_call_at_a_time(engine(model), r, 3) for r in reqs]
    assert [r.tokens for r in out] == want
    assert want[2] == cold.tokens[:cold.tokens.index(stop) + 1] and out[2].stop_reason == "stop_token"
    assert [len(t) for t in want] == [NEW, 7, len(want[2]), 5]


def test_stop_token_and_budget(model, cold):
    stop = cold.tokens[3]
    r = run(engine(model), stop_tokens=(stop,))
    assert r.tokens == cold.tokens[: cold.tokens.index(stop) + 1] and r.stop_reason == "stop_token"
    cfg = model[0]
    one = slots_for_budget(cfg, CAP, 10**9, max_slots=1 << 30)
    assert slots_for_budget(cfg, CAP, 3 * (10**9 // one) + 1, max_slots=1 << 30) == 3
    with pytest.raises(ValueError, match="holds no slot"):
        slots_for_budget(cfg, CAP, 100)


def test_cli_serves_prompt_ids_and_reuses_the_prefix(model, cold, tmp_path):
    from experiments import decode

    ids, out = tmp_path / "ids.npy", tmp_path / "run.json"
    np.save(ids, PROMPT.astype(np.int32))
    decode.main(["--engine", "--prompt-ids", str(ids), "--max-new-tokens", str(NEW), "--temperature", "0",
                 "--capacity", str(CAP), "--slots", "2", "--prefill-chunk", str(CHUNK), "--page-tokens", str(PT),
                 "--cache-dir", str(tmp_path / "kv"), "--repeat", "2", "--output-json", str(out)])
    import json
    run_ = json.load(open(out))
    first, second = (r["requests"][0] for r in run_["rounds"])
    assert first["generated_ids"] == cold.tokens == second["generated_ids"] == run_["generated_ids"][0]
    assert second["metrics"]["host_window_hit"] and second["metrics"]["reused_tokens"] == 2 * PT
    args = decode.parse_args(["--engine", "--no-bounded-prefill", "--no-bounded-replay"])
    assert args.no_bounded_prefill and args.no_replay


def test_cancel_frees_a_live_slot_and_drops_a_queued_request(model, cold):
    eng = engine(model)  # 2 slots
    ids = [eng.submit(Request(PROMPT, max_new_tokens=NEW, id=f"r{i}")) for i in range(3)]
    eng.step()  # r0 and r1 in slots, r2 queued
    assert {r.id for r in eng.running()} == {"r0", "r1"} and all(r.tokens for r in eng.running())
    assert eng.cancel("r2") and eng.cancel("r0") and not eng.cancel("r0") and not eng.cancel("nope")
    assert {r.id for r in eng.running()} == {"r1"} and not eng.queue
    done = {r.id: r for r in eng.drain()}
    assert done["r0"].stop_reason == done["r2"].stop_reason == "cancelled" and done["r2"].tokens == []
    assert eng.done == []
    while eng.live:
        eng.step()
    (r1,) = eng.drain()
    assert r1.id == ids[1] and r1.tokens == cold.tokens  # the survivor is unaffected
