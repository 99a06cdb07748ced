"""The command lines as a user meets them: input they cannot use ends in one `error: ...` line naming the
flag or file and exit status 1, checked before the model is built; a cache directory that cannot be
written is refused at start-up; each served request says which prefix path it took and
--no-bounded-replay gives the cold run's tokens; the documented commands run on `tiny`; compiles are
announced with their shapes.

Entry points are called in-process (`main(argv)`) where possible: the checks run before any model setup,
so those tests take milliseconds. Subprocesses cover what only a process shows (exit status, no
traceback, a read-only mount).
"""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import compile_notice, sharding
from dsv41_jax.checkpoint.synthetic import fixture_config, make_tensors, write_checkpoint
from experiments import (_cli, bench_kernels, bench_sharding, bench_weights, cache_bytes, decode, logits, plan_deployment,
                         prefix_reuse, quality, recall, train_small)
from tests.configs import covered_elsewhere, five_layer_presets, five_layers

REPO = Path(__file__).resolve().parents[1]


def call(main, *argv):
    """main(argv) with every argument as a string, as from a shell."""
    return main([str(a) for a in argv])


def fails(main, argv, capsys) -> str:
    """The one stderr line of `main(argv)` ending the run with exit status 1."""
    with pytest.raises(SystemExit) as e:
        call(main, *argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    return err[0]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if an entry point builds a model: the input checks must come first."""
    def built(*a, **k):
        raise AssertionError("the model was built before the input was checked")
    monkeypatch.setattr(d, "init_params", built)


def run_module(module: str, *argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"experiments.{module}", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, **kw)


# ----------------------------------------------------------------------------- bad input: one line, exit 1
def test_an_error_is_one_line_and_exit_1_without_traceback(tmp_path):
    r = run_module("decode", "--prompt-file", tmp_path / "missing.txt")
    assert r.returncode == 1 and r.stdout == ""
    missing = tmp_path / "missing.txt"
    assert r.stderr.strip() == f"error: --prompt-file {missing}: cannot read it (No such file or directory)"


@pytest.mark.parametrize("case", ["missing prompt file", "non-UTF-8 prompt file", "corrupted tokenizer",
                                  "oversized max-new-tokens", "oversized for the engine", "oversized for --capacity",
                                  "no such checkpoint", "prompt ids not npy", "prompt ids out of range",
                                  "output dir missing", "bad mesh", "stop token out of range", "bad page size",
                                  "speculative one token", "weights not in fp8 blocks"])
def test_decode_refuses_bad_input_before_building_the_model(case, tmp_path, capsys, no_model):
    bad_text, tok, ids = tmp_path / "latin1.txt", tmp_path / "tokenizer.json", tmp_path / "ids.npy"
    bad_text.write_bytes("caf\xe9".encode("latin-1"))
    tok.write_text('{"model": {"type": ')
    np.save(ids, np.array([1, 2, 999]))
    argv, want = {
        "missing prompt file": (["--prompt-file", tmp_path / "no"], f"--prompt-file {tmp_path / 'no'}: cannot read"),
        "non-UTF-8 prompt file": (["--prompt-file", bad_text], f"--prompt-file {bad_text}: not UTF-8 text (byte 3"),
        "corrupted tokenizer": (["--tokenizer", tok], f"--tokenizer: {tok}: not a valid tokenizer.json"),
        "oversized max-new-tokens": (["--max-new-tokens", 5000], "--max-new-tokens 5000: the prompt (91 tokens) + 5000 "
                                     "new tokens need 5091 cache tokens, more than the model's max_seq_len (4096); "
                                     "use --max-new-tokens 4005 or less"),
        "oversized for the engine": (["--engine", "--max-new-tokens", 4050], "--max-new-tokens 4050: "),
        "oversized for --capacity": (["--capacity", 100, "--max-new-tokens", 20], "more than --capacity (100)"),
        "no such checkpoint": (["--checkpoint", tmp_path / "no"], f"--checkpoint {tmp_path / 'no'}: no such directory"),
        "prompt ids not npy": (["--prompt-ids", bad_text], f"--prompt-ids {bad_text}: not a .npy array"),
        "prompt ids out of range": (["--prompt-ids", ids], f"--prompt-ids {ids}: ids must be in [0, 320)"),
        "output dir missing": (["--output-json", tmp_path / "no" / "r.json"], "--output-json"),
        "bad mesh": (["--mesh", "tensor=3"], "--mesh tensor=3: "),
        "stop token out of range": (["--engine", "--stop-token", 400], "--stop-token 400: not an id of this model"),
        "bad page size": (["--engine", "--page-tokens", 33], "(--page-tokens, --slots, --hbm-budget-gb, --capacity): "
                          "page_tokens=33 must be a positive multiple"),
        "speculative one token": (["--speculative", "dspark", "--max-new-tokens", 1],
                                  "--speculative needs --max-new-tokens >= 2"),
        "weights not in fp8 blocks": (["--weight-format", "fp8"], "--weight-format fp8: tiny does not fit the "
                                      "released formats (last dim 16 is not a multiple of the scale block 32)"),
    }[case]
    line = fails(decode.main, argv, capsys)
    assert want in line, (want, line)


H200_BYTES = 139.8 * 2**30  # an H200's allocator limit, so that the sizes below do not depend on this machine


@pytest.mark.parametrize("argv,want", [
    # one device: the released-width model in bf16, then in its released formats
    ([], "v41-flash does not fit: its weights (1421.7 GiB in all) and cache for 1 x 93 tokens (2.7 MiB) need 1421.7 "
         "GiB on one device, and an H200 holds 139.8 GiB (cpu; activations not counted); draw the random weights in "
         "the released formats (--weight-format fp8), split the model over several devices with --mesh"),
    (["--weight-format", "fp8"], "its weights (476.6 GiB in all) and cache for 1 x 93 tokens (2.7 MiB) need 476.6 GiB "
                                 "on one device"),
    # on 8 devices the random weights are drawn in shards; with the Engram tables on them, 152.8 GiB each
    (["--weight-format", "fp8", "--batch", 8, "--mesh", "expert=8", "--layout", "dp_ep"],
     "need 152.8 GiB on each of the --mesh expert=8 devices, and an H200 holds 139.8 GiB (cpu; activations not "
     "counted); plan a wider mesh with `python -m experiments.plan_deployment --preset v41-flash"),
])
def test_decode_refuses_a_model_that_cannot_fit_before_drawing_it(argv, want, monkeypatch, capsys, no_model):
    """Weights + cache over a device's memory: one line with the sizes and what to do, before anything is
    allocated (the full v41-flash's weights are 288-1422 GiB)."""
    monkeypatch.setattr(decode, "device_memory", lambda n: (H200_BYTES, "an H200"))
    monkeypatch.setattr(sharding, "init_model", lambda *a, **k: pytest.fail("drawn before the check"))
    line = fails(decode.main, ["--preset", "v41-flash", "--max-new-tokens", 2, *argv], capsys)
    assert want in line, (want, line)


def test_decode_memory_check_counts_the_weights_and_cache_it_would_place(monkeypatch):
    """The check passes `tiny` on one device and refuses it just below its own weights + cache: what it counts is
    what `init_params` and `init_cache` allocate."""
    cfg = d.preset("tiny")
    need = sum(x.nbytes for x in jax.tree.leaves(d.init_params(cfg))) + \
        sum(x.nbytes for x in jax.tree.leaves(d.init_cache(cfg, 2, 64)))
    args = decode.parse_args(["--preset", "tiny", "--batch", "2"])
    monkeypatch.setattr(decode, "device_memory", lambda n: (float(need), "a device"))
    decode.check_memory(args, cfg, 2, 64)
    monkeypatch.setattr(decode, "device_memory", lambda n: (float(need - 1), "a device"))
    with pytest.raises(_cli.UserError, match="tiny does not fit"):
        decode.check_memory(args, cfg, 2, 64)
    with pytest.raises(SystemExit) as e:  # a checkpoint's or a run's weights keep their own format
        decode.parse_args(["--run", "somewhere", "--weight-format", "fp8"])
    assert e.value.code == 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small checkpoint in the released layout (10 shards)."""
    path = tmp_path_factory.mktemp("ckpt") / "released"
    cfg = fixture_config()
    write_checkpoint(path, cfg, make_tensors(cfg, seed=0), sharded=True)
    return path


def test_truncated_checkpoint_is_one_line_per_file(checkpoint, tmp_path, capsys):
    bad = tmp_path / "truncated"
    shutil.copytree(checkpoint, bad)
    shard = bad / "model-00005-of-00010.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:250_000])
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(3, 20))
    want = f"model-00005-of-00010.safetensors: 250,000 of {size:,d} bytes ("
    for main, argv in ((logits.main, ["--checkpoint", bad, "--input-ids", ids, "--out", tmp_path / "o.npz"]),
                       (decode.main, ["--checkpoint", bad, "--max-new-tokens", 2])):
        line = fails(main, argv, capsys)
        assert line.startswith(f"error: --checkpoint {bad}: 1 problem(s), nothing was loaded: {want}"), line


def test_corrupted_tokenizer_json_of_a_checkpoint_is_named(checkpoint, tmp_path, capsys):
    bad = tmp_path / "badtok"
    shutil.copytree(checkpoint, bad)
    (bad / "tokenizer.json").write_text('{"model": ')
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(3, 20))
    for main, argv in ((logits.main, ["--checkpoint", bad, "--input-ids", ids, "--out", tmp_path / "o.npz"]),
                       (decode.main, ["--checkpoint", bad])):
        assert f"{bad / 'tokenizer.json'}: not a valid tokenizer.json" in fails(main, argv, capsys)


@pytest.mark.parametrize("source", ["--checkpoint", "--run"])
def test_decode_reads_weights_into_their_shards_on_a_mesh(source, request):
    """With --mesh each array of a checkpoint or a train_small run is placed in its shards as it is read (no device
    holds the whole model): every param where `partitioning.param_shardings` puts it, the routed experts split over
    `expert`, the values those read onto one device."""
    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    from dsv41_jax import partitioning

    path = str(request.getfixturevalue("checkpoint" if source == "--checkpoint" else "tiny_run"))
    args = decode.parse_args([source, path, "--mesh", "data=2,expert=4", "--batch", "8"])
    cfg, params = decode.load_weights(args, decode.model_config(args))
    mesh = partitioning.make_mesh(cfg, "data=2,expert=4", batch=8, layout="tp_ep")
    want = jax.tree.leaves(partitioning.param_shardings(params, mesh, "tp_ep"))
    got = jax.tree.leaves(params)
    assert [x.sharding.spec for x in got] == [w.spec for w in want]
    assert all(x.sharding.mesh.shape == mesh.shape for x in got)
    w1 = params["layers"][1]["ffn"]["w1"][...]
    assert w1.sharding.spec[0] == "expert" and w1.addressable_shards[0].data.shape[0] * 4 == w1.shape[0]
    plain = decode.parse_args([source, path])
    _, one = decode.load_weights(plain, decode.model_config(plain))
    for a, b in zip(got, jax.tree.leaves(one), strict=True):
        assert len(b.sharding.device_set) == 1
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_memory_check_counts_a_checkpoint_as_it_loads(checkpoint, monkeypatch):
    """A quantized checkpoint's weights stay FP8 / FP4 when loaded (its config.json alone reads as float weights,
    twice the bytes here): the check counts exactly the loaded params."""
    args = decode.parse_args(["--checkpoint", str(checkpoint)])
    loaded = sum(x.nbytes for x in jax.tree.leaves(decode.load_weights(args, decode.model_config(args))[1]))
    monkeypatch.setattr(decode, "device_memory", lambda n: (float(loaded), "a device"))
    decode.check_memory(args, decode.model_config(args), 0, 64)
    monkeypatch.setattr(decode, "device_memory", lambda n: (float(loaded - 1), "a device"))
    with pytest.raises(_cli.UserError, match="does not fit"):
        decode.check_memory(args, decode.model_config(args), 0, 64)


def test_logits_refuses_bad_input(checkpoint, tmp_path, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(3, 20))
    out = ["--out", tmp_path / "o.npz"]
    assert fails(logits.main, ["--checkpoint", tmp_path / "nope", "--input-ids", ids, *out], capsys) == \
        f"error: --checkpoint {tmp_path / 'nope'}: no such directory"
    assert fails(logits.main, ["--checkpoint", checkpoint, "--input-ids", tmp_path / "no.npy", *out], capsys) \
        .startswith(f"error: --input-ids {tmp_path / 'no.npy'}: cannot read it")
    assert fails(logits.main, ["--checkpoint", checkpoint, "--input-ids", ids, "--decode-from", 99, *out], capsys) \
        == "error: --decode-from 99: must be in 1..17 (the number of tokens given)"
    assert fails(logits.main, ["--checkpoint", checkpoint, "--input-ids", ids, "--out", tmp_path / "x" / "o.npz"],
                 capsys).startswith("error: --out")


def test_other_entry_points_refuse_bad_input(tmp_path, capsys, no_model):
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert fails(prefix_reuse.main, ["--cache-dir", a_file], capsys) == \
        f"error: --cache-dir {a_file}: not writable (it is a file, not a directory); give a directory"
    assert fails(prefix_reuse.main, ["--lengths", 5000], capsys).startswith("error: --lengths 5000: ")
    assert fails(bench_sharding.main, ["--preset", "tiny", "--mesh", "data=3"], capsys).startswith(
        "error: --mesh data=3: ")
    assert fails(cache_bytes.main, ["--json", tmp_path / "no" / "x.json"], capsys).startswith("error: --json")
    assert fails(quality.main, ["--run", tmp_path / "no"], capsys) == f"error: --run {tmp_path / 'no'}: no such " \
        "directory"
    assert fails(quality.main, ["--merge", tmp_path / "nope.json"], capsys).startswith("error: --merge")
    assert fails(train_small.main, ["--steps", 1, "--out", a_file], capsys).startswith(
        f"error: --out {a_file}: not writable")
    if jax.default_backend() != "gpu":
        assert fails(bench_kernels.main, [], capsys).startswith("error: bench_kernels times the Triton kernels")
        assert fails(bench_weights.main, [], capsys).startswith("error: bench_weights times the GPU kernels")
    with pytest.raises(SystemExit) as e:  # argparse's own usage errors stay exit 2
        bench_kernels.main(["--contexts", "many"])
    assert e.value.code == 2 and "--contexts" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --cache-dir must be writable
def test_cache_dir_that_is_a_file_or_below_one_is_refused(tmp_path, capsys, no_model):
    a_file = tmp_path / "kv"
    a_file.write_text("not a directory")
    assert fails(decode.main, ["--cache-dir", a_file], capsys) == \
        f"error: --cache-dir {a_file}: not writable (it is a file, not a directory); give a directory"
    assert fails(decode.main, ["--cache-dir", a_file / "sub"], capsys) == \
        f"error: --cache-dir {a_file / 'sub'}: not writable (Not a directory); give a directory you can write to"


def test_read_only_cache_dir_is_refused(tmp_path):
    """A read-only directory, as the kernel enforces it: a read-only tmpfs mounted in a private mount
    namespace of the child process (root, which writes through mode bits), else mode 0o555."""
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = [sys.executable, "-m", "experiments.decode", "--cache-dir", str(ro)]
    if os.geteuid() != 0:
        ro.chmod(0o555)
    elif shutil.which("unshare") is None:
        pytest.skip("root writes through mode bits, and `unshare` (util-linux) is missing to mount a read-only tmpfs")
    else:
        mount = 'mount -t tmpfs -o ro dsv41-ro "$1" || exit 77; shift; exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", str(ro), *cmd]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if r.returncode == 77 or "unshare failed" in r.stderr:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().startswith(f"error: --cache-dir {ro}: not writable ("), r.stderr
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr


# ----------------------------------------------------------------------------- warm runs say which path they took
@pytest.fixture
def fresh_notices(monkeypatch):
    """Compiles announced as in a new process (another test may have run these shapes already)."""
    monkeypatch.setattr(compile_notice, "_seen", set())


_init_params = functools.cache(d.init_params)  # ~4 s for tiny, per call


@pytest.fixture
def same_params(monkeypatch):
    """Every run of these tests on the same random weights, made once (as each new process would make them)."""
    monkeypatch.setattr(d, "init_params", _init_params)


@pytest.fixture
def five_layer_model(monkeypatch):
    """`--preset tiny` as tiny's layer modes in 5 layers (tests/configs.py): what these tests check is what the
    CLI reports and which path each request takes, not tiny's depth, at ~40% less compile time per program."""
    monkeypatch.setattr(decode, "model_config", five_layer_presets(decode.model_config))


def test_each_request_names_its_path_and_no_bounded_replay_gives_the_cold_tokens(tmp_path, capsys, fresh_notices,
                                                                                  same_params, five_layer_model):
    """A second process on the same --cache-dir (a new engine: empty host pool) replays the last window;
    with --no-bounded-replay it recomputes and its greedy tokens are the cold run's. (Shapes shared with
    the next test's programs: capacity 120, one sequence, 64-token prefill.)"""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(0, 320, 90).astype(np.int32))  # 2 pages before the last token
    base = ["--prompt-ids", ids, "--max-new-tokens", 12, "--capacity", 120, "--slots", 1, "--prefill-chunk", 64,
            "--page-tokens", 32, "--cache-dir", tmp_path / "kv", "--output-json", tmp_path / "run.json"]

    def run(*extra):
        call(decode.main, *base, *extra)
        out = capsys.readouterr()
        return out.out + out.err, json.loads((tmp_path / "run.json").read_text())["rounds"]

    text, rounds = run("--repeat", 2)
    cold = rounds[0]["requests"][0]["generated_ids"]
    assert "round 0 req0: path: cold prefill" in text
    assert "round 1 req1: path: exact restore" in text and rounds[1]["requests"][0]["generated_ids"] == cold
    for shape in ("prefill [B=1, T=64, layers 0-2]", "prefill [B=1, T=64]",
                  "decode [B=1, capacity=120, 8 steps per call]"):
        assert f"compiling {shape} ...\n" in text and f"compiling {shape} done in " in text, shape
    text, rounds = run()
    assert "round 0 req0: path: bounded replay" in text and "add --no-bounded-replay for output identical" in text
    text, rounds = run("--no-bounded-replay")
    assert "round 0 req0: path: full recompute" in text
    assert rounds[0]["requests"][0]["generated_ids"] == cold


def test_help_offers_the_exact_alternative(capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-bounded-replay" in text and "output identical to a cold run" in text
    assert "bounded replay" in text and "can differ from a cold run" in text


# ----------------------------------------------------------------------------- compiles are announced
def test_decode_announces_compiles_and_starts_the_bar_after_them(capsys, fresh_notices, same_params,
                                                                 five_layer_model):
    metrics = call(decode.main, "--prompt", "x" * 40, "--max-new-tokens", 40, "--capacity", 120)
    err = capsys.readouterr().err
    prefill, decode_ = "compiling prefill [B=1, T=64]", "compiling decode [B=1, capacity=120, 16 steps per call]"
    for line in (prefill + " ...", prefill + " done in", decode_ + " ...", decode_ + " done in"):
        assert line in err, (line, err)
    bar = err.index("decode:   0%")  # tqdm's first frame: its clock starts here, after the compile
    # 39 decode steps: the first call's 16 compile, the bar counts the other 23
    assert err.index(decode_ + " done in") < bar and "0/23" in err[bar:bar + 80]
    assert metrics["new_tokens"] == 40


@covered_elsewhere("test_decode_announces_compiles_and_starts_the_bar_after_them (the CLI's order) and "
                   "tests/test_dspark.py (the speculative tokens)")
def test_speculative_decode_compiles_its_six_programs_first_then_times_every_call(capsys, fresh_notices,
                                                                                  caplog, monkeypatch):
    """--speculative: plain prefill and decode, speculative prefill and decode, draft and verify are compiled
    side by side before anything is timed (no model program compiles after that), and at temperature 0
    the speculative tokens are the plain ones. The weights are committed to the device, as a --run's
    restored ones are (an uncommitted stand-in input then compiles another program). tiny in three layers
    (window, Full m=2 with Engram, Reuse) with its draft stages reading layers 1 and 2: what is tested is the
    CLI's order of compiles and calls, not the model's depth (each layer adds to six compiles)."""
    monkeypatch.setattr(d, "init_params", lambda *a, **k: jax.device_put(_init_params(*a, **k), jax.devices()[0]))
    real_config = decode.model_config

    def three_layers(args):
        cfg = real_config(args)
        return dataclasses.replace(cfg, n_layers=3, compress_ratios=(0, 2, 2) + cfg.compress_ratios[cfg.n_layers:],
                                   kv_source_layers=(1,), index_source_layers=(1,), candidate_source_layer=-1,
                                   engram_layer_ids=(1,), engram_num_embeddings=(),
                                   dspark_target_layer_ids=(1, 2)).with_derived_engram()

    monkeypatch.setattr(decode, "model_config", three_layers)
    done_at = []
    real = decode.compile_side_by_side
    monkeypatch.setattr(decode, "compile_side_by_side", lambda progs: (real(progs), done_at.append(len(caplog.records))))
    with caplog.at_level("WARNING", logger="jax"), jax.log_compiles():
        m = call(decode.main, "--speculative", "dspark", "--prompt", "x" * 40, "--max-new-tokens", 9, "--batch", 2)
    # log_compiles holds per thread: the side-by-side compiles (worker threads) are not logged, every later
    # call runs on this thread and would be. Nothing compiles once they are done: a model program would
    # make a timed call minutes long, an eager op (the sampling of the prefill's logits did) ~0.5 s on a GPU.
    later = [r.getMessage() for r in caplog.records[done_at[0]:]]
    assert not [t for t in later if t.startswith("Compiling")], later
    err = capsys.readouterr().err
    for label in ("prefill [B=2, T=64]", "decode [B=2, capacity=54, 8 steps per call]", "speculative prefill", "draft (timed alone)",
                  "verify (timed alone)", "speculative decode [8 steps per call]"):
        assert err.count(f"compiling {label} ...") == 1 and err.count(f"compiling {label} done in") == 1, (label, err)
    spec = m["speculative"]
    assert spec["same_tokens_as_plain"] and 1 <= spec["acceptance_length"] <= 4
    assert np.isfinite([spec["tokens_per_s"], spec["plain_tokens_per_s"], spec["draft_ms"], spec["verify_ms"]]).all()


# ----------------------------------------------------------------------------- documented commands on tiny
def test_plan_deployment_runs_on_tiny(capsys):
    plan_deployment.main(["--preset", "tiny"])
    out = capsys.readouterr().out
    assert "tiny on mesh tensor=2" in out and "context 4,096" in out and "weights counted as bf16" in out
    assert fails(plan_deployment.main, ["--preset", "tiny", "--mesh", "tensor=8"], capsys) == \
        "error: --mesh tensor=8: mesh axis tensor=8 does not divide n_heads=4; choose a size that divides it"
    assert fails(plan_deployment.main, ["--preset", "tiny", "--context", 8192], capsys) == \
        "error: --context 8192: more than tiny's max_seq_len (4096)"


def test_plan_deployment_compile_agrees_with_the_plan(capsys):
    # XLA's per-device argument bytes of the compiled sharded step (8 simulated devices, conftest) against the
    # plan's tables: weights, cache and Engram tables per device, plus a few bytes of tokens
    p = plan_deployment.main(["--preset", "tiny", "--mesh", "data=2,expert=2", "--layout", "dp_ep", "--batch", "4",
                              "--context", "64", "--compile"])
    assert abs(p["arguments_per_device"] / p["plan_arguments_per_device"] - 1) < 0.01
    assert p["temporaries_per_device"] > 0 and "compiled decode step" in capsys.readouterr().out


def test_cache_bytes_labels_what_it_measured(capsys):
    cache_bytes.main(["--preset", "tiny"])
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["4K"], ["128K"], ["1M"])]
    assert rows == ["4K"] and "not measured: 128K, 1M, beyond the preset's max_seq_len of 4,096" in out
    assert "0.000 B" not in out and " K" in out  # tiny's ~0.9M parameters in thousands
    assert cache_bytes.count_label(748.5e9) == "748.500 B" and cache_bytes.count_label(12) == "12"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A train_small output directory of tiny (untrained weights) whose config allows 512 tokens, in 5 layers
    (tests/configs.py: the evaluation CLIs' bookkeeping is what is checked, not tiny's depth)."""
    from dsv41_jax import train

    run = tmp_path_factory.mktemp("run") / "tiny"
    run.mkdir()
    cfg = five_layers(train_small.study_config("tiny", "csa2", False).replace(max_seq_len=512))
    train_small.save_config(run / "config.json", cfg)
    train.save_checkpoint(run / "checkpoint", d.init_params(cfg, seed=0), None, 0)  # evaluated, never resumed
    return run


def test_recall_counts_every_query_once_per_variant(tiny_run, capsys):
    # --minutes 0: the first round (one batch of 2 examples per length) only, of the 4 examples asked for
    res = call(recall.main, "--run", tiny_run, "--lengths", 300, "--pairs", 2, "--examples", 4, "--batch", 2,
               "--chunk", 128, "--variants", "base", "--corpus-mb", 0.3, "--minutes", 0)
    assert [r["variant"] for r in res["rows"]] == [quality.BASE, "bounded replay of the queries' window"]
    assert res["examples_per_length"] == 2
    for row in res["rows"]:
        assert sum(b["n"] for b in row["by_distance"]) == 4 and 0 <= row["accuracy"] <= 1
    assert "| " + quality.BASE in res["markdown"]
    # the replay row's paired difference to the inference config: same queries, one value per query pair
    vs = [b for b in res["rows"][1]["vs_first"] if b["n"]]
    assert sum(b["n"] for b in vs) == 4 and all(-1 <= b["diff"] <= 1 for b in vs)
    assert f'Paired difference to "{quality.BASE}"' in res["markdown"]
    capsys.readouterr()
    assert fails(recall.main, ["--run", tiny_run, "--lengths", 1024], capsys) == \
        "error: --lengths 1024: beyond the run's max_seq_len (512)"


def test_recall_against_another_model_pairs_the_same_queries(tiny_run, tmp_path, capsys):
    # the first call's results, then the same model again against them: the same queries (one seed), so the
    # paired rows equal this run's and their differences are exactly 0 where the first call scored
    flags = ["--run", tiny_run, "--lengths", 300, "--pairs", 2, "--examples", 2, "--batch", 2, "--chunk", 128,
             "--variants", "base", "--no-replay", "--corpus-mb", 0.3]
    first = call(recall.main, *flags, "--out", tmp_path / "first.json")
    res = call(recall.main, *flags, "--against", tmp_path / "first.json", "other", "--label", "this")
    assert [r["variant"] for r in res["rows"]] == [f"this: {quality.BASE}", f"other: {quality.BASE}"]
    assert res["rows"][1]["against"] == "other" and "against" not in res["rows"][0]  # the plot dashes its rows
    assert list(res["queries"]["right"]) == [quality.BASE]  # the raw outcomes keep the names --against reads
    assert res["rows"][1]["accuracy"] == first["rows"][0]["accuracy"] == res["rows"][0]["accuracy"]
    assert [b["n"] for b in res["rows"][1]["by_distance"]] == [b["n"] for b in first["rows"][0]["by_distance"]]
    assert all(b["diff"] == 0 for b in res["rows"][1]["vs_first"] if b["n"])
    capsys.readouterr()
    assert fails(recall.main, [*flags[:5], 3, *flags[6:], "--against", tmp_path / "first.json", "other"],
                 capsys) == (f"error: --against {tmp_path / 'first.json'}: made with other --pairs (2 there, 3 "
                             "here); its queries are not this run's")
    # other queries (here: a distance changed) are refused before anything is evaluated
    other = json.loads((tmp_path / "first.json").read_text())
    other["queries"]["distance"][0] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert fails(recall.main, [*flags, "--against", tmp_path / "other.json", "other"], capsys) == \
        "error: --against: its queries' distances differ from this run's (another corpus?)"


def test_quality_keeps_the_retrieval_lengths_the_run_allows(tiny_run, capsys):
    res = call(quality.main, "--run", tiny_run, "--variants", "base", "--no-replay", "--batch", 1, "--ppl-len", 128,
               "--ppl-batches", 1, "--retrieval-batches", 1, "--chunk", 256, "--corpus-mb", 0.3)
    assert res["retrieval_lengths"] == [512] and set(res["rows"][0]["retrieval"]) == {"512"}
    assert "note: retrieval lengths [1024, 2048, 4096, 8192] skipped: beyond the run's max_seq_len (512)" in \
        capsys.readouterr().err
    assert fails(quality.main, ["--run", tiny_run, "--retrieval-lengths", 512, 2048], capsys) == \
        "error: --retrieval-lengths 2048: beyond the run's max_seq_len (512)"


# ----------------------------------------------------------------------------- train_small's outputs
def test_train_small_output_default_and_loss_curve(tmp_path, monkeypatch, capsys):
    """The whole of main() with a stand-in train step (the real one compiles for ~40 s): the default --out,
    the CSV and, without matplotlib, the line that says how to get the PNG."""
    import jax.numpy as jnp

    from dsv41_jax import train

    with pytest.raises(SystemExit):
        train_small.parse_args(["--help"])
    assert "git-ignored" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "make_train_step", lambda cfg, opt, **kw: lambda p, s, batch: (
        p, s, {"lm_loss": jnp.float32(5.0), "indexer_kl": jnp.float32(0.1)}))
    monkeypatch.setattr(train, "loss_fn", lambda tr, rest, cfg, tokens: (0.0, {"lm_loss": jnp.float32(5.0)}))
    # the recall probe's forward: uniform logits, so no value is right and each digit costs log(V) nats
    monkeypatch.setattr(train, "forward_logits", lambda tr, rest, cfg, t: jnp.zeros((*t.shape, cfg.vocab_size)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as when it is not installed
    summary = call(train_small.main, "--steps", 2, "--batch", 1, "--eval-batches", 1, "--corpus-mb", 0.2,
                   "--recall-frac", 0.5, "--recall-pairs", 2)
    vocab = train_small.study_config("tiny", "csa2", False).vocab_size
    assert summary["val_recall_acc"] == 0.0 and summary["val_recall_nll"] == pytest.approx(4 * np.log(vocab), rel=1e-4)
    out = tmp_path / "runs" / "train_small_tiny"
    assert "val_recall_acc" in (out / "loss_curve.csv").read_text().splitlines()[0]
    assert summary["curve"] == str(Path("runs/train_small_tiny/loss_curve.csv")) and (out / "loss_curve.csv").is_file()
    assert "pip install matplotlib" in capsys.readouterr().err
    assert fails(train_small.main, ["--steps", 1], capsys) == f"error: --out {Path('runs/train_small_tiny')}: holds " \
        "a checkpoint/ of an earlier run; pass another --out or remove it"


def test_train_small_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    """--resume: the weights and optimizer state of the last call (a stand-in step adds 1 to every weight),
    the step count, and one loss curve across calls, whose clock runs on; the model flags are the run's, the
    train attention the last call's unless the call switches it (a sparse stage after a dense warm-up)."""
    import jax.numpy as jnp

    from dsv41_jax import train

    topk = []  # the index_topk each call's train step was built with
    monkeypatch.setattr(train, "make_train_step", lambda cfg, opt, **kw: topk.append(cfg.index_topk) or (
        lambda p, s, batch: (jax.tree.map(lambda x: x + 1, p), s,
                             {"lm_loss": jnp.float32(5.0), "indexer_kl": jnp.float32(0.1)})))
    monkeypatch.setattr(train, "loss_fn", lambda tr, rest, cfg, tokens: (0.0, {"lm_loss": jnp.float32(5.0)}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run, small = tmp_path / "run", ["--batch", 1, "--eval-batches", 1, "--corpus-mb", 0.2, "--eval-every", 2,
                                    "--seq", 64]
    call(train_small.main, "--steps", 3, "--out", run, "--train-attention", "dense", *small)
    summary = call(train_small.main, "--resume", run, "--steps", 5, "--preset", "small", *small)
    assert (summary["steps"], summary["resumed_from_step"], summary["preset"]) == (5, 3, "tiny")
    assert summary["stages"] == [{"from_step": 0, "train_attention": "dense"}] and topk == [64, 64]
    assert "resuming" in capsys.readouterr().err
    rows = train_small.read_curve(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and [r["val_lm_loss"] != "" for r in rows] == [0, 1, 1, 1, 1]
    assert all(a["seconds"] <= b["seconds"] for a, b in zip(rows, rows[1:]))
    cfg = train_small.study_config("tiny", "csa2", False)
    fresh = d.init_params(cfg, seed=0)
    opt = train_small.make_optimizer(3e-3, 20)
    params, _, step = train.restore_checkpoint(run / "checkpoint", fresh, train.init_opt_state(opt, fresh))
    assert step == 5 and not (run / "checkpoint.new").exists()
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(fresh)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want) + 5, rtol=1e-6, atol=1e-5)
    assert fails(train_small.main, ["--resume", run, "--steps", 5], capsys) == \
        f"error: --steps 5: the run in {run} is at step 5 already; give a larger --steps"
    summary = call(train_small.main, "--resume", run, "--steps", 6, "--train-attention", "sparse", *small)
    assert summary["stages"] == [{"from_step": 0, "train_attention": "dense"},
                                 {"from_step": 5, "train_attention": "sparse"}]
    assert topk[-1] == cfg.index_topk < 64 and summary["train_attention"] == "sparse"
    # --init-from: a new run from those weights (6 stand-in steps: +6), its own step count and curve
    summary = call(train_small.main, "--init-from", run, "--out", tmp_path / "next", "--steps", 2, "--preset", "small",
                   *small)
    assert (summary["steps"], summary["preset"], summary["stages"][0]["from_step"]) == (2, "tiny", 0)
    params, _, _ = train.restore_checkpoint(tmp_path / "next" / "checkpoint", fresh)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(fresh)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want) + 8, rtol=1e-6, atol=1e-5)
    capsys.readouterr()
    assert fails(train_small.main, ["--resume", tmp_path, "--steps", 9], capsys).startswith(
        f"error: --resume {tmp_path}: no checkpoint, config.json, summary.json, loss_curve.csv in it")


def test_train_small_plots_the_curve_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": 1, "lm_loss": 5.0, "indexer_kl": 0.2, "val_lm_loss": ""},
            {"step": 2, "lm_loss": 4.0, "indexer_kl": 0.1, "val_lm_loss": 4.5}]
    assert train_small.write_curve(tmp_path, rows) == str(tmp_path / "loss_curve.png")
    assert (tmp_path / "loss_curve.png").stat().st_size > 0 and (tmp_path / "loss_curve.csv").is_file()
