"""experiments.bench_decode on CPU: the loop's steps per call and calls per host sync reach its rows."""

from experiments import bench_decode


def test_bench_decode_times_queued_calls_on_tiny(capsys):
    rows = bench_decode.main(["--preset", "tiny", "--layers", "2", "--batch", "2", "--context", "256", "--steps", "4", "--chunk", "2",
                              "--queued", "2", "--kernels", "jnp", "--copy-gb", "0.01"])
    (row,) = rows
    assert (row["steps_per_call"], row["calls_per_sync"], row["batch"]) == (2, 2, 2)
    assert row["ms_step_loop"] > 0 and row["roofline_ms"] > 0 and row["bytes_must_move"] > 0
    assert "(the loop: 2 steps per api.generate call, 2 call(s) per host sync)" in capsys.readouterr().out
