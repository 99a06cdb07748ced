"""experiments.bench_decode on CPU: the loop's steps per call and calls per host sync reach its rows, the index keys'
layout its config; the serving loop's timing."""

import numpy as np

from experiments import bench_decode


def test_bench_decode_times_queued_calls_on_tiny(capsys, monkeypatch):
    monkeypatch.setattr(bench_decode, "ROOM", 8)  # the cache's lengths rewound in every phase (Room)
    rewinds = []
    before = bench_decode.Room.before
    monkeypatch.setattr(bench_decode.Room, "before", lambda self, cache, n: (
        rewinds.append(self.taken + n > bench_decode.ROOM), before(self, cache, n))[1])
    rows = bench_decode.main(["--preset", "tiny", "--layers", "3", "--batch", "2", "--context", "256", "--steps", "4", "--chunk", "2",
                              "--queued", "2", "--kernels", "jnp", "--copy-gb", "0.01", "--index-key-layout", "sm90"])
    (row,) = rows
    assert (row["steps_per_call"], row["calls_per_sync"], row["batch"]) == (2, 2, 2)
    assert row["ms_step_loop"] > 0 and row["ms_step_serving"] > 0
    assert row["roofline_ms"] > 0 and row["bytes_must_move"] > 0
    assert row["ratio_serving"] == row["ms_step_serving"] / row["roofline_ms"]
    out = capsys.readouterr().out
    assert "(the loop: 2 steps per api.generate call, 2 call(s) per host sync; serving:" in out
    assert "index keys sm90," in out  # layer 2 (Full) scans its index keys in Hopper's words, through the codec
    assert sum(rewinds) >= 3, rewinds


class _Clock:
    """Virtual seconds: the host's own work takes none, waiting for a call's tokens moves time to their deadline."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Device:
    """A GPU stand-in running each dispatched call after the previous one, `seconds` each (the first `first`): a
    call's tokens turn into an array once its deadline passes (np.asarray waits for it, on `clock`)."""

    def __init__(self, clock: _Clock, seconds: float, first: float):
        self.clock, self.seconds, self.first, self.end = clock, seconds, first, None

    def __call__(self, cache):
        now = self.clock()
        self.end = now + self.first if self.end is None else max(now, self.end) + self.seconds
        return _Tokens(self.clock, self.end), None, cache + 1


class _Tokens:
    def __init__(self, clock: _Clock, ready: float):
        self.clock, self.ready = clock, ready

    def __array__(self, dtype=None, copy=None):
        self.clock.now = max(self.clock.now, self.ready)
        return np.zeros((1, 4), np.int32)


def test_serving_loop_counts_the_steady_state_not_the_pipeline_filling(monkeypatch):
    """Calls of 20 ms of 4 steps each, the first (as a call after a host wait) 200 ms: 5 ms per step, the first
    call's delay not counted, every call dispatched once (the cache threads through)."""
    clock = _Clock()
    monkeypatch.setattr(bench_decode.time, "perf_counter", clock)
    ms, cache = bench_decode.serving_loop_ms(_Device(clock, 0.02, 0.2), 0, calls=6, chunk=4)
    assert cache == 7
    assert abs(ms - 5.0) < 1e-9, ms


def test_room_rewinds_the_lengths_before_a_run_would_pass_the_capacity():
    """Runs of steps on a random cache stay within its context + ROOM tokens: the lengths go back to the context
    only when the next run would not fit, and a run longer than the room is refused with what to change."""
    import jax.numpy as jnp
    import pytest

    from dsv41_jax.cache import Cache

    cache = Cache(lengths=jnp.full((2,), 100, jnp.int32), window={}, window_start=jnp.zeros((1, 2), jnp.int32),
                  sources=(), ngram_history=jnp.zeros((2, 1), jnp.int32))
    room = bench_decode.Room(100)
    taken = 0
    for n in (100, 100, 56, 1, 80):
        before = cache.lengths
        cache = room.before(cache, n)
        if taken + n > bench_decode.ROOM:
            assert cache.lengths is not before and np.asarray(cache.lengths).tolist() == [100, 100]
            # as committed as before: a committed array among uncommitted ones made the next jitted call compile
            # again (the H200's loop column read that compile, thirty-second session)
            assert cache.lengths.committed == before.committed
            cache, taken = cache.replace(lengths=cache.lengths + n), n
        else:
            assert cache.lengths is before
            cache, taken = cache.replace(lengths=cache.lengths + n), taken + n
        assert int(cache.lengths.max()) <= 100 + bench_decode.ROOM
    assert room.taken == taken == 81
    with pytest.raises(ValueError, match="--chunk"):
        room.before(cache, bench_decode.ROOM + 1)
