"""Cache tiers below HBM: a host-memory pool for window rings and an on-disk store of global KV pages.

Both are plain numpy + the standard library (no JAX), so they can be tested, and shared between
processes, without a model.
"""

from dsv41_jax.tiers.host_pool import HostPool
from dsv41_jax.tiers.keys import block_chain, fingerprint
from dsv41_jax.tiers.page_store import PageStore

__all__ = ["HostPool", "PageStore", "block_chain", "fingerprint"]
