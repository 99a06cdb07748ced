"""One switch between the plain-jnp reference ops and the Pallas kernels.

`backend` is "jnp" (reference, any device), "pallas" (kernels_pallas; GPU or TPU, or interpret mode
on CPU) or "auto" (Pallas on GPU/TPU when the record formats are the released packed ones, jnp
otherwise). The model passes `ModelConfig.kernels`; users override it with `cfg.replace(kernels=...)`.
"""

from __future__ import annotations

import jax

from dsv41_jax import ops


def resolve(backend: str) -> str:
    if backend not in ("auto", "jnp", "pallas"):
        raise ValueError(f"kernel backend must be auto|jnp|pallas, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "tpu") else "jnp"
    return backend


def indexer_scores_decode(q_bhd, w_bh, key_rec, reachable_b, codec, *, backend="jnp"):
    return ops.indexer_scores_decode(q_bhd, w_bh, key_rec, reachable_b, codec)


def select_topk(scores, k, *, backend="jnp"):
    return ops.select_topk(scores, k)


def candidate_blocks(scores, reachable, n_blocks, block, *, backend="jnp"):
    return ops.candidate_blocks(scores, reachable, n_blocks, block)


def sparse_attention_decode(q_bhd, window_rec, window_valid, window_codec, entry_rec, idx_bk, entry_codec,
                            sink_h, scale, *, backend="jnp"):
    return ops.sparse_attention_decode(q_bhd, window_rec, window_valid, window_codec, entry_rec, idx_bk,
                                       entry_codec, sink_h, scale)
