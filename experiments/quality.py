"""What the design's approximations cost a trained model: FP4 cache, sparse selection, the candidate
pool, bounded replay and (with a second run) the CSA2 sharing, on held-out text and on passkey retrieval.

    python -m experiments.train_small --preset small --study --minutes 6 --out runs/csa2
    python -m experiments.train_small --preset small --study --plan all-full --minutes 6 --out runs/full
    python -m experiments.quality --run runs/csa2 --out runs/csa2/quality.json
    python -m experiments.quality --run runs/full --model all-Full --variants base --no-replay --out runs/full/quality.json
    python -m experiments.quality --merge runs/csa2/quality.json runs/full/quality.json    # one table

One set of weights (--run, a train_small output directory) is evaluated under several inference
configurations (`VARIANTS`); the same held-out windows and the same retrieval examples go through every
one. Everything runs through the inference path (`dsv41_jax.api.prefill`, chunks of --chunk tokens into
a cache of --capacity tokens), so the FP4/FP8 cache really holds quantized bytes.

- Perplexity: random windows of --ppl-len + 1 tokens of the held-out stdlib files (every 20th file),
  reported as nats and bits per byte.
- Bounded replay: the same windows split at P = --ppl-len - --replay-tail; the state at P is built
  cold (exact) and by replay (cold up to P - W, then the last window W recomputed from an empty window
  on top of the cached global KV, whose exact rows are then put back, as the engine does); the tail is
  scored from both states (NLL, largest logit difference, argmax agreement).
- Retrieval: a 6-digit key planted at --key-depth of the context, recalled at its end
  (experiments/corpus.py); accuracy of the whole key (all digits argmax-correct) and per digit, at each
  of --retrieval-lengths, cold and after a bounded replay of the window before the question.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import dsv41_jax as d
from dsv41_jax import train
from dsv41_jax.cache import Cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.serving import slots as rows
from experiments import _cli
from experiments.placement import committed
from experiments.corpus import KEY_DIGITS, PASSKEY_MIN_LENGTH, load_corpus, passkey_batch, windows
from experiments.train_small import dense_overrides, load_config

RETRIEVAL_LENGTHS = (512, 1024, 2048, 4096, 8192)

# name -> ModelConfig changes at inference for a cache of `capacity` tokens (the weights stay the run's)
VARIANTS = {
    "inference config (FP4 cache, sparse, pool)": lambda capacity: {},
    "BF16 cache": lambda capacity: {"quantize_cache": False},
    "dense attention (no selection)": dense_overrides,
    "flat indexer (no candidate pool)": lambda capacity: {"candidate_source_layer": -1},
    # the arithmetic closest to a dense-trained model's own: no 4-bit cache and no selection
    "BF16 cache, dense attention (reference)": lambda capacity: {"quantize_cache": False,
                                                                 **dense_overrides(capacity)},
}
BASE = next(iter(VARIANTS))


def run_config(run: str):
    """The trained config of a train_small output directory (--run), refused when the run is incomplete."""
    path = _cli.input_dir(run, "--run")
    if not (path / "checkpoint").is_dir():
        raise _cli.UserError(f"--run {run}: no checkpoint/ in it; give a finished experiments.train_small --out "
                             "directory")
    try:
        return load_config(path / "config.json", sinkhorn_unroll="rolled")
    except (OSError, ValueError, TypeError, KeyError) as e:  # missing, not JSON, keys that make no config
        raise _cli.UserError(f"--run {run}: config.json: {e}") from None


def lengths_and_capacity(args, cfg: ModelConfig) -> tuple[list[int], int]:
    """(retrieval lengths, cache capacity) that fit the run's model: the defaults beyond its max_seq_len are
    dropped (with a note); explicit --ppl-len / --retrieval-lengths beyond it are refused."""
    top = cfg.max_seq_len
    if args.retrieval_lengths is None:
        kept = [n for n in RETRIEVAL_LENGTHS if n <= top]
        if len(kept) < len(RETRIEVAL_LENGTHS):
            print(f"note: retrieval lengths {[n for n in RETRIEVAL_LENGTHS if n > top]} skipped: beyond the run's "
                  f"max_seq_len ({top})", file=sys.stderr)
    else:
        kept = args.retrieval_lengths
        if max(kept) > top:
            raise _cli.UserError(f"--retrieval-lengths {max(kept)}: beyond the run's max_seq_len ({top})")
    if min(kept) < PASSKEY_MIN_LENGTH:
        raise _cli.UserError(f"--retrieval-lengths {min(kept)}: a passkey example needs at least {PASSKEY_MIN_LENGTH} "
                             "tokens")
    if args.ppl_len > top:
        raise _cli.UserError(f"--ppl-len {args.ppl_len}: beyond the run's max_seq_len ({top})")
    if args.replay and args.ppl_len - args.replay_tail < 2 * cfg.window_size:
        raise _cli.UserError(f"--ppl-len {args.ppl_len} - --replay-tail {args.replay_tail}: must leave two windows "
                             f"({2 * cfg.window_size} tokens) before the scored tail")
    return kept, max([args.ppl_len, *kept])


def load_run(run: Path, cfg: ModelConfig, shardings=None):
    """params of a train_small output directory whose config is `cfg` (whatever optimizer it trained with), on the
    default device or each read into its shards (shardings: callable(param path, shape) -> Sharding, as
    `partitioning.param_sharding`)."""
    params, _, step = train.restore_checkpoint(run / "checkpoint", d.abstract_params(cfg), param_shardings=shardings)
    print(f"{run}: step {step}, {sum(np.size(x) for x in jax.tree.leaves(params)):,} parameters", file=sys.stderr)
    return params


def empty_cache(cfg: ModelConfig, batch: int, capacity: int) -> Cache:
    """An empty cache committed to the default device, as the restored params are: an uncommitted first
    chunk and the committed caches that follow it would be two programs, compiled twice."""
    return committed(d.init_cache(cfg, batch, capacity))


def run_chunks(cfg: ModelConfig, params, cache: Cache, ids_bt: np.ndarray, lo: int, hi: int, chunk: int,
               keep: tuple[int, int] | None = None):
    """Prefill ids[:, lo:hi] (every row the same span) in chunks; (f32 logits of positions keep[0]..keep[1]
    as [B, n, V] or None, cache)."""
    kept = []
    for a, n, logits, chunk_cache in d.prefill_chunks(cfg, params, cache, ids_bt, lo, hi, chunk, all_logits=True):
        cache = chunk_cache  # the cache after this chunk (the input one is donated)
        if keep is not None and a < keep[1] and a + n > keep[0]:
            s, e = max(keep[0], a) - a, min(keep[1], a + n) - a
            kept.append(np.asarray(logits[:, s:e], np.float32))
    return (np.concatenate(kept, axis=1) if kept else None), cache


def cold_and_replayed(cfg: ModelConfig, params, ids_bt, p: int, chunk: int, capacity: int) -> tuple[Cache, Cache]:
    """Caches after ids[:, :p]: exact, and with the last window [p - W, p) replayed on the cached global KV."""
    w = cfg.window_size
    b = ids_bt.shape[0]
    _, before = run_chunks(cfg, params, empty_cache(cfg, b, capacity), ids_bt, 0, p - w, chunk)
    _, exact = run_chunks(cfg, params, before, ids_bt, p - w, p, chunk)
    # as the engine's replay starts; committed like the params (see empty_cache)
    start = jax.device_put(rows.reset_row(rows.to_host(before), p - w), jax.devices()[0])
    _, replayed = run_chunks(cfg, params, start, ids_bt, p - w, p, chunk)
    return exact, replayed.replace(sources=exact.sources)  # the replay's own global rows are not kept


def nll(logits_btv: np.ndarray, targets_bt: np.ndarray) -> float:
    """Mean next-token negative log-likelihood in nats."""
    lse = jax.nn.logsumexp(logits_btv, axis=-1)
    picked = np.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return float(np.mean(np.asarray(lse) - picked))


def perplexity(cfg: ModelConfig, params, batches: list[np.ndarray], chunk: int, capacity: int) -> dict:
    t = batches[0].shape[1] - 1
    vals = []
    for ids in batches:
        cache = empty_cache(cfg, ids.shape[0], capacity)
        logits, _ = run_chunks(cfg, params, cache, ids, 0, t, chunk, keep=(0, t))
        vals.append(nll(logits, ids[:, 1:]))
    x = float(np.mean(vals))
    return {"nll": round(x, 4), "bits_per_byte": round(x / math.log(2), 4), "ppl": round(math.exp(x), 3)}


def replay_drift(cfg: ModelConfig, params, batches: list[np.ndarray], tail: int, chunk: int, capacity: int) -> dict:
    t = batches[0].shape[1] - 1
    p = (t - tail) // cfg.window_size * cfg.window_size
    cold, rep, dmax, agree = [], [], 0.0, []
    for ids in batches:
        exact, replayed = cold_and_replayed(cfg, params, ids, p, chunk, capacity)
        lc, _ = run_chunks(cfg, params, exact, ids, p, t, chunk, keep=(p, t))
        lr, _ = run_chunks(cfg, params, replayed, ids, p, t, chunk, keep=(p, t))
        cold.append(nll(lc, ids[:, p + 1:]))
        rep.append(nll(lr, ids[:, p + 1:]))
        dmax = max(dmax, float(np.abs(lc - lr).max()))
        agree.append(float(np.mean(lc.argmax(-1) == lr.argmax(-1))))
    return {"prefix": p, "tail": t - p, "nll_cold": round(float(np.mean(cold)), 4),
            "nll_replay": round(float(np.mean(rep)), 4), "max_abs_dlogit": round(dmax, 4),
            "argmax_agreement": round(float(np.mean(agree)), 4)}


def key_scores(logits_bkv: np.ndarray, ids_bt: np.ndarray, answer: int):
    """(whole key right bool [B], digits right bool [B, 6], digits' NLL f32 [B, 6] in nats) from the logits
    of positions answer-1 .. answer+4. The NLL shows partial retrieval: a model that only knows "a digit
    comes" pays about ln 10 = 2.30 per digit."""
    key = ids_bt[:, answer:answer + KEY_DIGITS]
    right = logits_bkv.argmax(-1) == key
    lse = np.asarray(jax.nn.logsumexp(logits_bkv, axis=-1))
    return right.all(-1), right, lse - np.take_along_axis(logits_bkv, key[..., None], axis=-1)[..., 0]


def retrieval(cfg: ModelConfig, params, sets: dict[int, list[tuple[np.ndarray, int]]], chunk: int, capacity: int,
              replay: bool) -> dict:
    """{length: {key_acc, digit_acc, key_nll}} over the examples of each length (cold, or with a bounded
    replay of the last window before the question); key_nll: mean nats per key digit."""
    out = {}
    for length, batches in sets.items():
        keys, digits, nlls = [], [], []
        for ids, ans in batches:
            keep = (ans - 1, ans - 1 + KEY_DIGITS)
            if replay:
                p = (ans - 16) // cfg.window_size * cfg.window_size  # the question's window is replayed
                _, state = cold_and_replayed(cfg, params, ids, p, chunk, capacity)
                logits, _ = run_chunks(cfg, params, state, ids, p, length, chunk, keep=keep)
            else:
                logits, _ = run_chunks(cfg, params, empty_cache(cfg, ids.shape[0], capacity), ids, 0, length,
                                       chunk, keep=keep)
            k, g, nl = key_scores(logits, ids, ans)
            keys.append(k)
            digits.append(g)
            nlls.append(nl)
        out[length] = {"key_acc": round(float(np.concatenate(keys).mean()), 4),
                       "digit_acc": round(float(np.concatenate(digits).mean()), 4),
                       "key_nll": round(float(np.concatenate(nlls).mean()), 4)}
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="train_small output directory (config.json + checkpoint/)")
    ap.add_argument("--model", default="CSA2", help="name of the run's model in the table")
    ap.add_argument("--variants", default="all", choices=["all", "base"], help="base: only the inference config (config.json)")
    ap.add_argument("--no-replay", dest="replay", action="store_false", help="skip the bounded-replay rows")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from earlier --out files, evaluate nothing")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk width (one compile per variant)")
    ap.add_argument("--ppl-len", type=int, default=1024)
    ap.add_argument("--ppl-batches", type=int, default=8)
    ap.add_argument("--replay-tail", type=int, default=256, help="tokens scored after the replayed window")
    ap.add_argument("--retrieval-lengths", type=int, nargs="+", help="context lengths of the passkey examples "
                    f"(default: {' '.join(map(str, RETRIEVAL_LENGTHS))}, those within the run's max_seq_len)")
    ap.add_argument("--retrieval-batches", type=int, default=4, help="batches of --batch examples per length")
    ap.add_argument("--key-depth", type=float, default=0.1, help="where the key sits, as a fraction of the context")
    ap.add_argument("--corpus-mb", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    args = ap.parse_args(argv)
    if not args.run and not args.merge:
        ap.error("give --run DIR (evaluate) or --merge JSON... (tabulate)")
    return args


def markdown(res: dict) -> str:
    """The tables of docs/QUALITY.md from a result dict."""
    lens = res["retrieval_lengths"]
    head = "| model / inference | ppl (bits/byte) | " + " | ".join(f"key acc (NLL) @ {n}" for n in lens) + " |"
    lines = [head, "|" + "---|" * (2 + len(lens))]

    def cell(r: dict) -> str:  # files made before key_nll existed have accuracy only
        return f"{r['key_acc']:.2f}" + (f" ({r['key_nll']:.2f})" if "key_nll" in r else "")

    for row in res["rows"]:
        keys = " | ".join(cell(row["retrieval"][str(n)]) for n in lens)
        ppl = f"{row['ppl']['ppl']:.3f} ({row['ppl']['bits_per_byte']:.4f})" if row["ppl"] else "see below"
        lines.append(f"| {row['model']}: {row['variant']} | {ppl} | {keys} |")
    for r in res.get("replay", []):
        lines += ["", "| model | tail after P | NLL cold | NLL replay | max abs dlogit | argmax agreement |",
                  "|---|---|---|---|---|---|",
                  f"| {r['model']} | {r['tail']} tokens after {r['prefix']} | {r['nll_cold']} | {r['nll_replay']} | "
                  f"{r['max_abs_dlogit']} | {r['argmax_agreement']} |"]
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """One result dict from several --out files (rows and replay rows concatenated)."""
    parts = []
    for p in paths:
        try:
            part = json.loads(_cli.read_text(p, "--merge"))
        except ValueError as e:
            raise _cli.UserError(f"--merge {p}: not JSON ({e})") from None
        if not isinstance(part, dict) or "retrieval_lengths" not in part:
            raise _cli.UserError(f"--merge {p}: not a file written by experiments.quality --out")
        parts.append(part)
    lens = parts[0]["retrieval_lengths"]
    if any(p["retrieval_lengths"] != lens for p in parts):
        raise _cli.UserError("--merge: the files were made with different --retrieval-lengths; rerun them alike")
    return {"retrieval_lengths": lens, "rows": [r for p in parts for r in p["rows"]],
            "replay": [r for p in parts for r in p.get("replay", [])]}


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge:
        res = merge(args.merge)
        print(markdown(res))
        return res
    cfg = run_config(args.run)
    args.retrieval_lengths, capacity = lengths_and_capacity(args, cfg)
    _cli.output_file(args.out, "--out")
    _, val_ids = load_corpus(int(args.corpus_mb * 2**20))
    rng = np.random.default_rng(args.seed)
    ppl_sets = [windows(val_ids, args.batch, args.ppl_len + 1, rng) for _ in range(args.ppl_batches)]
    ret_sets = {n: [passkey_batch(val_ids, args.batch, n, args.key_depth, rng) for _ in range(args.retrieval_batches)]
                for n in args.retrieval_lengths}
    t0 = time.perf_counter()
    res = {"args": vars(args), "backend": jax.default_backend(), "retrieval_lengths": args.retrieval_lengths, "rows": []}

    def save():  # after every row, so that an interrupted run keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    def evaluate(model: str, cfg: ModelConfig, params, variants):
        for name in tqdm(variants, desc=model, file=sys.stderr):
            v = cfg.replace(**VARIANTS[name](capacity))
            res["rows"].append({"model": model, "variant": name,
                                "ppl": perplexity(v, params, ppl_sets, args.chunk, capacity),
                                "retrieval": {str(k): x for k, x in retrieval(v, params, ret_sets, args.chunk,
                                                                              capacity, replay=False).items()}})
            print(json.dumps(res["rows"][-1]), file=sys.stderr)
            save()

    params = load_run(Path(args.run), cfg)
    evaluate(args.model, cfg, params, list(VARIANTS) if args.variants == "all" else [BASE])
    res["replay"] = []
    if args.replay:
        res["replay"].append({"model": args.model, **replay_drift(cfg, params, ppl_sets, args.replay_tail, args.chunk,
                                                                  capacity)})
        res["rows"].append({"model": args.model, "variant": "bounded replay of the question's window", "ppl": None,
                            "retrieval": {str(k): x for k, x in retrieval(cfg, params, ret_sets, args.chunk, capacity,
                                                                          replay=True).items()}})
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["markdown"] = markdown(res)
    save()
    print(res["markdown"])
    return res


if __name__ == "__main__":
    main()
