"""CSA2 attention proper: window ring + compressed entries selected by the indexer, one sink softmax.

One code path serves prefill, chunked prefill and decode: a forward processes T new tokens per
sequence on top of what the cache already holds (`StepInputs.lengths_b`), `n_new_b[b]` of them real
(the rest is right padding). A decode step is T == 1; it reads the packed cache through the
decode-form ops (what the Pallas kernels replace). For T > 1 the compressed entries are attended
densely under the top-k mask, which is the same set of keys (tests check that the two paths agree).

A layer takes the chunk's frozen `StepInputs`, its window ring and what the earlier layers published
(`Published`), and returns its output, its ring after the chunk and what it publishes: a kv source
its cache slot (`compressor.py` pools the chunk, the indexer's key projection makes its index keys),
an indexing layer its top-k and, as the candidate source, the pool (`indexer.py`). See
docs/ARCHITECTURE.md for the data flow of a whole step.

Quantize-dequantize happens where the release does it: window KV after norm + RoPE (FP8), compressed
latent after pooling + norm + RoPE (FP4/E4M3), indexer q and k after RoPE (FP4/E8M0). What attention
reads is always what the cache stores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import kernels, ops
from dsv41_jax.cache import SourceCache
from dsv41_jax.compressor import Compressor, scatter_rows
from dsv41_jax.config import ModelConfig
from dsv41_jax.indexer import Indexer
from dsv41_jax.layers import Linear, RMSNorm, linears, released_fp8_linear, rms_norms
from dsv41_jax.plan import LayerPlan, Mode
from dsv41_jax.quant import fake_quant_ste
from dsv41_jax.rope import apply_rope, inv_frequencies
from dsv41_jax.step import IndexerRecord, LayerAux, Published, StepInputs


def ring_positions(length_b: jax.Array, w: int) -> jax.Array:
    """int32 [B, W]: the newest position p < length with p % W == slot (negative: empty slot)."""
    r = jnp.arange(w)
    last = length_b[:, None] - 1
    return last - jnp.mod(last - r, w)


def write_ring(ring: dict, kv_btd: jax.Array, lengths_b: jax.Array, n_new_b: jax.Array, codec):
    """One layer's window ring (records [B, W, ...]) after appending a chunk's window KV kv [B, T, hd]
    (n_new_b real rows) to sequences of lengths_b. Returns (the chunk's records [B, T, ...], the ring)."""
    chunk = codec.encode(kv_btd)
    w = jax.tree.leaves(ring)[0].shape[1]
    ring_pos = ring_positions(lengths_b + n_new_b, w)  # [B, W] after this chunk
    from_chunk = ring_pos >= lengths_b[:, None]
    t_idx = jnp.clip(ring_pos - lengths_b[:, None], 0, kv_btd.shape[1] - 1)

    def upd(o, c):
        picked = jnp.take_along_axis(c, t_idx.reshape(*t_idx.shape, *([1] * (c.ndim - 2))), axis=1)
        sel = from_chunk.reshape(*from_chunk.shape, *([1] * (c.ndim - 2)))
        return jnp.where(sel, picked, o)

    return chunk, jax.tree.map(upd, ring, chunk)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan, *, rngs: nnx.Rngs):
        dt = cfg.param_dtype
        self.plan = plan
        self.cfg = cfg
        h, hd = cfg.n_heads, cfg.head_dim
        self.wq_a = released_fp8_linear(cfg, cfg.dim, cfg.q_lora_rank, rngs=rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = released_fp8_linear(cfg, cfg.q_lora_rank, h * hd, rngs=rngs)
        self.wkv = released_fp8_linear(cfg, cfg.dim, hd, rngs=rngs)
        self.kv_norm = RMSNorm(hd, cfg.norm_eps)
        # grouped low-rank output: group g projects its own heads [h/G * hd] -> o_lora, then wo_b.
        # wo_a ships in FP8 but the release dequantizes it at conversion and runs it unquantized.
        self.wo_a = Linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, rngs=rngs, dtype=dt)
        self.wo_b = released_fp8_linear(cfg, cfg.o_groups * cfg.o_lora_rank, cfg.dim, rngs=rngs)
        self.attn_sink = nnx.Param(jnp.zeros((h,), jnp.float32))
        if plan.compresses:
            self.compressor = Compressor(cfg, plan.ratio, rngs=rngs)
        if plan.has_indexer:
            self.indexer = Indexer(cfg, plan, rngs=rngs)
        self.scale = hd ** -0.5

    @property
    def inv_freq(self):
        c, p = self.cfg, self.plan
        return inv_frequencies(c.rope_head_dim, p.rope_theta, p.yarn, c.original_seq_len, c.rope_factor,
                               c.beta_fast, c.beta_slow)

    def _publish_source(self, x_btd: jax.Array, inp: StepInputs, pub: Published):
        """Kv source: compress this chunk into main KV and index keys, write them into its cache slot.
        Returns (`pub` with the slot (and in training its views) replaced, the compressor's extension)."""
        slot, m = self.plan.source_slot, self.plan.ratio
        src: SourceCache = pub.sources[slot]
        latent_bgd, j_bg, pend_kv, pend_score, ext = self.compressor(x_btd, inp.lengths_b, inp.n_new_b, src)
        gpos_bg = j_bg * m  # an entry is rotated at its group's first position
        # training: the indexer learns from its KL alone, so the backbone gets no gradient through it
        keys_bgd = self.indexer.keys(jax.lax.stop_gradient(latent_bgd) if inp.training else latent_bgd, gpos_bg,
                                     self.inv_freq)
        main_bgd = apply_rope(latent_bgd, gpos_bg, self.inv_freq)
        fmt = inp.fmt
        enc_k, enc_m = fmt.index_key.encode(keys_bgd), fmt.main_kv.encode(main_bgd)
        views = pub.views
        if inp.training:
            view = lambda codec, old, new: scatter_rows(codec.decode(old), j_bg,
                                                        fake_quant_ste(codec, new.astype(jnp.float32)))
            slot_views = (view(fmt.main_kv, src.entries, main_bgd), view(fmt.index_key, src.index_keys, keys_bgd))
            views = views[:slot] + (slot_views,) + views[slot + 1:]
        new_src = SourceCache(
            entries=jax.tree.map(lambda a, r: scatter_rows(a, j_bg, r), src.entries, enc_m),
            index_keys=jax.tree.map(lambda a, r: scatter_rows(a, j_bg, r), src.index_keys, enc_k),
            pend_kv=pend_kv, pend_score=pend_score,
        )
        key_owner_b = pub.key_owner_b
        if key_owner_b is not None:  # "released": republished only when this step completes a group
            completes = (inp.pos_bt[:, 0] + 1) % m == 0
            key_owner_b = jnp.where(completes, slot, key_owner_b)
        sources = pub.sources[:slot] + (new_src,) + pub.sources[slot + 1:]
        return dataclasses.replace(pub, sources=sources, views=views, key_owner_b=key_owner_b), ext

    def __call__(self, x_btd: jax.Array, inp: StepInputs, ring: dict, pub: Published):
        """x [B, T, dim] -> (out [B, T, dim], this layer's ring records [B, W, ...] after the chunk, the
        `Published` the next layer reads, `LayerAux`). `ring`: this layer's ring before the chunk."""
        cfg, p = self.cfg, self.plan
        b, t, _ = x_btd.shape
        h, hd, w = cfg.n_heads, cfg.head_dim, cfg.window_size
        fmt, pos_bt, lengths_b = inp.fmt, inp.pos_bt, inp.lengths_b
        qa_btr, kv_btd = linears(x_btd, [self.wq_a, self.wkv], jnp.float32, kernels=inp.kernels)
        qr_btr, kv_btd = rms_norms([qa_btr, kv_btd], [self.q_norm, self.kv_norm], x_btd.dtype, kernels=inp.kernels)
        q_bthd = apply_rope(self.wq_b(qr_btr, kernels=inp.kernels).reshape(b, t, h, hd), pos_bt, self.inv_freq)
        kv_btd = apply_rope(kv_btd, pos_bt, self.inv_freq)
        chunk_rec, new_ring = write_ring(ring, kv_btd, lengths_b, inp.n_new_b, fmt.window_kv)

        ext = scores_btn = None
        if p.compresses:
            pub, ext = self._publish_source(x_btd, inp, pub)
        if p.has_indexer:
            topk_btk, pool_btn, scores_btn = self.indexer.select(x_btd, qr_btr, self.inv_freq, inp, pub)
            pub = dataclasses.replace(pub, topk_btk=topk_btk, pool_btn=pool_btn)
        topk_btk = pub.topk_btk if p.mode is not Mode.WINDOW else None
        src = pub.sources[p.source_slot] if p.mode is not Mode.WINDOW else None

        window_view = record = None
        start_b1 = inp.window_start_lb[p.layer][:, None]  # older ring slots are empty
        if inp.decode:
            valid_bw = ring_positions(lengths_b + inp.n_new_b, w) >= start_b1
            if src is not None:  # its output comes with the rotation taken off, in the model's dtype
                o_bhd = kernels.sparse_attention_decode(
                    q_bthd[:, 0], new_ring, valid_bw, fmt.window_kv, src.entries, topk_btk[:, 0], fmt.main_kv,
                    self.attn_sink[...], self.scale, pos_bt[:, 0], self.inv_freq, x_btd.dtype, kernels=inp.kernels)
                return self.project(o_bhd[:, None], inp.kernels), new_ring, pub, LayerAux(window_view, record, ext)
            o_bthd = ops.attend(q_bthd, fmt.window_kv.decode(new_ring), valid_bw[:, None], self.attn_sink[...],
                                self.scale)
        else:
            old_pos_bw = ring_positions(lengths_b, w)
            kpos_bk = jnp.concatenate([old_pos_bw, pos_bt], axis=1)  # [B, W + T]
            qp = pos_bt[:, :, None]
            kp = kpos_bk[:, None, :]
            mask_btk = (kp >= start_b1[:, :, None]) & (kp <= qp) & (kp > qp - w)
            if inp.training:
                chunk_btd = window_view = fake_quant_ste(fmt.window_kv, kv_btd.astype(jnp.float32))
            else:
                chunk_btd = fmt.window_kv.decode(chunk_rec)
            keys_bkd = jnp.concatenate([fmt.window_kv.decode(ring), chunk_btd], axis=1)
            if src is not None:
                entries_bnd = pub.views[p.source_slot][0] if inp.training else fmt.main_kv.decode(src.entries)
                if inp.training and p.has_indexer:  # the KL target: this layer's attention over the entries
                    record = IndexerRecord(p.layer, scores_btn, q_bthd, entries_bnd, self.scale)
                keys_bkd = jnp.concatenate([keys_bkd, entries_bnd], axis=1)
                mask_btk = jnp.concatenate([mask_btk, ops.topk_to_mask(topk_btk, entries_bnd.shape[1])], axis=2)
            o_bthd = ops.attend(q_bthd, keys_bkd, mask_btk, self.attn_sink[...], self.scale)

        out_btd = self.project_out(o_bthd, pos_bt, x_btd.dtype, inp.kernels)
        return out_btd, new_ring, pub, LayerAux(window_view, record, ext)

    def project_out(self, o_bthd: jax.Array, pos_bt: jax.Array, dtype, kernels: str) -> jax.Array:
        """Attention output f32 [B, T, H, hd] -> [B, T, dim] in `dtype`: the query's rotation taken off
        the rope dims, then the grouped low-rank projection (wo_a per group of heads, then wo_b)."""
        return self.project(apply_rope(o_bthd, pos_bt, self.inv_freq, inverse=True).astype(dtype), kernels)

    def project(self, o_bthd: jax.Array, kernels: str) -> jax.Array:
        """`project_out` after the rotation: o [B, T, H, hd] in the model's dtype -> [B, T, dim]."""
        cfg = self.cfg
        b, t, h, hd = o_bthd.shape
        g, dtype = cfg.o_groups, o_bthd.dtype
        o_btgd = o_bthd.reshape(b, t, g, h * hd // g)
        wo_a_grd = self.wo_a.weight[...].reshape(g, cfg.o_lora_rank, -1).astype(dtype)
        o_btgr = jnp.einsum("btgd,grd->btgr", o_btgd, wo_a_grd, preferred_element_type=jnp.float32).astype(dtype)
        return self.wo_b(o_btgr.reshape(b, t, g * cfg.o_lora_rank), kernels=kernels)
