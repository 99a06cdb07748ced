"""What XLA's TF32 default on a GPU does to the logits through the one f32-stored weight the model multiplies
by activations: the mHC coefficient projections' hc_fn (`hyper.projection` asks for IEEE f32 since the
twenty-sixth session). Runs on a CPU, which computes every f32 dot in IEEE f32:

    python -m experiments.tf32_effect [--preset tiny] [--dtype bfloat16] [--tokens 64] [--seeds 0 1 2]

Prefill logits of random token ids on random weights, three ways: as stored; every hc_fn rounded to TF32's 10
mantissa bits (to nearest, `lax.reduce_precision`; a TF32 dot reads an f32 operand at that width, rounded or
truncated by its kernel; the stream's bf16 values are exact in TF32, so in a bf16 model this is what a TF32
projection changes); every hc_fn entry moved by one f32 ulp (the size of a change of summation order). Prints each
variant's distance from the first: max and median |difference| over the largest |logit|, and the share of positions
whose top token is unchanged, one row per seed (weights, token ids and the ulp directions). The FP8 / FP4 quantizers
inside the model turn small input differences into code flips, so the max is the largest single move and the median
the typical one.
"""

from __future__ import annotations

import argparse
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import api, config
from dsv41_jax.cache import init_cache
from experiments import _cli


def _is_hc_fn(path) -> bool:
    return "'fn'" in jax.tree_util.keystr(path)


def variants(params, seed: int) -> dict:
    """{name: params} with every hc_fn as stored, rounded to TF32, moved one ulp up or down at random."""
    key = jax.random.key(seed)

    def one_ulp(path, a):  # each leaf its own directions (keyed by its path: leaves of one size differ too)
        leaf_key = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
        up = jax.random.bernoulli(leaf_key, 0.5, a.shape)
        return jnp.nextafter(a, jnp.where(up, jnp.inf, -jnp.inf).astype(a.dtype))

    def with_fn(f):
        return jax.tree_util.tree_map_with_path(lambda p, a: f(p, a) if _is_hc_fn(p) else a, params)

    tf32 = lambda _, a: jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=10)  # noqa: E731
    return {"as stored": params, "hc_fn rounded to TF32": with_fn(tf32), "hc_fn moved 1 ulp": with_fn(one_ulp)}


@_cli.entry_point
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(config.PRESETS))
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: the preset's")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    if args.tokens < 1:
        raise _cli.UserError(f"--tokens must be >= 1, got {args.tokens}")
    cfg = config.preset(args.preset, **({"dtype": args.dtype} if args.dtype else {}))
    if not any(_is_hc_fn(path) for path, _ in jax.tree_util.tree_flatten_with_path(api.abstract_params(cfg))[0]):
        raise _cli.UserError(f"preset {args.preset!r} has no hyper-connections (hc_mult 1): nothing to round")
    print(f"{args.preset} ({cfg.dtype}), 2 x {args.tokens} tokens: distance from the logits as stored")
    print("| seed | hc_fn | max |diff| / max |logit| | median | top token unchanged |\n|---|---|---|---|---|",
          flush=True)
    for seed in args.seeds:
        params = api.init_params(cfg, seed=seed)
        ids = jax.random.randint(jax.random.key(seed), (2, args.tokens), 0, cfg.vocab_size, jnp.int32)
        lengths = jnp.full((2,), args.tokens, jnp.int32)
        logits = {}
        for name, p_v in variants(params, seed).items():
            out, _ = api.prefill(cfg, p_v, init_cache(cfg, 2, args.tokens), ids, lengths, all_logits=True)
            logits[name] = np.asarray(out, np.float64)
        ref = logits.pop("as stored")
        scale = np.abs(ref).max()
        for name, out in logits.items():
            d = np.abs(out - ref)
            same = np.mean(out.argmax(-1) == ref.argmax(-1))
            print(f"| {seed} | {name.removeprefix('hc_fn ')} | {d.max() / scale:.3g} | {np.median(d) / scale:.3g} | "
                  f"{same:.4f} |", flush=True)


if __name__ == "__main__":
    main()
