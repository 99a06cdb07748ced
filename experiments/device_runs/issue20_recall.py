"""Issue 20 on one H200, in calls of one warm machine (it keeps no disk between sessions, and a carried
checkpoint is limited to 64 MiB): does the dense BF16 `small` learn multi-query associative recall, and
what do the inference approximations then cost?

    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall train   # ~9 min: a new run
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall more    # ~9 min: the same run, resumed
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall eval    # ~9 min: the variants (experiments.recall)

A second argument `deep-full` does the same with `train_small --plan deep-full` (the Reindex layers as Full
layers: the issue's "Reindex vs Full for the deep layers" is a second trained model) in its own directory.

`train_small --train-attention dense`, every row one MQAR example (16 pairs in 4,096 tokens of stdlib text;
the curriculum grows their distance from 640 to 4,096 tokens over the first half of STEPS steps; the answer
digits weigh 16 in the loss, ~20% of it, else 64 answer digits among 4K text targets are too little signal
for minutes of training), one row per step (batch 4 needed 245 GiB), a validation point every 100 steps: LM
loss and held-out whole-value recall accuracy at the final distance (`val_recall_acc`, teacher-forced, 4
rows). `more` continues it (`--resume`) up to STEPS; each call prints the whole learning curve and copies
loss_curve.csv / summary.json to $OUT. `eval` scores accuracy against distance under every variant (FP4 vs
BF16 cache, sparse vs dense, pool vs flat, bounded replay vs cold) on 2K-16K examples for 5 minutes (rounds
of one batch per length). On 2026-12-02 `train` + `more` (1,982 steps) left recall at chance
(docs/QUALITY.md). I20_DRY=1: the same calls with `tiny`,
512-token rows and a few steps (a CPU check of this script).
"""

import csv
import os
import shutil
import sys

from experiments.device_runs._steps import OUT, step

DRY = bool(os.environ.get("I20_DRY"))
PLAN = sys.argv[2] if len(sys.argv) > 2 else "csa2"
RUN, STEPS, PRESET, SEQ, PAIRS, START, MINUTES = (f"/tmp/i20/{PLAN}", 4000, "small", 4096, 16, 640, 7.3) if not DRY else \
    (f"/tmp/i20dry/{PLAN}", 200, "tiny", 512, 4, 160, 0.8)
# a resumed call is a new process: with a compilation cache on the machine it reads the train step back
# instead of compiling it again
CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(RUN), "jax_cache")}
TAG = "" if PLAN == "csa2" else f"_{PLAN}"  # the log and output names of the second model
# one row per step: dense attention over 4,096 tokens at batch 4 needed 245 GiB in the train step (H200: 139)
TRAIN = ["--steps", str(STEPS), "--recall-frac", "1", "--recall-pairs", str(PAIRS), "--recall-distance", str(START),
         str(SEQ), "--answer-weight", "16", "--retrieval-frac", "0", "--seq", str(SEQ), "--batch", "1", "--lr", "1e-3",
         "--warmup", "100", "--eval-every", "3" if DRY else "100", "--eval-batches", "4"]


def show_curve() -> None:
    for name in ("loss_curve.csv", "summary.json", "config.json"):
        if os.path.exists(os.path.join(RUN, name)):
            base, ext = os.path.splitext(name)
            shutil.copy(os.path.join(RUN, name), os.path.join(OUT, base + TAG + ext))
    if os.path.exists(os.path.join(RUN, "loss_curve.csv")):
        print("| step | s | train LM | train answer CE per digit (mean since the last row) | val LM | recall acc | "
              "recall NLL |\n|---|---|---|---|---|---|---|")
        since = []
        for r in csv.DictReader(open(os.path.join(RUN, "loss_curve.csv"))):
            since.append(float(r.get("heavy_ce") or "nan"))
            if r["val_lm_loss"]:
                print(f"| {r['step']} | {r['seconds']} | {r['lm_loss']} | {sum(since) / len(since):.3f} | "
                      f"{r['val_lm_loss']} | {r.get('val_recall_acc', '')} | {r.get('val_recall_nll', '')} |")
                since = []


if __name__ == "__main__":
    phase = sys.argv[1] if len(sys.argv) > 1 else "train"
    if phase == "train":
        step(f"train_recall{TAG}", ["-m", "experiments.train_small", "--preset", PRESET, "--study", "--plan", PLAN,
                                    "--train-attention", "dense", *TRAIN, "--minutes", str(MINUTES), "--out", RUN],
             530, CACHE)
        show_curve()
    elif phase == "more":
        step(f"train_recall_more{TAG}", ["-m", "experiments.train_small", "--resume", RUN, *TRAIN, "--minutes",
                                         str(MINUTES)], 530, CACHE)
        show_curve()
    else:
        lengths, examples, minutes = (["512"], "4", "0.1") if DRY else (["2048", "4096", "8192", "16384"], "256", "5")
        step(f"recall_eval{TAG}", ["-m", "experiments.recall", "--run", RUN, "--lengths", *lengths, "--pairs",
                                   str(PAIRS), "--examples", examples, "--minutes", minutes,
                                   "--out", os.path.join(OUT, f"recall{TAG}.json")], 540)
        print(open(os.path.join(OUT, f"recall_eval{TAG}.log")).read()[-3000:])
