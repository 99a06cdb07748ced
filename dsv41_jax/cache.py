"""The decode cache pytree: global KV of every kv source, per-layer window rings, compressor state.

Layout (B sequences, capacity C tokens; formats from dsv41_jax.quant):

- `sources[s]` for the s-th kv source layer (ratio m, N = ceil(C / m) entries):
  `entries`    main KV records [B, N, ...]   (FP4 + E4M3/16: 288 B per 512-d entry)
  `index_keys` indexer key records [B, N, ...] (FP4 + E8M0/32: 68 B per 128-d key)
  `pend_kv`, `pend_score` f32 [B, m, head_dim]: projections of the group still filling up (m > 1).
- `window` records [L, B, W, ...] (FP8 + E8M0/32: 528 B per 512-d row): ring slot r of layer l holds the
  newest position p < length with p % W == r. Positions are implied by `lengths`, never stored.
- `window_start` int32 [L, B]: layer l's ring holds no position below window_start[l, b]; its slots for
  older positions are empty and masked on read. 0 for a ring filled from the first token; larger where
  a layer restarted from an empty ring (it skipped tokens, see `Transformer.forward(layers=)`, or its
  window was rebuilt by bounded replay).
- `ngram_history` int32 [B, max_ngram - 1]: the last tokens (compressed ids), -1 before the start.
- `lengths` int32 [B]: tokens already in the cache per sequence.

Entry j of a ratio-m source stands for tokens [j*m, (j+1)*m) and is reachable from position p once
(j+1)*m <= p+1. Anything stored at or past a sequence's reachable count is garbage by contract (it is
masked on read and overwritten when its group completes), which is what lets batches of unequal
lengths share one fixed-shape update.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsv41_jax import kernels
from dsv41_jax.config import ModelConfig
from dsv41_jax.plan import Mode, build_plan
from dsv41_jax.quant import cache_formats


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SourceCache:
    entries: dict
    index_keys: dict
    pend_kv: jax.Array
    pend_score: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Cache:
    lengths: jax.Array
    window: dict
    window_start: jax.Array
    sources: tuple
    ngram_history: jax.Array

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def replace(self, **kw) -> "Cache":
        return Cache(**{**self.__dict__, **kw})


def formats_of(cfg: ModelConfig):
    return cache_formats(cfg.quantize_cache, "float32" if cfg.dtype == "float32" else "bfloat16",
                         kernels.index_key_layout(cfg))


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> Cache:
    """An empty cache for `batch` sequences of up to `capacity` tokens each (all arrays zero)."""
    if batch <= 0 or capacity <= 0:
        raise ValueError(f"batch and capacity must be positive, got batch={batch}, capacity={capacity}")
    if capacity > cfg.max_seq_len:
        raise ValueError(f"capacity={capacity} exceeds the model's max_seq_len={cfg.max_seq_len}")
    fmt = formats_of(cfg)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    plan = build_plan(cfg)
    sources = []
    for p in plan:
        if p.mode is not Mode.FULL:
            continue
        n = -(-capacity // p.ratio)
        sources.append(SourceCache(
            entries=zeros(fmt.main_kv.shapes((batch, n), cfg.head_dim)),
            index_keys=zeros(fmt.index_key.shapes((batch, n), cfg.index_head_dim)),
            pend_kv=jnp.zeros((batch, p.ratio, cfg.head_dim), jnp.float32),
            pend_score=jnp.zeros((batch, p.ratio, cfg.head_dim), jnp.float32),
        ))
    hist = max(cfg.engram_max_ngram_size - 1, 0) if cfg.engram_layer_ids else 0
    return Cache(
        lengths=jnp.zeros((batch,), jnp.int32),
        window=zeros(fmt.window_kv.shapes((cfg.n_layers, batch, cfg.window_size), cfg.head_dim)),
        window_start=jnp.zeros((cfg.n_layers, batch), jnp.int32),
        sources=tuple(sources),
        ngram_history=jnp.full((batch, hist), -1, jnp.int32),
    )


def cache_capacity(cache: Cache, cfg: ModelConfig) -> int:
    """Token capacity implied by the first source's entry count (or unbounded for window-only models)."""
    plan = [p for p in build_plan(cfg) if p.mode is Mode.FULL]
    if not plan:
        return cfg.max_seq_len
    return cache.sources[0].entries["values"].shape[1] * plan[0].ratio


def _nbytes(tree) -> int:
    return sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def cache_bytes(cache: Cache) -> dict[str, int]:
    """Bytes of each part of a cache (or of its `jax.eval_shape` abstract form)."""
    return {
        "global_main_kv": _nbytes([s.entries for s in cache.sources]),
        "global_index_keys": _nbytes([s.index_keys for s in cache.sources]),
        "window": _nbytes(cache.window),
        "compressor_state": _nbytes([(s.pend_kv, s.pend_score) for s in cache.sources]),
        "other": _nbytes((cache.lengths, cache.window_start, cache.ngram_history)),
    }


def global_bytes_per_token(cfg: ModelConfig, capacity: int = 1 << 16) -> float:
    """Global KV bytes per token, measured from the abstract cache the code would allocate."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, 1, capacity))
    b = cache_bytes(shapes)
    return (b["global_main_kv"] + b["global_index_keys"]) / capacity
