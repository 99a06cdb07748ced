"""A FastAPI app served by uvicorn on 127.0.0.1 (a free port) in a thread, for tests with real clients."""

import contextlib
import threading
import time

import uvicorn


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
