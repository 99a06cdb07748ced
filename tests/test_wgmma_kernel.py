"""The Hopper FP4 expert kernel (`kernels_pallas.gpu_wgmma`): what a CPU can check and, on an H100/H200, its
values compiled against the jnp twin (`grouped.rows_matmul`).

The Mosaic GPU interpreter cannot run a register-operand wgmma, so on a CPU: the decode's bit arithmetic by
a numpy model of its PTX (every code, every E8M0 byte the fast path takes), the K permutation, the
arguments it refuses, and that it lowers for CUDA (its Mosaic GPU module is built; PTX needs a GPU)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import grouped
from kernels_pallas import gpu_grouped, gpu_wgmma
from tests.kernel_checks import bf16_bits_to_float, run_decode_ptx

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def test_decode_bits_give_every_code_times_its_scale():
    """Every pair of codes in every byte position, for E8M0 bytes 0..128 (2**-127 .. 2**1): output i holds
    inputs WORD_PAIRS[i] (input 2b in byte b's low nibble) as E2M1 x 2**(byte - 127), bf16 products exact."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (4096, 8)).astype(np.uint32)
    codes[:256, :2] = np.stack(np.meshgrid(np.arange(16), np.arange(16)), -1).reshape(256, 2)  # all pairs
    words = np.zeros(len(codes), np.uint32)
    for j in range(8):  # input j: byte j // 2, high nibble for odd j
        words |= codes[:, j] << np.uint32(4 * j)
    exps = np.resize(np.arange(129, dtype=np.uint8), len(codes))
    got = run_decode_ptx(gpu_wgmma.DECODE_PTX, words, exps)
    for i, (lo, hi) in enumerate(gpu_wgmma.WORD_PAIRS):
        for lane, j in enumerate((lo, hi)):
            want = E2M1[codes[:, j]] * np.exp2(exps.astype(np.float64) - 127)
            np.testing.assert_array_equal(got[:, i, lane], want)
            assert np.array_equal(np.signbit(got[:, i, lane]), np.signbit(E2M1[codes[:, j]]))  # -0 stays -0
    # and the products are representable in bf16 (the FMA rounds nothing): at most 3 significant bits
    assert np.all(np.asarray(jnp.asarray(got, jnp.bfloat16), np.float64) == got)


def test_k_permutation_is_a_bijection_within_scale_groups_of_each_thread():
    """Every input of a 256 step exactly once; thread q's columns (pairs 8b + 2q in each 16) hold only inputs
    of its scale groups 2q and 2q + 1 (the scales it loads)."""
    p = gpu_wgmma.k_perm()
    assert sorted(p) == list(range(gpu_wgmma.TK))
    cols = np.arange(gpu_wgmma.TK)
    thread = (cols % 8) // 2
    assert np.all(p // 32 // 2 == thread)


def _packed(e, n, k, seed=0):
    """(values uint8 [E, N, K/2], scales uint8 [E, N, K/32] with bytes 118..123): random FP4 experts."""
    rng = np.random.default_rng(seed)
    values = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    scales = jnp.asarray(rng.integers(118, 124, (e, n, k // 32)), jnp.uint8)
    return values, scales


def test_refuses_what_it_cannot_compute():
    values, scales = _packed(2, 64, 256)
    ids = jnp.zeros((4,), jnp.int32)
    for x, kw, what in ((jnp.zeros((3, 256), jnp.bfloat16), {}, "R | M"),  # 3 rows for 4 assignments
                        (jnp.zeros((1, 256), jnp.float32), {}, "bf16"),
                        (jnp.zeros((1, 256), jnp.bfloat16), {"splits": 2}, "splits")):
        with pytest.raises(ValueError, match=re.escape(what)):
            gpu_wgmma.rows_matmuls_fp4_wgmma(x, [(values, scales)], ids, **kw)
    with pytest.raises(ValueError, match="do not fit"):
        gpu_wgmma.rows_matmuls_fp4_wgmma(jnp.zeros((1, 256), jnp.bfloat16), [(values, scales), (values[:1], scales[:1])],
                                   ids)


def test_dispatch_takes_it_only_where_it_computes(monkeypatch):
    """`supported` (the dispatch's test) on a Hopper GPU: bf16 x whose rows divide M, K % 256, N % 64; never
    elsewhere, nor while ON is off."""
    values, scales = _packed(2, 64, 256)
    x = jnp.zeros((2, 256), jnp.bfloat16)
    monkeypatch.setattr(gpu_wgmma, "is_hopper", lambda: False)
    assert not gpu_wgmma.supported(x, [(values, scales)], 4)
    monkeypatch.setattr(gpu_wgmma, "is_hopper", lambda: True)
    assert gpu_wgmma.supported(x, [(values, scales)], 4) and gpu_wgmma.supported(x[:1], [(values, scales)], 6)
    assert not gpu_wgmma.supported(x, [(values, scales)], 5)  # 2 rows do not divide 5
    assert not gpu_wgmma.supported(x.astype(jnp.float32), [(values, scales)], 4)
    v128, s128 = _packed(2, 64, 128)
    assert not gpu_wgmma.supported(x[:, :128], [(v128, s128)], 4)  # K = 128: not whole 256-input steps
    v32, s32 = _packed(2, 32, 256)
    assert not gpu_wgmma.supported(x, [(v32, s32)], 4)  # N = 32
    monkeypatch.setattr(gpu_wgmma, "ON", False)
    assert not gpu_wgmma.supported(x, [(values, scales)], 4)


def test_x_column_formula_is_the_kernels_k_order():
    """`_load_x` places x by `x_column_input`: it must be the order the decodes give the wgmma's K columns."""
    t = np.arange(gpu_wgmma.TK // 2)
    for fp8, perm in ((False, gpu_wgmma.k_perm()), (True, gpu_wgmma.fp8_k_perm())):
        first = gpu_wgmma.x_column_input(t, fp8)
        np.testing.assert_array_equal(perm[0::2], first)
        np.testing.assert_array_equal(perm[1::2], first + gpu_wgmma.X_PAIR[fp8])


def test_swizzled_offset_is_the_128_byte_swizzle_of_the_tiled_layout():
    """The shared-memory offsets the x load and the attention's key tiles compute: the (8, 64)-tiled bf16 layout's
    byte address with bits 4..6 (the 16 B chunk) XORed by bits 7..9 (the row within its 1 KB tile)."""
    for lead_n, rows in ((4, 8), (4, 64)):
        lead, row, col = np.meshgrid(np.arange(lead_n), np.arange(rows), np.arange(256), indexing="ij")
        plain = ((((lead * (rows // 8) + row // 8) * 4 + col // 64) * 8 + row % 8) * 64 + col % 64) * 2
        want = plain ^ (((plain >> 7) & 7) << 4)
        got = gpu_wgmma.swizzled_offset(lead, row, col, rows)
        np.testing.assert_array_equal(got, want)
        assert len(np.unique(got)) == got.size  # a bijection onto the array's bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles it for real")
@pytest.mark.parametrize("rows,m,splits,k", [(1, 6, 1, 512), (6, 6, 2, 512), (2, 12, 1, 512), (1, 6, 1, 1280)])
def test_lowers_for_cuda(rows, m, splits, k):
    """One token's k rows, a row each with K split, and two tokens' k rows each (R = M / k), two weights; CTAs
    that load x themselves (<= X_STEPS_MAX steps) and CTAs that take it by TMA (5 steps)."""
    s = jax.ShapeDtypeStruct
    e, n = 8, 128
    w = (s((e, n, k // 2), jnp.uint8), s((e, n, k // 32), jnp.uint8))
    f = functools.partial(gpu_wgmma.rows_matmuls_fp4_wgmma, splits=splits)
    text = jax.jit(f).trace(s((rows, k), jnp.bfloat16), [w, w], s((m,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and f"fp4_rows_wgmma_{n}x{k}" in text


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("rows,m,splits,k", [(1, 6, 1, 768), (6, 6, 3, 768), (8, 48, 1, 768), (48, 48, 3, 768),
                                             (1, 1, 1, 768), (1, 6, 1, 2560), (8, 48, 2, 2560)])
def test_matches_the_twin_on_the_gpu(rows, m, splits, k):
    """Two weights in one launch, unequal expert sets, a -1 row (zero), x of one row, a row each, and one row
    per token's k = 6 assignments; CTAs that load x themselves (3 steps or fewer) and by TMA (5, 10 steps);
    equal to the twin up to f32 summation order."""
    e, n = 16, 192
    pairs = [_packed(e, n, k, seed=s) for s in (1, 2)]
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, m), jnp.int32).at[m // 2].set(-1)
    got = gpu_wgmma.rows_matmuls_fp4_wgmma(x, pairs, ids, splits=splits)
    xm = jnp.repeat(x, m // rows, axis=0)
    for y, (values, scales) in zip(got, pairs):
        want = grouped.rows_matmul(xm, {"values": values, "scales": scales}, ids)
        assert y.shape == (m, n)
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
        assert not np.any(np.asarray(y[m // 2]))


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_layer_takes_the_kernel_for_a_few_tokens(tokens, act_quant, monkeypatch):
    """A bf16 MoE layer in the released weight formats: its decode-sized calls run the wgmma kernel as rows
    (one token and a few alike) and equal the jnp twin's layer. The two compute the same f32 products in
    another summation order; the SwiGLU output is rounded to bf16 before w2, where a 1-ulp difference can
    flip a bf16 rounding (2**-8 relative) of a few hidden units: bounded at 1% of the output's scale, and
    the mean difference at 0.1%."""
    from flax import nnx

    import dsv41_jax as d
    from dsv41_jax.moe import MoE

    cfg = d.preset("tiny").replace(dim=256, moe_inter_dim=256, n_routed_experts=16, n_activated_experts=4,
                                   weight_format="fp8", dtype="bfloat16", param_dtype="bfloat16",
                                   activation_quant=act_quant)
    monkeypatch.setattr(gpu_wgmma, "ON", True)  # the dispatch's switch
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(tokens).normal(size=(1, tokens, cfg.dim)), jnp.bfloat16)
    hlo = jax.jit(lambda x: moe(x, kernels="pallas")[0]).lower(x).as_text()
    assert "fp4_rows_wgmma" in hlo
    y_kernel = np.asarray(moe(x, kernels="pallas")[0], np.float32)
    y_jnp = np.asarray(moe(x, kernels="jnp")[0], np.float32)
    diff, scale = np.abs(y_kernel - y_jnp), np.abs(y_jnp).max()
    assert diff.max() <= 1e-2 * scale and diff.mean() <= 1e-3 * scale, (diff.max() / scale, diff.mean() / scale)


def test_fp8_decode_bits_give_every_byte_times_its_scale():
    """FP8_DECODE_PTX modelled instruction by instruction: every E4M3 byte but the NaNs, in every position of a
    word, times 2**(E - 7) with E up to the fast path's 134: the E4M3 value times 2**(E - 127), exact in bf16."""
    ptx = gpu_wgmma.FP8_DECODE_PTX
    assert re.findall(r"\b(prmt|shl|and|lop3|fma)\.", ptx) == ["prmt", "shl", "and", "fma"] * 2
    sels = [int(v, 16) for v in re.findall(r"prmt\.b32 t, \$2, 0, (0x[0-9a-f]+);", ptx)]
    assert sels == list(gpu_wgmma.FP8_SELECTORS) and ptx.count("shl.b32 m, t, 4; and.b32 m, m, 0x87F087F0;") == 2
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint32)  # E4M3 NaN: 0x7F, 0xFF
    rng = np.random.default_rng(1)
    words4 = np.stack([rng.permutation(np.resize(codes, 4 * len(codes)))[:len(codes)] for _ in range(4)], -1)
    words4[:, 0] = codes  # every code in byte 0 at least
    words = sum(words4[:, j] << np.uint32(8 * j) for j in range(4)).astype(np.uint32)
    exps = np.resize(np.arange(100, 135, dtype=np.uint32), len(codes))
    mult = bf16_bits_to_float(((exps + 120) << 7).astype(np.uint16))
    e4m3 = np.asarray(jnp.asarray(words4.astype(np.uint8)).view(jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
    for sel in sels:
        t = np.zeros_like(words)
        for out_byte in range(4):  # prmt: nibble n picks byte n & 7 of (a, b = 0); with bit 3, that byte's sign
            n = (sel >> (4 * out_byte)) & 0xF
            src = (words >> np.uint32(8 * (n & 7))) & np.uint32(0xFF) if n & 7 < 4 else np.zeros_like(words)
            byte = np.where(src & np.uint32(0x80), np.uint32(0xFF), np.uint32(0)) if n & 8 else src
            t |= byte.astype(np.uint32) << np.uint32(8 * out_byte)
        m = (t << np.uint32(4)) & np.uint32(0x87F087F0)
        lo, hi = sel & 0xF, (sel >> 8) & 0xF  # the lanes' source bytes
        for lane, j in enumerate((lo, hi)):
            bits = (m >> np.uint32(16 * lane)) & np.uint32(0xFFFF)
            got = bf16_bits_to_float(bits.astype(np.uint16)) * mult
            np.testing.assert_array_equal(got, e4m3[:, j] * np.exp2(exps.astype(np.float64) - 127))


def test_fp8_k_permutation_keeps_each_threads_inputs_in_its_scale_groups():
    p = gpu_wgmma.fp8_k_perm()
    assert sorted(p) == list(range(gpu_wgmma.TK))
    thread = (np.arange(gpu_wgmma.TK) % 8) // 2
    assert np.all(np.isin(p // 32 - thread, (0, 4)))  # groups q and q + 4 of 8 per step


def test_fp8_scale_box_takes_the_layers_k():
    """The v41 FP8 projections' K (4096, 1280, 8192, 2304) all make a CTA's scales one TMA box; rows of at most
    256 bytes, a multiple of 16."""
    for k in (4096, 1280, 8192, 2304, 256):
        rows, cols = gpu_wgmma.fp8_scale_box(k)
        assert rows * cols == k // 16 and cols <= 256 and cols % 16 == 0
    assert gpu_wgmma.fp8_scale_box(4352) is None and gpu_wgmma.fp8_scale_box(1200) is None


def test_k_splits_are_the_fewest_whole_splits_reaching_the_target():
    """Every choice divides the steps, leaves each CTA its minimum steps (when the steps allow any split) and
    stays within the cap; a smaller such split would not reach the target, and one that misses the target
    has no larger such split. At the v41 launches: the splits the H200 sweep chose (docs/BENCHMARKS.md,
    sixteenth pass)."""
    for steps in range(1, 40):
        for ctas in (1, 28, 80, 432, 3456):
            for target, min_steps in ((gpu_wgmma.FP8_CTAS, 1), (gpu_wgmma.FP4_CTAS, 2)):
                s = gpu_grouped.k_splits(steps, ctas, target, min_steps, gpu_wgmma.MAX_SPLITS)
                valid = lambda c: steps % c == 0 and steps // c >= min_steps and c <= gpu_wgmma.MAX_SPLITS  # noqa: E731
                assert steps % s == 0 and (valid(s) or (s == 1 and steps < min_steps))
                assert not any(valid(c) and c * ctas >= target for c in range(1, s))
                assert s * ctas >= target or not any(valid(c) for c in range(s + 1, steps + 1))
    fp8 = [gpu_wgmma.fp8_splits(k, tiles) for k, tiles in ((8192, 80), (5120, 72), (5120, 28), (1280, 512), (2304, 80))]
    assert fp8 == [16, 10, 10, 5, 9]  # wo_b, shared w1 + w3, wq_a + wkv, wq_b, shared w2
    fp4 = [gpu_wgmma.fp4_splits(k, ctas) for k, ctas in ((5120, 432), (2304, 480), (5120, 3456), (2304, 3840))]
    assert fp4 == [10, 3, 1, 1]  # batch 1 w1 + w3, w2; batch 8


@pytest.mark.skipif(not gpu_wgmma.is_hopper(), reason="needs an H100/H200 (sm_90): wgmma")
@pytest.mark.parametrize("m,ns,k,splits", [(1, (1024, 512), 2048, None), (8, (192,), 1024, 1), (5, (64, 128), 3072, 3),
                                           (2, (256,), 1280, None), (8, (64, 128), 2304, 3), (3, (128,), 2560, 1),
                                           (8, (64,), 5120, 1)])
def test_fp8_matches_the_twin_on_the_gpu(m, ns, k, splits):
    """Projections of one input in one launch (unequal widths), K split or not, 1..8 rows; K = 1280 and 2304
    (scales as a [1, K/16] box); CTAs that load x themselves (<= 4 steps) and by TMA (10, 20 steps)."""
    rng = np.random.default_rng(m)
    ws = [(jnp.asarray(rng.integers(0, 256, (n, k)) & 0xFE, jnp.uint8),
           jnp.asarray(rng.integers(114, 135, (n // 32, k // 32)), jnp.uint8)) for n in ns]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = gpu_wgmma.fp8_matmuls_wgmma(x, ws, splits=splits)
    for y, (q, e) in zip(got, ws):
        want = grouped.fp8_matmul(x, jax.lax.bitcast_convert_type(q, jnp.float8_e4m3fn), e)
        assert y.shape == want.shape
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
