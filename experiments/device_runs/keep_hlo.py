"""Keep one XLA-optimized HLO module of a device run: the largest `*after_optimizations.txt` under a dump folder
(`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`), gzipped into $OUT, so that what XLA made of a program on
the GPU (its fusions, copies, command buffers) can be read afterwards on any machine. A device call returns at
most 8 files of 16 MiB: one compressed module fits where the dump's hundreds of files do not.

    PYTHONPATH=. python3 -m experiments.device_runs.keep_hlo DIR NAME   # -> $OUT/NAME.hlo.txt.gz
"""

import glob
import gzip
import os
import shutil
import sys

from experiments.device_runs._steps import OUT


def keep(dump_dir: str, name: str) -> str:
    """Path of the gzipped copy of the largest optimized module under dump_dir; ValueError if there is none."""
    found = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not found:
        raise ValueError(f"no *after_optimizations.txt under {dump_dir}: was XLA_FLAGS=--xla_dump_to={dump_dir} "
                         "--xla_dump_hlo_as_text set for the program's compile?")
    src = max(found, key=os.path.getsize)
    os.makedirs(OUT, exist_ok=True)
    dst = os.path.join(OUT, f"{name}.hlo.txt.gz")
    with open(src, "rb") as f, gzip.open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
    print(f"{os.path.basename(src)} ({os.path.getsize(src) / 1e6:.1f} MB) -> {dst} ({os.path.getsize(dst) / 1e6:.1f} MB)")
    return dst


if __name__ == "__main__":
    keep(sys.argv[1], sys.argv[2])
