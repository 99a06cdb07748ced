"""Two `experiments.serve` processes sharing one window store and one --cache-dir, for each store
(Mooncake Store, Redis; with DSV41_FULL=1): a prompt the first served is an exact window hit on the second (the first's
cold tokens); the store killed while the second streams turns hits into misses, recomputed (both run
with --no-bounded-replay, so a miss gives the cold tokens again, not an approximation), and both servers
keep serving.

Compile time is most of the cost: the servers compile with XLA's backend optimizations off (both run the
same programs, so their tokens still agree exactly) and share the suite's JAX compilation cache (conftest.py),
so each program is compiled by the first server that needs it and loaded by every later one. That cache starts
empty in every run, as on a fresh CI machine (a cache kept across runs made this test's local times shorter
than CI's).
"""

import os
import re

import httpx2 as httpx
import numpy as np
import openai
import pytest

from tests import stores
from tests.configs import covered_elsewhere
from tests.http_server import ServeProcess

PT, CAP, NEW = 32, 160, 12
PROMPT = np.random.default_rng(1).integers(0, 320, 90).tolist()  # 2 full pages before the last token
ENV = {"JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],  # set by conftest.py
       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
       "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                                                      " --xla_llvm_disable_expensive_passes=true"}


# Both stores only with DSV41_FULL=1 (the suite's time: two server processes compiling, ~45 s of the 2-core CI
# machine beside the other worker): tests/test_window_store.py runs the same sharing in one process (two engines,
# two HTTP servers, Redis, the store killed) and tests/test_mooncake_store.py the Mooncake client; the processes
# themselves are what this test adds, and that part does not depend on the store.
@covered_elsewhere("tests/test_window_store.py and tests/test_mooncake_store.py (one process)")
@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_two_server_processes_share_one_store_and_one_cache_dir(kind, tmp_path):
    if stores.skip_reason(kind):
        pytest.skip(stores.skip_reason(kind))
    store = stores.start(kind)
    args = ["--preset", "tiny", "--slots", "2", "--capacity", str(CAP), "--prefill-chunk", "32", "--page-tokens",
            str(PT), "--decode-chunk", "4", "--kernels", "jnp", "--no-bounded-prefill", "--no-bounded-replay",
            "--host-pool-gb", "0.016", "--cache-dir", str(tmp_path / "kv"), "--window-store", store.url]
    servers = []
    try:
        a = ServeProcess(args, str(tmp_path / "a.log"), ENV)
        servers.append(a)
        a.ready()
        b = ServeProcess(args, str(tmp_path / "b.log"), ENV)  # starts while a compiles
        servers.append(b)
        cold = complete(a, PROMPT)
        b.ready()
        assert paths(a) == {"cold": 1}
        assert complete(b, PROMPT) == cold
        assert paths(b) == {"host_restore": 1} and scrape(b, "dsv41_prefix_reused_tokens_total") == 2 * PT

        stream = client(b).completions.create(model="tiny", prompt="x" * 8, max_tokens=CAP - 9, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        got = [next(chunks)]  # b is decoding it
        store.kill()
        assert complete(b, PROMPT) == cold  # admitted beside the stream: a miss, recomputed
        got += list(chunks)
        assert sum(len(c.choices[0].token_ids) for c in got) == CAP - 9
        assert got[-1].choices[0].finish_reason == "length"
        assert complete(a, PROMPT) == cold
        assert paths(b) == {"host_restore": 1, "cold": 1, "recompute": 1}  # "cold": the short prompt
        assert paths(a) == {"cold": 1, "recompute": 1}
        for srv in servers:
            assert scrape(srv, "dsv41_window_store_errors") >= 1
            assert scrape(srv, 'dsv41_prefix_hits_total{tier="host"}') == (srv is b)
            assert srv.proc.poll() is None and httpx.get(srv.url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        for srv in servers:
            srv.proc.terminate()
        for srv in servers:
            srv.stop()
        store.close()


def client(srv: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(srv: ServeProcess, prompt: list[int]) -> list[int]:
    return client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].token_ids


def scrape(srv: ServeProcess, series: str) -> float:
    """The value of one series (name with its labels, as /metrics prints it); 0 when absent."""
    m = re.search(rf"^{re.escape(series)} (\S+)$", httpx.get(srv.url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else 0.0


def paths(srv: ServeProcess) -> dict[str, int]:
    """Requests by prefix path, from the server's /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return {p: int(float(v)) for p, v in re.findall(r'^dsv41_prefix_paths_total\{path="(\w+)"\} (\S+)$', text, re.M)}
