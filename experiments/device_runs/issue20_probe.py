"""Issue 20, a diagnostic on one H200: does `small` learn MQAR at a learning rate suited to its width?

On 2026-12-02 `small` (dense attention, 512-token rows, batch 8, lr 2e-3) stayed at chance on the answer digits
for 4,278 steps, while `tiny` (lr 3e-3) left chance by step 200; `tiny` in bfloat16 or with `small`'s
128-token window learned too (docs/QUALITY.md, tenth session). What is left between them is scale: width 1024
against 64, 12 layers against 8, 16 heads of 256 against 4 of 64, and a rate tuned for the small one.

    PYTHONPATH=. python3 -m experiments.device_runs.issue20_probe 3e-4 1e-4   # ~8 min (the first run ~290 s)

Its answer (2026-12-02, eleventh session): both rates learn (answer CE 0.37 / 0.41 at steps 701-800, held-out
accuracy 0.39 / 0.44 at step 800); issue20_recall trains at 3e-4 since (docs/QUALITY.md).

Short runs from scratch, one after the other, on `tiny`'s task (4 pairs, their distance growing 153 -> 400
tokens over the first half: beyond the window, through the compressed entries), --steps each (I20_STEPS,
default 800), validated once at the end (held-out whole-value accuracy). The rate lives in the optimizer
state, so every run after the first reads the compiled train step back from the compilation cache
(one compile, ~86 s). Runs on one GPU time-slice, and two dense train steps of this size (41.5 GiB of
temporaries each) fill most of it, hence one after the other. Prints the answer-digit training cross
entropy (chance ln 10 = 2.303, from each run's loss_curve.csv) per 100 steps, and each run's final accuracy.
I20_DRY=1: the same with `tiny` (a CPU check).
"""

import csv
import json
import os
import shutil
import sys

from experiments.device_runs._steps import OUT, step

DRY = bool(os.environ.get("I20_DRY"))
STEPS = int(os.environ.get("I20_STEPS", "800" if not DRY else "6"))
PRESET, SEQ = ("small", "512") if not DRY else ("tiny", "256")
CACHE = {"JAX_COMPILATION_CACHE_DIR": "/tmp/i20probe/jax_cache"}


def answer_ce(curve_path: str) -> dict[int, float]:
    """step -> its answer-digit training cross entropy (the heavy_ce column of train_small's loss_curve.csv)."""
    if not os.path.exists(curve_path):
        return {}
    return {int(r["step"]): float(r["heavy_ce"]) for r in csv.DictReader(open(curve_path)) if r.get("heavy_ce")}


def main(rates: list[str]) -> None:
    results = {}
    for lr in rates:
        run = f"/tmp/i20probe/lr{lr}"
        argv = ["-m", "experiments.train_small", "--preset", PRESET, "--study", "--train-attention", "dense",
                "--warmup", "50", "--seq", SEQ, "--batch", "8", "--recall-pairs", "4", "--recall-distance", "153",
                "400" if not DRY else "256", "--lr", lr, "--recall-frac", "1", "--answer-weight", "16",
                "--retrieval-frac", "0", "--steps", str(STEPS), "--eval-every", str(STEPS), "--eval-batches", "2",
                "--out", run]
        step(f"probe_lr{lr}", argv, 320, CACHE)
        summary, curve = os.path.join(run, "summary.json"), os.path.join(run, "loss_curve.csv")
        if os.path.exists(curve):
            shutil.copy(curve, os.path.join(OUT, f"probe_lr{lr}_loss_curve.csv"))
        results[lr] = (answer_ce(curve),
                       json.load(open(summary)) if os.path.exists(summary) else {})
    print("| lr | " + " | ".join(f"steps {a + 1}-{a + 100}" for a in range(0, STEPS, 100)) +
          " | held-out accuracy at the end | peak GiB |")
    for lr, (ce, s) in results.items():
        cells = []
        for a in range(0, STEPS, 100):
            got = [v for n, v in ce.items() if a < n <= a + 100]
            cells.append(f"{sum(got) / len(got):.3f}" if got else "")
        print(f"| {lr} | " + " | ".join(cells) + f" | {s.get('val_recall_acc', 'no summary')} | "
              f"{s.get('peak_device_gib')} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["3e-4", "1e-4"])
