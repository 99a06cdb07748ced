"""experiments.profile_step: kernels attributed to the model code that made them (the parts that run on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dsv41_jax as d
from dsv41_jax import api
from dsv41_jax.moe import MoE
from experiments import profile_step as ps
from experiments.bench_decode import truncated

# tiny's first 3 layers (window, window + Engram, Full with an indexer; MoE in each): the same kinds of kernels
# to attribute as the whole model, in a fraction of its compile
CFG = truncated(d.preset("tiny"), 3)


def test_op_names_carry_the_class_and_method_and_the_patch_is_undone():
    original = MoE.__call__
    params = d.init_params(CFG, seed=0)
    cache = d.init_cache(CFG, 2, 32)
    with ps.scoped_methods() as n:
        assert n > 20 and MoE.__call__ is not original
        hlo = jax.jit(lambda p, c, t: api.forward(CFG, p, c, t, jnp.ones((2,), jnp.int32))[0]).lower(
            params, cache, jnp.zeros((2, 1), jnp.int32)).compile().as_text()
    assert MoE.__call__ is original
    sources = ps.kernel_sources(hlo)
    where = set(sources.values())
    assert any(w.startswith("MoE.__call__/Router.__call__:") for w in where), sorted(where)[:20]
    assert any("Attention." in w for w in where)
    # every instruction name is matched with . and - spelled _ (as the profiler names kernels)
    assert all("." not in k and "-" not in k for k in sources)


def test_attribute_sums_per_step_and_keeps_unknown_names():
    events = [{"name": "fusion_1", "dur": 4.0}, {"name": "fusion_1", "dur": 6.0}, {"name": "MemcpyD2D", "dur": 2.0}]
    rows = ps.attribute(events, {"fusion_1": "MoE.__call__/MoE._routed:add"}, steps=2)
    assert rows == {"MoE.__call__/MoE._routed:add": [1.0, 5.0], "MemcpyD2D": [0.5, 1.0]}


def test_host_in_gaps_charges_only_the_large_gaps():
    """A 90 us GPU gap (kernels end at 10, the next starts at 100) and a 5 us one: the host events that overlap
    the large one are listed with their overlap; the small gap and the events outside are not."""
    kernels = [{"name": "a", "ts": 0, "dur": 10}, {"name": "b", "ts": 100, "dur": 10}, {"name": "c", "ts": 115, "dur": 5}]
    host = [{"name": "cuGraphLaunch", "ts": 20, "dur": 200}, {"name": "launch c", "ts": 111, "dur": 3},
            {"name": "early", "ts": 0, "dur": 5}]
    n, during = ps.host_in_gaps(kernels, host)
    assert n == 1 and during == {"cuGraphLaunch": [1, 80]}


def test_idle_before_charges_each_gap_to_the_kernel_after_it():
    """Overlapping kernels count as busy (a2 runs inside and past a): the gaps are 20..100 (before b) and 110..115."""
    kernels = [{"name": "a", "ts": 0, "dur": 10}, {"name": "a2", "ts": 5, "dur": 15}, {"name": "b", "ts": 100, "dur": 10},
               {"name": "c", "ts": 115, "dur": 5}]
    assert ps.idle_before(kernels, {"b": "Attention:dot"}, steps=2) == {"Attention:dot": [0.5, 40.0], "c": [0.5, 2.5]}


def test_one_step_lists_a_middle_steps_kernels_in_order_with_the_idle_before_each():
    """Three steps of two kernels each (the LM head's last): the middle one is listed from the kernel after the
    first head up to the second head, each with its start after the first head's end and the GPU idle since the
    previous kernel ended (overlap counts as busy)."""
    src = {"head": "Transformer.forward/Linear.__call__:dot_general", "mm": "MoE.__call__/MoE._routed:gather"}
    kernels = [{"name": n, "ts": ts, "dur": dur} for n, ts, dur in
               [("mm", 0, 2), ("head", 3, 4), ("mm", 10, 2), ("head", 11, 5), ("mm", 20, 1), ("head", 22, 1)]]
    assert ps.one_step(kernels, src) == [(3, 3.0, 2, src["mm"]), (4, 0.0, 5, src["head"])]
    assert ps.one_step(kernels[:2], src) == []  # one step: no step boundary to cut at


def test_one_step_of_chunked_calls_is_not_a_calls_first():
    """Two calls of 3 steps, each step's kernel named by its index: the listed step is call 2's middle one (4),
    not its first (3), which also runs the call's start."""
    src = {"head": "Transformer.forward/Linear.__call__:dot_general"}
    kernels = [{"name": n, "ts": 10 * i + dt, "dur": 1} for i in range(6) for n, dt in ((f"k{i}", 0), ("head", 5))]
    assert [row[-1] for row in ps.one_step(kernels, src, chunk=3)] == ["k4", src["head"]]
    assert [row[-1] for row in ps.one_step(kernels, src)] == ["k3", src["head"]]  # no chunk: the middle


def test_alone_charges_only_the_time_a_kernel_runs_by_itself():
    """a 0..10 and a2 5..20 overlap on 5..10; b 30..40 runs alone; c 40..45 starts as b ends (not an overlap). Busy
    0..20 and 30..45 (35 us in 5 steps); alone: a 5 us, a2 10, b 10, c 5."""
    kernels = [{"name": "a", "ts": 0, "dur": 10}, {"name": "a2", "ts": 5, "dur": 15}, {"name": "b", "ts": 30, "dur": 10},
               {"name": "c", "ts": 40, "dur": 5}]
    busy, solo = ps.alone(kernels, {"b": "MoE:dot"}, steps=5)
    assert busy == 35 / 5
    assert solo == {"a": [0.2, 1.0], "a2": [0.2, 2.0], "MoE:dot": [0.2, 2.0], "c": [0.2, 1.0]}


def test_host_lead_compares_each_iteration_with_its_gpu_step():
    """Three GPU steps (a kernel, then the LM head) starting at 10, 160 and 400; the host starts its iterations at 0,
    150 and 170: leads 10, 10 and 230 (min 10, median 10). Moved to 100, the third host start is the second
    iteration: leads 10, 60, 250. Counts that do not match give None."""
    head = "Transformer.forward/Linear.__call__:dot_general"
    kernels = []
    for t0 in (10, 160, 400):
        kernels += [{"name": "k", "ts": t0, "dur": 50}, {"name": "head", "ts": t0 + 50, "dur": 50}]
    host = [{"name": f"[iter={i}]", "ts": t, "dur": d} for i, (t, d) in enumerate(((0, 140), (150, 20), (170, 30)))]
    host.append({"name": "cuGraphLaunch", "ts": 1, "dur": 5})
    lead = ps.host_lead(kernels, host, {"head": head})
    assert lead == {"host_us": 30, "lead_us": [10, 10]}
    host[2]["ts"] = 100
    assert ps.host_lead(kernels, host, {"head": head})["lead_us"] == [10, 60]
    assert ps.host_lead(kernels, host[:2], {"head": head}) is None
    assert ps.attribute(host, {}, steps=3) == {"[iter=0]": [1 / 3, 140 / 3], "[iter=1]": [1 / 3, 20 / 3],
                                             "[iter=2]": [1 / 3, 10.0], "cuGraphLaunch": [1 / 3, 5 / 3]}


def test_weight_idle_counts_the_time_no_weight_stream_runs_and_shares_it():
    """An FP8 weight kernel 0..10; a small kernel 5..15 (5 us with no weight stream: alone); two small kernels
    20..30 and 25..30 (10 us, shared: 7.5 and 2.5); the LM head 30..40 (a weight stream). Two steps."""
    head = "Transformer.forward/Linear.__call__:dot_general"
    kernels = [{"name": "fp8_wgmma_5120x8192_mosaic_gpu_kernel", "ts": 0, "dur": 10}, {"name": "a", "ts": 5, "dur": 10},
               {"name": "b", "ts": 20, "dur": 10}, {"name": "c", "ts": 25, "dur": 5}, {"name": "h", "ts": 30, "dur": 10}]
    total, by = ps.weight_idle(kernels, {"h": head, "c": "Attention.__call__/Attention.project_out:concatenate"}, steps=2)
    assert total == 7.5
    assert by == {"a": [0.5, 2.5], "b": [0.5, 3.75], "Attention.__call__/Attention.project_out:concatenate": [0.5, 1.25]}


def test_saved_events_give_the_same_report_on_any_machine(tmp_path, capsys):
    """A traced call's events saved and read back (`--from-events`) give the same tables as the live analysis."""
    head = "Transformer.forward/Linear.__call__:dot_general"
    kernels = [{"name": n, "ts": 10 * i + dt, "dur": 2} for i in range(4) for n, dt in (("k", 0), ("head", 5))]
    host = [{"name": f"[iter={i}]", "ts": 10 * i - 3, "dur": 1} for i in range(4)]
    path = str(tmp_path / "events.json.gz")
    ps.save_events(path, kernels, host, {"head": head, "unused": "x"}, steps=4, chunk=2)
    got = ps.load_events(path)
    assert got == (kernels, host, {"head": head}, 4, 2)
    args = ps.parse_args(["--timeline", "--top", "5"])
    live = ps.report(kernels, host, {"head": head}, 4, 2, args)
    first = capsys.readouterr().out
    again = ps.main(["--from-events", path, "--timeline", "--top", "5"])
    assert again == live and first in capsys.readouterr().out
    assert live["no_weight_stream_us_per_step"] == 2.0 and live["host_lead"]["lead_us"] == [3, 3]
