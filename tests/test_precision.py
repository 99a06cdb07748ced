"""The precision the model's dots ask for (`dsv41_jax.precision`), read off the traced programs: a float32 model
asks for IEEE f32 in every dot (a GPU otherwise runs them in TF32: the f32 parity cases then sat up to 26% of the
logit scale from the goldens on the H200), a bfloat16 model leaves the caller's default except where a dot asks
for itself."""

import jax
import jax.numpy as jnp
import pytest

import dsv41_jax as d
from dsv41_jax import api, dspark, precision
from tests.configs import TINY5
from tests.kernel_checks import dot_precisions

HIGHEST = (jax.lax.Precision.HIGHEST,) * 2


def _forward_precisions(cfg, t: int) -> list:
    """Precisions of the dots of a forward of t tokens (t = 1: a decode step) on 2 sequences, traced abstractly."""
    params, cache = d.abstract_params(cfg), jax.eval_shape(lambda: d.init_cache(cfg, 2, 16))
    tokens = jax.ShapeDtypeStruct((2, t), jnp.int32)
    n_new = jax.ShapeDtypeStruct((2,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, c, x, n: d.forward(cfg, p, c, x, n, all_logits=True))(params, cache, tokens,
                                                                                            n_new)
    return dot_precisions(jaxpr.jaxpr)


@pytest.mark.parametrize("t", [1, 4])
def test_float32_model_asks_for_ieee_f32_in_every_dot(t):
    got = _forward_precisions(TINY5.replace(dtype="float32"), t)
    assert got and all(p == HIGHEST for p in got), sorted(set(map(str, got)))


def test_bfloat16_model_keeps_the_callers_default():
    got = _forward_precisions(TINY5.replace(dtype="bfloat16", param_dtype="bfloat16"), 1)
    assert any(p is None for p in got) and any(p == HIGHEST for p in got)  # hc_fn's projection asks for itself
    with jax.default_matmul_precision("high"):  # a caller's setting reaches the dots that do not ask
        got = _forward_precisions(TINY5.replace(dtype="bfloat16", param_dtype="bfloat16"), 1)
    assert all(p in (HIGHEST, (jax.lax.Precision.HIGH,) * 2) for p in got)


def test_draft_stages_follow_the_model():
    """The draft's own dots (stages, head, Markov and confidence heads) are traced outside `forward`."""
    cfg = TINY5.replace(dtype="float32")
    assert cfg.has_dspark
    b = 2
    window = jax.eval_shape(lambda: api.init_draft_window(cfg, b))
    rows = jax.ShapeDtypeStruct((b,), jnp.int32)

    def draft(params, window, tok, lengths):
        model = api.bind(cfg, params)
        zeros = jnp.zeros((b,), jnp.int32)
        return dspark.draft(model, window, tok, lengths, jnp.zeros((b,)), zeros.astype(jnp.uint32), zeros)

    got = dot_precisions(jax.make_jaxpr(draft)(d.abstract_params(cfg), window, rows, rows).jaxpr)
    assert got and all(p == HIGHEST for p in got), sorted(set(map(str, got)))


def test_the_config_chooses():
    f32, bf16 = TINY5.replace(dtype="float32"), TINY5.replace(dtype="bfloat16", param_dtype="bfloat16")
    assert [precision.matmul_precision(c) for c in (f32, bf16)] == ["highest", None]  # "auto"
    assert [precision.matmul_precision(c.replace(matmul_precision="inherit")) for c in (f32, bf16)] == [None, None]
    assert [precision.matmul_precision(c.replace(matmul_precision="highest")) for c in (f32, bf16)] == ["highest"] * 2
    got = _forward_precisions(f32.replace(matmul_precision="inherit"), 1)  # a float32 model in the caller's TF32
    assert any(p is None for p in got)
    with pytest.raises(ValueError, match="matmul_precision must be auto"):
        f32.replace(matmul_precision="high")
