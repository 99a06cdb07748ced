"""DSpark, the release's speculative decoding: the draft stages (`mtp.*`), their draft forward, and the
lossless draft-verify-commit step around them.

The draft (the release's `forward_spec`, decode branch). Sequence b holds n = lengths[b] tokens in the
target's cache and t0 = its newest token, not cached yet (position n). Stage 0 turns the target's hidden
streams (`Transformer.forward`'s aux `hidden_btf`: the inputs of `dspark_target_layer_ids`, averaged
over the hc copies) into main_x = main_norm(main_proj(hidden)); every stage s keeps a window ring of its
own main KV of main_x at the committed positions (FP8 like the backbone's rings; positions implied by
the target's lengths: slot r holds the newest p < n with p % W == r). A block of K = dspark_block_size
slots at positions n..n+K-1 holds [t0, noise, ..., noise]: embedded, copied to the hc streams, run
through the stages (mHC blocks whose attention sees the stage's whole ring plus the whole block, no
causal mask inside the block; window-only rope), collapsed, normed by the last stage and read by the
shared head. Slot i predicts the token at n+i+1; the last stage's Markov head adds a low-rank bigram
bias from the token at slot i (t0, then the previous draft), and the draft d_{i+1} is sampled from
that, one slot after another. The confidence head scores each slot from (hidden, Markov embedding).

The step (`speculative_step`, all shapes static):

1. draft d_1..d_K as above (greedy at temperature 0, else sampled at the row's temperature);
2. verify: one target forward over [t0, d_1..d_K] (K+1 tokens at n..n+K, the chunk path), all logits;
3. accept: at temperature 0 the longest prefix with d_i == argmax p_i; when sampling, the standard
   speculative-sampling rule (accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
   rejection draw from normalize(max(0, p_i - q_i)); if all K pass, draw the bonus from p_{K+1}), whose
   output is distributed exactly as the target's own samples;
4. emit e = min(accepted + 1, budget, up to and including a stop id) tokens, and commit exactly the e
   tokens the target has now consumed (t0, d_1..d_{e-1}); the last emitted token is the next t0.

Why the commit is exact with one forward. The verify forward appended all K+1 tokens to a copy of the
cache. For the first e of them every value it computed is the value a forward of just those e tokens
computes (causal attention, per-token MoE, compressor groups pooled from their own tokens), so the
cache of "the e accepted tokens appended as one chunk" (which the project's tests hold equal to decoding
them one by one) differs from the verified cache only where the rejected tail wrote:

- window rings: slots whose position under the new length is older than the step took the tail's rows;
  they are restored from the cache before the step (K + 1 <= window_size, so the block never wraps);
- compressed entries and index keys: the tail wrote only entries at or past the reachable count of
  the new length, garbage by the cache's contract (masked on read, rewritten when their group completes);
- the pending group of a ratio > 1 source: re-cut from the verify forward's [pending ++ block]
  projections (`compressor.pending_rows`, from the forward's aux `pending_ext`) for e tokens instead of K+1;
- lengths and the Engram n-gram history: recomputed for e tokens.

The draft rings get main KV for the e committed positions from the same forward's hidden streams. The
result is bit-identical to that chunk replay (tests/test_dspark.py checks every cache array), at the
cost of one target forward per step instead of two. The candidate pool is not state (recomputed from
the scores every step). Index-key semantics: the verify forward is a chunk, so speculative decoding
follows the "consistent" semantics, also under `index_keys="released"`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import ops
from dsv41_jax.attention import Attention, ring_positions, write_ring
from dsv41_jax.block import MixedBlock
from dsv41_jax.cache import Cache, SourceCache, formats_of
from dsv41_jax.compressor import pending_rows
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import advance_history
from dsv41_jax.hyper import collapse
from dsv41_jax.layers import Embedding, Linear, RMSNorm, released_fp8_linear
from dsv41_jax.plan import LayerPlan, Mode, build_plan
from dsv41_jax.precision import model_precision
from dsv41_jax.quant import fake_quant, fake_quant_ste
from dsv41_jax.rope import apply_rope


# ----------------------------------------------------------------------------- modules (released layout)
class DSparkAttention(Attention):
    """A window-only attention (own query, window KV, sink, grouped output; rope_theta without YaRN)
    whose keys are its ring of main KV (the target's hidden at committed positions) and the block's own
    keys. `plan.layer` is the stage index: its slot in the draft rings."""

    def __init__(self, cfg: ModelConfig, stage: int, *, rngs: nnx.Rngs):
        plan = LayerPlan(stage, Mode.WINDOW, 0, -1, -1, -1, False, False, cfg.rope_theta, False)
        super().__init__(cfg, plan, rngs=rngs)

    def main_kv(self, main_x_btd: jax.Array, pos_bt: jax.Array, kernels: str) -> jax.Array:
        """Main KV rows [B, T, hd] (before FP8) of main_x at positions pos_bt."""
        return apply_rope(self.kv_norm(self.wkv(main_x_btd, kernels=kernels)), pos_bt, self.inv_freq)

    def draft(self, x_bkd: jax.Array, ring_bwd: jax.Array, filled_bw: jax.Array, lengths_b: jax.Array, fmt,
              kernels: str, ste: bool = False) -> jax.Array:
        """The block's attention: x [B, K, dim] at positions lengths + [0, K); ring_bwd: this stage's ring
        keys f32 [B, W, hd] (as stored), filled_bw: which slots hold a position. Returns [B, K, dim].
        ste: straight-through fake quantization of the block keys (training)."""
        cfg = self.cfg
        b, k, _ = x_bkd.shape
        pos = lengths_b[:, None] + jnp.arange(k, dtype=jnp.int32)
        qr = self.q_norm(self.wq_a(x_bkd, kernels=kernels))
        q = apply_rope(self.wq_b(qr, kernels=kernels).reshape(b, k, cfg.n_heads, cfg.head_dim), pos, self.inv_freq)
        kv = apply_rope(self.kv_norm(self.wkv(x_bkd, kernels=kernels)), pos, self.inv_freq).astype(jnp.float32)
        kv = (fake_quant_ste if ste else fake_quant)(fmt.window_kv, kv)
        keys = jnp.concatenate([ring_bwd, kv], axis=1)  # [B, W + K, hd]
        mask = jnp.concatenate([filled_bw, jnp.ones((b, k), bool)], axis=1)[:, None, :]
        o = ops.attend(q, keys, jnp.broadcast_to(mask, (b, k, keys.shape[1])), self.attn_sink[...], self.scale)
        return self.project_out(o, pos, x_bkd.dtype, kernels)


class MarkovHead(nnx.Module):
    """Low-rank bigram bias: logits_bias[v] = head(embed(previous token)), rank dspark_markov_rank."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = Embedding(cfg.vocab_size, cfg.dspark_markov_rank, rngs=rngs, dtype=cfg.param_dtype)
        self.head = Linear(cfg.dspark_markov_rank, cfg.vocab_size, rngs=rngs, dtype=cfg.param_dtype)


class ConfidenceHead(nnx.Module):
    """One f32 logit per slot from [hidden, Markov embedding] (adaptive block length)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.proj = Linear(cfg.dim + cfg.dspark_markov_rank, 1, rngs=rngs, dtype=cfg.param_dtype)


class DSparkStage(MixedBlock):
    """Draft stage s (`mtp.{s}.*`): an mHC block with a DSparkAttention and its own MoE sizes; stage 0
    also has main_proj / main_norm, the last stage norm / markov_head / confidence_head."""

    def __init__(self, cfg: ModelConfig, stage: int, *, rngs: nnx.Rngs):
        self._build(cfg, DSparkAttention(cfg, stage, rngs=rngs), cfg.dspark_moe(), rngs)
        if stage == 0:
            self.main_proj = released_fp8_linear(cfg, cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim, rngs=rngs)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.markov_head = MarkovHead(cfg, rngs=rngs)
            self.confidence_head = ConfidenceHead(cfg, rngs=rngs)


# ----------------------------------------------------------------------------- draft rings and draft forward
def check_stages(cfg: ModelConfig) -> None:
    """A clear error where a config without DSpark stages meets a speculative path (its rings would be empty)."""
    if not cfg.has_dspark:
        raise ValueError("this config has no DSpark draft stages (n_mtp_layers or dspark_block_size is 0); "
                         "speculative decoding needs a config and params with them")


def init_draft_window(cfg: ModelConfig, batch: int) -> dict:
    """Empty draft rings: window records [n_mtp_layers, B, W, ...] in the window-KV format."""
    shapes = formats_of(cfg).window_kv.shapes((cfg.n_mtp_layers, batch, cfg.window_size), cfg.head_dim)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@model_precision
def write_rings(model, window: dict, hidden_btf: jax.Array, lengths_b: jax.Array, n_new_b: jax.Array,
                kernels: str = "jnp") -> dict:
    """Append the main KV of n_new_b[b] positions (lengths_b[b] + [0, T)) to every stage's ring.
    hidden_btf: the target forward's aux `hidden_btf` for those positions [B, T, n_targets * dim]."""
    cfg = model.cfg
    t = hidden_btf.shape[1]
    pos = lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)
    main_x = model.mtp[0].main_norm(model.mtp[0].main_proj(hidden_btf, kernels=kernels))
    fmt = formats_of(cfg)
    for s, stage in enumerate(model.mtp):
        ring = jax.tree.map(lambda a, s=s: a[s], window)
        _, ring = write_ring(ring, stage.attn.main_kv(main_x, pos, kernels), lengths_b, n_new_b, fmt.window_kv)
        window = jax.tree.map(lambda a, r, s=s: a.at[s].set(r), window, ring)
    return window


def _row_keys(seed_b: jax.Array, step_b: jax.Array, tag: int) -> jax.Array:
    """One PRNG key per row: fold_in(fold_in(key(seed), step), tag)."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), n), tag))(seed_b, step_b)


def _draw(logits_bv: jax.Array, temperature_b: jax.Array, keys_b: jax.Array) -> jax.Array:
    """int32 [B]: argmax at temperature 0, else a sample of softmax(logits / temperature)."""
    drawn = jax.vmap(lambda k, l, t: jax.random.categorical(k, l / jnp.maximum(t, 1e-5)))(keys_b, logits_bv,
                                                                                          temperature_b)
    return jnp.where(temperature_b > 0, drawn, jnp.argmax(logits_bv, axis=-1)).astype(jnp.int32)


def _stages(model, rings: list, filled_bw, tok_b, lengths_b, kernels: str, ste: bool = False) -> jax.Array:
    """The draft stages over blocks [t0, noise, ...] at positions lengths + [0, K): collapsed hidden
    [B, K, dim] (before the last stage's norm). rings: per stage, ring keys f32 [B, W, hd]."""
    cfg = model.cfg
    k, dt, fmt = cfg.dspark_block_size, jnp.dtype(cfg.dtype), formats_of(cfg)
    b = tok_b.shape[0]
    ids = jnp.concatenate([tok_b[:, None], jnp.full((b, k - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    h = jnp.broadcast_to(model.embed(ids).astype(dt)[:, :, None, :], (b, k, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((b, k, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    for stage, ring in zip(model.mtp, rings):
        attend = lambda x, st=stage, r=ring: (st.attn.draft(x, r, filled_bw, lengths_b, fmt, kernels, ste), None)
        h, pre, _, _ = stage.mix(h, pre, attend, kernels)
    return collapse(h, pre)


def _markov(last, prev_b: jax.Array):
    """(logit bias f32 [B, V], embedding [B, rank]) of the Markov head for the previous tokens."""
    emb = last.markov_head.embed(prev_b)
    return last.markov_head.head(emb.astype(jnp.float32), jnp.float32), emb


def _confidence(last, x_bkd, embeds_bkr) -> jax.Array:
    feats = jnp.concatenate([x_bkd, embeds_bkr.astype(x_bkd.dtype)], axis=-1).astype(jnp.float32)
    return last.confidence_head.proj(feats, jnp.float32)[..., 0]


@model_precision
def draft(model, window: dict, tok_b: jax.Array, lengths_b: jax.Array, temperature_b: jax.Array,
          seed_b: jax.Array, step_b: jax.Array, kernels: str = "jnp"):
    """Draft K = dspark_block_size tokens after t0 = tok_b (position lengths_b, not cached).

    Returns (drafts int32 [B, K], logits f32 [B, K, V] (Markov bias included; slot i's distribution is
    softmax(logits[:, i] / temperature)), confidence f32 [B, K] (logits of the confidence head)).
    """
    cfg = model.cfg
    fmt = formats_of(cfg)
    rings = [fmt.window_kv.decode(jax.tree.map(lambda a, s=s: a[s], window)) for s in range(cfg.n_mtp_layers)]
    filled = ring_positions(lengths_b, cfg.window_size) >= 0  # [B, W]
    x = _stages(model, rings, filled, tok_b, lengths_b, kernels)
    last = model.mtp[-1]
    logits = model.head(last.norm(x).astype(jnp.float32), jnp.float32)
    prev, drafts, biased, embeds = tok_b, [], [], []
    for i in range(cfg.dspark_block_size):  # the Markov bias of slot i depends on the token drawn at slot i - 1
        bias, emb = _markov(last, prev)
        li = logits[:, i] + bias
        prev = _draw(li, temperature_b, _row_keys(seed_b, step_b, i))
        drafts.append(prev)
        biased.append(li)
        embeds.append(emb)
    return jnp.stack(drafts, axis=1), jnp.stack(biased, axis=1), _confidence(last, x, jnp.stack(embeds, axis=1))


@model_precision
def distill_loss(model, hidden_btf: jax.Array, target_btv: jax.Array, tokens_bt: jax.Array,
                 anchors: tuple[int, ...]):
    """Self-distillation loss of the draft stages on a frozen target's forward over tokens_bt [B, T].

    hidden_btf / target_btv: that forward's aux `hidden_btf` and logits (gradients stopped here). For each
    anchor n (1 <= n <= T - K) the draft sees what it sees at inference with n tokens cached: rings of
    main KV at positions [n - W, n) (fake-quantized straight-through) and t0 = tokens[n]; slot i is
    trained towards the target's distribution at position n + i, its Markov bias teacher-forced with
    tokens[n + i]. The confidence head learns by binary cross-entropy whether the draft's greedy token
    at each slot and all before it equal the target's (greedy acceptance). Returns (kl + bce, aux).
    """
    cfg = model.cfg
    k, w = cfg.dspark_block_size, cfg.window_size
    b, t = tokens_bt.shape
    if not anchors or min(anchors) < 1 or max(anchors) > t - k:
        raise ValueError(f"anchors {anchors} must lie in 1..{t - k} (T={t}, dspark_block_size={k})")
    hidden_btf, target_btv = jax.lax.stop_gradient(hidden_btf), jax.lax.stop_gradient(target_btv)
    fmt = formats_of(cfg)
    pos_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    main_x = model.mtp[0].main_norm(model.mtp[0].main_proj(hidden_btf))
    n = jnp.asarray(anchors, jnp.int32)  # [A]
    ring_pos = n[:, None] - w + jnp.arange(w)  # [A, W]
    rings = []
    for stage in model.mtp:
        kv = fake_quant_ste(fmt.window_kv, stage.attn.main_kv(main_x, pos_bt, "jnp").astype(jnp.float32))
        rings.append(kv[:, jnp.clip(ring_pos, 0, t - 1)].reshape(b * len(anchors), w, -1))  # [B*A, W, hd]
    filled = jnp.tile(ring_pos >= 0, (b, 1))
    slots = n[:, None] + jnp.arange(k)  # [A, K]
    prev = tokens_bt[:, slots].reshape(-1, k)  # slot i's previous token: t0, then tokens[n + i]
    target = target_btv[:, slots].reshape(-1, k, target_btv.shape[-1])
    x = _stages(model, rings, filled, prev[:, 0], jnp.repeat(n[None], b, 0).reshape(-1), "jnp", ste=True)
    last = model.mtp[-1]
    bias, emb = jax.vmap(lambda p: _markov(last, p), in_axes=1, out_axes=1)(prev)
    logits = model.head(last.norm(x).astype(jnp.float32), jnp.float32) + bias
    log_p = jax.nn.log_softmax(target, axis=-1)
    kl = jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - jax.nn.log_softmax(logits, axis=-1)), axis=-1))
    hit = jnp.cumprod((jnp.argmax(logits, -1) == jnp.argmax(target, -1)).astype(jnp.float32), axis=1)
    conf = _confidence(last, x, emb)
    bce = jnp.mean(jnp.maximum(conf, 0) - conf * hit + jnp.log1p(jnp.exp(-jnp.abs(conf))))
    return kl + bce, {"draft_kl": kl, "confidence_bce": bce, "greedy_acceptance": jnp.mean(jnp.sum(hit, axis=1))}


# ----------------------------------------------------------------------------- accept and commit
def accept(drafts_bk, q_logits_bkv, p_logits_bkv, temperature_b, seed_b, step_b):
    """The acceptance rule. p_logits [B, K+1, V]: the target at t0, d_1..d_K. Returns (accepted int32 [B]
    in 0..K, next int32 [B]: the target's token after the accepted prefix).

    Temperature 0: accepted = longest prefix with d_i == argmax p_i; next = argmax p at the first
    mismatch (or after d_K). Otherwise speculative sampling (module docstring) at that temperature.
    """
    b, k = drafts_bk.shape
    t = jnp.maximum(temperature_b, 1e-5)[:, None, None]
    p = jax.nn.softmax(p_logits_bkv / t, axis=-1)  # [B, K+1, V]
    q = jax.nn.softmax(q_logits_bkv / t, axis=-1)  # [B, K, V]
    greedy = temperature_b <= 0
    pick = lambda a, i: jnp.take_along_axis(a, i[..., None], axis=-1)[..., 0]
    p_d, q_d = pick(p[:, :k], drafts_bk), pick(q, drafts_bk)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(_row_keys(seed_b, step_b, k + 1))
    ok = jnp.where(greedy[:, None], drafts_bk == jnp.argmax(p_logits_bkv[:, :k], axis=-1), u * q_d <= p_d)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    at = lambda a: jnp.take_along_axis(a, jnp.minimum(accepted, a.shape[1] - 1)[:, None, None], axis=1)[:, 0]
    p_at = at(p)
    residual = jnp.where((accepted < k)[:, None], jnp.maximum(p_at - at(q), 0.0), p_at)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
    keys = _row_keys(seed_b, step_b, k + 2)
    sampled = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(keys, residual).astype(jnp.int32)
    nxt = jnp.where(greedy, jnp.argmax(at(p_logits_bkv), axis=-1).astype(jnp.int32), sampled)
    return accepted.astype(jnp.int32), nxt


def commit(model, before: Cache, verified: Cache, pending_ext: list, block_bt: jax.Array,
           n_commit_b: jax.Array) -> Cache:
    """The cache `before` with the first n_commit_b[b] tokens of block_bt appended, from `verified` (the
    forward of the whole block on `before`) and its compressor extensions (`ForwardAux.pending_ext`, module
    docstring).
    Bit-identical to forward(before, block_bt, n_commit_b)'s cache."""
    cfg = model.cfg
    new_len = before.lengths + n_commit_b
    fresh = ring_positions(new_len, cfg.window_size) >= before.lengths[:, None]  # [B, W]: slots of this step

    def ring(old, new):
        sel = fresh.reshape(1, *fresh.shape, *([1] * (old.ndim - 3)))
        return jnp.where(sel, new, old)

    window = jax.tree.map(ring, before.window, verified.window)
    ext = iter(pending_ext)
    sources = []
    for src, p in zip(verified.sources, [p for p in build_plan(cfg) if p.compresses]):
        if p.ratio > 1:
            kv_ext, sc_ext = next(ext)
            pend_kv, pend_score = pending_rows(kv_ext, sc_ext, before.lengths, n_commit_b, p.ratio)
            src = SourceCache(entries=src.entries, index_keys=src.index_keys, pend_kv=pend_kv, pend_score=pend_score)
        sources.append(src)
    history = before.ngram_history
    if cfg.engram_layer_ids:
        history = advance_history(history, model.engram_token_map[...][block_bt], n_commit_b)
    return Cache(lengths=new_len, window=window, window_start=verified.window_start, sources=tuple(sources),
                 ngram_history=history)


def speculative_step(model, cache: Cache, window: dict, tok_b, temperature_b, seed_b, step_b, budget_b, stop_bs,
                     kernels: str = "jnp"):
    """One draft-verify-commit step (module docstring) for every sequence with budget_b > 0.

    tok_b int32 [B]: newest token, not cached. step_b: tokens the row has sampled so far (PRNG stream).
    budget_b: tokens the row may still emit (0: idle, untouched). stop_bs int32 [B, S] (-1 padded).
    Returns `verify`'s tuple, with the draft's confidence f32 [B, K] added to its stats.
    """
    drafts, q_logits, confidence = draft(model, window, tok_b, cache.lengths, temperature_b, seed_b, step_b, kernels)
    *rest, stats = verify(model, cache, window, tok_b, drafts, q_logits, temperature_b, seed_b, step_b, budget_b,
                          stop_bs, kernels)
    return (*rest, {**stats, "confidence": confidence})


def verify(model, cache: Cache, window: dict, tok_b, drafts_bk, q_logits_bkv, temperature_b, seed_b, step_b,
           budget_b, stop_bs, kernels: str = "jnp"):
    """Verify drafts [B, K] (drawn from softmax(q_logits / temperature) slot by slot) with one target
    forward, accept, emit and commit (module docstring).

    Returns (out int32 [B, K+1] (-1 past the emitted), n_out int32 [B], next tok_b, budget_b, cache,
    window, stats {"accepted" int32 [B]}).
    """
    k = drafts_bk.shape[1]
    live = budget_b > 0
    block = jnp.concatenate([tok_b[:, None], drafts_bk], axis=1)  # [B, K+1]
    p_logits, verified, aux = model.forward(cache, block, jnp.where(live, k + 1, 0).astype(jnp.int32),
                                            all_logits=True, kernels=kernels, with_aux=True)
    accepted, nxt = accept(drafts_bk, q_logits_bkv, p_logits, temperature_b, seed_b, step_b)
    out, n_out, new_tok, budget = emit(drafts_bk, accepted, nxt, tok_b, budget_b, stop_bs)
    new_cache = commit(model, cache, verified, aux.pending_ext, block, n_commit_b=n_out)
    window = write_rings(model, window, aux.hidden_btf, cache.lengths, n_out, kernels)
    return out, n_out, new_tok, budget, new_cache, window, {"accepted": jnp.where(live, accepted, 0)}


def emit(drafts_bk, accepted_b, next_b, tok_b, budget_b, stop_bs):
    """What a step emits: d_1..d_accepted then next, cut to the budget and after a stop id (emitted,
    never fed). Returns (out int32 [B, K+1] (-1 padded), n_out [B], the next token to feed [B] (the
    last emitted; tok_b where nothing was), budget [B] (0 after a stop))."""
    k = drafts_bk.shape[1]
    slot = jnp.arange(k + 1)[None, :]
    out = jnp.where(slot < accepted_b[:, None], jnp.pad(drafts_bk, ((0, 0), (0, 1))),
                    jnp.where(slot == accepted_b[:, None], next_b[:, None], -1))
    is_stop = jnp.any(out[:, :, None] == stop_bs[:, None, :], axis=-1) & (out >= 0)
    first_stop = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1), k + 1)
    n_out = jnp.clip(jnp.minimum(accepted_b + 1, first_stop + 1), 0, jnp.maximum(budget_b, 0)).astype(jnp.int32)
    out = jnp.where(slot < n_out[:, None], out, -1)
    last = jnp.take_along_axis(out, jnp.maximum(n_out - 1, 0)[:, None], axis=1)[:, 0]
    new_tok = jnp.where(n_out > 0, last, tok_b)
    budget = jnp.where(first_stop < n_out, 0, budget_b - n_out)
    return out, n_out, new_tok, budget
