"""FP4 / FP8 formats of the KV cache: the byte layout lives here and only here.

Formats (SPEC section 3 and 6):

| record          | values                                 | scales                              | bytes (D) |
|-----------------|----------------------------------------|-------------------------------------|-----------|
| main KV entry   | FP4 E2M1, 2 per byte, low nibble = even | E4M3 per 16 channels (amax / 6)     | D/2 + D/16 |
| indexer key     | FP4 E2M1 packed (or Hopper's words)     | E8M0 per 32 (2^ceil(log2(amax/6)))  | D/2 + D/32 |
| window KV       | FP8 E4M3 (one byte)                     | E8M0 per 32 (2^ceil(log2(amax/448)))| D + D/32   |

Hopper's words (`SM90_WORD_BITS`, `INDEX_KEY_SM90`) hold the same codes in the same bytes, each 32-bit word's
bits placed for the H100/H200 scan's decode.

Every array is stored as `uint8` (GPU_NOTES: fp4 arrays report 1 byte/element and cannot be loaded by
Pallas on Hopper; byte counts must come from real arrays). E4M3 bytes are the raw fp8 bit patterns;
E8M0 bytes are the biased exponent (value = 2^(byte - 127)).

Decoding goes through lookup tables on the stored bytes, never through a float cast round trip, so
XLA's excess-precision pass cannot silently drop a quantize-dequantize (GPU_NOTES gotcha).
Quantization follows the released kernels: round to nearest even, FP4 clamped to +-6, FP8 to +-448.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0

# E2M1 value of each 4-bit code (bit 3 = sign).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# Round-to-nearest-even boundaries between consecutive magnitudes; at an exact tie the result goes
# up only when the upper code is even (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0).
_FP4_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_FP4_TIE_UP = np.array([False, True, False, True, False, True, False])
# E4M3 value of each byte (NaN for 0x7f / 0xff).
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# ----------------------------------------------------------------------------- scalar formats
def fp4_codes(v: jax.Array) -> jax.Array:
    """f32 -> 4-bit E2M1 codes (uint8, bit 3 = sign): RNE, saturating at +-6, NaN -> -0.

    Same results as a float4_e2m1fn cast (what GPU_NOTES records), without relying on one.
    """
    mag = jnp.abs(v)[..., None]
    code = jnp.sum(mag > _FP4_MIDS, axis=-1) + jnp.sum((mag == _FP4_MIDS) & _FP4_TIE_UP, axis=-1)
    sign = jnp.signbit(v).astype(jnp.uint8) << 3
    return jnp.where(jnp.isnan(v), jnp.uint8(8), code.astype(jnp.uint8) | sign)


def fp4_decode(codes: jax.Array) -> jax.Array:
    """4-bit codes (uint8) -> f32 values."""
    return jnp.asarray(FP4_VALUES)[codes.astype(jnp.int32)]


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., 2n] -> uint8 [..., n]; element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., n] -> codes [..., 2n] (inverse of `pack_nibbles`)."""
    lo, hi = packed & 0x0F, packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# Hopper's word layout of packed FP4 codes (the indexer keys' on sm_90: `Fp4Codec(word_layout="sm90")`). A
# little-endian 32-bit word of `pack_nibbles` holds codes c < 8 (bits 4c .. 4c + 3: mantissa, e0, e1, sign);
# SM90_WORD_BITS[4c + k] is where bit k of code c sits in the stored word instead. The wgmma scan's decode
# (`kernels_pallas.gpu_indexer_wgmma.SM90_DECODE_PTX`) wants each bf16 lane as sign << 15 | e1 e0 m << 6, code
# pairs (3, 7), (2, 6), (1, 5), (0, 4) in its four outputs: here the first pair already sits at bits 6..8 and 15
# of each 16-bit half, the next two pairs 3 and 6 bits below (one rotate each), the last pair scattered where an
# integer multiply's three copies put them (a mask, a multiply, a mask): 12 instructions a word where the
# released nibbles take 17 (docs/BENCHMARKS.md, fifty-first session). Same bytes, same codes, one bijection.
SM90_WORD_BITS = np.array([30, 26, 27, 29, 0, 1, 2, 9, 3, 4, 5, 12, 6, 7, 8, 15,
                           14, 10, 11, 13, 16, 17, 18, 25, 19, 20, 21, 28, 22, 23, 24, 31])


WORD_LAYOUTS = ("nibbles", "sm90")  # `Fp4Codec.word_layout`: the released nibbles, Hopper's words


def move_bits(word: jax.Array, src, dest) -> jax.Array:
    """uint32 word's bits src[i] placed at bits dest[i], every other bit 0: one mask and shift per distinct
    distance (jnp; also inside kernels)."""
    src, dist = np.asarray(src), np.asarray(dest) - np.asarray(src)
    out = None
    for d in sorted(set(dist.tolist())):
        part = word & jnp.uint32(sum(1 << int(b) for b in src[dist == d]))
        part = part << d if d >= 0 else part >> -d
        out = part if out is None else out | part
    return out


def _permute_word_bits(packed: jax.Array, dest: np.ndarray) -> jax.Array:
    """uint8 [..., 4n]: each little-endian 32-bit word's bit i moved to bit dest[i]."""
    if packed.shape[-1] % 4:
        raise ValueError(f"the sm90 word layout needs whole 32-bit words: last dim {packed.shape[-1]} % 4 != 0")
    b = packed.reshape(*packed.shape[:-1], -1, 4).astype(jnp.uint32)
    out = move_bits(b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24), np.arange(32), dest)
    return jnp.stack([(out >> (8 * i)) & 0xFF for i in range(4)], -1).astype(jnp.uint8).reshape(packed.shape)


def to_sm90_words(packed: jax.Array) -> jax.Array:
    """`pack_nibbles` bytes [..., 4n] -> the same codes in Hopper's word layout (SM90_WORD_BITS)."""
    return _permute_word_bits(packed, SM90_WORD_BITS)


def from_sm90_words(stored: jax.Array) -> jax.Array:
    """Inverse of `to_sm90_words`."""
    return _permute_word_bits(stored, np.argsort(SM90_WORD_BITS))


def e8m0_scale(amax: jax.Array, max_value: float) -> tuple[jax.Array, jax.Array]:
    """Power-of-two scale 2^ceil(log2(amax / max_value)), computed on the f32 bits as the release does.

    Returns (scale f32, biased exponent uint8). `amax` must be positive and finite.
    """
    x = amax.astype(jnp.float32) * jnp.float32(1.0 / max_value)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    exp = jnp.clip(exp, 1, 254)
    scale = jax.lax.bitcast_convert_type(exp << 23, jnp.float32)
    return scale, exp.astype(jnp.uint8)


def e8m0_decode(exp: jax.Array) -> jax.Array:
    """Biased exponent bytes -> f32 power of two."""
    return jax.lax.bitcast_convert_type(exp.astype(jnp.int32) << 23, jnp.float32)


def e4m3_encode(x: jax.Array) -> jax.Array:
    """f32 -> E4M3 bit pattern (uint8), RNE, saturating at +-448 (a bare cast would give NaN)."""
    q = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def e4m3_decode(b: jax.Array) -> jax.Array:
    return jnp.asarray(E4M3_VALUES)[b.astype(jnp.int32)]


# ----------------------------------------------------------------------------- record codecs
def _groups(x: jax.Array, block: int) -> jax.Array:
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the scale block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)


@dataclass(frozen=True)
class Fp4Codec:
    """FP4 E2M1 values, packed two per byte, one scale per `block` channels (E4M3 or E8M0); word_layout
    "nibbles" as released (`pack_nibbles`), "sm90" the same codes in Hopper's word layout (`to_sm90_words`)."""

    block: int
    scale_format: str  # "e4m3" | "e8m0"
    word_layout: str = "nibbles"  # "nibbles" | "sm90"

    def __post_init__(self):
        if self.word_layout not in WORD_LAYOUTS:
            raise ValueError(f"Fp4Codec word_layout must be one of {WORD_LAYOUTS}, got {self.word_layout!r}")

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        g = _groups(x, self.block)
        amax = jnp.max(jnp.abs(g), axis=-1)
        if self.scale_format == "e4m3":
            # keep an all-zero group's scale nonzero; scale = amax/6 rounded to E4M3
            s_bytes = e4m3_encode(jnp.maximum(amax, 6 * 2.0**-9) / FP4_MAX)
            scale = e4m3_decode(s_bytes)
        else:
            scale, s_bytes = e8m0_scale(jnp.maximum(amax, 6 * 2.0**-126), FP4_MAX)
        v = jnp.clip(g / scale[..., None], -FP4_MAX, FP4_MAX)
        packed = pack_nibbles(fp4_codes(v).reshape(x.shape))
        return {"values": to_sm90_words(packed) if self.word_layout == "sm90" else packed, "scales": s_bytes}

    def decode(self, rec: dict[str, jax.Array], dtype=jnp.float32) -> jax.Array:
        packed = from_sm90_words(rec["values"]) if self.word_layout == "sm90" else rec["values"]
        codes = unpack_nibbles(packed)
        vals = fp4_decode(codes)
        vals = vals.reshape(*vals.shape[:-1], -1, self.block)
        scale = e4m3_decode(rec["scales"]) if self.scale_format == "e4m3" else e8m0_decode(rec["scales"])
        return (vals * scale[..., None]).reshape(codes.shape).astype(dtype)

    def shapes(self, lead: tuple[int, ...], dim: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"values": jax.ShapeDtypeStruct((*lead, dim // 2), jnp.uint8),
                "scales": jax.ShapeDtypeStruct((*lead, dim // self.block), jnp.uint8)}

    def bytes_per_record(self, dim: int) -> int:
        return dim // 2 + dim // self.block


@dataclass(frozen=True)
class Fp8Codec:
    """FP8 E4M3 values (one byte each), one E8M0 scale per `block` channels."""

    block: int = 32

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        g = _groups(x, self.block)
        amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1), 1e-4)
        scale, s_bytes = e8m0_scale(amax, FP8_MAX)
        q = e4m3_encode(g / scale[..., None]).reshape(x.shape)
        return {"values": q, "scales": s_bytes}

    def decode(self, rec: dict[str, jax.Array], dtype=jnp.float32) -> jax.Array:
        vals = e4m3_decode(rec["values"])
        vals = vals.reshape(*vals.shape[:-1], -1, self.block) * e8m0_decode(rec["scales"])[..., None]
        return vals.reshape(rec["values"].shape).astype(dtype)

    def shapes(self, lead: tuple[int, ...], dim: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"values": jax.ShapeDtypeStruct((*lead, dim), jnp.uint8),
                "scales": jax.ShapeDtypeStruct((*lead, dim // self.block), jnp.uint8)}

    def bytes_per_record(self, dim: int) -> int:
        return dim + dim // self.block


@dataclass(frozen=True)
class RawCodec:
    """Unquantized storage (cache quantization switched off): the values as they are."""

    dtype: str = "float32"

    def encode(self, x: jax.Array) -> dict[str, jax.Array]:
        return {"values": x.astype(self.dtype)}

    def decode(self, rec: dict[str, jax.Array], dtype=jnp.float32) -> jax.Array:
        return rec["values"].astype(dtype)

    def shapes(self, lead: tuple[int, ...], dim: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"values": jax.ShapeDtypeStruct((*lead, dim), jnp.dtype(self.dtype))}

    def bytes_per_record(self, dim: int) -> int:
        return dim * jnp.dtype(self.dtype).itemsize


# The released formats.
MAIN_KV = Fp4Codec(block=16, scale_format="e4m3")
INDEX_KEY = Fp4Codec(block=32, scale_format="e8m0")
INDEX_KEY_SM90 = Fp4Codec(block=32, scale_format="e8m0", word_layout="sm90")  # the same bytes in Hopper's words
WINDOW_KV = Fp8Codec(block=32)


@dataclass(frozen=True)
class CacheFormats:
    main_kv: Fp4Codec | RawCodec
    index_key: Fp4Codec | RawCodec
    window_kv: Fp8Codec | RawCodec


def cache_formats(quantize: bool, dtype: str = "float32", index_layout: str = "nibbles") -> CacheFormats:
    """The released formats (the index keys' words in `index_layout`: "nibbles" as released, "sm90" Hopper's),
    or raw storage in `dtype` when cache quantization is switched off."""
    if quantize:
        return CacheFormats(MAIN_KV, {"nibbles": INDEX_KEY, "sm90": INDEX_KEY_SM90}[index_layout], WINDOW_KV)
    raw = RawCodec(dtype)
    return CacheFormats(raw, raw, raw)


def fake_quant(codec, x: jax.Array) -> jax.Array:
    """Quantize-dequantize `x` through `codec` (what the model sees is what the cache stores)."""
    return codec.decode(codec.encode(x), x.dtype)


def fake_quant_ste(codec, x: jax.Array) -> jax.Array:
    """`fake_quant` with a straight-through gradient (identity), for quantization-aware training."""
    return x + jax.lax.stop_gradient(fake_quant(codec, x) - x)
