"""Pure, jit-able entry points: parameters in, pytrees out, no global state.

    cfg = dsv41_jax.preset("tiny")
    params = init_params(cfg, seed=0)                    # nnx.State pytree
    cache = init_cache(cfg, batch=2, capacity=256)
    logits, cache = prefill(cfg, params, cache, tokens_bt, lengths_b)   # right-padded prompts
    logits, cache = decode_step(cfg, params, cache, next_tokens_b)

`freeze(params)` makes the params cheap to pass (each jitted call flattens its arguments, and an
nnx.State walks its Variables in Python: ~0.2 ms per call for the v41 slice); every function here takes
either. Freeze again after changing a State in place.

`donate=True` (prefill, decode_step; always in `generate`) hands the cache's buffers to XLA, which updates
them in place: the cache passed in is then deleted, use the returned one. Without it every call copies
every cache array. `generate` runs N decode steps in one compiled call, sampling and stop checks on
device, so no host work sits between tokens.

`prefill` also continues an existing cache (chunked prefill): it appends lengths[b] tokens to each
sequence. Images: `images=` gives each sequence's image spans (`dsv41_jax.images.ImageSpan`, from
`expand_prompt`; positions relative to this call's tokens): their positions take the vision tower's
embeddings (`encode_image`). A span may be cut between calls (`prefill_chunks` does that): the tower
sees the whole image either way, so chunked prefill equals one prefill. `prefill(..., layers=plan.encoder_depth(plan))` runs only the layers up to the last kv
source (decoder-side bounded prefill, see `Transformer.forward`). Inputs are checked here, before XLA
sees them, whenever they are concrete; inside a user's own `jax.jit` the checks that need values are
skipped.

On a mesh: `placement=` (a `partitioning.Placement`, from `sharding.shard_model`, with the params placed
there) runs `prefill`, `decode_step` and `generate` on the mesh -- the same checks, the same `kernels`,
the same traced code; the inputs are put on the mesh and the outputs (logits, sampled ids, cache) stay
split as the placement says.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import dspark
from dsv41_jax.compile_options import jit as _jit
from dsv41_jax.cache import Cache, cache_capacity, init_cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.images import EncodedSpan
from dsv41_jax.kernels import resolve
from dsv41_jax.model import Transformer
from dsv41_jax.partitioning import Placement
from dsv41_jax.sampling import sample

__all__ = ["init_params", "abstract_params", "freeze", "FrozenParams", "bind", "prefill", "prefill_chunks", "decode_step", "generate", "forward",
           "init_cache", "graphdef", "encode_image", "encode_spans", "init_draft_window", "speculative_prefill",
           "speculative_generate"]


def _abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves. Built outside any ambient mesh: under `jax.set_mesh`
    (a `placement=` call) nnx.eval_shape would turn the params' logical-axis metadata into mesh shardings
    and fail on names that are not mesh axes; the partitioning module resolves those names itself."""
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


@jax.tree_util.register_pytree_node_class
class FrozenParams:
    """An nnx.State of params flattened once (`freeze`): one pytree node whose children are the arrays.

    A jitted call flattens its arguments on every call; an nnx.State flattens each Variable through a
    Python callback (~1-2 us each on this repository's CPU: 0.34-0.67 ms per call for tiny's 309 Variables,
    0.17-0.26 ms for the slice's 167; `experiments.bench_dispatch`). `.state` is the State (of tracers inside a
    trace). The arrays are the State's at freezing: a State changed in place afterwards is not seen (freeze
    it again)."""

    __slots__ = ("state", "_leaves", "_treedef")

    def __init__(self, state: nnx.State, leaves: tuple | None = None, treedef=None):
        if leaves is None:
            leaves, treedef = jax.tree.flatten(state)
        self.state, self._leaves, self._treedef = state, tuple(leaves), treedef

    def tree_flatten(self):
        return self._leaves, self._treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(jax.tree.unflatten(treedef, leaves), leaves, treedef)


def freeze(params) -> FrozenParams:
    """`params` (an nnx.State, or already frozen) as `FrozenParams`: what a serving loop passes per call."""
    if isinstance(params, FrozenParams):
        return params
    if not isinstance(params, nnx.State):
        raise TypeError(f"freeze takes the nnx.State of init_params / a loader, got {type(params).__name__}")
    return FrozenParams(params)


def bind(cfg: ModelConfig, params) -> Transformer:
    """The NNX model of `cfg` with `params` (an nnx.State or FrozenParams) in it: what traced code calls."""
    return nnx.merge(graphdef(cfg), params.state if isinstance(params, FrozenParams) else params)


def forward(cfg: ModelConfig, params, cache: Cache, tokens_bt, n_new_b, *, all_logits: bool = False,
            layers: int | None = None, kernels: str = "jnp", image_embeds_btd=None, image_mask_bt=None):
    """Traceable core: T new tokens per sequence (n_new_b real) on top of `cache`, through the first
    `layers` blocks (None: all). image_embeds_btd [B, T, dim] / image_mask_bt bool [B, T]: the
    image-span rows of these tokens (see `Transformer.forward`), or None for text only."""
    model = bind(cfg, params)
    return model.forward(cache, tokens_bt, n_new_b, all_logits=all_logits, layers=layers, kernels=kernels,
                         image_embeds=image_embeds_btd, image_mask=image_mask_bt)


_STATIC = ("cfg", "all_logits", "layers", "kernels")
_forward_jit = _jit(forward, static_argnames=_STATIC)
_forward_donating = _jit(forward, static_argnames=_STATIC, donate_argnames=("cache",))


@lru_cache(maxsize=32)
def _jit_on_mesh(fn, static_argnames: tuple, donate: tuple, placement: Placement, n_rows: int,
                 draft_cfg: ModelConfig | None = None):
    """`fn` jitted to run on `placement`'s mesh: its first n_rows outputs split like the sequences, the
    next one (the cache) as the placement puts caches, and with `draft_cfg` a last one, that config's DSpark
    draft rings (`Placement.window_shardings`). donate: argument names. The placement is active while it
    runs: the routed experts read its mesh and sequence split (moe.py, expert_parallel.py)."""
    window = () if draft_cfg is None else (placement.window_shardings(
        jax.eval_shape(lambda: dspark.init_draft_window(draft_cfg, placement.batch))),)
    # XLA's default command-buffer order here: CONCURRENT (compile_options) was measured and checked on one GPU only
    jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate,
                     out_shardings=(*(placement.rows,) * n_rows, placement.cache, *window))

    def run(*args, **kwargs):
        with placement.active():
            return jitted(*args, **kwargs)

    return run


def _run(donate: bool, placement: Placement | None):
    if placement is not None:
        return _jit_on_mesh(forward, _STATIC, ("cache",) if donate else (), placement, 1)
    return _forward_donating if donate else _forward_jit


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _encode(cfg: ModelConfig, params, patches_nc, *, grid: tuple[int, int, int, int]):
    return bind(cfg, params).image_span(patches_nc, *grid)


_encode_jit = _jit(_encode, static_argnames=("cfg", "grid"))


def encode_image(cfg: ModelConfig, params, image) -> jax.Array:
    """The embeddings [n_tokens, dim] (activation dtype) of a `PreparedImage`'s prompt span: the vision
    tower on its patches, then the span layout (dsv41_jax.vision). One compile per patch grid."""
    if not cfg.vision_n_layers:
        raise ValueError("this model has no vision tower (vision_n_layers == 0): it cannot take images")
    grid = (image.n_vit_h, image.n_vit_w, image.n_llm_h, image.n_llm_w)
    return _encode_jit(cfg, params, jnp.asarray(image.patches.astype(np.float32)), grid=grid)


def encode_spans(cfg: ModelConfig, params, spans) -> list[EncodedSpan]:
    """Each `ImageSpan` with its embeddings on the host (f32), for prefilling it in several calls."""
    return [EncodedSpan(s.start, np.asarray(encode_image(cfg, params, s.image), np.float32)) for s in spans]


def _image_rows(cfg: ModelConfig, params, images, tokens_bt, lengths_b):
    """(image_embeds f32 [B, T, dim], image_mask bool [B, T]) of `images` (per sequence a list of
    ImageSpan / EncodedSpan, positions relative to tokens_bt's columns), or (None, None) when no span
    reaches a real token. ValueError for spans whose positions do not hold image_token_id."""
    b, t = tokens_bt.shape
    if len(images) != b:
        raise ValueError(f"images must hold one list of spans per sequence ({b}), got {len(images)}")
    if not cfg.vision_n_layers:
        raise ValueError("this model has no vision tower (vision_n_layers == 0): it cannot take images")
    tokens, lengths = np.asarray(tokens_bt), np.asarray(lengths_b)
    emb, mask = np.zeros((b, t, cfg.dim), np.float32), np.zeros((b, t), bool)
    for row, spans in enumerate(images):
        for span in spans or ():
            lo, hi = max(span.start, 0), min(span.stop, int(lengths[row]))
            if lo >= hi:
                continue
            if (tokens[row, lo:hi] != cfg.image_token_id).any() or mask[row, lo:hi].any():
                raise ValueError(f"sequence {row}: image span at {span.start}..{span.stop - 1} must cover positions "
                                 f"holding image_token_id {cfg.image_token_id} and no other span; build the prompt "
                                 "with dsv41_jax.images.expand_prompt")
            rows = span.embeds if isinstance(span, EncodedSpan) else np.asarray(encode_image(cfg, params, span.image))
            emb[row, lo:hi] = rows[lo - span.start:hi - span.start]
            mask[row, lo:hi] = True
    return (emb, mask) if mask.any() else (None, None)


def _onto(placement: Placement | None, cache: Cache, *rows):
    """(cache, *rows) put on the placement's mesh (rows: int arrays that lead with the batch); as they
    are without a placement."""
    if placement is None:
        return (cache, *rows)
    return (placement.put_cache(cache), *map(placement.put_rows, rows))


def _check_tokens(cfg: ModelConfig, tokens, name: str) -> None:
    if not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of token ids, got dtype {jnp.asarray(tokens).dtype}")
    if _concrete(tokens):
        t = np.asarray(tokens)
        if t.size and (t.min() < 0 or t.max() >= cfg.vocab_size):
            raise ValueError(f"{name} has ids outside [0, {cfg.vocab_size}): min {t.min()}, max {t.max()}")


def prefill(cfg: ModelConfig, params, cache: Cache, tokens_bt, lengths_b, *, all_logits: bool = False,
            layers: int | None = None, kernels: str = "jnp", donate: bool = False, images=None,
            placement: Placement | None = None):
    """Append right-padded prompts to the cache.

    tokens_bt: int [B, T] (positions >= lengths_b[b] are padding, any valid id); lengths_b: int [B],
    1 <= lengths_b[b] <= T. Returns (logits, cache): logits f32 [B, V] at each prompt's last token,
    or [B, T, V] with all_logits=True. layers=k < n_layers runs blocks [0, k) only and returns
    (None, cache); the later blocks' rings then restart empty at the new length (`Cache.window_start`).
    donate=True updates the cache in place (the argument is consumed; see the module docstring).
    images: None, or per sequence a list of `ImageSpan`s (positions relative to tokens_bt's columns; a
    span may reach outside them, those positions come in other calls) whose positions hold
    image_token_id; they are prefilled with the vision tower's embeddings (module docstring).
    placement: run on a mesh (module docstring); logits and cache come back split there.
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
    embeds, mask = _image_rows(cfg, params, images, tokens_bt, lengths_b) if images is not None else (None, None)
    cache, tokens_bt, lengths_b = _onto(placement, cache, tokens_bt, lengths_b)
    return _run(donate, placement)(cfg, params, cache, tokens_bt.astype(jnp.int32), lengths_b.astype(jnp.int32),
                                   all_logits=all_logits, layers=layers, kernels=resolve(kernels),
                                   image_embeds_btd=embeds, image_mask_bt=mask)


def prefill_chunks(cfg: ModelConfig, params, cache: Cache, ids_bt, lo: int, hi: int, width: int, *,
                   all_logits: bool = False, layers: int | None = None, kernels: str = "jnp", donate: bool = False,
                   images=None, placement: Placement | None = None):
    """`prefill` of ids_bt[:, lo:hi] (int [B, >= hi], every row the same span) in chunks of `width` tokens,
    the last one right-padded, so every chunk has one shape (one compile). A generator: yields
    (start, n, logits, cache) after each chunk of n real tokens starting at position `start`.
    images: per sequence its `ImageSpan`s / `EncodedSpan`s at positions of ids_bt; each image is
    encoded once, and a chunk gets the rows of the spans that reach it (chunks without any run the
    text-only program)."""
    ids_bt = np.asarray(ids_bt)
    b = ids_bt.shape[0]
    if images is not None:
        images = [[s if isinstance(s, EncodedSpan) else encode_spans(cfg, params, [s])[0] for s in row or ()]
                  for row in images]
    for a in range(lo, hi, width):
        n = min(width, hi - a)
        t = np.zeros((b, width), np.int32)
        t[:, :n] = ids_bt[:, a:a + n]
        here = None
        if images is not None:  # the spans that reach [a, a + n), shifted to the chunk's columns
            here = [[EncodedSpan(s.start - a, s.embeds) for s in row if s.start < a + n and s.stop > a]
                    for row in images]
            here = here if any(here) else None
        logits, cache = prefill(cfg, params, cache, t, np.full((b,), n, np.int32), all_logits=all_logits,
                                layers=layers, kernels=kernels, donate=donate, images=here, placement=placement)
        yield a, n, logits, cache


def _check_next_tokens(cfg: ModelConfig, cache: Cache, tokens_b, check_ids: bool = True) -> jax.Array:
    """tokens_b as an array after checking it is one integer id per sequence (and, if asked, in range)."""
    tokens_b = jnp.asarray(tokens_b)
    if tokens_b.shape != (cache.batch,):
        raise ValueError(f"decode tokens must have shape ({cache.batch},), got {tokens_b.shape}")
    if not jnp.issubdtype(tokens_b.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array of token ids, got dtype {tokens_b.dtype}")
    if check_ids:
        _check_tokens(cfg, tokens_b, "tokens")
    return tokens_b


def _check_room(cfg: ModelConfig, cache: Cache, n_new_b, when: str) -> None:
    """Refuse appending n_new_b[b] tokens to sequences that would pass the cache's capacity (when the
    values are concrete; `when` ends the message, e.g. " in 8 steps")."""
    if not (_concrete(cache.lengths) and _concrete(n_new_b)):
        return
    cap = cache_capacity(cache, cfg)
    full = np.asarray(cache.lengths) + np.asarray(n_new_b) > cap
    if full.any():
        raise ValueError(f"cache full: sequences {np.flatnonzero(full).tolist()} would exceed the capacity of "
                         f"{cap} tokens{when}; make the cache larger or generate fewer tokens")


def decode_step(cfg: ModelConfig, params, cache: Cache, tokens_b, active_b=None, *, kernels: str = "jnp",
                validate: bool = True, donate: bool = False, placement: Placement | None = None):
    """Append one token per sequence; returns (logits f32 [B, V], cache).

    active_b: optional bool [B]; inactive sequences are left untouched (their logits are garbage).
    validate=False skips the value checks (ids in range, room in the cache), which read device arrays
    back to the host: a generation loop that feeds sampled ids and tracks lengths itself can skip them.
    donate=True updates the cache in place (the argument is consumed). placement: run on a mesh (module
    docstring); tokens_b may be the previous step's output there.
    """
    tokens_b = _check_next_tokens(cfg, cache, tokens_b, validate)
    n_new = _rows(cache.batch, 1, "int32") if active_b is None else jnp.asarray(active_b).astype(jnp.int32)
    if validate:
        _check_room(cfg, cache, n_new, "")
    cache, tokens_b, n_new = _onto(placement, cache, tokens_b, n_new)
    return _run(donate, placement)(cfg, params, cache, tokens_b.astype(jnp.int32)[:, None], n_new, all_logits=False,
                                   kernels=resolve(kernels))


def _generate(cfg: ModelConfig, params, cache, tokens_b, temperature_b, seed_b, step_b, budget_b, stop_bs, *, n_steps: int,
              kernels: str):
    def one_step(carry, _):
        cache, tok, count = carry
        live = count < budget_b  # [B]: sequences that still feed a token and sample the next
        logits, cache = forward(cfg, params, cache, tok[:, None], live.astype(jnp.int32), kernels=kernels)
        nxt = sample(logits, temperature_b, seed_b, step_b + count)
        nxt = jnp.where(live, nxt, tok)
        stop = jnp.any(nxt[:, None] == stop_bs, axis=1)
        count = jnp.where(live, jnp.where(stop, budget_b, count + 1), count)
        return (cache, nxt, count), (nxt, live)

    init = (per_layer_window(cache), tokens_b, jnp.zeros_like(budget_b))
    (cache, _, _), (toks, emitted) = jax.lax.scan(one_step, init, length=n_steps)
    return toks.T, emitted.T, stacked_window(cache)


def per_layer_window(cache: Cache) -> Cache:
    """The cache with its window rings as a tuple of per-layer record dicts ([B, W, ...] each), as the
    generation loop carries them: a layer's ring is then updated in its own buffer, where in the stacked
    [L, B, W, ...] arrays XLA copied each layer's new ring into its slot (the v41 slice on the H200: ~10 memcpy
    kernels per step fewer, docs/BENCHMARKS.md sixteenth pass). `stacked_window` undoes it."""
    n = jax.tree.leaves(cache.window)[0].shape[0]
    return dataclasses.replace(cache, window=tuple(jax.tree.map(lambda a, l=l: a[l], cache.window) for l in range(n)))


def stacked_window(cache: Cache) -> Cache:
    """`per_layer_window` undone: the rings stacked [L, B, W, ...] again."""
    return dataclasses.replace(cache, window=jax.tree.map(lambda *rings: jnp.stack(rings), *cache.window))


_GENERATE_STATIC = ("cfg", "n_steps", "kernels")
_generate_jit = _jit(_generate, static_argnames=_GENERATE_STATIC, donate_argnames=("cache",))


@lru_cache(maxsize=256)
def _rows(b: int, value, dtype: str, width: int | None = None) -> jax.Array:
    """A device array [b] (or [b, width]) filled with a Python scalar, made once: inputs that keep their
    buffers from call to call let the GPU reuse the recorded command buffers of a compiled step (new
    buffers make XLA update them: milliseconds per call at the released width)."""
    return jnp.full((b,) if width is None else (b, width), value, dtype)


def _per_seq(v, b: int, dtype: str) -> jax.Array:
    """A per-sequence argument as a [b] array of `dtype`: a Python scalar from `_rows`, an array as is."""
    if isinstance(v, (int, float, np.integer, np.floating)):
        return _rows(b, v.item() if isinstance(v, np.generic) else v, dtype)
    v = jnp.asarray(v)
    return (v if v.shape == (b,) else jnp.broadcast_to(v, (b,))).astype(dtype)


def generate(cfg: ModelConfig, params, cache: Cache, tokens_b, n_steps: int, *, temperature_b=0.0, seed_b=0,
             step_b=0, budget_b=None, stop_ids_bs=None, kernels: str = "jnp", validate: bool = True,
             placement: Placement | None = None):
    """Up to `n_steps` decode steps in one compiled call: feed tokens_b, sample the next token on device
    (`sampling.sample`: greedy at temperature 0), feed it, and so on. The cache is donated.

    tokens_b int [B]: each sequence's newest token, not yet in the cache. Per sequence (scalars
    broadcast): temperature_b, seed_b and step_b (the sampling key is fold_in(key(seed), step), step
    counting that sequence's sampled tokens), budget_b int [B] (tokens it may still sample; 0 = idle;
    default n_steps), stop_ids_bs int [B, S] (-1 padded): a sampled stop id ends the sequence (it is
    emitted, never fed). Returns (tokens int32 [B, n_steps], emitted bool [B, n_steps]: True where
    the token is a real sample of that sequence, cache). placement: run on a mesh (module docstring).
    validate=False skips the checks that read device values back to the host (ids in range, room in
    the cache), as `decode_step`'s: the host can then queue the next call while this one runs.
    """
    tokens_b = _check_next_tokens(cfg, cache, tokens_b, validate)
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
    b = cache.batch
    budget = _per_seq(n_steps if budget_b is None else budget_b, b, "int32")
    if validate:
        _check_room(cfg, cache, np.minimum(np.asarray(budget), n_steps), f" in {n_steps} steps")
    stop = _rows(b, -1, "int32", 1) if stop_ids_bs is None else jnp.asarray(stop_ids_bs, jnp.int32)
    if stop.ndim != 2 or stop.shape[0] != b:
        raise ValueError(f"stop_ids_bs must be [{b}, S] (-1 padded), got shape {stop.shape}")
    cache, tokens_b = _onto(placement, cache, tokens_b)
    run = _generate_jit if placement is None else _jit_on_mesh(_generate, _GENERATE_STATIC, ("cache",), placement, 2)
    return run(cfg, params, cache, tokens_b.astype(jnp.int32), _per_seq(temperature_b, b, "float32"),
               _per_seq(seed_b, b, "uint32"), _per_seq(step_b, b, "int32"), budget, stop, n_steps=n_steps,
               kernels=resolve(kernels))


# ----------------------------------------------------------------------------- DSpark speculative decoding

def init_draft_window(cfg: ModelConfig, batch: int) -> dict:
    """Empty DSpark draft rings for `batch` sequences (see dsv41_jax.dspark); they follow the cache's lengths."""
    dspark.check_stages(cfg)
    return dspark.init_draft_window(cfg, batch)


def _speculative_prefill(cfg: ModelConfig, params, cache, window, tokens_bt, n_new_b, *, kernels):
    model = bind(cfg, params)
    logits, new_cache, aux = model.forward(cache, tokens_bt, n_new_b, all_logits=False, kernels=kernels,
                                           with_aux=True)
    window = dspark.write_rings(model, window, aux.hidden_btf, cache.lengths, n_new_b, kernels)
    return logits, new_cache, window


_SPECULATIVE_PREFILL_STATIC = ("cfg", "kernels")
_speculative_prefill_jit = _jit(_speculative_prefill, static_argnames=_SPECULATIVE_PREFILL_STATIC,
                                donate_argnames=("cache", "window"))


def _speculative_on(placement: Placement | None, cfg: ModelConfig, fn, jitted, static: tuple, n_rows: int,
                    cache: Cache, window: dict, *rows):
    """(the program to call, cache, window, *rows): `jitted` as it is without a placement; on one, `fn` compiled
    for its mesh (outputs: n_rows rows, cache, window) and the inputs put there."""
    if placement is None:
        return (jitted, cache, window, *rows)
    cache, *rows = _onto(placement, cache, *rows)
    return (_jit_on_mesh(fn, static, ("cache", "window"), placement, n_rows, cfg), cache,
            placement.put_window(window), *rows)


def speculative_prefill(cfg: ModelConfig, params, cache: Cache, window: dict, tokens_bt, lengths_b, *,
                        kernels: str = "jnp", placement: Placement | None = None):
    """`prefill` that also fills the DSpark draft rings from the target's hidden streams (one forward).

    Same inputs as `prefill` plus `window` (from `init_draft_window`, or the previous call's); returns
    (logits f32 [B, V] at each prompt's last token, cache, window). Cache and window are donated.
    placement: run on a mesh (module docstring), the rings split like the cache's window.
    """
    dspark.check_stages(cfg)
    tokens_bt = jnp.asarray(tokens_bt)
    if tokens_bt.ndim != 2 or tokens_bt.shape[0] != cache.batch or tokens_bt.shape[1] == 0:
        raise ValueError(f"tokens must be [batch={cache.batch}, tokens >= 1], got shape {tokens_bt.shape}")
    _check_tokens(cfg, tokens_bt, "tokens")
    lengths_b = jnp.asarray(lengths_b)
    if lengths_b.shape != (cache.batch,) or not jnp.issubdtype(lengths_b.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape ({cache.batch},), got {lengths_b.shape}")
    if _concrete(lengths_b) and ((np.asarray(lengths_b) < 1) | (np.asarray(lengths_b) > tokens_bt.shape[1])).any():
        raise ValueError(f"lengths must be in 1..{tokens_bt.shape[1]}, got {np.asarray(lengths_b).tolist()}")
    _check_room(cfg, cache, lengths_b, "")
    run, cache, window, tokens_bt, lengths_b = _speculative_on(
        placement, cfg, _speculative_prefill, _speculative_prefill_jit, _SPECULATIVE_PREFILL_STATIC, 1, cache, window,
        tokens_bt, lengths_b)
    return run(cfg, params, cache, window, tokens_bt.astype(jnp.int32), lengths_b.astype(jnp.int32),
               kernels=resolve(kernels))


def _speculative_generate(cfg: ModelConfig, params, cache, window, tokens_b, temperature_b, seed_b, step_b, budget_b, stop_bs,
                          *, n_steps: int, kernels: str):
    model = bind(cfg, params)

    def one_step(carry, _):
        cache, window, tok, count, budget = carry
        out, n_out, tok, budget, cache, window, stats = dspark.speculative_step(
            model, cache, window, tok, temperature_b, seed_b, step_b + count, budget, stop_bs, kernels)
        return (cache, window, tok, count + n_out, budget), (out, n_out, stats["accepted"])

    init = (cache, window, tokens_b, jnp.zeros_like(budget_b), budget_b)
    (cache, window, tok, _, _), (out, n_out, accepted) = jax.lax.scan(one_step, init, length=n_steps)
    return out.transpose(1, 0, 2), n_out.T, accepted.T, tok, cache, window


_SPECULATIVE_GENERATE_STATIC = ("cfg", "n_steps", "kernels")
_speculative_generate_jit = _jit(_speculative_generate, static_argnames=_SPECULATIVE_GENERATE_STATIC,
                                 donate_argnames=("cache", "window"))


def speculative_generate(cfg: ModelConfig, params, cache: Cache, window: dict, tokens_b, n_steps: int, *,
                         temperature_b=0.0, seed_b=0, step_b=0, budget_b=None, stop_ids_bs=None,
                         kernels: str = "jnp", placement: Placement | None = None):
    """Up to `n_steps` DSpark steps (draft a block, verify it with one target forward, commit the accepted
    prefix; `dspark.speculative_step`) in one compiled call. Cache and window are donated.

    Arguments as in `generate` (tokens_b: each sequence's newest token, not cached; budget_b: tokens it
    may still emit, default n_steps * (dspark_block_size + 1)). At temperature 0 the emitted tokens are
    exactly those of `generate`; when sampling they are distributed as the target's samples.
    Returns (tokens int32 [B, n_steps, K+1] (-1 padded), n_out int32 [B, n_steps] (tokens emitted per
    step), accepted int32 [B, n_steps] (drafts accepted per step), next tokens_b, cache, window).
    placement: run on a mesh (module docstring), the rings split like the cache's window.
    """
    dspark.check_stages(cfg)
    tokens_b = _check_next_tokens(cfg, cache, tokens_b)
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
    b, k = cache.batch, cfg.dspark_block_size
    budget = _per_seq(n_steps * (k + 1) if budget_b is None else budget_b, b, "int32")
    # a verify forward appends a whole block before the rejected tail is dropped
    _check_room(cfg, cache, jnp.minimum(budget, n_steps * (k + 1)) + k, f" in {n_steps} speculative steps "
                f"(each verifies {k + 1} tokens)")
    stop = _rows(b, -1, "int32", 1) if stop_ids_bs is None else jnp.asarray(stop_ids_bs, jnp.int32)
    if stop.ndim != 2 or stop.shape[0] != b:
        raise ValueError(f"stop_ids_bs must be [{b}, S] (-1 padded), got shape {stop.shape}")
    run, cache, window, tokens_b = _speculative_on(placement, cfg, _speculative_generate, _speculative_generate_jit,
                                                   _SPECULATIVE_GENERATE_STATIC, 4, cache, window, tokens_b)
    return run(cfg, params, cache, window, tokens_b.astype(jnp.int32), _per_seq(temperature_b, b, "float32"),
               _per_seq(seed_b, b, "uint32"), _per_seq(step_b, b, "int32"), budget, stop, n_steps=n_steps,
               kernels=resolve(kernels))
