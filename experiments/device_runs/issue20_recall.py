"""Issue 20 on one H200, in calls of one warm machine (it keeps no disk between sessions, and a carried
checkpoint is limited to 64 MiB): does the dense BF16 `small` learn multi-query associative recall, and
what do the inference approximations then cost?

    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall train   # ~9 min: a new run
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall more    # ~9.5 min: the same run, resumed
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall eval    # the variants (experiments.recall)

`train_small --train-attention dense` with half the rows MQAR (8 pairs; the curriculum grows their distance
from 384 to 4,096 tokens over the first half of STEPS steps), 4,096-token rows, a validation point every 50
steps: LM loss and held-out whole-value recall accuracy at the final distance (`val_recall_acc`, teacher-
forced). `more` continues it (`--resume`) up to STEPS; each call prints the whole learning curve and copies
loss_curve.csv / summary.json to $OUT. `eval` scores accuracy against distance under every variant (FP4 vs
BF16 cache, sparse vs dense, pool vs flat, bounded replay vs cold) on 4K and 8K examples. I20_DRY=1: the
same calls with `tiny`, 512-token rows and a few steps (a CPU check of this script).
"""

import csv
import os
import shutil
import sys

from experiments.device_runs._steps import OUT, step

DRY = bool(os.environ.get("I20_DRY"))
RUN, STEPS, PRESET, SEQ, MINUTES = ("/tmp/i20/recall", 2000, "small", 4096, 8.0) if not DRY else \
    ("/tmp/i20dry/recall", 200, "tiny", 512, 0.8)
# a resumed call is a new process: with a compilation cache on the machine it reads the train step back
# instead of compiling it again
CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(RUN), "jax_cache")}
TRAIN = ["--steps", str(STEPS), "--recall-frac", "0.5", "--recall-pairs", "8", "--recall-distance", "384", str(SEQ),
         "--retrieval-frac", "0", "--seq", str(SEQ), "--batch", "4", "--lr", "2e-3", "--warmup", "50",
         "--eval-every", "3" if DRY else "50", "--eval-batches", "1"]


def show_curve() -> None:
    for name in ("loss_curve.csv", "summary.json", "config.json"):
        if os.path.exists(os.path.join(RUN, name)):
            shutil.copy(os.path.join(RUN, name), OUT)
    if os.path.exists(os.path.join(RUN, "loss_curve.csv")):
        print("| step | s | train LM | val LM | recall acc | recall NLL |\n|---|---|---|---|---|---|")
        for r in csv.DictReader(open(os.path.join(RUN, "loss_curve.csv"))):
            if r["val_lm_loss"]:
                print(f"| {r['step']} | {r['seconds']} | {r['lm_loss']} | {r['val_lm_loss']} | "
                      f"{r.get('val_recall_acc', '')} | {r.get('val_recall_nll', '')} |")


if __name__ == "__main__":
    phase = sys.argv[1] if len(sys.argv) > 1 else "train"
    if phase == "train":
        step("train_recall", ["-m", "experiments.train_small", "--preset", PRESET, "--study", "--train-attention",
                              "dense", *TRAIN, "--minutes", str(MINUTES), "--out", RUN],
             560, CACHE)
        show_curve()
    elif phase == "more":
        step("train_recall_more", ["-m", "experiments.train_small", "--resume", RUN, *TRAIN, "--minutes", str(MINUTES)],
             570, CACHE)
        show_curve()
    else:
        lengths, examples = (["512"], "2") if DRY else (["4096", "8192"], "64")
        step("recall_eval", ["-m", "experiments.recall", "--run", RUN, "--lengths", *lengths, "--examples", examples,
                             "--out", os.path.join(OUT, "recall.json")], 570)
        print(open(os.path.join(OUT, "recall_eval.log")).read()[-3000:])
