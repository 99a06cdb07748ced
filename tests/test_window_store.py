"""The window pool in Redis: entries round-trip with the disk pages' checksum discipline, a damaged or
foreign entry and a dead store are misses, and two engines (and two HTTP servers) sharing one store and
one cache directory restore each other's prefixes exactly (the cold run's greedy tokens) until the store
dies, after which they fall back to bounded replay without an error (two server *processes*:
tests/test_two_servers.py).

Each test starts its own `redis-server` on a Unix socket in a fresh temporary directory (no port, no
other user's data) and stops it (tests/stores.py); `.ci/run` installs the Debian package.
"""

import time

import numpy as np
import openai
import pytest

import dsv41_jax as d
from dsv41_jax.serving import Engine, EngineConfig, Request
from dsv41_jax.tiers import RedisPool
from tests.stores import ARRAYS, RedisStore, skip_reason

pytestmark = pytest.mark.skipif(skip_reason("redis") is not None, reason=str(skip_reason("redis")))


@pytest.fixture
def store():
    s = RedisStore()
    yield s
    s.close()


def test_entries_round_trip_and_bad_ones_are_misses(store):
    pool = RedisPool(store.url, "fp1", ttl_s=60)
    assert pool.put("k", ARRAYS)
    got = pool.get("k")
    assert set(got) == set(ARRAYS) and all(np.array_equal(got[k], v) and got[k].dtype == v.dtype
                                           for k, v in ARRAYS.items())
    assert 0 < store.client.ttl("dsv41:window:fp1:k") <= 60
    assert pool.get("other") is None and pool.stats["miss_absent"] == 1
    raw = store.client.get("dsv41:window:fp1:k")
    store.client.set("dsv41:window:fp1:k", raw[:-1] + bytes([raw[-1] ^ 1]))  # one flipped bit
    assert pool.get("k") is None and pool.stats["miss_checksum"] == 1
    store.client.set("dsv41:window:fp1:k2", raw)  # another key's entry copied over
    assert pool.get("k2") is None and pool.stats["miss_key"] == 1
    store.client.set("dsv41:window:fp2:k", raw)  # another producer's entry
    assert RedisPool(store.url, "fp2", ttl_s=60).get("k") is None


def test_a_dead_store_is_a_quick_miss(store):
    pool = RedisPool(store.url, "fp", ttl_s=60, timeout_s=0.2, retry_s=60)
    assert pool.put("k", ARRAYS)
    store.stop()
    t0 = time.perf_counter()
    assert pool.get("k") is None and not pool.put("k", ARRAYS) and pool.get("k") is None
    assert time.perf_counter() - t0 < 2 and pool.stats["store_errors"] == 1  # then it backs off
    assert pool.stats["skipped_store_down"] == 2


def test_a_slow_store_is_a_miss(store):
    pool = RedisPool(store.url, "fp", ttl_s=60, timeout_s=0.2, retry_s=60)
    assert pool.put("k", ARRAYS)
    store.client.execute_command("CLIENT", "PAUSE", "1500", "ALL")  # the server holds every command for 1.5 s
    t0 = time.perf_counter()
    assert pool.get("k") is None and pool.get("k") is None
    assert time.perf_counter() - t0 < 1 and pool.stats["store_errors"] == 1  # one timeout, then the back-off
    assert pool.stats["miss_store_down"] == 2


PT, CAP, NEW = 32, 160, 12
PROMPT = np.random.default_rng(1).integers(0, 320, 90)  # 2 full pages before the last token


@pytest.fixture(scope="module")
def model():
    cfg = d.preset("tiny")
    return cfg, d.init_params(cfg, seed=0)


def engine(model, **kw):
    cfg, params = model
    return Engine(cfg, params, EngineConfig(slots=2, capacity=CAP, prefill_chunk=32, page_tokens=PT, progress=False,
                                            **kw))


@pytest.fixture(scope="module")
def cold(model):
    return engine(model).generate([Request(PROMPT, max_new_tokens=NEW)])[0]


def test_two_engines_share_windows_until_the_store_dies(model, cold, store, tmp_path):
    def run(eng):
        return eng.generate([Request(PROMPT, max_new_tokens=NEW)])[0]

    shared = dict(cache_dir=str(tmp_path / "kv"), window_store=store.url)
    first = run(engine(model, **shared))
    assert first.metrics["prefix_path"] == "cold" and first.metrics["host_bytes_written"] > 0
    second = run(engine(model, **shared))  # a new engine: nothing of its own
    assert second.metrics["prefix_path"] == "host_restore" and second.metrics["reused_tokens"] == 2 * PT
    assert first.tokens == second.tokens == cold.tokens
    store.stop()
    third = run(engine(model, **shared))
    assert third.metrics["prefix_path"] == "bounded_replay" and len(third.tokens) == NEW and third.error is None


def test_two_http_servers_share_one_store(model, cold, store, tmp_path):
    """What a client of two servers behind one store sees: the second serves the first's prefix from the
    store (its metrics say so) with the cold run's tokens; with the store gone, a replay, no error."""
    from dsv41_jax.serving.http import Server
    from dsv41_jax.text_tokenizers import ByteTokenizer
    from tests.http_server import serving

    shared = dict(cache_dir=str(tmp_path / "kv"), window_store=store.url)
    a, b = (Server(engine(model, **shared), ByteTokenizer(), "tiny") for _ in range(2))
    with serving(a.app) as url_a, serving(b.app) as url_b:
        def complete(url):
            api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            return api.completions.create(model="tiny", prompt=PROMPT.tolist(), max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].token_ids

        def metric(srv, name, labels=None):
            return srv.metrics.registry.get_sample_value(name, labels) or 0.0

        assert complete(url_a) == cold.tokens
        assert complete(url_b) == cold.tokens
        assert metric(b, "dsv41_prefix_hits_total", {"tier": "host"}) == 1
        assert metric(b, "dsv41_prefix_reused_tokens_total") == 2 * PT
        store.stop()
        assert len(complete(url_b)) == NEW  # pages from disk, window replayed: no error
        assert metric(b, "dsv41_replays_total") == 1 and metric(b, "dsv41_prefix_hits_total", {"tier": "host"}) == 1


