"""Weight matmuls in stored formats: the GPU kernels against their jnp twins (interpret mode on CPU,
compiled on a GPU), the twin against the dense formula it replaced, and the MoE built on them.

Tolerances: the decoded weights are exact in the compute dtype, so kernel and twin differ by f32
summation order only: <= 1e-5 x max|y| in f32 (bf16 operands: the same products, so the same bound).
The twin gathers only the experts with rows and must equal dequantize-everything + ragged_dot exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv41_jax as d
from dsv41_jax import grouped, kernels
from dsv41_jax.layers import quantize_activation, quantize_fp8_blocks
from dsv41_jax.moe import MoE, swiglu
from experiments.bench_decode import truncated
import kernels_pallas
from kernels_pallas import gpu_grouped

INTERPRET = jax.default_backend() == "cpu"


@pytest.fixture(autouse=True)
def _exact_f32_dots():
    """XLA on GPU runs f32 dots in TF32 by default; the twins here must be exact, as on CPU."""
    with jax.default_matmul_precision("highest"):
        yield
SIZES = {
    "unequal_with_empty": [3, 0, 5, 1, 0, 0, 2, 1],
    "all_to_one_expert": [0, 0, 0, 0, 0, 0, 0, 12],
    "one_token": [0, 1, 0, 0, 0, 0, 0, 0],
    "long_groups": [20, 17, 0, 0, 33, 1, 0, 9],  # several row tiles per group at tm=16
}


def _experts(e=8, k=64, n=48, seed=0):
    w = np.random.default_rng(seed).normal(size=(e, n, k)).astype(np.float32) * 0.1
    return grouped.EXPERT_FP4.encode(jnp.asarray(w))


def _close(a, b, rel=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(a - b).max() <= rel * max(np.abs(b).max(), 1e-30), (np.abs(a - b).max(), np.abs(b).max())


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_fp4_kernel_matches_twin(case, dtype):
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    w = _experts()
    m = int(sizes.sum()) + 3  # trailing rows no group owns: zero in both
    x = jnp.asarray(np.random.default_rng(1).normal(size=(m, 64)), dtype)
    ref = grouped.grouped_matmul(x, w, sizes)
    dense = jax.lax.ragged_dot(x, grouped.dequantize_experts(w, dtype), sizes, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(dense))  # gathering the hit experts changes nothing
    assert not np.asarray(ref[int(sizes.sum()):]).any()
    for tiles in (None, (64, 32, 16)):  # the chosen tiles, and prefill-sized row tiles with several K steps
        out = gpu_grouped.grouped_matmul_fp4(x, w["values"], w["scales"], sizes, tiles=tiles, interpret=INTERPRET)
        _close(out, ref)
    # two weights in one launch (w1 and w3): each output equals its own twin
    w2 = _experts(seed=1)
    outs = gpu_grouped.grouped_matmuls_fp4(x, [(w["values"], w["scales"]), (w2["values"], w2["scales"])], sizes,
                                           interpret=INTERPRET)
    _close(outs[0], ref)
    _close(outs[1], grouped.grouped_matmul(x, w2, sizes))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("experts", [[5], [3, 0, 7, 2, 6, 1], [4, -1, 4, 0, -1]])  # one row; a token's top-6; repeats and none
def test_rows_fp4_kernel_matches_twin(experts, dtype, monkeypatch):
    """The row form (each row names its expert, -1 none): twin = the grouped form of the same rows sorted,
    and the GPU kernel (one row tile per row) and the TPU route of `kernels.rows_matmuls` (sorted for the
    grouped TPU kernel, put back) equal the twin."""
    w, w2 = _experts(), _experts(seed=1)
    e = jnp.asarray(experts, jnp.int32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(len(experts), 64)), dtype)
    ref = grouped.rows_matmul(x, w, e)
    order = np.argsort(np.where(np.asarray(e) >= 0, experts, 8), kind="stable")
    sizes = jnp.asarray(np.bincount(np.asarray(e)[np.asarray(e) >= 0], minlength=8), jnp.int32)
    sorted_y = np.zeros(ref.shape, np.float32)
    sorted_y[order] = np.asarray(grouped.grouped_matmul(x[order], w, sizes))
    _close(ref, sorted_y)
    assert not np.asarray(ref)[np.asarray(e) < 0].any()
    outs = gpu_grouped.rows_matmuls_fp4(x, [(w["values"], w["scales"]), (w2["values"], w2["scales"])], e,
                                        interpret=INTERPRET)
    _close(outs[0], ref)
    _close(outs[1], grouped.rows_matmul(x, w2, e))
    # one token's row read by every row (the batch-1 decode step passes x as [1, K]), kernel and twin
    ref1 = grouped.rows_matmul(x[:1], w, e)
    _close(ref1, grouped.rows_matmul(jnp.broadcast_to(x[:1], x.shape), w, e))
    _close(gpu_grouped.rows_matmuls_fp4(x[:1], [(w["values"], w["scales"])], e, interpret=INTERPRET)[0], ref1)
    # x of R = M / 2 rows, row m reading x[m // 2] (a few tokens' assignments): twin, GPU and TPU routes
    xr = x[::2] if len(experts) % 2 == 0 else None
    ref_r = None if xr is None else grouped.rows_matmul(jnp.repeat(xr, 2, axis=0), w, e)
    if xr is not None:
        _close(grouped.rows_matmul(xr, w, e), ref_r)
        _close(kernels.rows_matmuls(xr, [w], e, kernels="pallas")[0], ref_r)
    monkeypatch.setattr(kernels_pallas, "platform", lambda family=None: ("tpu", True))
    (tpu,) = kernels.rows_matmuls(x, [w], e, kernels="pallas")
    _close(tpu, ref)
    (tpu,) = kernels.rows_matmuls(x[:1], [w], e, kernels="pallas")
    _close(tpu, ref1)
    if xr is not None:
        _close(kernels.rows_matmuls(xr, [w], e, kernels="pallas")[0], ref_r)


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("experts", [[5], [3, 0, 7, 2, 6, 1], [4, -1, 4, 0, -1]])
def test_rows_float_kernel_matches_twin(experts, w_dtype, monkeypatch):
    """Float experts [E, K, N] in the row form: the GPU kernel (K split across programs, two weights in one
    launch) equals the twin; `kernels.rows_matmuls` takes it with "pallas" off a TPU, with the twin's
    gradient, and stays on the twin on a TPU."""
    rng = np.random.default_rng(len(experts))
    w, w3 = (jnp.asarray(rng.normal(size=(8, 256, 96)) * 0.1, w_dtype) for _ in range(2))
    e = jnp.asarray(experts, jnp.int32)
    x = jnp.asarray(rng.normal(size=(len(experts), 256)), w_dtype)
    refs = [grouped.rows_matmul(x, wi, e) for wi in (w, w3)]
    assert not np.asarray(refs[0])[np.asarray(e) < 0].any()
    for splits in (None, 1):
        outs = gpu_grouped.rows_matmuls_float(x, [w, w3], e, splits=splits, interpret=INTERPRET)
        for out, ref in zip(outs, refs):
            _close(out, ref)
    (one_row,) = gpu_grouped.rows_matmuls_float(x[:1], [w], e, interpret=INTERPRET)  # x read by every row
    _close(one_row, grouped.rows_matmul(jnp.broadcast_to(x[:1], x.shape), w, e))
    loss = lambda fn: lambda x, w: sum(jnp.sum(y * y) for y in fn(x, [w, w3], e))  # noqa: E731
    g_kernel = jax.grad(loss(lambda *a: kernels.rows_matmuls(*a, kernels="pallas")), (0, 1))(x, w)
    g_twin = jax.grad(loss(lambda *a: kernels.rows_matmuls(*a, kernels="jnp")), (0, 1))(x, w)
    for a, b in zip(g_kernel, g_twin):  # bf16: the cotangents are 2y rounded to bf16 from two f32 sums
        _close(a, b, rel=1e-5 if w_dtype == jnp.float32 else 1e-2)
    jaxpr = str(jax.make_jaxpr(lambda a: kernels.rows_matmuls(a, [w], e, kernels="pallas"))(x))
    assert "grouped_matmul_float" in jaxpr
    monkeypatch.setattr(kernels_pallas, "platform", lambda family=None: ("tpu", True))
    jaxpr = str(jax.make_jaxpr(lambda a: kernels.rows_matmuls(a, [w], e, kernels="pallas"))(x))
    assert "pallas_call" not in jaxpr


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # bf16: the PTX decode on a GPU
@pytest.mark.parametrize("m", [1, 5, 70])
def test_fp8_matmul_kernel_matches_twin(m, dtype):
    rng = np.random.default_rng(m)
    q, s = quantize_fp8_blocks(jnp.asarray(rng.normal(size=(96, 128)).astype(np.float32)))
    x = jnp.asarray(rng.normal(size=(m, 128)), dtype)
    ref = grouped.fp8_matmul(x, q, s)
    _close(gpu_grouped.fp8_matmul(x, q, s, interpret=INTERPRET), ref)
    # four K chunks: few output tiles, so K is split over 4 programs per tile and summed after
    assert gpu_grouped.k_splits(4, 3) == 4
    _close(gpu_grouped.fp8_matmul(x, q, s, tiles=(16, 32, 32), interpret=INTERPRET), ref)
    # projections of one input in one launch (wq_a + wkv): widths 96 and 32 side by side, 32-wide tiles
    q2, s2 = quantize_fp8_blocks(jnp.asarray(rng.normal(size=(32, 128)).astype(np.float32)))
    both = gpu_grouped.fp8_matmuls(x, [(q, s), (q2, s2)], interpret=INTERPRET)
    assert [y.shape for y in both] == [(m, 96), (m, 32)]
    _close(both[0], ref)
    _close(both[1], grouped.fp8_matmul(x, q2, s2))


def test_every_code_and_scale_decodes_exactly():
    """One-hot bf16 rows make the kernels output their decoded weights: every FP4 / E4M3 byte value at every
    scale byte up to the fast decode's limit equals the twin's decode exactly (on a GPU: the PTX decode)."""
    rng = np.random.default_rng(0)
    n, k = 64, 128
    vals = jnp.asarray(np.tile(np.arange(256, dtype=np.uint8), n * k // 2 // 256).reshape(1, n, k // 2))
    sc = jnp.asarray(rng.integers(gpu_grouped.FP4_FAST_MAX - 12, gpu_grouped.FP4_FAST_MAX + 1, (1, n, k // 32)),
                     jnp.uint8)
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    want = grouped.dequantize_experts({"values": vals, "scales": sc}, jnp.float32)[0]  # [K, N]
    got = gpu_grouped.grouped_matmul_fp4(eye, vals, sc, jnp.array([k], jnp.int32), interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    q = jnp.asarray(np.tile(np.arange(256, dtype=np.uint8) & 0xFE, n * k // 256).reshape(n, k))  # no NaN codes
    e = jnp.asarray(rng.integers(gpu_grouped.FP8_FAST_MAX - 20, gpu_grouped.FP8_FAST_MAX + 1, (n // 32, k // 32)),
                    jnp.uint8)
    want = grouped.dequantize_fp8_blocks(jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn), e).T
    got = gpu_grouped.fp8_matmul(eye, q, e, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tile_map_covers_every_row_once():
    sizes = jnp.asarray([3, 0, 40, 1, 0, 17], jnp.int32)
    grp, row0, end = gpu_grouped.tile_map(sizes, int(sizes.sum()), 16)
    owner = -np.ones(int(sizes.sum()), int)
    for g, a, z in zip(*map(np.asarray, (grp, row0, end))):
        if g < 0:
            continue
        rows = np.arange(a, min(a + 16, z))
        assert (owner[rows] == -1).all()
        owner[rows] = g
    np.testing.assert_array_equal(owner, np.repeat(np.arange(6), np.asarray(sizes)))
    # the scan-free cumulative sum it is built on, and the constant map of a dense projection
    np.testing.assert_array_equal(gpu_grouped.inclusive_sum(sizes), np.cumsum(np.asarray(sizes)))
    np.testing.assert_array_equal(np.stack(gpu_grouped.dense_tile_map(40, 16)), [[0, 0, 0], [0, 16, 32], [40] * 3])


def _moe_cfg(**kw):
    """tiny in the released weight formats (FP8 projections, FP4 experts); no Engram unless asked."""
    base = dict(engram_layer_ids=(), engram_num_embeddings=(), n_routed_experts=8, n_activated_experts=2,
                weight_format="fp8")
    return d.preset("tiny").replace(**(base | kw))


def _old_routed(moe, x_nd, w_nk, ids_nk):
    """The path this replaced: every expert dequantized, one ragged_dot over all of them."""
    raw = moe._raw_experts()
    full = lambda name: grouped.dequantize_experts(moe._stored(raw, name), x_nd.dtype)
    k = ids_nk.shape[-1]
    order = jnp.argsort(ids_nk.reshape(-1), stable=True)
    sizes = jnp.bincount(ids_nk.reshape(-1), length=moe.n_experts).astype(jnp.int32)
    xs = x_nd[order // k]
    mm = lambda a, name: jax.lax.ragged_dot(a, full(name), sizes, preferred_element_type=jnp.float32)
    act = (swiglu(mm(xs, "w1"), mm(xs, "w3"), moe.limit) * w_nk.reshape(-1)[order][:, None]).astype(x_nd.dtype)
    if moe.act_quant:
        act = quantize_activation(act)
    return jnp.zeros(x_nd.shape, jnp.float32).at[order // k].add(mm(act, "w2"))


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # decode (M < E: gathered experts) and a prefill chunk
def test_moe_paths_agree(act_quant, tokens):
    cfg = _moe_cfg(activation_quant=act_quant)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(tokens).normal(size=(1, tokens, cfg.dim)), jnp.float32)
    xn = x.reshape(tokens, cfg.dim)
    w, ids, _ = moe.router(xn)
    xin = quantize_activation(xn) if act_quant else xn
    new = moe._routed(xin, w, ids, moe._raw_experts(), 0, moe.n_experts, "jnp")
    old = _old_routed(moe, xin, w, ids)
    scale = float(jnp.abs(old).max())
    assert float(jnp.abs(new - old).max()) <= 1e-6 * scale
    y_jnp, _ = moe(x, kernels="jnp")
    y_kernel, _ = moe(x, kernels="pallas")  # the GPU kernels (interpreted on CPU) for experts and FP8 projections
    _close(y_kernel, y_jnp, rel=1e-5)


@pytest.mark.parametrize("act_quant", [
    pytest.param(False, marks=pytest.mark.skipif(INTERPRET, reason="60 s interpreted; the W4A8 case covers CPU")),
    True])
def test_model_logits_with_weight_kernels(monkeypatch, act_quant):
    """The model, f32, released weight formats: decode logits with the expert and FP8 kernels (forced on,
    everything else jnp) against the jnp twins, to 1e-5 of the logit scale, from the same filled cache
    (prefill-sized inputs of the kernels: the kernel tests above, 70-row FP8, 40-token MoE). tiny's first
    3 layers (window, window + Engram, Full with an indexer) launch every kind of weight kernel the model has.
    The cache is filled by jnp decode steps (6 tokens, 5 in row 1): the program of `want`, so no prefill
    compile."""
    tiny = d.preset("tiny")
    cfg = truncated(_moe_cfg(activation_quant=act_quant, engram_layer_ids=tiny.engram_layer_ids, engram_head_dim=32,
                             engram_num_embeddings=tiny.engram_num_embeddings), 3)  # FP8 Engram needs 32-wide heads
    params = d.init_params(cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    cache = d.init_cache(cfg, 2, 64)
    for i in range(6):
        _, cache = d.decode_step(cfg, params, cache, ids[:, i], active_b=np.array([True, i < 5]))
    np.testing.assert_array_equal(cache.lengths, [6, 5])
    spare = jax.tree.map(jnp.copy, cache)  # decode_step donates its cache
    want, _ = d.decode_step(cfg, params, cache, ids[:, 0])
    monkeypatch.setattr(kernels, "_weight_kernels", lambda kernels, rows: True)
    jax.clear_caches()  # the api's jitted step must retrace with the kernels in it
    got, _ = d.decode_step(cfg, params, spare, ids[:, 0])
    jax.clear_caches()
    want, got = np.asarray(want), np.asarray(got)
    err = np.abs(got - want).max(-1) / np.abs(want).max()
    print(f"act_quant={act_quant}: max |dlogit| / scale {err.max():.2e}")
    assert (err <= 1e-5).all(), err


def test_prefill_sized_inputs_keep_the_xla_path(monkeypatch):
    """Above WEIGHT_KERNEL_ROWS rows (prefill chunks) the weight matmuls do not call the kernels, even with
    kernels="pallas"; at or below it they do."""
    calls = []

    class NoKernels:  # stands in for the kernels_pallas module: any use of a kernel fails the test
        def __getattr__(self, name):
            calls.append(name)
            pytest.fail(f"kernel {name} called")

    monkeypatch.setattr(kernels, "_kp", NoKernels())
    w = _experts(k=32, n=16)
    rows = kernels.WEIGHT_KERNEL_ROWS + 1
    sizes = jnp.asarray([rows, 0, 0, 0, 0, 0, 0, 0], jnp.int32)
    x = jnp.ones((rows, 32), jnp.float32)
    np.testing.assert_array_equal(kernels.grouped_matmul(x, w, sizes, kernels="pallas"),
                                  grouped.grouped_matmul(x, w, sizes))
    q, s = quantize_fp8_blocks(jnp.ones((32, 32)))
    kernels.fp8_matmul(x, q, s, kernels="pallas")
    assert not calls
    with pytest.raises(pytest.fail.Exception):
        kernels.fp8_matmul(x[:kernels.WEIGHT_KERNEL_ROWS], q, s, kernels="pallas")


def test_scales_beyond_the_fast_decode_are_reported():
    """The GPU kernels' bf16 decode folds 2**(E + 126) (FP4) / 2**(E + 120) (FP8) into one bf16: the loader
    names every param whose scales exceed that, and only those."""
    ok = {"layers/0/ffn/w1_scale": jnp.full((2, 4), gpu_grouped.FP4_FAST_MAX, jnp.uint8),
          "layers/0/attn/wq_a/scale": jnp.full((2, 2), gpu_grouped.FP8_FAST_MAX, jnp.uint8),
          "layers/0/engram/table_scale": jnp.full((2, 2), 250, jnp.uint8)}  # not read by these kernels
    assert kernels.scales_beyond_fast_decode(ok) == []
    bad = ok | {"layers/1/ffn/w2_scale": jnp.full((2, 4), gpu_grouped.FP4_FAST_MAX + 1, jnp.uint8),
                "layers/1/attn/wo_b/scale": jnp.full((2, 2), gpu_grouped.FP8_FAST_MAX + 1, jnp.uint8)}
    assert kernels.scales_beyond_fast_decode(bad) == ["layers/1/ffn/w2_scale", "layers/1/attn/wo_b/scale"]

