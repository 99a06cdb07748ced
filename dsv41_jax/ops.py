"""Plain-jnp reference implementations of the CSA2 hot spots.

These are the semantics the Pallas kernels (kernels_pallas/) must reproduce, and what runs on CPU.
Shapes: B batch, T query tokens, N compressed entries, S attended keys, H heads, D channels.

- `indexer_scores`: score[b,t,n] = sum_h w[b,t,h] * relu(q[b,t,h] . k[b,n])
- `select_topk`: the k best positions per row, sorted by position, -1 for empty slots; ties go to the
  lowest position; -inf scores are never selected.
- `candidate_blocks`: blocks of `block` positions scored by their max, the newest reachable block
  pinned, the best `n_blocks` kept (sorted, -1 padded): `select_topk` of `pin_newest_block` of
  `block_maxima` (the maxima the indexer-scan kernel writes in the same pass as the scores).
- pool forms (a Reindex layer in decode): `pool_positions` maps the pool's block ids to the positions
  it holds; `indexer_scores_pool_decode` scores only those; `pool_topk_positions` maps a top-k over
  the pool back to absolute positions.
- `attend`: one softmax over the keys a mask allows, with a per-head sink in the denominator only.
- `*_decode`: the decode-step forms that read the packed cache records (what the kernels replace).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def by_query_chunks(fn, q_chunk: int, *per_query: jax.Array) -> jax.Array:
    """fn(*per_query) computed `q_chunk` queries (axis 1 of every argument) at a time, sequentially, and
    concatenated along axis 1: what keeps a [B, T, ..., S] intermediate of fn from existing whole.
    Queries are independent, so this equals fn on all of them (up to float summation order)."""
    t = per_query[0].shape[1]
    if t <= q_chunk:
        return fn(*per_query)
    n = -(-t // q_chunk)

    def split(a):  # [B, T, ...] -> [n, B, q_chunk, ...]
        a = jnp.pad(a, [(0, 0), (0, n * q_chunk - t)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(a.shape[0], n, q_chunk, *a.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in per_query))
    return out.swapaxes(0, 1).reshape(out.shape[1], n * q_chunk, *out.shape[3:])[:, :t]


def indexer_scores(q_bthd: jax.Array, w_bth: jax.Array, k_bnd: jax.Array, q_chunk: int = 256) -> jax.Array:
    """ReLU-weighted head sum of the indexer. Returns f32 [B, T, N].

    `q_chunk` queries at a time, so the per-head [B, T, H, N] products never exist whole (at 128K
    entries and a 2048-token chunk they would be 17 GB per indexing layer)."""
    k = k_bnd.astype(jnp.float32)

    def scores(q, w):
        logits = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), k)
        return jnp.einsum("bthn,bth->btn", jax.nn.relu(logits), w.astype(jnp.float32))

    return by_query_chunks(scores, q_chunk, q_bthd, w_bth)


def mask_unreachable(scores_btn: jax.Array, reachable_bt: jax.Array) -> jax.Array:
    """-inf at positions n >= reachable[b, t] (entries whose group the query has not completed)."""
    n = jnp.arange(scores_btn.shape[-1])
    return jnp.where(n < reachable_bt[..., None], scores_btn, NEG_INF)


def select_topk(scores: jax.Array, k: int) -> jax.Array:
    """int32 [..., k]: the k highest-scoring positions of each row, ascending; -1 fills empty slots.

    Exact top set; ties broken towards the lowest position (`lax.top_k` is stable).
    """
    n = scores.shape[-1]
    kk = min(k, n)
    vals, idx = jax.lax.top_k(scores, kk)
    idx = jnp.where(vals > NEG_INF, idx, n)  # empty -> sorts last
    idx = jnp.sort(idx, axis=-1)
    idx = jnp.where(idx < n, idx, -1).astype(jnp.int32)
    if kk < k:
        idx = jnp.concatenate([idx, jnp.full((*idx.shape[:-1], k - kk), -1, jnp.int32)], axis=-1)
    return idx


def block_maxima(scores: jax.Array, block: int) -> jax.Array:
    """f32 [..., ceil(N / block)]: the max of every block of `block` positions of scores [..., N]
    (a partial last block is -inf padded)."""
    n = scores.shape[-1]
    nb = -(-n // block)
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, nb * block - n)], constant_values=NEG_INF)
    return padded.reshape(*scores.shape[:-1], nb, block).max(axis=-1)


def pin_newest_block(bmax: jax.Array, reachable: jax.Array, block: int) -> jax.Array:
    """Block scores f32 [..., NB]: the block maxima bmax [..., NB] with the block holding the newest
    reachable position (reachable [...] positions) set to +inf, so that a top-k always keeps it."""
    newest = (reachable - 1) // block  # -1 when nothing is reachable
    pin = (jnp.arange(bmax.shape[-1]) == newest[..., None]) & (reachable[..., None] > 0)
    return jnp.where(pin, jnp.inf, bmax)


def candidate_blocks(scores_btn: jax.Array, reachable_bt: jax.Array, n_blocks: int, block: int) -> jax.Array:
    """Level one of the hierarchical top-k. int32 [B, T, n_blocks] block ids (ascending, -1 padded).

    `scores_btn` must already be -inf at unreachable positions. The block holding the newest reachable
    position is always kept (it may be only partly filled and would otherwise lose to older blocks).
    """
    return select_topk(pin_newest_block(block_maxima(scores_btn, block), reachable_bt, block), n_blocks)


def blocks_to_mask(blocks_btk: jax.Array, n: int, block: int) -> jax.Array:
    """bool [B, T, n]: True at positions inside the listed blocks."""
    nb = -(-n // block)
    hit = jnp.zeros((*blocks_btk.shape[:-1], nb + 1), bool)
    hit = jnp.put_along_axis(hit, jnp.where(blocks_btk >= 0, blocks_btk, nb), True, axis=-1, inplace=False)
    return jnp.repeat(hit[..., :nb], block, axis=-1)[..., :n]


def topk_to_mask(idx_btk: jax.Array, n: int) -> jax.Array:
    """bool [B, T, n]: True at the selected positions."""
    hit = jnp.zeros((*idx_btk.shape[:-1], n + 1), bool)
    hit = jnp.put_along_axis(hit, jnp.where(idx_btk >= 0, idx_btk, n), True, axis=-1, inplace=False)
    return hit[..., :n]


def attend(q_bthd: jax.Array, kv: jax.Array, mask: jax.Array, sink_h: jax.Array, scale: float,
           q_chunk: int = 256) -> jax.Array:
    """Sink softmax attention with K = V (one shared latent head). f32 out [B, T, H, D].

    kv: [B, S, D] (shared by all queries) or [B, T, S, D] (per query); mask: [B, T, S] bool.
    A query with no allowed key returns zeros (its whole mass goes to the sink).
    Shared keys are processed `q_chunk` queries at a time so the [B, T, H, S] scores never exist whole.
    """
    if kv.ndim == 3:
        return by_query_chunks(lambda q, m: _attend(q, kv, m, sink_h, scale), q_chunk, q_bthd, mask)
    return _attend(q_bthd, kv, mask, sink_h, scale)


def _attend(q_bthd, kv, mask, sink_h, scale):
    q = q_bthd.astype(jnp.float32)
    kv = kv.astype(jnp.float32)
    if kv.ndim == 3:
        s = jnp.einsum("bthd,bsd->bths", q, kv)
    else:
        s = jnp.einsum("bthd,btsd->bths", q, kv)
    s = jnp.where(mask[:, :, None, :], s * scale, NEG_INF)
    sink = sink_h.astype(jnp.float32)[None, None, :]
    m = jnp.maximum(jnp.max(s, axis=-1), sink)  # [B, T, H], finite thanks to the sink
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink - m)
    if kv.ndim == 3:
        o = jnp.einsum("bths,bsd->bthd", p, kv)
    else:
        o = jnp.einsum("bths,btsd->bthd", p, kv)
    return o / denom[..., None]


# ----------------------------------------------------------------------------- decode forms
# These read cache records ({"values", "scales"} arrays in the layout of dsv41_jax.quant) and are the
# exact contracts of the Pallas decode kernels.
def gather_rows(x_bn: jax.Array, idx_bk: jax.Array) -> jax.Array:
    """x[b, idx[b, k], ...] with -1 mapped to row 0 (callers mask those rows)."""
    idx = jnp.maximum(idx_bk, 0).reshape(*idx_bk.shape, *([1] * (x_bn.ndim - 2)))
    return jnp.take_along_axis(x_bn, idx, axis=1)


def indexer_scores_decode(q_bhd: jax.Array, w_bh: jax.Array, key_rec: dict, reachable_b: jax.Array,
                          codec) -> jax.Array:
    """Decode-step indexer scan over the packed keys [B, N, ...]: f32 [B, N], -inf past `reachable_b`."""
    keys = codec.decode(key_rec)
    s = indexer_scores(q_bhd[:, None], w_bh[:, None], keys)[:, 0]
    return mask_unreachable(s, reachable_b)


def sparse_attention_decode(q_bhd: jax.Array, window_rec: dict, window_valid_bw: jax.Array, window_codec,
                            entry_rec: dict, idx_bk: jax.Array, entry_codec, sink_h: jax.Array,
                            scale: float) -> jax.Array:
    """One decode query per sequence over its window ring and its selected compressed entries.

    window_rec: ring records [B, W, ...] with validity [B, W]; entry_rec: compressed entries [B, N, ...],
    of which only the rows named by idx_bk [B, K] (-1 = empty) are read. Returns f32 [B, H, D].
    """
    window = window_codec.decode(window_rec)
    sel = entry_codec.decode(jax.tree.map(lambda a: gather_rows(a, idx_bk), entry_rec))
    kv = jnp.concatenate([window, sel], axis=1)
    mask = jnp.concatenate([window_valid_bw, idx_bk >= 0], axis=1)
    return attend(q_bhd[:, None], kv, mask[:, None], sink_h, scale)[:, 0]


# ----------------------------------------------------------------------------- candidate-pool decode forms
# A Reindex layer scores only the candidate source's pool: block ids int32 [B, K] from `candidate_blocks`
# (ascending, distinct, -1 padded at the end), i.e. the P = K * block pool positions below. Because
# the blocks ascend, pool slots ascend with position, so a top-k over the pool slots (ties to the lowest
# slot) is the top-k over the positions with the same tie rule.
def pool_positions(blocks_bk: jax.Array, block: int) -> jax.Array:
    """int32 [B, K * block]: the absolute position of each pool slot; negative in empty (-1) blocks."""
    pos = blocks_bk[..., :, None] * block + jnp.arange(block, dtype=jnp.int32)
    pos = jnp.where(blocks_bk[..., :, None] >= 0, pos, -1)
    return pos.reshape(*blocks_bk.shape[:-1], -1).astype(jnp.int32)


def indexer_scores_pool_decode(q_bhd: jax.Array, w_bh: jax.Array, key_rec: dict, blocks_bk: jax.Array, block: int,
                               reachable_b: jax.Array, codec) -> jax.Array:
    """Decode-step indexer scan over the pool only: f32 [B, K * block].

    Slot j holds the score of position `pool_positions(blocks_bk, block)[b, j]` (what
    `indexer_scores_decode` gives there), -inf in empty blocks and at positions >= min(reachable_b, N).
    Only the pool's rows of the packed keys [B, N, ...] are gathered and decoded.
    """
    n = jax.tree.leaves(key_rec)[0].shape[1]
    pos = pool_positions(blocks_bk, block)
    ok = (pos >= 0) & (pos < jnp.minimum(reachable_b, n)[:, None])
    keys = codec.decode(jax.tree.map(lambda a: gather_rows(a, jnp.where(ok, pos, 0)), key_rec))
    s = indexer_scores(q_bhd[:, None], w_bh[:, None], keys)[:, 0]
    return jnp.where(ok, s, NEG_INF)


def pool_topk_positions(slots_bk: jax.Array, blocks_bk: jax.Array, block: int) -> jax.Array:
    """Pool slots (a `select_topk` over pool scores: ascending, -1 padded) -> absolute positions, int32."""
    bid = jnp.take_along_axis(blocks_bk, jnp.maximum(slots_bk, 0) // block, axis=-1)
    return jnp.where(slots_bk >= 0, bid * block + slots_bk % block, -1).astype(jnp.int32)
