"""Where a decode step's GPU time goes, by the model code that launched each kernel.

    python -m experiments.profile_step                      # the v41 slice, batch 1, 4K, 5 steps per call
    python -m experiments.profile_step --preset small --batch 8 --out /tmp/prof
    python -m experiments.profile_step --batch 8 --chunk 20 --queued 4 --timeline   # + one step, kernel by kernel
    python -m experiments.profile_step --from-events /tmp/profile_step/events.json.gz --timeline   # again, any machine

Every method of the dsv41_jax modules runs under a `jax.named_scope` of its class and name
("MoE._routed"), so the op name XLA keeps on each fused kernel says which code made it. One
`api.generate` call (the jitted loop, cache donated) is traced with `jax.profiler`; each kernel of the
trace is matched to its HLO instruction and so to the innermost two scopes and the primitive at the
fusion's root ("MoE.__call__/MoE._routed:select_n"). Pallas kernels keep their own names. Prints kernels
and GPU microseconds per step by source and by scope, largest first; the time each source's kernels ran with no
other kernel (kernels overlap under CONCURRENT command buffers: that is the step's serial part); the GPU's idle
time by the kernel after each gap; the host events during the gaps of 50 us or more and in the whole call; how
far the host's loop iterations run ahead of the GPU's steps; the time no weight-streaming kernel runs (the HBM
mostly idle) by source; and the step time of the loop outside the profiler (the profiler's own overhead is why
it is measured without it). With --timeline, one step's kernels in launch order with their start and the GPU's
idle time before each. The traced call's events are saved (`events.json.gz` in --out): `--from-events` prints
the same tables from that file on any machine.
Weights and cache are random, as in `experiments.bench_decode`.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import functools
import glob
import gzip
import importlib
import inspect
import json
import os
import pkgutil
import re
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import dsv41_jax
from dsv41_jax import api
from experiments import bench_decode as bd


def _scoped(name: str, fn):
    @functools.wraps(fn)
    def inner(*a, **k):
        with jax.named_scope(name):
            return fn(*a, **k)
    return inner


@contextlib.contextmanager
def scoped_methods():
    """Every method of every nnx.Module class in dsv41_jax runs under a named scope "Class.method" inside
    the block (for what is traced there); yields how many were wrapped, restores them after."""
    saved = []
    for info in pkgutil.walk_packages(dsv41_jax.__path__, "dsv41_jax."):
        try:
            mod = importlib.import_module(info.name)
        except ImportError:  # an optional extra (server, stores) that is not installed: not in the model
            continue
        for cname, cls in vars(mod).items():
            if not (inspect.isclass(cls) and issubclass(cls, nnx.Module) and cls.__module__ == mod.__name__):
                continue
            for fname, fn in list(vars(cls).items()):
                if inspect.isfunction(fn) and (fname == "__call__" or not fname.startswith("__")):
                    saved.append((cls, fname, fn))
                    setattr(cls, fname, _scoped(f"{cname}.{fname}", fn))
    try:
        yield len(saved)
    finally:
        for cls, fname, fn in saved:
            setattr(cls, fname, fn)


_SCOPE = re.compile(r"^[A-Z]\w*\.\w+$")


def kernel_sources(hlo_text: str) -> dict[str, str]:
    """Kernel name (the HLO instruction name with . and - as _) -> "Outer.scope/Inner.scope:primitive"."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        op = re.search(r'op_name="([^"]+)"', line)
        if not m or not op:
            continue
        parts = op.group(1).split("/")
        scopes = [p for p in parts if _SCOPE.match(p)]
        where = "/".join(scopes[-2:]) + ":" + parts[-1] if scopes else "/".join(parts[-2:])
        out[re.sub(r"[.\-]", "_", m.group(1))] = where
    return out


HOST_NAME = 90  # characters of a host event's name kept (Python frames can be long)
HEAD = "Transformer.forward/Linear."  # the source of the LM head's kernel: every step's last large kernel


def is_head(source: str) -> bool:
    return source.startswith(HEAD)


def trace_events(trace_dir: str) -> tuple[list[dict], list[dict]]:
    """(GPU kernel events, host events), each {name, ts, dur} in us, sorted by start, of the newest Perfetto
    trace in trace_dir."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    return ([e for e in spans if e.get("pid") in gpu],
            [{**e, "name": e["name"][:HOST_NAME]} for e in spans if e.get("pid") not in gpu])


def gaps(kernels: list[dict]):
    """Yield (start us, end us, the kernel after it) for each idle stretch of the GPU's timeline (kernels sorted by
    start; overlapping kernels count as busy)."""
    end = None
    for e in kernels:
        if end is not None and e["ts"] > end:
            yield end, e["ts"], e
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])


def host_in_gaps(kernels: list[dict], host: list[dict], min_gap_us: float = 50.0) -> tuple[int, dict]:
    """(number of GPU idle gaps >= min_gap_us, {host event name: [events, us overlapping those gaps]}): what
    the host was doing while the GPU waited, e.g. at a step boundary."""
    long = [(g0, g1) for g0, g1, _ in gaps(kernels) if g1 - g0 >= min_gap_us]
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in host:
        for g0, g1 in long:
            overlap = min(g1, e["ts"] + e["dur"]) - max(g0, e["ts"])
            if overlap > 0:
                by[e["name"]][0] += 1
                by[e["name"]][1] += overlap
    return len(long), dict(by)


ITER = re.compile(r"\[iter=\d+\]")


def host_lead(kernels: list[dict], host: list[dict], sources: dict[str, str]) -> dict | None:
    """How far the host runs ahead of the GPU, step by step: the host's `[iter=k]` events of the generate loop's
    `while` (one per decode step, in order) against the GPU's steps (each ends with its LM head kernel). Returns
    {"host_us": median host time per iteration, "lead_us": [min, median] of (the GPU's start of step s - the
    host's start of iteration s)}, or None when the counts do not match. A lead near 0 means the GPU waited for
    the host's launches (or the host waited for the GPU); a lead of many steps means the host's work is hidden."""
    iters = sorted((e for e in host if ITER.fullmatch(e["name"])), key=lambda e: e["ts"])
    heads = [e for e in kernels if is_head(sources.get(e["name"], ""))]
    if not iters or len(iters) != len(heads):
        return None
    ts = [k["ts"] for k in kernels]
    # step s starts with the first kernel launched after step s - 1's head ended
    starts = [ts[0]] + [ts[min(bisect.bisect_left(ts, h["ts"] + h["dur"]), len(ts) - 1)] for h in heads[:-1]]
    leads = [g - e["ts"] for g, e in zip(starts, iters)]
    return {"host_us": statistics.median(e["dur"] for e in iters), "lead_us": [min(leads), statistics.median(leads)]}


def attribute(kernels: list[dict], sources: dict[str, str], steps: int) -> dict[str, list[float]]:
    """{source: [kernels per step, GPU us per step]}; unmatched kernels keep their own name."""
    by = collections.defaultdict(lambda: [0.0, 0.0])
    for e in kernels:
        where = sources.get(e["name"], e["name"])
        by[where][0] += 1 / steps
        by[where][1] += e["dur"] / steps
    return dict(by)


def stretches(kernels: list[dict]):
    """Yield (us, indices of the kernels running) for each stretch of the timeline between two consecutive kernel
    starts or ends during which some kernel runs (the set is the sweep's own: read it before the next one)."""
    edges = sorted([(e["ts"] + e["dur"], 0, i) for i, e in enumerate(kernels)]  # ends before starts at one time
                   + [(e["ts"], 1, i) for i, e in enumerate(kernels)])
    running, last = set(), None
    for t, starts, i in edges:
        if running and t > last:
            yield t - last, running
        (running.add if starts else running.discard)(i)
        last = t


def alone(kernels: list[dict], sources: dict[str, str], steps: int) -> tuple[float, dict[str, list[float]]]:
    """(us per step the GPU runs any kernel, {source: [kernels per step, us per step it ran with no other kernel]}).
    With the command buffers' kernels ordered by data only (compile_options) kernels overlap, so their summed
    durations overstate the step; the time a kernel runs alone is the step's serial part: what shortening that
    kernel can save."""
    by = {where: [n, 0.0] for where, (n, _) in attribute(kernels, sources, steps).items()}
    busy = 0.0
    for dt, running in stretches(kernels):
        busy += dt
        if len(running) == 1:
            (j,) = running
            by[sources.get(kernels[j]["name"], kernels[j]["name"])][1] += dt / steps
    return busy / steps, by


def idle_before(kernels: list[dict], sources: dict[str, str], steps: int) -> dict[str, list[float]]:
    """{source: [kernels per step, GPU idle us per step just before them]}: the gaps of the GPU's timeline
    charged to the kernel that ends each (host launches, command-buffer boundaries)."""
    by = collections.defaultdict(lambda: [0.0, 0.0])
    for g0, g1, e in gaps(kernels):
        where = sources.get(e["name"], e["name"])
        by[where][0] += 1 / steps
        by[where][1] += (g1 - g0) / steps
    return dict(by)


def one_step(kernels: list[dict], sources: dict[str, str], chunk: int = 1) -> list[tuple[float, float, float, str]]:
    """[(start us from the step's start, GPU idle us before it, its us, source)] for each kernel of one step in the
    middle of the traced call, in launch order (start and duration show which kernels overlap): a step is what
    runs after one LM head's kernel (`Transformer.forward/Linear`, every step's last large kernel) up to and with
    the next one's. With `chunk` steps per generate call, the step
    is one in the middle of a call: a call's first step also runs the call's start (its carried buffers'
    copies, ~20 memcpys of the v41 slice), which the middle step of 4 calls of 20 was."""
    heads = [i for i, e in enumerate(kernels) if is_head(sources.get(e["name"], ""))]
    if len(heads) < 2:
        return []
    # step j (j >= 1) runs from heads[j - 1] to heads[j]; the middle call's middle step, or the middle step
    j = (len(heads) // chunk // 2) * chunk + chunk // 2 if chunk > 1 else len(heads) // 2
    mid = min(max(j, 1), len(heads) - 1) - 1
    step = kernels[heads[mid]:heads[mid + 1] + 1]  # from the first head, whose end starts the idle count
    idle = {id(e): g1 - g0 for g0, g1, e in gaps(step)}
    t0 = step[0]["ts"] + step[0]["dur"]  # the previous step's head ends
    return [(e["ts"] - t0, idle.get(id(e), 0.0), e["dur"], sources.get(e["name"], e["name"])) for e in step[1:]]


# the kernels that stream weights: the FP8 / FP4 Mosaic kernels, the LM head and wo_a (XLA's dots, in
# `Attention.project`; `project_out` in traces made before the thirty-first session)
WEIGHT_STREAM = re.compile(r"(fp8|fp4_rows)_wgmma_|^" + re.escape(HEAD)
                           + r"|project(_out)?:(convert_element_type|dot_general)$")


def weight_idle(kernels: list[dict], sources: dict[str, str], steps: int) -> tuple[float, dict[str, list[float]]]:
    """(us per step the GPU runs kernels but none that streams weights (`WEIGHT_STREAM`), {source: [kernels per
    step, us per step of that time, shared equally among the kernels running]}): the latency-bound time between
    the weight streams, with the HBM mostly idle, and whose kernels fill it."""
    where = [sources.get(e["name"], e["name"]) for e in kernels]
    by = {w: [n, 0.0] for w, (n, _) in attribute(kernels, sources, steps).items()}
    total = 0.0
    for dt, running in stretches(kernels):
        if not any(WEIGHT_STREAM.search(where[j]) for j in running):
            total += dt
            for j in running:
                by[where[j]][1] += dt / len(running) / steps
    return total / steps, {w: v for w, v in by.items() if v[1] > 0}


def save_events(path: str, kernels: list[dict], host: list[dict], sources: dict[str, str], steps: int,
                chunk: int) -> None:
    """The traced call's kernels and host events (name, start, duration) and each kernel's source, gzipped JSON:
    what `--from-events` analyses again without a GPU (~0.2 MB for 80 steps of the slice, where the trace and the
    HLO it needs are ~2 MB)."""
    names = {e["name"] for e in kernels}
    data = {"steps": steps, "chunk": chunk, "sources": {n: sources[n] for n in names if n in sources},
            "kernels": [[e["name"], e["ts"], e["dur"]] for e in kernels],
            "host": [[e["name"], e["ts"], e["dur"]] for e in host]}
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def load_events(path: str) -> tuple[list[dict], list[dict], dict[str, str], int, int]:
    """`save_events`'s file back: (kernels, host events, sources, steps, chunk)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    as_events = lambda rows: [{"name": n, "ts": ts, "dur": dur} for n, ts, dur in rows]
    return as_events(data["kernels"]), as_events(data["host"]), data["sources"], data["steps"], data["chunk"]


def _table(title: str, rows: dict[str, list[float]], top: int, cols: str = "kernels / step | GPU us / step") -> None:
    print(f"\n| {title} | {cols} |\n|---|---|---|")
    for k, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {k} | {n:.1f} | {us:.1f} |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v41-slice", choices=["v41-slice", "small", "tiny"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=5, help="decode steps per traced call")
    p.add_argument("--queued", type=int, default=1,
                   help="generate calls dispatched before the host waits for the last one's tokens (1: a sync per "
                        "call, as a client that reads each call's tokens before the next; >1: the host queues the "
                        "next call while the GPU runs this one)")
    p.add_argument("--kernels", default="auto", choices=["auto", "jnp", "pallas"])
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--timeline", action="store_true",
                   help="also print one step's kernels in launch order (idle before, duration, source)")
    p.add_argument("--out", default="/tmp/profile_step", help="trace, HLO text, events and JSON rows go here")
    p.add_argument("--from-events", metavar="FILE", help="analyse a saved events.json.gz (any machine, no GPU) "
                   "instead of profiling")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_events:
        kernels, host, sources, steps, chunk = load_events(args.from_events)
        print(f"{args.from_events}: {steps} steps, {chunk} per call")
        return report(kernels, host, sources, steps, chunk, args)
    with scoped_methods() as n:
        print(f"named scopes on {n} methods", flush=True)
        return _profile(args)


def _profile(args) -> dict:
    cfg = bd.slice_config(weight_format="fp8") if args.preset == "v41-slice" else dsv41_jax.preset(args.preset)
    if args.context + bd.ROOM > cfg.max_seq_len:
        raise SystemExit(f"error: --context {args.context} exceeds the preset's max_seq_len {cfg.max_seq_len} - "
                         f"{bd.ROOM}")
    params = api.freeze(bd.random_params(cfg))
    cache, room = bd.random_cache(cfg, args.batch, args.context), bd.Room(args.context)
    tokens = jax.random.randint(jax.random.key(2), (args.batch,), 0, cfg.vocab_size)
    os.makedirs(args.out, exist_ok=True)

    steps = args.chunk * args.queued  # decode steps per timed (and traced) call()

    def rewind():  # before a call, outside its timing
        nonlocal cache
        cache = room.before(cache, steps)

    def call():
        nonlocal cache
        for _ in range(args.queued):  # each call's cache is the next one's input: queued without a host sync
            toks, _, cache = api.generate(cfg, params, cache, tokens, args.chunk, kernels=args.kernels,
                                          validate=False)
        jax.block_until_ready(toks)

    rewind()
    t = time.perf_counter()
    call()
    print(f"compiled and ran one call in {time.perf_counter() - t:.1f} s", flush=True)
    times = []
    for _ in range(8):
        rewind()
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) / steps * 1e3)
    step_ms = statistics.median(times)
    b = args.batch
    one = lambda v, dt: jnp.full((b,), v, dt)
    hlo = api._generate_jit.lower(cfg, params, cache, tokens, one(0, jnp.float32), one(0, jnp.uint32),
                                  one(0, jnp.int32), one(args.chunk, jnp.int32), jnp.full((b, 1), -1, jnp.int32),
                                  n_steps=args.chunk, kernels=api.resolve(args.kernels)).compile().as_text()
    with open(os.path.join(args.out, "hlo.txt"), "w") as f:
        f.write(hlo)
    trace_dir = os.path.join(args.out, "trace")
    rewind()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        call()
    kernels, host = trace_events(trace_dir)
    if not kernels:
        raise SystemExit("the trace has no GPU kernels: run this on a GPU")
    sources = kernel_sources(hlo)
    save_events(os.path.join(args.out, "events.json.gz"), kernels, host, sources, steps, args.chunk)
    print(f"\n{args.preset} batch {b}, context {args.context}: {step_ms:.3f} ms/step (loop, not profiled; "
          f"{args.chunk} steps per call, {args.queued} call(s) per host sync)")
    result = report(kernels, host, sources, steps, args.chunk, args)
    result["step_ms"] = step_ms
    with open(os.path.join(args.out, "attribution.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def report(kernels: list[dict], host: list[dict], sources: dict[str, str], steps: int, chunk: int, args) -> dict:
    """Print the tables of a traced call of `steps` decode steps (`chunk` per generate call); returns its rows."""
    rows = attribute(kernels, sources, steps)
    busy = sum(us for _, us in rows.values())
    union, solo = alone(kernels, sources, steps)
    print(f"{len(kernels) / steps:.0f} kernels and {busy / 1e3:.3f} ms of GPU time per step; the GPU runs a kernel "
          f"{union / 1e3:.3f} ms of it, one alone {sum(us for _, us in solo.values()) / 1e3:.3f} ms")
    _table("source", rows, args.top)
    _table("source, alone", solo, args.top, "kernels / step | us / step with no other kernel running")
    scopes = collections.defaultdict(lambda: [0.0, 0.0])
    for k, (n, us) in rows.items():
        key = k.split(":")[0] if ":" in k else k
        scopes[key][0] += n
        scopes[key][1] += us
    _table("scope", dict(scopes), args.top)
    idle = idle_before(kernels, sources, steps)
    print(f"\nGPU idle between kernels: {sum(us for _, us in idle.values()):.1f} us per step (traced call)")
    _table("idle before", idle, 15)
    n_gaps, during = host_in_gaps(kernels, host)
    print(f"\n{n_gaps} GPU gaps of >= 50 us in {steps} steps; host events overlapping them (all threads):")
    _table("host event in the gaps", {k: [n / steps, us / steps] for k, (n, us) in during.items()}, 25,
           "events / step | us in the gaps / step")
    lead = host_lead(kernels, host, sources)
    if lead:
        print(f"\nhost: {lead['host_us']:.0f} us per loop iteration (median); the host starts an iteration "
              f"{lead['lead_us'][0]:.0f} us (min) / {lead['lead_us'][1]:.0f} us (median) before the GPU starts it")
    _table("host event, whole call", attribute(host, {}, steps), 25, "events / step | us / step")
    no_weights, waiting = weight_idle(kernels, sources, steps)
    print(f"\nno weight stream running (HBM mostly idle): {no_weights:.1f} us per step")
    _table("source, no weight stream running", waiting, args.top, "kernels / step | us / step (shared)")
    if args.timeline:
        rows1 = one_step(kernels, sources, chunk)
        print(f"\none step's {len(rows1)} kernels in launch order:\n\n| # | start us | idle us before | us | source |\n"
              "|---|---|---|---|---|")
        for i, (start_us, idle_us, us, where) in enumerate(rows1):
            print(f"| {i} | {start_us:.1f} | {idle_us:.1f} | {us:.1f} | {where} |")
    return {"kernels_per_step": len(kernels) / steps, "gpu_us_per_step": busy, "busy_us_per_step": union,
            "no_weight_stream_us_per_step": no_weights, "host_lead": lead, "by_source": rows, "alone_by_source": solo}


if __name__ == "__main__":
    main()
