"""Cost of the sharded code path against the plain one, on the devices at hand.

    python -m experiments.bench_sharding [--preset small] [--mesh data=1] [--batch 8] [--steps 64]

Times the decode step of `api.decode_step` without and with a mesh placement
(`sharding.ShardedModel.decode_step`, the same checked call with `placement=`) on the same params and
prompts and checks their logits agree. The two paths alternate in --rounds rounds of
--steps steps each (warm-up excluded): a slow phase of the shared machine then hits both, and the
overhead is the median over rounds of (sharded median / plain median) - 1.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import dsv41_jax as d
from dsv41_jax import partitioning as S
from dsv41_jax.sharding import shard_model
from experiments import _cli


def _median_step(step, cache, tokens, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits, cache = step(cache, tokens)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), logits


@_cli.entry_point
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(d.PRESETS))
    ap.add_argument("--mesh", default=f"data={len(jax.devices())}")
    ap.add_argument("--layout", default="tp_ep", choices=sorted(S.LAYOUTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="steps per round and path")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sinkhorn", default="auto", choices=["auto", "unrolled", "rolled"],
                    help="ModelConfig.sinkhorn_unroll (rolled: much shorter compiles on GPU)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if min(a.batch, a.prompt, a.steps, a.rounds) < 1:
        ap.error("--batch, --prompt, --steps and --rounds must be >= 1")
    cfg = d.preset(a.preset, sinkhorn_unroll=a.sinkhorn)
    try:  # before the parameters exist: `small` takes a while to initialize
        S.check_mesh(cfg, S.parse_mesh(a.mesh), batch=a.batch, layout=a.layout)
    except S.MeshError as e:
        raise _cli.UserError(f"--mesh {a.mesh}: {e}") from None
    if a.prompt + a.steps + 8 > cfg.max_seq_len:
        raise _cli.UserError(f"--prompt {a.prompt} + --steps {a.steps}: more tokens than {a.preset}'s max_seq_len "
                             f"({cfg.max_seq_len})")
    _cli.output_file(a.out, "--out")
    params = d.init_params(cfg)
    cap = a.prompt + a.steps + 8
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.prompt))
    lens = np.full((a.batch,), a.prompt)
    nxt = np.asarray(tok[:, 0], np.int32)

    _, c_plain = d.prefill(cfg, params, d.init_cache(cfg, a.batch, cap), tok, lens)
    plain = lambda c, t: d.decode_step(cfg, params, c, t, validate=False)
    m = shard_model(cfg, params, S.make_mesh(cfg, a.mesh, batch=a.batch, layout=a.layout), a.layout, batch=a.batch)
    _, c_shard = m.prefill(m.init_cache(cap), tok, lens)
    sharded = lambda c, t: m.decode_step(c, t, validate=False)
    _median_step(plain, c_plain, nxt, 3)  # compile + warm-up
    _median_step(sharded, c_shard, nxt, 3)
    rounds = []
    for r in range(a.rounds):  # ABAB..., then BABA...: neither path always runs first
        order = [("plain", plain, c_plain), ("sharded", sharded, c_shard)][:: 1 if r % 2 == 0 else -1]
        got = {name: _median_step(f, c, nxt, a.steps) for name, f, c in order}
        rounds.append({k: 1e3 * v[0] for k, v in got.items()})
    diff = float(np.abs(np.asarray(got["plain"][1]) - np.asarray(got["sharded"][1])).max())
    scale = float(np.abs(np.asarray(got["plain"][1])).max())  # what the difference is relative to
    ratios = [x["sharded"] / x["plain"] for x in rounds]
    row = dict(preset=a.preset, mesh=a.mesh, layout=a.layout, batch=a.batch, devices=len(jax.devices()),
               plain_ms=float(np.median([x["plain"] for x in rounds])),
               sharded_ms=float(np.median([x["sharded"] for x in rounds])),
               overhead=float(np.median(ratios)) - 1, overhead_min=min(ratios) - 1, overhead_max=max(ratios) - 1,
               rounds=rounds, max_logit_diff=diff, logit_scale=scale)
    print(f"{'round':>5s} {'plain ms':>9s} {'sharded ms':>10s} {'ratio':>6s}")
    for i, x in enumerate(rounds):
        print(f"{i:5d} {x['plain']:9.3f} {x['sharded']:10.3f} {x['sharded'] / x['plain']:6.3f}")
    print(f"overhead of the sharded path: median {100 * row['overhead']:+.1f}% (rounds {100 * row['overhead_min']:+.1f}"
          f"% .. {100 * row['overhead_max']:+.1f}%)   max |dlogit| {diff:.2e} (logit scale {scale:.2f})")
    if a.out:
        json.dump(row, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
