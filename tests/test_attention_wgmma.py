"""The Hopper sparse attention (`kernels_pallas.gpu_attention_wgmma`): what a CPU can check (the channel order
of its decodes, their PTX's bit arithmetic modelled in numpy, that it lowers for CUDA) and, on an H100/H200,
its output against `ops.sparse_attention_decode` (the Triton kernel's bound: 5e-3 relative per sequence, a
sequence with no valid key exactly zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import gpu_attention
from kernels_pallas import gpu_attention_wgmma as att
from kernels_pallas import gpu_wgmma
from tests.test_kernels_gpu import _attention_case, attention_ref

ON_HOPPER = gpu_wgmma.is_hopper()


def test_channel_order_is_a_permutation_within_each_group_of_8():
    p = att.channel_perm()
    assert sorted(p) == list(range(att.D))
    assert np.all(p // 8 == np.arange(att.D) // 8)


def _bf16(bits):
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def _prmt_sign(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 with sign replication: result byte i = byte (sel_i & 7) of (b:a), or its sign (0x00 / 0xFF)
    when sel_i & 8."""
    src = (a | b << 32).to_bytes(8, "little")
    out = 0
    for lane in range(4):
        s = (sel >> (4 * lane)) & 0xF
        byte = src[s & 7]
        out |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << (8 * lane)
    return out


@pytest.mark.parametrize("e", [100, 127, 144])
def test_window_decode_model_gives_e4m3_times_scale_in_perm8_order(e):
    """A numpy model of WINDOW_PTX (prmt with sign bytes, << 4, mask, times 2**(E - 17)) on every E4M3 byte."""
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN bytes (the codec never writes them)
    for raw in np.resize(codes, (-(-codes.size // 8), 8)):
        a, b = (int(w) for w in raw.view("<u4"))
        outs = []
        for x, y in gpu_wgmma.WORD_PAIRS:
            m = (_prmt_sign(a, b, att._window_selector(x, y)) << 4) & 0x87F087F0
            outs.extend(_bf16([m & 0xFFFF, m >> 16]) * np.float32(2.0 ** (e - 17)))
        want = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)[list(att.PERM8)] * 2.0 ** (e - 127 - att.KEY_SHIFT)
        np.testing.assert_array_equal(np.asarray(outs, np.float32), want)


def test_entry_values_are_exact_bf16_products():
    """SCALE_PTX's factor E4M3 x 2**116 is exact in bf16, and the decode's E2M1 x 2**-126 times it is
    E2M1 x E4M3 x 2**-KEY_SHIFT, itself a bf16 (so the one fma.rn.bf16x2 is exact), for every pair."""
    s = np.arange(256, dtype=np.uint8)
    s = s[(s & 0x7F) != 0x7F].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    factor = s * np.float32(2.0 ** 116)
    np.testing.assert_array_equal(factor.astype(ml_dtypes.bfloat16).astype(np.float32), factor)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6], np.float32)
    prod = (e2m1[:, None] * np.float32(2.0 ** -126)) * factor[None, :]
    np.testing.assert_array_equal(prod, e2m1[:, None] * s[None, :] * np.float32(2.0 ** -att.KEY_SHIFT))
    np.testing.assert_array_equal(prod.astype(ml_dtypes.bfloat16).astype(np.float32), prod)
    assert np.abs(prod[prod != 0]).min() >= 2.0 ** -126  # normal: no subnormal rounding anywhere


def _abstract_args(q_dtype, b=2, w=128, n=300, k=512):
    """The kernel's arguments as shapes (q [b, 64, 512] of q_dtype, a window of w, n entries, k selected), to lower
    it for CUDA on a CPU."""
    s = jax.ShapeDtypeStruct
    return (s((b, att.H, att.D), q_dtype), s((b, w, att.D), jnp.uint8), s((b, w, att.D // 32), jnp.uint8),
            s((b, w), jnp.bool_), s((b, n, att.D // 2), jnp.uint8), s((b, n, att.D // 16), jnp.uint8),
            s((b, k), jnp.int32), s((att.H,), jnp.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles it for real")
def test_lowers_for_cuda():
    s = jax.ShapeDtypeStruct
    b, w, n, k = 2, 128, 300, 512
    args = _abstract_args(jnp.float32, b, w, n, k)
    f = jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=3))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "sparse_attention_wgmma" in text
    with pytest.raises(ValueError, match="64 heads|wgmma attention"):
        jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05)).trace(
            s((b, 16, att.D), jnp.float32), *args[1:]).lower(lowering_platforms=("cuda",))
    partials = jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=att.MAX_SPLITS + 1))
    assert "sparse_attention_wgmma" in partials.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "globaltimer_lo" not in text  # no timeline unless asked
    for splits in (2, att.MAX_SPLITS + 1):  # with a timeline (a row per CTA), merged in the kernel and partials
        timed = jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=splits, timeline=True)).trace(*args)
        tiles = -(-(w // att.T + k // att.T) // splits)  # key tiles per range
        assert [o.shape for o in timed.out_info] == [(b, att.H, att.D), (b * splits, len(att.timeline_names(tiles)) + 1)]
        assert "globaltimer_lo" in timed.lower(lowering_platforms=("cuda",)).as_text()
    for splits in (4, 8):  # clusters merging through distributed shared memory, 16 and 8 rows a CTA
        merged = jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=splits, merged=True))
        assert "sparse_attention_wgmma" in merged.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for splits in (3, 9):  # 3 ranges cannot own equal row blocks; 9 is past the largest portable cluster
        with pytest.raises(ValueError, match="one cluster of at most"):
            jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=splits, merged=True)).trace(*args)
    with pytest.raises(ValueError, match="at least one key range"):
        jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=-1)).trace(*args)
    long_k = att.T * att.MAX_TILES_PER_RANGE  # with the window's 2 tiles, one range would hold too many
    with pytest.raises(ValueError, match="entry ids fit in shared memory.*pass splits >= 2"):
        jax.jit(lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, splits=1)).trace(
            *args[:6], s((b, long_k), jnp.int32), args[7])


def test_warpgroup_registers_fit_what_the_launch_holds():
    """setmaxnreg counts (multiples of 8 in [24, 256]) whose sum is past the launch's 168 a thread over the three
    warpgroups make an increase wait forever: the call hangs on the GPU (232 / 208 / 72 did)."""
    regs = att.REGISTERS
    launch = 65536 // (128 * len(regs)) // 8 * 8  # a thread's registers at launch: 168 for three warpgroups
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs) and sum(regs) <= len(regs) * launch


def test_default_splits_fill_the_gpu_with_no_empty_range():
    for b in (1, 2, 3, 8, 16, 33, 64, 200):
        for tiles in (1, 2, 6, 10, 11, 40):
            s = att.default_splits(b, tiles)
            per = -(-tiles // s)
            assert 1 <= s <= tiles and (s - 1) * per < tiles  # the last range holds a tile
            assert per <= att.MAX_TILES_PER_RANGE  # its entry ids fit in shared memory
            if tiles <= att.MAX_TILES_PER_RANGE:
                assert b * s <= max(132, b)  # one wave of CTAs
    assert att.default_splits(64, 10) == 2 and att.default_splits(8, 10) == 10  # the bench's 128 + 512 keys


@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel runs on an H100/H200")
@pytest.mark.parametrize("b,w,n,k,splits,merged", [(3, 128, 300, 512, 1, None), (3, 128, 3000, 512, 2, None),
                                                    (5, 64, 2000, 300, 4, True), (4, 128, 3000, 512, 8, True),
                                                    (4, 64, 3000, 128, 8, True), (2, 128, 3000, 512, None, None),
                                                    (3, 64, 2000, 300, 9, None), (3, 128, 300, 512, 3, None)])
def test_matches_the_reference(b, w, n, k, splits, merged):
    """Key ranges merged inside their cluster (each CTA owning 64 / S rows, the others' sent through distributed
    shared memory): one, two (the default up to MERGED_SPLITS), 4 over 6 tiles, 8 over 10, 8 over 3 (5 empty);
    partials merged by `gpu_attention.combine` (the default at 2 sequences: 10 ranges; 9 over 6 tiles, 3 empty;
    3, which no cluster merge takes)."""
    q, window, valid, entries, idx, sink = _attention_case(splits or 0, b, att.H, att.D, w, n, k)
    scale = att.D ** -0.5
    ref = attention_ref(q, window, valid, entries, idx, sink, scale)
    out = att.sparse_attention_wgmma(q, window["values"], window["scales"], valid, entries["values"],
                                     entries["scales"], idx, sink, scale, splits=splits, merged=merged)
    np.testing.assert_array_equal(out[0], 0.0)
    for i in range(1, b):
        err = float(jnp.linalg.norm(out[i] - ref[i]) / jnp.linalg.norm(ref[i]))
        assert err < 5e-3, (i, err)


@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel runs on an H100/H200")
@pytest.mark.parametrize("b,w,n,k,splits,merged", [(3, 128, 300, 512, 1, None), (5, 64, 2000, 300, 4, True),
                                                    (3, 64, 2000, 300, 9, None), (3, 128, 3000, 512, 2, False)])
def test_the_prefetch_changes_no_output(b, w, n, k, splits, merged):
    """The L2 prefetch (its id loads clamped into idx, the first tile's rows and q first) leaves the output exactly
    as without it: one range (window tiles first, then entry tiles), 4 ranges merged, more ranges than tiles,
    partials."""
    q, window, valid, entries, idx, sink = _attention_case(splits, b, att.H, att.D, w, n, k)
    run = lambda **kw: att.sparse_attention_wgmma(q, window["values"], window["scales"], valid, entries["values"],  # noqa: E731
                                                  entries["scales"], idx, sink, att.D ** -0.5, splits=splits,
                                                  merged=merged, **kw)
    np.testing.assert_array_equal(run(skip=("prefetch",)), run())


@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernel runs on an H100/H200")
@pytest.mark.parametrize("splits,merged,out_dtype", [(2, None, jnp.bfloat16), (2, None, jnp.float32),
                                                     (1, None, jnp.bfloat16), (3, False, jnp.bfloat16),
                                                     (None, None, jnp.bfloat16)])
def test_output_unrotated(splits, merged, out_dtype):
    """With unrotate, the merged form (turned and cast by the merging kernel itself, to bf16 and to f32; one range
    and two) and the partials (padded to `range_rows`, merged and turned by `gpu_attention.combine_unrotated`; 10
    ranges by default at 2 sequences) give `unrotated` of the plain output in out_dtype."""
    b = 2
    q, window, valid, entries, idx, sink = _attention_case(5, b, att.H, att.D, 128, 3000, 512)
    ang = jnp.linspace(0.0, 40.0, b * 32).reshape(b, 32)
    cos = jnp.concatenate([jnp.ones((b, att.D // 2 - 32)), jnp.cos(ang)], -1)
    sin = jnp.concatenate([jnp.zeros((b, att.D // 2 - 32)), jnp.sin(ang)], -1)
    run = lambda **kw: att.sparse_attention_wgmma(q, window["values"], window["scales"], valid, entries["values"],  # noqa: E731
                                                  entries["scales"], idx, sink, att.D ** -0.5, splits=splits,
                                                  merged=merged, **kw)
    plain, out = run(), run(unrotate=(cos, sin), out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref = gpu_attention.unrotated(plain, cos, sin)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2.0 ** -8, atol=1e-6 * float(jnp.abs(ref).max()))
