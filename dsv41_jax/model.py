"""The DeepSeek-V4.1 backbone as Flax NNX modules, and its chunk forward over the cache.

embed -> hc copies -> [Engram] -> blocks (mHC around CSA2 attention and MoE) -> collapse -> norm -> head.
With a vision tower (`cfg.vision_n_layers`, dsv41_jax/vision.py) the embeddings of image-span positions
are replaced by the tower's (`image_embeds` / `image_mask` of `forward`), and at those positions, as the
release does, Engram's gate is shut and its n-grams stop (the position is a dead token in the n-gram
history), and the routers pick experts with their image bias (`bias_vl`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.attention import Attention, Step, released_key_owner
from dsv41_jax.cache import Cache, formats_of
from dsv41_jax.engram import Engram
from dsv41_jax.engram_hash import EngramHashLayout, advance_history, ngram_hash_ids, ngram_windows
from dsv41_jax.block import MixedBlock
from dsv41_jax.dspark import DSparkStage
from dsv41_jax.hyper import collapse
from dsv41_jax.layers import Buffer, Embedding, Linear, RMSNorm
from dsv41_jax.plan import build_plan
from dsv41_jax.partitioning import annotate_params
from dsv41_jax.vision import build_vision, image_span


class Block(MixedBlock):
    def __init__(self, cfg, plan, engram_rows: int | None, *, rngs: nnx.Rngs):
        self._build(cfg, Attention(cfg, plan, rngs=rngs), cfg, rngs)
        self.engram = Engram(cfg, engram_rows, rngs=rngs) if engram_rows else None

    def __call__(self, h, pre_mix, step: Step, engram_ids=None, image_mask=None, capture: list | None = None):
        """h: [B, T, hc, dim]; pre_mix: [B, T, hc] from the previous block; image_mask: bool [B, T] or
        None (text only). Returns (h, next pre_mix). capture: a list that gets this block's input stream
        (after Engram) averaged over the hc copies, [B, T, dim]: what DSpark reads from its target layers."""
        if self.engram is not None:
            h = self.engram(h, engram_ids, backend=step.kernel_backend, image_mask=image_mask)
        if capture is not None:
            capture.append(jnp.mean(h.astype(jnp.float32), axis=2).astype(h.dtype))
        return self.mix(h, pre_mix, lambda x: self.attn(x, step), step.extras, step.kernel_backend, image_mask)


class Transformer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        plan = build_plan(cfg)
        rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
        self.embed = Embedding(cfg.vocab_size, cfg.dim, rngs=rngs, dtype=cfg.param_dtype)
        self.layers = nnx.List([Block(cfg, p, rows.get(p.layer), rngs=rngs) for p in plan])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, cfg.vocab_size, rngs=rngs, dtype=cfg.param_dtype)
        if cfg.has_dspark:  # the draft stages share embed and head (dsv41_jax.dspark)
            self.mtp = nnx.List([DSparkStage(cfg, s, rngs=rngs) for s in range(cfg.n_mtp_layers)])
        if cfg.engram_layer_ids:
            # tokenizer-derived compressed vocabulary for the n-gram hashes (identity for random presets)
            self.engram_token_map = Buffer(jnp.arange(cfg.vocab_size, dtype=jnp.int32) % cfg.engram_compressed_vocab_size)
        if cfg.vision_n_layers:  # built last: the text params draw the same random values with or without it
            for name, module in build_vision(cfg, rngs=rngs).items():
                setattr(self, name, module)
        annotate_params(self)  # logical axes (partitioning.PARAM_AXES) -> each param's NNX metadata

    def forward(self, cache: Cache, tokens_bt: jax.Array, n_new_b: jax.Array, *, all_logits: bool,
                layers: int | None = None, kernel_backend: str = "jnp", training: bool = False,
                extras: dict | None = None, image_embeds: jax.Array | None = None,
                image_mask: jax.Array | None = None) -> tuple[jax.Array | None, Cache]:
        """Process T new tokens per sequence on top of `cache`; n_new_b[b] of them are real.

        Returns logits f32 ([B, T, V] if all_logits else [B, V] at each sequence's last real token)
        and the updated cache. training=True runs the quantization-aware training forward (see
        `attention.Step.training`; one-token chunks then take the dense path too). `extras`, when
        given, receives the by-products the layers record (`Step.extras`; "expert_load": one int32
        [E] count of routed assignments per layer), which dsv41_jax.train reads.

        layers=k runs blocks [0, k) only (decoder-side bounded prefill: k = `plan.encoder_depth`):
        the global KV they publish is exact, the skipped blocks' window rings restart empty after
        this chunk (`Cache.window_start`), and there are no logits (None is returned for them).

        image_embeds [B, T, dim] and image_mask bool [B, T] (both or neither): positions where the mask
        is set take image_embeds instead of their token's embedding and are image positions for Engram
        and the routers (module docstring). A span may be cut between chunks: its rows are inputs.
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        dt = jnp.dtype(cfg.dtype)
        n_run = len(self.layers) if layers is None else layers
        if not 0 < n_run <= len(self.layers):
            raise ValueError(f"layers={layers} must be in 1..{len(self.layers)} (n_layers)")
        step = Step(pos=cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32), lengths=cache.lengths,
                    n_new=n_new_b, fmt=formats_of(cfg), window=cache.window, window_start=cache.window_start,
                    sources=list(cache.sources),
                    decode=(t == 1 and not training), kernel_backend=kernel_backend, training=training,
                    extras={} if extras is None else extras)
        if cfg.index_keys == "released" and t == 1 and step.sources:
            ratios = tuple(p.ratio for p in build_plan(cfg) if p.compresses)
            step.key_owner = released_key_owner(ratios, cache.lengths)
        history = cache.ngram_history
        engram_ids = None
        if cfg.engram_layer_ids:
            comp = self.engram_token_map[...][tokens_bt]
            if image_mask is not None:  # dead tokens: n-grams neither include nor reach past them
                comp = jnp.where(image_mask, -1, comp)
            pad = self.engram_token_map[...][cfg.engram_pad_id]
            win = ngram_windows(comp, history, pad, cfg.engram_max_ngram_size)
            engram_ids = ngram_hash_ids(EngramHashLayout.from_config(cfg), win)  # [B, T, L_e, cols]
            history = advance_history(history, comp, n_new_b)
        x0 = self.embed(tokens_bt).astype(dt)
        if image_mask is not None:
            x0 = jnp.where(image_mask[..., None], image_embeds.astype(dt), x0)
        h = jnp.broadcast_to(x0[:, :, None, :], (b, t, cfg.hc_mult, cfg.dim))
        pre = jnp.zeros((b, t, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        e_slot = {l: i for i, l in enumerate(cfg.engram_layer_ids)}
        targets = cfg.dspark_target_layer_ids if cfg.has_dspark and extras is not None else ()
        hidden: list = []
        for layer in range(n_run):
            ids = engram_ids[:, :, e_slot[layer]] if layer in e_slot else None
            h, pre = self.layers[layer](h, pre, step, ids, image_mask, hidden if layer in targets else None)
        if targets and len(hidden) == len(targets):
            step.extras["main_hidden"] = jnp.concatenate(hidden, axis=-1)
        new_len = cache.lengths + n_new_b
        start = cache.window_start
        if n_run < len(self.layers):  # skipped rings hold nothing before the new length
            start = start.at[n_run:].set(jnp.where(n_new_b > 0, new_len, start[n_run:]))
        new_cache = Cache(lengths=new_len, window=step.window, window_start=start, sources=tuple(step.sources),
                          ngram_history=history)
        if n_run < len(self.layers):
            return None, new_cache
        x = collapse(h, pre)
        if not all_logits:
            last = jnp.clip(n_new_b - 1, 0, t - 1)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        return self.head(self.norm(x).astype(jnp.float32), jnp.float32), new_cache

    def image_span(self, patches_nc: jax.Array, n_vit_h: int, n_vit_w: int, n_llm_h: int, n_llm_w: int) -> jax.Array:
        """Embeddings [n_span, dim] of one image's prompt span (dsv41_jax.vision.image_span)."""
        return image_span(self, patches_nc, n_vit_h, n_vit_w, n_llm_h, n_llm_w)
