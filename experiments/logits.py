"""Logits of a released checkpoint for given token ids: one prefill, or a prefill then decode steps.

    python -m experiments.logits --checkpoint DIR --input-ids IDS.npy --out OUT.npz \
        [--decode-from N] [--index-keys released|consistent] [--dtype float32|bfloat16] [--no-activation-quant] \
        [--engram-on-host]

IDS.npy holds int token ids [batch, tokens] (or [tokens]). Writes OUT.npz with `logits` float32
[batch, tokens, vocab]: position t holds the logits after token t. Without --decode-from every position
comes from one prefill; with it, positions < N come from a prefill of the first N tokens and each later
position from a one-token decode step fed the given ids (teacher forcing). --engram-on-host keeps the
Engram tables in host memory (`load_checkpoint(..., engram_on_host=True)`): the released ones are
~190 GiB and do not fit next to the rest in one accelerator's memory.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dsv41_jax.config import ModelConfig
from experiments import _cli


def input_ids(args, cfg: ModelConfig) -> tuple[np.ndarray, int]:
    """(ids [batch, tokens] of --input-ids, tokens to prefill), checked against the model and --decode-from."""
    ids = _cli.load_ids(args.input_ids, "--input-ids")
    _cli.check_ids(ids, cfg.vocab_size, "--input-ids", args.input_ids)
    ids = np.atleast_2d(ids)
    t = ids.shape[1]
    if t > cfg.max_seq_len:
        raise _cli.UserError(f"--input-ids {args.input_ids}: {t} tokens, more than the model's max_seq_len "
                             f"({cfg.max_seq_len})")
    n = t if args.decode_from is None else args.decode_from
    if not 1 <= n <= t:
        raise _cli.UserError(f"--decode-from {n}: must be in 1..{t} (the number of tokens given)")
    return ids, n


def run(args) -> np.ndarray:
    import dsv41_jax as d

    ids, n = input_ids(args, _cli.checkpoint_config(args.checkpoint))
    _cli.output_file(args.out, "--out")
    b, t = ids.shape
    loaded = _cli.load_checkpoint(args.checkpoint, dtype=args.dtype, index_keys=args.index_keys,
                                  activation_quant=None if args.activation_quant else False,
                                  engram_on_host=args.engram_on_host, progress=not args.quiet)
    cfg, params = loaded.cfg, loaded.params
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    t0 = time.perf_counter()
    cache = d.init_cache(cfg, b, t)
    logits, cache = d.prefill(cfg, params, cache, ids[:, :n], np.full(b, n), all_logits=True)
    out = [np.asarray(logits, np.float32)]
    for pos in range(n, t):
        step, cache = d.decode_step(cfg, params, cache, ids[:, pos])
        out.append(np.asarray(step, np.float32)[:, None])
    logits = np.concatenate(out, axis=1)
    print(f"{b}x{t} tokens ({'prefill' if n == t else f'prefill {n} + {t - n} decode steps'}), "
          f"weights {cfg.weight_format}, activation quant {'on' if cfg.activation_quant else 'off'}, "
          f"index keys {cfg.index_keys}, {cfg.dtype}, Engram tables in {'host' if args.engram_on_host else 'device'} "
          f"memory: load {loaded.seconds:.1f} s ({loaded.gbps:.2f} GB/s), "
          f"forward {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return logits


@_cli.entry_point
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="directory with config.json, safetensors, tokenizer.json")
    ap.add_argument("--input-ids", required=True, help=".npy of int token ids [batch, tokens]")
    ap.add_argument("--out", required=True, help="output .npz (array `logits` [batch, tokens, vocab] float32)")
    ap.add_argument("--decode-from", type=int, default=None, help="prefill this many tokens, decode the rest")
    ap.add_argument("--index-keys", choices=("released", "consistent"), default="consistent")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--no-activation-quant", dest="activation_quant", action="store_false",
                    help="skip the release's FP8 rounding of projection inputs (what HF transformers does)")
    ap.add_argument("--engram-on-host", action="store_true",
                    help="keep the Engram tables in host memory (pinned_host); rows are gathered on the host")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    logits = run(args)
    np.savez(args.out, logits=logits)
    print(f"wrote {args.out}: logits {list(logits.shape)}", file=sys.stderr)


if __name__ == "__main__":
    main()
