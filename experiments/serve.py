"""An OpenAI-compatible HTTP server over the serving engine (dsv41_jax/serving/http.py).

    python -m experiments.serve                                   # tiny preset, random weights, port 8000
    python -m experiments.serve --preset small --slots 8 --capacity 2048 --cache-dir /tmp/kv
    python -m experiments.serve --checkpoint DIR --port 8000 --max-queue 256
    python -m experiments.serve --cache-dir /shared/kv --window-store redis://storehost:6379/0   # one of several
    python -m experiments.serve --cache-dir /shared/kv --window-store mooncake://storehost:50051  # (Mooncake Store)

    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'

Random-weight presets use the byte tokenizer and a simple chat template ("<|role|>\\ncontent\\n" per
message, then "<|assistant|>\\n"); a checkpoint brings its tokenizer.json and the `chat_template` of its
tokenizer_config.json. The model name clients pass is --model-name (default: the preset, or the
checkpoint directory's name).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import dsv41_jax as d
from experiments import _cli
from experiments.decode import (WARM_PATHS, check_memory, engine_config, load_weights, model_config,
                               random_engine_params, tokenizer)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(d.PRESETS))
    ap.add_argument("--checkpoint", help="a released checkpoint directory (its tokenizer.json and chat template)")
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: the checkpoint's, else byte-level)")
    ap.add_argument("--model-name", help="the model id clients send (default: preset or checkpoint name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--slots", type=int, default=4, help="requests decoded together (one compiled batch)")
    ap.add_argument("--hbm-budget-gb", type=float, help="derive the slot count from this cache budget instead")
    ap.add_argument("--capacity", type=int, default=512, help="cache tokens per slot: prompt + max_tokens of a "
                    "request must fit")
    ap.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more are "
                    "answered 429")
    ap.add_argument("--decode-chunk", type=int, default=8, help="decode steps per compiled call: larger is "
                    "faster, smaller lets new requests join (and cancelled ones leave) sooner")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights of a preset")
    ap.add_argument("--no-quantize-cache", action="store_true", help="raw cache instead of FP4/FP8")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the preset's)")
    ap.add_argument("--weight-format", choices=["float", "fp8"], help="random weights of a --preset as floats (the "
                    "preset's default) or in the released formats (fp8: FP8 projections, packed FP4 experts)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "jnp", "pallas"])
    ap.add_argument("--engram-on-host", action="store_true",
                    help="with --checkpoint: keep the Engram tables in host memory (pinned_host)")
    eng = ap.add_argument_group("prefix reuse", WARM_PATHS)
    eng.add_argument("--cache-dir", help="persistent page store for prompt prefixes (a writable directory, created "
                     "if missing); without it nothing is reused")
    eng.add_argument("--prefill-chunk", type=int, default=256)
    eng.add_argument("--page-tokens", type=int, default=64)
    eng.add_argument("--retention-hours", type=float, default=72.0)
    eng.add_argument("--host-pool-gb", type=float, help="window pool size (default: 10%% of host memory)")
    eng.add_argument("--host-ttl-s", type=float, default=300.0)
    eng.add_argument("--window-store", help="keep the window pool in this Redis / Valkey server (redis://host:port/db "
                     "or unix:///path.sock) or Mooncake Store (mooncake://master_host:port; this server adds "
                     "--host-pool-gb of its memory to it) instead of in this process, shared by every server of the "
                     "same weights and --cache-dir: a prefix one served is an exact restore on another; a store that "
                     "is down is a miss (bounded replay)")
    eng.add_argument("--no-prefix-reuse", action="store_true", help="never read the tiers (cold every time)")
    eng.add_argument("--no-bounded-replay", "--no-replay", dest="no_replay", action="store_true",
                     help="on a disk hit without window state recompute the whole prompt (exact, slower)")
    eng.add_argument("--no-bounded-prefill", action="store_true", help="run every layer on every prompt token")
    ap.add_argument("--mesh", help="serve on a device mesh, axis=size pairs over data/tensor/expert, e.g. "
                    "data=2,expert=4 --layout dp_ep (product = device count; the layout's sequence axes must divide "
                    "--slots)")
    ap.add_argument("--layout", default="tp_ep", choices=["tp_ep", "dp", "dp_ep"], help="sharding rules for --mesh")
    # decode's model_config / load_weights / check_memory also serve its --run, which this CLI lacks
    ap.set_defaults(run=None)
    args = ap.parse_args(argv)
    for flag, value, low in (("--port", args.port, 0), ("--slots", args.slots, 1), ("--max-queue", args.max_queue, 0),
                             ("--decode-chunk", args.decode_chunk, 1), ("--capacity", args.capacity, 2),
                             ("--prefill-chunk", args.prefill_chunk, 1)):
        if value < low:
            ap.error(f"{flag} must be >= {low}, got {value}")
    if args.engram_on_host and not args.checkpoint:
        ap.error("--engram-on-host applies to --checkpoint (presets have random in-memory tables)")
    if args.weight_format and args.checkpoint:
        ap.error("--weight-format applies to a --preset's random weights (a checkpoint has its own)")
    return args


def build_server(args):
    """The `Server` of the flags: every check first (one `error:` line), then weights and engine."""
    from dsv41_jax.serving import Engine
    from dsv41_jax.serving.http import Server
    from dsv41_jax.serving.text import load_chat_template
    from dsv41_jax.tiers.window_store import check_url

    cfg = model_config(args)
    tok = tokenizer(args, cfg)
    if args.capacity > cfg.max_seq_len:
        raise _cli.UserError(f"--capacity {args.capacity}: exceeds the model's max_seq_len of {cfg.max_seq_len}")
    ecfg = engine_config(args, cfg, args.capacity, args.slots)
    if args.window_store and not args.cache_dir:
        raise _cli.UserError("--window-store: needs --cache-dir (the window pool holds the state at prefixes whose "
                             "pages are on disk)")
    if args.window_store:
        try:
            check_url(args.window_store)
        except ValueError as e:
            raise _cli.UserError(f"--window-store {e}") from None
    ecfg = dataclasses.replace(ecfg, slots=None if args.hbm_budget_gb else args.slots, decode_chunk=args.decode_chunk,
                               window_store=args.window_store)
    try:
        template = load_chat_template(args.checkpoint)
    except ValueError as e:
        raise _cli.UserError(f"--checkpoint: {e}") from None
    if args.cache_dir:
        _cli.writable_dir(args.cache_dir, "--cache-dir")
    check_memory(args, cfg, 0, args.capacity)  # the engine sizes its cache to the memory left
    cfg, params = load_weights(args, cfg)
    if params is None:
        params = random_engine_params(args, cfg, ecfg)
    name = args.model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint else args.preset)
    try:
        engine = Engine(cfg, params, ecfg)
    except (ImportError, ConnectionError) as e:  # the window store's client is missing, or its store unreachable
        if not args.window_store:
            raise
        raise _cli.UserError(f"--window-store {e}") from None
    return Server(engine, tok, name, args.max_queue, template)


@_cli.entry_point
def main(argv=None) -> None:
    import uvicorn

    args = parse_args(argv)
    server = build_server(args)
    print(f"[serve] model {server.model_name!r}: {server.engine.n_slots} slots x {args.capacity} tokens, "
          f"queue {args.max_queue}" + (f", mesh {args.mesh} layout {args.layout}" if args.mesh else "")
          + f"; http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
