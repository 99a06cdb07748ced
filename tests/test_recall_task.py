"""The multi-query associative recall task (experiments/recall_task.py) and its scoring."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import recall_task as rt
from experiments.corpus import TOK

FILLER = (np.random.default_rng(0).integers(32, 127, 20_000) + TOK.offset).astype(np.int32)


def _text(ids) -> str:
    return bytes(int(i) - TOK.offset for i in ids if i >= TOK.offset).decode()


@pytest.mark.parametrize("max_distance", [None, 300])
def test_every_query_asks_a_planted_pair_at_its_stated_distance(max_distance):
    rng = np.random.default_rng(1)
    length, n = 1024, 6
    ids, dist = rt.example(FILLER, length, n, max_distance, rng)
    assert ids.shape == (length,) and ids[0] == TOK.bos_id
    ans = rt.answer_positions(length, n)
    for q in range(n):
        value = _text(ids[ans[q]])
        key = _text(ids[ans[q, 0] - rt.QUERY_VALUE_AT:ans[q, 0]])[len("\n# get "):-2]
        plant = _text(ids).index(f"\n# let {key} = ")  # byte index == token index - 1 (the <bos>)
        assert _text(ids[1 + plant:1 + plant + rt.PLANT_LEN]) == f"\n# let {key} = {value}\n"
        assert dist[q] == ans[q, 0] - (1 + plant + rt.PLANT_VALUE_AT)
        assert _text(ids).count(f"# let {key} ") == 1  # keys are distinct
    assert dist.min() > 0
    if max_distance:
        assert dist.max() < max_distance


def test_curriculum_and_refusals():
    assert rt.curriculum(0, 100, 64, 4096) == 64
    assert rt.curriculum(50, 100, 64, 4096) == rt.curriculum(99, 100, 64, 4096) == 4096
    assert 64 < rt.curriculum(25, 100, 64, 4096) < 4096
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="needs at least"):
        rt.example(FILLER, rt.min_length(8) - 1, 8, None, rng)
    with pytest.raises(ValueError, match="no room"):
        rt.example(FILLER, 2048, 8, 8 * (rt.PLANT_LEN + rt.QUERY_LEN), rng)


def test_scores_count_whole_values_and_their_nll():
    rng = np.random.default_rng(3)
    length, n = 512, 4
    ids, _ = rt.batch(FILLER, 2, length, n, None, rng)
    target = ids[:, rt.answer_positions(length, n)]  # [B, Q, D]
    logits = np.zeros((2, n, rt.VALUE_DIGITS, TOK.size), np.float32)
    np.put_along_axis(logits, target[..., None], 5.0, axis=-1)  # right everywhere
    logits[1, 2, 3] = 0.0
    logits[1, 2, 3, (target[1, 2, 3] + 1) % TOK.size] = 5.0  # one wrong digit
    right, nll = rt.scores(logits, ids, length, n)
    assert right.tolist() == [[True] * 4, [True, True, False, True]]
    one = np.log(np.exp(5.0) + TOK.size - 1) - 5.0  # NLL of a right digit
    np.testing.assert_allclose(nll[0], 4 * one, rtol=1e-5)
    np.testing.assert_allclose(nll[1, 2], 3 * one + np.log(np.exp(5.0) + TOK.size - 1), rtol=1e-5)


def test_wilson_interval_and_bins():
    lo, hi = rt.wilson(50, 100)
    assert abs(lo - 0.4038) < 1e-3 and abs(hi - 0.5962) < 1e-3
    assert rt.wilson(0, 0) == (0.0, 1.0) and rt.wilson(10, 10)[1] == pytest.approx(1.0)
    rows = rt.by_distance(np.array([1, 0, 1, 1]), np.array([10, 20, 300, 5000]), [0, 100, 1000, 10_000])
    assert [(r["n"], r["acc"]) for r in rows] == [(2, 0.5), (1, 1.0), (1, 1.0)]


def test_paired_difference_per_bin():
    right = np.array([1, 1, 0, 1, 1, 0])
    base = np.array([1, 0, 0, 1, 0, 1])
    dist = np.array([10, 20, 30, 300, 400, 500])
    lo_bin, hi_bin, empty = rt.paired_difference(right, base, dist, [0, 100, 1000, 2000])
    d = np.array([0.0, 1.0, 0.0])  # the first bin's paired differences
    half = 1.959964 * d.std(ddof=1) / np.sqrt(3)
    assert lo_bin["n"] == 3 and lo_bin["diff"] == pytest.approx(1 / 3)
    assert lo_bin["ci95"] == pytest.approx((1 / 3 - half, 1 / 3 + half))
    assert hi_bin["diff"] == pytest.approx(0.0) and hi_bin["ci95"][1] > 0 > hi_bin["ci95"][0]  # +1 and -1
    assert empty["n"] == 0 and np.isnan(empty["diff"])
    same = rt.paired_difference(right, right, dist, [0, 1000])[0]
    assert same["diff"] == 0 and same["ci95"] == (0.0, 0.0)


def test_training_batches_mix_recall_rows_at_the_current_distance():
    from experiments.corpus import training_batches
    reach = {"d": 200}
    data = training_batches(FILLER, 6, 511, 0.0, np.random.default_rng(4), 1.0, 4, lambda: reach["d"], 8.0)
    first = next(data)
    ans = rt.answer_positions(512, 4)
    for row in first["tokens"]:  # every row a recall example, its plants within 200 tokens of the queries
        assert all(_text(row[a[0] - rt.QUERY_VALUE_AT:a[0]]).startswith("\n# get ") for a in ans)
        assert _text(row[:ans[0, 0] - 200]).count("# let ") == 0
    # the targets that are answer digits (target i predicts token i + 1) weigh 8, the others 1
    want = np.ones((6, 511), np.float32)
    want[:, ans.ravel() - 1] = 8.0
    np.testing.assert_array_equal(first["weights"], want)
    reach["d"] = 500
    later = next(data)
    assert any(_text(row[:ans[0, 0] - 200]).count("# let ") > 0 for row in later["tokens"])
