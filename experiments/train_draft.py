"""Train DSpark draft stages on a frozen, trained target (self-distillation), so speculative decoding of
a `experiments.train_small` model accepts.

    python -m experiments.train_draft --run runs/small --out runs/small_dspark --minutes 10   # one GPU
    python -m experiments.decode --run runs/small_dspark --speculative dspark --max-new-tokens 256

--run is a train_small output directory (its config has no draft stages). The draft gets --stages
stages drafting blocks of --block tokens from the inputs of the target's last three layers (or
--targets), Markov rank --markov-rank and the target's expert counts; its params start random, the
target's are copied from the run and never change (`dsv41_jax.train.make_draft_train_step`). Training
data: windows of the same corpus (experiments/corpus.py). Writes to --out: config.json (the target's
config with the draft stages), checkpoint/ (params and step only: every tool that reads runs restores
params alone) and summary.json (loss and greedy acceptance on the training batches and on held-out
windows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dsv41_jax as d
from dsv41_jax import train
from dsv41_jax.checkpoint.orbax_io import flat_params
from dsv41_jax.pytree_paths import path_str
from dsv41_jax.compile_notice import compiling
from experiments import _cli
from experiments.corpus import load_corpus, windows
from experiments.quality import load_run, run_config
from experiments.train_small import save_config


def draft_config(cfg, args):
    """The target's config with DSpark stages appended (compress_ratios extended with zeros)."""
    targets = tuple(args.targets) if args.targets else tuple(range(max(cfg.n_layers - 3, 0), cfg.n_layers))
    return cfg.replace(n_mtp_layers=args.stages, compress_ratios=tuple(cfg.ratios) + (0,) * args.stages,
                       dspark_block_size=args.block, dspark_noise_token_id=cfg.vocab_size - 1,
                       dspark_target_layer_ids=targets, dspark_markov_rank=args.markov_rank,
                       dspark_n_routed_experts=0, dspark_n_activated_experts=0)


def with_target(params, target_params):
    """`params` (a draft config's) with every backbone leaf taken from the trained target's."""
    got = {k: v for k, v in flat_params(target_params).items() if not k.startswith("mtp/")}  # its own drafts: not ours
    return jax.tree_util.tree_map_with_path(lambda p, x: got.get(path_str(p), x), params)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="train_small output directory of the target")
    ap.add_argument("--out", required=True, help="output directory (must not hold a checkpoint/ yet)")
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--block", type=int, default=4, help="dspark_block_size: tokens drafted per step")
    ap.add_argument("--targets", type=int, nargs="+", help="target layers read (default: the last three)")
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=16, help="drafted positions per sequence and step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--corpus-mb", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        ap.error("give --steps, --minutes or both")
    if min(args.stages, args.block, args.batch, args.anchors, args.markov_rank) < 1 or args.seq <= args.block + 1:
        ap.error("--stages, --block, --batch, --anchors, --markov-rank must be >= 1 and --seq > --block + 1")
    return args


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if (out / "checkpoint").exists():
        raise _cli.UserError(f"--out {out}: holds a checkpoint/ already; pass another --out or remove it")
    target_cfg = run_config(args.run).replace(sinkhorn_unroll="rolled")  # as train_small: unrolled, the draft step compiled > 3 min on the H200
    try:
        cfg = draft_config(target_cfg, args)
    except ValueError as e:
        raise _cli.UserError(f"draft settings: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    params = with_target(d.init_params(cfg, seed=args.seed), load_run(Path(args.run), target_cfg))
    train_ids, val_ids = load_corpus(int(args.corpus_mb * 2**20))
    rng, val_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    hi = args.seq - args.block
    anchors = tuple(int(a) for a in np.unique(np.linspace(max(1, hi // args.anchors), hi, args.anchors).astype(int)))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, b2=0.95, weight_decay=0.0))
    step_fn = train.make_draft_train_step(cfg, opt, anchors)
    state = train.init_draft_opt_state(opt, params)
    val = [jnp.asarray(windows(val_ids, args.batch, args.seq, val_rng), jnp.int32) for _ in range(4)]
    print(f"[train_draft] target {args.run} ({target_cfg.n_layers} layers) + {args.stages} stage(s), blocks of "
          f"{args.block}, targets {cfg.dspark_target_layer_ids}, {len(anchors)} anchors per sequence", flush=True)
    t0, step, rows = time.perf_counter(), 0, []
    while (args.steps is None or step < args.steps) and (args.minutes is None or time.perf_counter() - t0 < 60 * args.minutes):
        batch = {"tokens": jnp.asarray(windows(train_ids, args.batch, args.seq, rng), jnp.int32)}
        with compiling(("draft_step",), "draft train step"):
            params, state, m = step_fn(params, state, batch)
        step += 1
        if step % 50 == 0 or step == 1:
            rows.append({"step": step, **{k: float(v) for k, v in m.items()}})
            print(f"step {step}: loss {rows[-1]['loss']:.3f} kl {rows[-1]['draft_kl']:.3f} greedy acceptance "
                  f"{rows[-1]['greedy_acceptance']:.2f} of {args.block}", flush=True)
    save_config(out / "config.json", cfg.replace(sinkhorn_unroll="rolled"))
    train.save_checkpoint(out / "checkpoint", params, None, step)  # params only: a draft is evaluated, not resumed
    # saved before the held-out pass, so a run stopped during it still leaves a usable draft
    draft, rest = train.split_draft(params)
    held_fn = jax.jit(train.draft_loss_fn, static_argnums=(2, 4))  # eager, it took minutes on the H200
    held = [held_fn(draft, rest, cfg, v, anchors)[1] for v in val]
    summary = {"steps": step, "seconds": time.perf_counter() - t0, "anchors": list(anchors), "curve": rows,
               "val_greedy_acceptance": float(np.mean([float(h["greedy_acceptance"]) for h in held])),
               "val_draft_kl": float(np.mean([float(h["draft_kl"]) for h in held]))}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"held-out greedy acceptance {summary['val_greedy_acceptance']:.2f} drafts of {args.block} per step "
          f"(+1 token from the target); wrote {out}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
