"""How many serial steps the top-k kernels' threshold search takes (`kernels_pallas.decode.kth_search`, the search
both select kernels run): rows of distinct scores (normal, |normal|, lognormal) and rows tied at the k-th
(normal rounded to halves), on the CPU. Each step is one count over the row, a block reduction in the GPU kernel
(the 32 steps over a row of 8192 lanes took 17.4 us of the kernel on the H200, docs/BENCHMARKS.md eighteenth
pass), so the steps are most of the search's serial time.

    python -m experiments.select_steps [--n 4352] [--k 512] [--rows 8]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments._cli import entry_point
from kernels_pallas import decode

KINDS = {
    "normal": lambda rng, n: rng.normal(size=n),
    "abs normal": lambda rng, n: np.abs(rng.normal(size=n)),
    "lognormal": lambda rng, n: rng.lognormal(size=n),
    "normal rounded to 0.5 (ties)": lambda rng, n: np.round(rng.normal(size=n) * 2) / 2,
}


def steps(kind: str, n: int, k: int, rows: int, seed: int = 0) -> list[int]:
    """Steps of the search on `rows` random rows of `kind` (the floor of a single-level row: -inf's key)."""
    rng = np.random.default_rng(seed)
    search = jax.jit(decode.kth_search, static_argnums=1)
    keys = [decode.ordered_key(jnp.asarray(KINDS[kind](rng, n), jnp.float32)) for _ in range(rows)]
    return [int(search(key, k, jnp.int32(decode.NEG_INF_KEY))[0]) for key in keys]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4352, help="entries a row (the slice's top-512 row at 4K: 4352)")
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--rows", type=int, default=8)
    return p.parse_args(argv)


@entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    out = {kind: steps(kind, args.n, args.k, args.rows) for kind in KINDS}
    print(f"rows of {args.n}, k = {args.k}, {args.rows} rows a kind: search steps (of 32)\n")
    print("| row | steps per row | median |\n|---|---|---|")
    for kind, s in out.items():
        print(f"| {kind} | {', '.join(map(str, s))} | {np.median(s):.0f} |")
    return out


if __name__ == "__main__":
    main()
