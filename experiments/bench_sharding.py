"""Cost of the sharded code path against the plain one, on the devices at hand.

    python -m experiments.bench_sharding [--preset small] [--mesh data=1] [--batch 8] [--steps 64]

Times the decode step of `api.decode_step` and of `sharding.ShardedModel.decode_step` on the same
params and prompts (warm-up excluded, median of per-step times) and checks their logits agree.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import dsv41_jax as d
from dsv41_jax import sharding as S


def _median_step(step, cache, tokens, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits, cache = step(cache, tokens)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), logits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(d.PRESETS))
    ap.add_argument("--mesh", default=f"data={len(jax.devices())}")
    ap.add_argument("--layout", default="tp_ep", choices=sorted(S.LAYOUTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    cfg = d.preset(a.preset)
    params = d.init_params(cfg)
    cap = a.prompt + a.steps + 8
    tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.prompt))
    lens = np.full((a.batch,), a.prompt)
    nxt = np.asarray(tok[:, 0], np.int32)

    _, c_plain = d.prefill(cfg, params, d.init_cache(cfg, a.batch, cap), tok, lens)
    plain = lambda c, t: d.decode_step(cfg, params, c, t, validate=False)
    m = S.shard_model(cfg, params, S.make_mesh(cfg, a.mesh, batch=a.batch), a.layout, batch=a.batch, capacity=cap)
    _, c_shard = m.prefill(m.place_cache(d.init_cache(cfg, a.batch, cap)), tok, lens)
    sharded = lambda c, t: m.decode_step(c, t)
    _median_step(plain, c_plain, nxt, 3)  # compile + warm-up
    _median_step(sharded, c_shard, nxt, 3)
    t_plain, l_plain = _median_step(plain, c_plain, nxt, a.steps)
    t_shard, l_shard = _median_step(sharded, c_shard, nxt, a.steps)
    t_plain2, _ = _median_step(plain, c_plain, nxt, a.steps)  # again, to see the run-to-run noise
    diff = float(np.abs(np.asarray(l_plain) - np.asarray(l_shard)).max())
    row = dict(preset=a.preset, mesh=a.mesh, layout=a.layout, batch=a.batch, devices=len(jax.devices()),
               plain_ms=1e3 * t_plain, plain_again_ms=1e3 * t_plain2, sharded_ms=1e3 * t_shard,
               overhead=t_shard / min(t_plain, t_plain2) - 1, max_logit_diff=diff)
    print(f"{'path':10s} {'ms/step':>9s}\n{'plain':10s} {row['plain_ms']:9.3f}\n{'plain (2)':10s} "
          f"{row['plain_again_ms']:9.3f}\n{'sharded':10s} {row['sharded_ms']:9.3f}\n"
          f"overhead of the sharded path: {100 * row['overhead']:+.1f}%   max |dlogit| {diff:.2e}")
    if a.out:
        json.dump(row, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
