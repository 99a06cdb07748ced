"""Issue 12 at batch 1 on one H200: the kernels that decide the step, alone, with their launch parameters swept.

    PYTHONPATH=. python3 -m experiments.device_runs.issue12_b1_kernels          # ~2.5 min
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_b1_kernels latency  # ~1.5 min: hyper kernels, selects
    PYTHONPATH=. python3 -m experiments.device_runs.issue12_b1_kernels attention  # ~5 min: attention's tiles at 4K

After the twenty-second session's first call (slice b1 1.636 ms/step, 1.78x; GPU busy 1.656 ms) the weight
kernels of a batch-1 step run at 55-75% of the copy peak (FP8 wo_b / wq_b / shared experts, FP4 routed
experts: ~240 us over their bytes at the peak) and each of the 12 `hyper_in` launches (the sub-layer input side
in one launch, since split in two: `gpu_hyper.hyper_input`, `hyper_coefficients`, which these steps time now) takes
~5.3 us for a row of 4 x 5120 and a 4 x 4 Sinkhorn. Steps: `bench_wgmma --sweep` at one token (every K split and pipeline
depth of both kernels, each checked against its twin first), then the input side at 1 and 8 rows with 1, 2, 4
and 8 warps (GPU time per launch, a jitted chain of 32 launches on distinct rows, from a profiler trace).
Logs in $OUT. `latency` (twenty-fifth session): what the two latency-bound kernels spend their time on, one row:
the input side with its 20 Sinkhorn iterations or 1, and the top-k selections at the slice's row lengths (4352
compressed positions at 4K + the bench's 256 spare; the pool's 16384) by warps, 4352 with its top level held to a
level's 4096 candidates (two levels, as before `gpu_select.top_capacity`) and to twice that (one level of 8192).
The selects' GPU us leave out the XLA kernel that builds a second level (~1.4 us).
`attention` (twenty-sixth session): the batch-1 step's sparse attention (Triton, 5 calls a step at 14 us each in
the slice at 4K, with the split combine's 2 XLA kernels ~2.8 us more) by its launch parameters at the step's shape
(128 window keys + 512 of 4352 entries, 64 heads), one `bench_kernels` run each (~20 s); the closing summary on
stdout has every row (a device call brings back only some of its 15 logs: twenty-seventh session, 8). Result
(twenty-seventh session, docs/BENCHMARKS.md twentieth pass): the dispatch's tiles, measured at 128K, are the
fastest at 4K too.
"""

import os
import sys
import tempfile

from experiments.device_runs._steps import OUT, step


def _hyper_inputs(reps: int, n: int):
    """reps distinct random (h, mixes, pre_mix) of n rows at the v41 stream (hc 4 x 5120, bf16), and the shared
    (norm weight, scale, base)."""
    import jax
    import jax.numpy as jnp

    hc, d = 4, 5120
    key = jax.random.key(n)
    h = jax.random.normal(key, (reps, n, hc, d), jnp.bfloat16)
    mixes = jax.random.normal(jax.random.fold_in(key, 1), (reps, n, (2 + hc) * hc), jnp.float32) * 30
    pre_mix = jax.nn.sigmoid(jax.random.normal(jax.random.fold_in(key, 2), (reps, n, hc)))
    norm_w = 1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 3), (d,))
    scale, base = jnp.array([0.1, 0.2, 0.3]), 0.1 * jax.random.normal(jax.random.fold_in(key, 4), ((2 + hc) * hc,))
    return (h, mixes, pre_mix), (norm_w, scale, base)


def _hyper_launches(reps: int, shared, warps: int = 4, iters: int = 20):
    """A jitted chain of reps sub-layer input sides, each `gpu_hyper.hyper_input` + `hyper_coefficients`."""
    import jax

    from dsv41_jax import hyper, layers
    from kernels_pallas import gpu_hyper

    norm_w, scale, base = shared
    return jax.jit(lambda h, m, p: [
        (gpu_hyper.hyper_input(h[i], p[i], norm_w, collapse_rows=hyper.collapse_rows, norm=layers.rms_apply,
                               norm_eps=1e-20, num_warps=warps),
         *gpu_hyper.hyper_coefficients(h[i], m[i], scale, base, coefficients=hyper.coefficients, iters=iters,
                                       hc_eps=1e-6, mix_eps=1e-20, num_warps=warps)) for i in range(reps)])


def hyper_warps() -> None:
    """GPU us per sub-layer input side (`gpu_hyper.hyper_input` + `hyper_coefficients`; until the thirty-third
    session the one launch `hyper_in`) at the v41 stream by num_warps."""
    import jax
    import jax.numpy as jnp

    from experiments.bench_decode import kernel_profile

    reps = 32
    print("| rows | num_warps | GPU us per input side | max abs diff vs 4 warps |\n|---|---|---|---|", flush=True)
    for n in (1, 8):
        args, shared = _hyper_inputs(reps, n)
        ref = None
        for warps in (4, 1, 2, 8):
            call = _hyper_launches(reps, shared, warps)
            out = jax.block_until_ready(call(*args))
            ref = ref or out
            diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for o, r in zip(out, ref) for a, b in zip(o, r))
            with tempfile.TemporaryDirectory() as tmp:
                prof = kernel_profile(lambda: jax.block_until_ready(call(*args)), tmp, reps, top=10)
            us = sum(r["us_per_step"] for r in prof[2:] if r["name"].startswith("hyper_"))
            print(f"| {n} | {warps} | {us:.2f} | {diff:.3g} |", flush=True)


def latency() -> None:
    """GPU us per sub-layer input side (1 row; the one launch `hyper_in` until the thirty-third session) by
    Sinkhorn iterations, and of the top-k kernel by row length and candidate capacity (each checked against
    `ops.select_topk`)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax import ops
    from experiments.bench_decode import kernel_profile
    from kernels_pallas import gpu_select

    def per_launch(call, args, name, reps):
        jax.block_until_ready(call(*args))
        with tempfile.TemporaryDirectory() as tmp:
            prof = kernel_profile(lambda: jax.block_until_ready(call(*args)), tmp, reps, top=10)
        return sum(r["us_per_step"] for r in prof[2:] if r["name"].startswith(name))

    reps = 32
    args, shared = _hyper_inputs(reps, 1)
    print("| kernel | variant | GPU us per launch | exact |\n|---|---|---|---|", flush=True)
    for iters in (20, 1):
        us = per_launch(_hyper_launches(reps, shared, iters=iters), args, "hyper_", reps)
        print(f"| hyper_input + hyper_coefficients, 1 row | {iters} Sinkhorn iterations | {us:.2f} | - |", flush=True)
    key = jax.random.key(0)
    top_capacity = gpu_select.top_capacity
    levels = {"top <= cap (before)": lambda k: gpu_select.capacity(k)[1], "top <= 2 cap (now)": top_capacity}
    for n, variants in ((4352, [("top <= cap (before)", w) for w in (4, 8, 16)]
                         + [("top <= 2 cap (now)", w) for w in (8, 16, 32)]),
                        (16384, [("top <= 2 cap (now)", w) for w in (4, 8, 16)])):
        scores = jax.random.normal(jax.random.fold_in(key, n), (reps, 1, n), jnp.float32)
        ref = jax.jit(jax.vmap(lambda s: ops.select_topk(s, 512)))(scores)
        for name, warps in variants:
            gpu_select.top_capacity = levels[name]
            try:
                # unjitted inside: a jit cache keyed on shapes would reuse the other capacity's kernel
                top = gpu_select.topk_from_levels.__wrapped__
                call = jax.jit(lambda s, w=warps: [top(gpu_select.build_levels(s[i], 512), 512, num_warps=w)
                                                   for i in range(reps)])
                exact = all(bool((a == b).all()) for a, b in zip(call(scores), ref))
                us = per_launch(call, (scores,), "select_topk", reps)
            finally:
                gpu_select.top_capacity = top_capacity
            print(f"| select_topk, 1 x {n}, k 512 | {name}, {warps} warps | {us:.2f} | {exact} |", flush=True)

# the b1 sparse attention's launch parameters, each one `bench_kernels` run at the step's 4K shape (its attention
# row: the L2 flushed before every call, relative error against the jnp twin, % of the copy peak):
# (splits, heads per program, keys per tile, warps); the first is the dispatch's at batch 1 (the twenty-seventh
# session also ran three configurations of a two-kernel "split" form, since removed: none was faster)
ATTENTION_VARIANTS = [(20, 16, 32, 4), (10, 16, 32, 4), (5, 16, 32, 4), (40, 16, 16, 4), (20, 16, 16, 4),
                      (20, 32, 32, 4), (10, 32, 32, 8), (20, 64, 32, 8), (5, 64, 32, 8), (10, 16, 64, 4),
                      (2, 16, 64, 4)]


def attention_steps() -> list[str]:
    """Run `bench_kernels --only attention` once per ATTENTION_VARIANTS entry; returns the step names."""
    names = []
    for splits, block, bk, warps in ATTENTION_VARIANTS:
        name = f"attention_flash_s{splits}_b{block}_k{bk}_w{warps}"
        step(name, ["-m", "experiments.bench_kernels", "--contexts", "4352", "--batches", "1", "--only", "attention",
                    "--splits", str(splits), "--head-block", str(block), "--block-k", str(bk),
                    "--att-warps", str(warps)], 90)
        names.append(name)
    return names


if __name__ == "__main__":
    if sys.argv[1:] == ["attention"]:
        for name in attention_steps():
            log = open(os.path.join(OUT, f"{name}.log")).read()
            print(f"== {name}: " + next((ln.strip() for ln in log.splitlines() if ln.lstrip().startswith(
                ("attention", "failed"))), log[-300:]))
        raise SystemExit(0)
    if sys.argv[1:] == ["hyper"]:
        hyper_warps()
        raise SystemExit(0)
    if sys.argv[1:] == ["latency"]:
        latency()
        raise SystemExit(0)
    step("wgmma_sweep_b1", ["-m", "experiments.bench_wgmma", "--sweep", "--tokens", "1", "--fp8-rows", "1",
                            "--reps", "32"], 330)
    step("hyper_warps", ["-m", "experiments.device_runs.issue12_b1_kernels", "hyper"], 120)
    for name in ("wgmma_sweep_b1", "hyper_warps"):
        log = open(os.path.join(OUT, f"{name}.log")).read()
        print(f"\n== {name}\n{log[log.find(chr(10) + '| '):].strip()[-6000:]}")
