"""One thread that owns the engine: continuous batching for many concurrent callers.

The engine is single-threaded by design (one batched cache, one compiled step). Callers (the HTTP
handlers, on the event loop) never touch it: they `submit` a request with a callback and may `cancel`
it; the driver thread moves submissions into the engine between steps, runs `engine.step()` while
anything is queued or live, and after each step calls each request's callback with the tokens it
gained and, once, with its finished `Result`. Requests therefore join and leave the running batch at
every step, without recompiling.

Back-pressure: at most `max_queue` requests wait for a slot beyond those the next step admits into the
free slots; beyond that `submit` raises `QueueFull` at once, so a burst is refused instead of queued
without bound.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from dsv41_jax.serving.engine import Engine, Request, Result


class QueueFull(Exception):
    """Every slot is busy and `max_queue` requests already wait; the caller should retry later."""


@dataclass
class _Tracked:
    on_event: Callable  # on_event(new_tokens: list[int], result: Result | None); result set once, at the end
    sent: int = 0


class Driver:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self._lock = threading.Condition()
        self._pending: list[tuple[Request, _Tracked]] = []
        self._cancels: set[str] = set()
        self._tracked: dict[str, _Tracked] = {}
        self._stop = False
        self._n = 0
        self._thread = threading.Thread(target=self._run, name="engine-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join()

    def waiting(self) -> int:
        """Requests submitted and not yet in a slot."""
        with self._lock:
            return len(self._pending) + len(self.engine.queue)

    def running(self) -> int:
        return len(self.engine.live)

    def submit(self, req: Request, on_event: Callable) -> str:
        """Queue `req` (already validated) and return its id; QueueFull when `max_queue` requests wait.
        `on_event` runs on the driver thread: it must only hand the data over (e.g. call_soon_threadsafe)."""
        with self._lock:
            free = self.engine.n_slots - len(self.engine.live)  # the next step admits this many at once
            if len(self._pending) + len(self.engine.queue) >= self.max_queue + free:
                raise QueueFull(f"{self.max_queue} requests already wait for one of {self.engine.n_slots} slots")
            self._n += 1
            req.id = f"cmpl-{self._n}"
            self._pending.append((req, _Tracked(on_event)))
            self._lock.notify()
        return req.id

    def cancel(self, rid: str) -> None:
        """Stop request `rid` at the next step (its slot is freed); nothing happens when it already ended."""
        with self._lock:
            self._cancels.add(rid)
            self._lock.notify()

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._lock:
                while not (self._stop or self._pending or self._cancels or eng.queue or eng.live):
                    self._lock.wait()
                if self._stop:
                    return
                pending, self._pending = self._pending, []
                cancels, self._cancels = self._cancels, set()
                for req, tr in pending:  # inside the lock: waiting() never misses a request in transit
                    eng.submit(req)
                    self._tracked[req.id] = tr
            for rid in cancels:
                eng.cancel(rid)
            try:
                if eng.queue or eng.live:
                    eng.step()
            except Exception:  # a bug or a device failure: fail every request rather than hang them
                traceback.print_exc()
                for res in eng.running() + [lv.res for lv in eng.queue]:
                    eng.cancel(res.id)
                    res.error = "the engine failed while running this request; see the server log"
            self._publish()

    def _publish(self) -> None:
        for res in self.engine.running():
            self._send(res, None)
        for res in self.engine.drain():
            self._send(res, res)

    def _send(self, res: Result, final: Result | None) -> None:
        tr = self._tracked.get(res.id)
        if tr is None:
            return
        new, tr.sent = res.tokens[tr.sent:], len(res.tokens)
        if new or final:
            tr.on_event(list(new), final)
        if final:
            del self._tracked[res.id]
