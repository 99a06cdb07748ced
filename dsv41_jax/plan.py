"""The CSA2 layer plan: what each layer computes and whose caches it reads.

This is the one place that decides a layer's mode. It is derived from the config, never hard-coded:

- WINDOW  (ratio 0): sliding window only; no compressor, no indexer.
- FULL    (a kv source): compresses its own main KV (the 512-d latent), projects its own indexer keys
  from that latent, runs its own indexer query and top-k.
- REINDEX (an index source that is not a kv source): reads the latest preceding source's main KV and
  indexer keys; its own indexer query and top-k (inside the candidate pool when one is active).
- REUSE   (every other compressing layer): reads the latest preceding source's main KV and the top-k
  of the latest preceding index source; no indexer at all.

Every layer keeps its own query, window KV ring, output projection and sink, whatever its mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv41_jax.config import ModelConfig


class Mode(str, Enum):
    WINDOW = "window"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    mode: Mode
    ratio: int  # 0 for WINDOW
    kv_source: int  # layer whose compressed main KV / index keys this layer reads (-1: none)
    topk_source: int  # layer whose top-k indices this layer uses (-1: none)
    source_slot: int  # position of kv_source among the kv sources (index into the cache's sources)
    is_candidate_source: bool  # publishes the candidate-block pool
    uses_candidates: bool  # scores only inside the candidate pool
    rope_theta: float
    yarn: bool  # YaRN frequency scaling (compressing layers only)

    @property
    def has_indexer(self) -> bool:
        return self.mode in (Mode.FULL, Mode.REINDEX)

    @property
    def compresses(self) -> bool:
        return self.mode is Mode.FULL


@lru_cache(maxsize=64)
def build_plan(cfg: "ModelConfig") -> tuple[LayerPlan, ...]:
    """Derive the per-layer plan. Raises ValueError naming the field and layer of an inconsistency.

    Computed once per config: `ModelConfig` is frozen and hashable, equal configs share one plan (an
    immutable tuple), so every caller -- model construction, cache sizing, the api's checks -- asks here
    instead of keeping its own copy."""
    n = cfg.n_layers
    ratios = cfg.compress_ratios[:n]
    kv_src, idx_src = tuple(cfg.kv_source_layers), tuple(cfg.index_source_layers)

    def bad(msg: str) -> ValueError:
        return ValueError(f"invalid ModelConfig: {msg}")

    for field, layers in (("kv_source_layers", kv_src), ("index_source_layers", idx_src)):
        if list(layers) != sorted(set(layers)):
            raise bad(f"{field}={list(layers)} must be strictly increasing")
        for l in layers:
            if not 0 <= l < n:
                raise bad(f"{field} names layer {l}, outside 0..{n - 1} (n_layers={n})")
            if ratios[l] == 0:
                raise bad(f"{field} names layer {l}, whose compress_ratios entry is 0 (window-only)")
    for l, m in enumerate(ratios):
        if m < 0:
            raise bad(f"compress_ratios[{l}]={m} is negative")
    for l in kv_src:
        if l not in idx_src:
            raise bad(f"kv_source_layers has layer {l}, which is not in index_source_layers: a kv source "
                      "must publish the indexer keys its dependants read")
    cand = cfg.candidate_source_layer
    if cand >= 0:
        if cand >= n:
            raise bad(f"candidate_source_layer={cand} is outside 0..{n - 1}")
        if cand not in kv_src:
            raise bad(f"candidate_source_layer={cand} must be one of kv_source_layers={list(kv_src)}")
        if cfg.candidate_block_size <= 0 or cfg.candidate_topk_blocks <= 0:
            raise bad("candidate_block_size and candidate_topk_blocks must be positive when "
                      f"candidate_source_layer={cand}")

    plans = []
    last_kv, last_idx = -1, -1
    for l in range(n):
        m = ratios[l]
        theta, yarn = (cfg.compress_rope_theta, cfg.original_seq_len > 0) if m else (cfg.rope_theta, False)
        if m == 0:
            plans.append(LayerPlan(l, Mode.WINDOW, 0, -1, -1, -1, False, False, theta, yarn))
            continue
        if l in kv_src:
            mode, last_kv, last_idx = Mode.FULL, l, l
        elif l in idx_src:
            mode, last_idx = Mode.REINDEX, l
        else:
            mode = Mode.REUSE
        if last_kv < 0:
            raise bad(f"layer {l} ({mode.value}, compress_ratios[{l}]={m}) comes before any kv source "
                      f"(kv_source_layers={list(kv_src)})")
        if ratios[last_kv] != m:
            raise bad(f"compress_ratios[{l}]={m} differs from its kv source layer {last_kv}'s ratio "
                      f"{ratios[last_kv]}")
        plans.append(LayerPlan(
            layer=l, mode=mode, ratio=m, kv_source=last_kv, topk_source=last_idx,
            source_slot=kv_src.index(last_kv),
            is_candidate_source=(l == cand),
            uses_candidates=(mode is not Mode.REUSE and 0 <= cand < l),
            rope_theta=theta, yarn=yarn,
        ))
    return tuple(plans)


def encoder_depth(plan: tuple[LayerPlan, ...]) -> int:
    """Layers [0, encoder_depth) must see every prompt token: up to and including the last kv source.

    The layers after it publish no global KV (their compressed entries come from that source), so a
    prompt's tokens before its last window reach them only through their window rings; this is what
    decoder-side bounded prefill skips. len(plan) when no layer publishes global KV.
    """
    return max((p.layer + 1 for p in plan if p.mode is Mode.FULL), default=len(plan))


def describe(plan: tuple[LayerPlan, ...]) -> str:
    """One line per layer, for logs and the README."""
    rows = []
    for p in plan:
        extra = ""
        if p.mode is not Mode.WINDOW:
            extra = f" m={p.ratio} kv<-{p.kv_source} topk<-{p.topk_source}"
            if p.is_candidate_source:
                extra += " candidate-source"
            if p.uses_candidates:
                extra += " in-pool"
        rows.append(f"layer {p.layer:2d}: {p.mode.value:7s}{extra}")
    return "\n".join(rows)
