"""Page store and host pool: every way a page can be bad is a miss, never data or an exception."""

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dsv41_jax.tiers import HostPool, PageStore, block_chain, fingerprint

PT = 4


def page_arrays(k: int) -> dict:
    rng = np.random.default_rng(k)
    return {"s0.values": rng.integers(0, 255, (2, 8), dtype=np.uint8), "tokens": np.arange(PT, dtype=np.int32) + k}


class Clock:
    def __init__(self, t=1e9):
        self.t = t

    def __call__(self):
        return self.t


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.fixture
def store(tmp_path):
    fp = fingerprint({"dim": 8}, "w0", PT)
    return PageStore(tmp_path / "cache", fp, PT, clock=Clock())


def test_chain_keys_cover_the_whole_prefix():
    fp = fingerprint({"dim": 8}, "w0", PT)
    a = block_chain(fp, [1, 2, 3, 4, 5, 6, 7, 8, 9], PT)
    b = block_chain(fp, [0, 2, 3, 4, 5, 6, 7, 8], PT)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first block: different key
    assert block_chain(fingerprint({"dim": 8}, "w1", PT), [1, 2, 3, 4], PT)[0] != a[0]
    assert fingerprint({"dim": 8}, "w0", PT) != fingerprint({"dim": 8}, "w0", 2 * PT)


def test_roundtrip_prefix_and_stats(store):
    keys = block_chain(store.fp, np.arange(3 * PT), PT)
    for k, key in enumerate(keys[:2]):
        assert store.put(key, k * PT, page_arrays(k))
    assert store.put(keys[0], 0, page_arrays(0))  # present: skipped, still True
    pages = store.lookup(keys)
    assert len(pages) == 2 and same(pages[1], page_arrays(1))
    assert store.stats["pages_written"] == 2 and store.stats["bytes_read"] > 0


def corrupt(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "flip_header":
        data[20] ^= 0x01
    elif how == "empty":
        data = b""
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "flip_header", "empty"])
def test_damaged_page_is_a_miss_and_is_replaced(store, how):
    key = block_chain(store.fp, np.arange(PT), PT)[0]
    store.put(key, 0, page_arrays(0))
    corrupt(store.path(key), how)
    assert store.get(key, 0) is None and store.stats["misses"] == 1
    assert store.put(key, 0, page_arrays(0)) and same(store.get(key, 0), page_arrays(0))


def test_other_producer_range_or_age_is_a_miss(store, tmp_path):
    key = block_chain(store.fp, np.arange(PT), PT)[0]
    store.put(key, 0, page_arrays(0))
    other = PageStore(store.root, fingerprint({"dim": 8}, "w1", PT), PT, clock=store.clock)
    os.makedirs(other.dir, exist_ok=True)
    os.link(store.path(key), other.path(key))  # a page of another producer under this producer's name
    assert other.get(key, 0) is None and other.stats["miss_fingerprint"] == 1
    assert store.get(key, PT) is None and store.stats["miss_token_range"] == 1
    store.put(key, 0, page_arrays(0))
    store.clock.t += store.retention_s + 1
    os.utime(store.path(key), (store.clock.t - store.retention_s - 1,) * 2)
    assert store.get(key, 0) is None and store.stats["miss_expired"] == 1


def test_missing_directory_and_full_disk(store, tmp_path, monkeypatch):
    key = block_chain(store.fp, np.arange(PT), PT)[0]
    assert store.get(key, 0) is None  # root does not exist yet
    def enospc(fd, data):
        os.write(fd, data[:5])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(store, "_write_all", enospc)
    assert store.put(key, 0, page_arrays(0)) is False
    assert store.stats["write_error_ENOSPC"] == 1 and os.listdir(store.dir) == []  # temp removed
    assert store.get(key, 0) is None
    ro = PageStore("/proc/not-writable", store.fp, PT)
    assert ro.put(key, 0, page_arrays(0)) is False and ro.get(key, 0) is None


def test_gc_removes_expired_pages_and_stale_temp_files(store):
    keys = block_chain(store.fp, np.arange(2 * PT), PT)
    store.put(keys[0], 0, page_arrays(0))
    open(os.path.join(store.dir, ".tmp-1-dead"), "wb").write(b"half")
    store.clock.t += 2 * 3600
    store.put(keys[1], PT, page_arrays(1))
    old = store.clock.t - store.retention_s - 1
    os.utime(store.path(keys[0]), (old, old))
    os.utime(os.path.join(store.dir, ".tmp-1-dead"), (old, old))
    assert store.gc() == 2
    assert sorted(os.listdir(store.dir)) == [keys[1] + ".page"]


WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from dsv41_jax.tiers.page_store import PageStore
    root, fp, key, mode = sys.argv[1:5]
    s = PageStore(root, fp, {pt})
    def killed(fd, data):
        os.write(fd, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill":
        s._write_all = killed
        s.put(key, 0, {{"x": np.arange(64, dtype=np.int32)}})
    else:  # hammer: rewrite the same page many times (delete + write), as another engine would
        for i in range(int(mode)):
            try:
                os.unlink(s.path(key))
            except OSError:
                pass
            s.put(key, 0, {{"x": np.arange(64, dtype=np.int32)}})
""").format(pt=PT)


def run_writer(store, key, mode):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.Popen([sys.executable, "-c", WRITER, str(store.root), store.fp, key, mode], env=env)


def test_writer_killed_mid_write_leaves_no_page(store):
    key = block_chain(store.fp, np.arange(PT), PT)[0]
    p = run_writer(store, key, "kill")
    assert p.wait(60) == -9
    assert any(n.startswith(".tmp-") for n in os.listdir(store.dir))  # the half-written temp file
    assert store.get(key, 0) is None and store.stats["miss_absent"] == 1


def test_concurrent_writer_never_shows_a_half_written_page(store):
    key = block_chain(store.fp, np.arange(PT), PT)[0]
    p = run_writer(store, key, "300")
    seen = 0
    while p.poll() is None:
        page = store.get(key, 0)
        if page is not None:
            assert np.array_equal(page["x"], np.arange(64))
            seen += 1
    assert p.returncode == 0
    bad = {k: v for k, v in store.stats.items() if k.startswith("miss_") and k != "miss_absent"}
    assert bad == {}, f"reader saw damaged pages: {bad}"


def test_host_pool_capacity_lru_and_ttl():
    clock = Clock(0.0)
    a = {"w": np.zeros(100, np.uint8)}
    pool = HostPool(capacity_bytes=250, ttl_s=10, clock=clock)
    assert pool.put("a", a) and pool.put("b", a) and pool.put("c", a)  # c evicts a (LRU)
    assert pool.get("a") is None and pool.get("b") is not None and pool.stats["evicted"] == 1
    assert pool.put("d", a)  # evicts c: b was used more recently
    assert pool.get("c") is None and pool.get("b") is not None
    clock.t = 11
    assert pool.get("b") is None and pool.used_bytes == 0 and pool.stats["expired"] == 2
    assert not pool.put("huge", {"w": np.zeros(300, np.uint8)})
    with pytest.raises(ValueError, match="ttl"):
        HostPool(capacity_bytes=1, ttl_s=0)
