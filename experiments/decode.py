"""Prompt in, tokens out, with the numbers that matter: tokens/s, cache bytes/token, peak memory.

    python -m experiments.decode                       # tiny preset, random weights, CPU or GPU
    python -m experiments.decode --preset small --max-new-tokens 128 --batch 8
    python -m experiments.decode --prompt-file p.txt --tokenizer tokenizer.json --output-json run.json

Random-weight presets produce random text: this measures the machinery, not quality.
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (the prompt, truncated "
                    "by b tokens for sequence b, so lengths differ)")
    ap.add_argument("--capacity", type=int, help="cache tokens per sequence (default: prompt + new tokens)")
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: byte-level)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-quantize-cache", action="store_true", help="raw cache instead of FP4/FP8")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the preset's)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "jnp", "pallas"])
    ap.add_argument("--output-json", help="write generated ids and metrics here")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    overrides = {"quantize_cache": not args.no_quantize_cache}
    if args.dtype:
        overrides.update(dtype=args.dtype, param_dtype=args.dtype)
    cfg = d.preset(args.preset, **overrides)
    tok = load_tokenizer(args.tokenizer, cfg.vocab_size)
    text = open(args.prompt_file).read() if args.prompt_file else args.prompt
    ids = tok.encode(text)
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
    params = d.init_params(cfg, seed=args.seed)
    jax.block_until_ready(params)
    t_init = time.perf_counter() - t0
    cache = d.init_cache(cfg, b, capacity)

    t0 = time.perf_counter()
    logits, cache = d.prefill(cfg, params, cache, tokens, lengths, kernels=args.kernels)
    key = jax.random.key(args.seed)
    nxt = _sample(logits, key, args.temperature)
    nxt.block_until_ready()
    ttft = time.perf_counter() - t0

    out = [nxt]
    steps = min(args.max_new_tokens, capacity - int(lengths.max())) - 1
    t_first = t_loop = 0.0
    for s in tqdm(range(steps), desc="decode", unit="tok", disable=steps < 32, file=sys.stderr):
        t0 = time.perf_counter()
        # sampled ids are in range and the loop stops at capacity: skip the host round trip of validation
        logits, cache = d.decode_step(cfg, params, cache, nxt, kernels=args.kernels, validate=False)
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
        preset=args.preset, backend=jax.default_backend(), batch=b, prompt_tokens=lengths.tolist(),
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
    print(f"window rings          {metrics['window_bytes_per_sequence'] / 1e6:8.2f} MB/sequence")
    print(f"peak memory           {peak / 2**20:8.1f} MiB  ({peak_kind})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(generated_ids=gen.tolist(), metrics=metrics), f, indent=2)
    return metrics


if __name__ == "__main__":
    main()
