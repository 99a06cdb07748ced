"""Issue 12 on one H200: the benchmark points of the decode-speed issue, each under its own timeout, tables
in $OUT/<name>.log and rows in $OUT/<name>.json, each step's last table printed at the end.

    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode           # ~8 min: slice b1, b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode wide      # ~9.5 min: b64 4K / 128K, small
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode cmdbuf    # ~9 min
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode profiles  # ~7 min: small b1, both b1 profiles
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode ab        # ~9 min: the unmeasured changes, A/B
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode ab_slice  # ~2.5 min: the same, the slice only
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode ab_b8     # ~9.5 min: ab's first half, slice b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode profile_b8  # ~3 min: the slice's b8 profile
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode flags     # ~5 min: XLA options, b1 profiles
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode diagnose  # ~7 min: b8 profile, flags
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode wgmma     # ~7 min: wgmma tests, sweep, b1 A/B
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode wgmma2    # ~9.5 min: tests, b1 A/B, b8 after
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode wgmma_b8_before  # ~4 min: b8 Triton; b1 no cmdbuf
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode cmdbuf_cc  # ~3 min: Mosaic calls in cmd buffers
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode chunks    # ~5 min: 5 or 20 steps per call
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode scan_ab   # ~3 min: the Hopper scan, b8 128K
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode chunks16  # ~2.5 min: b1, b8, 16 steps per call
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode callgap   # ~4 min: the call-start gap, b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode queued    # ~4 min: calls queued, b8 and b1
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode points    # ~7 min: b1 + b8, small, b64 (queued)
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode points_128k  # ~4 min: b64 at 128K (queued)
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode tests_points  # ~8 min: serial_ab's tests, b1 + b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode serial_profiles  # ~6 min: serial_ab's A/B, small
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode wide_points  # ~8 min: b64 at 4K and 128K
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode attention_ab  # ~5 min: wgmma attention, b64 128K
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode attention_ab_b8  # ~4 min: the same, b8 4K
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode xload     # ~7 min: x loaded in-kernel, b1 A/B
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode xload_b8  # ~5 min: the same, b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode xload_b1  # ~4 min: xload without its tests
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode pdl       # ~5 min: XLA's PDL off / on, b1
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode verify    # ~7 min: wgmma tests, slice b1 + b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode cublas    # ~5.5 min: cuBLAS dots, heroless, b1
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode concurrent  # ~9 min: graphs as DAGs, b1
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode concurrent_points  # ~7.5 min: check, b1 + b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode concurrent_wide  # ~7.5 min: check, small, b64
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode concurrent_flags  # ~9 min: more in the graphs, b1
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode profile_alone  # ~4 min: the serial part, b1 + b8
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode while_graph  # ~5 min: the loop as one graph, b1
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_decode serial_ab  # ~7 min: seven hot-path changes A/B, b1; HLO

One bench point per step: a point costs its random params (~20 s), the step's compile (20-30 s), the
generation loop's compile (not in the printed compile time) and the timing; on 2026-12-02 the three slice
points of one process did not fit 230 s, and until bench_decode stopped compiling its step twice (thirteenth
session) the batch-8 point did not fit 270 s (step compile 62 s, three of them with the expert-hit forward).
`cmdbuf`: the slice and `small` at batch 1, each as is and with the whole generation loop as one command
buffer (XLA_FLAGS below), in one call so that they are compared on one machine: the slice's batch-1 step is
~415 kernels and its wall time was 0.2-0.4 ms over the GPU's busy time; `small`'s is ~670 kernels of ~2 us
(thirteenth session's profiles). `profiles`: `small`'s batch-1 bench point, then where the
GPU time of a batch-1 step goes, `small` and the slice (`profile_step`). `ab`: the GPU-compiled tests of the
latest kernels (AB_TESTS), then the batch-1 profiles of `small`, the slice and `small` again, each first in a copy of the tree with SINCE_MEASURED taken back
(`_steps.tree_before`), then as it is with AFTER_ENV (kernels off by default until timed): the changes made
since the last GPU measurement, timed against the code before them on one machine.
"""

import os
import sys

from experiments.device_runs._steps import OUT, step, tree_before

LOOP_CMDBUF = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"}
# the slice points, then the batch size: 40 steps = the loop timed over 8 calls of 5 (2 calls read 0.48 ms
# above profile_step's 8 in one run)
SLICE_ARGS = ["--steps", "40", "--chunk", "5", "--batch"]
SLICE = ["experiments.bench_decode", *SLICE_ARGS]
GROUPS = {  # name -> [(step name, module and arguments, timeout s, extra environment)]
    "default": [
        ("slice_4k_b1", [*SLICE, "1"], 150, {}),
        ("slice_4k_b8", [*SLICE, "8"], 330, {}),
    ],
    "wide": [
        ("slice_4k_b64", [*SLICE, "64"], 200, {}),
        ("slice_128k_b64", [*SLICE, "64", "--context", "131072"], 200, {}),
        ("small", ["experiments.bench_decode", "--preset", "small", "--batch", "1", "8", "--steps", "20",
                   "--chunk", "10"], 170, {}),
    ],
    "cmdbuf": [(name + suffix, ["experiments.bench_decode", *args], timeout_s, env)
               for name, args, timeout_s in (("slice_b1", [*SLICE_ARGS, "1"], 150),
                                             ("small_b1", ["--preset", "small", "--batch", "1", "--steps", "20",
                                                           "--chunk", "10"], 130))
               for suffix, env in (("", {}), ("_loop_cmdbuf", LOOP_CMDBUF))],
}
SMALL_B1 = ["--preset", "small", "--batch", "1", "--steps", "20", "--chunk", "10"]
PROFILE_B1 = {preset: ["experiments.profile_step", "--preset", preset, "--batch", "1", "--top", "30", "--out",
                       f"/tmp/i12_prof_{preset}"] for preset in ("small", "v41-slice")}
GROUPS["profiles"] = [("small_b1", ["experiments.bench_decode", *SMALL_B1], 160, {}),
                      ("profile_small_b1", PROFILE_B1["small"], 120, {}),
                      ("profile_b1", PROFILE_B1["v41-slice"], 120, {})]
# (file, the text now, the text before), taken back in the "before" tree; none now. Timed: the mHC projections in
# IEEE f32 (`ab`, twenty-seventh session: their 24 kernels 41.2 -> 40.0 us, GPU 1.560 ms either way), the top-k
# kernel's top level up to twice a level's candidates, 8 warps up to 8192 entries (`ab_slice`, twenty-sixth
# session: the select of a 4352-entry row 24.0 -> 10.4 us, GPU -13 / -12 us), its search skipped for rows of at most k
# entries (`pdl`'s profiles, twenty-fifth session: that select 9.9 -> 1.5 us against the twenty-fourth session's) and
# its search at 2 bits a step (`issue12_select` at 5933709, slower in the step, taken out), the weight kernels' CTAs
# loading their x (`xload`, `xload_b8`, twenty-fourth session), the wgmma attention (`attention_ab`,
# `attention_ab_b8`, twenty-third session), the weight kernels' K splits (`splits` at 38594e8), the branch
# next/attention-query-in-kernel (`attnq` at 79e28c4), q's exponent by XLA and RoPE without its concatenate (`qrope`
# at 342860d, slower, taken back), the expand and router kernels joined to XLA's dots (`fused` at 88966b7: slower,
# taken out).
SINCE_MEASURED = []
# `xload*`: every CTA of the Hopper weight kernels takes x by TMA, permuted and padded by XLA, in a copy of the tree
XLOAD_OFF = [("kernels_pallas/gpu_wgmma.py", "X_STEPS_MAX = 4", "X_STEPS_MAX = 0")]
# `attention_ab*`: the Hopper attention off (the dispatch's Triton kernel at every batch) in a copy of the tree
ATTENTION_OFF = [("kernels_pallas/gpu_attention_wgmma.py", "MIN_BATCH = 1", "MIN_BATCH = 1 << 30")]
# `scan_ab`: the Hopper indexer scan off (a copy of the tree) and on (as it is), batch 8 at 128K, where the
# encoder's Full layers scan 64K and 128K positions (eighteenth session: the scans 102.8 -> 59.3 us, the step's
# GPU time 3.561 -> 3.500 ms; every row of the profiles printed)
SCAN_OFF = [("kernels_pallas/gpu_indexer_wgmma.py", "ON = True", "ON = False")]
# kernels off by default until timed, on in the "after" half of `ab` (environment variables); none now (the last,
# DSV41_HYPER_SPLIT, was timed in the twenty-fourth pass and is the only form since)
AFTER_ENV = {}
# the GPU-compiled tests of the latest changes, first in `ab` (update with SINCE_MEASURED; now the hyper kernel's,
# of the last change timed);
# in the fifteenth session 150 s held the hyper kernel's tests but not the attention tests after them (19 s in a
# call apart); in the twenty-seventh 110 s held 8 of the hyper kernel's 9 (its model-decode test alone: 78 s).
# WGMMA_TESTS: the Hopper weight kernels' tests, first in the groups that time those kernels.
AB_TESTS = ("ab_gpu_tests", ["pytest", "tests/test_hyper_kernel.py", "-q", "-p", "no:cacheprovider"], 200,
            {"JAX_PLATFORMS": "cuda"})
WGMMA_TESTS = ("wgmma_gpu_tests", ["pytest", "tests/test_wgmma_kernel.py", "-q", "-p", "no:cacheprovider"], 110,
               {"JAX_PLATFORMS": "cuda"})
# a step whose name ends in "_before" runs in that copy; `ab_slice`: the slice's pair only, twice (~2.5 min)
GROUPS["ab_slice"] = [(f"profile_slice{rep}_b1_{side}", PROFILE_B1["v41-slice"], 90, {})
                      for rep in ("", "_again") for side in ("before", "after")]
GROUPS["ab"] = [AB_TESTS] + [(f"profile_{name}_b1_{side}", PROFILE_B1[preset], 90, {})
                             for name, preset in (("small", "small"), ("slice", "v41-slice"), ("small_again", "small"))
                             for side in ("before", "after")]

# the weight kernels' GPU tests, then the slice's b1 profile before / after, twice (~7 min); `xload_b8` below
GROUPS["xload"] = [WGMMA_TESTS] + [(f"profile_slice{rep}_b1_{side}", PROFILE_B1["v41-slice"], 90, {})
                                for rep in ("", "_again") for side in ("xload_off", "xload_on")]
# the same without the tests (twenty-fifth session: they ran in `verify`'s call), ~4 min
GROUPS["xload_b1"] = GROUPS["xload"][1:]
# one call when machines are scarce: the tests, `small` and the slice once each side, then the batch-8 point
GROUPS["ab_b8"] = GROUPS["ab"][:5] + [GROUPS["default"][1]]
# XLA options that might remove small kernels without code: RAFT for the routers' top-k (XLA's took 5.6 us
# per call of 384 experts), Triton fusions first in priority fusion (norms and their consumers as one kernel),
# Triton multi-output fusions; the slice's batch-1 profile with each, then `small`'s plain and heroless (~5 min)
XLA_OPTIONS = {"plain": {}, "raft_topk": {"XLA_FLAGS": "--xla_gpu_experimental_enable_raft_for_stable_topk=true"},
               "heroless": {"XLA_FLAGS": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true"},
               "multi_output": {"XLA_FLAGS": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=true"},
               # cuBLAS for XLA's dots: the mHC projections run as a split-K Triton GEMM and its reduce (24 kernels,
               # 41 us at batch 1, nineteenth pass), and as products and a row sum XLA still made two kernels
               "no_triton_gemm": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}}
GROUPS["flags"] = ([(f"profile_slice_b1_{name}", PROFILE_B1["v41-slice"], 80, env) for name, env in XLA_OPTIONS.items()]
                   + [(f"profile_small_b1_{name}", PROFILE_B1["small"], 80, XLA_OPTIONS[name])
                      for name in ("plain", "heroless")])
# XLA's dots by cuBLAS against the defaults, the slice's batch-1 profile twice each (~3 min), then heroless
# priority fusion with the time to compile that `flags` did not give it (60 s; ~2.5 min)
GROUPS["cublas"] = [(f"profile_slice{rep}_b1_{name}", PROFILE_B1["v41-slice"], 80, XLA_OPTIONS[name])
                    for rep in ("", "_again") for name in ("plain", "no_triton_gemm")] + [
    ("profile_slice_b1_heroless", PROFILE_B1["v41-slice"], 150, XLA_OPTIONS["heroless"])]
# where the batch-8 step's time goes (no profile of it since the third pass; ninth pass: 2.04x of its roofline,
# the routed experts estimated at ~3 of its 4.3 ms)
GROUPS["profile_b8"] = [("profile_slice_b8", ["experiments.profile_step", "--preset", "v41-slice", "--batch", "8",
                                              "--top", "40", "--out", "/tmp/i12_prof_b8"], 240, {})]

# the batch-8 profile, then the XLA options on the slice (~7 min)
GROUPS["diagnose"] = GROUPS["profile_b8"] + [(name, args, 60, env) for name, args, _, env in GROUPS["flags"][:4]]


# the wgmma expert kernel (seventeenth session): its tests, the prototype's sweep of its variants against the
# Triton kernel, the slice's batch-1 profile before / after (~7 min); then batch 8 before / after (~7 min)
GROUPS["wgmma"] = [WGMMA_TESTS, ("wgmma_sweep", ["experiments.bench_wgmma"], 250, {})] + \
    [(f"profile_slice_b1_{side}", PROFILE_B1["v41-slice"], 100, {}) for side in ("before", "after")]
GROUPS["wgmma_b8"] = [(f"profile_slice_b8_{side}", GROUPS["profile_b8"][0][1], 240, {}) for side in ("before", "after")]
# after the first call (overlapped wgmma wrong, loop slower with fewer GPU us): the serial kernels' tests, the
# slice's batch-1 profile before / after with the GPU's idle time by kernel, the batch-8 profile after, and
# batch 1 after with custom calls added to the command buffers' op types (~9.5 min)
GROUPS["wgmma_b8_before"] = [("profile_slice_b8_before", GROUPS["profile_b8"][0][1], 170, {}),
                             # is the batch-1 step host-bound? the same step with XLA's command buffers off
                             ("profile_slice_b1_no_cmdbuf", PROFILE_B1["v41-slice"], 85,
                              {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="})]
GROUPS["wgmma2"] = [(WGMMA_TESTS[0], WGMMA_TESTS[1], 100, WGMMA_TESTS[3])] + [
    (f"profile_slice_b1_{side}", PROFILE_B1["v41-slice"], 90, {}) for side in ("before", "after")] + [
    ("profile_slice_b8_after", GROUPS["profile_b8"][0][1], 200, {}),
    ("profile_slice_b1_after_cmdbuf_cc", PROFILE_B1["v41-slice"], 90,
     {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+CUSTOM_CALL"})]

# eighteenth session: the batch-1 step's GPU idles ~11 us before each of the 24 cuBLAS dots that follow a
# Mosaic kernel (host-bound launches, `profile_step`'s host table), and XLA put none of the 76 Pallas calls
# (Triton and Mosaic) into its command buffers. Triton calls are not FFI handlers: they could enter only as
# a listed legacy target, a flag this XLA does not know (both runs stopped at flag parsing). The flag's "+A,+B"
# form may apply only its first item (XLA's flag parser as read in its source returns inside its loop), hence
# the whole list of command types. The generation loop itself as one graph (WHILE, CONDITIONAL) needs every
# op of the step to be a command; judged impossible here while Triton kernels remained, until the twenty-ninth
# session's trace showed the whole body in one graph (`while_graph` below).
CC_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"
CC = {"XLA_FLAGS": f"--xla_gpu_enable_command_buffer={CC_TYPES}"}  # jax 0.11.2's XLA has no legacy-target flag

def slice_profile(batch: int, chunk: int = 5, context: int = 4096, top: int = 25, queued: int = 1) -> list[str]:
    """`profile_step` of the v41 slice (module and arguments of a step)."""
    return ["experiments.profile_step", "--preset", "v41-slice", "--batch", str(batch), "--context", str(context),
            "--chunk", str(chunk), "--top", str(top), "--queued", str(queued),
            "--out", f"/tmp/i12_slice_b{batch}_c{chunk}_{context}_q{queued}"]


GROUPS["cmdbuf_cc"] = [(f"profile_slice_b{b}_{name}", slice_profile(b), 90, env)
                       for b in (1, 8) for name, env in (("plain", {}), ("cc", CC))]
GROUPS["scan_ab"] = [(f"profile_slice_b8_128k_{side}", slice_profile(8, 16, 131072, top=400), 130, {})
                     for side in ("scan_off", "scan_on")]
# the slice at 4K with `experiments.decode`'s 16 steps per call (its first run, after `scan_ab` in that call,
# had the Hopper scan's defective CTA split)
GROUPS["chunks16"] = [(f"profile_slice_b{b}_chunk16", slice_profile(b, 16), 100, {}) for b in (1, 8)]
# the one large GPU gap of a call (b1: 210-270 us in 5 steps) is the host's first graph launch of the call;
# 20 steps per call spread it 4x thinner
GROUPS["chunks"] = [(f"profile_slice_b{b}_chunk{c}", slice_profile(b, c), 110, {}) for b, c in ((8, 5), (8, 20), (1, 20))]
# twentieth session: the call's first graph launch (`command_buffer_8`, iteration 0) holds the GPU ~1.1 ms per
# call at batch 8 (nineteenth session): is it the graph (command buffers off, or Mosaic calls inside them), and
# is it per call (40 steps per call)?
NO_CMDBUF = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
GROUPS["callgap"] = [("profile_slice_b8_chunk20", slice_profile(8, 20), 100, {}),
                     ("profile_slice_b8_chunk20_no_cmdbuf", slice_profile(8, 20), 100, NO_CMDBUF),
                     ("profile_slice_b8_chunk20_cc", slice_profile(8, 20), 100, CC),
                     ("profile_slice_b8_chunk40", slice_profile(8, 40), 110, {}),
                     ("profile_slice_b1_chunk20_no_cmdbuf", slice_profile(1, 20), 90, NO_CMDBUF)]
# (first call: the gap is ~1.1 ms per call, at 20 or 40 steps; command buffers off or Mosaic calls inside them
# are slower.) Does it hide when the host queues the next call before it reads this one's tokens?
GROUPS["queued"] = [(f"profile_slice_b{b}_chunk20_queued{q}", slice_profile(b, 20, queued=q), 110, {})
                    for b, q in ((8, 1), (8, 4), (1, 4), (1, 1))]

# the points as the fourteenth pass ran them (calls queued), in one call (~7 min): slice b1 and b8 in one
# process, `small` b1, slice b64
GROUPS["points"] = [
    ("bench_slice_q4", ["experiments.bench_decode", "--batch", "1", "8", "--steps", "160", "--chunk", "20",
                        "--queued", "4"], 280, {}),
    ("bench_small_b1_q4", ["experiments.bench_decode", "--preset", "small", "--batch", "1", "--steps", "80",
                           "--chunk", "20", "--queued", "4"], 100, {}),
    ("bench_slice_b64_q2", ["experiments.bench_decode", "--batch", "64", "--steps", "40", "--chunk", "10",
                            "--queued", "2"], 195, {})]

# the last target point, as the targets table ran it: `points` and this re-measure all of them in two calls
GROUPS["points_128k"] = [("bench_slice_b64_128k_q2", ["experiments.bench_decode", "--batch", "64", "--context",
                                                      "131072", "--steps", "20", "--chunk", "10", "--queued", "2"],
                          260, {})]

# the wgmma attention against the Triton kernel in the slice: batch 64 at 128K (~5 min), batch 8 at 4K (~4 min)
GROUPS["attention_ab"] = [(f"profile_slice_b64_128k_{side}", slice_profile(64, 10, 131072, top=40), 170, {})
                          for side in ("attention_off", "attention_on")]
GROUPS["xload_b8"] = [(f"profile_slice_b8_{side}", slice_profile(8, 20, top=40), 130, {})
                      for side in ("xload_off", "xload_on")]
GROUPS["attention_ab_b8"] = [(f"profile_slice_b8_{side}", slice_profile(8, 20, top=40), 130, {})
                             for side in ("attention_off", "attention_on")]

# Programmatic Dependent Launch: does this XLA emit it by default (the probe's PTX), and what does it change in
# the slice's batch-1 step, ~300 kernels of which ~220 are 1-4 us fusions (twenty-fifth session, ~5 min)
PDL = {name: {"XLA_FLAGS": f"--xla_gpu_enable_pdl={on} --xla_gpu_enable_pdl_launch={on}"}
       for name, on in (("pdl_on", "true"), ("pdl_off", "false"))}
GROUPS["pdl"] = ([(f"pdl_probe_{name}", ["experiments.device_runs.issue12_pdl_probe", f"/tmp/pdl_{name}"], 60, env)
                  for name, env in (("default", {}), *PDL.items())]
                 + [(f"profile_slice{rep}_b1_{name}", PROFILE_B1["v41-slice"], 90, env)
                    for rep in ("", "_again") for name, env in PDL.items()])

# twenty-eighth session: XLA records each command buffer with its default scheduling ("LHS": the thunks in
# order, one after another); CONCURRENT records the data dependencies only, so independent kernels of a graph
# segment may overlap (the small kernels beside the weight streams). The batch-1 point with each, then the
# profile with it (~8 min)
CONCURRENT = {"XLA_FLAGS": "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"}
def slice_bench(batch: int, chunk: int = 20) -> list[str]:
    """bench_decode of the slice at one batch, 160 steps, `chunk` steps per call, 4 calls per host sync."""
    return ["experiments.bench_decode", "--batch", str(batch), "--steps", "160", "--chunk", str(chunk), "--queued", "4"]


B1_POINT = slice_bench(1)
GROUPS["concurrent"] = [("bench_slice_b1_q4_plain", B1_POINT, 140, {}),
                        ("bench_slice_b1_q4_concurrent", B1_POINT, 140, CONCURRENT),
                        ("profile_slice_b1_concurrent", slice_profile(1, 20, top=40, queued=4), 110, CONCURRENT),
                        ("bench_slice_b1_q4_plain_again", B1_POINT, 140, {})]

# the Hopper weight kernels' GPU tests (not run since the review's swizzled_offset), then the issue's slice points
# as `points` runs them (~7 min)
GROUPS["verify"] = [WGMMA_TESTS, GROUPS["points"][0]]
# with it made the api's default (compile_options.GPU_OPTIONS): the same tokens and cache bits as XLA's default order,
# then the slice's batch-1 and batch-8 points as `points` runs them (~7.5 min)
GROUPS["concurrent_points"] = [("concurrent_check", ["experiments.device_runs.concurrent_check"], 200, {}),
                               GROUPS["points"][0]]
# the check again (its first run built bf16 experts: out of memory), `small` b1 and the slice at b64 (~7.5 min)
GROUPS["concurrent_wide"] = [GROUPS["concurrent_points"][0], *GROUPS["points"][1:]]
# next (not yet run): with the graphs' kernels ordered by data, more of the step inside graphs may overlap more:
# the Mosaic calls as graph commands (CC; slower under the default order, eighteenth pass) and graphs of fewer
# than XLA's default 5 commands; batch 1 with each against the api's default, in one call (~9 min)
SMALL_GRAPHS = "--xla_gpu_graph_min_graph_size=1"
GROUPS["concurrent_flags"] = [(f"bench_slice_b1_q4_{name}", B1_POINT, 130, env) for name, env in (
    ("api", {}), ("cc", CC), ("small_graphs", {"XLA_FLAGS": SMALL_GRAPHS}),
    ("cc_small_graphs", {"XLA_FLAGS": f"{CC['XLA_FLAGS']} {SMALL_GRAPHS}"}))]
# where batch 1's serial time is under CONCURRENT: profile_step's "alone" table (each source's time with no other
# kernel running) and one step's timeline, batch 1 and 8 (~4 min)
GROUPS["profile_alone"] = [(f"profile_slice_b{b}_alone", [*slice_profile(b, 20, top=60, queued=4), "--timeline"], 110, {})
                           for b in (1, 8)]

# twenty-ninth session: whether the host keeps ahead of batch 1's GPU steps (profile_step's host lead: a call's
# start costs the host a command-buffer update, which the GPU waits for unless the host is steps ahead), and
# what 40 steps per call (half the call starts) give the point (~6 min)
GROUPS["hostlead"] = [("profile_slice_b1_hostlead", slice_profile(1, 20, top=30, queued=4), 110, {}),
                      ("bench_slice_b1_q4_chunk20", B1_POINT, 130, {}),
                      ("bench_slice_b1_q4_chunk40", slice_bench(1, chunk=40), 130, {})]

# the open item of the twenty-eighth session: prefill and the speculative programs under the api's CONCURRENT
# order against XLA's default (the order by XLA_FLAGS). Prefill: the slice's 256-token chunk, time and logits (bit-
# compared afterwards from the returned files, `concurrent_prefill --compare`); speculative: the CLI's DSpark run on
# `tiny`, the preset with draft stages (draft / verify ms per step, tokens equal to plain decoding's). Their first
# run (twenty-ninth session, 200 s / 150 s a step) ran out of time in the compiles: each group is one call now
LHS = {"XLA_FLAGS": "--xla_gpu_command_buffer_scheduling_mode=LHS"}
PREFILL = "experiments.device_runs.concurrent_prefill"
SPEC_TINY = ["experiments.decode", "--preset", "tiny", "--speculative", "dspark", "--batch", "4", "--max-new-tokens",
             "64"]
GROUPS["concurrent_prefill"] = [("prefill_api", [PREFILL, "api"], 285, {}), ("prefill_lhs", [PREFILL, "lhs"], 285, LHS)]
GROUPS["concurrent_spec"] = [("spec_tiny_api", SPEC_TINY, 285, {}), ("spec_tiny_lhs", SPEC_TINY, 285, LHS)]
# The sub-layers' input side as one launch against two (the input apart from its coefficients): `hyper_split_all` at
# commit 7ef675c (twenty-fourth pass: two launches faster, the one-launch form removed since)

# The generation loop itself as one graph: call 7's trace (twenty-ninth session) shows each iteration of the loop
# as one graph launch with every kernel of the step inside it, so the premise above (Triton calls outside the
# graphs) no longer holds and WHILE may be recordable. A call would then be one launch, where the host now spends
# 0.44-0.98 ms a step launching the body's graph (a limit once a step is that short). Batch 1 as the api runs it,
# then with the loop as a command, and that run's profile (its host table says whether the loop was recorded)
# (~5 min)
WHILE_GRAPH = {"XLA_FLAGS": f"--xla_gpu_enable_command_buffer={CC_TYPES},WHILE,CONDITIONAL"}
GROUPS["while_graph"] = [("bench_slice_b1_api", B1_POINT, 110, {}),
                         ("bench_slice_b1_while", B1_POINT, 110, WHILE_GRAPH),
                         ("profile_slice_b1_while", slice_profile(1, 20, top=20, queued=4), 100, WHILE_GRAPH)]

# thirtieth session (no GPU lent), three changes on the batch-1 step's serial path, exact, untimed: the top-k
# kernel's threshold search stops once exactly k keys are at or above its prefix (`decode.kth_key`; 13-26 of 32 steps
# on distinct scores, rows of 4352: `python -m experiments.select_steps`); the compiled select's output is [rows, k] itself (was
# kp + 1 columns, sliced: a copy before the attention kernel); the sampling is one argmax over the vocabulary (was
# the greedy and the Gumbel-max argmax and a select). `serial_ab`: the selection's and the sampling's GPU tests,
# then the slice's batch-1 profile with the three taken back (a copy of the tree) and as it is: the select rows
# (three launches a step, 8-21 us each in call 7), the sampling's reductions (`vmap()/reduce`, 4 a step), the
# memcpys and the step's GPU time (~7 min with the tests added since). Thirty-first session (no GPU lent either), a fourth: the attention's key
# ranges merged and the rope taken off its output in one kernel (`gpu_attention.combine_unrotated`), where XLA ran
# three (the weights' max, their division, the sum with the inverse rope: 5.1-5.4 us a layer in call 7's timeline), the last
# revert below (the pallas branch of `dsv41_jax.kernels.sparse_attention_decode` as it was: the kernel's f32
# output, then the model's apply_rope and cast); and a fifth: an intermediate level of the top-k kernel takes its
# count of keys >= the new bound from the search (one block reduction a level fewer); a sixth: the attention's q and
# kv norms in one kernel (`gpu_norm.rms_norms`) where XLA ran ~4 (the projections' cast, a reduction per norm,
# the scaling: 4.0-5.8 us between wq_a and wq_b a layer in call 7's timeline). Thirty-second session (no GPU lent), a
# seventh, off the serial path: the router weight in the model's param dtype (bf16, as the release stores it) where
# it was f32, its dot bf16 x bf16 into f32 (exact products, as the reference's upcast): 3.9 MB a layer fewer to read
# (the slice's roofline drops by as much, 23.6 MB a step)
SERIAL_OFF = [("dsv41_jax/moe.py", "(cfg.n_routed_experts, cfg.dim), cfg.param_dtype))",
               "(cfg.n_routed_experts, cfg.dim), jnp.float32))"),
              ("dsv41_jax/moe.py",
               'jnp.einsum("nd,ed->ne", x_nd, self.weight[...], preferred_element_type=jnp.float32)',
               'jnp.einsum("nd,ed->ne", x_nd.astype(jnp.float32), self.weight[...])'),
              ("dsv41_jax/layers.py", "    if not kernels_mod.rms_norms_on(kernels, rows, [x.shape[-1] for x in xs]):",
               "    if True:"),
              ("kernels_pallas/gpu_select.py",
               "        _, x, n_x = decode.kth_search(keys, k, floor=bound)  # n_x = #(keys >= x)\n"
               "        new_bound = jnp.maximum(bound, x)\n",
               "        new_bound = jnp.maximum(bound, decode.kth_key(keys, k, floor=bound))\n"
               "        n_ge = jnp.sum((keys >= new_bound).astype(jnp.int32))\n"),
              ("kernels_pallas/gpu_select.py", "        take_ties = (x < bound) | (n_x <= k)",
               "        take_ties = n_ge <= k"),
              ("kernels_pallas/decode.py", "return (i < 32) & ((n_ge != k) | (res < floor))", "return i < 32"),
              ("kernels_pallas/gpu_select.py", "width = kp + 1 if interpret else k", "width = kp + 1"),
              ("dsv41_jax/sampling.py",
               "drawn = jax.random.gumbel(key, logits.shape, logits.dtype) + logits / jnp.maximum(t, 1e-5)\n"
               "        return jnp.argmax(jnp.where(t > 0, drawn, logits)).astype(jnp.int32)",
               "drawn = jax.random.categorical(key, logits / jnp.maximum(t, 1e-5))\n"
               "        return jnp.where(t > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)"),
              ("dsv41_jax/kernels.py",
               "        cos_bp, sin_bp = pair_angles(pos_b, inv_freq, q_bhd.shape[-1])\n"
               "        return per_sequence(lambda q, w, v, e, i, c, s, sink: _kp.sparse_attention_decode(\n"
               "            q, w, v, e, i, sink, scale, unrotate=(c, s), out_dtype=dtype),\n"
               "            q_bhd, window_rec, window_valid, entry_rec, idx_bk, cos_bp, sin_bp, shared=(sink_h,))",
               "        o_bhd = per_sequence(lambda q, w, v, e, i, sink: _kp.sparse_attention_decode(q, w, v, e, i, sink, "
               "scale),\n            q_bhd, window_rec, window_valid, entry_rec, idx_bk, shared=(sink_h,))\n"
               "        return apply_rope(o_bhd[:, None], pos_b[:, None], inv_freq, inverse=True)[:, 0].astype(dtype)")]
# The second profile also dumps the generation loop's optimized HLO, kept gzipped (`keep_hlo`): what XLA made of
# the step on the GPU (e.g. the ~10 memcpys a step, some between a select and the attention that reads it), to be
# read on a CPU afterwards
HLO_DUMP = {"XLA_FLAGS": "--xla_dump_to=/tmp/i12_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*generate.*"}
GROUPS["serial_ab"] = [("serial_gpu_tests", ["pytest", "tests/test_kernels_gpu.py", "tests/test_sampling.py",
                                             "tests/test_attention_wgmma.py", "tests/test_norm_kernel.py", "-q", "-p",
                                             "no:cacheprovider", "-k",
                                             "select or candidate or threshold or sample or unrotated or norm_kernel "
                                             "or sparse_attention or indexer_scores"],
                       240, {"JAX_PLATFORMS": "cuda"})] + [
    (f"profile_slice_b1{side}", slice_profile(1, 20, top=80, queued=4), 100, env)  # every select row printed
    for side, env in (("_serial_off", {}), ("", HLO_DUMP))] + [
    ("keep_hlo_b1", ["experiments.device_runs.keep_hlo", "/tmp/i12_hlo", "slice_b1_generate"], 30, {})]

# the same steps in the order that settles the most per call when a session has ~25 min of device time (thirty-second
# session): the hot-path changes' GPU tests with the b1 + b8 points (~8 min), then serial_ab's A/B profiles with
# `small` (~6 min), then b64 at 4K and 128K (~8 min)
GROUPS["tests_points"] = [GROUPS["serial_ab"][0], GROUPS["points"][0]]
GROUPS["serial_profiles"] = [*GROUPS["serial_ab"][1:], GROUPS["points"][1]]
GROUPS["wide_points"] = [GROUPS["points"][2], *GROUPS["points_128k"]]

# a step whose name ends in one of these runs in a copy of the tree with that list of changes taken back
TREES = {"_before": SINCE_MEASURED, "_scan_off": SCAN_OFF, "_attention_off": ATTENTION_OFF, "_xload_off": XLOAD_OFF,
         "_serial_off": SERIAL_OFF}


def last_table(log: str, name: str) -> str:
    """The bench's final table (the profile's summary and source table), or the log's tail if it has none."""
    if name.endswith("tests"):
        return "\n".join(log.strip().splitlines()[-3:])
    if name == "wgmma_sweep":
        return log[log.rfind("\n| shape"):].strip()
    if name.startswith("profile"):
        idle = log.find("\nGPU idle between kernels")
        if idle >= 0:  # the profile's idle table and custom-call placement, then its first tables
            return log[idle:].strip() + "\n" + last_table(log[:idle], name)
        at = log.find("(loop, not profiled)")
        start = log.rfind("\n", 0, at) + 1 if at >= 0 else -1
    else:
        start = max(log.rfind("\n| batch"), log.rfind("\n| op |"))
    return (log[start:start + 2500] if start >= 0 else log[-1500:]).strip()


if __name__ == "__main__":
    steps = GROUPS[sys.argv[1] if len(sys.argv) > 1 else "default"]
    trees = {end: tree_before(reverts, f"/tmp/tree{end}") for end, reverts in TREES.items()
             if any(name.endswith(end) for name, *_ in steps)}
    for name, (module, *args), timeout_s, env in steps:
        out = ["--out", os.path.join(OUT, f"{name}.json")] if module == "experiments.bench_decode" else []
        env = {**env, **AFTER_ENV} if name.endswith(("_after", "tests")) else env
        cwd = next((tree for end, tree in trees.items() if name.endswith(end)), None)
        step(name, ["-m", module, *args, *out], timeout_s, env, cwd=cwd)
    for name, *_ in steps:
        print(f"\n== {name}\n{last_table(open(os.path.join(OUT, f'{name}.log')).read(), name)}")
