"""The backend-independent part of a window pool in a shared store (`SharedPool`): the record format,
expiry, miss accounting and the back-off after a failure. The backends: `window_store.RedisPool`,
`mooncake_pool.MooncakePool`; `window_store.window_pool(url, ...)` picks one. See window_store's doc.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from dsv41_jax.tiers import records

MAGIC = b"DSV41WN\x00"


class StoreDown(Exception):
    """The store did not do what was asked: unreachable, slower than the timeout, or it refused."""


_DOWN = object()  # what `_call` returns instead of raising


class SharedPool:
    """HostPool's interface over a store that several processes share. A backend gives `_write(name,
    data)` and `_read(name) -> bytes | None` (None: no such entry), raising StoreDown when the store
    fails; this class does the record format, expiry, miss accounting and the back-off."""

    def __init__(self, fp: str, ttl_s: float, *, retry_s: float = 5.0, clock=time.monotonic, wall=time.time):
        if ttl_s <= 0:
            raise ValueError(f"the window store needs ttl > 0, got {ttl_s} s")
        self.fp, self.ttl_s, self.retry_s, self.clock, self.wall = fp, ttl_s, retry_s, clock, wall
        self.prefix = f"dsv41:window:{fp}:"
        self.stats = Counter()
        self._down_until = 0.0

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Store `arrays` under `key`; False (nothing stored) when the store is down or too slow."""
        data = records.encode(MAGIC, self.fp, key, arrays, expires_unix_s=self.wall() + self.ttl_s)
        if self._call(self._write, self.prefix + key, data) is _DOWN:
            return False
        self.stats["puts"] += 1
        self.stats["bytes_written"] += len(data)
        return True

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        """The arrays stored under `key` (writable copies, as the in-process pool's), or None (a miss)."""
        data = self._call(self._read, self.prefix + key)
        if data is _DOWN or data is None:
            return self._miss("store_down" if data is _DOWN else "absent")
        header = {}
        arrays = records.decode(data, MAGIC, self.fp, key, copy=True, header_out=header)
        if isinstance(arrays, str):
            return self._miss(arrays)
        if not self.wall() < header.get("expires_unix_s", 0):  # a store without TTLs (Mooncake) keeps them
            return self._miss("expired")
        self.stats["hits"] += 1
        self.stats["bytes_read"] += len(data)
        return arrays

    def _call(self, op, *args):
        """op(*args); _DOWN when the store fails, or is in its back-off after a failure."""
        if self.clock() < self._down_until:
            self.stats["skipped_store_down"] += 1
            return _DOWN
        try:
            return op(*args)
        except StoreDown:
            self.stats["store_errors"] += 1
            self._down_until = self.clock() + self.retry_s
            return _DOWN

    def _miss(self, reason: str):
        self.stats["misses"] += 1
        self.stats[f"miss_{reason}"] += 1
        return None

    def _write(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def _read(self, name: str) -> bytes | None:
        raise NotImplementedError
