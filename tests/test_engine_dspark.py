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
