"""Issue 17 on one H200, in two calls on one warm machine (the run directories live in /tmp there):

    PYTHONPATH=. python3 -m experiments.device_runs.issue17_dspark train    # ~8 min: target, then its draft
    PYTHONPATH=. python3 -m experiments.device_runs.issue17_dspark decode   # ~6 min: batch 1 and 16

`train`: `small` trained for TARGET_MIN minutes (compile included; batch 8 x 128 tokens: its compile took
80 s on the H200, 2,050 steps in 4 min), then DSpark draft stages on it for DRAFT_MIN minutes (compile 63 s).
`decode`: the same held-out prompt (the first 64 bytes of the stdlib's json/decoder.py: the target was
trained on 128-byte rows, and a 1,200-byte prompt made it repeat one byte) decoded plainly and
speculatively at batch 1 and 16 (`experiments.decode --speculative dspark`), 64 new tokens; its six
programs compile side by side (one after another they took over 4 min). Each step runs under a timeout sized
from this session's H200 timings, so that a slow step leaves the others their time; logs and JSONs under
$OUT, the acceptance / tokens/s table printed last. I17_DRY=1: the same steps with `tiny` for seconds
(a CPU check of this script).
"""

import json
import os
import sys

from experiments.device_runs._steps import OUT, step

RUNS = "/tmp/i17"
DRY = bool(os.environ.get("I17_DRY"))
PRESET, TARGET_MIN, DRAFT_MIN = ("tiny", 0.3, 0.3) if DRY else ("small", 4.0, 2.0)


def train() -> None:
    if step("train_small", ["-m", "experiments.train_small", "--preset", PRESET, "--study", "--minutes", str(TARGET_MIN),
                            "--eval-every", "100000", "--eval-batches", "2", "--out", f"{RUNS}/small"], 330):
        return
    step("train_draft", ["-m", "experiments.train_draft", "--run", f"{RUNS}/small", "--out", f"{RUNS}/small_dspark",
                         "--minutes", str(DRAFT_MIN)], 240)
    for name in ("small/summary.json", "small_dspark/summary.json"):
        if os.path.exists(f"{RUNS}/{name}"):
            print(name, open(f"{RUNS}/{name}").read()[:1500])


def decode() -> None:
    prompt = os.path.join(os.path.dirname(json.__file__), "decoder.py")  # Python source, as the training text
    with open(prompt, "rb") as f, open("/tmp/i17_prompt.txt", "wb") as g:
        g.write(f.read(64))
    rows = []
    for b in (1, 2) if DRY else (1, 16):
        path = os.path.join(OUT, f"dspark_b{b}.json")
        step(f"decode_b{b}", ["-m", "experiments.decode", "--run", f"{RUNS}/small_dspark", "--speculative", "dspark",
                              "--batch", str(b), "--prompt-file", "/tmp/i17_prompt.txt", "--max-new-tokens", "12" if DRY else "64",
                              "--output-json", path], 280)
        if os.path.exists(path):
            rows.append((b, json.load(open(path))["metrics"]["speculative"]))
    print("\n| batch | acceptance length | draft ms | verify ms | spec tokens/s | plain tokens/s | speedup | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for b, m in rows:
        print(f"| {b} | {m['acceptance_length']:.2f} | {m['draft_ms']:.2f} | {m['verify_ms']:.2f} | "
              f"{m['tokens_per_s']:.1f} | {m['plain_tokens_per_s']:.1f} | {m['speedup']:.2f} | {m['same_tokens_as_plain']} |")


if __name__ == "__main__":
    {"train": train, "decode": decode}[sys.argv[1] if len(sys.argv) > 1 else "train"]()
