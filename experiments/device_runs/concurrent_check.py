"""Does the api's command-buffer scheduling (`compile_options.GPU_OPTIONS`: CONCURRENT, graph kernels ordered by their
data dependencies only) compute what XLA's default order computes? The v41 slice with random weights in the
released formats (FP8 projections, FP4 experts) and a random 4K cache, greedy `api.generate` for 2 calls of 20
steps from the same inputs, once through the api and once through the same function jitted without the options;
the sampled tokens and every cache array after the 40 steps are compared bit for bit (every kernel of the step is
deterministic at these batch sizes).

    PYTHONPATH=. python3 -m experiments.device_runs.concurrent_check           # ~2.5 min on one H200
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import api, compile_options
from experiments.bench_decode import random_cache, random_params, slice_config

STEPS, CALLS, CONTEXT = 20, 2, 4096


def run(gen, cfg, params, cache, tokens):
    out = []
    for _ in range(CALLS):
        toks, _, cache = gen(cfg, params, cache, tokens, STEPS, kernels="auto", validate=False)
        tokens = toks[:, -1]
        out.append(np.asarray(toks))
    return np.concatenate(out, axis=1), cache


def main(batches=(1, 8)) -> int:
    cfg = slice_config(weight_format="fp8")  # as bench_decode runs it
    params = api.freeze(random_params(cfg))
    plain = jax.jit(api._generate, static_argnames=api._GENERATE_STATIC, donate_argnames=("cache",))

    def generate_plain(*args, **kwargs):
        saved, api._generate_jit = api._generate_jit, plain
        try:
            return api.generate(*args, **kwargs)
        finally:
            api._generate_jit = saved

    opts = compile_options.options(jax.default_backend(), os.environ.get("XLA_FLAGS", ""))
    print(f"options {opts}; {CALLS} calls of {STEPS} steps, context {CONTEXT}", flush=True)
    print("| batch | tokens equal | cache arrays | arrays differing | elements differing |\n|---|---|---|---|---|")
    failed = 0
    for b in batches:
        tokens = jax.random.randint(jax.random.key(2), (b,), 0, cfg.vocab_size)
        base = random_cache(cfg, b, CONTEXT)
        got = {}
        for name, gen in (("plain", generate_plain), ("api", api.generate)):
            got[name] = run(gen, cfg, params, jax.tree.map(jnp.copy, base), tokens)
        (t0, c0), (t1, c1) = got["plain"], got["api"]
        diffs = [int(np.sum(np.asarray(a) != np.asarray(c))) for a, c in zip(jax.tree.leaves(c0), jax.tree.leaves(c1))]
        same = bool(np.array_equal(t0, t1))
        failed += (not same) or any(diffs)
        print(f"| {b} | {same} | {len(diffs)} | {sum(d > 0 for d in diffs)} | {sum(diffs)} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
