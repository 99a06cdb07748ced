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
from urllib.parse import urlsplit


from dsv41_jax.tiers import mooncake_pool
from dsv41_jax.tiers.host_pool import HostPool
from dsv41_jax.tiers.shared_pool import SharedPool, StoreDown

SCHEMES = {"redis": "redis", "rediss": "redis", "unix": "redis", "mooncake": "mooncake"}


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
        mooncake_pool.parse_url(url)
    return SCHEMES[scheme]


def window_pool(url: str | None, fp: str, ttl_s: float, capacity_bytes: int | None = None):
    """The window pool of an engine: in process (`HostPool` of `capacity_bytes`, None: 10% of host memory)
    without a URL, else the shared store at `url`. A Mooncake Store pool is built from a segment of
    `capacity_bytes` that each member process contributes (so again 10% of host memory by default)."""
    if url is None:
        return HostPool(capacity_bytes, ttl_s)
    if check_url(url) == "redis":
        return RedisPool(url, fp, ttl_s)
    return mooncake_pool.MooncakePool(url, fp, ttl_s, capacity_bytes)
