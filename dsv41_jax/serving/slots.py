"""One sequence's row of a batched cache: take it out, put it back, and convert it to and from pages.

A row is a `Cache` of batch 1. The batch axis is 0 everywhere except the window rings ([L, B, W, ...])
and their start positions ([L, B]), where it is 1. Moving rows with a traced slot index keeps one
compiled program for every slot.

Page arrays (numpy, what the disk tier stores for the tokens [k*P, (k+1)*P) of a prefix):
  "s{i}.entries.{leaf}", "s{i}.index_keys.{leaf}"  rows [k*P/m_i, (k+1)*P/m_i) of kv source i (ratio m_i)
  "tokens"                                        int32 [P], checked on load against the request
Compressor pending state is not stored: at a page boundary every source's group is complete
(P is a multiple of every ratio), so the forward never reads it. The n-gram history is a function of
the last tokens, so it is recomputed from them (`ngram_history_at`), exactly as the forward builds it.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from dsv41_jax.cache import Cache, SourceCache


def _axes(cache: Cache) -> Cache:
    """The batch axis of every leaf, as a Cache-shaped pytree of ints."""
    zero = lambda t: jax.tree.map(lambda _: 0, t)
    return Cache(lengths=0, window=jax.tree.map(lambda _: 1, cache.window), window_start=1,
                 sources=zero(cache.sources), ngram_history=0)


@jax.jit
def take_row(cache: Cache, slot) -> Cache:
    return jax.tree.map(lambda a, ax: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=ax), cache, _axes(cache))


@partial(jax.jit, donate_argnums=0)
def put_row(cache: Cache, slot, row: Cache) -> Cache:
    return jax.tree.map(lambda a, r, ax: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=ax),
                        cache, row, _axes(cache))


@partial(jax.jit, donate_argnums=0)
def put_window_row(window: dict, slot, row: dict) -> dict:
    """DSpark draft rings ([stages, B, W, ...], `api.init_draft_window`) with slot `slot` replaced by `row`
    (batch 1)."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=1),
                        window, row)


def to_host(row: Cache) -> Cache:
    return jax.tree.map(lambda a: np.array(a), row)


def page_arrays(row: Cache, ratios: tuple[int, ...], tokens: np.ndarray, start: int, page_tokens: int) -> dict:
    """The page for tokens [start, start + page_tokens) of a host row (see the module docstring)."""
    out = {}
    for i, (src, m) in enumerate(zip(row.sources, ratios)):
        lo, hi = start // m, (start + page_tokens) // m
        for part in ("entries", "index_keys"):
            for leaf, a in getattr(src, part).items():
                out[f"s{i}.{part}.{leaf}"] = a[0, lo:hi]
    out["tokens"] = np.asarray(tokens[start:start + page_tokens], np.int32)
    return out


def fill_from_pages(row: Cache, pages: list[dict], ratios: tuple[int, ...], page_tokens: int) -> Cache:
    """A host row whose global KV rows [0, len(pages) * page_tokens) come from `pages` (in place)."""
    for k, page in enumerate(pages):
        for i, (src, m) in enumerate(zip(row.sources, ratios)):
            lo, hi = k * page_tokens // m, (k + 1) * page_tokens // m
            for part in ("entries", "index_keys"):
                for leaf, a in getattr(src, part).items():
                    a[0, lo:hi] = page[f"s{i}.{part}.{leaf}"]
    return row


def pages_match(pages: list[dict], tokens: np.ndarray, page_tokens: int, row: Cache) -> bool:
    """Pages hold the request's own tokens and arrays shaped like this cache's rows (else: unusable)."""
    for k, page in enumerate(pages):
        if not np.array_equal(page.get("tokens"), tokens[k * page_tokens:(k + 1) * page_tokens]):
            return False
    want = {f"s{i}.{part}.{leaf}": a.shape[2:] for i, src in enumerate(row.sources)
            for part in ("entries", "index_keys") for leaf, a in getattr(src, part).items()}
    return all(set(p) == set(want) | {"tokens"} and all(p[n].shape[1:] == s for n, s in want.items()) for p in pages)


def ngram_history_at(token_map: np.ndarray, tokens: np.ndarray, n: int, width: int,
                     dead: np.ndarray | None = None) -> np.ndarray:
    """int32 [1, width]: the engram history after n tokens (compressed ids of the last `width`, -1 before 0
    and at the positions where `dead` (bool [>= n]: image spans) is set)."""
    out = np.full((1, width), -1, np.int32)
    take = min(n, width)
    if take:
        comp = token_map[np.asarray(tokens[n - take:n])]
        out[0, width - take:] = comp if dead is None else np.where(dead[n - take:n], -1, comp)
    return out


def reset_row(row: Cache, length: int) -> Cache:
    """A host cache (a row, or any batch) with `length` tokens claimed per sequence, every window ring
    empty before `length` (`Cache.window_start`) and no pending compressor group: where a replay starts."""
    return row.replace(lengths=np.full_like(row.lengths, length), window_start=np.full_like(row.window_start, length),
                       sources=tuple(SourceCache(s.entries, s.index_keys, np.zeros_like(s.pend_kv),
                                                 np.zeros_like(s.pend_score)) for s in row.sources))
