"""Issue 12 on one H200, one call (< 10 min): every benchmark point of the decode-speed issue, each under
its own timeout, tables in $OUT/<name>.log and rows in $OUT/<name>.json.

    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode

The v41 slice at batch 1, 8 and 64 (4K) in one process (params made once), 128K x 64, `small` at batch 1
and 8, then the batch-1 attribution (`experiments.profile_step`). Prints each step's last table.
"""

import os

from experiments.device_runs._steps import OUT, step

POINTS = [  # (name, bench_decode arguments, timeout s)
    ("slice_4k", ["--batch", "1", "8", "64", "--steps", "10", "--chunk", "5"], 230),
    ("slice_128k_b64", ["--batch", "64", "--context", "131072", "--steps", "6", "--chunk", "3"], 110),
    ("small", ["--preset", "small", "--batch", "1", "8", "--steps", "30", "--chunk", "10"], 120),
]

def last_table(log: str, name: str) -> str:
    """The bench's final table (the profile's summary and source table), or the log's tail if it has none."""
    start = log.find("v41-slice batch") if name == "profile_b1" else log.rfind("\n| batch")
    return (log[start:start + 2500] if start >= 0 else log[-1500:]).strip()


if __name__ == "__main__":
    for name, args, timeout_s in POINTS:
        step(name, ["-m", "experiments.bench_decode", *args, "--out", os.path.join(OUT, f"{name}.json")], timeout_s)
    step("profile_b1", ["-m", "experiments.profile_step", "--batch", "1", "--top", "30", "--out", "/tmp/i12_prof"], 90)
    for name in [p[0] for p in POINTS] + ["profile_b1"]:
        print(f"\n== {name}\n{last_table(open(os.path.join(OUT, f'{name}.log')).read(), name)}")
