"""`bench_kernels.flushed_calls`, the program `time_hbm` profiles: each of its calls is one call's own work. XLA
merges identical work and drops unused results, so without the per-call argument barrier the calls' work on the
unperturbed arguments would run once for all calls, and without the kept outputs it would not run at all: the
GPU time per call would then undercount the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_kernels as bk


def _call(x, y):  # y is not the perturbed argument: only the barrier keeps its work per call
    return jnp.sin(y) @ y + x[0]


@pytest.mark.parametrize("flush", ["rewrite", "read"])
def test_every_call_runs_its_own_work_after_its_flush(monkeypatch, flush):
    monkeypatch.setattr(bk, "KW", {"interpret": True})  # the flush as on the smoke run (CPU)
    monkeypatch.setattr(bk, "FLUSH", flush)
    x, y = jnp.arange(8, dtype=jnp.float32), jax.random.normal(jax.random.key(0), (32, 32))
    f, reps = bk.flushed_calls(_call, (x, y), perturb=0, reps=5)
    buf = jnp.zeros((bk._FLUSH_BLOCK,), jnp.uint32)
    hlo = f.lower(buf, x, y).compile().as_text()
    assert reps == 5 and hlo.count(" dot(") == reps, hlo.count(" dot(")
    buf_out, outs = f(buf, x, y)
    assert len(outs) == reps
    for out in outs:
        np.testing.assert_allclose(out, _call(x, y), rtol=1e-5)
    # every rewrite flipped the buffer (^ 1 each); the read flush leaves it as it was
    np.testing.assert_array_equal(buf_out, reps % 2 if flush == "rewrite" else 0)


def test_the_timed_output_is_the_calls_output(monkeypatch):
    """`time_hbm_output` gives fn's output from the timed program itself (the rows' error checks compile nothing
    more), the call's own values with the perturbed argument passed through the flush; `time_hbm` its time alone."""
    monkeypatch.setattr(bk, "KW", {"interpret": True})  # the smoke run's wall time (CPU)
    x, y = jnp.arange(8, dtype=jnp.float32), jax.random.normal(jax.random.key(1), (32, 32))
    t, info, out = bk.time_hbm_output(_call, (x, y), perturb=0, reps=3)
    assert t > 0 and info == {}
    np.testing.assert_allclose(out, _call(x, y), rtol=1e-5)
    assert len(bk.time_hbm(_call, (x, y), perturb=0, reps=3)) == 2


def test_an_unknown_flush_is_refused(monkeypatch):
    monkeypatch.setattr(bk, "FLUSH", "zero")
    with pytest.raises(ValueError, match="rewrite' or 'read'"):
        bk.l2_flush(jnp.zeros((bk._FLUSH_BLOCK,), jnp.uint32), jnp.zeros((8,), jnp.uint32))


def test_fewer_calls_where_the_outputs_would_pass_the_budget(monkeypatch):
    monkeypatch.setattr(bk, "KEPT_BYTES", 3 * 32 * 32 * 4)  # three outputs' bytes
    x, y = jnp.zeros((8,), jnp.float32), jnp.zeros((32, 32), jnp.float32)
    assert bk.flushed_calls(_call, (x, y), perturb=0, reps=20)[1] == 3
    monkeypatch.setattr(bk, "KEPT_BYTES", 1)
    assert bk.flushed_calls(_call, (x, y), perturb=0, reps=20)[1] == 2  # at least two calls


def test_the_copy_peak_is_timed_as_the_kernels_are(monkeypatch):
    """`hbm_copy_bandwidth` times, through `time_hbm` (as the scan and attention rows are), a pass that reads and
    writes every word of the copy, and counts both."""
    seen = {}

    def fake_time_hbm(fn, args, perturb):
        seen["out"], seen["args"], seen["perturb"] = fn(*args), args, perturb
        return 1e-3, {}

    monkeypatch.setattr(bk, "time_hbm", fake_time_hbm)
    rate = bk.hbm_copy_bandwidth(1 / 1024)  # 1 MiB
    s, x = seen["args"]
    assert seen["perturb"] == 0 and s.size * s.dtype.itemsize <= 64  # the small array goes through the flush
    assert x.nbytes == 2**20 and seen["out"].shape == x.shape
    np.testing.assert_array_equal(seen["out"], x ^ s[0])  # every word read and written
    assert bool(jnp.any(seen["out"] != x))
    assert rate == 2 * 2**20 / 1e-3


def test_the_dispatch_variant_times_what_the_model_runs(monkeypatch, tmp_path):
    """`--att-variant dispatch` times `kernels_pallas.sparse_attention_decode` (the model's call, whose tiles
    depend on the batch), checked against the jnp twin (smoke run: interpret mode on CPU)."""
    import json

    import kernels_pallas

    monkeypatch.setattr(bk, "KW", {})  # --smoke sets these module globals: restored after the test
    monkeypatch.setattr(bk, "FLUSH", bk.FLUSH)
    real, calls = kernels_pallas.sparse_attention_decode, []
    monkeypatch.setattr(kernels_pallas, "sparse_attention_decode",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    out = tmp_path / "rows.json"
    bk.main(["--smoke", "--contexts", "8192", "--batches", "1", "--only", "attention", "--att-variant", "dispatch",
             "--dense-limit-gb", "0", "--out", str(out)])
    row = next(r for r in json.loads(out.read_text()) if r.get("piece") == "attention" and "dispatch" in r["impl"])
    assert calls and calls[0][0] == 1 and row["rel_err"] < 5e-3, (calls, row)


def test_the_two_errors_are_the_norms_they_name():
    """`rel_err` is the L2 ratio over all elements, `max_rel_err` the ratio of the largest magnitudes: one element
    off by 0.5 of a ref whose largest magnitude is 2 gives 0.25 for the latter and 0.5 / ||ref|| for the former."""
    ref = jnp.array([[2.0, -1.0], [0.5, 1.0]], jnp.float32)
    out = ref.at[1, 0].add(0.5).astype(jnp.bfloat16)
    assert bk.max_rel_err(out, ref) == pytest.approx(0.25)
    assert bk.rel_err(out, ref) == pytest.approx(0.5 / np.sqrt(4 + 1 + 0.25 + 1))
