"""Issue 21 on one GPU (thirty-eighth and thirty-ninth sessions): the wgmma attention with its warpgroups in roles
(warpgroup 0 the logits, the softmax and p . keys[:, :256]; warpgroup 1 p . keys[:, 256:] with warpgroup 0's p
from shared memory; the decode of every tile a tile ahead by warpgroup 1, and since the thirty-ninth by
warpgroups 1 and 2) against earlier kernels, each in a copy of the tree.

Groups (default: tests attention ablate before ptx):
- tests: the attention's GPU tests (and the scan's, with a scan group), compiled (a hang of the hand-offs ends at
  the step's timeout, and the groups after it are not run);
- attention: `issue21_timeline`'s group (batch 64 and 8 at 128K, q f32 and bf16, timed from HBM, with the CTAs'
  timelines);
- ablate: `issue21_prefetch`'s (the batch-64 kernel without its decode / wgmmas / both / store);
- before: the command's timing groups (TIMING; attention when none is given; and ptx when the command has it,
  since the fortieth session: each copy's PTX and ptxas report under $OUT/before_<name>/mgpu; with timelines
  since the thirty-ninth session's end, untimed before) in a copy of the tree per `build/before/<name>.py` (carried: the
  attention's kernel file) or `build/before/<name>/` (copied over the tree: e.g. the scan's kernel), that commit's
  `kernels_pallas/gpu_attention_wgmma.py`: call 3 (with ablate): d5eba4e (lockstep warpgroups) and 8cdff13 (the
  two roles, each entry tile's rows loaded when it is decoded); call 4: d5eba4e, f36d2fe (rows loaded a tile
  ahead), d872694 (ranges take strided tiles). Thirty-ninth session, call 1 (with model): the ladder 4817d20
  (the two roles), cfe28a0 (a third warpgroup decoding rows 32..63 of every tile, warpgroup 1 rows 0..31;
  `plgpu.set_max_registers` per warpgroup, REGISTERS), 870d38e (+ the merged kernel turning and casting the
  model's output), 5156c9a (+ the merge's statistics through distributed shared memory), the tree at d0fcffc (+
  the prefetch in two bursts); calls 2 and 3: d0fcffc against a candidate; call 4: 4817d20 against bf1e5f3 (the
  decoders' entry ids in shared memory). `... issue21_roles tests attention model ablate before ptx` takes ~8
  min with one kernel before: give it the call's 600 s, or leave out ablate;
- model: the call as the model makes it (`dsv41_jax.kernels.sparse_attention_decode`: bf16 q, the rope's angles to
  turn the output back, bf16 out) at batch 64 and 8, timed from HBM (moved: the bf16 output and the angles), its
  error against `gpu_attention.unrotated` of the f32 twin (since 870d38e the merged kernel turns and casts its
  rows itself; before, XLA did after the kernel);
- ptx: `issue21_prefetch`'s (PTX and ptxas report: registers, spills) of the kernels the command times
  (`ptx_kernels`).

    mkdir -p build/before && for c in 4817d20; do
      git show $c:kernels_pallas/gpu_attention_wgmma.py > build/before/$c.py; done
    PYTHONPATH=. python3 -m experiments.device_runs.issue21_roles [GROUP ...]     (~6 min; carry build/before)

Logs and a table per group under $OUT.
"""

import os
import shutil
import sys

from experiments.device_runs._steps import OUT, step, tree_before
from experiments.device_runs.issue21_prefetch import ablate_group, ptx_group
from experiments.device_runs.issue21_timeline import SHARED_GROUPS, gpu_tests, model_call_case, run_groups, timed_row

BEFORE = "build/before"


def model_group(say, rows) -> None:
    import jax.numpy as jnp

    from experiments import bench_kernels as bk
    from kernels_pallas import gpu_attention_wgmma as att

    peak = bk.hbm_copy_bandwidth(1.0)
    say(f"copy peak {peak / 1e9:.0f} GB/s")
    scale = bk.D_ATT ** -0.5
    for b in (64, 8):
        args, moved, ref = model_call_case(b)
        fn = lambda *a: att.sparse_attention_wgmma(*a[:8], scale, unrotate=a[8:], out_dtype=jnp.bfloat16)  # noqa: E731
        timed_row(say, rows, "attention", f"model's call, 128K x {b}, bf16 q and out, unrotated", fn, args, 7, moved,
                  peak, lambda out, ref=ref: f"{bk.rel_err(out, ref):.1e}")
        del args, ref


def before_group(say, groups) -> None:
    """Each earlier form in a copy of the tree, run with `groups` of this script (its logs, and with ptx its PTX and
    ptxas report, under $OUT/before_<name>/): `BEFORE/<name>.py` is the attention's kernel file; a folder
    `BEFORE/<name>/` is copied over the tree (its files at their paths in the repository: another kernel, or
    several files)."""
    for entry in sorted(os.listdir(BEFORE)):
        name, src = entry.removesuffix(".py"), os.path.join(BEFORE, entry)
        tree = tree_before([], f"/tmp/tree_{name}")
        if os.path.isdir(src):
            shutil.copytree(src, tree, dirs_exist_ok=True)
        else:
            shutil.copy(src, os.path.join(tree, "kernels_pallas", "gpu_attention_wgmma.py"))
        step(f"before_{name}", ["-m", "experiments.device_runs.issue21_roles", *groups], 300,
             env={"OUT": os.path.join(OUT, f"before_{name}")}, cwd=tree)
        say(open(os.path.join(OUT, f"before_{name}.log")).read()[-2500:])


# The groups that time a kernel: `before` runs those of its command in each copy (attention when none is given)
TIMING = (*SHARED_GROUPS, "model")


def main(groups: list[str]) -> int:
    timed = ([g for g in groups if g in TIMING] or ["attention"]) + [g for g in groups if g == "ptx"]
    return run_groups(groups, {"ablate": ablate_group, "model": model_group,
                               "before": lambda say, rows: before_group(say, timed),
                               "ptx": lambda say, rows: ptx_group(say, ptx_kernels(groups))},
                      tests=lambda say: gpu_tests(say, gpu_test_files(groups), 330))


def ptx_kernels(groups: list[str]) -> tuple[str, ...]:
    """The kernels whose PTX the ptx group dumps: the scan's with a scan group, the attention's with any other (a copy
    of the tree in `before` recompiles only what it times)."""
    timed = [g for g in groups if g in TIMING or g == "ablate"]
    return tuple(k for k, wanted in (("attention", not timed or any(not g.startswith("scan") for g in timed)),
                                     ("scan", any(g.startswith("scan") for g in timed))) if wanted)


def gpu_test_files(groups: list[str]) -> tuple[str, ...]:
    """The GPU tests of the kernels the groups time: the attention's, and the scan's with a scan group."""
    scan = ("tests/test_indexer_wgmma.py",) if any(g.startswith("scan") for g in groups) else ()
    return ("tests/test_attention_wgmma.py", *scan)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["tests", "attention", "ablate", "before", "ptx"]))
