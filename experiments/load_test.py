"""A bounded load test of a running server (experiments.serve): concurrent streaming clients on loopback.

    python -m experiments.serve --preset tiny --slots 16 --max-queue 64 --port 8000 &
    python -m experiments.load_test --url http://127.0.0.1:8000 --clients 64 --requests 2 --max-tokens 32

After one warm-up request (which pays for the compiles), each client sends --requests streaming
completions one after another (prompts of random letters, so prefixes differ). Reports errors (any is a failure: exit status 1), time to first token p50/p99
(from sending the request to the first chunk with a token), generated tokens/s over the wall time, and
the requests' own decode rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time

import numpy as np

from experiments import _cli


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt-chars", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    for flag in ("clients", "requests", "prompt_chars", "max_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


async def client(api, model: str, args, rng: random.Random, out: list, errors: list) -> None:
    for _ in range(args.requests):
        prompt = "".join(rng.choice(string.ascii_letters + " ") for _ in range(args.prompt_chars))
        t0, first, n = time.perf_counter(), None, 0
        try:
            stream = await api.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                  temperature=0.7, seed=rng.randrange(2**32), stream=True,
                                                  extra_body={"ignore_eos": True})
            async for chunk in stream:
                k = len(chunk.choices[0].token_ids)
                if k and first is None:
                    first = time.perf_counter()
                n += k
        except Exception as e:  # every failure counts; the message says which
            errors.append(f"{type(e).__name__}: {e}")
            continue
        end = time.perf_counter()
        out.append(dict(ttft_s=first - t0, tokens=n, total_s=end - t0,
                        decode_tokens_per_s=(n - 1) / (end - first) if n > 1 and end > first else float("nan")))


async def run(args) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        model = (await api.models.list()).data[0].id
    except openai.APIConnectionError:
        raise _cli.UserError(f"--url {args.url}: no server answers there; start one with python -m experiments.serve"
                             ) from None
    out, errors = [], []
    await client(api, model, argparse.Namespace(**{**vars(args), "requests": 1}), random.Random(-1), [], errors)
    if errors:  # the warm-up request (it pays for the compiles) failed: the server cannot serve this load
        raise _cli.UserError(f"--url {args.url}: the warm-up request failed: {errors[0]}")
    t0 = time.perf_counter()
    await asyncio.gather(*(client(api, model, args, random.Random(i), out, errors) for i in range(args.clients)))
    wall = time.perf_counter() - t0
    ttft = np.array([r["ttft_s"] for r in out]) if out else np.array([np.nan])
    return dict(model=model, clients=args.clients, requests=args.clients * args.requests, completed=len(out),
                errors=len(errors), first_errors=errors[:5], wall_s=wall, max_tokens=args.max_tokens,
                prompt_chars=args.prompt_chars, ttft_p50_s=float(np.percentile(ttft, 50)),
                ttft_p99_s=float(np.percentile(ttft, 99)),
                tokens_per_s=sum(r["tokens"] for r in out) / wall,
                per_request_decode_tokens_per_s_p50=float(np.nanmedian([r["decode_tokens_per_s"] for r in out]))
                if out else float("nan"))


@_cli.entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    _cli.output_file(args.output_json, "--output-json")
    res = asyncio.run(run(args))
    print(f"{res['completed']}/{res['requests']} requests from {res['clients']} concurrent streaming clients in "
          f"{res['wall_s']:.1f} s, {res['errors']} errors")
    print(f"time to first token   p50 {res['ttft_p50_s']:.3f} s   p99 {res['ttft_p99_s']:.3f} s")
    print(f"throughput            {res['tokens_per_s']:.1f} generated tokens/s (all requests), "
          f"{res['per_request_decode_tokens_per_s_p50']:.1f} tokens/s per request (p50)")
    for e in res["first_errors"]:
        print(f"error: {e}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    if res["errors"]:
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()
