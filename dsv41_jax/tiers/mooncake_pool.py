"""The window pool in Mooncake Store (the KV store of the DeepSeek serving stacks), over TCP.

    mooncake_master --rpc_port 50051 --enable_http_metadata_server --http_metadata_server_port 8080
    python -m experiments.serve ... --cache-dir /shared/kv --window-store mooncake://storehost:50051

Mooncake Store is a pool built from the memory its clients bring: every server that joins mounts a
segment of `segment_bytes` of its own host memory (the engine passes the host pool size: 10% of host
memory by default), and the master (`mooncake_master`, shipped in the wheel) only keeps the metadata:
which key lives in which segment. A `get` reads the bytes from whichever segment holds them, over TCP
(the transfer engine's `tcp` protocol: no RDMA device, no GPU). When the pool fills, the master evicts
entries; when a server leaves, the entries in its segment go with it (a miss, as any other).

URL: mooncake://MASTER_HOST:RPC_PORT with optional query fields
    metadata=URL   the metadata service (default http://MASTER_HOST:8080/metadata, the master's own
                   --enable_http_metadata_server)
    local=HOST     the address other members reach this process's segment at (default 127.0.0.1: all
                   members on one machine; give the machine's LAN address when they are not)

Mooncake keeps entries until it evicts them (its leases protect an entry from eviction; they are no
time to live), so the pool's TTL is the expiry time in each record's header, checked on read against
this machine's clock: members on several machines need synchronized clocks (NTP), or a TTL well above
their skew. Calls into the client that do not return within `timeout_s` are a miss (a dead master makes
some calls block for ~4 s while the client reconnects), and start the usual back-off.

Needs the `mooncake` extra (`mooncake-transfer-engine-non-cuda`, x86-64 Linux, CPython 3.12 wheels) and
the Debian package `libibverbs1` (the wheel links libibverbs even for TCP).
"""

from __future__ import annotations

import concurrent.futures
import os
from urllib.parse import parse_qs, urlsplit

from dsv41_jax.tiers.host_pool import default_capacity_bytes
from dsv41_jax.tiers.shared_pool import SharedPool, StoreDown

LOCAL_BUFFER_BYTES = 64 << 20  # the client's staging buffer: bounds one entry (v41-flash: 2.7 MB)


def client_class():
    """mooncake.store.MooncakeDistributedStore, or ImportError saying what to install."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # its logging below errors: read once, when the library loads
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"a mooncake:// window store needs the mooncake extra (pip install -e '.[mooncake]') and "
                          f"the Debian package libibverbs1: {e}") from None
    return MooncakeDistributedStore


def parse_url(url: str) -> tuple[str, str, str]:
    """(master "host:port", metadata URL, local host) of a mooncake:// URL, or ValueError saying what is wrong."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "mooncake" or not u.hostname or port is None:
        raise ValueError(f"{url!r}: a Mooncake Store URL is mooncake://MASTER_HOST:RPC_PORT[?metadata=URL&local=HOST]")
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(q) - {"metadata", "local"}
    if unknown:
        raise ValueError(f"{url!r}: unknown field(s) {sorted(unknown)}; the URL takes metadata= and local=")
    return (f"{u.hostname}:{port}", q.get("metadata", f"http://{u.hostname}:8080/metadata"),
            q.get("local", "127.0.0.1"))


class MooncakePool(SharedPool):
    """The pool in the Mooncake Store whose master `url` names; this process adds a segment of
    `segment_bytes` (None: 10% of host memory) to it. ConnectionError when it cannot join the store."""

    def __init__(self, url: str, fp: str, ttl_s: float, segment_bytes: int | None = None, *, timeout_s: float = 1.0,
                 **kw):
        super().__init__(fp, ttl_s, **kw)
        master, metadata, local = parse_url(url)
        # advertise (and send to) `local` rather than the first network interface the client finds
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local)
        self.url, self.timeout_s = url, timeout_s
        self.segment_bytes = default_capacity_bytes() if segment_bytes is None else int(segment_bytes)
        self.store = client_class()()
        rc = self.store.setup(local, metadata, self.segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master)
        if rc != 0:
            raise ConnectionError(f"{url}: could not join the Mooncake Store (setup returned {rc}): is mooncake_master "
                                  f"running at {master}, with its metadata service at {metadata}?")
        # one worker: calls keep the client's order; a call stuck on a dead master only delays later ones
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mooncake-pool")

    def close(self) -> None:
        """Leave the store: this process's segment, and the entries in it, are gone for every member."""
        self._worker.shutdown(wait=True)
        self.store.close()

    def _run(self, fn, *args):
        try:
            return self._worker.submit(fn, *args).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise StoreDown(f"no answer within {self.timeout_s} s") from None

    def _write(self, name: str, data: bytes) -> None:
        rc = self._run(self.store.upsert, name, data)  # upsert: a rewrite refreshes the entry (put would keep it)
        if rc != 0:
            raise StoreDown(f"upsert returned {rc}")

    def _read(self, name: str) -> bytes | None:
        data = self._run(self.store.get, name)
        if data:
            return data
        # an empty answer is either "no such entry" or a failure: ask which
        exists = self._run(self.store.is_exist, name)
        if exists < 0:
            raise StoreDown(f"is_exist returned {exists}")
        return None  # absent, or listed but unreadable (its segment's owner is gone)
