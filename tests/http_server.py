"""Servers for tests with real clients: a FastAPI app served by uvicorn in a thread (`serving`), or
`python -m experiments.serve` in a process of its own (`serve_process`), both on 127.0.0.1."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import uvicorn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def serving(app):
    """Yields the server's base URL (http://127.0.0.1:PORT) while it runs; stops it afterwards."""
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m experiments.serve ARGS --port P` started in its own process, its output in `log`, at
    `url`; `ready()` waits until it answers /health. `env` is added to this process's environment."""

    def __init__(self, args: list[str], log: str, env: dict | None = None):
        port = free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "experiments.serve", *args, "--port", str(port)],
                                         cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out,
                                         stderr=subprocess.STDOUT)

    def ready(self, timeout_s: float = 120) -> "ServeProcess":
        deadline = time.time() + timeout_s
        while True:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.output()}"
            assert time.time() < deadline, f"the server did not answer in {timeout_s} s:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s (a Mooncake client whose master is gone takes ~10 s to leave)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
