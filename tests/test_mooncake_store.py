"""The window pool in Mooncake Store, over TCP on 127.0.0.1: entries written by one member are read from
its segment by another with the disk pages' checksum discipline; a damaged, foreign or expired entry and
a dead master are misses. (Two server processes sharing it: tests/test_two_servers.py.)

Each test starts its own `mooncake_master` (shipped in the wheel, with its HTTP metadata service) on free
loopback ports and stops it (tests/stores.py). Needs the `mooncake` extra and the Debian package
libibverbs1 (.ci/run installs it).
"""

import time

import numpy as np
import pytest

from dsv41_jax.tiers import records
from dsv41_jax.tiers.mooncake_pool import MooncakePool, parse_url
from dsv41_jax.tiers.shared_pool import MAGIC
from dsv41_jax.tiers.window_store import check_url, window_pool
from tests.stores import ARRAYS, MooncakeMaster, skip_reason

needs_mooncake = pytest.mark.skipif(skip_reason("mooncake") is not None, reason=str(skip_reason("mooncake")))

SEGMENT = 16 << 20


@pytest.fixture
def master():
    m = MooncakeMaster()
    yield m
    m.close()


def test_urls():
    assert parse_url("mooncake://h:50051") == ("h:50051", "http://h:8080/metadata", "127.0.0.1")
    assert parse_url("mooncake://h:1?metadata=http://m:9/metadata&local=10.1.2.3") == \
        ("h:1", "http://m:9/metadata", "10.1.2.3")
    assert check_url("mooncake://h:1") == "mooncake" and check_url("unix:///tmp/r.sock") == "redis"
    for bad, message in (("mooncake://h", "MASTER_HOST:RPC_PORT"), ("mooncake://h:1?segment=2", "unknown field"),
                         ("memcached://h:1", "unknown window store")):
        with pytest.raises(ValueError, match=message):
            check_url(bad)


@needs_mooncake
def test_entries_round_trip_between_members_and_bad_ones_are_misses(master):
    now = [time.time()]
    a = window_pool(master.url, "fp1", 60, SEGMENT)  # as an engine builds it
    b = MooncakePool(master.url, "fp1", ttl_s=60, segment_bytes=SEGMENT, wall=lambda: now[0])  # another member
    try:
        assert isinstance(b, MooncakePool) and a.put("k", ARRAYS)
        got = b.get("k")  # read over TCP from a's segment
        assert set(got) == set(ARRAYS) and all(np.array_equal(got[k], v) and got[k].dtype == v.dtype
                                               for k, v in ARRAYS.items())
        got["window_start"][0] = 0  # a writable copy, not a view of the store's bytes
        assert b.get("other") is None and b.stats["miss_absent"] == 1
        raw = a.store.get("dsv41:window:fp1:k")
        assert a.store.upsert("dsv41:window:fp1:k", raw[:-1] + bytes([raw[-1] ^ 1])) == 0  # one flipped bit
        assert b.get("k") is None and b.stats["miss_checksum"] == 1
        assert a.store.upsert("dsv41:window:fp1:k2", raw) == 0  # another key's entry copied over
        assert b.get("k2") is None and b.stats["miss_key"] == 1
        assert a.store.upsert("dsv41:window:fp2:k", raw) == 0  # another producer's entry
        c = MooncakePool(master.url, "fp2", ttl_s=60, segment_bytes=0)  # a member that brings no memory
        assert c.get("k") is None and c.stats["miss_fingerprint"] == 1
        c.close()
        assert a.put("k", ARRAYS)  # a rewrite replaces the damaged entry
        assert b.get("k") is not None
        now[0] = time.time() + 61  # the store keeps it; its header says it expired
        assert b.get("k") is None and b.stats["miss_expired"] == 1
        assert isinstance(records.decode(a.store.get("dsv41:window:fp1:k"), MAGIC, "fp1", "k"), dict)
    finally:
        a.close()
        b.close()


@needs_mooncake
def test_a_dead_master_is_a_quick_miss(master):
    pool = MooncakePool(master.url, "fp", ttl_s=60, segment_bytes=SEGMENT, timeout_s=0.5, retry_s=60)
    try:
        assert pool.put("k", ARRAYS)
        master.kill()
        t0 = time.perf_counter()
        assert pool.get("k") is None and not pool.put("k", ARRAYS) and pool.get("k") is None
        assert time.perf_counter() - t0 < 2 and pool.stats["store_errors"] == 1  # then it backs off
        assert pool.stats["skipped_store_down"] == 2
        master.start()  # a client leaves a live master in ~2 s, a dead one in ~11 s
    finally:
        pool.close()


@needs_mooncake
def test_a_slow_store_is_a_miss(master):
    pool = MooncakePool(master.url, "fp", ttl_s=60, segment_bytes=SEGMENT, timeout_s=0.2, retry_s=60)
    real = pool.store

    class Slow:  # the client answers, but after the deadline
        def __getattr__(self, name):
            return getattr(real, name)

        def get(self, name):
            time.sleep(0.6)
            return real.get(name)

    try:
        assert pool.put("k", ARRAYS)
        pool.store = Slow()
        t0 = time.perf_counter()
        assert pool.get("k") is None and pool.get("k") is None
        assert time.perf_counter() - t0 < 0.5  # one deadline, then the back-off
        assert pool.stats["store_errors"] == 1 and pool.stats["skipped_store_down"] == 1
    finally:
        pool.store = real
        pool.close()

