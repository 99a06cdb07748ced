"""Issue 15 on a 2-H200 host: PYTHONPATH=. python3 -m experiments.device_runs.issue15_two_gpus [bench|equal|extra|small|engine];
logs and JSON under $OUT.

Three runs of < 5 min each (parts in priority order, each in its own process with a timeout; a failed
part is reported and the next one runs; the table comes last):
  bench (default): bench_decode on the v41 slice, 4K context, decode in api.generate chunks, one process
         per point: 1 GPU (CUDA_VISIBLE_DEVICES=0) at batch 64, 2 GPUs --mesh expert=2 --layout dp_ep at
         batch 128 (64 per GPU, weak scaling) with --profile (communication per step), then 1 GPU at
         batch 8 and 2 GPUs at batch 16.
  equal: float32 `small` (matmul precision "highest", cache quantization off as in CI), batch 16:
         prefill logits and 8 greedy tokens on 1 GPU vs data=2 (dp), expert=2 (tp_ep), expert=2 (dp_ep):
         max |dlogits| / max |logits| and the first diverging token. GPU: ragged_all_to_all transport.
  extra: the 1-GPU rows again, then dp_ep with the routed experts in one kernel call of 768 rows
         (kernels.WEIGHT_KERNEL_ROWS raised to 1024), dp_ep with the dense all-to-all transport, dp data=2.
  small: `small` at 2K context: 1 GPU batch 16; 2 GPUs dp_ep batch 16 and 32 (profiled); tp_ep batch 16.
  engine: the serving engine (float32 `small` as in `equal`, 8 requests over 4 slots, 16 tokens each) on 1 GPU
         vs on the mesh (dp_ep expert=2, tp_ep expert=2, dp data=2, and dp_ep with DSpark steps where the
         model has draft stages): tokens equal, and the wall time of a second round (compiled) with its tokens/s.
Dry run of `equal` / `engine` on CPU: I15_PRESET=tiny JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2
"""

import json
import os
import sys
import time

from experiments.device_runs._steps import OUT, step

T0 = time.time()
BUDGET_S = 285
BENCH = ["-m", "experiments.bench_decode", "--context", "4096", "--steps", "10", "--chunk", "8", "--copy-gb", "1"]


def equal_mode():
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    import dsv41_jax as d
    from dsv41_jax import partitioning as S
    from dsv41_jax.sharding import greedy, shard_model

    cfg = d.preset(os.environ.get("I15_PRESET", "small"), dtype="float32", param_dtype="float32", quantize_cache=False, sinkhorn_unroll="rolled")
    b, prompt, steps = 16, 24, 8
    params = d.init_params(cfg, seed=0)
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, prompt))
    lens = np.random.default_rng(1).integers(8, prompt + 1, b)
    cap = prompt + steps + 8

    def timed(m):
        t = time.time()
        return (*greedy(cfg, params, tok, lens, cap, steps, m), time.time() - t)

    ref_logits, ref_toks, s = timed(None)
    print(f"one GPU: {s:.1f} s", flush=True)
    scale = float(np.abs(ref_logits).max())
    for layout, mesh in (("dp_ep", "expert=2"), ("tp_ep", "expert=2"), ("dp", "data=2")):
        if time.time() - T0 > BUDGET_S - 20:
            print(f"{layout} {mesh}: skipped, out of time", flush=True)
            continue
        try:
            m = shard_model(cfg, params, S.make_mesh(cfg, mesh, batch=b, layout=layout), layout, batch=b)
            logits, toks, s = timed(m)
            same = (toks == ref_toks).all(0)
            row = dict(layout=layout, mesh=mesh, rel_logit_err=float(np.abs(logits - ref_logits).max()) / scale,
                       tokens_equal=bool(same.all()), first_diverging_step=None if same.all() else int(np.argmin(same)),
                       seconds=s)
        except Exception as e:  # noqa: BLE001 -- report and go on with the next layout
            row = dict(layout=layout, mesh=mesh, error=f"{type(e).__name__}: {e}"[:300])
        print(json.dumps(row), flush=True)
        with open(os.path.join(OUT, "equal.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def engine_mode():
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    import dsv41_jax as d
    from dsv41_jax.serving import Engine, EngineConfig, Request

    cfg = d.preset(os.environ.get("I15_PRESET", "small"), dtype="float32", param_dtype="float32", quantize_cache=False,
                   sinkhorn_unroll="rolled")
    params = d.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    reqs = [Request(rng.integers(0, cfg.vocab_size, int(n)), max_new_tokens=16) for n in rng.integers(20, 120, 8)]

    def served(**mesh):
        eng = Engine(cfg, params, EngineConfig(slots=4, capacity=256, prefill_chunk=64, progress=False, **mesh))
        eng.generate(reqs)  # compiles
        t = time.time()
        out = eng.generate(reqs)
        return [r.tokens for r in out], time.time() - t

    want, s = served()
    rows = [dict(layout="one GPU", mesh="-", tokens_equal=True, seconds=s)]
    runs = [(layout, mesh, None) for layout, mesh in (("dp_ep", "expert=2"), ("tp_ep", "expert=2"), ("dp", "data=2"))]
    for layout, mesh, spec in runs + ([("dp_ep", "expert=2", "dspark")] if cfg.has_dspark else []):
        if spec:
            layout += " + DSpark steps"
        if time.time() - T0 > BUDGET_S - 30:
            rows.append(dict(layout=layout, mesh=mesh, error="skipped, out of time"))
            continue
        try:
            toks, s = served(mesh=mesh, layout=layout.split()[0], speculative=spec)
            rows.append(dict(layout=layout, mesh=mesh, tokens_equal=toks == want, seconds=s,
                             first_diverging_request=next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), None)))
        except Exception as e:  # noqa: BLE001 -- report and go on with the next layout
            rows.append(dict(layout=layout, mesh=mesh, error=f"{type(e).__name__}: {e}"[:300]))
        print(json.dumps(rows[-1]), flush=True)
    n_tokens = sum(len(t) for t in want)
    for r in rows:
        r["tokens_per_s"] = n_tokens / r["seconds"] if "seconds" in r else None
        with open(os.path.join(OUT, "engine.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")


def part(name: str, argv: list[str], timeout: int, env: dict | None = None) -> None:
    left = BUDGET_S - (time.time() - T0)
    if left < 30:
        print(f"[{name}] skipped: {left:.0f} s of the budget left", flush=True)
        return
    step(name, argv, min(timeout, left), env)


def with_setting(setting: str, args: list[str]) -> list[str]:
    """python -c: apply `setting` (module attribute) before bench_decode runs."""
    return ["-c", f"{setting}; from experiments.bench_decode import main; main({args!r})"]


def load(name):
    try:
        with open(os.path.join(OUT, f"{name}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def jsonl(name: str) -> list[dict]:
    try:
        return [json.loads(line) for line in open(os.path.join(OUT, f"{name}.jsonl"))]
    except OSError:
        return []


def layout_table(title: str, rows: list[dict], columns: tuple, cells) -> None:
    """A markdown table of rows per (layout, mesh): cells(row) -> the columns' values, or the row's error."""
    if not rows:
        return
    print(f"\n## {title}\n| layout | mesh | " + " | ".join(columns) + " |\n|---|---|" + "---|" * len(columns))
    for r in rows:
        values = (f"error: {r['error'][:80]}",) + ("",) * (len(columns) - 1) if "error" in r else cells(r)
        print(f"| {r['layout']} | {r['mesh']} | " + " | ".join(map(str, values)) + " |")


def table():
    layout_table("float32 equality, `small`, batch 16, 8 greedy tokens (vs 1 GPU)", jsonl("equal"),
                 ("max|dlogits|/scale", "tokens equal", "first diverging step", "s"),
                 lambda r: (f"{r['rel_logit_err']:.2e}", r["tokens_equal"], r["first_diverging_step"], f"{r['seconds']:.0f}"))
    layout_table("the serving engine, float32 `small`, 8 requests over 4 slots, 16 tokens each (vs 1 GPU)",
                 jsonl("engine"), ("tokens equal", "first diverging request", "second round s", "tokens/s"),
                 lambda r: (r["tokens_equal"], r.get("first_diverging_request"), f"{r['seconds']:.2f}",
                            f"{r['tokens_per_s']:.0f}"))
    one = {(r["preset"], r["batch"]): r for name in ("one_b64", "one_b8", "small_one") for r in load(name)}
    print("\n## decode in api.generate chunks (vs 1 GPU at the same batch per GPU: weak scaling)")
    print("| run | preset | batch/GPU | ms/step | tokens/s | vs 1 GPU | comm us/step/GPU | comm/busy | comm/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    for name in ("one_b64", "dp_ep_b128", "one_b8", "dp_ep_b16", "dp_ep_rows1024", "dp_ep_dense", "dp", "small_one",
                 "small_dp_ep", "small_tp_ep"):
        for r in load(name):
            per = r["batch"] // r.get("devices", 1)
            tps = r["batch"] * 1e3 / r["ms_step_loop"]
            base = one.get((r["preset"], per))
            ratio = f"{tps / (base['batch'] * 1e3 / base['ms_step_loop']):.2f}x" if base and r.get("devices", 1) > 1 else "-"
            comm = "-" if r.get("comm_us_step") is None else f"{r['comm_us_step']:.0f}"
            print(f"| {name} | {r['preset']} | {per} | {r['ms_step_loop']:.3f} | {tps:.0f} | {ratio} | {comm} | "
                  f"{pct(r.get('comm_share'))} | {pct(r.get('comm_share_of_step'))} |")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "bench"
    if mode == "equal-child":
        return equal_mode()
    if mode == "engine-child":
        return engine_mode()
    one = lambda b, t: part(f"one_b{b}", BENCH + ["--batch", str(b), "--out", f"{OUT}/one_b{b}.json"], t,
                            {"CUDA_VISIBLE_DEVICES": "0"})
    ep = lambda b, t: part(f"dp_ep_b{b}", BENCH + ["--mesh", "expert=2", "--layout", "dp_ep", "--batch", str(b),
                                                    "--profile", f"{OUT}/prof_dp_ep", "--out", f"{OUT}/dp_ep_b{b}.json"], t)
    mesh = ["--mesh", "expert=2", "--batch", "16", "128"]
    if mode == "bench":  # one process per point: a point that fails or runs out of time loses only itself
        one(64, 80)
        ep(128, 100)
        one(8, 60)
        ep(16, 60)
    elif mode == "equal":
        part("equal", [__file__, "equal-child"], BUDGET_S)
    elif mode == "engine":
        part("engine", [__file__, "engine-child"], BUDGET_S)
    elif mode == "extra":
        one(64, 70)
        part("dp_ep_rows1024", with_setting("import dsv41_jax.kernels as K; K.WEIGHT_KERNEL_ROWS = 1024",
                                            BENCH[2:] + mesh + ["--layout", "dp_ep", "--out", f"{OUT}/dp_ep_rows1024.json"]), 100)
        part("dp_ep_dense", with_setting("import dsv41_jax.expert_parallel as E; E.TRANSPORT = 'dense'",
                                         BENCH[2:] + mesh + ["--layout", "dp_ep", "--out", f"{OUT}/dp_ep_dense.json"]), 100)
        part("dp", BENCH + ["--mesh", "data=2", "--layout", "dp", "--batch", "16", "128", "--out", f"{OUT}/dp.json"], 90)
    elif mode == "small":  # the first measurement: `small`, 1 GPU vs 2 (strong and weak scaling)
        small = BENCH + ["--preset", "small", "--context", "2048"]
        part("small_one", small + ["--batch", "16", "--out", f"{OUT}/small_one.json"], 90, {"CUDA_VISIBLE_DEVICES": "0"})
        part("small_dp_ep", small + ["--mesh", "expert=2", "--layout", "dp_ep", "--batch", "16", "32", "--profile",
                                     f"{OUT}/prof_small", "--out", f"{OUT}/small_dp_ep.json"], 120)
        part("small_tp_ep", small + ["--mesh", "expert=2", "--layout", "tp_ep", "--batch", "16", "--out",
                                     f"{OUT}/small_tp_ep.json"], 70)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} [bench|equal|extra|small|engine]")
    print(f"total {time.time() - T0:.0f} s")
    table()


if __name__ == "__main__":
    main()
