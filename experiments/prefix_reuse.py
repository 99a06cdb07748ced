"""What prefix reuse and decoder-side bounded prefill buy and cost: time to first token cold (exact and
bounded prefill) vs warm (window restored from the host pool) vs warm with bounded replay (disk pages
only), bytes per token moved on each tier, and how far bounded prefill and replay drift from the exact
cold run.

    python -m experiments.prefix_reuse                                   # tiny, CPU
    python -m experiments.prefix_reuse --preset small --lengths 1024 8192 32768 131072 --chunk 2048 \\
        --output-json pr.json                                            # one GPU

For every prompt length n (random ids; every engine shares one cache capacity and chunk width, so each
program compiles once, during a warm-up prompt that takes every path):
- cold exact: an engine with bounded_prefill=False on a fresh page-store directory;
- cold bounded: an engine with the default bounded prefill on another fresh directory; each cold run
  writes the prompt's pages and the window at its last page boundary;
- warm+window: the same prompt again on that engine (host-pool hit; bit-equal to its cold run on CPU,
  not in the H200 run, where the prompt's tail is a chunk of its own rather than part of a longer one,
  and bf16 matmuls of other shapes may round differently);
- warm+replay: a second engine on the same directory (empty host pool): disk hit, bounded replay.
TTFT is the wall time of `Engine.prefill` (tier reads and writes included) to the first token's logits.
Drift is teacher-forced: the exact, bounded, host-pool-restored and replayed states decode the exact
run's own greedy tokens side by side (four slots of one batch) for --drift-tokens steps (the prefill
logits count as the first), and we report the largest logit difference and how often the argmaxes
agree, for each pair in `PAIRS`. Random-weight presets: the drift of a trained model is not implied by
these numbers.
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
from dsv41_jax.serving import Engine, EngineConfig, plan_slots
from dsv41_jax.serving import slots as rows
from experiments import _cli

STATES = ("exact", "bounded", "window", "replay")  # slot order of the teacher-forced drift batch
# (state, reference) pairs whose drift is reported: each approximation against the exact run, and the
# host-pool restore against the cold bounded run it restores (bit-equal on CPU, not on the H200)
PAIRS = (("bounded", "exact"), ("replay", "exact"), ("window", "bounded"))


def timed_prefill(eng: Engine, prompt: np.ndarray):
    """(seconds, logits f32 [1, V], device row, metrics) of one prompt through the engine's tiers."""
    t0 = time.perf_counter()
    logits, row, m = eng.prefill(prompt)
    jax.block_until_ready((logits, row))
    return time.perf_counter() - t0, logits, row, m


def drift(eng: Engine, logits: list, states: list, steps: int) -> dict:
    """Teacher-forced decode of the states (slots of `eng`, in `STATES` order) on the exact state's greedy
    tokens.

    logits: the prefill logits [1, V] of each state. Returns {(state, reference): (max |dlogit|, greedy
    agreement)} for `PAIRS`, over `steps` tokens."""
    cache = jax.tree.map(jnp.copy, eng.cache)
    for slot, row in enumerate(states):
        cache = rows.put_row(cache, slot, row)
    active = jnp.arange(eng.n_slots) < len(states)
    lg = np.concatenate([np.asarray(x) for x in logits])  # [S, V]
    idx = [(STATES.index(a), STATES.index(b)) for a, b in PAIRS]
    worst, agree = np.zeros(len(PAIRS)), np.zeros(len(PAIRS))
    for step in range(steps):
        for i, (a, b) in enumerate(idx):
            worst[i] = max(worst[i], np.abs(lg[a] - lg[b]).max())
            agree[i] += lg[a].argmax() == lg[b].argmax()
        if step + 1 < steps:
            tok = jnp.full((eng.n_slots,), int(lg[0].argmax()), jnp.int32)
            out, cache = api.decode_step(eng.cfg, eng.params, cache, tok, active, validate=False)
            lg = np.asarray(out[:len(states)])
    return {pair: (float(worst[i]), float(agree[i] / steps)) for i, pair in enumerate(PAIRS)}


def measure_one(mk, prompt: np.ndarray, drift_tokens: int, root: str) -> dict:
    """One prompt through the four paths (see the module docstring); the row of the table."""
    exact_eng = mk(slots=len(STATES), bounded_prefill=False, cache_dir=f"{root}-exact")  # same tier writes
    t_exact, l_exact, r_exact, _ = timed_prefill(exact_eng, prompt)
    cold_eng = mk(cache_dir=root)
    t_bounded, l_bounded, r_bounded, cm = timed_prefill(cold_eng, prompt)
    t_warm, l_warm, r_warm, wm = timed_prefill(cold_eng, prompt)
    t_replay, l_replay, r_replay, rm = timed_prefill(mk(cache_dir=root), prompt)
    if not (wm["host_window_hit"] and rm["replayed_tokens"]):
        raise RuntimeError(f"expected a host-pool hit and a replay, got {wm} and {rm}")
    reused = max(wm["reused_tokens"], 1)
    row = dict(
        prompt_tokens=int(prompt.size), reused_tokens=wm["reused_tokens"], replayed_tokens=rm["replayed_tokens"],
        decoder_prefill_tokens=cm["decoder_prefill_tokens"],
        ttft_cold_exact_s=t_exact, ttft_cold_bounded_s=t_bounded, ttft_warm_window_s=t_warm,
        ttft_warm_replay_s=t_replay,
        disk_written_B_per_token=cm["disk_bytes_written"] / reused,
        disk_read_B_per_token=wm["disk_bytes_read"] / reused,
        host_written_B_per_seq=cm["host_bytes_written"], host_read_B_per_seq=wm["host_bytes_read"],
        warm_window_equals_cold=bool(np.array_equal(np.asarray(l_warm), np.asarray(l_bounded))),
        logit_scale=float(np.abs(np.asarray(l_exact)).max()), drift_tokens=drift_tokens,
    )
    d_ = drift(exact_eng, [l_exact, l_bounded, l_warm, l_replay], [r_exact, r_bounded, r_warm, r_replay], drift_tokens)
    for (name, _), (worst, agree) in d_.items():
        row[f"{name}_max_abs_logit_diff"], row[f"{name}_greedy_agreement"] = worst, agree
    return row


def measure(args) -> list[dict]:
    cfg = d.preset(args.preset)
    params = d.init_params(cfg, seed=args.seed)
    cap = min(-(-(max(args.lengths) + args.drift_tokens + 1) // args.chunk) * args.chunk, cfg.max_seq_len)
    base = args.cache_dir or tempfile.mkdtemp(prefix="prefix_reuse_")

    def mk(slots=1, **kw):
        return Engine(cfg, params, EngineConfig(slots=slots, capacity=cap, prefill_chunk=args.chunk,
                                                page_tokens=args.page_tokens, progress=False,
                                                weights_revision=f"random-seed{args.seed}", **kw))

    rng = np.random.default_rng(args.seed)
    # long enough for every path: an encoder-only chunk before the last window, a replay of a whole window
    warm_up = (cfg.window_size // args.page_tokens + 2) * args.page_tokens + 3
    measure_one(mk, rng.integers(0, cfg.vocab_size, warm_up).astype(np.int32), 2, f"{base}/warm-up")
    out = []
    for n in args.lengths:
        row = measure_one(mk, rng.integers(0, cfg.vocab_size, n).astype(np.int32), args.drift_tokens, f"{base}/{n}")
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def markdown(rows_: list[dict]) -> str:
    ms = lambda s: f"{1e3 * s:.1f} ms"
    head = ("| prompt | reused | decoder-layer tokens | TTFT cold exact | cold bounded | warm+window | warm+replay | "
            "disk W B/tok | disk R B/tok | host R B/seq | bounded: max dlogit, greedy agree | "
            "replay: max dlogit, greedy agree | window vs cold bounded: max dlogit, greedy agree | logit scale |\n|"
            + "---|" * 14 + "\n")
    return head + "".join(
        f"| {r['prompt_tokens']} | {r['reused_tokens']} | {r['decoder_prefill_tokens']} | "
        f"{ms(r['ttft_cold_exact_s'])} | {ms(r['ttft_cold_bounded_s'])} | {ms(r['ttft_warm_window_s'])} | "
        f"{ms(r['ttft_warm_replay_s'])} | {r['disk_written_B_per_token']:.1f} | {r['disk_read_B_per_token']:.1f} | "
        f"{r['host_read_B_per_seq']:,d} | {r['bounded_max_abs_logit_diff']:.4f}, "
        f"{100 * r['bounded_greedy_agreement']:.1f}% | {r['replay_max_abs_logit_diff']:.3f}, "
        f"{100 * r['replay_greedy_agreement']:.1f}% | {r['window_max_abs_logit_diff']:.4f}, "
        f"{100 * r['window_greedy_agreement']:.1f}% | {r['logit_scale']:.2f} |\n"
        for r in rows_)


@_cli.entry_point
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 129, 1024, 1030],
                    help="prompt lengths (just past a page boundary, e.g. 129, the decoder layers see the fewest "
                    "tokens)")
    ap.add_argument("--drift-tokens", type=int, default=256, help="teacher-forced tokens of the drift comparison")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk width")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--cache-dir", help="page store directory (default: a fresh temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    cfg = d.preset(args.preset)
    w = cfg.window_size
    if min(args.lengths) <= w + args.page_tokens or args.drift_tokens < 1 or args.chunk < 1:
        ap.error(f"every length must exceed window + page ({w} + {args.page_tokens}) so that a replay happens, "
                 "and --drift-tokens and --chunk must be >= 1")
    need = max(args.lengths) + args.drift_tokens + 1
    if need > cfg.max_seq_len:
        raise _cli.UserError(f"--lengths {max(args.lengths)}: with --drift-tokens {args.drift_tokens} it needs "
                             f"{need} cache tokens, more than {args.preset}'s max_seq_len ({cfg.max_seq_len})")
    try:
        plan_slots(cfg, EngineConfig(slots=1, capacity=need, page_tokens=args.page_tokens))
    except ValueError as e:
        raise _cli.UserError(f"--page-tokens {args.page_tokens}: {e}") from None
    _cli.output_file(args.output_json, "--output-json")
    if args.cache_dir:
        _cli.writable_dir(args.cache_dir, "--cache-dir")
    t0 = time.perf_counter()
    res = measure(args)
    print(f"\n{args.preset} on {jax.default_backend()} ({time.perf_counter() - t0:.0f} s)\n")
    print(markdown(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(preset=args.preset, backend=jax.default_backend(), rows=res), f, indent=2)
    return res


if __name__ == "__main__":
    main()
