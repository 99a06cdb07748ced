"""Pure, jit-able entry points: parameters in, pytrees out, no global state.

    cfg = dsv41_jax.preset("tiny")
    params = init_params(cfg, seed=0)                    # nnx.State pytree
    cache = init_cache(cfg, batch=2, capacity=256)
    logits, cache = prefill(cfg, params, cache, tokens_bt, lengths_b)   # right-padded prompts
    logits, cache = decode_step(cfg, params, cache, next_tokens_b)

`prefill` also continues an existing cache (chunked prefill): it appends lengths[b] tokens to each
sequence. `prefill(..., layers=plan.encoder_depth(plan))` runs only the layers up to the last kv
source (decoder-side bounded prefill, see `Transformer.forward`). Inputs are checked here, before XLA
sees them, whenever they are concrete; inside a user's own `jax.jit` the checks that need values are
skipped.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.cache import Cache, cache_capacity, init_cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.kernels import resolve
from dsv41_jax.model import Transformer

__all__ = ["init_params", "abstract_params", "prefill", "prefill_chunks", "decode_step", "forward", "init_cache",
           "graphdef"]


def _abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves. Built outside any ambient mesh: under `jax.set_mesh`
    (ShardedModel) nnx.eval_shape would turn the params' logical-axis metadata into mesh shardings and
    fail on names that are not mesh axes; the sharding module resolves those names itself."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


@lru_cache(maxsize=16)
def graphdef(cfg: ModelConfig):
    return nnx.split(_abstract_model(cfg))[0]


def init_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """Random parameters (an `nnx.State` pytree) for `cfg`."""
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]


def abstract_params(cfg: ModelConfig) -> nnx.State:
    """ShapeDtypeStructs of the parameters, allocating nothing (works for the full v41-flash)."""
    return nnx.split(_abstract_model(cfg))[1]


def forward(cfg: ModelConfig, params, cache: Cache, tokens_bt, n_new_b, *, all_logits: bool = False,
            layers: int | None = None, kernels: str = "jnp"):
    """Traceable core: T new tokens per sequence (n_new_b real) on top of `cache`, through the first
    `layers` blocks (None: all)."""
    model = nnx.merge(graphdef(cfg), params)
    return model.forward(cache, tokens_bt, n_new_b, all_logits=all_logits, layers=layers, kernel_backend=kernels)


_forward_jit = jax.jit(forward, static_argnames=("cfg", "all_logits", "layers", "kernels"))


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_tokens(cfg: ModelConfig, tokens, name: str) -> None:
    if not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of token ids, got dtype {jnp.asarray(tokens).dtype}")
    if _concrete(tokens):
        t = np.asarray(tokens)
        if t.size and (t.min() < 0 or t.max() >= cfg.vocab_size):
            raise ValueError(f"{name} has ids outside [0, {cfg.vocab_size}): min {t.min()}, max {t.max()}")


def prefill(cfg: ModelConfig, params, cache: Cache, tokens_bt, lengths_b, *, all_logits: bool = False,
            layers: int | None = None, kernels: str = "jnp"):
    """Append right-padded prompts to the cache.

    tokens_bt: int [B, T] (positions >= lengths_b[b] are padding, any valid id); lengths_b: int [B],
    1 <= lengths_b[b] <= T. Returns (logits, cache): logits f32 [B, V] at each prompt's last token,
    or [B, T, V] with all_logits=True. layers=k < n_layers runs blocks [0, k) only and returns
    (None, cache); the later blocks' rings then restart empty at the new length (`Cache.window_start`).
    """
    if layers is not None and not (isinstance(layers, int) and 0 < layers <= cfg.n_layers):
        raise ValueError(f"layers must be an int in 1..{cfg.n_layers} (n_layers) or None, got {layers!r}")
    tokens_bt = jnp.asarray(tokens_bt)
    if tokens_bt.ndim != 2:
        raise ValueError(f"tokens must be [batch, tokens], got shape {tokens_bt.shape}")
    b, t = tokens_bt.shape
    if t == 0:
        raise ValueError("empty prompt: tokens has zero columns; pass at least one token per sequence")
    if b != cache.batch:
        raise ValueError(f"tokens has batch {b} but the cache was made for batch {cache.batch}")
    _check_tokens(cfg, tokens_bt, "tokens")
    lengths_b = jnp.asarray(lengths_b)
    if lengths_b.shape != (b,) or not jnp.issubdtype(lengths_b.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape ({b},), got {lengths_b.shape} {lengths_b.dtype}")
    if _concrete(lengths_b) and _concrete(cache.lengths):
        n, have = np.asarray(lengths_b), np.asarray(cache.lengths)
        if (n < 1).any():
            raise ValueError(f"empty prompt: lengths must be >= 1, got {n.tolist()}")
        if (n > t).any():
            raise ValueError(f"lengths {n.tolist()} exceed the {t} token columns given")
        cap = cache_capacity(cache, cfg)
        if (have + n > cap).any():
            raise ValueError(f"prompt too long for the cache: cached {have.tolist()} + new {n.tolist()} tokens "
                             f"exceeds its capacity of {cap}; make the cache with a larger capacity")
    layers = None if layers == cfg.n_layers else layers  # one program for "all layers"
    return _forward_jit(cfg, params, cache, tokens_bt.astype(jnp.int32), lengths_b.astype(jnp.int32),
                        all_logits=all_logits, layers=layers, kernels=resolve(kernels))


def prefill_chunks(cfg: ModelConfig, params, cache: Cache, ids_bt, lo: int, hi: int, width: int, *,
                   all_logits: bool = False, layers: int | None = None, kernels: str = "jnp"):
    """`prefill` of ids_bt[:, lo:hi] (int [B, >= hi], every row the same span) in chunks of `width` tokens,
    the last one right-padded, so every chunk has one shape (one compile). A generator: yields
    (start, n, logits, cache) after each chunk of n real tokens starting at position `start`."""
    ids_bt = np.asarray(ids_bt)
    b = ids_bt.shape[0]
    for a in range(lo, hi, width):
        n = min(width, hi - a)
        t = np.zeros((b, width), np.int32)
        t[:, :n] = ids_bt[:, a:a + n]
        logits, cache = prefill(cfg, params, cache, t, np.full((b,), n, np.int32), all_logits=all_logits,
                                layers=layers, kernels=kernels)
        yield a, n, logits, cache


def decode_step(cfg: ModelConfig, params, cache: Cache, tokens_b, active_b=None, *, kernels: str = "jnp",
                validate: bool = True):
    """Append one token per sequence; returns (logits f32 [B, V], cache).

    active_b: optional bool [B]; inactive sequences are left untouched (their logits are garbage).
    validate=False skips the value checks (ids in range, room in the cache), which read device arrays
    back to the host: a generation loop that feeds sampled ids and tracks lengths itself can skip them.
    """
    tokens_b = jnp.asarray(tokens_b)
    if tokens_b.shape != (cache.batch,):
        raise ValueError(f"decode tokens must have shape ({cache.batch},), got {tokens_b.shape}")
    n_new = jnp.ones_like(cache.lengths) if active_b is None else jnp.asarray(active_b).astype(jnp.int32)
    if not jnp.issubdtype(tokens_b.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array of token ids, got dtype {tokens_b.dtype}")
    if validate:
        _check_tokens(cfg, tokens_b, "tokens")
    if validate and _concrete(cache.lengths) and _concrete(n_new):
        cap = cache_capacity(cache, cfg)
        full = np.asarray(cache.lengths + n_new) > cap
        if full.any():
            raise ValueError(f"cache full: sequences {np.flatnonzero(full).tolist()} already hold {cap} tokens "
                             "(the capacity); make the cache larger or stop generating")
    return _forward_jit(cfg, params, cache, tokens_b.astype(jnp.int32)[:, None], n_new, all_logits=False,
                        kernels=resolve(kernels))
