"""Say so before a call compiles. The first prefill or decode step of a shape is the longest wait of a
run (tiny on CPU: ~8 s each; larger models: minutes) and otherwise passes in silence, or under a
progress bar whose rate and ETA count the compile as a step.

    with compiling(("decode", cfg, b, capacity), f"decode [B={b}, capacity={capacity}]"):
        logits, cache = decode_step(...)

jax dispatches asynchronously: the call returns once its program is compiled and enqueued, so the time
printed after it is the compile (and tracing), not the execution.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

_seen: set = set()  # keys announced and compiled in this process (jax's caches are per process too)


@contextmanager
def compiling(key, label: str, enabled: bool = True):
    """Around the first call of `key` (hashable: kind, config, shapes) in this process, print
    'compiling <label> ...' to stderr before it and 'compiling <label> done in X s' after; silent on later
    calls of the same key, when not `enabled`, and when the call raises."""
    if not enabled or key in _seen:
        yield
        return
    print(f"compiling {label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    _seen.add(key)
    print(f"compiling {label} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
