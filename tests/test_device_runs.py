"""The device scripts' steps parse on any machine: every step of `experiments.device_runs.issue12_decode` names an
importable module (or a test file) and, where that module parses its arguments (bench_decode, profile_step, the
decode CLI), the step's argument list parses. A device call costs minutes of a lent GPU; a wrong argument list
found there (the twenty-ninth session's `--chunk 40` step) costs the call."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

from experiments.device_runs import issue12_decode

PARSERS = {"experiments.bench_decode", "experiments.profile_step", "experiments.decode"}
STEPS = sorted({(name, tuple(argv)) for steps in issue12_decode.GROUPS.values() for name, argv, *_ in steps})


@pytest.mark.parametrize("name,argv", STEPS, ids=[name for name, _ in STEPS])
def test_step_parses(name, argv):
    module, *args = argv
    if module == "pytest":
        assert all(os.path.exists(a) for a in args if a.startswith("tests/")), args
        return
    # found, not imported: a device script may act at import (issue12_pdl_probe sets XLA_FLAGS from sys.argv)
    assert importlib.util.find_spec(module) is not None, module
    if module in PARSERS:
        out = ["--out", "/tmp/x.json"] if module == "experiments.bench_decode" else []  # as the runner adds
        importlib.import_module(module).parse_args([*args, *out])


def test_the_check_catches_a_wrong_list_and_a_missing_module():
    """The twenty-ninth session's wrong step (a stray "160") and a module that does not exist both fail the check."""
    with pytest.raises(SystemExit):
        test_step_parses("bad", ("experiments.bench_decode", "--batch", "1", "--steps", "160", "160", "--chunk", "40"))
    with pytest.raises(AssertionError):
        test_step_parses("missing", ("experiments.device_runs.no_such_script",))
    with pytest.raises(AssertionError):
        test_step_parses("missing", ("pytest", "tests/test_no_such_file.py", "-q"))


TREES = issue12_decode.TREES


@pytest.mark.parametrize("end", sorted(TREES))
def test_each_revert_applies_to_this_tree(end, tmp_path):
    """A step ending in `end` runs in a copy of the tree with its list of changes taken back: each change's text must
    occur once (tree_before raises on the device otherwise, before the step runs)."""
    from experiments.device_runs._steps import tree_before
    root = tree_before(TREES[end], str(tmp_path / "tree"))
    for path, _, before in TREES[end]:
        assert before in open(os.path.join(root, path)).read()


def test_keep_hlo_keeps_the_largest_optimized_module(tmp_path, monkeypatch):
    """The largest `*after_optimizations.txt` of a dump comes back gzipped under $OUT; none there is an error that
    names the flags."""
    import gzip

    from experiments.device_runs import keep_hlo
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_1.jit_small.sm_9.0_gpu_after_optimizations.txt").write_text("HloModule small\n")
    (dump / "module_2.jit__generate.sm_9.0_gpu_after_optimizations.txt").write_text("HloModule big\n" * 50)
    (dump / "module_2.jit__generate.sm_9.0_gpu_after_optimizations-buffer-assignment.txt").write_text("x" * 9999)
    monkeypatch.setattr(keep_hlo, "OUT", str(tmp_path / "out"))
    kept = keep_hlo.keep(str(dump), "b1")
    assert kept == str(tmp_path / "out" / "b1.hlo.txt.gz")
    assert gzip.open(kept, "rt").read() == "HloModule big\n" * 50
    with pytest.raises(ValueError, match="xla_dump_to"):
        keep_hlo.keep(str(tmp_path), "none")


def test_run_groups_runs_the_groups_in_order_and_stops_at_failed_tests(tmp_path, monkeypatch):
    """The issue-21 device scripts' shared runner: an unknown group fails before anything runs; the groups run in
    the order given with the shared ones beside a script's own; a failed test step ends the run with its code."""
    from experiments.device_runs import _steps, issue21_timeline as tl
    monkeypatch.setattr(_steps, "OUT", str(tmp_path))
    ran = []
    own = {name: (lambda say, rows, name=name: ran.append(name)) for name in ("b", "a")}
    with pytest.raises(SystemExit, match="unknown groups"):
        tl.run_groups(["a", "nope"], own)
    assert ran == []
    assert tl.run_groups(["tests", "a", "b"], own, tests=lambda say: 0) == 0 and ran == ["a", "b"]
    assert tl.run_groups(["tests", "b"], own, tests=lambda say: 3) == 3 and ran == ["a", "b"]


def test_before_runs_each_earlier_form_in_its_own_tree(tmp_path, monkeypatch):
    """`issue21_roles before`: a `<name>.py` replaces the attention's kernel file in a copy of the tree, a folder is
    copied over it at its paths; each copy runs the command's timing groups (and ptx when the command has it) with
    its own $OUT folder; the scan's tests join with a scan."""
    from experiments.device_runs import issue21_roles as roles
    before, out = tmp_path / "before", tmp_path / "out"
    (before / "scan_q" / "kernels_pallas").mkdir(parents=True)
    (before / "scan_q" / "kernels_pallas" / "gpu_indexer_wgmma.py").write_text("the scan before")
    (before / "abc123.py").write_text("the attention before")
    out.mkdir()

    def tree(reverts, dest):
        root = tmp_path / os.path.basename(dest)
        (root / "kernels_pallas").mkdir(parents=True, exist_ok=True)
        return str(root)

    calls = []

    def step(name, argv, timeout_s, env, cwd):
        calls.append((name, argv[2:], env["OUT"]))
        (out / f"{name}.log").write_text("timed")

    monkeypatch.setattr(roles, "BEFORE", str(before))
    monkeypatch.setattr(roles, "OUT", str(out))
    monkeypatch.setattr(roles, "tree_before", tree)
    monkeypatch.setattr(roles, "step", step)
    roles.before_group(lambda *a: None, ["scan"])
    assert calls == [("before_abc123", ["scan"], str(out / "before_abc123")),
                     ("before_scan_q", ["scan"], str(out / "before_scan_q"))]
    assert (tmp_path / "tree_abc123" / "kernels_pallas" / "gpu_attention_wgmma.py").read_text() == "the attention before"
    assert (tmp_path / "tree_scan_q" / "kernels_pallas" / "gpu_indexer_wgmma.py").read_text() == "the scan before"
    calls.clear()
    monkeypatch.setattr(roles, "run_groups", lambda groups, own, tests: own["before"](lambda *a: None, []))
    roles.main(["tests", "model", "before", "ptx"])
    assert [groups for _, groups, _ in calls] == [["model", "ptx"]] * 2
    assert roles.ptx_kernels(["tests", "attention_b64", "before", "ptx"]) == ("attention",)
    assert roles.ptx_kernels(["scan", "ptx"]) == ("scan",) and roles.ptx_kernels(["ptx"]) == ("attention",)
    assert roles.ptx_kernels(["model", "scan_untimed", "ptx"]) == ("attention", "scan")
    assert roles.gpu_test_files(["tests", "scan", "before"]) == ("tests/test_attention_wgmma.py",
                                                                 "tests/test_indexer_wgmma.py")
    assert roles.gpu_test_files(["tests", "attention"]) == ("tests/test_attention_wgmma.py",)


def test_a_timeline_with_warpgroups_is_said_a_line_each():
    from experiments.device_runs.issue21_timeline import say_timeline
    lines = []
    say = lambda *a: lines.append(" ".join(map(str, a)))  # noqa: E731
    say_timeline(say, "timeline b64", {"warpgroup 0": {"span_us": 1.0}, "warpgroup 1": {"span_us": 2.0}})
    say_timeline(say, "timeline b8", {"span_us": 3.0, "start": (0.1, 0.2, 0.3)})
    assert lines == ["timeline b64 warpgroup 0: {'span_us': 1.0}", "timeline b64 warpgroup 1: {'span_us': 2.0}",
                     "timeline b8: {'span_us': 3.0, 'start': (0.1, 0.2, 0.3)}"]


def test_ncu_pages_read_back_as_the_kernel_must_have_run(tmp_path):
    """The Nsight Compute pages the fiftieth session brought back (one H100, the scan at 1M x 8 with and without
    its decode) read back through the script's own parsers into what the kernel's structure fixes: 8 HGMMAs a warp
    a 64-position tile (131,072 tiles, 4 warps each), the keys and scales read from DRAM and the f32 scores
    written, ncu's thousands separators parsed, and the decode's LOP3s gone from the no-decode form."""
    import tarfile

    from experiments.device_runs import issue21_ncu as ncu

    call1, call2 = (f"docs/bench_decode/h100_session50_call{k}_ncu_pages.tar.gz" for k in (1, 2))
    pages = {**ncu.source_pages(call1), **ncu.source_pages(call2)}
    assert {"scan_1m8", "scan_1m8_nodecode", "scan_128k8", "attention_b64"} <= set(pages)
    tiles = 8 * (1 << 20) // 64
    executed = {case: ncu.by_opcode(pages[case], "Instructions Executed") for case in ("scan_1m8", "scan_1m8_nodecode")}
    for case, ops in executed.items():
        assert ops["HGMMA"] == 8 * 4 * tiles, case
    assert executed["scan_1m8"]["LOP3"] - executed["scan_1m8_nodecode"]["LOP3"] >= 60 * 4 * tiles
    assert ncu.opcode("@!P1  BRA 0x7f7d597e3630") == "BRA"

    with tarfile.open(call1) as tar:
        tar.extract("scan_1m8.raw.csv", tmp_path, filter="data")
    (row,) = ncu.raw_rows(str(tmp_path / "scan_1m8.raw.csv"))
    assert row["Kernel Name"].startswith(ncu.KERNEL["scan"])
    positions = 8 * (1 << 20)
    assert 1e5 < ncu.as_float(row["gpu__time_duration.sum"]) < 1e6  # ns: ~224 us
    assert ncu.as_float(row["dram__bytes_read.sum"]) >= positions * (64 + 4)  # FP4 keys + E8M0 scales
    assert ncu.as_float(row["dram__bytes_write.sum"]) >= positions * 4  # f32 scores


def _scan_groups_on_cpu(monkeypatch, stub):
    """The scan's device groups made to run on a CPU: the wgmma scan replaced by `stub`, the Triton twin
    interpreted, one small point (128 positions x 2), untimed (1 us a call against a 1 TB/s copy)."""
    from experiments import bench_kernels as bk
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_indexer, gpu_indexer_wgmma as scan
    from tests.kernel_checks import index_case

    triton = gpu_indexer.indexer_scores
    monkeypatch.setattr(gpu_indexer, "indexer_scores", lambda *a, **kw: triton(*a, interpret=True, **kw))
    monkeypatch.setattr(scan, "indexer_scores_wgmma", stub)
    monkeypatch.setattr(tl, "SCAN_POINTS", ((128, 2),))
    monkeypatch.setattr(bk, "index_data", lambda key, b, n: index_case(3, b, 4, 128, n))
    monkeypatch.setattr(bk, "hbm_copy_bandwidth", lambda gb: 1e12)
    monkeypatch.setattr(bk, "time_hbm_output", lambda fn, args, perturb: (1e-6, {"pallas_us": 1.0}, fn(*args)))


@pytest.mark.parametrize("fused", ["equal", "differs", "fails"])
def test_blockmax_group_checks_the_fused_maxima_against_the_xla_form(monkeypatch, fused):
    """`issue21_timeline blockmax` on a CPU with the scan stubbed by its Triton twin: a row for each point, layout
    and form; the epilogue's maxima said bit-equal to the XLA form's when they are, how many places differ when
    not (a stub whose maxima are off by one place), and a fused form that fails said failed while the other rows
    still come."""
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_indexer

    triton = gpu_indexer.indexer_scores

    def stub(q, w, v, s, r, *, q_parts, layout, block=None):
        assert q_parts == 1 and layout in ("nibbles", "sm90")
        out = triton(q, w, v, s, r, interpret=True, layout=layout)
        if block is None:
            return out
        if fused == "fails":
            raise RuntimeError("stub: no fused kernel")
        maxima = out.reshape(out.shape[0], -1, block).max(-1)
        return out, maxima.at[0, 0].add(1.0) if fused == "differs" else maxima

    _scan_groups_on_cpu(monkeypatch, stub)
    lines, rows = [], []
    tl.blockmax_group(lambda *a: lines.append(" ".join(map(str, a))), rows)
    assert [r[1] for r in rows] == [f"128 x 2, {lay}, {form}" for lay in ("nibbles", "sm90")
                                    for form in ("XLA maxima after", "epilogue maxima")]
    got = [r[5] for r in rows if "epilogue" in r[1]]
    if fused == "fails":
        assert got == ["RuntimeError"] * 2 and all(r[2] == "failed" for r in rows if "epilogue" in r[1])
        assert any("FAILED: RuntimeError: stub: no fused kernel" in line for line in lines)
    else:
        want = "DIFFERS from XLA maxima after at 1 places" if fused == "differs" else "bit-equal to XLA maxima after"
        assert all(e.startswith("twin 0.0e+00, -inf same") and e.endswith(want) for e in got), got
    assert [r[5] for r in rows if "XLA" in r[1]] == ["twin 0.0e+00, -inf same"] * 2


def test_words_configs_group_runs_each_config_on_the_words(monkeypatch):
    """`issue21_timeline words_configs` on a CPU with the scan stubbed by the Triton twin on the words: a row a
    point and config, each scored against the twin on the released nibbles (so equal)."""
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_indexer

    triton, seen = gpu_indexer.indexer_scores, []

    def stub(q, w, v, s, r, *, q_parts, layout, ctas, tiles_per_step, stages):
        seen.append((ctas, tiles_per_step, stages))
        assert q_parts == 1 and layout == "sm90"
        return triton(q, w, v, s, r, interpret=True, layout=layout)

    _scan_groups_on_cpu(monkeypatch, stub)
    rows = []
    tl.words_configs_group(lambda *a: None, rows)
    assert seen == list(tl.WORDS_CONFIGS)  # each config called once: its error is the timed call's output
    assert [r[5] for r in rows] == ["0.0e+00, -inf same"] * len(tl.WORDS_CONFIGS)


def test_fresh_group_checks_the_fresh_product_against_plgpu_wgmma(monkeypatch):
    """`issue21_timeline fresh` on a CPU with the scan stubbed by its Triton twin: a row a point, layout and form,
    the fresh_product form asked for by `fresh=True` and said bit-equal to the plgpu.wgmma form."""
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_indexer

    triton, seen = gpu_indexer.indexer_scores, []

    def stub(q, w, v, s, r, *, q_parts, layout, fresh):
        seen.append(fresh)
        assert q_parts == 1 and layout in ("nibbles", "sm90")
        return triton(q, w, v, s, r, interpret=True, layout=layout)

    _scan_groups_on_cpu(monkeypatch, stub)
    rows = []
    tl.fresh_group(lambda *a: None, rows)
    assert [r[1] for r in rows] == [f"128 x 2, {lay}, {form}" for lay in ("nibbles", "sm90")
                                    for form in ("plgpu.wgmma", "fresh_product")]
    assert seen == [False, True] * 2  # each form called once: its error is the timed call's output
    assert [r[5] for r in rows] == ["twin 0.0e+00, -inf same", "twin 0.0e+00, -inf same; bit-equal to plgpu.wgmma"] * 2


def _jnp_attention(q, wv, ws, ok, ev, es, idx, sink, scale):
    """The attention kernels' positional contract on the jnp twin (f32 out): the stub of the device groups' tests."""
    import jax.numpy as jnp

    from dsv41_jax import ops, quant

    return ops.sparse_attention_decode(q.astype(jnp.float32), {"values": wv, "scales": ws}, ok, quant.WINDOW_KV,
                                       {"values": ev, "scales": es}, idx, quant.MAIN_KV, sink, scale)


def test_batch1_group_times_the_model_call_with_each_min_batch(monkeypatch):
    """`issue21_timeline batch1` on a CPU with both attention kernels stubbed by the jnp twin (and the dispatch told
    it runs compiled on a Hopper): each MIN_BATCH asked for takes its kernel (2: Triton, 1: wgmma), each row's
    error (the model's form: rope taken off, bf16 out) within bf16's rounding of the twin, and the module's
    MIN_BATCH is given back after."""
    import kernels_pallas
    from experiments import bench_kernels as bk
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_attention, gpu_attention_wgmma as att

    seen, data = [], bk.attention_data

    def twin(kind):
        def kernel(*a, unrotate, out_dtype, **_):
            seen.append(kind)
            return gpu_attention.finish(_jnp_attention(*a), unrotate, out_dtype)
        return kernel

    monkeypatch.setattr(kernels_pallas, "platform", lambda family=None: ("gpu", False))
    monkeypatch.setattr(att, "supported", lambda *a: True)
    monkeypatch.setattr(att, "sparse_attention_wgmma", twin("wgmma"))
    monkeypatch.setattr(gpu_attention, "sparse_attention", twin("triton"))
    monkeypatch.setattr(bk, "attention_data", lambda key, b, n: data(key, b, 1024))
    monkeypatch.setattr(bk, "hbm_copy_bandwidth", lambda gb: 1e12)
    monkeypatch.setattr(bk, "time_hbm_output", lambda fn, args, perturb: (1e-6, {"pallas_us": 1.0}, fn(*args)))
    rows, before = [], att.MIN_BATCH
    tl.batch1_group(lambda *a: None, rows)
    assert seen == ["triton", "wgmma", "triton", "wgmma"]  # once a row: its error is the timed call's output
    assert [r[1] for r in rows] == [f"128K x 1, the model's call, MIN_BATCH {m}" for m in (2, 1, 2, 1)]
    assert all(0 < float(r[5]) < 1e-2 for r in rows), rows
    assert att.MIN_BATCH == before


def test_scan_rows_score_each_variant_with_its_timed_output(monkeypatch):
    """`issue21_timeline`'s scan rows on a CPU (the wgmma scan stubbed by its Triton twin): a row a variant, its
    keyword arguments passed, the kernel called once a row (the error is the timed call's output), a wrong variant
    said wrong."""
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_indexer

    triton, seen = gpu_indexer.indexer_scores, []

    def stub(q, w, v, s, r, *, q_parts, off=0.0):
        seen.append(off)
        return triton(q, w, v, s, r, interpret=True) + off

    _scan_groups_on_cpu(monkeypatch, stub)
    args, moved = tl.scan_case(128, 2)
    rows = []
    fns = tl.scan_rows(lambda *a: None, rows, "128 x 2", args, moved, 1e12, {"as is": {}, "off": {"off": 0.5}})
    assert len(fns) == 2 and seen == [0.0, 0.5]
    assert [r[1] for r in rows] == ["128 x 2, as is", "128 x 2, off"]
    assert rows[0][5] == "0.0e+00, -inf same" and not rows[1][5].startswith("0.0e+00"), rows


def test_attention_group_scores_each_row_with_its_timed_output(monkeypatch):
    """`issue21_timeline`'s attention rows on a CPU (the wgmma kernel stubbed by the jnp twin, 1024 entries, its
    second call's output 1% off): a row a q dtype, the kernel called once a row, each row's error that of its own
    timed call, the outputs returned those calls'."""
    import jax.numpy as jnp
    import numpy as np

    from experiments import bench_kernels as bk
    from experiments.device_runs import issue21_timeline as tl
    from kernels_pallas import gpu_attention_wgmma as att

    seen, data = [], bk.attention_data

    def twin(q, *a, scale):
        seen.append(q.dtype)
        return _jnp_attention(q, *a, scale) * (1 + 0.01 * (len(seen) - 1))

    monkeypatch.setattr(att, "sparse_attention_wgmma", twin)
    monkeypatch.setattr(bk, "attention_data", lambda key, b, n, dtype: data(key, b, 1024, dtype))
    monkeypatch.setattr(bk, "time_hbm_output", lambda fn, args, perturb: (1e-6, {"pallas_us": 1.0}, fn(*args)))
    rows = []
    outs = tl.attention_group(lambda *a: None, rows, timelines=False, batches=(2,), peak=1e12)
    assert seen == [jnp.float32, jnp.bfloat16]
    assert [r[1] for r in rows] == ["128K x 2, q float32", "128K x 2, q bfloat16"]
    assert [r[5] for r in rows] == ["0.0e+00", "1.0e-02"], rows
    assert len(outs) == 2 and not np.array_equal(outs[0], outs[1])
