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


def test_attention_points_follow_the_tiles():
    names = att.timeline_names(3)
    assert names[:3] == ["start", "query", "first tile"] and names[-2:] == ["tiles", "stored"]
    assert names[3:-2] == ["logits 0", "p.v 0", "logits 1", "p.v 1", "logits 2", "p.v 2"]
