"""Issue 20 on one H200, first call: does the dense BF16 `small` learn multi-query associative recall within
what one device command allows? (The study's training must fit a 10-minute call: the machine keeps no
disk between sessions and a carried checkpoint is limited to 64 MiB.)

    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall

`train_small --train-attention dense` with half the rows MQAR (8 pairs; the curriculum grows their distance
from 384 to 4,096 tokens), 4,096-token rows, ~7.5 minutes including compiles, a validation point every 50
steps: LM loss and held-out whole-value recall accuracy at the final distance (`val_recall_acc`, teacher-
forced). Prints the learning curve; loss_curve.csv and summary.json under $OUT. If it learns, the next
call evaluates the variants on that run (`experiments.recall`, same warm machine, run dir /tmp/i20/recall).
"""

import csv
import os
import shutil

from experiments.device_runs._steps import OUT, step

RUN = "/tmp/i20/recall"

if __name__ == "__main__":
    step("train_recall", ["-m", "experiments.train_small", "--preset", "small", "--study", "--train-attention", "dense",
                          "--recall-frac", "0.5", "--recall-pairs", "8", "--recall-distance", "384", "4096",
                          "--retrieval-frac", "0", "--seq", "4096", "--batch", "4", "--lr", "2e-3", "--warmup", "50",
                          "--minutes", "7.5", "--eval-every", "50", "--eval-batches", "1", "--out", RUN], 560)
    for name in ("loss_curve.csv", "summary.json", "config.json"):
        if os.path.exists(os.path.join(RUN, name)):
            shutil.copy(os.path.join(RUN, name), OUT)
    if os.path.exists(os.path.join(RUN, "loss_curve.csv")):
        print("| step | s | train LM | val LM | recall acc | recall NLL |\n|---|---|---|---|---|---|")
        for r in csv.DictReader(open(os.path.join(RUN, "loss_curve.csv"))):
            if r["val_lm_loss"]:
                print(f"| {r['step']} | {r['seconds']} | {r['lm_loss']} | {r['val_lm_loss']} | "
                      f"{r.get('val_recall_acc', '')} | {r.get('val_recall_nll', '')} |")
