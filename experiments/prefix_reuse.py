"""What prefix reuse buys and costs: TTFT cold vs warm (window restored from the host pool) vs warm
with bounded replay (disk pages only), bytes per token moved on each tier, and the drift of replay.

    python -m experiments.prefix_reuse                                   # tiny, CPU
    python -m experiments.prefix_reuse --preset small --lengths 1024 4096 16384 --output-json pr.json

For every prompt length L (random ids, one engine configuration so everything compiles once, after a
warm-up request): a cold request writes the prompt's pages and window; the same request again on that
engine is a warm hit with the window in the host pool; a second engine on the same directory (empty
host pool) is a warm hit that replays the last window. Drift is teacher-forced: the cold state and the
replayed state decode the cold run's own greedy tokens side by side (two slots of one batch), and we
report the largest logit difference and how often the two argmaxes agree over --drift-tokens steps.
Random-weight presets: the drift of a trained model is not implied by these numbers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax as d
from dsv41_jax import api
from dsv41_jax.serving import Engine, EngineConfig, Request
from dsv41_jax.serving import slots as rows
from dsv41_jax.tiers import block_chain


def drift(cold_eng: Engine, replay_eng: Engine, prompt: np.ndarray, forced: list[int]) -> dict:
    """Teacher-forced comparison of the cold state (slot 0) and the replayed state (slot 1)."""
    eng, pt = replay_eng, replay_eng.ecfg.page_tokens
    n = prompt.size
    split = (n - 1) // pt * pt
    # the cold engine's own split (prefix, then the rest) so the cold state has the bytes a cold request has
    _, cold_row = cold_eng._chunks(jax.device_put(cold_eng._empty_row), prompt, 0, split, "cold")
    _, cold_row = cold_eng._chunks(cold_row, prompt, split, n, "cold")
    keys = block_chain(eng.fp, prompt[:split], pt)
    m = {}
    row, start, exact = eng._restore(prompt, keys, m)
    assert m.get("replayed_tokens") and not exact, f"expected a replay, got {m}"
    _, row = eng._chunks(row, prompt, start, n, "rest")
    cache = rows.put_row(rows.put_row(eng.cache, 0, cold_row), 1, row)
    active = jnp.asarray([True, True] + [False] * (eng.n_slots - 2))
    worst, agree = 0.0, 0
    for t in forced:
        tok = jnp.full((eng.n_slots,), t, jnp.int32)
        logits, cache = api.decode_step(eng.cfg, eng.params, cache, tok, active, validate=False)
        lg = np.asarray(logits[:2])
        worst = max(worst, float(np.abs(lg[0] - lg[1]).max()))
        agree += int(lg[0].argmax() == lg[1].argmax())
    return dict(max_abs_logit_diff=worst, greedy_agreement=agree / len(forced), steps=len(forced))


def measure(args) -> list[dict]:
    cfg = d.preset(args.preset)
    params = d.init_params(cfg, seed=args.seed)
    cap = -(-(max(args.lengths) + args.drift_tokens + 1) // args.chunk) * args.chunk
    root = args.cache_dir or tempfile.mkdtemp(prefix="prefix_reuse_")
    mk = lambda: Engine(cfg, params, EngineConfig(slots=2, capacity=cap, prefill_chunk=args.chunk,
                                                  page_tokens=args.page_tokens, cache_dir=root, progress=False))
    rng = np.random.default_rng(args.seed)
    warm_up = mk()
    warm_up.generate([Request(rng.integers(0, cfg.vocab_size, 2 * args.page_tokens + 3), max_new_tokens=2)])
    out = []
    for n in args.lengths:
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        eng = mk()
        cold = eng.generate([Request(prompt, max_new_tokens=args.drift_tokens)])[0]
        warm = eng.generate([Request(prompt, max_new_tokens=1)])[0]
        replay_eng = mk()
        replay = replay_eng.generate([Request(prompt, max_new_tokens=1)])[0]
        assert warm.tokens[0] == cold.tokens[0]
        cm, wm, rm = cold.metrics, warm.metrics, replay.metrics
        row = dict(
            prompt_tokens=n, reused_tokens=wm["reused_tokens"], replayed_tokens=rm["replayed_tokens"],
            ttft_cold_s=cm["ttft_s"], ttft_warm_window_s=wm["ttft_s"], ttft_warm_replay_s=rm["ttft_s"],
            disk_written_B_per_token=cm["disk_bytes_written"] / max(wm["reused_tokens"], 1),
            disk_read_B_per_token=wm["disk_bytes_read"] / max(wm["reused_tokens"], 1),
            host_written_B_per_seq=cm["host_bytes_written"], host_read_B_per_seq=wm["host_bytes_read"],
            host_read_B_per_token=wm["host_bytes_read"] / max(wm["reused_tokens"], 1),
            warm_window_first_token_exact=bool(np.array_equal(warm.first_logits, cold.first_logits)),
            replay_first_logit_max_diff=float(np.abs(replay.first_logits - cold.first_logits).max()),
            logit_scale=float(np.abs(cold.first_logits).max()),
        )
        row.update({f"replay_{k}": v for k, v in drift(eng, mk(), prompt, cold.tokens).items()})
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def markdown(rows_: list[dict], args) -> str:
    head = ("| prompt | reused | TTFT cold | warm+window | warm+replay | disk W B/tok | disk R B/tok | "
            "host R B/seq | replay max dlogit (scale) | greedy agree / " + str(args.drift_tokens) + " |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['prompt_tokens']} | {r['reused_tokens']} | {1e3 * r['ttft_cold_s']:.1f} ms | "
        f"{1e3 * r['ttft_warm_window_s']:.1f} ms | {1e3 * r['ttft_warm_replay_s']:.1f} ms | "
        f"{r['disk_written_B_per_token']:.1f} | {r['disk_read_B_per_token']:.1f} | {r['host_read_B_per_seq']:,d} | "
        f"{r['replay_max_abs_logit_diff']:.3f} ({r['logit_scale']:.2f}) | {100 * r['replay_greedy_agreement']:.1f}% |\n"
        for r in rows_)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--drift-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk width")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--cache-dir", help="page store directory (default: a fresh temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = measure(args)
    print(f"\n{args.preset} on {jax.default_backend()} ({time.perf_counter() - t0:.0f} s)\n")
    print(markdown(res, args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(preset=args.preset, backend=jax.default_backend(), rows=res), f, indent=2)
    return res


if __name__ == "__main__":
    main()
