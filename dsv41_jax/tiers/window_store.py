"""Host tier in a shared store: the window pool in Redis / Valkey or in Mooncake Store, so that several
servers (and a restarted one) restore each other's prefixes exactly instead of falling back to bounded
replay.

`window_pool(url, ...)` gives the pool of an engine: the in-process `HostPool` without a URL, else a
`SharedPool` of the store the URL names. Each has `HostPool`'s interface (put, get, stats).

    redis://host:port/db, rediss://..., unix:///path.sock   RedisPool (here)
    mooncake://master_host:port[?metadata=URL&local=HOST]  MooncakePool (tiers/mooncake_pool.py)

An entry is a `records` record, as the disk pages: the header names the producer's fingerprint, the key,
the wall-clock time the entry expires and every array's name/dtype/shape; the digest (blake2b) covers
everything before it. A damaged entry, one from another producer or key, an expired one, a store that
is down or slower than its timeout: each is a miss counted in `stats`, never an exception. After a
failure the store is not asked again for `retry_s` seconds, so a dead store costs one timeout, not one
per request.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from urllib.parse import urlsplit

import numpy as np

from dsv41_jax.tiers import records
from dsv41_jax.tiers.host_pool import HostPool

MAGIC = b"DSV41WN\x00"
SCHEMES = {"redis": "redis", "rediss": "redis", "unix": "redis", "mooncake": "mooncake"}


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


class RedisPool(SharedPool):
    """The pool in the Redis / Valkey server at `url` (redis://host:port/db or unix:///path/to/socket). The
    server does the bookkeeping: each entry is written with a TTL (`SET ... EX`), and its `maxmemory` with
    `allkeys-lru` bounds the pool, evicting the least recently used entries."""

    def __init__(self, url: str, fp: str, ttl_s: float, *, timeout_s: float = 0.5, **kw):
        super().__init__(fp, ttl_s, **kw)
        try:
            import redis
        except ImportError:
            raise ImportError("a redis:// window store needs the redis package: pip install -e '.[serve]'") from None
        self.redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url = url

    def _write(self, name: str, data: bytes) -> None:
        try:
            self.client.set(name, data, ex=max(1, math.ceil(self.ttl_s)))
        except self.redis.RedisError as e:  # connection refused or lost, timeout, out of memory, ...
            raise StoreDown(str(e)) from None

    def _read(self, name: str) -> bytes | None:
        try:
            return self.client.get(name)
        except self.redis.RedisError as e:
            raise StoreDown(str(e)) from None


def check_url(url: str) -> str:
    """The backend a window-store URL names ("redis" or "mooncake"), or ValueError saying what is accepted."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ValueError(f"{url!r}: unknown window store; give redis://host:port/db, unix:///path.sock (Redis / "
                         "Valkey) or mooncake://master_host:port (Mooncake Store)")
    if SCHEMES[scheme] == "mooncake":
        from dsv41_jax.tiers.mooncake_pool import parse_url

        parse_url(url)
    return SCHEMES[scheme]


def window_pool(url: str | None, fp: str, ttl_s: float, capacity_bytes: int | None = None):
    """The window pool of an engine: in process (`HostPool` of `capacity_bytes`, None: 10% of host memory)
    without a URL, else the shared store at `url`. A Mooncake Store pool is built from a segment of
    `capacity_bytes` that each member process contributes (so again 10% of host memory by default)."""
    if url is None:
        return HostPool(capacity_bytes, ttl_s)
    if check_url(url) == "redis":
        return RedisPool(url, fp, ttl_s)
    from dsv41_jax.tiers.mooncake_pool import MooncakePool

    return MooncakePool(url, fp, ttl_s, capacity_bytes)
