"""Rotary embeddings on the trailing `rope_dim` channels, interleaved adjacent pairs, optional YaRN.

As in the release: window-only layers rotate with theta = 1e4 and no YaRN; compressing layers rotate
everything (query, window KV, compressed entries, indexer q/k) with compress_rope_theta and YaRN.
YaRN here only reshapes the frequencies (no attention-temperature factor), as the release does.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np


@lru_cache(maxsize=None)
def inv_frequencies(rope_dim: int, theta: float, yarn: bool, original_seq_len: int, factor: float,
                    beta_fast: int, beta_slow: int) -> np.ndarray:
    """f32 [rope_dim // 2] angular frequency of each rotated pair."""
    freqs = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float32) / rope_dim))
    freqs = freqs.astype(np.float32)
    if yarn and original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
        smooth = (1 - ramp).astype(np.float32)
        freqs = (freqs / np.float32(factor) * (1 - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the last `2 * len(inv_freq)` channels of x by position.

    x: [B, T, D] or [B, T, H, D]; pos: [B, T] int (absolute token positions). Returns x's dtype.
    Pairs are (2i, 2i+1) of the rotated tail, taken as complex numbers; `inverse` conjugates.
    """
    rd = 2 * len(inv_freq)
    ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, rd/2]
    if x.ndim == 4:
        ang = ang[:, :, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], x[..., -rd:].astype(jnp.float32)
    re, im = tail[..., 0::2], tail[..., 1::2]
    rot = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rot.astype(x.dtype)], axis=-1)


def pair_angles(pos: jax.Array, inv_freq: np.ndarray, d: int) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) f32 [..., d/2] of `apply_rope`'s rotation of a d-channel row at positions pos [...], per
    channel pair (2p, 2p + 1): the rotated tail's angles (the same values apply_rope computes), cos 1 and sin 0
    for the pairs before it, which it leaves alone. For kernels that undo the rotation in place
    (`kernels_pallas.gpu_attention.unrotated`)."""
    ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    lead = jnp.zeros(pos.shape + (d // 2 - len(inv_freq),), jnp.float32)
    return jnp.concatenate([lead + 1, jnp.cos(ang)], -1), jnp.concatenate([lead, jnp.sin(ang)], -1)
