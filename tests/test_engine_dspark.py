"""The serving engine with DSpark speculative decode steps: the plain engine's tokens at temperature 0."""

from __future__ import annotations

import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax.serving import Engine, EngineConfig, Request

CFG = d.preset("tiny")  # 2 draft stages, blocks of K = 3
PARAMS = d.init_params(CFG, seed=0)


def _requests():
    rng = np.random.default_rng(3)
    # unequal prompts (past a page boundary, inside the first page), a stop id, more requests than slots
    return [Request(prompt=rng.integers(0, CFG.vocab_size, n), max_new_tokens=m, id=f"r{i}", stop_tokens=stop)
            for i, (n, m, stop) in enumerate([(37, 9, ()), (5, 7, ()), (21, 8, (7,))])]


def _run(speculative):
    # the engine shape of tests/test_engine.py: the plain engine's programs are compiled once per suite run
    ecfg = EngineConfig(slots=2, capacity=160, prefill_chunk=32, page_tokens=32, progress=False,
                        speculative=speculative)
    return Engine(CFG, PARAMS, ecfg).generate(_requests())


def test_speculative_engine_emits_the_plain_engines_tokens():
    plain, spec = _run(None), _run("dspark")
    for p, s in zip(plain, spec):
        assert s.error is None and s.tokens == p.tokens, (p.id, p.tokens, s.tokens)
        assert s.stop_reason == p.stop_reason
        assert s.metrics["speculative_steps"] >= 1 and s.metrics["acceptance_length"] >= 1.0


def test_speculative_engine_refusals():
    with pytest.raises(ValueError, match="DSpark"):
        Engine(CFG.replace(n_mtp_layers=0), PARAMS, EngineConfig(slots=1, capacity=64, speculative="dspark"))
    with pytest.raises(ValueError, match="speculative must be"):
        Engine(CFG, PARAMS, EngineConfig(slots=1, capacity=64, speculative="medusa"))
    eng = Engine(CFG, PARAMS, EngineConfig(slots=1, capacity=64, page_tokens=16, speculative="dspark", progress=False))
    with pytest.raises(ValueError, match="speculative block"):  # 60 + 2 + K = 3 > 64
        eng.validate(Request(prompt=np.ones(60, np.int32), max_new_tokens=2))


def test_speculative_engine_on_a_mesh_emits_the_plain_engines_tokens():
    """DSpark steps on 8 devices (data=2 x expert=4, dp_ep; tiny's layer modes, float32, raw cache: nothing
    quantized whose code a summation order could flip): the draft rings split like the cache's window, the
    tokens those of the plain engine on one device (the engine shape of tests/test_engine.py's mesh test)."""
    import jax

    from tests.configs import TINY5

    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    cfg = TINY5.replace(quantize_cache=False)
    params = d.init_params(cfg, seed=0)
    run = lambda slots, **kw: Engine(cfg, params, EngineConfig(slots=slots, capacity=160, prefill_chunk=32,
                                                               page_tokens=32, progress=False, **kw))
    plain = run(2).generate(_requests())
    eng = run(8, speculative="dspark", mesh="data=2,expert=4", layout="dp_ep")
    spec = eng.generate(_requests())
    for p, s in zip(plain, spec):
        assert s.error is None and s.tokens == p.tokens, (p.id, p.tokens, s.tokens)
        assert s.metrics["speculative_steps"] >= 1
    assert all(len(a.sharding.device_set) == 8 and a.sharding.spec[1] == ("data", "expert")
               for a in jax.tree.leaves(eng.window))
