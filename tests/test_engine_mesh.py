"""The serving engine on 8 devices in the DeepSeek serving layout (data=2 x expert=4, dp_ep: slots split over both
axes, experts over `expert`), plain and with DSpark steps, emits the one-device engine's tokens. tiny's layer modes
in 5 layers, float32, raw cache: nothing quantized whose code a summation order could flip. (Images on a mesh:
tests/test_vision.py.)

The engine shape of tests/test_engine.py. Both tests in one module: their one-device engines, and the mesh
engines' prefill through the layers up to the last kv source, are the same programs, compiled once.
"""

import jax
import pytest

import dsv41_jax as d
from dsv41_jax.pytree_paths import path_str
from dsv41_jax.serving import Engine, EngineConfig, Request, slots as rows
from tests.configs import TINY5
from tests.test_engine import CAP, CHUNK, NEW, PROMPT, PT
from tests.test_engine_dspark import _requests

MESH = dict(mesh="data=2,expert=4", layout="dp_ep")


@pytest.fixture(scope="module")
def model():
    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    cfg = TINY5.replace(quantize_cache=False)
    assert cfg.dtype == "float32"
    return cfg, d.init_params(cfg, seed=0)


def engine(model, slots=2, **kw):
    cfg, params = model
    return Engine(cfg, params, EngineConfig(slots=slots, capacity=CAP, prefill_chunk=CHUNK, page_tokens=PT,
                                            progress=False, **kw))


def test_engine_on_a_mesh_decodes_and_reuses_prefixes_as_one_device(model, tmp_path):
    """The params and the slots' cache live on the mesh, and two requests emit the one-device engine's tokens, cold
    (each prefilled on a batch-1 row replicated over the mesh) and from the host tier (an exact restore of the
    prefix); slots the mesh does not divide are refused first."""
    cfg = model[0]
    reqs = [Request(PROMPT, max_new_tokens=NEW), Request(PROMPT[:40], max_new_tokens=5, temperature=0.8, seed=2)]
    want = [r.tokens for r in engine(model).generate(reqs)]
    eng = engine(model, 8, cache_dir=str(tmp_path), **MESH)
    for round_ in range(2):
        out = eng.generate(reqs)
        assert [r.tokens for r in out] == want, round_
    assert out[0].metrics["prefix_path"] == "host_restore" and out[0].metrics["reused_tokens"] == 2 * PT
    w1 = next(a for p, a in jax.tree_util.tree_leaves_with_path(eng.params.state) if path_str(p).endswith("ffn/w1"))
    assert w1.sharding.spec[0] == "expert" and len(w1.sharding.device_set) == 8
    assert eng.cache.lengths.sharding.spec == jax.sharding.PartitionSpec(("data", "expert"))
    # a row put into the slots' cache comes back placed equivalently (P() for P(None, ...)): the next call takes it
    # as it is, no copy of the whole cache
    put = rows.put_row(eng.cache, 0, eng._row_placement.new_cache(cfg, CAP))
    assert eng.placement.put_cache(put) is put
    with pytest.raises(ValueError, match="slots=2: layout dp_ep splits the slots over 8 devices"):
        engine(model, **MESH)  # 2 slots


def test_speculative_engine_on_a_mesh_emits_the_plain_engines_tokens(model):
    """DSpark steps: the draft rings split like the cache's window, the tokens those of the plain engine on one
    device."""
    plain = engine(model).generate(_requests())
    eng = engine(model, 8, speculative="dspark", **MESH)
    spec = eng.generate(_requests())
    for p, s in zip(plain, spec):
        assert s.error is None and s.tokens == p.tokens, (p.id, p.tokens, s.tokens)
        assert s.metrics["speculative_steps"] >= 1
    assert all(len(a.sharding.device_set) == 8 and a.sharding.spec[1] == ("data", "expert")
               for a in jax.tree.leaves(eng.window))
