"""Bytes per token of the cache the code would allocate, and parameter counts, for a preset.

    python -m experiments.cache_bytes [--preset v41-flash]

Everything is measured from `jax.eval_shape` of the real cache/params constructors: nothing is
allocated and no number is a constant.
"""

from __future__ import annotations

import argparse
import json

import jax

import dsv41_jax as d
from dsv41_jax.cache import cache_bytes, init_cache
from dsv41_jax.params import param_counts
from experiments import _cli

# Published global KV bytes per token (DeepSeek-V4.1-Flash report, table of generations).
PUBLISHED = [("DeepSeek LLM 67B", 389_120), ("DeepSeek-V3", 70_272), ("DeepSeek-V3.2", 48_068),
             ("DeepSeek-V4-Flash", 3_514), ("DeepSeek-V4.1-Flash", 890)]
CONTEXTS = [("4K", 4096), ("128K", 131072), ("1M", 1 << 20)]


def tokens_label(n: int) -> str:
    """4096 -> '4K', 131072 -> '128K', 1048576 -> '1M', 5000 -> '5000'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def count_label(n: float) -> str:
    """A parameter count in the unit that shows its digits: 1.234 B, 12.3 M, 456.7 K, 12."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return str(int(n))


def contexts(cfg) -> tuple[list[int], list[str]]:
    """(the contexts of CONTEXTS this model allows, the names of those beyond its max_seq_len)."""
    allowed = [n for _, n in CONTEXTS if n <= cfg.max_seq_len]
    if len(allowed) < len(CONTEXTS):
        allowed.append(cfg.max_seq_len)  # the longest it has, measured under its own name
    return sorted(set(allowed)), [name for name, n in CONTEXTS if n > cfg.max_seq_len]


def measure(cfg) -> list[dict]:
    rows = []
    for ctx in contexts(cfg)[0]:
        name = tokens_label(ctx)
        b = cache_bytes(jax.eval_shape(lambda: init_cache(cfg, 1, ctx)))
        glob = b["global_main_kv"] + b["global_index_keys"]
        rows.append(dict(context=name, tokens=ctx, global_bytes=glob, global_bytes_per_token=glob / ctx,
                         main_kv_per_token=b["global_main_kv"] / ctx, index_keys_per_token=b["global_index_keys"] / ctx,
                         window_bytes_per_sequence=b["window"], state_bytes_per_sequence=b["compressor_state"] + b["other"],
                         all_bytes_per_token=sum(b.values()) / ctx))
    return rows


@_cli.entry_point
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-flash", choices=sorted(d.PRESETS))
    ap.add_argument("--no-quantize-cache", action="store_true", help="raw bf16 cache instead of FP4/FP8")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    _cli.output_file(args.json, "--json")
    cfg = d.preset(args.preset, quantize_cache=not args.no_quantize_cache)
    rows = measure(cfg)
    print(f"preset {args.preset}: cache measured from jax.eval_shape(init_cache) (batch 1)")
    beyond = contexts(cfg)[1]
    if beyond:
        print(f"(not measured: {', '.join(beyond)}, beyond the preset's max_seq_len of {cfg.max_seq_len:,d} tokens)")
    print(f"{'context':>8} {'global B/token':>15} {'main KV':>9} {'idx keys':>9} {'window/seq':>12} {'all B/token':>12}")
    for r in rows:
        print(f"{r['context']:>8} {r['global_bytes_per_token']:>15.1f} {r['main_kv_per_token']:>9.1f} "
              f"{r['index_keys_per_token']:>9.1f} {r['window_bytes_per_sequence'] / 1e6:>10.2f}MB "
              f"{r['all_bytes_per_token']:>12.1f}")
    print("\nglobal KV bytes per token, published generations vs ours:")
    for name, b in PUBLISHED:
        print(f"  {name:22s} {b:>9,d}")
    print(f"  {'dsv41_jax ' + args.preset:22s} {rows[0]['global_bytes_per_token']:>9,.0f}  (measured)")
    counts = param_counts(cfg)
    print("\nparameters (from jax.eval_shape of the params):")
    for k in ("backbone_total", "engram_tables", "total", "routed_experts", "active_prefill", "active_decode",
              "vision_tower"):
        print(f"  {k:16s} {count_label(counts[k]):>11s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, cache=rows, params=counts), f, indent=2)


if __name__ == "__main__":
    main()
