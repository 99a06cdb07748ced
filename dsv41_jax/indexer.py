"""The sparse indexer: scores compressed positions for each query, keeps the top `index_topk`.

score[n] = sum_h w_h * ReLU(q_h . k_n) over the indexer heads, against the index keys of the layer's
kv source (FP4/E8M0 after RoPE, as stored). The candidate source publishes a pool of
`candidate_topk_blocks` blocks of `candidate_block_size` positions from the block maxima of its scores;
a layer that uses the pool scores only its positions in decode (its cost stops growing with the
context), and for T > 1 scores everything and masks to the pool: both select the same set.

Index-key semantics (`ModelConfig.index_keys`), which differ only in decode steps:

- "consistent": every layer scores against its own kv source's keys, as in prefill.
- "released": what the released code does. A kv source republishes its keys into one shared slot only
  when a group completes, so at a decode step where a ratio-2 group is still filling, its layers score
  against the keys that were published last, whatever source published them (in the release: layer
  20's ratio-1 keys, read as if they were ratio-2 entries). The top-k indices found there still pick
  entries of the layer's own source. Chunked prefill keeps the consistent semantics (the release has
  no chunked prefill). The publisher before a decode step is derived from the position: a ratio-m
  source publishes at position q when (q + 1) % m == 0 (`released_key_owner`; the sources update it
  as they publish, `Published.key_owner_b`). The release's single-shot prefill also publishes a
  source whose last group is partial, which differs from that rule only when the highest kv source
  has a ratio above 1 (not the case in the release).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import kernels, ops
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers import Linear, RMSNorm, released_fp8_linear
from dsv41_jax.plan import LayerPlan
from dsv41_jax.quant import fake_quant, fake_quant_ste
from dsv41_jax.rope import apply_rope
from dsv41_jax.step import Published, StepInputs


def released_key_owner(source_ratios: tuple[int, ...], lengths_b: jax.Array) -> jax.Array:
    """int32 [B]: the kv-source slot that published index keys last before position lengths[b].

    Source s (ratio m_s) publishes at position q when (q + 1) % m_s == 0; sources publish in layer
    (slot) order, so the newest position with a publisher wins and within it the highest slot.
    -1 when nothing was published (an empty cache).
    """
    owner = jnp.full_like(lengths_b, -1)
    for back in range(math.lcm(*source_ratios), 0, -1):  # oldest first: newer positions overwrite
        q = lengths_b - back
        for slot, m in enumerate(source_ratios):
            owner = jnp.where((q >= 0) & ((q + 1) % m == 0), slot, owner)
    return owner.astype(jnp.int32)


def _resize_rows(rec: dict, n: int) -> dict:
    """Records [B, N', ...] cut or zero-padded to [B, n, ...] (rows past n are never reachable)."""
    def fit(a):
        if a.shape[1] >= n:
            return a[:, :n]
        return jnp.pad(a, [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
    return jax.tree.map(fit, rec)


class Indexer(nnx.Module):
    """The indexer of a FULL / REINDEX layer; a kv source's also owns the key projection (wk, k_norm)
    applied to its compressed latent."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, *, rngs: nnx.Rngs):
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = released_fp8_linear(cfg, cfg.q_lora_rank, hi * di, rngs=rngs)
        self.weights_proj = Linear(cfg.dim, hi, rngs=rngs, dtype=cfg.param_dtype)
        if plan.compresses:
            self.wk = Linear(cfg.head_dim, di, rngs=rngs, dtype=cfg.param_dtype)
            self.k_norm = RMSNorm(di, cfg.norm_eps)
        self.cfg, self.plan = cfg, plan
        self.n_heads, self.head_dim = hi, di
        self.weight_scale = di ** -0.5 * hi ** -0.5

    def keys(self, latent_bgd: jax.Array, gpos_bg: jax.Array, inv_freq) -> jax.Array:
        """Index keys [B, G, di] (before FP4) of a kv source's compressed latents at positions gpos."""
        return apply_rope(self.k_norm(self.wk(latent_bgd)), gpos_bg, inv_freq)

    def query(self, x_btd, qr_btr, pos_bt, inv_freq, inp: StepInputs):
        """(q [B, T, hi, di] after RoPE and FP4 fake quantization, head weights w f32 [B, T, hi])."""
        b, t, _ = x_btd.shape
        q_bthd = self.wq_b(qr_btr, kernels=inp.kernels).reshape(b, t, self.n_heads, self.head_dim)
        q_bthd = (fake_quant_ste if inp.training else fake_quant)(inp.fmt.index_key, apply_rope(q_bthd, pos_bt, inv_freq))
        w_bth = self.weights_proj(x_btd, jnp.float32) * self.weight_scale
        return q_bthd, w_bth

    def select(self, x_btd: jax.Array, qr_btr: jax.Array, inv_freq, inp: StepInputs, pub: Published):
        """Top-k of this layer: (int32 [B, T, index_topk] positions, the candidate pool after this layer
        (this layer's when it is the candidate source, else `pub.pool_btn`), the scores f32 [B, T, N] of
        every compressed position (-inf outside the support) when training, else None)."""
        cfg, p = self.cfg, self.plan
        block = cfg.candidate_block_size
        if inp.training:  # detached: the LM loss does not reach the indexer, its KL not the backbone
            x_btd, qr_btr = jax.lax.stop_gradient(x_btd), jax.lax.stop_gradient(qr_btr)
        q_bthd, w_bth = self.query(x_btd, qr_btr, inp.pos_bt, inv_freq, inp)
        reach_bt = (inp.pos_bt + 1) // p.ratio  # entries whose group the query has completed
        if inp.decode and p.uses_candidates:
            topk_bk = self._select_in_pool(q_bthd[:, 0], w_bth[:, 0], reach_bt[:, 0], inp, pub)
            return topk_bk[:, None], pub.pool_btn, None
        if inp.decode:
            scores_btn, bmax = self._scores_decode(q_bthd[:, 0], w_bth[:, 0], reach_bt[:, 0], inp, pub)
        else:
            scores_btn = self._scores_dense(q_bthd, w_bth, reach_bt, inp, pub)
            bmax = ops.block_maxima(scores_btn, block) if p.is_candidate_source else None
        pool_btn = pub.pool_btn
        if p.is_candidate_source:
            pool_btn = kernels.candidate_blocks(bmax, reach_bt, cfg.candidate_topk_blocks, block, kernels=inp.kernels)
        topk_btk = kernels.select_topk(scores_btn, cfg.index_topk, kernels=inp.kernels)
        return topk_btk, pool_btn, scores_btn if inp.training else None

    def _scores_decode(self, q_bhd, w_bh, reach_b, inp: StepInputs, pub: Published):
        """(f32 [B, 1, N] scores of every compressed position, -inf where unreachable; for the candidate
        source also their block maxima f32 [B, 1, NB], which the scan kernel writes in the same pass)."""
        block = self.cfg.candidate_block_size if self.plan.is_candidate_source else None
        out = kernels.indexer_scores_decode(q_bhd, w_bh, self._decode_keys(pub), reach_b, inp.fmt.index_key,
                                            block=block, kernels=inp.kernels)
        if block is None:
            return out[:, None], None
        return out[0][:, None], out[1][:, None]

    def _scores_dense(self, q_bthd, w_bth, reach_bt, inp: StepInputs, pub: Published) -> jax.Array:
        """f32 [B, T, N] scores of every compressed position (T > 1 / training), -inf where unreachable
        or outside the candidate pool (a layer that uses it)."""
        cfg, p = self.cfg, self.plan
        keys_bnd = (pub.views[p.source_slot][1] if inp.training
                    else inp.fmt.index_key.decode(pub.sources[p.source_slot].index_keys))
        scores_btn = ops.mask_unreachable(ops.indexer_scores(q_bthd, w_bth, keys_bnd), reach_bt)
        if p.uses_candidates:
            pool = ops.blocks_to_mask(pub.pool_btn, scores_btn.shape[-1], cfg.candidate_block_size)
            scores_btn = jnp.where(pool, scores_btn, ops.NEG_INF)
        return scores_btn

    def _select_in_pool(self, q_bhd, w_bh, reach_b, inp: StepInputs, pub: Published) -> jax.Array:
        """Decode top-k of a layer inside the candidate pool: int32 [B, index_topk] positions, from the
        scores of the pool's K * block positions only (the same set as the masked full scan)."""
        cfg, block = self.cfg, self.cfg.candidate_block_size
        blocks_bk = pub.pool_btn[:, 0]
        scores = kernels.indexer_scores_pool_decode(q_bhd, w_bh, self._decode_keys(pub), blocks_bk, block, reach_b,
                                                    inp.fmt.index_key, kernels=inp.kernels)
        return kernels.select_pool_topk(scores, blocks_bk, block, cfg.index_topk, kernels=inp.kernels)

    def _decode_keys(self, pub: Published) -> dict:
        """Index-key records [B, N, ...] a decode step scores against: this layer's source's, or with
        "released" semantics those of the slot each sequence reads (module docstring), sized like them."""
        own = pub.sources[self.plan.source_slot].index_keys
        if pub.key_owner_b is None:
            return own
        n = jax.tree.leaves(own)[0].shape[1]
        out = own
        for slot, src in enumerate(pub.sources):
            pick = pub.key_owner_b == slot
            out = jax.tree.map(lambda o, a: jnp.where(pick.reshape(-1, *([1] * (a.ndim - 1))), a, o),
                               out, _resize_rows(src.index_keys, n))
        return out
