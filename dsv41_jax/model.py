"""The DeepSeek-V4.1 backbone as Flax NNX modules, and its chunk forward over the cache.

embed -> hc copies -> [Engram] -> blocks (mHC around CSA2 attention and MoE) -> collapse -> norm -> head.
With a vision tower (`cfg.vision_n_layers`, dsv41_jax/vision.py) the embeddings of image-span positions
are replaced by the tower's (`image_embeds` / `image_mask` of `forward`), and at those positions, as the
release does, Engram's gate is shut and its n-grams stop (the position is a dead token in the n-gram
history), and the routers pick experts with their image bias (`bias_vl`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.attention import Attention
from dsv41_jax.cache import Cache, formats_of
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram import Engram
from dsv41_jax.engram_hash import EngramHashLayout, advance_history, ngram_hash_ids, ngram_windows
from dsv41_jax.block import MixedBlock
from dsv41_jax.dspark import DSparkStage
from dsv41_jax.hyper import collapse
from dsv41_jax.indexer import released_key_owner
from dsv41_jax.layers import Buffer, Embedding, Linear, RMSNorm
from dsv41_jax.plan import build_plan
from dsv41_jax.precision import model_precision
from dsv41_jax.partitioning import annotate_params
from dsv41_jax.step import ForwardAux, Published, StepInputs
from dsv41_jax.vision import build_vision, image_span


class Block(MixedBlock):
    def __init__(self, cfg: ModelConfig, plan, engram_rows: int | None, *, rngs: nnx.Rngs):
        self._build(cfg, Attention(cfg, plan, rngs=rngs), cfg, rngs)
        self.engram = Engram(cfg, engram_rows, rngs=rngs) if engram_rows else None

    def __call__(self, h_btcd, pre_mix_btc, inp: StepInputs, ring: dict, pub: Published, engram_ids=None,
                 image_mask_bt=None, capture: bool = False):
        """h: [B, T, hc, dim]; pre_mix: [B, T, hc] from the previous block; ring: this layer's window ring
        before the chunk; pub: what the earlier layers published; image_mask: bool [B, T] or None (text
        only). Returns (h, next pre_mix, ring after the chunk, `Published` for the next layer,
        `LayerAux`). capture: also return this block's input stream (after Engram) averaged over the
        hc copies, [B, T, dim] (`LayerAux.hidden_btd`): what DSpark reads from its target layers."""
        if self.engram is not None:
            h_btcd = self.engram(h_btcd, engram_ids, kernels=inp.kernels, image_mask=image_mask_bt)
        hidden = jnp.mean(h_btcd.astype(jnp.float32), axis=2).astype(h_btcd.dtype) if capture else None

        def attend(x_btd):
            out_btd, ring_after, pub_after, aux = self.attn(x_btd, inp, ring, pub)
            return out_btd, (ring_after, pub_after, aux)

        h_btcd, pre_mix_btc, (ring, pub, aux), load_e = self.mix(h_btcd, pre_mix_btc, attend, inp.kernels,
                                                                 image_mask_bt)
        return h_btcd, pre_mix_btc, ring, pub, dataclasses.replace(aux, expert_load_e=load_e, hidden_btd=hidden)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
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

    @model_precision
    def forward(self, cache: Cache, tokens_bt: jax.Array, n_new_b: jax.Array, *, all_logits: bool,
                layers: int | None = None, kernels: str = "jnp", training: bool = False, with_aux: bool = False,
                image_embeds: jax.Array | None = None, image_mask: jax.Array | None = None):
        """Process T new tokens per sequence on top of `cache`; n_new_b[b] of them are real.

        Returns (logits, cache), or (logits, cache, `step.ForwardAux`) with with_aux=True: logits f32
        ([B, T, V] if all_logits else [B, V] at each sequence's last real token) and the updated cache.
        training=True runs the quantization-aware training forward (`step.StepInputs.training`;
        one-token chunks then take the dense path too); its views and indexer records are in the aux,
        which dsv41_jax.train reads, as are the routed expert loads, the DSpark target layers' hidden
        streams (a model with draft stages) and the compressors' pending extensions (dsv41_jax.dspark).

        layers=k runs blocks [0, k) only (decoder-side bounded prefill: k = `plan.encoder_depth`):
        the global KV they publish is exact, the skipped blocks' window rings restart empty after
        this chunk (`Cache.window_start`), and there are no logits (None is returned for them).

        image_embeds [B, T, dim] and image_mask bool [B, T] (both or neither): positions where the mask
        is set take image_embeds instead of their token's embedding and are image positions for Engram
        and the routers (module docstring). A span may be cut between chunks: its rows are inputs.

        cache.window is the stacked [L, B, W, ...] records or, inside the generation loop, a tuple of each
        layer's own (`api.per_layer_window`); the cache returned keeps the form it came in.
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        dt = jnp.dtype(cfg.dtype)
        n_run = len(self.layers) if layers is None else layers
        if not 0 < n_run <= len(self.layers):
            raise ValueError(f"layers={layers} must be in 1..{len(self.layers)} (n_layers)")
        inp = StepInputs(pos_bt=cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32), lengths_b=cache.lengths,
                         n_new_b=n_new_b, window_start_lb=cache.window_start, fmt=formats_of(cfg),
                         decode=(t == 1 and not training), kernels=kernels, training=training)
        key_owner_b = None
        if cfg.index_keys == "released" and t == 1 and cache.sources:
            ratios = tuple(p.ratio for p in build_plan(cfg) if p.compresses)
            key_owner_b = released_key_owner(ratios, cache.lengths)
        pub = Published(sources=tuple(cache.sources), views=(None,) * len(cache.sources), key_owner_b=key_owner_b)
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
        targets = cfg.dspark_target_layer_ids if cfg.has_dspark and with_aux else ()
        window, layer_aux = cache.window, []
        for layer in range(n_run):
            ids = engram_ids[:, :, e_slot[layer]] if layer in e_slot else None
            if isinstance(window, tuple):  # a ring per layer (`per_layer_window`): the layer's own arrays
                ring = window[layer]
            else:
                ring = jax.tree.map(lambda a, l=layer: a[l], window)
            h, pre, ring, pub, aux = self.layers[layer](h, pre, inp, ring, pub, ids, image_mask, layer in targets)
            if isinstance(window, tuple):
                window = window[:layer] + (ring,) + window[layer + 1:]
            else:
                window = jax.tree.map(lambda a, r, l=layer: a.at[l].set(r), window, ring)  # the cache takes the slice
            layer_aux.append(aux)
        new_len = cache.lengths + n_new_b
        start = cache.window_start
        if n_run < len(self.layers):  # skipped rings hold nothing before the new length
            start = start.at[n_run:].set(jnp.where(n_new_b > 0, new_len, start[n_run:]))
        new_cache = Cache(lengths=new_len, window=window, window_start=start, sources=pub.sources,
                          ngram_history=history)
        logits = None
        if n_run == len(self.layers):
            x = collapse(h, pre)
            if not all_logits:
                last = jnp.clip(n_new_b - 1, 0, t - 1)
                x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
            logits = self.head(self.norm(x).astype(jnp.float32), jnp.float32)
        if not with_aux:
            return logits, new_cache
        hidden = [a.hidden_btd for a in layer_aux if a.hidden_btd is not None]
        aux = ForwardAux(expert_load_le=jnp.stack([a.expert_load_e for a in layer_aux]), layers=tuple(layer_aux),
                         views=pub.views,
                         hidden_btf=jnp.concatenate(hidden, axis=-1) if targets and len(hidden) == len(targets)
                         else None)
        return logits, new_cache, aux

    def image_span(self, patches_nc: jax.Array, n_vit_h: int, n_vit_w: int, n_llm_h: int, n_llm_w: int) -> jax.Array:
        """Embeddings [n_span, dim] of one image's prompt span (dsv41_jax.vision.image_span)."""
        return image_span(self, patches_nc, n_vit_h, n_vit_w, n_llm_h, n_llm_w)
