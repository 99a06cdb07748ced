"""CSA2 attention: window ring + compressed entries selected by the sparse indexer, one sink softmax.

One code path serves prefill, chunked prefill and decode: a forward processes T new tokens per
sequence on top of what the cache already holds (`Step.lengths`), `Step.n_new[b]` of them real (the
rest is right padding). A decode step is T == 1; it reads the packed cache through the decode-form
ops (what the Pallas kernels replace). For T > 1 the compressed entries are attended densely under
the top-k mask, which is the same set of keys (tests check that the two paths agree).

Quantize-dequantize happens where the release does it: window KV after norm + RoPE (FP8), compressed
latent after pooling + norm + RoPE (FP4/E4M3), indexer q and k after RoPE (FP4/E8M0). What attention
reads is always what the cache stores.

Index-key semantics (`ModelConfig.index_keys`), which differ only in decode steps:

- "consistent": every layer scores against its own kv source's keys, as in prefill.
- "released": what the released code does. A kv source republishes its keys into one shared slot only
  when a group completes, so at a decode step where a ratio-2 group is still filling, its layers score
  against the keys that were published last, whatever source published them (in the release: layer
  20's ratio-1 keys, read as if they were ratio-2 entries). The top-k indices found there still pick
  entries of the layer's own source. Chunked prefill keeps the consistent semantics (the release has
  no chunked prefill). The publisher before a decode step is derived from the position: a ratio-m
  source publishes at position q when (q + 1) % m == 0. The release's single-shot prefill also
  publishes a source whose last group is partial, which differs from that rule only when the
  highest kv source has a ratio above 1 (not the case in the release).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import kernels, ops
from dsv41_jax.cache import SourceCache
from dsv41_jax.layers import Linear, RMSNorm, released_fp8_linear
from dsv41_jax.plan import LayerPlan, Mode
from dsv41_jax.quant import CacheFormats, fake_quant, fake_quant_ste
from dsv41_jax.rope import apply_rope, inv_frequencies


@dataclass
class Step:
    """Trace-time state of one forward chunk, shared by the layers in order (sources publish first)."""

    pos: jax.Array  # int32 [B, T] absolute positions of the chunk's tokens
    lengths: jax.Array  # int32 [B] tokens in the cache before this chunk
    n_new: jax.Array  # int32 [B] real tokens in this chunk
    fmt: CacheFormats
    window: dict  # window ring records [L, B, W, ...], updated layer by layer
    window_start: jax.Array  # int32 [L, B]: layer l's ring holds no position below (Cache.window_start)
    sources: list  # SourceCache per kv source, updated by the source layers
    decode: bool  # T == 1: read packed records through the decode-form ops
    topk: jax.Array | None = None  # int32 [B, T, K] from the latest index source
    pool: jax.Array | None = None  # int32 [B, T, n_blocks] candidate source's pool: block ids, ascending, -1 padded
    kernel_backend: str = "jnp"
    key_owner: jax.Array | None = None  # int32 [B]: "released" decode, slot whose index keys are read
    extras: dict = field(default_factory=dict)
    # Quantization-aware training (dsv41_jax.train). Attention then reads straight-through fake-quant
    # views of what this chunk writes to the cache (f32, the stored values up to f32 rounding of the
    # STE sum; identity gradient), kept in `extras`: ("window", layer) [B, T, hd], ("main", slot)
    # [B, N, hd], ("index_keys", slot) [B, N, di]. The indexer's inputs are detached, and each
    # indexing layer appends {"layer", "scores" [B, T, N] (-inf outside the support), "q" [B, T, H, hd],
    # "keys" [B, N, hd], "scale"} to extras["indexer"] for the indexer's KL objective.
    training: bool = False


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


def _scatter_rows(arr: jax.Array, j_bg: jax.Array, rows: jax.Array) -> jax.Array:
    """arr[b, j[b, g]] = rows[b, g]; rows past the end of arr are dropped. Written per sequence (vmap: the
    batch is a batching dimension of the scatter), so that a mesh splitting the sequences keeps it local
    (global batch indices made GSPMD gather indices and rows onto every device)."""
    return jax.vmap(lambda a, j, r: a.at[j].set(r, mode="drop"))(arr, j_bg, rows.astype(arr.dtype))


def _ring_positions(length_b: jax.Array, w: int) -> jax.Array:
    """int32 [B, W]: the newest position p < length with p % W == slot (negative: empty slot)."""
    r = jnp.arange(w)
    last = length_b[:, None] - 1
    return last - jnp.mod(last - r, w)


def _take_rows(a_bnd: jax.Array, rows_bk: jax.Array) -> jax.Array:
    return jnp.take_along_axis(a_bnd, rows_bk[..., None], axis=1)


def _ext_index(v: jax.Array, lengths_b: jax.Array, m: int, t: int) -> jax.Array:
    """Virtual token v of (pending group ++ chunk) -> row of the compressor's [B, m + T, hd] extension
    (rows [0, m): the pending projections, of which lengths % m are real; rows m..: the chunk)."""
    held = (lengths_b % m)[:, None]
    return jnp.clip(jnp.where(v < held, v, m + v - held), 0, m + t - 1)


def pending_rows(kv_ext: jax.Array, sc_ext: jax.Array, lengths_b: jax.Array, n_new_b: jax.Array, m: int):
    """(pend_kv, pend_score) f32 [B, m, hd] after appending n_new_b of a chunk's tokens to sequences of
    lengths_b: the projections of the group left filling up (rows past its fill are garbage by contract).
    kv_ext / sc_ext: [B, m + T, hd], the pending rows followed by the chunk's projections."""
    total = lengths_b % m + n_new_b
    rows = _ext_index((total - total % m)[:, None] + jnp.arange(m)[None, :], lengths_b, m, kv_ext.shape[1] - m)
    return _take_rows(kv_ext, rows), _take_rows(sc_ext, rows)


class Compressor(nnx.Module):
    """m == 1: entry = RMSNorm(wkv x). m > 1: entry = RMSNorm(sum over the group of
    softmax_over_tokens(wgate x) * wkv x), non-overlapping groups of m tokens."""

    def __init__(self, cfg, ratio: int, *, rngs: nnx.Rngs):
        self.ratio = ratio
        self.wkv = Linear(cfg.dim, cfg.head_dim, rngs=rngs, dtype=cfg.param_dtype)
        if ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, rngs=rngs, dtype=cfg.param_dtype)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def __call__(self, x_btd: jax.Array, step: Step, src: SourceCache):
        """Returns (latent [B, G, hd] before RoPE, entry index j [B, G], pend_kv, pend_score)."""
        m = self.ratio
        b, t, _ = x_btd.shape
        if m == 1:
            j = step.lengths[:, None] + jnp.arange(t)
            return self.norm(self.wkv(x_btd)), j, src.pend_kv, src.pend_score
        # the pooling runs in f32 (the release promotes these weights to f32)
        xf = x_btd.astype(jnp.float32)
        kv_ext = jnp.concatenate([src.pend_kv, self.wkv(xf)], axis=1)  # [B, m + T, hd]
        sc_ext = jnp.concatenate([src.pend_score, self.wgate(xf)], axis=1)
        ext_index = lambda v: _ext_index(v, step.lengths, m, t)

        g = (m - 1 + t) // m
        rows = ext_index(jnp.arange(g * m)[None, :])  # [B, G*m]
        kv = _take_rows(kv_ext, rows).reshape(b, g, m, -1)
        sc = _take_rows(sc_ext, rows).reshape(b, g, m, -1)
        pooled = jnp.sum(jax.nn.softmax(sc, axis=2) * kv, axis=2)
        j = (step.lengths // m)[:, None] + jnp.arange(g)
        if "pending_ext" in step.extras:  # speculative verify: dsv41_jax.dspark.commit re-cuts the pending group
            step.extras["pending_ext"].append((kv_ext, sc_ext))
        pend_kv, pend_score = pending_rows(kv_ext, sc_ext, step.lengths, step.n_new, m)
        return self.norm(pooled.astype(x_btd.dtype)), j, pend_kv, pend_score


class Indexer(nnx.Module):
    """Scores compressed positions for each query: sum_h w_h * ReLU(q_h . k), keeps the top `index_topk`.

    A kv source also owns the key projection (wk, k_norm) applied to its compressed latent.
    """

    def __init__(self, cfg, owns_keys: bool, *, rngs: nnx.Rngs):
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = released_fp8_linear(cfg, cfg.q_lora_rank, hi * di, rngs=rngs)
        self.weights_proj = Linear(cfg.dim, hi, rngs=rngs, dtype=cfg.param_dtype)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, di, rngs=rngs, dtype=cfg.param_dtype)
            self.k_norm = RMSNorm(di, cfg.norm_eps)
        self.n_heads, self.head_dim = hi, di
        self.weight_scale = di ** -0.5 * hi ** -0.5

    def keys(self, latent_bgd: jax.Array, gpos_bg: jax.Array, inv_freq) -> jax.Array:
        return apply_rope(self.k_norm(self.wk(latent_bgd)), gpos_bg, inv_freq)

    def query(self, x_btd, qr_btr, pos_bt, inv_freq, fmt: CacheFormats, ste: bool = False, backend: str = "jnp"):
        b, t, _ = x_btd.shape
        q = self.wq_b(qr_btr, backend=backend).reshape(b, t, self.n_heads, self.head_dim)
        q = (fake_quant_ste if ste else fake_quant)(fmt.index_key, apply_rope(q, pos_bt, inv_freq))
        w = self.weights_proj(x_btd, jnp.float32) * self.weight_scale
        return q, w


class Attention(nnx.Module):
    def __init__(self, cfg, plan: LayerPlan, *, rngs: nnx.Rngs):
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
            self.indexer = Indexer(cfg, owns_keys=plan.compresses, rngs=rngs)
        self.scale = hd ** -0.5

    @property
    def inv_freq(self):
        c, p = self.cfg, self.plan
        return inv_frequencies(c.rope_head_dim, p.rope_theta, p.yarn, c.original_seq_len, c.rope_factor,
                               c.beta_fast, c.beta_slow)

    # ------------------------------------------------------------------ pieces
    def _publish_source(self, x_btd: jax.Array, step: Step) -> None:
        """Kv source: compress this chunk, write main KV and indexer keys into its cache slot."""
        slot, m = self.plan.source_slot, self.plan.ratio
        src: SourceCache = step.sources[slot]
        latent, j, pend_kv, pend_score = self.compressor(x_btd, step, src)
        gpos = j * m  # an entry is rotated at its group's first position
        # training: the indexer learns from its KL alone, so the backbone gets no gradient through it
        keys = self.indexer.keys(jax.lax.stop_gradient(latent) if step.training else latent, gpos, self.inv_freq)
        main = apply_rope(latent, gpos, self.inv_freq)
        enc_k, enc_m = step.fmt.index_key.encode(keys), step.fmt.main_kv.encode(main)
        if step.training:
            for name, codec, old, new in (("main", step.fmt.main_kv, src.entries, main),
                                          ("index_keys", step.fmt.index_key, src.index_keys, keys)):
                view = fake_quant_ste(codec, new.astype(jnp.float32))
                step.extras[(name, slot)] = _scatter_rows(codec.decode(old), j, view)
        step.sources[slot] = SourceCache(
            entries=jax.tree.map(lambda a, r: _scatter_rows(a, j, r), src.entries, enc_m),
            index_keys=jax.tree.map(lambda a, r: _scatter_rows(a, j, r), src.index_keys, enc_k),
            pend_kv=pend_kv, pend_score=pend_score,
        )
        if step.key_owner is not None:  # "released": republished only when this step completes a group
            completes = (step.pos[:, 0] + 1) % m == 0
            step.key_owner = jnp.where(completes, slot, step.key_owner)

    def _select(self, x_btd, qr_btr, step: Step) -> jax.Array:
        """Indexer + top-k for this layer (FULL / REINDEX): int32 [B, T, index_topk] positions.

        The candidate source publishes its pool (`step.pool`) from the block maxima of its scores. A
        layer inside the pool scores only the pool's positions in decode (its cost stops growing with
        the context); for T > 1 it scores everything and masks to the pool. Both select the same set.
        """
        cfg, p = self.cfg, self.plan
        block, backend = cfg.candidate_block_size, step.kernel_backend
        if step.training:  # detached: the LM loss does not reach the indexer, its KL not the backbone
            x_btd, qr_btr = jax.lax.stop_gradient(x_btd), jax.lax.stop_gradient(qr_btr)
        q, w = self.indexer.query(x_btd, qr_btr, step.pos, self.inv_freq, step.fmt, ste=step.training,
                                  backend=step.kernel_backend)
        reach = (step.pos + 1) // p.ratio  # [B, T] entries whose group the query has completed
        if step.decode and p.uses_candidates:
            return self._select_in_pool(q[:, 0], w[:, 0], reach[:, 0], step)[:, None]
        if step.decode:
            scores, bmax = self._scores_decode(q[:, 0], w[:, 0], reach[:, 0], step)
        else:
            scores = self._scores_dense(q, w, reach, step)
            bmax = ops.block_maxima(scores, block) if p.is_candidate_source else None
        if step.training:
            step.extras.setdefault("indexer", []).append({"layer": p.layer, "scores": scores})
        if p.is_candidate_source:
            step.pool = kernels.candidate_blocks(bmax, reach, cfg.candidate_topk_blocks, block, backend=backend)
        return kernels.select_topk(scores, cfg.index_topk, backend=backend)

    def _scores_decode(self, q_bhd, w_bh, reach_b, step: Step):
        """(f32 [B, 1, N] scores of every compressed position, -inf where unreachable; for the candidate
        source also their block maxima f32 [B, 1, NB], which the scan kernel writes in the same pass)."""
        block = self.cfg.candidate_block_size if self.plan.is_candidate_source else None
        out = kernels.indexer_scores_decode(q_bhd, w_bh, self._decode_keys(step), reach_b, step.fmt.index_key,
                                            block=block, backend=step.kernel_backend)
        if block is None:
            return out[:, None], None
        return out[0][:, None], out[1][:, None]

    def _scores_dense(self, q, w, reach, step: Step) -> jax.Array:
        """f32 [B, T, N] scores of every compressed position (T > 1 / training), -inf where unreachable
        or outside the candidate pool (a layer that uses it)."""
        cfg, p = self.cfg, self.plan
        keys = (step.extras[("index_keys", p.source_slot)] if step.training
                else step.fmt.index_key.decode(step.sources[p.source_slot].index_keys))
        scores = ops.mask_unreachable(ops.indexer_scores(q, w, keys), reach)
        if p.uses_candidates:
            pool = ops.blocks_to_mask(step.pool, scores.shape[-1], cfg.candidate_block_size)
            scores = jnp.where(pool, scores, ops.NEG_INF)
        return scores

    def _select_in_pool(self, q_bhd, w_bh, reach_b, step: Step) -> jax.Array:
        """Decode top-k of a layer inside the candidate pool: int32 [B, index_topk] positions, from the
        scores of the pool's K * block positions only (the same set as the masked full scan)."""
        cfg, block, backend = self.cfg, self.cfg.candidate_block_size, step.kernel_backend
        blocks = step.pool[:, 0]
        scores = kernels.indexer_scores_pool_decode(q_bhd, w_bh, self._decode_keys(step), blocks, block, reach_b,
                                                    step.fmt.index_key, backend=backend)
        return kernels.select_pool_topk(scores, blocks, block, cfg.index_topk, backend=backend)

    def _decode_keys(self, step: Step) -> dict:
        """Index-key records [B, N, ...] a decode step scores against: this layer's source's, or with
        "released" semantics those of the slot each sequence reads (module docstring), sized like them."""
        own = step.sources[self.plan.source_slot].index_keys
        if step.key_owner is None:
            return own
        n = jax.tree.leaves(own)[0].shape[1]
        out = own
        for slot, src in enumerate(step.sources):
            pick = step.key_owner == slot
            out = jax.tree.map(lambda o, a: jnp.where(pick.reshape(-1, *([1] * (a.ndim - 1))), a, o),
                               out, _resize_rows(src.index_keys, n))
        return out

    def _window(self, kv_btd: jax.Array, step: Step):
        """Write this chunk's window rows into the ring; return (ring records, old ring records)."""
        l, w = self.plan.layer, self.cfg.window_size
        rec = step.fmt.window_kv.encode(kv_btd)
        old = jax.tree.map(lambda a: a[l], step.window)
        ring_pos = _ring_positions(step.lengths + step.n_new, w)  # [B, W] after this chunk
        from_chunk = ring_pos >= step.lengths[:, None]
        t_idx = jnp.clip(ring_pos - step.lengths[:, None], 0, kv_btd.shape[1] - 1)

        def upd(o, c):
            picked = jnp.take_along_axis(c, t_idx.reshape(*t_idx.shape, *([1] * (c.ndim - 2))), axis=1)
            sel = from_chunk.reshape(*from_chunk.shape, *([1] * (c.ndim - 2)))
            return jnp.where(sel, picked, o)

        new = jax.tree.map(upd, old, rec)
        step.window = jax.tree.map(lambda a, n: a.at[l].set(n), step.window, new)
        return rec, old, new

    # ------------------------------------------------------------------ forward
    def __call__(self, x_btd: jax.Array, step: Step) -> jax.Array:
        cfg, p = self.cfg, self.plan
        b, t, _ = x_btd.shape
        h, hd, w = cfg.n_heads, cfg.head_dim, cfg.window_size
        be = step.kernel_backend
        qr = self.q_norm(self.wq_a(x_btd, backend=be))
        q = apply_rope(self.wq_b(qr, backend=be).reshape(b, t, h, hd), step.pos, self.inv_freq)
        kv = apply_rope(self.kv_norm(self.wkv(x_btd, backend=be)), step.pos, self.inv_freq)
        chunk_rec, old_ring, new_ring = self._window(kv, step)

        idx = None
        if p.compresses:
            self._publish_source(x_btd, step)
        if p.has_indexer:
            idx = self._select(x_btd, qr, step)
            step.topk = idx
        elif p.mode is Mode.REUSE:
            idx = step.topk
        fmt = step.fmt
        src = step.sources[p.source_slot] if p.mode is not Mode.WINDOW else None

        start = step.window_start[p.layer][:, None]  # [B, 1]: older ring slots are empty
        if step.decode:
            valid = _ring_positions(step.lengths + step.n_new, w) >= start
            if src is None:
                ring = fmt.window_kv.decode(new_ring)
                o = ops.attend(q, ring, valid[:, None], self.attn_sink[...], self.scale)
            else:
                o = kernels.sparse_attention_decode(
                    q[:, 0], new_ring, valid, fmt.window_kv, src.entries, idx[:, 0], fmt.main_kv,
                    self.attn_sink[...], self.scale, backend=step.kernel_backend)[:, None]
        else:
            old_pos = _ring_positions(step.lengths, w)  # [B, W]
            kpos = jnp.concatenate([old_pos, step.pos], axis=1)  # [B, W + T]
            qp = step.pos[:, :, None]
            mask = (kpos[:, None, :] >= start[:, :, None]) & (kpos[:, None, :] <= qp) & (kpos[:, None, :] > qp - w)
            if step.training:
                chunk_kv = step.extras[("window", p.layer)] = fake_quant_ste(fmt.window_kv, kv.astype(jnp.float32))
            else:
                chunk_kv = fmt.window_kv.decode(chunk_rec)
            keys = jnp.concatenate([fmt.window_kv.decode(old_ring), chunk_kv], axis=1)
            if src is not None:
                entries = step.extras[("main", p.source_slot)] if step.training else fmt.main_kv.decode(src.entries)
                if step.training and p.has_indexer:  # the KL target: this layer's attention over the entries
                    step.extras["indexer"][-1].update(q=q, keys=entries, scale=self.scale)
                keys = jnp.concatenate([keys, entries], axis=1)
                mask = jnp.concatenate([mask, ops.topk_to_mask(idx, entries.shape[1])], axis=2)
            o = ops.attend(q, keys, mask, self.attn_sink[...], self.scale)

        return self.project_out(o, step.pos, x_btd.dtype, be)

    def project_out(self, o_bthd: jax.Array, pos_bt: jax.Array, dtype, backend: str) -> jax.Array:
        """Attention output f32 [B, T, H, hd] -> [B, T, dim] in `dtype`: the query's rotation taken off
        the rope dims, then the grouped low-rank projection (wo_a per group of heads, then wo_b)."""
        cfg = self.cfg
        b, t, h, hd = o_bthd.shape
        o = apply_rope(o_bthd, pos_bt, self.inv_freq, inverse=True).astype(dtype)
        g = cfg.o_groups
        o = o.reshape(b, t, g, h * hd // g)
        wo_a = self.wo_a.weight[...].reshape(g, cfg.o_lora_rank, -1).astype(o.dtype)
        o = jnp.einsum("btgd,grd->btgr", o, wo_a, preferred_element_type=jnp.float32).astype(o.dtype)
        return self.wo_b(o.reshape(b, t, g * cfg.o_lora_rank), backend=backend)
