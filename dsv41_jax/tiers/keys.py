"""Content addresses for cached prefixes: a fingerprint of what produced the cache and a chained hash
of token blocks.

A cache entry may only be reused by the exact producer that wrote it, so the fingerprint covers the
model config, a digest of the weights (or a caller-given revision string), the cache byte-format
version and the page size: the known silent-corruption bugs of prefix caches all came from keys that
missed one of those. Hashes are blake2b over explicit little-endian bytes, stable across processes
and machines (Python's `hash()` is salted per process and must never be used here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

# Bump whenever the bytes a page holds change meaning (record layout, page header, what is stored).
CACHE_FORMAT_VERSION = 1


def _h() -> "hashlib._Hash":
    return hashlib.blake2b(digest_size=16)


def weights_digest(leaves) -> str:
    """Digest of parameter arrays (an iterable of array-likes, in a fixed order)."""
    h = _h()
    for a in leaves:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(config, weights: str, page_tokens: int, extra: str = "") -> str:
    """Hex id of (model config, weights digest or revision, cache format version, page size).

    config: a dataclass (e.g. ModelConfig) or a JSON-able dict.
    """
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    blob = json.dumps(dict(config=cfg, weights=weights, format=CACHE_FORMAT_VERSION, page_tokens=page_tokens,
                           extra=extra), sort_keys=True, default=str)
    h = _h()
    h.update(blob.encode())
    return h.hexdigest()


def block_chain(fp: str, tokens, page_tokens: int, images=()) -> list[str]:
    """Chained hashes of the full blocks of `tokens`: key[k] covers tokens[: (k+1) * page_tokens].

    key[k] = H(key[k-1] | tokens of block k | the images reaching block k), seeded with the fingerprint,
    so equal keys mean an equal whole prefix from the same producer, never just an equal block.
    images: (start, stop, content digest) of each image span: every span position holds the same image
    token id, so the digest is what tells two images apart (a prompt without images hashes as before).
    """
    t = np.asarray(tokens, dtype="<i4").reshape(-1)
    keys, prev = [], fp
    for k in range(len(t) // page_tokens):
        lo, hi = k * page_tokens, (k + 1) * page_tokens
        h = _h()
        h.update(prev.encode())
        h.update(t[lo:hi].tobytes())
        for start, stop, digest in images:
            if start < hi and stop > lo:
                h.update(f"|image {start} {stop} {digest}".encode())
        prev = h.hexdigest()
        keys.append(prev)
    return keys
