"""Host time of passing the params to a jitted call: the nnx.State as loaded vs `dsv41_jax.freeze`'s.

    python -m experiments.bench_dispatch                     # tiny, 200 calls each
    python -m experiments.bench_dispatch --preset small

A jitted call flattens its arguments before dispatch; an nnx.State flattens every Variable through a
Python callback, frozen params are one node over their arrays. Rows: a jitted call that ignores its
params (the passing alone) and one donated `decode_step` at batch 1 synced per call (what a caller of
`decode_step` pays per token), median over `--calls` after 10 warm-up calls, the two forms interleaved.
Last, one flatten of the v41 slice's params in both forms (abstract arrays: nothing is allocated).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import dsv41_jax as d
from experiments.bench_decode import slice_config


def _median_ms(call, n: int) -> float:
    times = []
    for _ in range(n + 10):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[10:])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    cfg = d.preset(args.preset)
    state = d.init_params(cfg, seed=0)
    forms = {"nnx.State": state, "frozen": d.freeze(state)}
    ignore = jax.jit(lambda params: 0)
    tok = np.array([3], np.int32)
    rounds, per_round = 3, max(1, args.calls // 3)
    steps = 1 + rounds * (per_round + 10)  # decode steps per form: room for every one in the cache
    capacity = -(-steps // 64) * 64
    if capacity > cfg.max_seq_len:
        ap.error(f"--calls {args.calls}: {steps} decode steps exceed {args.preset}'s max_seq_len {cfg.max_seq_len}")
    caches = {name: d.init_cache(cfg, 1, capacity) for name in forms}

    def step(name):
        logits, caches[name] = d.decode_step(cfg, forms[name], caches[name], tok, validate=False, donate=True)
        logits.block_until_ready()

    rows = []
    for op, run in (("jitted call that ignores the params", lambda name: ignore(forms[name])),
                    ("decode_step, batch 1, synced", step)):
        for name in forms:  # compile
            run(name)
        ms = {name: [] for name in forms}
        for _ in range(rounds):  # interleaved, so that a slow stretch of a shared machine hits both forms
            for name in forms:
                ms[name].append(_median_ms(lambda: run(name), per_round))
        rows.append(dict(op=op, **{name: statistics.median(v) for name, v in ms.items()}))
    print(f"\n{args.preset}: {len(jax.tree.leaves(state))} parameter arrays, backend {jax.default_backend()}\n")
    print("| call | nnx.State ms | frozen ms | saved ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['nnx.State']:.3f} | {r['frozen']:.3f} | {r['nnx.State'] - r['frozen']:.3f} |")
    sliced = d.abstract_params(slice_config())
    us = {name: 1e3 * _median_ms(lambda: jax.tree.flatten(p), args.calls)
          for name, p in (("nnx.State", sliced), ("frozen", d.freeze(sliced)))}
    print(f"\nv41-slice ({len(jax.tree.leaves(sliced))} arrays), one flatten: {us['nnx.State']:.0f} us as the "
          f"nnx.State, {us['frozen']:.0f} us frozen")
    return rows


if __name__ == "__main__":
    main()
