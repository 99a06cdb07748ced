"""Shared window stores for tests, each started fresh on this machine and stopped afterwards:
`RedisStore` (redis-server on a Unix socket in a directory of its own) and `MooncakeMaster`
(mooncake_master with its HTTP metadata service, on free loopback ports). `skip_reason(kind)` says why a
kind cannot run here (None when it can)."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

# one window-pool entry as the engine writes it (names, dtypes and shapes of a ring and its start)
ARRAYS = {"window.values": np.arange(96, dtype=np.uint8).reshape(2, 3, 16), "window_start": np.array([7], np.int32)}


def skip_reason(kind: str) -> str | None:
    if kind == "redis":
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis client comes with the [serve] extra"
        if shutil.which("redis-server") is None:
            return "redis-server is not installed: apt-get install redis-server (.ci/run does)"
        return None
    from dsv41_jax.tiers.mooncake_pool import client_class

    try:
        client_class()
    except ImportError as e:
        return f"{e} (.ci/run installs libibverbs1)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc, ready, what: str) -> None:
    deadline = time.time() + 20
    while not ready():
        assert time.time() < deadline and proc.poll() is None, f"{what} did not start"
        time.sleep(0.05)


class RedisStore:
    def __init__(self):
        import redis

        # a short directory of its own: a Unix socket path must fit in 107 bytes, which pytest's may not
        self.dir = tempfile.mkdtemp(prefix="dsv41-redis-")
        self.sock = os.path.join(self.dir, "redis.sock")
        self.url = f"unix://{self.sock}"
        self.proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", self.sock, "--unixsocketperm",
                                      "700", "--save", "", "--appendonly", "no", "--maxmemory", "64mb",
                                      "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url)

        def ready():
            try:
                return self.client.ping()
            except redis.RedisError:
                return False

        _wait(self.proc, ready, "redis-server")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class MooncakeMaster:
    def __init__(self):
        import mooncake

        self.rpc, self.http, metrics = free_port(), free_port(), free_port()
        self.url = f"mooncake://127.0.0.1:{self.rpc}?metadata=http://127.0.0.1:{self.http}/metadata"
        self.argv = [str(Path(mooncake.__file__).parent / "mooncake_master"), f"--rpc_port={self.rpc}",
                     "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                     "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}",
                     f"--metrics_port={metrics}", "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"]
        self.start()

    def start(self):
        """(Re)start the master on this store's ports: it knows nothing of the entries before."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def ready():
            try:
                for port in (self.rpc, self.http):
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                return False

        _wait(self.proc, ready, "mooncake_master")

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            self.kill()


def start(kind: str):
    return RedisStore() if kind == "redis" else MooncakeMaster()
