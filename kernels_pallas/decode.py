"""In-kernel decoders for the packed cache bytes of `dsv41_jax.quant` (shared by GPU and TPU kernels).

Everything here is plain jnp on uint8/int32 values, so it lowers through Triton and Mosaic alike and
runs in interpret mode. None of it casts to fp4 (Hopper cannot; GPU_NOTES).

The FP4 trick: an E2M1 code `c` (bit 3 sign, bits 2..0 magnitude) placed as `sign << 15 | mag << 9`
is the float16 bit pattern of `E2M1(c) * 2**-14`, subnormal 0.5 included (the two formats' exponent
fields line up and both have a subnormal step of half the smallest normal). Two integer ops per
value instead of a 16-entry table, and exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from dsv41_jax.quant import SM90_WORD_BITS, move_bits

FP4_F16_SHIFT = 2.0 ** 14  # fp4_as_f16 returns the E2M1 value times 2**-14


def nibbles(packed_u8: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes -> (low nibble = even element, high nibble = odd element) as int32 codes."""
    b = packed_u8.astype(jnp.int32)
    return b & 0xF, (b >> 4) & 0xF


def fp4_as_f16(code_i32: jax.Array) -> jax.Array:
    """E2M1 codes (int32 0..15) -> float16 holding E2M1(code) * 2**-14, exactly."""
    bits = ((code_i32 & 0x8) << 12) | ((code_i32 & 0x7) << 9)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


def sm90_f16(words_u32: jax.Array) -> list[jax.Array]:
    """Words of codes in Hopper's word layout (`quant.SM90_WORD_BITS`; uint32 or int32) -> [float16 of code c of
    each word for c < 8] (code c of word u is channel 8u + c), each E2M1 * 2**-14 as `fp4_as_f16` gives it: the
    code's 4 bits moved to f16 bits 9, 10, 11 (magnitude) and 15 (sign)."""
    w = words_u32.astype(jnp.uint32)
    return [jax.lax.bitcast_convert_type(move_bits(w, SM90_WORD_BITS[4 * c:4 * c + 4], (9, 10, 11, 15))
                                         .astype(jnp.uint16), jnp.float16) for c in range(8)]


def fp4_f32(code_i32: jax.Array) -> jax.Array:
    """E2M1 codes -> float32 values (exact)."""
    return fp4_as_f16(code_i32).astype(jnp.float32) * FP4_F16_SHIFT


def e8m0_f32(exp_u8: jax.Array) -> jax.Array:
    """Biased exponent bytes -> float32 2**(byte - 127) (bytes 1..254; the codecs never write 0/255)."""
    return jax.lax.bitcast_convert_type(exp_u8.astype(jnp.int32) << 23, jnp.float32)


def e4m3_f32(byte_u8: jax.Array) -> jax.Array:
    """E4M3 bit patterns -> float32 (exact; 0x7f/0xff are NaN as in the codec's table)."""
    return jax.lax.bitcast_convert_type(byte_u8.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def ordered_key(x_f32: jax.Array) -> jax.Array:
    """float32 -> int32 whose signed order is the float total order (-inf lowest, -0 < +0).

    That is the order `lax.top_k` uses, so ties and signed zeros resolve the same way.
    """
    bits = jax.lax.bitcast_convert_type(x_f32, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


NEG_INF_KEY = -0x7F800000 - 1  # ordered_key(-inf) = 0x807fffff as int32
EMPTY_KEY = -(2 ** 31)  # below every float: padding that is never selected


def kth_search(keys: jax.Array, k: int, floor) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`kth_key`'s search: (steps taken int32, x, #(keys >= x)); the steps for `experiments.select_steps`."""
    def step(carry):
        i, res, n_ge = carry
        cand = res + jnp.left_shift(jnp.int32(1), 31 - i)
        cnt = jnp.sum((keys >= cand).astype(jnp.int32))
        take = cnt >= k
        return i + 1, jnp.where(take, cand, res), jnp.where(take, cnt, n_ge)

    def searching(carry):
        i, res, n_ge = carry
        return (i < 32) & ((n_ge != k) | (res < floor))

    n_all = jnp.int32(keys.size)  # every lane is >= EMPTY_KEY
    return jax.lax.while_loop(searching, step, (jnp.int32(0), jnp.int32(EMPTY_KEY), n_all))


def kth_key(keys: jax.Array, k: int, floor) -> jax.Array:
    """Over all of `keys` (int32 `ordered_key`s, any shape): the largest x with #(keys >= x) >= k (EMPTY_KEY when
    fewer than k real entries), or a smaller x >= floor with #(keys >= x) == k exactly. The top-k kernels' threshold.

    A bitwise search in the unsigned image of the signed order (adding 2**bit with int32 wrap-around), one count
    (a block reduction) a step. It stops once exactly k keys are at or above its prefix x (and x >= floor):
    {keys >= x} is then the same k entries as {keys >= the k-th largest}, so a threshold x selects the same set;
    distinct scores separate after 13-26 of the 32 bits (rows of 4352, k 512: `python -m experiments.select_steps`),
    ties at the k-th run all 32. As a bound passed down the GPU kernel's levels, x is still at most the row's k-th
    largest, and one above the last bound still clears the entries dropped at it (`gpu_select`'s `complete`): those
    are <= the last bound < x <= the final threshold.
    """
    return kth_search(keys, k, floor)[1]


# -- arithmetic forms for Mosaic TPU, which has no float16 / float8 arithmetic on v5e and older ---------
def fp4_f32_arith(code_i32: jax.Array) -> jax.Array:
    """E2M1 codes -> float32 with f32 arithmetic only: magnitudes 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6."""
    mag = (code_i32 & 0x7).astype(jnp.float32)
    v = 0.5 * mag + 0.5 * jnp.maximum(mag - 4.0, 0.0) + jnp.maximum(mag - 6.0, 0.0)
    return jnp.where((code_i32 & 0x8) != 0, -v, v)


def e4m3_f32_arith(byte_u8: jax.Array) -> jax.Array:
    """E4M3 bytes -> float32 by assembling the f32 bits (subnormals included; 0x7f/0xff are not NaN here,
    the codec never writes them: it saturates at +-448)."""
    x = byte_u8.astype(jnp.int32)
    exp, man = (x >> 3) & 0xF, x & 0x7
    normal = jax.lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
    v = jnp.where(exp == 0, man.astype(jnp.float32) * 2.0 ** -9, normal)
    return jnp.where((x & 0x80) != 0, -v, v)
