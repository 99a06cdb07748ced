"""Train a small model of this architecture on text every machine here has: the Python standard
library's own source files (byte-level tokens), with the quantization-aware step of dsv41_jax.train.

    python -m experiments.train_small --steps 20                       # CPU smoke run, tiny preset
    python -m experiments.train_small --preset small --study --minutes 6 --out runs/csa2   # one GPU

Every 20th file (sorted by path) is held out for validation. Batches are random windows of
--seq + 1 bytes; a --retrieval-frac share of them are passkey examples (experiments/corpus.py), so
that the model learns to fetch a key from far back and `experiments.quality` can test retrieval.
`--study` scales the sparse selection down to the training length (top-64 entries, a candidate pool
of 16 blocks of 8, against 512 / 2048 x 8 in the release) so that selection, the candidate pool and
the compressed cache all matter at 1-8K tokens; `--plan all-full` gives every compressing layer its
own compressor and indexer (the baseline of the CSA2 sharing), `--plan deep-full` only the Reindex layers
(what Reindex saves at depth).
Writes to --out: the loss curve (loss_curve.png when matplotlib imports, and always loss_curve.csv),
summary.json, config.json (the trained config, for experiments.quality) and an orbax checkpoint of
params + optimizer state (checkpoint/). The vocabulary is cut to the byte tokenizer's 259 ids.

`--resume DIR` continues the run in DIR (its model, weights, optimizer state, step count and loss curve;
the checkpoint is replaced at the end), so that a run longer than one sitting is several calls:

    python -m experiments.train_small --preset small --study --steps 6000 --minutes 9 --out runs/r   # call 1
    python -m experiments.train_small --resume runs/r --steps 6000 --minutes 9                       # call 2, ...

With --steps the run ends at that step counted from its start, and the recall curriculum follows the
steps (without --steps it follows this call's --minutes). The data flags (--seq, --batch, --lr, the recall
task's) are each call's own; a resumed call keeps the run's --train-attention unless it gives one (a sparse
stage after a dense warm-up: `summary.json`'s "stages" lists them).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import dsv41_jax as d
from dsv41_jax import train
from dsv41_jax.compile_notice import compiling
from dsv41_jax.config import RUNTIME_FIELDS, ModelConfig
from experiments import _cli, recall_task
from experiments.placement import committed
from experiments.corpus import PASSKEY_MIN_LENGTH, TOK, load_corpus, training_batches, windows


def study_config(preset: str, plan: str, study: bool, dtype: str | None = None) -> ModelConfig:
    """The trained config: the preset cut to the byte vocabulary, f32 master weights, optionally the
    study's selection sizes, another layer plan (all-full, or deep-full: the Reindex layers as Full ones) and
    another compute dtype (None: the preset's)."""
    cfg = d.preset(preset, vocab_size=TOK.size, engram_compressed_vocab_size=TOK.size, param_dtype="float32",
                   dspark_noise_token_id=TOK.size - 1,
                   sinkhorn_unroll="rolled",  # unrolled, compiles take minutes
                   vision_n_layers=0)  # a text study: the byte vocabulary has no image token
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    if study:
        cfg = cfg.replace(index_topk=64, candidate_topk_blocks=16, candidate_block_size=8)
    if plan == "all-full":
        every = tuple(l for l, m in enumerate(cfg.ratios) if m > 0)
        cfg = cfg.replace(kv_source_layers=every, index_source_layers=every)
    elif plan == "deep-full":  # each Reindex layer gets its own compressor: the preset's other layers unchanged
        cfg = cfg.replace(kv_source_layers=tuple(sorted({*cfg.kv_source_layers, *cfg.index_source_layers})))
    return cfg


def dense_overrides(context: int) -> dict:
    """Config fields that turn sparse selection off for contexts up to `context` tokens: every reachable
    compressed entry attended, no candidate pool (the indexer still scores, and is still trained by KL)."""
    return {"index_topk": context, "candidate_source_layer": -1}


def save_config(path: Path, cfg: ModelConfig) -> None:
    path.write_text(json.dumps(dataclasses.asdict(cfg), indent=1))


def load_config(path: Path, **overrides) -> ModelConfig:
    """The config written by `save_config`, its runtime switches except the Sinkhorn loop's included
    (then `overrides`)."""
    raw = json.loads(Path(path).read_text())
    kept = {k: raw[k] for k in RUNTIME_FIELDS if k in raw and k != "sinkhorn_unroll"}
    return ModelConfig.from_dict(raw, **{**kept, **overrides})


def make_optimizer(lr: float, warmup: int) -> optax.GradientTransformation:
    """AdamW (b2 0.95, weight decay 0.1) after global-norm clipping at 1; the rate ramps linearly from 0 over
    `warmup` steps, then stays at `lr`. The rate is a value in the optimizer state (`with_lr`), not a constant
    of the compiled step: runs that differ only in --lr share one program (and the persistent compilation
    cache), and a resumed call trains at its own --lr."""
    ramp = lambda n: jnp.minimum(n / warmup, 1.0)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b2=0.95, weight_decay=0.1),
                       optax.scale_by_schedule(ramp))


def with_lr(opt_state, lr: float):
    """`make_optimizer`'s state with its peak rate set to `lr` (a resumed call's --lr)."""
    clip, adamw, ramp = opt_state
    return clip, adamw._replace(hyperparams={**adamw.hyperparams, "learning_rate": jnp.float32(lr)}), ramp


def save_replacing(path: Path, params, opt_state, step: int) -> None:
    """`train.save_checkpoint` to `path`, replacing a resumed run's checkpoint only once the new one is written."""
    new = path.with_name(path.name + ".new")
    shutil.rmtree(new, ignore_errors=True)  # a call stopped while saving
    train.save_checkpoint(new, params, opt_state, step)
    shutil.rmtree(path, ignore_errors=True)
    new.rename(path)


def read_curve(out: Path) -> list[dict]:
    """The rows of `write_curve`'s loss_curve.csv, numbers as numbers ("" where a row has no validation)."""
    with open(out / "loss_curve.csv", newline="") as f:
        return [{k: v if v == "" else int(v) if k == "step" else float(v) for k, v in r.items()}
                for r in csv.DictReader(f)]


def write_curve(out: Path, rows: list[dict]) -> str:
    """loss_curve.csv, and loss_curve.png next to it when matplotlib imports (else one line on stderr saying
    how to get it); returns the path of the plot, or of the CSV without one."""
    with open(out / "loss_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"loss curve: {out / 'loss_curve.csv'} only; for loss_curve.png next to it, pip install matplotlib "
              "(or the [plot] extra: pip install -e '.[plot]')", file=sys.stderr)
        return str(out / "loss_curve.csv")
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["lm_loss"] for r in rows], label="train LM loss (nats/byte)")
    val = [(r["step"], r["val_lm_loss"]) for r in rows if r["val_lm_loss"] != ""]
    if val:
        ax.plot(*zip(*val), "o-", label="validation LM loss")
    ax.plot(steps, [r["indexer_kl"] for r in rows], label="indexer KL")
    heavy = [r.get("heavy_ce", "") for r in rows]
    if any(h != "" and h > 0 for h in heavy):  # a retrieval task's answers: their CE, smoothed over 50 steps
        h = np.array([np.nan if x == "" else x for x in heavy], float)
        ax.plot(steps, [np.nanmean(h[max(0, i - 49):i + 1]) for i in range(len(h))],
                label="answer-digit CE (50-step mean; chance 2.30)")
    recall = [(r["step"], r["val_recall_acc"]) for r in rows if r.get("val_recall_acc", "") != ""]
    if recall:
        ax.plot(*zip(*recall), "s-", label="held-out recall accuracy (whole values)")
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=120)
    return str(out / "loss_curve.png")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    ap.add_argument("--plan", default="csa2", choices=["csa2", "all-full", "deep-full"],
                    help="csa2: the preset's layer plan; all-full: every compressing layer a Full layer; "
                         "deep-full: the preset's Reindex layers as Full layers (issue 20's Reindex vs Full)")
    ap.add_argument("--study", action="store_true", help="selection sizes scaled to 1-8K contexts (see above)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="compute dtype of activations and of the weights as used (master weights stay f32); "
                         "default: the preset's (tiny float32, small bfloat16)")
    ap.add_argument("--train-attention", default=None, choices=["sparse", "dense"],
                    help="dense: train with every compressed entry attended (the release's dense warm-up form; the "
                         "indexer still learns by KL), evaluate with the sparse config saved in config.json. Default "
                         "sparse, or with --resume the run's last; a resumed call may switch it (a sparse stage after "
                         "a dense warm-up, as the release trains)")
    ap.add_argument("--retrieval-frac", type=float, default=0.25, help="share of passkey rows per batch")
    ap.add_argument("--recall-frac", type=float, default=0.0,
                    help="share of multi-query associative recall rows per batch (experiments/recall_task.py)")
    ap.add_argument("--recall-pairs", type=int, default=8, help="key-value pairs per recall row")
    ap.add_argument("--recall-distance", type=int, nargs=2, default=None, metavar=("START", "END"),
                    help="curriculum: the recall pairs' max distance grows from START to END tokens over the first "
                         "half of the run (default: anywhere in the row)")
    ap.add_argument("--answer-weight", type=float, default=1.0,
                    help="loss weight of the answer digits of passkey and recall rows (other targets: 1); the "
                         "curve's lm_loss stays the unweighted mean")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--bias-rate", type=float, default=1e-2,
                    help="expert-bias step per update (the release's 1e-3 suits trillion-token runs: in a few "
                         "hundred steps it let the experts collapse, docs/QUALITY.md)")
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (and at the end)")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--corpus-mb", type=float, default=64.0, help="read at most this much source text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output directory (default: runs/train_small_<preset> under the "
                    "current directory; runs/ is git-ignored in this repository)")
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="continue the run in DIR (an earlier --out): its model flags, weights, optimizer state, "
                         "step count and loss curve; writes back to DIR")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="start a new run (its own --out) from the weights of the run in DIR, with DIR's model flags, "
                         "a fresh optimizer and step count: e.g. a sparse stage from a dense run written before "
                         "--resume could switch, or by another optimizer")
    args = ap.parse_args(argv)
    if args.resume and args.init_from:
        ap.error("--resume continues a run, --init-from starts one: give one of them")
    if args.resume and args.out and Path(args.out).resolve() != Path(args.resume).resolve():
        ap.error("--resume writes back to its own directory: drop --out")
    if args.steps is None and args.minutes is None:
        ap.error("give --steps, --minutes or both")
    if (args.steps is not None and args.steps < 1) or (args.minutes is not None and args.minutes <= 0):
        ap.error("--steps must be >= 1 and --minutes > 0")
    if min(args.batch, args.seq, args.eval_every, args.eval_batches) < 1 or not 0 <= args.retrieval_frac <= 1:
        ap.error("--batch, --seq, --eval-every and --eval-batches must be >= 1, --retrieval-frac in [0, 1]")
    if args.answer_weight <= 0:
        ap.error(f"--answer-weight {args.answer_weight}: must be > 0")
    if not 0 <= args.recall_frac <= 1 - args.retrieval_frac:
        ap.error("--recall-frac must be in [0, 1 - --retrieval-frac]")
    if args.recall_frac and args.seq + 1 < recall_task.min_length(args.recall_pairs):
        ap.error(f"--seq {args.seq}: recall rows of {args.recall_pairs} pairs need at least "
                 f"{recall_task.min_length(args.recall_pairs) - 1}; raise --seq or lower --recall-pairs")
    lo = recall_task.min_distance(args.recall_pairs)
    if args.recall_distance and not lo <= args.recall_distance[0] <= args.recall_distance[1]:
        ap.error(f"--recall-distance START END: need {lo} <= START <= END ({args.recall_pairs} pairs and their "
                 "queries must fit)")
    if args.retrieval_frac and args.seq + 1 < PASSKEY_MIN_LENGTH:
        ap.error(f"--seq {args.seq}: passkey rows need at least {PASSKEY_MIN_LENGTH - 1}; raise --seq or pass "
                 "--retrieval-frac 0")
    return args


MODEL_FLAGS = ("preset", "plan", "study", "dtype")  # fixed for a run: --resume takes them from it


def output_dir(args) -> Path:
    """--out (or its default), writable and without an earlier run's checkpoint, which orbax would refuse at
    the end, after the whole training. With --resume: its directory, holding a finished call's checkpoint,
    config and summary (whose model flags then replace the command line's; so do --init-from's). Also settles
    --train-attention (default sparse, or the resumed run's last) and `args.stages`, the run's train-attention
    stages so far."""
    if args.resume:
        run = _cli.input_dir(args.resume, "--resume")
        missing = [n for n in ("checkpoint", "config.json", "summary.json", "loss_curve.csv") if not (run / n).exists()]
        if missing:
            raise _cli.UserError(f"--resume {args.resume}: no {', '.join(missing)} in it; give the --out of a finished "
                                 "experiments.train_small call")
        earlier = json.loads((run / "summary.json").read_text())
        if args.steps is not None and earlier["steps"] >= args.steps:
            raise _cli.UserError(f"--steps {args.steps}: the run in {run} is at step {earlier['steps']} already; give "
                                 "a larger --steps")
        for k in MODEL_FLAGS:
            setattr(args, k, earlier["args"].get(k))  # .get: runs from before --dtype have none (the preset's)
        args.stages = earlier.get("stages") or [{"from_step": 0, "train_attention": earlier["train_attention"]}]
        args.train_attention = args.train_attention or args.stages[-1]["train_attention"]
        if args.train_attention != args.stages[-1]["train_attention"]:
            args.stages = args.stages + [{"from_step": earlier["steps"], "train_attention": args.train_attention}]
        return _cli.writable_dir(str(run), "--resume")
    if args.init_from:
        src = _cli.input_dir(args.init_from, "--init-from")
        if not ((src / "checkpoint").is_dir() and (src / "summary.json").exists()):
            raise _cli.UserError(f"--init-from {args.init_from}: no checkpoint/ and summary.json in it; give the --out "
                                 "of a finished experiments.train_small call")
        for k in MODEL_FLAGS:
            setattr(args, k, json.loads((src / "summary.json").read_text())["args"].get(k))
    args.train_attention = args.train_attention or "sparse"
    args.stages = [{"from_step": 0, "train_attention": args.train_attention}]
    out = Path(args.out or f"runs/train_small_{args.preset}")
    if (out / "checkpoint").exists():
        raise _cli.UserError(f"--out {out}: holds a checkpoint/ of an earlier run; pass another --out or remove it")
    return _cli.writable_dir(str(out), "--out")


def recall_probe(args, cfg: ModelConfig, filler: np.ndarray, rng: np.random.Generator):
    """params -> (whole-value accuracy, value NLL in nats) on --eval-batches batches of `args.batch` held-out
    recall rows at the curriculum's final distance, teacher-forced through the training forward: the retrieval
    learning curve."""
    end = args.recall_distance[1] if args.recall_distance else None
    sets = [recall_task.batch(filler, args.batch, args.seq + 1, args.recall_pairs, end, rng)[0]
            for _ in range(args.eval_batches)]
    before = recall_task.answer_positions(args.seq + 1, args.recall_pairs) - 1  # [Q, D]: logits that predict them
    fn = jax.jit(lambda p, t: train.forward_logits(*train.split_trainable(p), cfg, t)[:, before])

    def probe(params) -> tuple[float, float]:
        right, nll = [], []
        for ids in sets:
            with compiling(("recall", cfg, args.batch, args.seq), f"recall probe [B={args.batch}, T={args.seq}]"):
                logits = np.asarray(fn(params, jnp.asarray(ids[:, :-1])), np.float32)
            r, n = recall_task.scores(logits, ids, args.seq + 1, args.recall_pairs)
            right.append(r)
            nll.append(n)
        return round(float(np.mean(right)), 5), round(float(np.mean(nll)), 5)
    return probe


# Adam's rate x width that learned retrieval: tiny (width 64) at 3e-3, small (1024) at 3e-4 and 1e-4, while
# small at 2e-3 stayed at chance for 4,278 steps as its LM loss fell (docs/QUALITY.md, tenth and eleventh sessions)
RETRIEVAL_LR_X_WIDTH = 3e-3 * 64


def lr_note(lr: float, dim: int, retrieval: bool) -> str | None:
    """A warning when a run with retrieval rows trains at a rate far above what its width learned them at."""
    if retrieval and lr * dim > 4 * RETRIEVAL_LR_X_WIDTH:
        return (f"note: --lr {lr:g} at width {dim}: retrieval rows were not learned at such rates (small, width "
                f"1024, stayed at chance at 2e-3 and learned at 3e-4); try --lr {3e-4 * 1024 / dim:.1e}")
    return None


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    out = output_dir(args)
    cfg = study_config(args.preset, args.plan, args.study, args.dtype)
    note = lr_note(args.lr, cfg.dim, args.recall_frac > 0 or args.retrieval_frac > 0)
    if note:
        print(note, file=sys.stderr)
    if not args.resume:
        save_config(out / "config.json", cfg)
    train_ids, val_ids = load_corpus(int(args.corpus_mb * 2**20))
    print(f"corpus: {train_ids.size:,} train / {val_ids.size:,} validation bytes; preset {args.preset} "
          f"(plan {args.plan}{', study' if args.study else ''}); {jax.default_backend()} x{jax.device_count()}",
          file=sys.stderr)

    opt = make_optimizer(args.lr, args.warmup)
    params = d.init_params(cfg, seed=args.seed)
    opt_state = train.init_opt_state(opt, params)
    step0, rows = 0, []
    if args.resume:
        params, opt_state, step0 = train.restore_checkpoint(out / "checkpoint", params, opt_state)
        opt_state = with_lr(opt_state, args.lr)
        rows = read_curve(out)
        print(f"resuming {out} at step {step0}", file=sys.stderr)
    elif args.init_from:
        params, _, src_step = train.restore_checkpoint(Path(args.init_from) / "checkpoint", params)
        print(f"starting from the weights of {args.init_from} (its step {src_step})", file=sys.stderr)
    # committed, as restored arrays are: a new run and a resumed one then compile the same programs (and a
    # compilation cache made by the first call serves the next; uncommitted, the first call's did not)
    params, opt_state = committed((params, opt_state))
    train_cfg = cfg.replace(**dense_overrides(args.seq)) if args.train_attention == "dense" else cfg
    step_fn = train.make_train_step(train_cfg, opt, kl_weight=args.kl_weight, bias_rate=args.bias_rate)
    eval_fn = jax.jit(lambda p, tokens: train.loss_fn(*train.split_trainable(p), train_cfg, tokens)[1]["lm_loss"])
    rng = np.random.default_rng([args.seed, step0] if step0 else args.seed)  # a resumed run: other batches
    progress = {"frac": 0.0}  # of the run: by steps with --steps, else by this call's time

    def max_distance():
        if not args.recall_distance:
            return None
        return recall_task.curriculum(int(1000 * progress["frac"]), 1000, *args.recall_distance)

    data = training_batches(train_ids, args.batch, args.seq, args.retrieval_frac, rng, args.recall_frac,
                            args.recall_pairs, max_distance, args.answer_weight)
    val_rng = np.random.default_rng(args.seed + 1)
    val = [windows(val_ids, args.batch, args.seq + 1, val_rng) for _ in range(args.eval_batches)]

    probe = recall_probe(args, train_cfg, val_ids, val_rng) if args.recall_frac else None

    def evaluate() -> float:
        with compiling(("eval", train_cfg, args.batch, args.seq), f"validation loss [B={args.batch}, T={args.seq}]"):
            first = eval_fn(params, jnp.asarray(val[0]))
        return float(np.mean([float(first)] + [float(eval_fn(params, jnp.asarray(b))) for b in val[1:]]))

    validate_keys = ("val_lm_loss",) + (("val_recall_acc", "val_recall_nll") if probe else ())

    def validate() -> dict:
        """The row's validation columns: LM loss, and the recall probe's accuracy and NLL when it runs."""
        return dict(zip(validate_keys, (round(evaluate(), 5),) + (probe(params) if probe else ())))

    budget = args.minutes * 60 if args.minutes is not None else float("inf")
    total = args.steps if args.steps is not None else None
    before_s = float(rows[-1]["seconds"]) if rows else 0.0  # the curve's clock runs on across calls
    t0, step, compile_s, bar = time.perf_counter(), step0, None, None
    while (total is None or step < total) and time.perf_counter() - t0 < budget:
        with compiling(("train", train_cfg, args.batch, args.seq), f"train step [B={args.batch}, T={args.seq}]"):
            params, opt_state, m = step_fn(params, opt_state, jax.tree.map(jnp.asarray, next(data)))
        m = jax.tree.map(float, m)
        step += 1
        progress["frac"] = step / total if total else (time.perf_counter() - t0) / budget
        if compile_s is None:  # the bar starts after the compile, so its rate and ETA are the steps'
            compile_s = time.perf_counter() - t0
            bar = tqdm(total=total, initial=step, unit="step", file=sys.stderr)
        else:
            bar.update()
        last = step == total
        row = {"step": step, "seconds": round(before_s + time.perf_counter() - t0, 2), **{k: round(v, 5) for k, v in m.items()},
               **(validate() if step % args.eval_every == 0 or last else dict.fromkeys(validate_keys, ""))}
        rows.append(row)
        bar.set_postfix(loss=f"{m['lm_loss']:.3f}", kl=f"{m['indexer_kl']:.3f}",
                        **({"answers": f"{m['heavy_ce']:.3f}"} if "heavy_ce" in m else {}))
    bar.close()
    if rows[-1]["val_lm_loss"] == "":
        rows[-1].update(validate())
    train_s = time.perf_counter() - t0
    save_replacing(out / "checkpoint", params, opt_state, step)
    curve = write_curve(out, rows)
    tokens, call_tokens = step * args.batch * args.seq, (step - step0) * args.batch * args.seq
    peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")  # None on the CPU
    summary = {"preset": args.preset, "plan": args.plan, "study": args.study, "dtype": cfg.dtype, "train_attention": args.train_attention,
               "stages": args.stages,
               "params": int(sum(np.size(x) for x in jax.tree.leaves(params))), "backend": jax.default_backend(), "steps": step, "resumed_from_step": step0, "batch": args.batch,
               "seq": args.seq, "tokens": tokens, "seconds": round(train_s, 1),
               "peak_device_gib": None if peak is None else round(peak / 2**30, 2),
               "first_step_seconds_with_compile": round(compile_s, 1),
               "tokens_per_second_after_compile": round((call_tokens - args.batch * args.seq) /
                                                        max(train_s - compile_s, 1e-9), 1),
               "first_lm_loss": rows[0]["lm_loss"], "last_lm_loss": rows[-1]["lm_loss"],
               "val_lm_loss": rows[-1]["val_lm_loss"], "val_bits_per_byte": round(rows[-1]["val_lm_loss"] / np.log(2), 4),
               "last_indexer_kl": rows[-1]["indexer_kl"], **{k: rows[-1][k] for k in validate_keys[1:]},
               "curve": curve, "checkpoint": str(out / "checkpoint"),
               "args": {k: v for k, v in vars(args).items() if k != "stages"}}  # stages: above
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
