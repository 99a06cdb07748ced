"""Host tier in a shared store: the window pool in Redis / Valkey, so that several servers (and a restarted
one) restore each other's prefixes exactly instead of falling back to bounded replay.

`RedisPool` has `HostPool`'s interface (put, get, stats): the engine takes either. The store does the
pool's bookkeeping itself: each entry is written with a TTL (`SET ... EX`), and the server's `maxmemory`
with `allkeys-lru` bounds the pool and evicts the least recently used entries.

An entry is a `records` record, as the disk pages: the header names the producer's fingerprint, the key
and every array's name/dtype/shape, the digest (blake2b) covers everything before it. A damaged entry, one from another producer or key, a store that
is down or slower than `timeout_s`: each is a miss counted in `stats`, never an exception. After a
failure the store is not asked again for `retry_s` seconds, so a dead store costs one timeout, not one
per request.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np

from dsv41_jax.tiers import records

MAGIC = b"DSV41WN\x00"


class RedisPool:
    """key -> dict of numpy arrays in the Redis / Valkey server at `url` (redis://host:port/db or
    unix:///path/to/socket), for one producer (fingerprint `fp`), each entry valid for `ttl_s`."""

    def __init__(self, url: str, fp: str, ttl_s: float, *, timeout_s: float = 0.5, retry_s: float = 5.0,
                 clock=time.monotonic):
        try:
            import redis
        except ImportError:
            raise ImportError("a window store URL needs the redis package: pip install -e '.[serve]'") from None
        if ttl_s <= 0:
            raise ValueError(f"the window store needs ttl > 0, got {ttl_s} s")
        self.redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url, self.fp, self.ttl_s, self.retry_s, self.clock = url, fp, ttl_s, retry_s, clock
        self.prefix = f"dsv41:window:{fp}:"
        self.stats = Counter()
        self._down_until = 0.0

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Store `arrays` under `key`; False (nothing stored) when the store is down or too slow."""
        data = self._encode(key, arrays)
        if not self._call(lambda: self.client.set(self.prefix + key, data, ex=max(1, math.ceil(self.ttl_s)))):
            return False
        self.stats["puts"] += 1
        self.stats["bytes_written"] += len(data)
        return True

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        data = self._call(lambda: self.client.get(self.prefix + key))
        if not data:
            return self._miss("absent" if data is None else "store_down")
        arrays = self._decode(data, key)
        if isinstance(arrays, str):
            return self._miss(arrays)
        self.stats["hits"] += 1
        self.stats["bytes_read"] += len(data)
        return arrays

    def _call(self, op):
        """op()'s value; False when the store is down, slow, or in its back-off after a failure."""
        if self.clock() < self._down_until:
            self.stats["skipped_store_down"] += 1
            return False
        try:
            return op()
        except self.redis.RedisError:  # connection refused or lost, timeout, out of memory, ...
            self.stats["store_errors"] += 1
            self._down_until = self.clock() + self.retry_s
            return False

    def _miss(self, reason: str):
        self.stats["misses"] += 1
        self.stats[f"miss_{reason}"] += 1
        return None

    def _encode(self, key: str, arrays: dict[str, np.ndarray]) -> bytes:
        return records.encode(MAGIC, self.fp, key, arrays)

    def _decode(self, data: bytes, key: str) -> dict[str, np.ndarray] | str:
        """The arrays (copies: writable, as the in-process pool's), or why the bytes are not this entry."""
        return records.decode(data, MAGIC, self.fp, key, copy=True)
