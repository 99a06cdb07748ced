"""FP4 / FP8 cache formats: bit-exact codes, packing, saturation, NaN/zero, bounded error."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import quant


def test_all_fp4_codes_round_trip_against_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    # ml_dtypes' own decoding of each 4-bit pattern
    ml_vals = np.array([float(np.array(c, np.uint8).view(ml_dtypes.float4_e2m1fn)) for c in codes], np.float32)
    np.testing.assert_array_equal(np.asarray(quant.fp4_decode(jnp.asarray(codes))), ml_vals)
    # encoding each value gives its code back (the two zeros keep their sign)
    back = np.asarray(quant.fp4_codes(jnp.asarray(ml_vals)))
    np.testing.assert_array_equal(back, codes)


def test_random_fp4_codes_match_ml_dtypes_cast():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 3, 20000), rng.uniform(-8, 8, 20000),
                        np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -3.5, 6.0, 100.0, -1e9])]).astype(np.float32)
    ours = np.asarray(quant.fp4_codes(jnp.asarray(x)))
    ref = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    np.testing.assert_array_equal(ours, ref)


def test_fp4_saturation_nan_and_zero():
    x = jnp.array([np.inf, -np.inf, 7.0, -1e30, np.nan, 0.0, -0.0], jnp.float32)
    vals = np.asarray(quant.fp4_decode(quant.fp4_codes(x)))
    np.testing.assert_array_equal(vals[:4], [6.0, -6.0, 6.0, -6.0])
    # XLA's own f32 -> fp4 cast turns NaN into -0 (GPU_NOTES); ours does the same
    xla_nan = np.asarray(jnp.array([np.nan], jnp.float32).astype(jnp.float4_e2m1fn).astype(jnp.float32))
    assert vals[4] == 0.0 and np.signbit(vals[4]) and np.signbit(xla_nan[0])
    assert vals[5] == 0.0 and not np.signbit(vals[5])
    assert vals[6] == 0.0 and np.signbit(vals[6])


def test_nibble_order_matches_bitcast():
    rng = np.random.default_rng(1)
    codes = jnp.asarray(rng.integers(0, 16, (5, 32), dtype=np.uint8))
    packed = quant.pack_nibbles(codes)
    f4 = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., n, 2], element 0 = low nibble
    np.testing.assert_array_equal(np.asarray(f4.astype(jnp.float32)).reshape(5, 32),
                                  np.asarray(quant.fp4_decode(codes)))
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(packed)), np.asarray(codes))


def test_e4m3_saturates_and_e8m0_is_power_of_two():
    x = jnp.array([465.0, 1e6, -1e6, 448.0, 1.0], jnp.float32)
    vals = np.asarray(quant.e4m3_decode(quant.e4m3_encode(x)))
    np.testing.assert_array_equal(vals, [448.0, 448.0, -448.0, 448.0, 1.0])
    amax = jnp.array([6.0, 6.1, 3.0, 1e-30], jnp.float32)
    s, e = quant.e8m0_scale(amax, 6.0)
    np.testing.assert_array_equal(np.asarray(s), [1.0, 2.0, 0.5, np.asarray(quant.e8m0_decode(e))[3]])
    assert np.all(np.asarray(s) > 0)  # e8m0 has no zero: the scale never collapses


@pytest.mark.parametrize("codec,dim", [(quant.MAIN_KV, 512), (quant.INDEX_KEY, 128), (quant.WINDOW_KV, 512)])
def test_record_bytes_and_round_trip_bounds(codec, dim):
    rng = np.random.default_rng(2)
    gauss = rng.normal(0, 1, (64, dim)).astype(np.float32)
    # outlier-heavy: a few channels per row 100x larger
    outl = gauss.copy()
    outl[:, rng.integers(0, dim, 4)] *= 100.0
    for x, rel_rms_bound in ((gauss, 0.12), (outl, None)):
        rec = codec.encode(jnp.asarray(x))
        assert sum(int(a.size) for a in rec.values()) == 64 * codec.bytes_per_record(dim)
        assert all(a.dtype == jnp.uint8 for a in rec.values())
        y = np.asarray(codec.decode(rec))
        g = x.reshape(64, -1, codec.block)
        err = np.abs(y - x).reshape(g.shape)
        amax = np.abs(g).max(-1, keepdims=True)
        if isinstance(codec, quant.Fp4Codec):
            # half the widest E2M1 gap (4 -> 6) is 1 scale unit; scale ~ amax/6 (x2 for E8M0 rounding,
            # x(1 + 2^-3) for E4M3 rounding)
            bound = amax / 6 * (2.0 if codec.scale_format == "e8m0" else 1.0 + 2**-3) * 1.0
        else:
            bound = np.maximum(np.abs(g) * 2**-4, amax / 448 * 2 * 2**-9)  # 3 mantissa bits, subnormal floor
        assert np.all(err <= bound + 1e-6), float((err - bound).max())
        if rel_rms_bound is not None:
            rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
            assert rel < rel_rms_bound, rel


def test_raw_codec_is_lossless():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 64)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(quant.fake_quant(quant.RawCodec("float32"), x)), np.asarray(x))


def test_index_keys_in_hopper_words_hold_the_same_bytes_and_values():
    """INDEX_KEY_SM90 stores the released codes with each 32-bit word's bits moved (`SM90_WORD_BITS`): as many
    bytes, the same decoded values, the same bytes once moved back; a layout it does not know is refused."""
    x = jax.random.normal(jax.random.key(5), (3, 7, 128)) * 4
    rel, sm90 = quant.INDEX_KEY.encode(x), quant.INDEX_KEY_SM90.encode(x)
    assert sm90["values"].shape == rel["values"].shape and sm90["values"].dtype == jnp.uint8
    np.testing.assert_array_equal(sm90["scales"], rel["scales"])
    assert not np.array_equal(sm90["values"], rel["values"])
    np.testing.assert_array_equal(quant.from_sm90_words(sm90["values"]), rel["values"])
    np.testing.assert_array_equal(quant.INDEX_KEY_SM90.decode(sm90), quant.INDEX_KEY.decode(rel))
    assert quant.INDEX_KEY_SM90.bytes_per_record(128) == quant.INDEX_KEY.bytes_per_record(128)
    assert quant.cache_formats(True, index_layout="sm90").index_key == quant.INDEX_KEY_SM90
    with pytest.raises(ValueError, match="word_layout"):
        quant.Fp4Codec(block=32, scale_format="e8m0", word_layout="packed")
    with pytest.raises(ValueError, match="whole 32-bit words"):
        quant.to_sm90_words(jnp.zeros((2, 6), jnp.uint8))
