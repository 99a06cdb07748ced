"""The channel-split Hopper sparse attention (`kernels_pallas.gpu_attention_channels`): on a CPU, that it lowers for
CUDA and refuses what it cannot hold; on an H100/H200, its output against `ops.sparse_attention_decode`'s reference
(the wgmma kernel's bound: 5e-3 relative per sequence, a sequence with no valid key exactly zero) and against the
key-split wgmma kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gpu_attention
from kernels_pallas import gpu_attention_channels as ch
from kernels_pallas import gpu_attention_wgmma as att
from kernels_pallas import gpu_wgmma
from tests.test_kernels_gpu import _attention_case, attention_ref

ON_HOPPER = gpu_wgmma.is_hopper()


def _shapes(b, w, n, k):
    s = jax.ShapeDtypeStruct
    return (s((b, att.H, att.D), jnp.float32), s((b, w, att.D), jnp.uint8), s((b, w, att.D // 32), jnp.uint8),
            s((b, w), jnp.bool_), s((b, n, att.D // 2), jnp.uint8), s((b, n, att.D // 16), jnp.uint8),
            s((b, k), jnp.int32), s((att.H,), jnp.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles it for real")
def test_lowers_for_cuda_and_refuses_too_many_tiles():
    b, w, n, k = 2, 128, 300, 512
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()  # noqa: E731
    text = lower(lambda *a: ch.sparse_attention_channels(*a, scale=0.05), *_shapes(b, w, n, k))
    assert "mosaic_gpu" in text and "sparse_attention_channels" in text
    cs = jax.ShapeDtypeStruct((b, att.D // 2), jnp.float32)
    turned = lower(lambda *a: ch.sparse_attention_channels(*a[:8], scale=0.05, unrotate=a[8:], out_dtype=jnp.bfloat16),
                   *_shapes(b, w, n, k), cs, cs)
    assert "sparse_attention_channels" in turned
    long_k = att.T * (ch.MAX_TILES - w // att.T + 1)  # one tile more than the ids' shared memory holds
    with pytest.raises(ValueError, match="at most 32"):
        lower(lambda *a: ch.sparse_attention_channels(*a, scale=0.05), *_shapes(b, w, n, long_k))
    with pytest.raises(ValueError, match="at most 14 in shared memory with ahead=True"):
        lower(lambda *a: ch.sparse_attention_channels(*a, scale=0.05, ahead=True),
              *_shapes(b, w, n, att.T * (ch.MAX_TILES_AHEAD - 1)))
    with pytest.raises(ValueError, match="64 heads|wgmma attention"):
        lower(lambda *a: ch.sparse_attention_channels(*a, scale=0.05), jax.ShapeDtypeStruct((b, 16, att.D), jnp.float32),
              *_shapes(b, w, n, k)[1:])


def test_named_barriers_and_registers_fit():
    """Ids 4.. (0 is the CTA's barrier, 1..3 Mosaic GPU's warpgroups'), at most 16; setmaxnreg counts within what
    the launch holds (`att.REGISTERS`' rule: an increase past it hangs)."""
    ids = [*range(ch.KEYS_READY, ch.KEYS_READY + ch.SLOTS), *range(ch.SLOT_FREE, ch.SLOT_FREE + ch.SLOTS),
           ch.P_READY, ch.P_READY + 1, ch.P_FREE, ch.P_FREE + 1, ch.STATS_READY]
    assert len(set(ids)) == len(ids) and min(ids) >= 4 and max(ids) < 16
    regs = ch.REGISTERS
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs) and sum(regs) <= 3 * (65536 // (128 * 3) // 8 * 8)


def _run(case, **kw):
    q, window, valid, entries, idx, sink = case
    return ch.sparse_attention_channels(q, window["values"], window["scales"], valid, entries["values"],
                                        entries["scales"], idx, sink, att.D ** -0.5, **kw)


@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernels run on an H100/H200")
@pytest.mark.parametrize("b,w,n,k", [(3, 128, 300, 512), (4, 64, 3000, 300), (3, 128, 2000, 64), (2, 64, 5000, 1920)])
def test_matches_the_reference(b, w, n, k):
    """The released window and top-k (2 + 8 tiles), a partial last tile, 3 tiles (fewer than the p slots' reuse),
    32 tiles (MAX_TILES); the logits a tile ahead give the same output bit for bit (same arithmetic, other
    order of waits)."""
    case = _attention_case(b + w + k, b, att.H, att.D, w, n, k)
    q, window, valid, entries, idx, sink = case
    ref = attention_ref(q, window, valid, entries, idx, sink, att.D ** -0.5)
    out = _run(case)
    np.testing.assert_array_equal(out[0], 0.0)
    for i in range(1, b):
        err = float(jnp.linalg.norm(out[i] - ref[i]) / jnp.linalg.norm(ref[i]))
        assert err < 5e-3, (i, err)
    if w // att.T + -(-k // att.T) <= ch.MAX_TILES_AHEAD:
        np.testing.assert_array_equal(_run(case, ahead=True), out)
    keys = att.sparse_attention_wgmma(q, window["values"], window["scales"], valid, entries["values"],
                                      entries["scales"], idx, sink, att.D ** -0.5)
    np.testing.assert_allclose(out, keys, rtol=0, atol=2e-3 * float(jnp.abs(keys).max()))


@pytest.mark.skipif(not ON_HOPPER, reason="the wgmma kernels run on an H100/H200")
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_output_unrotated(out_dtype):
    b = 2
    case = _attention_case(5, b, att.H, att.D, 128, 3000, 512)
    ang = jnp.linspace(0.0, 40.0, b * 32).reshape(b, 32)
    cos = jnp.concatenate([jnp.ones((b, att.D // 2 - 32)), jnp.cos(ang)], -1)
    sin = jnp.concatenate([jnp.zeros((b, att.D // 2 - 32)), jnp.sin(ang)], -1)
    plain, out = _run(case), _run(case, unrotate=(cos, sin), out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref = gpu_attention.unrotated(plain, cos, sin)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2.0 ** -8, atol=1e-6 * float(jnp.abs(ref).max()))
