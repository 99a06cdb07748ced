"""Prompt in, tokens out, with the numbers that matter: tokens/s, cache bytes/token, peak memory.

    python -m experiments.decode                       # tiny preset, random weights, CPU or GPU
    python -m experiments.decode --preset small --max-new-tokens 128 --batch 8
    python -m experiments.decode --prompt-file p.txt --tokenizer tokenizer.json --output-json run.json
    python -m experiments.decode --cache-dir /tmp/kv --repeat 2 --output-json run.json   # serving engine
    python -m experiments.decode --checkpoint DIR --prompt-ids ids.npy --cache-dir /tmp/kv --temperature 0

Without --engine / --cache-dir the prompt (and its --batch truncations) runs as one static batch, as
before. With them it goes through `dsv41_jax.serving.Engine`: fixed decode slots, chunked prefill,
prefix reuse from the host pool and the on-disk page store, per-request metrics in the JSON.
Random-weight presets produce random text: this measures the machinery, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import dsv41_jax as d
from dsv41_jax.cache import cache_bytes
from dsv41_jax.textio import load_tokenizer


def peak_memory_bytes() -> tuple[int, str]:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), f"{jax.default_backend()} device peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host process max RSS"


@jax.jit
def _sample(logits_bv, key, temperature):
    greedy = jnp.argmax(logits_bv, axis=-1)
    drawn = jax.random.categorical(key, logits_bv / jnp.maximum(temperature, 1e-5), axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 2)
    src.add_argument("--prompt-file")
    src.add_argument("--prompt-ids", help=".npy of int token ids: [tokens] for one request, [requests, tokens] for several")
    ap.add_argument("--checkpoint", help="a released checkpoint directory (needs dsv41_jax.checkpoint); "
                    "its tokenizer.json is used unless --tokenizer is given")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (the prompt, truncated "
                    "by b tokens for sequence b, so lengths differ)")
    ap.add_argument("--capacity", type=int, help="cache tokens per sequence (default: prompt + new tokens)")
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: byte-level)")
    ap.add_argument("--engram-on-host", action="store_true",
                    help="with --checkpoint: keep the Engram tables in host memory (pinned_host), gathered there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-quantize-cache", action="store_true", help="raw cache instead of FP4/FP8")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the preset's)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "jnp", "pallas"])
    ap.add_argument("--output-json", help="write generated ids and metrics here")
    ap.add_argument("--mesh", help="run sharded on a device mesh, axis=size pairs over data/tensor/expert, "
                    "e.g. data=2,expert=4 (product = device count; see dsv41_jax/sharding.py)")
    ap.add_argument("--layout", default="tp_ep", help="sharding rule set for --mesh (tp_ep or dp)")
    ap.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first "
                    "(multi-host: one process per host, coordinator from the environment)")
    eng = ap.add_argument_group("serving engine (on with --engine or --cache-dir)")
    eng.add_argument("--engine", action="store_true", help="serve through dsv41_jax.serving.Engine")
    eng.add_argument("--cache-dir", help="persistent page store for prompt prefixes (implies --engine)")
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
                     "last window (exact, slower)")
    eng.add_argument("--no-bounded-prefill", action="store_true", help="run every layer on every prompt token "
                     "(exact) instead of running the layers after the last kv source on the last window only")
    eng.add_argument("--stop-token", type=int, action="append", default=[], help="stop at this id (repeatable)")
    eng.add_argument("--repeat", type=int, default=1, help="serve the same requests this many times in a row "
                     "(the second round shows prefix reuse)")
    args = ap.parse_args(argv)
    args.engine = args.engine or bool(args.cache_dir)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.engram_on_host and not args.checkpoint:
        ap.error("--engram-on-host applies to --checkpoint (presets have random in-memory tables)")
    return args


def load_model(args):
    """(cfg, params, tokenizer path) from --checkpoint or --preset."""
    overrides = {"quantize_cache": not args.no_quantize_cache}
    if args.dtype:
        overrides.update(dtype=args.dtype, param_dtype=args.dtype)
    if not args.checkpoint:
        return d.preset(args.preset, **overrides), None, args.tokenizer
    try:
        from dsv41_jax.checkpoint import load_checkpoint
    except ImportError as e:
        sys.exit(f"error: --checkpoint needs dsv41_jax.checkpoint, which is not importable here ({e})")
    loaded = load_checkpoint(args.checkpoint, dtype=args.dtype or "bfloat16", engram_on_host=args.engram_on_host)
    tok = args.tokenizer or os.path.join(args.checkpoint, "tokenizer.json")
    return loaded.cfg, loaded.params, tok if os.path.exists(tok) else None


def prompt_ids(args, tok) -> list[np.ndarray]:
    if args.prompt_ids:
        ids = np.load(args.prompt_ids)
        if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
            sys.exit(f"error: {args.prompt_ids}: expected int ids [tokens] or [requests, tokens], got {ids.dtype}{list(ids.shape)}")
        return [r for r in np.atleast_2d(ids).astype(np.int32)]
    text = open(args.prompt_file).read() if args.prompt_file else args.prompt
    return [np.asarray(tok.encode(text), np.int32)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    if args.mesh and args.engine:
        sys.exit("error: --mesh is not supported with the serving engine yet; drop --engine/--cache-dir")
    cfg, params, tok_path = load_model(args)
    tok = load_tokenizer(tok_path, cfg.vocab_size)
    prompts = prompt_ids(args, tok)
    if args.engine:
        return serve(args, cfg, params, tok, prompts)
    ids = prompts[0].tolist()
    if len(prompts) > 1:
        sys.exit("error: several prompts need the serving engine: add --engine")
    if not ids:
        sys.exit("error: the prompt encodes to zero tokens")
    b = args.batch
    lengths = np.array([max(1, len(ids) - i) for i in range(b)], np.int32)
    width = -(-len(ids) // 64) * 64  # bucket the padded width so nearby prompt lengths share a compile
    tokens = np.zeros((b, width), np.int32)
    for i in range(b):
        tokens[i, : lengths[i]] = ids[: lengths[i]]
    capacity = args.capacity or int(lengths.max()) + args.max_new_tokens
    print(f"[decode] preset={args.preset} backend={jax.default_backend()} batch={b} prompt={len(ids)} tokens "
          f"capacity={capacity} cache={'fp4/fp8' if cfg.quantize_cache else 'raw'} dtype={cfg.dtype}", flush=True)

    t0 = time.perf_counter()
    params = d.init_params(cfg, seed=args.seed) if params is None else params
    jax.block_until_ready(params)
    t_init = time.perf_counter() - t0
    cache = d.init_cache(cfg, b, capacity)
    prefill = lambda c, t, n: d.prefill(cfg, params, c, t, n, kernels=args.kernels)
    # sampled ids are in range and the loop stops at capacity: skip the host round trip of validation
    decode = lambda c, t: d.decode_step(cfg, params, c, t, kernels=args.kernels, validate=False)
    if args.mesh:
        from dsv41_jax import sharding

        try:
            mesh = sharding.make_mesh(cfg, args.mesh, batch=b)
        except ValueError as e:
            sys.exit(f"error: {e}")
        sharded = sharding.shard_model(cfg, params, mesh, args.layout, batch=b, capacity=capacity)
        cache, prefill, decode = sharded.place_cache(cache), sharded.prefill, sharded.decode_step
        print(f"[decode] mesh {dict(mesh.shape)} layout {args.layout} on {mesh.size} device(s)", flush=True)

    t0 = time.perf_counter()
    logits, cache = prefill(cache, tokens, lengths)
    key = jax.random.key(args.seed)
    nxt = _sample(logits, key, args.temperature)
    nxt.block_until_ready()
    ttft = time.perf_counter() - t0

    out = [nxt]
    steps = min(args.max_new_tokens, capacity - int(lengths.max())) - 1
    t_first = t_loop = 0.0
    for s in tqdm(range(steps), desc="decode", unit="tok", disable=steps < 32, file=sys.stderr):
        t0 = time.perf_counter()
        logits, cache = decode(cache, nxt)
        key, sub = jax.random.split(key)
        nxt = _sample(logits, sub, args.temperature)
        out.append(nxt)
        if s == 0:
            nxt.block_until_ready()
            t_first = time.perf_counter() - t0  # includes compiling the decode step
        else:
            t_loop += time.perf_counter() - t0
    jax.block_until_ready(nxt)
    gen = np.stack([np.asarray(x) for x in out], axis=1)  # [B, new]

    live = cache_bytes(cache)  # measured from the arrays this run allocated
    glob = live["global_main_kv"] + live["global_index_keys"]
    timed = max(steps - 1, 0)
    tps = b * timed / t_loop if timed and t_loop > 0 else float("nan")
    peak, peak_kind = peak_memory_bytes()
    metrics = dict(
        preset=args.preset, backend=jax.default_backend(), mesh=args.mesh, batch=b, prompt_tokens=lengths.tolist(),
        new_tokens=int(gen.shape[1]), init_s=t_init, ttft_s=ttft, first_decode_step_s=t_first,
        decode_tokens_per_s=tps, decode_step_ms=1e3 * t_loop / timed if timed else float("nan"),
        cache_capacity=capacity, global_cache_bytes=glob, global_cache_bytes_per_token=glob / (b * capacity),
        window_bytes_per_sequence=live["window"] / b, cache_bytes_total=sum(live.values()),
        peak_memory_bytes=peak, peak_memory_kind=peak_kind,
    )
    shown = tok.decode(ids)
    print(f"\n--- sequence 0 ---\nprompt (last 120 chars): {shown[-120:]!r}\ngenerated ids: {gen[0, :16].tolist()}"
          f"{' ...' if gen.shape[1] > 16 else ''}\ngenerated text: {tok.decode(gen[0])!r}\n")
    print(f"time to first token   {ttft:8.3f} s   (prefill incl. compile)")
    print(f"decode                {metrics['decode_step_ms']:8.2f} ms/step, {tps:8.1f} tokens/s "
          f"over {timed} steps x {b} sequences (first step incl. compile: {t_first:.2f} s)")
    print(f"global KV cache       {metrics['global_cache_bytes_per_token']:8.1f} bytes/token  (measured: "
          f"{glob:,d} B in the cache arrays / {b}x{capacity} token slots)")
    print_memory(metrics, peak, peak_kind)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(generated_ids=gen.tolist(), metrics=metrics), f, indent=2)
    return metrics


def print_memory(metrics: dict, peak: int, peak_kind: str) -> None:
    print(f"window rings          {metrics['window_bytes_per_sequence'] / 1e6:8.2f} MB/sequence")
    print(f"peak memory           {peak / 2**20:8.1f} MiB  ({peak_kind})")


def serve(args, cfg, params, tok, prompts: list[np.ndarray]) -> dict:
    """Serve the prompts (each one --batch times, truncated by b tokens) through the engine, --repeat rounds."""
    from dsv41_jax.serving import Engine, EngineConfig, Request

    if params is None:
        params = d.init_params(cfg, seed=args.seed)
    reqs = [Request(p[: max(1, p.size - i)], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    seed=args.seed + i, stop_tokens=tuple(args.stop_token))
            for p in prompts for i in range(args.batch)]
    longest = max(r.prompt.size for r in reqs)
    chunk = args.prefill_chunk
    capacity = args.capacity or -(-(longest + args.max_new_tokens) // chunk) * chunk
    budget = int(args.hbm_budget_gb * 2**30) if args.hbm_budget_gb else None
    ecfg = EngineConfig(slots=args.slots or (None if budget else len(reqs)), hbm_budget_bytes=budget,
                        capacity=capacity, prefill_chunk=chunk, page_tokens=args.page_tokens,
                        cache_dir=args.cache_dir, retention_s=args.retention_hours * 3600,
                        host_pool_bytes=int(args.host_pool_gb * 2**30) if args.host_pool_gb else None,
                        host_ttl_s=args.host_ttl_s, prefix_reuse=not args.no_prefix_reuse,
                        replay=not args.no_replay, bounded_prefill=not args.no_bounded_prefill,
                        kernels=args.kernels)
    engine = Engine(cfg, params, ecfg)
    print(f"[decode] engine preset={args.preset if not args.checkpoint else args.checkpoint} "
          f"backend={jax.default_backend()} slots={engine.n_slots} capacity={capacity} requests={len(reqs)} "
          f"x {args.repeat} rounds cache_dir={args.cache_dir}", flush=True)
    rounds = []
    for r in range(args.repeat):
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t0
        for res in results:
            m = res.metrics
            if res.error:
                print(f"round {r} {res.id}: error: {res.error}")
                continue
            print(f"round {r} {res.id}: prompt {m['prompt_tokens']} reused {m['reused_tokens']} replayed "
                  f"{m['replayed_tokens']} decoder-layer tokens {m['decoder_prefill_tokens']} window "
                  f"{'hit' if m['host_window_hit'] else 'miss'} | ttft "
                  f"{m['ttft_s']:.3f} s, {m['decode_tokens_per_s']:.1f} tok/s, {m['generated_tokens']} tokens "
                  f"({res.stop_reason})")
        gen = sum(len(x.tokens) for x in results)
        rounds.append(dict(wall_s=wall, tokens_per_s=gen / wall,
                           requests=[dict(id=x.id, generated_ids=x.tokens, error=x.error, stop_reason=x.stop_reason,
                                          metrics=x.metrics) for x in results]))
    first = next((x for x in results if not x.error), None)
    if first is not None:
        print(f"\n--- {first.id} ---\ngenerated ids: {first.tokens[:16]}{' ...' if len(first.tokens) > 16 else ''}"
              f"\ngenerated text: {tok.decode(first.tokens)!r}\n")
    live = cache_bytes(engine.cache)
    glob = live["global_main_kv"] + live["global_index_keys"]
    peak, peak_kind = peak_memory_bytes()
    metrics = dict(preset=args.preset, backend=jax.default_backend(), slots=engine.n_slots, cache_capacity=capacity,
                   global_cache_bytes_per_token=glob / (engine.n_slots * capacity),
                   window_bytes_per_sequence=live["window"] / engine.n_slots, peak_memory_bytes=peak,
                   peak_memory_kind=peak_kind, tiers={k: dict(v.stats) for k, v in
                                                      (("disk", engine.store), ("host", engine.host)) if v})
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
