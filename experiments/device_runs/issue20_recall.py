"""Issue 20 on one H200, in calls of one warm machine (it keeps no disk between sessions, and a carried
checkpoint is limited to 64 MiB): does the dense BF16 `small` learn multi-query associative recall, and
what do the inference approximations then cost?

    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall train   # ~9 min: stage A, a new run
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall more    # ~9 min: stage B, the same run
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall eval    # ~9 min: the variants (experiments.recall)

A second argument `deep-full` does the same with `train_small --plan deep-full` (the Reindex layers as Full
layers: the issue's "Reindex vs Full for the deep layers" is a second trained model) in its own directory.

`train_small --train-attention dense`, every row one MQAR example (experiments/recall_task.py: key-value
pairs in stdlib text, queried at the row's end; the answer digits weigh 16 in the loss). A curriculum over
length, in two stages, because one stage at full length did not learn: on 2026-12-02 `small` trained
straight on 4,096-token rows (16 pairs at 640-4,096 tokens, one row per step: batch 4 needed 245 GiB) stayed
at chance for 1,982 steps, while `tiny` on 256-token rows learned the task on the CPU (docs/QUALITY.md):
- stage A (`train`): 512-token rows, batch 8, 8 pairs whose distance grows from 305 to 512 tokens (beyond
  the 128-token window: retrieval through the compressed entries) over the call;
- stage B (`more`): resumed on 4,096-token rows, batch 1, 16 pairs at 640 -> 4,096 tokens.
On 2026-12-02 (tenth session) stage A at lr 2e-3 stayed at chance for 1,882 steps, and 2,396 more on 4 pairs
at 153-400 tokens (docs/QUALITY.md); `issue20_probe` tries lower rates. I20_RUN=<run dir> I20_LR=<rate> run
`more` and `eval` on another run (a probe's that learned) at that rate. A validation point every 100 steps:
LM loss on held-out text and held-out whole-value recall accuracy at the stage's final distance
(`val_recall_acc`, teacher-forced); each call prints the whole learning curve (with the answer digits'
training cross entropy) and copies loss_curve.csv / summary.json to $OUT. `eval` scores accuracy against
distance under every variant (FP4 vs BF16 cache, sparse vs dense, pool vs flat, bounded replay vs cold) on
2K-16K examples for 5 minutes (rounds of one batch per length). I20_DRY=1: the same calls with `tiny` and
short rows (a CPU check of this script).
"""

import csv
import os
import shutil
import sys

from experiments.device_runs._steps import OUT, step

DRY = bool(os.environ.get("I20_DRY"))
PLAN = sys.argv[2] if len(sys.argv) > 2 else "csa2"
RUN, PRESET = (f"/tmp/i20/{PLAN}", "small") if not DRY else (f"/tmp/i20dry/{PLAN}", "tiny")
RUN = os.environ.get("I20_RUN", RUN)  # `more` / `eval` on another run, e.g. one of issue20_probe's
MINUTES = "7.3" if not DRY else "0.8"
# a resumed call is a new process: with a compilation cache on the machine it reads the programs it shares
# with the first call back instead of compiling them again
CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(RUN), "jax_cache")}
TAG = "" if PLAN == "csa2" else f"_{PLAN}"  # the log and output names of the second model
COMMON = ["--recall-frac", "1", "--answer-weight", "16", "--retrieval-frac", "0", "--eval-every",
          "3" if DRY else "100", "--eval-batches", "2", "--minutes", MINUTES]
# (seq, batch, pairs, distance start, end, lr) of each stage; the distance grows over the call's minutes
STAGE_A = ("512", "8", "8", "305", "512", "2e-3") if not DRY else ("256", "4", "4", "153", "256", "3e-3")
STAGE_B = ("4096", "1", "16", "640", "4096", os.environ.get("I20_LR", "1e-3")) if not DRY else \
    ("512", "2", "8", "305", "512", os.environ.get("I20_LR", "1e-3"))
EVAL_PAIRS = STAGE_B[2]


def stage(seq: str, batch: str, pairs: str, start: str, end: str, lr: str) -> list[str]:
    return ["--seq", seq, "--batch", batch, "--recall-pairs", pairs, "--recall-distance", start, end, "--lr", lr,
            *COMMON]


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
                                    "--train-attention", "dense", "--warmup", "50", *stage(*STAGE_A), "--out", RUN],
             530, CACHE)
        show_curve()
    elif phase == "more":
        step(f"train_recall_more{TAG}", ["-m", "experiments.train_small", "--resume", RUN, *stage(*STAGE_B)], 530,
             CACHE)
        show_curve()
    else:
        lengths, examples, minutes = (["512"], "4", "0.1") if DRY else (["2048", "4096", "8192", "16384"], "256", "5")
        step(f"recall_eval{TAG}", ["-m", "experiments.recall", "--run", RUN, "--lengths", *lengths, "--pairs",
                                   EVAL_PAIRS, "--examples", examples, "--minutes", minutes,
                                   "--out", os.path.join(OUT, f"recall{TAG}.json")], 540)
        print(open(os.path.join(OUT, f"recall_eval{TAG}.log")).read()[-3000:])
