"""Retrieval accuracy against distance under the inference approximations (issue 20's study).

    python -m experiments.train_small --preset small --study --recall-frac 0.5 --recall-distance 256 8192 \\
        --seq 8192 --minutes 40 --out runs/recall
    python -m experiments.recall --run runs/recall --lengths 2048 8192 16384 --out runs/recall/recall.json

Multi-query associative recall examples (`experiments/recall_task.py`: --pairs key-value pairs scattered
through held-out stdlib text, every one queried at the end) go through the inference path
(`dsv41_jax.api.prefill`, chunks of --chunk tokens) under each configuration of `experiments.quality`
(FP4 vs BF16 cache, sparse vs dense, pool vs flat indexer) and cold vs after a bounded replay of the
window before the queries. A query is right when all its value digits are the argmax; accuracy is
reported per distance bin (tokens from the planted value to the query) with a 95% Wilson interval, so a
2-point difference is visible once a bin holds ~2,000 queries (--examples). Writes the JSON rows,
a markdown table and, when matplotlib imports, accuracy-vs-distance plots (PNG) next to --out.
`--against OTHER.json LABEL` adds another trained model's rows from its --out, paired query by query with
this run's (the same seed gives the same queries): two plans, e.g. Reindex vs Full, compared on one sample;
`--label NAME` names this run's rows so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments import _cli, recall_task as rt
from experiments.corpus import load_corpus
from experiments.quality import BASE, VARIANTS, cold_and_replayed, empty_cache, load_run, run_chunks, run_config

EDGES = [0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def evaluate(cfg, params, ids_bt: np.ndarray, n_pairs: int, chunk: int, capacity: int, replay: bool):
    """(right bool [B, Q], nll [B, Q]) of one batch of examples (cold, or with the queries' window replayed)."""
    length = ids_bt.shape[1]
    ans = rt.answer_positions(length, n_pairs)
    keep = (int(ans.min()) - 1, int(ans.max()))  # the logits that predict the answer digits
    if replay:
        p = (keep[0] - 1) // cfg.window_size * cfg.window_size
        _, state = cold_and_replayed(cfg, params, ids_bt, p, chunk, capacity)
        logits, _ = run_chunks(cfg, params, state, ids_bt, p, length, chunk, keep=keep)
    else:
        logits, _ = run_chunks(cfg, params, empty_cache(cfg, ids_bt.shape[0], capacity), ids_bt, 0, length, chunk,
                               keep=keep)
    return rt.scores(logits[:, ans - 1 - keep[0]], ids_bt, length, n_pairs)


def markdown(res: dict) -> str:
    """Accuracy per distance bin with 95% Wilson intervals, then each row's paired difference to the first."""
    bins = [(lo, hi) for lo, hi in zip(EDGES[:-1], EDGES[1:]) if any(
        r["lo"] == lo and r["n"] for row in res["rows"] for r in row["by_distance"])]
    head = " | ".join(f"{lo}-{hi}" for lo, hi in bins) + " |"
    sep = "|" + "---|" * (1 + len(bins))
    lines = ["| model / inference | " + head, sep]
    for row in res["rows"]:
        cells = {r["lo"]: r for r in row["by_distance"]}
        lines.append(f"| {row['variant']} | " + " | ".join(
            f"{cells[lo]['acc']:.3f} [{cells[lo]['ci95'][0]:.3f}, {cells[lo]['ci95'][1]:.3f}] (n={cells[lo]['n']})"
            if cells[lo]["n"] else "-" for lo, _ in bins) + " |")
    first = res["rows"][0]["variant"]
    lines += ["", f"Paired difference to \"{first}\" on the same queries (95% interval):", "",
              "| model / inference | " + head, sep]
    for row in res["rows"][1:]:
        cells = {r["lo"]: r for r in row["vs_first"]}
        lines.append(f"| {row['variant']} | " + " | ".join(
            f"{cells[lo]['diff']:+.3f} [{cells[lo]['ci95'][0]:+.3f}, {cells[lo]['ci95'][1]:+.3f}]"
            if cells[lo]["n"] else "-" for lo, _ in bins) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: pip install matplotlib (or the [plot] extra)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in res["rows"]:
        pts = [r for r in row["by_distance"] if r["n"]]
        x = [np.sqrt(r["lo"] * r["hi"]) if r["lo"] else r["hi"] / 2 for r in pts]
        y = [r["acc"] for r in pts]
        err = [[r["acc"] - r["ci95"][0] for r in pts], [r["ci95"][1] - r["acc"] for r in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=row["variant"],
                    linestyle="--" if row.get("against") else "-")  # the other model's rows dashed
    ax.set_xscale("log")
    ax.set_xlabel("distance (tokens from the planted value to its query)")
    ax.set_ylabel("whole-value accuracy (95% CI)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="train_small output directory (config.json + checkpoint/)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="example lengths (tokens)")
    ap.add_argument("--pairs", type=int, default=8, help="key-value pairs (and queries) per example")
    ap.add_argument("--examples", type=int, default=256, help="examples per length (x --pairs queries)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk width")
    ap.add_argument("--minutes", type=float, default=float("inf"),
                    help="stop after the round of batches (one per length) that passes this much time")
    ap.add_argument("--variants", default="all", choices=["all", "base"])
    ap.add_argument("--no-replay", dest="replay", action="store_false", help="skip the bounded-replay row")
    ap.add_argument("--corpus-mb", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="write the results to this JSON file (plot: same name, .png)")
    ap.add_argument("--against", nargs=2, metavar=("JSON", "LABEL"), default=None,
                    help="another model's --out of this command, made with the same --lengths --pairs --batch "
                         "--seed --corpus-mb: its rows are added as 'LABEL: <variant>', paired with this run's "
                         "first row on the queries both scored (e.g. Reindex vs Full: two trained models)")
    ap.add_argument("--label", default=None,
                    help="this run's model, its rows named 'LABEL: <variant>' in the table and the plot (with "
                         "--against: which rows are which model); the per-query outcomes keep the plain names")
    args = ap.parse_args(argv)
    if min(args.lengths) < rt.min_length(args.pairs):
        ap.error(f"--lengths {min(args.lengths)}: {args.pairs} pairs need at least {rt.min_length(args.pairs)} tokens")
    if args.minutes < 0:
        ap.error(f"--minutes {args.minutes}: must be >= 0")
    if min(args.examples, args.batch, args.chunk, args.pairs) < 1:
        ap.error("--examples, --batch, --chunk and --pairs must be >= 1")
    return args


PAIRING_ARGS = ("lengths", "pairs", "batch", "seed", "corpus_mb")  # what fixes the queries and their order


def load_against(path: str, args) -> dict:
    """The results of `--against`, refused unless they were scored on the same queries as this run's."""
    try:
        other = json.loads(Path(path).read_text())
        queries = other["queries"]
        given = other["args"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _cli.UserError(f"--against {path}: not results of experiments.recall --out ({e})") from None
    differ = [k for k in PAIRING_ARGS if given.get(k) != vars(args)[k]]
    if differ:
        raise _cli.UserError(f"--against {path}: made with other " + ", ".join(
            f"--{k.replace('_', '-')} ({given.get(k)} there, {vars(args)[k]} here)" for k in differ) +
            "; its queries are not this run's")
    return queries


def check_same_queries(queries: dict, planned_distance: np.ndarray) -> None:
    """Refuse, before any evaluation, --against results whose queries are not this run's first ones."""
    n = min(len(planned_distance), len(queries["distance"]))
    if not np.array_equal(np.asarray(queries["distance"][:n]), planned_distance[:n]):
        raise _cli.UserError("--against: its queries' distances differ from this run's (another corpus?)")


def paired_rows(queries: dict, label: str, base: np.ndarray, dist: np.ndarray) -> list[dict]:
    """Rows of another model's per-query outcomes, paired with `base` (this run's first row) on the queries both
    scored: the first min(len) queries, which the shared seed makes the same (`check_same_queries`)."""
    n = min(len(base), len(queries["distance"]))
    rows = []
    for name, right in queries["right"].items():
        r = np.asarray(right[:n], bool)
        rows.append({"variant": f"{label}: {name}", "against": label, "accuracy": float(r.mean()), "value_nll": None,
                     "by_distance": rt.by_distance(r, dist[:n], EDGES),
                     "vs_first": rt.paired_difference(r, base[:n], dist[:n], EDGES)})
    return rows


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = run_config(args.run)
    capacity = -(-max(args.lengths) // args.chunk) * args.chunk
    if capacity > cfg.max_seq_len:
        raise _cli.UserError(f"--lengths {max(args.lengths)}: beyond the run's max_seq_len ({cfg.max_seq_len})")
    _cli.output_file(args.out, "--out")
    against = load_against(args.against[0], args) if args.against else None
    _, val_ids = load_corpus(int(args.corpus_mb * 2**20))
    rng = np.random.default_rng(args.seed)
    # rounds of one batch per length, so a run cut short by --minutes still covers every length
    sets = [rt.batch(val_ids, args.batch, n, args.pairs, None, rng)
            for _ in range(-(-args.examples // args.batch)) for n in args.lengths]
    if against is not None:
        check_same_queries(against, np.concatenate([d.ravel() for _, d in sets]))
    params = load_run(Path(args.run), cfg)
    res = {"args": vars(args), "edges": EDGES, "rows": []}
    t0 = time.perf_counter()
    runs = [(name, False) for name in (VARIANTS if args.variants == "all" else [BASE])]
    runs += [("bounded replay of the queries' window", True)] if args.replay else []
    got = {name: ([], [], []) for name, _ in runs}  # right, nll, distance: one array per batch
    done = 0
    for ids, d in tqdm(sets, desc="example batches (every variant)", file=sys.stderr):
        for name, replay in runs:
            v = cfg if replay else cfg.replace(**VARIANTS[name](capacity))
            r, n = evaluate(v, params, ids, args.pairs, args.chunk, capacity, replay)
            for out, x in zip(got[name], (r, n, d)):
                out.append(x.ravel())
        done += 1
        if done % len(args.lengths) == 0 and time.perf_counter() - t0 > 60 * args.minutes:
            print(f"--minutes {args.minutes}: stopping after {done} of {len(sets)} batches", file=sys.stderr)
            break
    base = np.concatenate(got[runs[0][0]][0])  # every variant scored the same queries, in the same order
    # the raw outcomes, for any later paired analysis: each query's distance and, per variant, 1 if right
    res["queries"] = {"distance": np.concatenate(got[runs[0][0]][2]).tolist(),
                      "right": {name: np.concatenate(got[name][0]).astype(int).tolist() for name, _ in runs}}
    for name, _ in runs:
        right, nll, dist = (np.concatenate(x) for x in got[name])
        res["rows"].append({"variant": name, "accuracy": float(right.mean()), "value_nll": float(nll.mean()),
                            "by_distance": rt.by_distance(right, dist, EDGES),
                            "vs_first": rt.paired_difference(right, base, dist, EDGES)})
        print(json.dumps(res["rows"][-1]), file=sys.stderr)
    if args.label:
        for row in res["rows"]:
            row["variant"] = f"{args.label}: {row['variant']}"
    if against is not None:
        res["rows"] += paired_rows(against, args.against[1], base, np.concatenate(got[runs[0][0]][2]))
    res["examples_per_length"] = done // len(args.lengths) * args.batch
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["markdown"] = markdown(res)
    if args.out:
        res["plot"] = plot(res, Path(args.out).with_suffix(".png"))
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(res["markdown"])
    return res


if __name__ == "__main__":
    main()
