"""Issue 20 on one H200, in calls of one warm machine (it keeps no disk between sessions, and a carried
checkpoint is limited to 64 MiB): does the dense BF16 `small` learn multi-query associative recall, and
what do the inference approximations then cost?

    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall train deep-full   # ~4.5 min: stage A
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall more deep-full    # ~8.5 min: stage B
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall eval deep-full    # ~6 min: the variants
    PYTHONPATH=. python3 -m experiments.device_runs.issue20_recall sparse deep-full  # ~4 min: sparse stage

The arguments after the phase are layer plans (`train_small --plan`, default csa2), one run each in
/tmp/i20/<plan>: `deep-full` is the issue's "Reindex vs Full for the deep layers", a second trained model
whose Reindex layers are Full layers. Several plans in one call run at the same time (the GPU memory split
between them), which measured at most 1.3x one run's throughput with slower compiles (docs/QUALITY.md,
eleventh session), so one plan per call is the plan; stage B of one plan needs 69 GiB, so `more` refuses two.

`train_small --train-attention dense`, every row one MQAR example (experiments/recall_task.py: key-value
pairs in stdlib text, queried at the row's end; the answer digits weigh 16 in the loss). A curriculum over
length, in two stages, because one stage at full length did not learn (2026-12-02: 1,982 steps at chance):
- stage A (`train`): 512-token rows, batch 8, 4 pairs whose distance grows from 153 to 400 tokens (beyond
  the 128-token window: retrieval through the compressed entries), 800 steps;
- stage B (`more`): resumed on 4,096-token rows, batch 1, 16 pairs at 640 -> 4,096 tokens, 7.3 minutes.
Both at lr 3e-4: at 2e-3 `small` stayed at chance for 4,278 steps, at 3e-4 and 1e-4 it learned
(`issue20_probe`, docs/QUALITY.md, eleventh session). I20_RUN=<run dir> runs `more` / `eval` of one plan on
another run; I20_LR overrides the rate of both stages, I20_STEPS stage A's steps. A validation point every
100 steps: LM loss on held-out text and held-out whole-value recall accuracy at the stage's final distance
(`val_recall_acc`, teacher-forced); each call prints the whole learning curve (with the answer digits'
training cross entropy) and copies loss_curve.csv / summary.json to $OUT. `eval` scores accuracy against
distance on 2K-16K examples for 5 minutes (rounds of one batch per length): every variant (FP4 vs BF16
cache, sparse vs dense, pool vs flat, bounded replay vs cold) for the first plan, the inference config alone
for the others; a plan evaluated without csa2 in the same call is paired with the eleventh session's csa2
model (`experiments.recall --against`, same queries). I20_DRY=1: the same calls with `tiny` and short rows
(a CPU check of this script).

`sparse` continues a run with sparse attention in training (stage B's rows, I20_SPARSE_MINUTES, default 2.5):
on the CPU a `tiny` deep-full model trained dense retrieved 13-17% under sparse selection and 85-94% after
199 sparse steps (docs/QUALITY.md, eleventh session); its Full layer's own indexer learns what to select only
once selection is trained. `small`'s deep-full model, trained dense, lost only 1-3 points to sparse selection
(twelfth session), so its sparse stage has not been run. `eval` after it (I20_EVAL_MINUTES to shorten) scores the model again.
"""

import csv
import os
import shutil
import sys

from experiments.device_runs._steps import OUT, steps_together

DRY = bool(os.environ.get("I20_DRY"))
PRESET, ROOT = ("small", "/tmp/i20") if not DRY else ("tiny", "/tmp/i20dry")
# a resumed call is a new process: with a compilation cache on the machine it reads the programs it shares
# with the first call back instead of compiling them again
CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(ROOT, "jax_cache")}
LR = os.environ.get("I20_LR", "3e-4")
STEPS_A = os.environ.get("I20_STEPS", "800" if not DRY else "6")
EVAL_EVERY = "3" if DRY else "100"
COMMON = ["--recall-frac", "1", "--answer-weight", "16", "--retrieval-frac", "0", "--eval-batches", "2"]
# (seq, batch, pairs, distance start, end) of each stage; the distance grows over the stage
STAGE_A = ("512", "8", "4", "153", "400") if not DRY else ("256", "4", "4", "153", "256")
STAGE_B = ("4096", "1", "16", "640", "4096") if not DRY else ("512", "2", "8", "305", "512")
EVAL_PAIRS = STAGE_B[2]
SPARSE_MINUTES = os.environ.get("I20_SPARSE_MINUTES", "2.5" if not DRY else "0.5")
# the csa2 model of 2026-12-02 (eleventh session), scored by `eval` with the same flags: a later session's
# deep-full model is paired with it query by query (experiments.recall --against) when csa2 is not retrained
CSA2_EVAL = "docs/quality/recall_h200_session11_eval.json"


def run_dir(plan: str, plans: list[str]) -> str:
    return os.environ["I20_RUN"] if "I20_RUN" in os.environ and len(plans) == 1 else os.path.join(ROOT, plan)


def tag(plan: str) -> str:
    """The suffix of a plan's log and output names (none for csa2, the released plan)."""
    return "" if plan == "csa2" else f"_{plan}"


def stage(seq: str, batch: str, pairs: str, start: str, end: str) -> list[str]:
    return ["--seq", seq, "--batch", batch, "--recall-pairs", pairs, "--recall-distance", start, end, "--lr", LR,
            "--eval-every", EVAL_EVERY, *COMMON]


def show_curve(run: str, plan: str) -> None:
    for name in ("loss_curve.csv", "summary.json", "config.json"):
        if os.path.exists(os.path.join(run, name)):
            base, ext = os.path.splitext(name)
            shutil.copy(os.path.join(run, name), os.path.join(OUT, base + tag(plan) + ext))
    if os.path.exists(os.path.join(run, "loss_curve.csv")):
        print(f"{plan}:\n| step | s | train LM | train answer CE per digit (mean since the last row) | val LM | "
              "recall acc | recall NLL |\n|---|---|---|---|---|---|---|")
        since = []
        for r in csv.DictReader(open(os.path.join(run, "loss_curve.csv"))):
            since.append(float(r.get("heavy_ce") or "nan"))
            if r["val_lm_loss"]:
                print(f"| {r['step']} | {r['seconds']} | {r['lm_loss']} | {sum(since) / len(since):.3f} | "
                      f"{r['val_lm_loss']} | {r.get('val_recall_acc', '')} | {r.get('val_recall_nll', '')} |")
                since = []


def main(phase: str, plans: list[str]) -> None:
    runs = {plan: run_dir(plan, plans) for plan in plans}
    if phase == "train":
        steps_together([(f"train_recall{tag(p)}", ["-m", "experiments.train_small", "--preset", PRESET, "--study",
                                                   "--plan", p, "--train-attention", "dense", "--warmup", "50",
                                                   *stage(*STAGE_A), "--steps", STEPS_A, "--out", run], CACHE)
                        for p, run in runs.items()], 540)
    elif phase in ("more", "sparse"):  # stage B, or the same rows with sparse attention in training
        if len(plans) > 1 and not DRY:
            raise SystemExit(f"{phase}: one plan per call (stage B of one plan needs 69 GiB of the GPU)")
        sparse = ["--train-attention", "sparse"] if phase == "sparse" else []
        minutes = SPARSE_MINUTES if phase == "sparse" else "7.3" if not DRY else "0.8"
        steps_together([(f"train_recall_{phase}{tag(p)}", ["-m", "experiments.train_small", "--resume", run, *sparse,
                                                           *stage(*STAGE_B), "--minutes", minutes], CACHE)
                        for p, run in runs.items()], 540)
    elif phase == "eval":
        lengths, examples = (["512"], "4") if DRY else (["2048", "4096", "8192", "16384"], "256")
        minutes = "0.1" if DRY else os.environ.get("I20_EVAL_MINUTES", "5")
        steps_together([(f"recall_eval{tag(p)}", ["-m", "experiments.recall", "--run", run, "--lengths", *lengths,
                                                  "--pairs", EVAL_PAIRS, "--examples", examples, "--minutes", minutes,
                                                  *([] if i == 0 else ["--variants", "base", "--no-replay"]),
                                                  *(["--against", CSA2_EVAL, "csa2 model", "--label", f"{p} model"]
                                                    if p != "csa2" and "csa2" not in plans and not DRY else []),
                                                  "--out", os.path.join(OUT, f"recall{tag(p)}.json")], {})
                        for i, (p, run) in enumerate(runs.items())], 540)
        for p in plans:
            print(open(os.path.join(OUT, f"recall_eval{tag(p)}.log")).read()[-3000:])
        return
    else:
        raise SystemExit(f"phase {phase!r}: one of train, more, sparse, eval")
    for p, run in runs.items():
        show_curve(run, p)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "train", sys.argv[2:] or ["csa2"])
