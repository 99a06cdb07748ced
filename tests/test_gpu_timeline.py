"""Per-CTA timelines (`kernels_pallas.gpu_timeline`): the phases read off a timeline, across the timer's wrap, and
the attention's points. That the kernels lower with a timeline is in their own lowering tests
(tests/test_indexer_wgmma.py, tests/test_attention_wgmma.py); a GPU runs them in
experiments.device_runs.issue21_timeline."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_pallas import gpu_attention_wgmma as att
from kernels_pallas import gpu_timeline


def test_phases_reads_spans_medians_and_sms_across_the_timers_wrap():
    # 4 CTAs, points (start, mid, end) in ns from a base just below the 32-bit wrap, SM ids in the last column
    base = 2**32 - 1500
    ns = np.array([[0, 1000, 5000], [200, 2200, 4200], [4000, 6000, 9000], [4100, 5100, 7100]], np.int64)
    timeline = np.concatenate([(base + ns) % 2**32, np.array([[3], [7], [3], [7]])], axis=1).astype(np.uint32)
    got = gpu_timeline.phases(timeline, ["start", "mid", "end"])
    assert got["span_us"] == pytest.approx(9.0)
    assert got["sms"] == 2 and got["ctas_per_sm"] == 2
    assert got["start"] == (pytest.approx(2.1), pytest.approx(4.07), pytest.approx(4.1))  # waiting to start
    assert got["mid"] == (pytest.approx(1.5), pytest.approx(2.0), pytest.approx(2.0))
    assert got["end"] == (pytest.approx(2.5), pytest.approx(3.7), pytest.approx(4.0))


def test_phases_sums_a_repeated_kind_per_cta():
    # 2 CTAs: start, then per tile i "logits i" and "p.v i" (2 tiles), then end
    ns = np.array([[0, 1000, 3000, 4000, 7000, 8000], [0, 2000, 3000, 5000, 6000, 6500]], np.int64)
    timeline = np.concatenate([ns, np.array([[0], [1]])], axis=1).astype(np.uint32)
    names = ["start", "logits 0", "p.v 0", "logits 1", "p.v 1", "end"]
    got = gpu_timeline.phases(timeline, names)
    assert got["logits *"] == (pytest.approx(3.0), pytest.approx(3.8), pytest.approx(4.0))  # 1 + 1 and 2 + 2 us
    assert got["p.v *"] == (pytest.approx(3.5), pytest.approx(4.7), pytest.approx(5.0))  # 2 + 3 and 1 + 1 us
    assert "start *" not in got and got["end"] == (pytest.approx(0.75), pytest.approx(0.95), pytest.approx(1.0))


def test_phases_by_group_measures_each_group_from_its_own_start():
    # 2 CTAs; group a: (start, end), group b: (start, work), stamped from another thread that starts later
    ns = np.array([[0, 4000, 1000, 3000], [500, 2500, 2500, 3500]], np.int64)
    timeline = np.concatenate([ns, np.array([[0], [1]])], axis=1).astype(np.uint32)
    got = gpu_timeline.phases_by_group(timeline, {"a": ["start", "end"], "b": ["start", "work"]})
    assert got["a"]["end"] == (pytest.approx(3.0), pytest.approx(3.8), pytest.approx(4.0))
    assert got["b"]["work"] == (pytest.approx(1.5), pytest.approx(1.9), pytest.approx(2.0))
    assert got["b"]["span_us"] == pytest.approx(2.5)  # from group b's first stamp (1000 ns) to its last (3500)
    with pytest.raises(ValueError, match="3 points and the SM id, for a timeline of 5 columns"):
        gpu_timeline.phases_by_group(timeline, {"a": ["start", "end"], "b": ["start"]})


def test_attention_points_follow_the_tiles():
    groups = att.timeline_groups(3)
    wg0, wg1, wg2 = groups.values()
    assert wg0[:3] == ["start", "query", "first tile"]
    assert wg0[-5:] == ["tiles", "merge stats", "merge rows", "merge staged", "stored"]
    assert wg0[3:-5] == ["logits 0", "p.v 0", "logits 1", "p.v 1", "logits 2", "p.v 2"]
    assert wg1[:3] == ["start", "query", "decode 0"] and wg1[-2:] == ["stats", "stored"]
    assert wg1[3:9] == ["decode 1", "p wait 0", "p.v 0", "decode 2", "p wait 1", "p.v 1"] and len(wg1) == 5 + 3 * 3
    assert wg2 == ["start", "decode 0", "decode 1", "decode 2", "decode 3", "merged"]
    assert att.timeline_names(3) == wg0 + wg1 + wg2
    columns = len(att.timeline_names(5)) + 1  # the device script reads the tiles back from the column count
    from experiments.device_runs.issue21_timeline import attention_points
    assert attention_points(columns) == att.timeline_groups(5)
