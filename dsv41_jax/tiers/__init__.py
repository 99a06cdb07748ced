"""Cache tiers below HBM: a host-memory pool for window rings (in process, or shared in Redis / Valkey or
Mooncake Store) and an on-disk store of global KV pages.

All are plain numpy + the standard library (+ the redis or mooncake client for a shared pool; no JAX), so
they can be tested, and shared between processes, without a model.
"""

from dsv41_jax.tiers.host_pool import HostPool
from dsv41_jax.tiers.keys import block_chain, fingerprint
from dsv41_jax.tiers.page_store import PageStore
from dsv41_jax.tiers.window_store import RedisPool, SharedPool, window_pool

__all__ = ["HostPool", "PageStore", "RedisPool", "SharedPool", "block_chain", "fingerprint", "window_pool"]
