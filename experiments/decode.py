"""Prompt in, tokens out, with the numbers that matter: tokens/s, cache bytes/token, peak memory.

    python -m experiments.decode                       # tiny preset, random weights, CPU or GPU
    python -m experiments.decode --preset small --max-new-tokens 128 --batch 8
    python -m experiments.decode --prompt-file p.txt --tokenizer tokenizer.json --output-json run.json
    python -m experiments.decode --cache-dir /tmp/kv --repeat 2 --output-json run.json   # serving engine
    python -m experiments.decode --checkpoint DIR --prompt-ids ids.npy --cache-dir /tmp/kv --temperature 0
    python -m experiments.decode --image cat.png --prompt "Describe the picture."   # images in the prompt
    python -m experiments.decode --speculative dspark --batch 4                  # + DSpark, same prompt

Without --engine / --cache-dir the prompt (and its --batch truncations) runs as one static batch, as
before. With them it goes through `dsv41_jax.serving.Engine`: fixed decode slots, chunked prefill,
prefix reuse from the host pool and the on-disk page store, per-request metrics in the JSON.
Random-weight presets produce random text: this measures the machinery, not quality.

`--speculative dspark` with --engine runs the engine's decode as DSpark draft-verify steps (per-request
`acceptance_length` in the JSON). Without --engine it decodes the same prompt a second time with DSpark speculative
decoding (dsv41_jax.dspark: draft a block, verify it with one target forward, commit the accepted prefix)
and reports acceptance length (tokens per verify step), draft and verify time per step and tokens/s,
next to the plain decode's tokens/s from the same run, and whether the tokens agree (they must at
temperature 0). Random draft weights accept almost nothing: trained ones come from --run (an
`experiments.train_draft` output).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import dsv41_jax as d
from dsv41_jax import compile_options
from dsv41_jax.cache import cache_bytes
from dsv41_jax.compile_notice import compiling
from dsv41_jax.sampling import sample
from experiments import _cli
from experiments.placement import committed


def peak_memory_bytes() -> tuple[int, str]:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), f"{jax.default_backend()} device peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host process max RSS"


WARM_PATHS = """\
Each request prints the path its prompt took: cold prefill; exact restore (pages from
disk, window from the host pool: the cold run's tokens); bounded replay (a run on a
--cache-dir that an earlier process filled: pages from disk, last window recomputed,
an approximation whose greedy tokens can differ from a cold run's); or full recompute.
For the cold run's tokens on every run, add --no-bounded-replay."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 2)
    src.add_argument("--prompt-file", help="UTF-8 text file holding the prompt")
    src.add_argument("--prompt-ids", help=".npy of int token ids: [tokens] for one request, [requests, tokens] for several")
    ap.add_argument("--checkpoint", help="a released checkpoint directory (needs dsv41_jax.checkpoint); "
                    "its tokenizer.json is used unless --tokenizer is given")
    ap.add_argument("--decode-chunk", type=int, default=16,
                    help="decode steps per compiled call (api.generate: sampling on device, no host work between "
                         "tokens), with or without --mesh")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sequence; prompt + "
                    "these must fit the cache (--capacity, at most the model's max_seq_len)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (the prompt, truncated "
                    "by b tokens for sequence b, so lengths differ)")
    ap.add_argument("--capacity", type=int, help="cache tokens per sequence (default: prompt + new tokens)")
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: byte-level)")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image for the prompt (repeatable; needs a model with a vision tower). Each goes where "
                    "the prompt has an image placeholder (image_token_id), in order; a prompt without placeholders "
                    "gets them all at its start (after a leading <bos>)")
    ap.add_argument("--engram-on-host", action="store_true",
                    help="with --checkpoint: keep the Engram tables in host memory (pinned_host), gathered there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-quantize-cache", action="store_true", help="raw cache instead of FP4/FP8")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the preset's)")
    ap.add_argument("--weight-format", choices=["float", "fp8"],
                    help="random weights of a --preset as floats (the preset's default) or in the released formats "
                    "(fp8: FP8 + E8M0 32x32 projections, packed FP4 routed experts), as a checkpoint loads them")
    ap.add_argument("--kernels", default="auto", choices=["auto", "jnp", "pallas"])
    ap.add_argument("--output-json", help="write generated ids and metrics here")
    ap.add_argument("--speculative", choices=["dspark"], help="also decode with DSpark speculative decoding and "
                    "compare (needs draft stages: a preset or --run whose config has n_mtp_layers > 0)")
    ap.add_argument("--run", help="an experiments.train_small output directory (config.json + checkpoint/): "
                    "its trained weights and config instead of --preset's random ones")
    ap.add_argument("--mesh", help="run sharded on a device mesh, axis=size pairs over data/tensor/expert, "
                    "e.g. data=2,expert=4 (product = device count; see dsv41_jax/partitioning.py)")
    ap.add_argument("--layout", default="tp_ep", choices=["tp_ep", "dp", "dp_ep"],
                    help="sharding rule set for --mesh (dp_ep: attention data-parallel, experts expert-parallel)")
    ap.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first "
                    "(multi-host: one process per host, coordinator from the environment)")
    eng = ap.add_argument_group("serving engine (on with --engine or --cache-dir)", WARM_PATHS)
    eng.add_argument("--engine", action="store_true", help="serve through dsv41_jax.serving.Engine")
    eng.add_argument("--cache-dir", help="persistent page store for prompt prefixes (implies --engine; must be a "
                     "writable directory, created if missing)")
    eng.add_argument("--slots", type=int, help="decode slots (default: --batch, or from --hbm-budget-gb)")
    eng.add_argument("--hbm-budget-gb", type=float, help="derive the slot count from this cache budget")
    eng.add_argument("--prefill-chunk", type=int, default=256)
    eng.add_argument("--page-tokens", type=int, default=64)
    eng.add_argument("--retention-hours", type=float, default=72.0)
    eng.add_argument("--host-pool-gb", type=float, help="window pool size (default: 10%% of host memory)")
    eng.add_argument("--host-ttl-s", type=float, default=300.0)
    eng.add_argument("--no-prefix-reuse", action="store_true", help="never read the tiers (cold every time)")
    eng.add_argument("--no-bounded-replay", "--no-replay", dest="no_replay", action="store_true",
                     help="on a disk hit without window state, recompute the whole prompt instead of replaying the "
                     "last window: output identical to a cold run (slower)")
    eng.add_argument("--no-bounded-prefill", action="store_true", help="run every layer on every prompt token "
                     "(exact) instead of running the layers after the last kv source on the last window only")
    eng.add_argument("--stop-token", type=int, action="append", default=[], help="stop at this id (repeatable)")
    eng.add_argument("--repeat", type=int, default=1, help="serve the same requests this many times in a row "
                     "(the second round shows prefix reuse)")
    args = ap.parse_args(argv)
    args.engine = args.engine or bool(args.cache_dir)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if args.decode_chunk < 1:
        ap.error("--decode-chunk must be >= 1")
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.capacity is not None and args.capacity < 2:
        ap.error("--capacity must be >= 2")
    if args.prefill_chunk < 1:
        ap.error("--prefill-chunk must be >= 1")
    if args.engram_on_host and not args.checkpoint:
        ap.error("--engram-on-host applies to --checkpoint (presets have random in-memory tables)")
    if args.image and args.batch > 1:
        ap.error("--image runs one sequence: drop --batch (several requests: --engine --prompt-ids)")
    if args.speculative and args.mesh and not args.engine:
        ap.error("--speculative on a mesh runs through the serving engine: add --engine")
    if args.run and args.checkpoint:
        ap.error("give --run or --checkpoint, not both")
    if args.weight_format and (args.run or args.checkpoint):
        ap.error("--weight-format applies to a --preset's random weights (a checkpoint or run has its own)")
    return args


def model_name(args) -> str:
    """What the run decodes with, for its log and JSON: the checkpoint, the training run, or the preset."""
    return str(args.checkpoint or args.run or args.preset)


def model_config(args):
    """The config the run will use, from --preset or the checkpoint's config.json (no weights read)."""
    overrides = {"quantize_cache": not args.no_quantize_cache}
    if args.dtype:
        overrides.update(dtype=args.dtype, param_dtype=args.dtype)
    if args.weight_format:
        overrides.update(weight_format=args.weight_format)
    if args.checkpoint:
        return _cli.checkpoint_config(args.checkpoint)
    if args.run:
        from experiments.quality import run_config

        return run_config(args.run).replace(sinkhorn_unroll="auto", **overrides)
    return d.preset(args.preset, **overrides)


def load_weights(args, cfg):
    """(cfg, params or None for random ones) once the input is known to be usable: the slow part."""
    if not (args.run or args.checkpoint):
        return cfg, None
    shardings = None
    if args.mesh:  # each array read straight into its shards: no device holds the whole model
        from dsv41_jax import partitioning

        mesh = partitioning.make_mesh(cfg, args.mesh, batch=args.batch, layout=args.layout)
        shardings = partial(partitioning.param_sharding, mesh=mesh, layout=args.layout)
    if args.run:
        from experiments.quality import load_run

        return cfg, load_run(Path(args.run), cfg, shardings)
    loaded = _cli.load_checkpoint(args.checkpoint, dtype=args.dtype or "bfloat16", engram_on_host=args.engram_on_host,
                                  shardings=shardings)
    return loaded.cfg, loaded.params


def tokenizer(args, cfg):
    if args.tokenizer or not args.checkpoint:  # the byte-level one writes a vision model's placeholder "<image>"
        return _cli.tokenizer(args.tokenizer, cfg.vocab_size, "--tokenizer",
                              cfg.image_token_id if cfg.vision_n_layers else None)
    path = os.path.join(args.checkpoint, "tokenizer.json")
    return _cli.tokenizer(path if os.path.exists(path) else None, cfg.vocab_size, "--checkpoint")


def prompt_ids(args, tok, vocab_size: int) -> list[np.ndarray]:
    if args.prompt_ids:
        ids = _cli.load_ids(args.prompt_ids, "--prompt-ids")
        _cli.check_ids(ids, vocab_size, "--prompt-ids", args.prompt_ids)
        return [r for r in np.atleast_2d(ids).astype(np.int32)]
    text = _cli.read_text(args.prompt_file, "--prompt-file") if args.prompt_file else args.prompt
    ids = np.asarray(tok.encode(text), np.int32)
    if ids.size == 0:
        raise _cli.UserError(f"{'--prompt-file ' + args.prompt_file if args.prompt_file else '--prompt'}: "
                             "encodes to zero tokens; give some text")
    return [ids]


def place_images(args, cfg, tok, prompts: list[np.ndarray]):
    """(prompts with their image spans expanded, the spans of each) for --image; every image is read and
    checked here, before any weights or compiles (`dsv41_jax.images`: unreadable, too small, too elongated)."""
    if not args.image:
        return prompts, [[] for _ in prompts]
    from dsv41_jax.images import ImageError, expand_prompt, prepare_image

    if not cfg.vision_n_layers:
        raise _cli.UserError(f"--image {args.image[0]}: this model has no vision tower (vision_n_layers == 0)")
    try:
        images = [prepare_image(path, cfg) for path in args.image]
    except ImageError as e:
        raise _cli.UserError(f"--image {e}") from None
    out, spans = [], []
    for ids in prompts:
        if not (ids == cfg.image_token_id).any():  # no placeholders: the images lead the prompt
            at = 1 if ids.size and ids[0] == getattr(tok, "bos_id", None) else 0
            ids = np.concatenate([ids[:at], np.full(len(images), cfg.image_token_id, np.int32), ids[at:]])
        try:
            ids, where = expand_prompt(ids, images, cfg)
        except ValueError as e:
            raise _cli.UserError(f"--image: {e}") from None
        out.append(ids)
        spans.append(where)
    for img in images:
        print(f"[decode] image {img.source}: {img.n_vit_h}x{img.n_vit_w} patches -> {img.n_tokens} prompt tokens",
              flush=True)
    return out, spans


def cache_capacity(args, cfg, longest: int, default: int) -> int:
    """Tokens per cache row: --capacity, else `default` (>= longest + --max-new-tokens); refused with the
    flag to change when the longest prompt and its new tokens do not fit the model or --capacity."""
    if args.capacity and args.capacity > cfg.max_seq_len:
        raise _cli.UserError(f"--capacity {args.capacity}: exceeds the model's max_seq_len of {cfg.max_seq_len}")
    limit, what = (args.capacity, "--capacity") if args.capacity else (cfg.max_seq_len, "the model's max_seq_len")
    if longest >= limit:
        raise _cli.UserError(f"the prompt has {longest} tokens: no room for a new token in {what} ({limit}); "
                             "shorten the prompt")
    need = longest + args.max_new_tokens
    if need > limit:
        raise _cli.UserError(f"--max-new-tokens {args.max_new_tokens}: the prompt ({longest} tokens) + "
                             f"{args.max_new_tokens} new tokens need {need} cache tokens, more than {what} "
                             f"({limit}); use --max-new-tokens {limit - longest} or less")
    return args.capacity or min(default, cfg.max_seq_len)


def check_mesh(args, cfg) -> None:
    from dsv41_jax import partitioning

    try:
        partitioning.check_mesh(cfg, partitioning.parse_mesh(args.mesh), batch=args.batch, layout=args.layout)
    except partitioning.MeshError as e:
        raise _cli.UserError(f"--mesh {args.mesh}: {e}") from None


def device_memory(n_devices: int) -> tuple[float, str]:
    """(bytes one device may hold, what it is): an accelerator's allocator limit, or on a CPU its share of the
    host's memory (simulated devices share it)."""
    dev = jax.local_devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    if limit:
        return float(limit), f"a {dev.device_kind}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / n_devices, "this host's memory" + (
        f" / {n_devices} devices" if n_devices > 1 else "")


def check_memory(args, cfg, rows: int, capacity: int) -> None:
    """Refuse, before any weight is drawn or read, a run whose weights and cache alone exceed a device's memory
    (XLA's out-of-memory error would come minutes later, deep in a traceback). Activations and XLA's workspace are
    not counted: a run that passes may still not fit. rows x capacity: the cache (0 rows: none counted).

    Where the weights go: one device without --mesh; with --mesh, random weights are drawn and a checkpoint or a
    --run is read into their shards (`sharding.init_model`, `load_weights`)."""
    from jax.sharding import AbstractMesh

    from dsv41_jax import partitioning as S
    from experiments.plan_deployment import size

    if args.checkpoint:  # the formats `load_weights` will read it in (FP8/FP4 kept), from the headers
        cfg = _cli.load_checkpoint(args.checkpoint, config_only=True, dtype=args.dtype or "bfloat16")
    try:
        params = d.abstract_params(cfg)
    except ValueError as e:  # quant: a dimension the released formats' scale blocks do not divide
        raise _cli.UserError(f"--weight-format {cfg.weight_format}: {args.preset} does not fit the released "
                             f"formats ({e}); use --weight-format float") from None
    sizes = S.parse_mesh(args.mesh) if args.mesh else {"data": 1}
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    by = S.param_bytes(params, mesh, args.layout)
    w_total, w_dev = by["weights"]
    if not args.engram_on_host:  # with it the tables stay in pinned host memory
        w_total, w_dev = w_total + by["engram_tables"][0], w_dev + by["engram_tables"][1]
    c_total, c_dev = 0, 0.0
    if rows:
        cache = jax.eval_shape(lambda: d.init_cache(cfg, rows, capacity))
        c_total, c_dev = S.bytes_per_device(cache, S.cache_specs(cache, mesh, args.layout), mesh)
    need = (w_dev if args.mesh else w_total) + c_dev
    have, what = device_memory(mesh.size)
    if need <= have:
        return
    where = f"each of the --mesh {args.mesh} devices" if args.mesh else "one device"
    plan = "`python -m experiments.plan_deployment" + ("`" if args.checkpoint or args.run else
                                                         f" --preset {args.preset} --mesh expert=8 --layout dp_ep`")
    fp8 = "" if cfg.weight_format == "fp8" or args.checkpoint or args.run else \
        "draw the random weights in the released formats (--weight-format fp8), "
    advice = fp8 + (f"split the model over several devices with --mesh, planned by {plan}, or run a smaller --preset "
                    "(small, tiny)" if not args.mesh else f"plan a wider mesh with {plan}"
              + (", or give the Engram tables to host memory with --engram-on-host" if args.checkpoint
                 and not args.engram_on_host else ""))
    cache = f" and cache for {rows} x {capacity} tokens ({size(c_total).strip()})" if rows else ""
    raise _cli.UserError(
        f"{model_name(args)} does not fit: its weights ({size(w_total).strip()} in all){cache} need "
        f"{size(need).strip()} on {where}, and {what} holds {size(have).strip()} ({jax.default_backend()}; "
        f"activations not counted); {advice}")


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    # every check of the input first: what follows (weights, compiles) takes seconds to minutes
    cfg = model_config(args)
    tok = tokenizer(args, cfg)
    prompts = prompt_ids(args, tok, cfg.vocab_size)
    prompts, spans = place_images(args, cfg, tok, prompts)
    _cli.output_file(args.output_json, "--output-json")
    bad_stops = [t for t in args.stop_token if not 0 <= t < cfg.vocab_size]
    if bad_stops:
        raise _cli.UserError(f"--stop-token {bad_stops[0]}: not an id of this model (0..{cfg.vocab_size - 1})")
    longest = max(p.size for p in prompts)
    if args.speculative and not cfg.has_dspark:
        raise _cli.UserError(f"--speculative dspark: this model has no DSpark draft stages (n_mtp_layers="
                             f"{cfg.n_mtp_layers}, dspark_block_size={cfg.dspark_block_size}); use --preset tiny or a "
                             "--run made by experiments.train_draft")
    if args.speculative and not args.engine and args.max_new_tokens < 2:
        raise _cli.UserError("--speculative needs --max-new-tokens >= 2 (the prefill gives the first token, "
                             "drafting starts after it)")
    if args.engine:
        chunk = args.prefill_chunk
        spare = cfg.dspark_block_size if args.speculative else 0  # a verify appends a whole block
        capacity = cache_capacity(args, cfg, longest, -(-(longest + args.max_new_tokens + spare) // chunk) * chunk)
        ecfg = engine_config(args, cfg, capacity, len(prompts) * args.batch)
        if args.cache_dir:
            _cli.writable_dir(args.cache_dir, "--cache-dir")
        check_memory(args, cfg, 0, capacity)  # the engine sizes its cache to the memory left
        cfg, params = load_weights(args, cfg)
        return serve(args, cfg, params, tok, prompts, ecfg, spans)
    if len(prompts) > 1:
        raise _cli.UserError(f"--prompt-ids {args.prompt_ids}: several prompts need the serving engine: add --engine")
    # a speculative verify appends a whole block before the rejected tail is dropped
    spare = cfg.dspark_block_size + 1 if args.speculative else 0
    capacity = cache_capacity(args, cfg, longest + spare, longest + spare + args.max_new_tokens)
    if args.mesh:
        check_mesh(args, cfg)
    check_memory(args, cfg, args.batch, capacity)
    cfg, params = load_weights(args, cfg)
    return run_batch(args, cfg, params, tok, prompts[0].tolist(), capacity, spans[0])


def run_batch(args, cfg, params, tok, ids: list[int], capacity: int, spans=()) -> dict:
    """The prompt and its --batch truncations as one static batch: prefill, then --max-new-tokens - 1 steps.
    spans: the prompt's image spans (--image; batch 1)."""
    b = args.batch
    lengths = np.array([max(1, len(ids) - i) for i in range(b)], np.int32)
    width = -(-len(ids) // 64) * 64  # bucket the padded width so nearby prompt lengths share a compile
    tokens = np.zeros((b, width), np.int32)
    for i in range(b):
        tokens[i, : lengths[i]] = ids[: lengths[i]]
    print(f"[decode] model={model_name(args)} backend={jax.default_backend()} batch={b} prompt={len(ids)} tokens "
          f"capacity={capacity} cache={'fp4/fp8' if cfg.quantize_cache else 'raw'} dtype={cfg.dtype}", flush=True)

    t0 = time.perf_counter()
    placement = None  # one device; with --mesh, where the params, caches and rows live on the mesh
    if args.mesh:
        from dsv41_jax import partitioning, sharding

        mesh = partitioning.make_mesh(cfg, args.mesh, batch=b, layout=args.layout)
        sharded = (sharding.init_model(cfg, mesh, args.layout, batch=b, seed=args.seed) if params is None
                   else sharding.shard_model(cfg, params, mesh, args.layout, batch=b))
        params, placement = sharded.params, sharded.placement
        print(f"[decode] mesh {dict(mesh.shape)} layout {args.layout} on {mesh.size} device(s)", flush=True)
    elif params is None:
        params = d.init_params(cfg, seed=args.seed)
    jax.block_until_ready(params)
    t_init = time.perf_counter() - t0
    params = d.freeze(params)  # passed to a jitted call per chunk of steps: flattened once
    cache = placement.new_cache(cfg, capacity) if placement else d.init_cache(cfg, b, capacity)
    if args.speculative:  # as `compile_side_by_side`'s stand-ins (experiments/placement.py says why)
        cache = committed(cache)
    # the cache is donated: each call updates it in place and returns it
    images = [list(spans)] if spans else None
    prefill = lambda c, t, n: d.prefill(cfg, params, c, t, n, kernels=args.kernels, donate=True, images=images,
                                        placement=placement)
    steps = args.max_new_tokens - 1  # cache_capacity made room for all of them
    temp, seed, chunk = _loop_setup(args, b)

    def decode_chunk(cache, nxt, done: int, n: int):
        """n steps in one call, sampling on device (nxt: int32 [B], on the host or the device); nothing is read
        back: returns the device's tokens [B, chunk] (past n: each sequence's last token, repeated), the last
        of them (the next call's nxt) and the cache."""
        toks, _, cache = d.generate(cfg, params, cache, nxt, chunk, temperature_b=temp, seed_b=seed,
                                    step_b=1 + done, budget_b=n, kernels=args.kernels, validate=False,
                                    placement=placement)
        return toks, toks[:, -1], cache
    shape = (cfg, b, capacity, args.kernels, args.mesh, args.layout)  # what a compiled program depends on
    labels = {"prefill": f"prefill [B={b}, T={width}]",
              "decode": f"decode [B={b}, capacity={capacity}, {chunk} steps per call]"}
    if args.speculative:  # six programs (steps >= 1 here): compiled side by side before anything is timed
        compile_side_by_side([
            (("prefill", width, *shape), labels["prefill"],  # with the sampling of its logits, as timed
             lambda: sample(prefill(committed(d.init_cache(cfg, b, capacity)), tokens, lengths)[0], temp, seed,
                            jnp.zeros((b,), jnp.int32))),
            (("decode", chunk, *shape), labels["decode"], lambda: decode_chunk(
                committed(d.init_cache(cfg, b, capacity)), np.zeros((b,), np.int32), 0, min(chunk, steps))),
            *speculative_programs(args, cfg, params, tokens, lengths, capacity)])

    t0 = time.perf_counter()
    with compiling(("prefill", width, *shape), labels["prefill"]):
        logits, cache = prefill(cache, tokens, lengths)
    nxt = np.asarray(sample(logits, temp, seed, jnp.zeros((b,), jnp.int32)))
    ttft = time.perf_counter() - t0

    out, t_first, t_loop, done = [nxt[:, None]], 0.0, 0.0, 0
    if steps:
        t0 = time.perf_counter()
        with compiling(("decode", chunk, *shape), labels["decode"]):
            toks, nxt, cache = decode_chunk(cache, nxt, 0, min(chunk, steps))
            out.append(np.asarray(toks)[:, :min(chunk, steps)])
        done = out[-1].shape[1]
        t_first = time.perf_counter() - t0  # includes compiling the decode loop
    # the bar starts after that compile, so its rate and ETA are the steps'. Each call is queued before the
    # previous call's tokens are read back, so the host's work between calls (its launches, reading the tokens)
    # overlaps the GPU's: the next call's first token is the previous call's last, still on the device.
    with tqdm(total=steps - done, desc="decode", unit="tok", disable=steps < 32, file=sys.stderr) as bar:
        def read_back(toks, n: int) -> None:  # a call's n new tokens to the host
            out.append(np.asarray(toks)[:, :n])
            bar.update(n)

        t0, pending = time.perf_counter(), None
        while done < steps:
            n = min(chunk, steps - done)
            toks, nxt, cache = decode_chunk(cache, nxt, done, n)
            if pending is not None:
                read_back(*pending)
            pending, done = (toks, n), done + n
        if pending is not None:
            read_back(*pending)
        t_loop = time.perf_counter() - t0
    gen = np.concatenate(out, axis=1)  # [B, new]

    live = cache_bytes(cache)  # measured from the arrays this run allocated
    glob = live["global_main_kv"] + live["global_index_keys"]
    if args.speculative:  # compiled before: every call is timed
        t_loop, timed = t_loop + t_first, steps
    else:
        timed = steps - min(chunk, steps)  # the steps after the first (compiling) call
    tps = b * timed / t_loop if timed and t_loop > 0 else float("nan")
    peak, peak_kind = peak_memory_bytes()
    metrics = dict(
        preset=model_name(args), backend=jax.default_backend(), mesh=args.mesh, batch=b, prompt_tokens=lengths.tolist(),
        new_tokens=int(gen.shape[1]), init_s=t_init, ttft_s=ttft, first_decode_step_s=t_first,
        decode_tokens_per_s=tps, decode_step_ms=1e3 * t_loop / timed if timed else float("nan"),
        cache_capacity=capacity, global_cache_bytes=glob, global_cache_bytes_per_token=glob / (b * capacity),
        window_bytes_per_sequence=live["window"] / b, cache_bytes_total=sum(live.values()),
        peak_memory_bytes=peak, peak_memory_kind=peak_kind,
    )
    shown = tok.decode(ids)
    print(f"\n--- sequence 0 ---\nprompt (last 120 chars): {shown[-120:]!r}\ngenerated ids: {gen[0, :16].tolist()}"
          f"{' ...' if gen.shape[1] > 16 else ''}\ngenerated text: {tok.decode(gen[0])!r}\n")
    print(f"time to first token   {ttft:8.3f} s   (prefill{'' if args.speculative else ' incl. compile'})")
    print(f"decode                {metrics['decode_step_ms']:8.2f} ms/step, {tps:8.1f} tokens/s "
          f"over {timed} steps x {b} sequences" + ("" if args.speculative else
          f" (first {min(chunk, steps)} steps incl. compile: {t_first:.2f} s)"))
    print(f"global KV cache       {metrics['global_cache_bytes_per_token']:8.1f} bytes/token  (measured: "
          f"{glob:,d} B in the cache arrays / {b}x{capacity} token slots)")
    print_memory(metrics, peak, peak_kind)
    if args.speculative:
        spec_gen, metrics["speculative"] = run_speculative(args, cfg, params, tokens, lengths, capacity, gen, metrics)
    if args.output_json:
        with open(args.output_json, "w") as f:
            out = dict(generated_ids=gen.tolist(), metrics=metrics)
            if args.speculative:
                out["speculative_generated_ids"] = spec_gen.tolist()
            json.dump(out, f, indent=2)
    return metrics


def compile_side_by_side(programs: list) -> None:
    """Run each (key, label, thunk) of `programs` once, all at once in threads: an XLA compile releases the
    GIL, so the programs of a run compile side by side instead of one after another (a speculative run of
    the trained `small` on the H200 needs six: one after another they took over four minutes). Each thunk
    makes its own throwaway inputs of the real call's shapes; `compiling` marks its key as compiled, so
    the real call that follows says nothing and is not slowed by a compile."""
    def one(key, label, thunk):
        with compiling(key, label):
            jax.block_until_ready(thunk())

    with ThreadPoolExecutor(len(programs)) as pool:
        for f in [pool.submit(one, *p) for p in programs]:
            f.result()


def _loop_setup(args, b: int):
    """(temperature [B] f32, seed [B] uint32, steps per compiled call) of the plain and the speculative loop."""
    return (jnp.full((b,), args.temperature, jnp.float32), jnp.full((b,), args.seed, jnp.uint32),
            max(1, min(args.decode_chunk, args.max_new_tokens - 1)))


def speculative_programs(args, cfg, params, tokens, lengths, capacity: int) -> list:
    """`run_speculative`'s programs as (key, label, thunk) for `compile_side_by_side`: its prefill, its
    generation loop, and the draft and the verify it times separately."""
    from dsv41_jax import api

    b = tokens.shape[0]
    temp, seed, chunk = _loop_setup(args, b)
    fresh = lambda: committed((d.init_cache(cfg, b, capacity), api.init_draft_window(cfg, b)))  # noqa: E731
    zeros = committed(jnp.zeros((b,), jnp.int32))

    def verify():
        cache, window = fresh()
        drafts, q_logits, _ = jax.eval_shape(partial(_draft, cfg=cfg, kernels=args.kernels), params, cache, window,
                                             zeros, temp, seed)
        return _verify(params, cache, window, zeros, *committed((jnp.zeros(drafts.shape, drafts.dtype),
                                                                   jnp.zeros(q_logits.shape, q_logits.dtype))),
                       temp, seed, cfg=cfg, kernels=args.kernels)

    return [(("spec_prefill", tokens.shape[1], cfg, b, capacity), "speculative prefill",
              lambda: api.speculative_prefill(cfg, params, *fresh(), tokens, lengths, kernels=args.kernels)),
             (("draft", cfg, b, capacity, args.kernels), "draft (timed alone)",
              lambda: _draft(params, *fresh(), zeros, temp, seed, cfg=cfg, kernels=args.kernels)),
             (("verify", cfg, b, capacity, args.kernels), "verify (timed alone)", verify),
             (("spec", chunk, cfg, b, capacity), f"speculative decode [{chunk} steps per call]",
              lambda: api.speculative_generate(cfg, params, *fresh(), zeros, chunk, temperature_b=temp, seed_b=seed,
                                               step_b=1, budget_b=0, kernels=args.kernels))]


def run_speculative(args, cfg, params, tokens, lengths, capacity: int, plain_gen: np.ndarray, plain: dict):
    """The same prompt through DSpark speculative decoding: (generated ids [B, new], metrics)."""
    from dsv41_jax import api

    b, k = tokens.shape[0], cfg.dspark_block_size
    temp, seed, chunk = _loop_setup(args, b)  # chunk: speculative steps per compiled call
    cache, window = committed((d.init_cache(cfg, b, capacity), api.init_draft_window(cfg, b)))
    with compiling(("spec_prefill", tokens.shape[1], cfg, b, capacity), "speculative prefill"):
        logits, cache, window = api.speculative_prefill(cfg, params, cache, window, tokens, lengths,
                                                        kernels=args.kernels)
    nxt = sample(logits, temp, seed, jnp.zeros((b,), jnp.int32))
    want = args.max_new_tokens - 1
    out, n_out, acc, budget, call_s = [], [], [], np.full(b, want, np.int32), []
    while (budget > 0).any():
        t0 = time.perf_counter()
        with compiling(("spec", chunk, cfg, b, capacity), f"speculative decode [{chunk} steps per call]"):
            toks, n, a, nxt, cache, window = api.speculative_generate(
                cfg, params, cache, window, nxt, chunk, temperature_b=temp, seed_b=seed,
                step_b=1 + want - budget, budget_b=budget, kernels=args.kernels)
        n = np.asarray(n)
        call_s.append(time.perf_counter() - t0)  # compiled before the plain run: every call is timed
        out.append(np.asarray(toks))
        n_out.append(n)
        acc.append(np.asarray(a))
        budget = budget - n.sum(1)
    toks, n_out, acc = np.concatenate(out, 1), np.concatenate(n_out, 1), np.concatenate(acc, 1)
    gen = np.stack([np.concatenate([plain_gen[i, :1]] + [toks[i, s, :n_out[i, s]] for s in range(toks.shape[1])])
                    for i in range(b)])
    live = n_out > 0
    t_loop = sum(call_s)
    step_ms = _time_draft_and_verify(cfg, params, cache, window, nxt, temp, seed, args.kernels, capacity)
    m = dict(block_size=k, acceptance_length=float(n_out[live].mean()), accepted_drafts_per_step=float(acc[live].mean()),
             verify_steps=int(live.sum(1).max()), tokens_per_s=n_out.sum() / t_loop if t_loop else float("nan"),
             plain_tokens_per_s=plain["decode_tokens_per_s"], first_call_s=call_s[0] if call_s else float("nan"), **step_ms,
             same_tokens_as_plain=bool((gen == plain_gen).all()))
    m["speedup"] = m["tokens_per_s"] / m["plain_tokens_per_s"]
    print(f"\n--- DSpark speculative decoding (blocks of {k}) ---")
    print(f"acceptance length     {m['acceptance_length']:8.2f} tokens per verify step ({m['accepted_drafts_per_step']:.2f} "
          f"drafts accepted of {k}; {m['verify_steps']} steps for {want} tokens)")
    print(f"draft / verify        {m['draft_ms']:8.2f} / {m['verify_ms']:.2f} ms per step (separately jitted, batch {b})")
    print(f"speculative decode    {m['tokens_per_s']:8.1f} tokens/s  vs plain {m['plain_tokens_per_s']:.1f} tokens/s "
          f"(x{m['speedup']:.2f})")
    print(f"tokens                {'identical to' if m['same_tokens_as_plain'] else 'differ from'} plain decode's"
          + ("" if args.temperature == 0 else " (sampling: equal only in distribution)"))
    return gen, m


@partial(compile_options.jit, static_argnames=("cfg", "kernels"))  # as the api compiles
def _draft(params, cache, window, tok, temp, seed, *, cfg, kernels):
    """One DSpark draft of the block after tok [B], on its own (timed by `_time_draft_and_verify`)."""
    from dsv41_jax import api, dspark

    return dspark.draft(api.bind(cfg, params), window, tok, cache.lengths, temp, seed,
                        jnp.zeros_like(tok), kernels)


@partial(compile_options.jit, static_argnames=("cfg", "kernels"))  # as the api compiles
def _verify(params, cache, window, tok, drafts, q_logits, temp, seed, *, cfg, kernels):
    """One verify (target forward over K + 1 tokens, accept, commit) on its own, with budget 1: nothing of
    the caller's state changes (the arrays are not donated)."""
    from dsv41_jax import api, dspark

    zero = jnp.zeros_like(tok)
    return dspark.verify(api.bind(cfg, params), cache, window, tok, drafts, q_logits, temp, seed,
                         zero, zero + 1, jnp.full((tok.shape[0], 1), -1, jnp.int32), kernels)


def _time_draft_and_verify(cfg, params, cache, window, tok, temp, seed, kernels: str, capacity: int,
                           reps: int = 5) -> dict:
    """Median ms of the draft and of the verify of one step, each its own jitted call, on the final state."""
    b = tok.shape[0]

    def median_ms(key, label, f, *a):
        with compiling(key, label):  # compiled already when `compile_side_by_side` ran it
            jax.block_until_ready(f(*a, cfg=cfg, kernels=kernels))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a, cfg=cfg, kernels=kernels))
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times))

    drafts, q_logits, _ = _draft(params, cache, window, tok, temp, seed, cfg=cfg, kernels=kernels)
    return dict(draft_ms=median_ms(("draft", cfg, b, capacity, kernels), "draft (timed alone)", _draft, params,
                                   cache, window, tok, temp, seed),
                verify_ms=median_ms(("verify", cfg, b, capacity, kernels), "verify (timed alone)", _verify, params,
                                    cache, window, tok, drafts, q_logits, temp, seed))


def print_memory(metrics: dict, peak: int, peak_kind: str) -> None:
    print(f"window rings          {metrics['window_bytes_per_sequence'] / 1e6:8.2f} MB/sequence")
    print(f"peak memory           {peak / 2**20:8.1f} MiB  ({peak_kind})")


# what each value of the engine's `prefix_path` metric means for the tokens
PATHS = {
    "cold": "cold prefill",
    "host_restore": "exact restore (pages from disk, window from the host pool: the cold run's tokens)",
    "bounded_replay": "bounded replay (pages from disk, last window recomputed: approximate, tokens may differ "
                      "from a cold run's; --no-bounded-replay recomputes exactly)",
    "recompute": "full recompute (pages on disk unused: no window in the host pool, no bounded replay: the cold "
                 "run's tokens)",
}


def collapse_spans(ids: np.ndarray, spans) -> np.ndarray:
    """The prompt with each expanded image span back to its one placeholder (what `Request` takes)."""
    keep = np.ones(ids.size, bool)
    for s in spans:
        keep[s.start + 1:s.stop] = False
    return ids[keep]


def engine_config(args, cfg, capacity: int, n_requests: int):
    """The EngineConfig of the flags; refused (before any weights exist) when the engine could not use it."""
    from dsv41_jax.serving import EngineConfig, plan_slots
    from dsv41_jax.serving.engine import slot_split

    budget = int(args.hbm_budget_gb * 2**30) if args.hbm_budget_gb else None
    ecfg = EngineConfig(slots=args.slots or (None if budget else n_requests), hbm_budget_bytes=budget,
                        capacity=capacity, prefill_chunk=args.prefill_chunk, page_tokens=args.page_tokens,
                        cache_dir=args.cache_dir, retention_s=args.retention_hours * 3600,
                        host_pool_bytes=int(args.host_pool_gb * 2**30) if args.host_pool_gb else None,
                        host_ttl_s=args.host_ttl_s, prefix_reuse=not args.no_prefix_reuse,
                        replay=not args.no_replay, bounded_prefill=not args.no_bounded_prefill,
                        kernels=args.kernels, speculative=getattr(args, "speculative", None), mesh=args.mesh,
                        layout=args.layout)
    from dsv41_jax.partitioning import MeshError

    try:
        if args.mesh and not (args.slots or budget):  # the requests' slots, rounded up to fill the mesh's split
            split = slot_split(cfg, ecfg)
            ecfg = dataclasses.replace(ecfg, slots=-(-n_requests // split) * split)
        plan_slots(cfg, ecfg)
    except ValueError as e:
        flags = ("--mesh, --layout, --slots" if isinstance(e, MeshError) else
                 "--page-tokens, --slots, --hbm-budget-gb, --capacity")
        raise _cli.UserError(f"engine settings ({flags}): {e}") from None
    return ecfg


def random_engine_params(args, cfg, ecfg):
    """A --preset's random weights (--seed) for the engine of `ecfg`: on one device, or with --mesh drawn straight
    into their shards (`sharding.init_model`: no device holds the whole model)."""
    if not args.mesh:
        return d.init_params(cfg, seed=args.seed)
    from dsv41_jax import partitioning, sharding
    from dsv41_jax.serving import plan_slots

    mesh = partitioning.make_mesh(cfg, args.mesh, layout=args.layout)
    return sharding.init_model(cfg, mesh, args.layout, batch=plan_slots(cfg, ecfg), seed=args.seed).params


def serve(args, cfg, params, tok, prompts: list[np.ndarray], ecfg, spans=None) -> dict:
    """Serve the prompts (each one --batch times, truncated by b tokens) through the engine, --repeat rounds.
    spans: each prompt's image spans (--image, batch 1): the request gets the prompt with one placeholder per
    image back, and the images."""
    from dsv41_jax.serving import Engine, Request

    if params is None:
        params = random_engine_params(args, cfg, ecfg)
    spans = spans or [[] for _ in prompts]
    prompts = [collapse_spans(p, s) for p, s in zip(prompts, spans)]
    reqs = [Request(p[: max(1, p.size - i)], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    seed=args.seed + i, stop_tokens=tuple(args.stop_token), images=tuple(x.image for x in s))
            for p, s in zip(prompts, spans) for i in range(args.batch)]
    capacity = ecfg.capacity
    engine = Engine(cfg, params, ecfg)
    print(f"[decode] engine model={model_name(args)} "
          f"backend={jax.default_backend()} slots={engine.n_slots} capacity={capacity} requests={len(reqs)} "
          f"x {args.repeat} rounds cache_dir={args.cache_dir}"
          + (f" mesh {args.mesh} layout {args.layout}" if args.mesh else ""), flush=True)
    rounds, paths = [], Counter()
    for r in range(args.repeat):
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t0
        for res in results:
            m = res.metrics
            if res.error:
                print(f"round {r} {res.id}: error: {res.error}")
                continue
            paths[m["prefix_path"]] += 1
            print(f"round {r} {res.id}: path: {PATHS[m['prefix_path']]}")
            print(f"round {r} {res.id}: prompt {m['prompt_tokens']} reused {m['reused_tokens']} replayed "
                  f"{m['replayed_tokens']} decoder-layer tokens {m['decoder_prefill_tokens']} window "
                  f"{'hit' if m['host_window_hit'] else 'miss'} | ttft "
                  f"{m['ttft_s']:.3f} s, {m['decode_tokens_per_s']:.1f} tok/s, {m['generated_tokens']} tokens "
                  f"({res.stop_reason})")
        gen = sum(len(x.tokens) for x in results)
        rounds.append(dict(wall_s=wall, tokens_per_s=gen / wall,
                           requests=[dict(id=x.id, generated_ids=x.tokens, error=x.error, stop_reason=x.stop_reason,
                                          metrics=x.metrics) for x in results]))
    if paths["bounded_replay"]:
        print(f"note: {paths['bounded_replay']} request(s) took bounded replay: their tokens may differ from a cold "
              "run's; add --no-bounded-replay for output identical to a cold run")
    first = next((x for x in results if not x.error), None)
    if first is not None:
        print(f"\n--- {first.id} ---\ngenerated ids: {first.tokens[:16]}{' ...' if len(first.tokens) > 16 else ''}"
              f"\ngenerated text: {tok.decode(first.tokens)!r}\n")
    live = cache_bytes(engine.cache)
    glob = live["global_main_kv"] + live["global_index_keys"]
    peak, peak_kind = peak_memory_bytes()
    metrics = dict(preset=model_name(args), backend=jax.default_backend(), slots=engine.n_slots, cache_capacity=capacity,
                   global_cache_bytes_per_token=glob / (engine.n_slots * capacity),
                   window_bytes_per_sequence=live["window"] / engine.n_slots, peak_memory_bytes=peak,
                   peak_memory_kind=peak_kind, tiers=engine.prefix.stats() if engine.prefix else {})
    print(f"throughput            {rounds[-1]['tokens_per_s']:8.1f} tokens/s over the last round (all requests)")
    print(f"global KV cache       {metrics['global_cache_bytes_per_token']:8.1f} bytes/token  (measured: "
          f"{glob:,d} B in the cache arrays / {engine.n_slots}x{capacity} token slots)")
    print_memory(metrics, peak, peak_kind)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(rounds=rounds, metrics=metrics, generated_ids=[x["generated_ids"] for x in
                                                                         rounds[-1]["requests"]]), f, indent=2)
    return metrics


if __name__ == "__main__":
    main()
