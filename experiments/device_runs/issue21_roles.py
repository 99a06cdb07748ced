"""Issue 21 on one GPU (thirty-eighth session): the wgmma attention with its warpgroups in two roles (warpgroup 0
the logits, the softmax and p . keys[:, :256]; warpgroup 1 every tile's decode a tile ahead and p . keys[:, 256:]
with warpgroup 0's p from shared memory) against the kernel as it was, both lockstep warpgroups computing the
whole logits and decoding half a tile each.

Groups (default: tests attention ablate before ptx):
- tests: the attention's GPU tests, compiled (a hang of the hand-offs ends at the step's timeout, and the groups
  after it are not run);
- attention: `issue21_timeline`'s group (batch 64 and 8 at 128K, q f32 and bf16, timed from HBM, with the CTAs'
  timelines);
- ablate: `issue21_prefetch`'s (the batch-64 kernel without its decode / wgmmas / both / store);
- before: attention (untimed) in a copy of the tree per kernel `build/before/<commit>.py` (carried), that commit's
  `kernels_pallas/gpu_attention_wgmma.py`: call 3 (with ablate): d5eba4e (lockstep warpgroups) and 8cdff13 (the
  two roles, each entry tile's rows loaded when it is decoded); call 4: d5eba4e, f36d2fe (rows loaded a tile
  ahead), d872694 (ranges take strided tiles). On the branch next/three-warpgroups (a third warpgroup decoding
  rows 32..63 of every tile, warpgroup 1 rows 0..31; `plgpu.set_max_registers` per warpgroup, REGISTERS): d5eba4e
  and 2de7f1e (main's two-role kernel), not yet run;
- ptx: `issue21_prefetch`'s (the kernel's PTX and ptxas report: registers, spills).

    mkdir -p build/before && for c in d5eba4e 2de7f1e; do
      git show $c:kernels_pallas/gpu_attention_wgmma.py > build/before/$c.py; done
    PYTHONPATH=. python3 -m experiments.device_runs.issue21_roles [GROUP ...]     (~6 min; carry build/before)

Logs and a table per group under $OUT.
"""

import os
import shutil
import sys

from experiments.device_runs._steps import OUT, step, tree_before
from experiments.device_runs.issue21_prefetch import ablate_group, ptx_group
from experiments.device_runs.issue21_timeline import gpu_tests, run_groups

BEFORE = "build/before"


def before_group(say, rows) -> None:
    del rows  # each kernel's table is in its own log
    for kernel in sorted(os.listdir(BEFORE)):
        commit = kernel.removesuffix(".py")
        tree = tree_before([], f"/tmp/tree_{commit}")
        shutil.copy(os.path.join(BEFORE, kernel), os.path.join(tree, "kernels_pallas", "gpu_attention_wgmma.py"))
        step(f"before_{commit}", ["-m", "experiments.device_runs.issue21_roles", "attention_untimed"], 300, cwd=tree)
        say(open(os.path.join(OUT, f"before_{commit}.log")).read()[-2500:])


def main(groups: list[str]) -> int:
    return run_groups(groups, {"ablate": ablate_group, "before": before_group,
                               "ptx": lambda say, rows: ptx_group(say)},
                      tests=lambda say: gpu_tests(say, ("tests/test_attention_wgmma.py",), 240))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["tests", "attention", "ablate", "before", "ptx"]))
