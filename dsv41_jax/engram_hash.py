"""Engram n-gram hashing, bit-compatible with the release, inside jit and without 64-bit JAX.

Each position hashes the n-grams ending there (sizes 2..max_ngram_size) over *compressed* token ids
(a tokenizer-derived vocabulary; the identity for our random-weight presets). The hash of the
(i+1)-gram is the XOR of token * multiplier over its tokens, reduced modulo one prime per
(n-gram size, head); each (size, head) owns a disjoint, prime-sized range of the layer's table.

The release computes in int64. JAX runs with 32-bit integers by default, so products and XORs are
carried as (hi, lo) uint32 limbs and the modulus is taken `w` bits at a time with r < p < 2^(32-w).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # annotations only: config imports engram_primes from here
    from dsv41_jax.config import ModelConfig


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


@lru_cache(maxsize=None)
def engram_primes(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int):
    """[layer][ngram size - 2][head] bucket moduli: successive primes above vocab_size - 1, never reused."""
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_n = []
        for _ in range(max_ngram - 1):
            sizes, cur = [], vocab_size - 1
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per_n.append(tuple(sizes))
        out.append(tuple(per_n))
    return tuple(out)


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """int64 [n_layers, max_ngram]: odd multipliers from a per-layer seeded RNG, bounded against overflow."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * l).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for l in layer_ids]
    return np.stack(rows)


@dataclass(frozen=True)
class EngramHashLayout:
    """Static hash parameters of all Engram layers (numpy, derived from the config)."""

    primes: np.ndarray  # int64 [L, n-1, heads]
    offsets: np.ndarray  # int64 [L, (n-1)*heads], start row of each (size, head) range
    mult_hi: np.ndarray  # uint32 [L, n]
    mult_lo: np.ndarray  # uint32 [L, n]
    max_ngram: int
    chunk_bits: int  # bits folded per modular step

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "EngramHashLayout":
        primes = np.array(engram_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                        cfg.engram_vocab_size), dtype=np.int64)
        flat = primes.reshape(len(cfg.engram_layer_ids), -1)
        offsets = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], 1)
        mult = hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size)
        mult_u = mult.astype(np.uint64)
        pmax = int(primes.max())
        if pmax >= 2**31:
            raise ValueError(f"engram prime {pmax} too large for 32-bit modular reduction")
        chunk_bits = 1 << ((32 - pmax.bit_length()).bit_length() - 1)  # power of two <= spare bits
        chunk_bits = min(chunk_bits, 16)
        return cls(primes=primes, offsets=offsets,
                   mult_hi=(mult_u >> np.uint64(32)).astype(np.uint32),
                   mult_lo=(mult_u & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                   max_ngram=cfg.engram_max_ngram_size, chunk_bits=chunk_bits)


def _mul_u32(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Full 64-bit product of two uint32 arrays as (hi, lo) uint32."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    lo = (p00 & 0xFFFF) | (mid << 16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, lo


def _mod_u64(hi: jax.Array, lo: jax.Array, p: jax.Array, chunk_bits: int) -> jax.Array:
    """(hi * 2^32 + lo) mod p for uint32 limbs, folding `chunk_bits` (a power of two) bits per step.

    Needs p < 2^(32 - chunk_bits) so that (r << chunk_bits) | chunk fits in 32 bits.
    """
    r = jnp.zeros_like(hi)
    mask = jnp.uint32((1 << chunk_bits) - 1)
    for word in (hi, lo):
        for shift in range(32 - chunk_bits, -1, -chunk_bits):
            r = ((r << chunk_bits) | ((word >> shift) & mask)) % p
    return r


def ngram_hash_ids(layout: EngramHashLayout, tokens_btn: jax.Array) -> jax.Array:
    """Table rows for every Engram layer.

    tokens_btn: int32 [B, T, max_ngram] compressed ids, column i = the token i positions back (pad
    id where there is no history). Returns int32 [B, T, L, (max_ngram-1) * heads].
    """
    t = tokens_btn.astype(jnp.uint32)[:, :, None, :]  # [B, T, 1, n]
    hi_t, lo_t = _mul_u32(t, jnp.asarray(layout.mult_lo))
    hi_t = hi_t + t * jnp.asarray(layout.mult_hi)  # [B, T, L, n]
    primes = jnp.asarray(layout.primes.astype(np.uint32))  # [L, n-1, heads]
    roll_hi, roll_lo = hi_t[..., 0], lo_t[..., 0]
    out = []
    for i in range(1, layout.max_ngram):
        roll_hi, roll_lo = roll_hi ^ hi_t[..., i], roll_lo ^ lo_t[..., i]
        p = primes[:, i - 1, :]  # [L, heads]
        out.append(_mod_u64(roll_hi[..., None], roll_lo[..., None], p, layout.chunk_bits))
    ids = jnp.concatenate(out, axis=-1).astype(jnp.int32)  # [B, T, L, (n-1)*heads]
    return ids + jnp.asarray(layout.offsets.astype(np.int32))


def ngram_windows(tokens_bt: jax.Array, history_bh: jax.Array, pad_id: int, max_ngram: int) -> jax.Array:
    """[B, T, max_ngram] look-back windows over (history ++ tokens); column i = i positions back.

    history_bh: int32 [B, max_ngram-1] the previous tokens, oldest first, -1 where the sequence had
    not started (those become pad_id, as do slots before the start).
    """
    full = jnp.concatenate([history_bh, tokens_bt], axis=1)  # [B, H + T]
    h = history_bh.shape[1]
    t = tokens_bt.shape[1]
    cols = []
    blocked = jnp.zeros(tokens_bt.shape, bool)
    for shift in range(max_ngram):
        src = jax.lax.dynamic_slice_in_dim(full, h - shift, t, axis=1)
        blocked = blocked | (src < 0)
        cols.append(jnp.where(blocked, pad_id, src))
    return jnp.stack(cols, axis=-1)


def advance_history(history_bh: jax.Array, tokens_bt: jax.Array, n_new_b: jax.Array) -> jax.Array:
    """The history [B, H] after appending the first n_new_b[b] of tokens_bt (compressed ids) to each row."""
    full = jnp.concatenate([history_bh, tokens_bt], axis=1)
    keep = n_new_b[:, None] + jnp.arange(history_bh.shape[1])
    return jnp.take_along_axis(full, keep, axis=1)


def reference_hash_ids_np(layout: EngramHashLayout, windows: np.ndarray) -> np.ndarray:
    """int64 numpy version (the release's arithmetic), for tests."""
    mult = (layout.mult_hi.astype(np.uint64) << np.uint64(32)) | layout.mult_lo.astype(np.uint64)
    prods = windows.astype(np.int64)[:, :, None, :] * mult.astype(np.int64)
    roll = prods[..., 0]
    out = []
    for i in range(1, layout.max_ngram):
        roll = roll ^ prods[..., i]
        out.append(roll[..., None] % layout.primes[:, i - 1])
    return np.concatenate(out, -1) + layout.offsets
