import os

import pytest

# Deterministic CPU numerics for the suite; set before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 simulated CPU devices for the sharding tests; single-device code runs on device 0 as before.
# A collective waits for all of its device threads: on a loaded 2-core machine one can start later than
# XLA's default 40 s, which aborts the process; wait up to 10 minutes instead.
COLLECTIVE_PATIENCE = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=8 "
                      + COLLECTIVE_PATIENCE)

# Compiles dominate the suite's time on the CPU: LLVM's expensive passes off (JAX's own test setting; the
# HLO passes, and with them fusion and summation order, are unchanged).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One persistent compilation cache for the whole run, made by the first process (pytest itself, before its
# xdist workers start: they inherit it, as do the scripts tests run as subprocesses) and removed at its exit.
# The workers and the tests compile many identical programs (tiny's prefill and decode at the same shapes):
# compiled once per run instead of once per process (measured on this repo's 2-core CI machine:
# `pytest -n 2 tests/test_model.py tests/test_generate.py tests/test_engine.py tests/test_step_state.py`
# 219 s without the cache, 160 s with an empty one).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not os.environ.get("PYTEST_XDIST_WORKER"):
    import atexit
    import shutil
    import tempfile

    _JIT_CACHE = tempfile.mkdtemp(prefix="dsv41_jax_test_jit_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JIT_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, _JIT_CACHE, ignore_errors=True)


# Every compiled CPU program keeps its JIT-ed code mapped (a few memory maps for a small one, hundreds for a
# model step), and a worker that runs half the suite compiles thousands: on the 2-core CI machine (`wc -l
# /proc/PID/maps` of both workers every 3 s through `make test`) one reached 64,200 maps of Linux's default
# limit of 65,530 (vm.max_map_count); with the clearing below, 35,983. Past it mmap fails
# inside XLA, which took workers down with a segfault or an abort while (de)serializing a program for the
# compilation cache (three CI runs of 2026-12-04/05). So between modules, a process past half its limit
# drops the compiled programs (later modules load the ones they need again, from that cache).
def _map_counts() -> tuple[int, int] | None:
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:  # not Linux: no such limit to stay under
        return None


@pytest.fixture(autouse=True, scope="module")
def _memory_maps_within_limit():
    yield
    counts = _map_counts()
    if counts is not None and counts[0] > counts[1] // 2:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()

# The Makefile's xdist run hands whole modules to its 2 workers. xdist's default order (the modules with the most
# tests first) left modules of few long tests (the mesh engines, DSpark, the CLI) for the end, one worker running
# them while the other idled; with `--no-loadscope-reorder` the modules go out in this order instead, the longest
# first (each module's test times summed from `pytest -n 2 ... --junitxml=FILE tests` on this repo's 2-core test
# machine, 2026-12-07, fifty-third session: 1,549 s over the two workers), so the last ones are short.
# Modules not listed follow in their collected order; a stale list only costs balance, never a test.
LONGEST_MODULES = ("test_grouped.py", "test_cli.py", "test_engine.py", "test_engine_dspark.py", "test_window_store.py",
                   "test_train.py", "test_engine_mesh.py", "test_serve.py", "test_sharding.py", "test_dspark.py",
                   "test_kernels_lowering.py", "test_expert_parallel.py", "test_parity.py", "test_kernels_dispatch.py",
                   "test_vision.py", "test_kernels_gpu.py", "test_kernels_tpu.py", "test_step_state.py", "test_model.py",
                   "test_checkpoint.py", "test_hyper_kernel.py", "test_generate.py", "test_dspark_parity.py",
                   "test_compile_options.py", "test_bench_decode_cli.py", "test_mooncake_store.py")


# Modules that run test_engine.py's programs (the tiny engine's prefill and decode): one xdist scope with it, so that
# the worker that runs it runs them next, and they find those programs compiled in its own process (not traced,
# lowered and read from the compilation cache again).
SAME_SCOPE = {"test_engine_dspark.py": "test_engine.py", "test_window_store.py": "test_engine.py"}


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            folder, _, name = scope.rpartition("/")
            return f"{folder}/{SAME_SCOPE[name]}" if name in SAME_SCOPE else scope

    return Scheduling(config, log)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept
