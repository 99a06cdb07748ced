"""Persistent tier: immutable pages of global KV on disk, one file per block of prompt tokens.

Layout: `<root>/<fingerprint>/<chain key>.page`. A file is a `records` record (MAGIC | header length |
header | payload | digest) whose header also holds the token range [start, end) and the creation time;
the digest (blake2b) covers everything before it, so a
truncated file, a flipped byte anywhere, a header from another producer or a page from another range
are all detected. Every such problem is a miss (counted by reason in `stats`), never an exception
and never data.

Commit protocol (what makes a page visible only once durable): write a uniquely named temp file in
the same directory, fsync it, rename it onto the final name (atomic on POSIX), fsync the directory.
Readers only ever open final names, so a writer killed at any point leaves either no page or a
whole one; two processes writing the same key write the same bytes and the last rename wins.
Pages are immutable: a hit refreshes the file's mtime (retention counts from the last use), nothing
is rewritten in place. Leftover temp files of killed writers are removed by `gc()` after a grace
period.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections import Counter

import numpy as np

from dsv41_jax.tiers import records

MAGIC = b"DSV41PG\x00"
DEFAULT_RETENTION_S = 72 * 3600


class PageStore:
    """Pages of `page_tokens` tokens for one producer (fingerprint `fp`) under directory `root`.

    retention_s: a page not used for this long is expired (a miss, and removed by `gc`).
    clock: seconds since the epoch (tests move it forward).
    """

    def __init__(self, root: str, fp: str, page_tokens: int, *, retention_s: float = DEFAULT_RETENTION_S,
                 tmp_grace_s: float = 3600.0, clock=time.time):
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        self.root, self.fp, self.page_tokens = str(root), fp, page_tokens
        self.dir = os.path.join(self.root, fp)
        self.retention_s, self.tmp_grace_s, self.clock = retention_s, tmp_grace_s, clock
        self.stats = Counter()

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".page")

    # ------------------------------------------------------------------ write
    def put(self, key: str, token_start: int, arrays: dict[str, np.ndarray]) -> bool:
        """Write one page unless it exists; True when the page is durable on disk afterwards.

        Disk errors (full disk, read-only or missing directory, ...) are counted, the temp file is
        removed and False is returned: a failed write only costs a future recompute.
        """
        final = self.path(key)
        if os.path.exists(final):
            self.stats["write_skipped_present"] += 1
            return True
        data = self._encode(key, token_start, arrays)
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        fd = None
        try:
            os.makedirs(self.dir, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._write_all(fd, data)
            os.fsync(fd)
            os.close(fd)
            fd = None
            os.replace(tmp, final)
            self._fsync_dir()
        except OSError as e:
            self.stats["write_errors"] += 1
            self.stats[f"write_error_{errno.errorcode.get(e.errno, e.errno)}"] += 1
            if fd is not None:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self.stats["pages_written"] += 1
        self.stats["bytes_written"] += len(data)
        return True

    def _write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def _fsync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _encode(self, key: str, token_start: int, arrays: dict[str, np.ndarray]) -> bytes:
        return records.encode(MAGIC, self.fp, key, arrays, token_start=int(token_start),
                              token_end=int(token_start) + self.page_tokens, created=self.clock())

    # ------------------------------------------------------------------ read
    def get(self, key: str, token_start: int) -> dict[str, np.ndarray] | None:
        """The arrays of page `key` covering [token_start, token_start + page_tokens), or None (a miss)."""
        final = self.path(key)
        try:
            st = os.stat(final)
            if self.clock() - st.st_mtime > self.retention_s:
                return self._miss("expired", final)
            with open(final, "rb") as f:
                data = f.read()
        except OSError:
            return self._miss("absent")
        arrays = self._decode(data, key, token_start)
        if isinstance(arrays, str):
            return self._miss(arrays, final)
        try:  # retention counts from the last use
            now = self.clock()
            os.utime(final, (now, now))
        except OSError:
            pass
        self.stats["hits"] += 1
        self.stats["bytes_read"] += len(data)
        return arrays

    def _miss(self, reason: str, drop: str | None = None):
        self.stats["misses"] += 1
        self.stats[f"miss_{reason}"] += 1
        if drop is not None and reason != "absent":
            try:  # an unusable page is removed so the next write can replace it
                os.unlink(drop)
            except OSError:
                pass
        return None

    def _decode(self, data: bytes, key: str, token_start: int) -> dict[str, np.ndarray] | str:
        """The arrays, or the reason (a short string) the bytes are not a valid page for this request."""
        span = dict(token_start=token_start, token_end=token_start + self.page_tokens)
        return records.decode(data, MAGIC, self.fp, key, expect=span, mismatch="token_range")

    def lookup(self, keys: list[str]) -> list[dict[str, np.ndarray]]:
        """The pages of the longest cached prefix: pages for keys[0], keys[1], ... up to the first miss."""
        pages = []
        for k, key in enumerate(keys):
            page = self.get(key, k * self.page_tokens)
            if page is None:
                break
            pages.append(page)
        return pages

    # ------------------------------------------------------------------ retention
    def gc(self) -> int:
        """Remove expired pages and stale temp files of every producer under root; returns files removed."""
        removed, now = 0, self.clock()
        try:
            producers = os.listdir(self.root)
        except OSError:
            return 0
        for sub in producers:
            d = os.path.join(self.root, sub)
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                p = os.path.join(d, name)
                try:
                    age = now - os.stat(p).st_mtime
                    stale = (name.endswith(".page") and age > self.retention_s) or \
                            (name.startswith(".tmp-") and age > self.tmp_grace_s)
                    if stale:
                        os.unlink(p)
                        removed += 1
                except OSError:
                    continue
        self.stats["gc_removed"] += removed
        return removed
