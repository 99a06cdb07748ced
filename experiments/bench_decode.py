"""Decode speed against the memory roofline, at the released width, without a checkpoint or a prefill.

    python -m experiments.bench_decode                       # the 6-layer v41-flash slice, batch 1/8/64, 4K
    python -m experiments.bench_decode --batch 64 --context 131072
    python -m experiments.bench_decode --preset small --weight-format float
    python -m experiments.bench_decode --preset v41-flash --layers 40   # the whole model (needs the memory)
    python -m experiments.bench_decode --mesh expert=2 --layout dp_ep --batch 128 --profile /tmp/p   # 2 devices

Weights are random in the released formats (`--weight-format fp8`: FP8 + E8M0/32x32 projections, packed
FP4 + E8M0/32 routed experts), generated on the device leaf by leaf; the cache is filled with random
bytes in the released formats at the given context (`--context` tokens in every sequence, room for `ROOM` = 256
more: its lengths go back to the context before a run of steps would pass that, `Room`). Each row:
ms per step (median of `--steps` donated decode steps, after warm-up), the same with `--chunk` steps
per call (`api.generate`: sampling on device; `--queued N`: N calls per host sync), the same in the serving loop's
steady state (each call queued before the previous call's tokens are read back, as `experiments.decode` runs
it: no host sync leaves the GPU idle; `serving_loop_ms`), the bytes a step
must move (stored weights of the dense layers and of the experts the batch was routed to in that step,
embedding/Engram rows, and the cache a step reads: window rings, the selected entries, the index keys
each indexer scans), the copy bandwidth measured in the same run, their ratio, launches per step
(instructions of the compiled program outside fusions) and the peak device memory.

The `v41-slice` preset is 6 layers of the released shapes: window / Full m=2 with Engram / Reuse /
Full m=1 candidate source / Reuse / Reindex. Engram tables are shrunk (a lookup reads B x rows, not the
table, so the size does not change what a step moves).

`--mesh` runs the same steps sharded (`partitioning.place` with `--layout`, default `dp_ep`) over the
devices at hand; `--batch` is then the whole batch, split as the layout says. Extra columns: tokens/s
in all and per device, and with `--profile` the communication per step (GPU time of the collective
kernels -- NCCL, all-to-all, all-gather, ... -- per device; it includes waiting for the slowest device)
and its share of the device's busy time and of the step. The bytes-to-move / roofline columns stay one
device's model of the whole batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

import dsv41_jax as d
from dsv41_jax import api, partitioning
from dsv41_jax.kernels import index_key_layout, resolve
from dsv41_jax.cache import init_cache
from dsv41_jax.plan import Mode, build_plan
from dsv41_jax.pytree_paths import is_engram_table, path_str
from experiments.bench_kernels import copy_bandwidth


def slice_config(**overrides):
    """The released shapes in 6 layers that cover every layer mode (see the module docstring)."""
    return dataclasses.replace(  # validated by with_derived_engram, once the Engram rows exist
        d.preset("v41-flash"), n_layers=6, n_mtp_layers=0, compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3), index_source_layers=(1, 3, 5),
        candidate_source_layer=3, engram_layer_ids=(1,), engram_vocab_size=100_003, engram_num_embeddings=(),
        vision_n_layers=0,  # decode speed: the tower runs once per image, in prefill
        **overrides).with_derived_engram()


def truncated(cfg, n: int):
    """The first n layers of `cfg` (sources, indexers and Engram past them dropped)."""
    keep = lambda ls: tuple(l for l in ls if l < n)
    return cfg.replace(n_layers=n, n_mtp_layers=0, kv_source_layers=keep(cfg.kv_source_layers),
                       index_source_layers=keep(cfg.index_source_layers),
                       candidate_source_layer=cfg.candidate_source_layer if cfg.candidate_source_layer < n else -1,
                       engram_layer_ids=keep(cfg.engram_layer_ids),
                       engram_num_embeddings=tuple(r for l, r in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings)
                                                   if l < n))


# ----------------------------------------------------------------------------- random weights and cache
def _kind(name: str, s: jax.ShapeDtypeStruct) -> str:
    """How to draw one param, from its name and stored dtype."""
    last = name.split("/")[-1]
    if s.dtype == jnp.uint8 and last.endswith("scale"):  # E8M0 exponents
        return "exp_expert" if "ffn/w" in name else ("exp_engram" if "engram" in name else "exp_dense")
    if s.dtype == jnp.uint8:
        return "bytes"  # packed FP4 codes: any byte is valid
    if s.dtype == jnp.float8_e4m3fn:
        return "e4m3"
    if s.dtype == jnp.int32:
        return "token_map"
    if "norm" in name or last in ("q_weight", "k_weight"):
        return "ones"
    if last in ("attn_sink", "bias", "base"):
        return "zeros"
    if "hc_" in name and last == "scale":
        return "tenth"
    return "unit" if name.startswith("embed") else "fan_in"


@functools.lru_cache(maxsize=None)
def _maker(kind: str, shape: tuple, dtype, compressed_vocab: int):
    """A jitted key -> value for one kind of param (one compile per kind, shape and dtype)."""
    def make(key):
        if kind.startswith("exp_"):  # E8M0 exponents with plausible weight magnitudes
            centre = {"exp_expert": 119, "exp_engram": 120, "exp_dense": 115}[kind]
            return jax.random.randint(key, shape, centre - 1, centre + 2).astype(dtype)
        if kind == "bytes":
            return jax.random.bits(key, shape, jnp.uint8)
        if kind == "e4m3":
            return jnp.clip(40 * jax.random.normal(key, shape, jnp.float32), -448, 448).astype(dtype)
        if kind == "token_map":
            return (jnp.arange(int(np.prod(shape)), dtype=jnp.int32) % compressed_vocab).reshape(shape)
        if kind in ("ones", "zeros", "tenth"):
            return jnp.full(shape, {"ones": 1.0, "zeros": 0.0, "tenth": 0.1}[kind], dtype)
        std = 1.0 if kind == "unit" else shape[-1] ** -0.5
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.jit(make)


def random_params(cfg, seed: int = 0):
    """Random params of `cfg` built leaf by leaf on the device (no f32 copy of the experts ever exists)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(api.abstract_params(cfg))
    out = [_maker(_kind(path_str(path), s), s.shape, s.dtype, cfg.engram_compressed_vocab_size)(
        jax.random.fold_in(jax.random.key(seed), i)) for i, (path, s) in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(tree, out)


ROOM = 256  # tokens a random cache has room for past its context: the most steps run between two rewinds


def random_cache(cfg, batch: int, context: int, seed: int = 1):
    """A cache holding `context` tokens per sequence and room for `ROOM` more, every record random bytes in
    its format."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, context + ROOM))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for i, (path, s) in enumerate(leaves):
        name, key = path_str(path), jax.random.fold_in(jax.random.key(seed), i)
        if name == "lengths":
            v = jnp.full(s.shape, context, jnp.int32)
        elif s.dtype == jnp.uint8 and name.endswith("scales"):
            # E4M3 scales (main KV) around 2**-6, E8M0 ones (window, index keys) around 2**-4
            e4m3 = "entries" in name
            v = jax.jit(lambda k: jax.random.randint(k, s.shape, 0x18 if e4m3 else 121, 0x20 if e4m3 else 125)
                        .astype(jnp.uint8))(key)
        elif s.dtype == jnp.uint8 and "window" in name:  # E4M3 values: avoid the NaN bytes 0x7f / 0xff
            v = jax.jit(lambda k: jax.random.bits(k, s.shape, jnp.uint8) & 0xF7)(key)
        elif s.dtype == jnp.uint8:
            v = jax.jit(lambda k: jax.random.bits(k, s.shape, jnp.uint8))(key)
        elif s.dtype == jnp.float32:
            v = jax.jit(lambda k: 0.1 * jax.random.normal(k, s.shape))(key)
        elif name == "ngram_history":
            v = jnp.ones(s.shape, jnp.int32)
        else:
            v = jnp.zeros(s.shape, s.dtype)
        out.append(v)
    return jax.tree_util.tree_unflatten(tree, out)


class Room:
    """Keeps the steps run on a `random_cache` inside its capacity, so that every step reads a cache of
    `context` to `context + ROOM` tokens (past the capacity a step's writes would fall off the arrays while
    its reads still counted `context`). `before(cache, n)`, called outside any timed region ahead of n more
    steps, sets the lengths back to `context` when those steps would pass the capacity: the positions after
    it are rewritten, the bytes stay random."""

    def __init__(self, context: int):
        self.context, self.taken = context, 0

    def before(self, cache, n: int):
        if n > ROOM:
            raise ValueError(f"{n} steps in one run pass the {ROOM} tokens of room of a random cache: run fewer "
                             "steps per call (--chunk) or fewer calls per host sync (--queued)")
        if self.taken + n > ROOM:
            # as committed as the lengths it replaces: a committed array among uncommitted ones is another
            # signature, and the next call compiled again (H200, thirty-second session: the loop column read a
            # compile, 124 ms a step)
            lengths = np.full(cache.lengths.shape, self.context, np.int32)
            lengths = (jax.device_put(lengths, cache.lengths.sharding) if cache.lengths.committed
                       else jnp.asarray(lengths))
            cache, self.taken = cache.replace(lengths=lengths), 0
        self.taken += n
        return cache


# ----------------------------------------------------------------------------- bytes a step must move
def _nbytes(a) -> int:
    return int(a.size) * jnp.dtype(a.dtype).itemsize


def weight_bytes(cfg, params, experts_hit: list[int]) -> dict:
    """Stored bytes a decode step reads: dense weights, routed experts hit, embedding and Engram rows."""
    dense, per_expert = 0, {}
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_str(path)
        if name.startswith("embed") or is_engram_table(name) or name == "engram_token_map":
            continue
        if "/ffn/w" in name:  # routed experts: [E, ...] per layer, counted per expert hit
            layer = int(name.split("/")[1])
            per_expert[layer] = per_expert.get(layer, 0) + _nbytes(a) // a.shape[0]
        else:
            dense += _nbytes(a)
    expert = sum(per_expert[l] * n for l, n in enumerate(experts_hit))
    return {"dense": dense, "experts": expert}


def cache_read_bytes(cfg, batch: int, context: int) -> int:
    """Cache bytes one decode step reads (released formats): each layer's window ring and selected
    entries, each indexer's keys (all of them, or the candidate pool's)."""
    fmt = d.cache.formats_of(cfg)
    win = fmt.window_kv.bytes_per_record(cfg.head_dim) * cfg.window_size
    entry = fmt.main_kv.bytes_per_record(cfg.head_dim)
    key = fmt.index_key.bytes_per_record(cfg.index_head_dim)
    total = 0
    for p in build_plan(cfg):
        total += win
        if p.mode is Mode.WINDOW:
            continue
        n = context // p.ratio
        total += min(cfg.index_topk, n) * entry
        if p.mode is Mode.FULL or (p.mode is Mode.REINDEX and not p.uses_candidates):
            total += n * key
        elif p.mode is Mode.REINDEX:
            total += min(cfg.candidate_topk_blocks * cfg.candidate_block_size, n) * key
    return batch * total


def experts_hit(cfg, params, cache, tokens, kernels: str):
    """(distinct routed experts per layer in one decode step on this cache, from the router's load; the cache after
    that step). The step runs as the timed ones do, with `kernels` (resolved) and the cache donated: the jnp
    scan's temporaries (14 GiB at 128K x 64) or a copy of a cache it may not overwrite (17 GiB) took an H100
    past its memory."""
    def load(params, cache, tokens):
        m = nnx.merge(api.graphdef(cfg), params)
        _, cache, aux = m.forward(cache, tokens[:, None], jnp.ones_like(cache.lengths), all_logits=False,
                                  kernels=kernels, with_aux=True)
        return aux.expert_load_le, cache
    counts, cache = jax.jit(load, donate_argnums=1)(params, cache, tokens)
    return [int(c) for c in np.asarray((counts > 0).sum(-1))], cache


# ----------------------------------------------------------------------------- timing
def launches(compiled) -> int:
    """Instructions of the compiled program outside fused computations: one per kernel launch or
    library call (parameters, tuples and bitcasts excluded)."""
    n, skip = 0, False
    for line in compiled.as_text().splitlines():
        if line and not line.startswith(" "):
            skip = "fused" in line or "wrapped" in line or line.startswith("HloModule")
            continue
        if skip or "=" not in line:
            continue
        head = line.split("=", 1)[1].split("(", 1)[0].split()
        if head and head[-1] not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            n += 1
    return n


COLLECTIVE = re.compile(r"nccl|all.?to.?all|ragged|all.?gather|all.?reduce|reduce.?scatter|collective|"
                        r"send.?recv|ptop|peer", re.IGNORECASE)  # kernel names of inter-device traffic


def kernel_profile(run, out_dir: str, steps: int, top: int = 15, devices: int = 1) -> list[dict]:
    """GPU time per step and device by kernel name over `run()` (which does `steps` decode steps on
    `devices` GPUs), from a jax.profiler trace (its Perfetto JSON): [{name, us_per_step, calls_per_step}],
    largest first, after a "total" row and a "communication" row (the kernels `COLLECTIVE` matches)."""
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        run()
    path = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            by_name.setdefault(e["name"], []).append(float(e.get("dur", 0)))
    per = steps * devices
    rows = sorted(({"name": n, "us_per_step": sum(v) / per, "calls_per_step": len(v) / per}
                   for n, v in by_name.items()), key=lambda r: -r["us_per_step"])
    sums = lambda name, rs: {"name": name, "us_per_step": sum(r["us_per_step"] for r in rs),
                             "calls_per_step": sum(r["calls_per_step"] for r in rs)}
    return [sums("total", rows), sums("communication", [r for r in rows if COLLECTIVE.search(r["name"])])] + rows[:top]


def on_mesh(cfg, params, cache, tokens, args):
    """(params, cache, tokens, placement) on `args.mesh` by `args.layout`'s rules."""
    mesh = partitioning.make_mesh(cfg, args.mesh, batch=cache.batch, layout=args.layout)
    placement = partitioning.place(cfg, params, mesh, args.layout, batch=cache.batch)
    return jax.device_put(params, placement.params), placement.put_cache(cache), placement.put_rows(tokens), placement


def serving_loop_ms(gen, cache, calls: int, chunk: int):
    """(ms per step, cache) of the decode loop as `experiments.decode` runs it: each call queued before the previous
    call's tokens are read back to the host, so the host never waits with the GPU idle. The step time is the spacing
    of the read-backs in steady state: from the first call's to the last's, over the calls completed in between
    (the pipeline's filling, before the first read-back, is not counted). gen(cache) -> (tokens, _, cache)."""
    toks, _, cache = gen(cache)
    stamps = []
    for _ in range(calls):
        nxt, _, cache = gen(cache)
        np.asarray(toks)  # the previous call's tokens to the host, as the CLI reads them
        stamps.append(time.perf_counter())
        toks = nxt
    np.asarray(toks)
    stamps.append(time.perf_counter())
    return 1e3 * (stamps[-1] - stamps[0]) / (calls * chunk), cache


def bench_point(cfg, params, batch: int, context: int, args, peak_bw: float) -> dict:
    cache, room = random_cache(cfg, batch, context), Room(context)
    tokens = jax.random.randint(jax.random.key(2), (batch,), 0, cfg.vocab_size)
    hit, cache = experts_hit(cfg, params, room.before(cache, 1), tokens, resolve(args.kernels))
    placement, n_dev, n_launch = None, 1, None
    if args.mesh:  # the same steps on the mesh: params placed there, the cache and tokens split
        params, cache, tokens, placement = on_mesh(cfg, params, cache, tokens, args)
        n_dev = placement.mesh.size
    run_params = api.freeze(params)  # as a serving loop passes them: flattened once
    if placement is None:
        # lowered with the arguments `step` passes, so that its first call reuses this compile (an argument of
        # another pytree structure, e.g. unfrozen params, compiled the step a second time: 62 s at batch 8)
        lowered = api._forward_donating.lower(cfg, run_params, cache, tokens[:, None], jnp.ones((batch,), jnp.int32),
                                              all_logits=False, kernels=resolve(args.kernels))
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        n_launch = launches(compiled)
    step = lambda c, t: api.decode_step(cfg, run_params, c, t, kernels=args.kernels, validate=False, donate=True,
                                        placement=placement)
    if placement is not None:  # no lowering on a mesh here: the first call's time, compile included
        cache = room.before(cache, 1)
        t0 = time.perf_counter()
        logits, cache = step(cache, tokens)
        logits.block_until_ready()
        compile_s = time.perf_counter() - t0
    print(f"  compiled in {compile_s:.1f} s, {n_launch} launches; warming up", flush=True)
    cache = room.before(cache, 3)
    for _ in range(3):
        logits, cache = step(cache, tokens)
    logits.block_until_ready()
    times = []
    for _ in range(args.steps):
        cache = room.before(cache, 1)
        t = time.perf_counter()
        logits, cache = step(cache, tokens)
        logits.block_until_ready()
        times.append(time.perf_counter() - t)
    ms = 1e3 * statistics.median(times)
    print(f"  {ms:.3f} ms/step; timing the jitted loop", flush=True)
    # the jitted loop: --chunk steps per call
    gen = lambda c: api.generate(cfg, run_params, c, tokens, args.chunk, kernels=args.kernels, validate=False,
                                 placement=placement)
    toks, _, cache = gen(room.before(cache, args.chunk))
    toks.block_until_ready()
    gtimes = []
    for _ in range(max(2, args.steps // (args.chunk * args.queued))):
        cache = room.before(cache, args.chunk * args.queued)
        t = time.perf_counter()
        for _ in range(args.queued):  # queued behind each other, one host sync for the group
            toks, _, cache = gen(cache)
        toks.block_until_ready()
        gtimes.append((time.perf_counter() - t) / (args.chunk * args.queued))
    loop_ms = 1e3 * statistics.median(gtimes)
    # serving runs of as many calls as the room holds (the first call of a run, the pipeline's filling, is not
    # counted): the median run's ms per step
    calls = max(4, args.steps // args.chunk)
    per_run = min(calls, ROOM // args.chunk - 1)
    serving = []
    for _ in range(-(-calls // per_run)):
        ms_run, cache = serving_loop_ms(gen, room.before(cache, (per_run + 1) * args.chunk), per_run, args.chunk)
        serving.append(ms_run)
    serving_ms = statistics.median(serving)
    prof = None
    if args.profile:
        def run():
            nonlocal cache
            toks, _, cache = gen(room.before(cache, args.chunk))
            toks.block_until_ready()
        prof = kernel_profile(run, os.path.join(args.profile, f"b{batch}_c{context}"), args.chunk, args.profile_top,
                              n_dev)
        for r in prof:
            print(f"    {r['us_per_step']:9.1f} us/step {r['calls_per_step']:6.1f} calls  {r['name'][:110]}", flush=True)
    w = weight_bytes(cfg, params, hit)
    c_bytes = cache_read_bytes(cfg, batch, context)
    embed_rows = batch * cfg.dim * jnp.dtype(cfg.param_dtype).itemsize
    must = w["dense"] + w["experts"] + c_bytes + embed_rows
    roof_ms = 1e3 * must / peak_bw
    stats = jax.devices()[0].memory_stats() or {}
    del cache
    comm_us = prof[1]["us_per_step"] if prof and prof[0]["us_per_step"] else None  # None: no GPU kernels traced
    return dict(batch=batch, context=context, devices=n_dev, mesh=args.mesh, layout=args.layout if args.mesh else None,
                tokens_per_s=batch * 1e3 / loop_ms, tokens_per_s_per_device=batch * 1e3 / loop_ms / n_dev,
                comm_us_step=comm_us, comm_share=None if comm_us is None else comm_us / prof[0]["us_per_step"],
                comm_share_of_step=None if comm_us is None else comm_us / (1e3 * loop_ms),
                ms_step=ms, ms_step_loop=loop_ms, ms_step_serving=serving_ms, steps_per_call=args.chunk,
                calls_per_sync=args.queued, roofline_ms=roof_ms,
                ratio=ms / roof_ms, ratio_loop=loop_ms / roof_ms, ratio_serving=serving_ms / roof_ms,
                bytes_must_move=must, dense_bytes=w["dense"],
                expert_bytes=w["experts"], cache_bytes_read=c_bytes, experts_hit=hit, launches=n_launch,
                compile_s=compile_s, profile=prof, peak_bytes=stats.get("peak_bytes_in_use"), logit_absmax=float(jnp.abs(logits).max()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v41-slice", choices=["v41-slice", "v41-flash", "small", "tiny"])
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers of the preset")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, nargs="+", default=[4096])
    p.add_argument("--weight-format", default=None, choices=["fp8", "float"],
                   help="default: fp8 (released formats) for the v41 presets, the preset's own otherwise")
    p.add_argument("--activation-quant", action="store_true", help="the release's W8A8 / W4A8 mode")
    p.add_argument("--kernels", default="auto", choices=["auto", "jnp", "pallas"])
    p.add_argument("--index-key-layout", default="auto", choices=["auto", "nibbles", "sm90"],
                   help="the cached index keys' word layout (ModelConfig.index_key_layout; auto: the kernels' choice)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per point (median)")
    p.add_argument("--chunk", type=int, default=16,
                   help="steps per api.generate call (16: what experiments.decode runs; each call pays one graph "
                        "update, docs/BENCHMARKS.md twelfth pass)")
    p.add_argument("--queued", type=int, default=1,
                   help="calls the loop timing queues before the host waits (1: a sync per call; experiments.decode "
                        "queues each call before reading the previous call's tokens, so its host work overlaps the "
                        "GPU's)")
    p.add_argument("--copy-gb", type=float, default=4.0, help="GiB of the copy that measures the peak bandwidth")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one --chunk loop per point into DIR and print GPU time per kernel")
    p.add_argument("--profile-top", type=int, default=15, help="kernels listed per profiled point")
    p.add_argument("--mesh", default=None, help="run sharded over the devices at hand, e.g. expert=2 or data=2 "
                   "(axes data/tensor/expert; the product must equal the device count)")
    p.add_argument("--layout", default="dp_ep", choices=sorted(partitioning.LAYOUTS), help="rules for --mesh")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def mesh_table(rows, args) -> None:
    print("\n| mesh | layout | batch | devices | ms/step (loop) | tokens/s | tokens/s/device | comm us/step/device "
          "| comm / busy | comm / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    for r in rows:
        comm = "-" if r["comm_us_step"] is None else f"{r['comm_us_step']:.0f}"
        print(f"| {args.mesh} | {args.layout} | {r['batch']} | {r['devices']} | {r['ms_step_loop']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_per_device']:.0f} | {comm} | {pct(r['comm_share'])} | "
              f"{pct(r['comm_share_of_step'])} |")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    v41 = args.preset.startswith("v41")
    fmt = args.weight_format or ("fp8" if v41 else None)
    over = (dict(activation_quant=args.activation_quant, index_key_layout=args.index_key_layout)
            | ({"weight_format": fmt} if fmt else {}))
    cfg = slice_config(**over) if args.preset == "v41-slice" else d.preset(args.preset, **over)
    if args.layers is not None:
        cfg = truncated(cfg, args.layers)
    if max(args.context) + ROOM > cfg.max_seq_len:
        raise SystemExit(f"error: --context {max(args.context)} exceeds the preset's max_seq_len {cfg.max_seq_len} - "
                         f"{ROOM}")
    if args.chunk * max(2, args.queued) > ROOM:
        raise SystemExit(f"error: --chunk {args.chunk} x max(2, --queued {args.queued}) steps must fit the {ROOM} "
                         "tokens of room of the random cache")
    if args.mesh:
        try:  # before the params exist
            for b in args.batch:
                partitioning.check_mesh(cfg, partitioning.parse_mesh(args.mesh), b, layout=args.layout)
        except partitioning.MeshError as e:
            raise SystemExit(f"error: --mesh {args.mesh}: {e}") from None
    print(f"{args.preset}: {cfg.n_layers} layers, weight_format={cfg.weight_format}, kernels={args.kernels}, "
          f"index keys {index_key_layout(cfg)}, "
          f"device {jax.devices()[0].device_kind}" + (f", mesh {args.mesh} layout {args.layout}" if args.mesh else ""),
          flush=True)
    peak = copy_bandwidth(args.copy_gb)
    print(f"copy bandwidth (read+write, this run): {peak / 1e9:.0f} GB/s", flush=True)
    t = time.perf_counter()
    params = random_params(cfg)
    jax.block_until_ready(params)
    print(f"random params in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    for ctx in args.context:
        for b in args.batch:
            print(f"batch {b}, context {ctx} ...", flush=True)
            r = bench_point(cfg, params, b, ctx, args, peak)
            r.update(preset=args.preset, layers=cfg.n_layers, kernels=args.kernels, peak_bw=peak)
            rows.append(r)
            print(f"  {r['ms_step']:.3f} ms/step ({r['ms_step_loop']:.3f} in the loop), roofline {r['roofline_ms']:.3f} "
                  f"ms, compile {r['compile_s']:.1f} s", flush=True)
    print(f"\n(the loop: {args.chunk} steps per api.generate call, {args.queued} call(s) per host sync; serving: "
          "each call queued before the previous call's tokens are read back, as experiments.decode runs it)")
    print("\n| batch | context | ms/step | ms/step (loop) | ms/step (serving) | must move GB | roofline ms | step/roof | "
          "loop/roof | serving/roof | experts hit | launches | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['ms_step']:.3f} | {r['ms_step_loop']:.3f} | "
              f"{r['ms_step_serving']:.3f} | {r['bytes_must_move'] / 1e9:.3f} | {r['roofline_ms']:.3f} | {r['ratio']:.2f} | "
              f"{r['ratio_loop']:.2f} | {r['ratio_serving']:.2f} | {sum(r['experts_hit'])} | {r['launches'] or '-'} | "
              f"{(r['peak_bytes'] or 0) / 2**30:.1f} |")
    if args.mesh:
        mesh_table(rows, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
