"""The prefix cache of an engine: the tiers below HBM and the protocol that reads and writes them.

- after [0, P) of a prompt (P: a page boundary) the global KV of every full page goes to the disk tier
  (`PageStore`) and the window rings at P to the host tier (`window_pool`), both keyed by the chained
  hash of the tokens and images (`tiers.keys.block_chain`): `publish`, for exact states only;
- a later prompt that starts with cached pages loads their global KV instead of recomputing it
  (`restore`); with the window of that prefix in the host pool the state at the prefix is restored
  exactly (same bytes, so greedy tokens equal a cold run), else *bounded replay* (`replay`, on by
  default; off: recompute the whole prompt) recomputes the last window of the prefix on top of the
  cached global KV: lengths = R - W, every window ring empty before R - W (`Cache.window_start`),
  n-gram history recomputed for R - W, prefill of tokens [R - W, R), then the cached (exact) global
  rows of [R - W, R) are put back over the replay's recomputed ones. The pending compressor group is
  empty at R - W because W and the page size are multiples of every ratio. Replay is an approximation
  (the first replayed queries see a window missing its older half; the exact cone grows by a window
  per layer), measured by `experiments.prefix_reuse`. States derived from a replay are never written
  back to either tier.

Pages are the same bytes in either prefill mode; a host-pool entry holds its engine's own state
(bounded or exact), so the two modes keep separate pools. The in-process pool lives and dies with the
engine; with `window_store` (a Redis / Valkey or Mooncake Store URL, `tiers.window_store`) engines of
the same weights and settings (one fingerprint) share it, so a prefix one served is an exact restore
on another. Any problem with a tier (damaged/foreign/expired page, full disk, missing directory) is a
miss and a recompute: the tiers report misses, never raise.

The model work stays with the engine: a replay runs through the `prefill` callable it passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from dsv41_jax import kernels
from dsv41_jax.cache import Cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.images import image_mask
from dsv41_jax.plan import Mode, build_plan
from dsv41_jax.serving import slots as rows
from dsv41_jax.tiers import PageStore, block_chain, fingerprint, window_pool
from dsv41_jax.tiers.keys import weights_digest

if TYPE_CHECKING:  # engine.py imports this module
    from dsv41_jax.serving.engine import EngineConfig


def full_ratios(cfg: ModelConfig) -> tuple[int, ...]:
    """The compression ratio of every kv source (Full layer), in cache order: what a page is cut by."""
    return tuple(p.ratio for p in build_plan(cfg) if p.mode is Mode.FULL)


class PrefixCache:
    """The disk pages and host-pool windows of one engine (weights `params` of `cfg`, settings `ecfg`,
    whose `cache_dir` is set); `empty_row` is a host row of the engine's cache before any token."""

    def __init__(self, cfg: ModelConfig, params, ecfg: EngineConfig, empty_row: Cache):
        self.cfg, self.ecfg, self.empty_row = cfg, ecfg, empty_row
        self.page_tokens = ecfg.page_tokens
        self.ratios = full_ratios(cfg)
        self.replay_ok = ecfg.replay and cfg.window_size % math.lcm(*self.ratios) == 0
        tm = params["engram_token_map"][...] if cfg.engram_layer_ids else None
        self.token_map = None if tm is None else np.asarray(tm)
        self.hist_width = empty_row.ngram_history.shape[1]
        weights = ecfg.weights_revision or weights_digest(jax.tree.leaves(params))
        # the index keys' word layout as resolved here ("auto" differs between an H100 and a TPU)
        self.fp = fingerprint(cfg, weights, ecfg.page_tokens,
                              extra=f"capacity-independent;{self.ratios};index keys {kernels.index_key_layout(cfg)}")
        self.store = PageStore(ecfg.cache_dir, self.fp, ecfg.page_tokens, retention_s=ecfg.retention_s)
        # window states differ between the prefill modes: a shared pool keeps them apart
        mode = "bounded" if ecfg.bounded_prefill else "exact"
        self.host = window_pool(ecfg.window_store, f"{self.fp}-{mode}", ecfg.host_ttl_s, ecfg.host_pool_bytes)
        self.store.gc()

    def keys(self, prefix_ids: np.ndarray, spans=()) -> list[str]:
        """The chain key of every full page of `prefix_ids` (int32 [n]), with the image spans reaching it."""
        images = [(s.start, s.stop, s.image.digest) for s in spans]
        return block_chain(self.fp, prefix_ids, self.page_tokens, images)

    def stats(self) -> dict[str, dict]:
        """The counters of each tier: {"disk": {...}, "host": {...}}."""
        return {"disk": dict(self.store.stats), "host": dict(self.host.stats)}

    def restore(self, ids: np.ndarray, keys: list[str], m: dict, prefill: Callable[[Cache, int, int], Cache],
                enc=()) -> tuple[Cache | None, int, bool]:
        """(device row, reused prefix R, state exact?) from the tiers for prompt `ids` (int32 [n]) whose
        page keys are `keys`; R == 0 (and no row) when nothing is usable. prefill(device row, lo, hi)
        runs tokens [lo, hi) of the prompt onto the row (a bounded replay); `enc`: the encoded image
        spans. Fills the tier metrics of `m` (see `Engine.prefill`)."""
        if not (self.ecfg.prefix_reuse and keys):
            return None, 0, True
        pt, w = self.page_tokens, self.cfg.window_size
        r0 = dict(self.store.stats)
        pages = self.store.lookup(keys)
        m["disk_bytes_read"] = self.store.stats["bytes_read"] - r0.get("bytes_read", 0)
        m["disk_pages_hit"] = len(pages)
        if pages and not rows.pages_match(pages, ids, pt, self.empty_row):
            m["disk_pages_rejected"], pages = len(pages), []
        r = len(pages) * pt
        if r == 0:
            return None, 0, True
        row = rows.fill_from_pages(jax.tree.map(np.copy, self.empty_row), pages, self.ratios, pt)
        snap = self.host.get(keys[len(pages) - 1])
        if snap is not None:
            m["host_window_hit"], m["host_bytes_read"] = True, sum(a.nbytes for a in snap.values())
            row = row.replace(lengths=np.array([r], np.int32), window_start=snap["window_start"],
                              window={k[len("window."):]: v for k, v in snap.items() if k.startswith("window.")},
                              ngram_history=self._history(ids, r, enc))
            m["prefix_path"] = "host_restore"
            return jax.device_put(row), r, True
        if not self.replay_ok or r < w:
            m["disk_pages_unused"] = len(pages)  # no window and no replay: recompute from scratch
            m["prefix_path"] = "recompute"
            return None, 0, True
        row = rows.reset_row(row, r - w).replace(ngram_history=self._history(ids, r - w, enc))
        dev = prefill(jax.device_put(row), r - w, r)
        # the replay recomputed the global rows of [r - w, r) from a partial window: put the exact ones back
        host = rows.fill_from_pages(rows.to_host(dev), pages, self.ratios, pt)
        m["replayed_tokens"], m["prefix_path"] = w, "bounded_replay"
        return jax.device_put(host), r, False

    def _history(self, ids: np.ndarray, n: int, enc=()) -> np.ndarray:
        """int32 [1, hist]: the n-gram history after `n` tokens of `ids` (see `slots.ngram_history_at`)."""
        if self.token_map is None:
            return np.zeros((1, 0), np.int32)
        dead = image_mask(enc, len(ids)) if enc else None  # image positions end every n-gram
        return rows.ngram_history_at(self.token_map, ids, n, self.hist_width, dead)

    def publish(self, row: Cache, ids: np.ndarray, keys: list[str], start: int, split: int, m: dict) -> None:
        """Write the pages of [start, split) of the exact state `row` (a device row) and its window at
        `split` to the tiers; fills the write metrics of `m`."""
        pt = self.page_tokens
        host = rows.to_host(row)
        w0 = self.store.stats["bytes_written"]
        for k in range(start // pt, split // pt):
            if not self.store.put(keys[k], k * pt, rows.page_arrays(host, self.ratios, ids, k * pt, pt)):
                break  # a failed write (e.g. full disk): later pages would not be reachable anyway
        m["disk_bytes_written"] = self.store.stats["bytes_written"] - w0
        snap = {f"window.{k}": v for k, v in host.window.items()} | {"window_start": host.window_start}
        if self.host.put(keys[split // pt - 1], snap):
            m["host_bytes_written"] = sum(a.nbytes for a in snap.values())
