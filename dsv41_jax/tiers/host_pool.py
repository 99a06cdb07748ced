"""Host tier: window rings (and other small per-prefix state) of finished or paused sequences, in
host memory, with a byte capacity and a time to live.

Window KV is never persisted (it is ~W x layers x 528 B per sequence, constant in length, and only
useful for minutes); losing it costs a bounded replay of one window, not a full prefill. Entries are
evicted least recently used when the pool is full and dropped when older than the TTL; either way
they are gone, and a lookup is a miss.
"""

from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict

import numpy as np

DEFAULT_TTL_S = 300.0


def default_capacity_bytes(fraction: float = 0.10) -> int:
    """`fraction` of physical host memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(total * fraction)


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(int(a.nbytes) for a in arrays.values())


class HostPool:
    """key -> dict of numpy arrays, LRU within `capacity_bytes`, each entry valid for `ttl_s` after put."""

    def __init__(self, capacity_bytes: int | None = None, ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        self.capacity_bytes = default_capacity_bytes() if capacity_bytes is None else int(capacity_bytes)
        if self.capacity_bytes < 0 or ttl_s <= 0:
            raise ValueError(f"host pool needs capacity >= 0 and ttl > 0, got {self.capacity_bytes} B, {ttl_s} s")
        self.ttl_s, self.clock = ttl_s, clock
        self._items: OrderedDict[str, tuple[float, int, dict]] = OrderedDict()
        self.used_bytes = 0
        self.stats = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Store copies of `arrays`; False (nothing stored) when one entry exceeds the whole capacity."""
        n = _nbytes(arrays)
        if n > self.capacity_bytes:
            self.stats["rejected_too_large"] += 1
            return False
        self._drop(key)
        self._expire()
        while self.used_bytes + n > self.capacity_bytes:
            old, _ = next(iter(self._items.items()))
            self._drop(old)
            self.stats["evicted"] += 1
        self._items[key] = (self.clock() + self.ttl_s, n, {k: np.array(v, copy=True) for k, v in arrays.items()})
        self.used_bytes += n
        self.stats["puts"] += 1
        self.stats["bytes_written"] += n
        return True

    def get(self, key: str) -> dict[str, np.ndarray] | None:
        self._expire()
        item = self._items.get(key)
        if item is None:
            self.stats["misses"] += 1
            return None
        self._items.move_to_end(key)
        self.stats["hits"] += 1
        self.stats["bytes_read"] += item[1]
        return item[2]

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.used_bytes -= item[1]

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (deadline, _, _) in self._items.items() if deadline <= now]:
            self._drop(key)
            self.stats["expired"] += 1
