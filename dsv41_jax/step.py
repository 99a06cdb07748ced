"""What flows through one forward chunk: frozen inputs, the state layers hand on, the by-products.

A chunk forward (`model.Transformer.forward`) runs its layers in order. Each attention layer takes

- `StepInputs`: what is fixed for the whole chunk (positions, lengths, formats, switches); frozen,
  no layer can change it;
- `Published`: what the earlier layers published for the later ones (the kv sources' cache slots
  after this chunk, the latest top-k and candidate pool, the "released" index-key owner);

and returns its output, its window ring after the chunk (the model writes it into the cache), the
`Published` the next layer sees (a new object: `dataclasses.replace`) and its `LayerAux`. Nothing is
written in place, so following the cache through a step means following return values.

`ForwardAux` gathers the by-products a caller can ask for (`forward(..., with_aux=True)`): the routed
expert load (balancing, benchmarks), the quantization-aware training views and indexer records (the
indexer's KL loss), the DSpark target's hidden streams and the compressors' pending extensions (the
speculative commit).

All are frozen dataclasses registered as pytrees (switches and formats static), so they can cross
`jax.jit` boundaries, e.g. a jitted forward returning its `ForwardAux`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from dsv41_jax.quant import CacheFormats


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """The chunk's inputs, the same for every layer. B sequences, T new tokens each, L layers."""

    pos_bt: jax.Array  # int32 [B, T] absolute positions of the chunk's tokens
    lengths_b: jax.Array  # int32 [B] tokens in the cache before this chunk
    n_new_b: jax.Array  # int32 [B] real tokens in this chunk (the rest is right padding)
    window_start_lb: jax.Array  # int32 [L, B]: layer l's ring holds no position below (Cache.window_start)
    fmt: CacheFormats = field(metadata={"static": True})
    # T == 1 and not training: read packed records through the decode-form ops
    decode: bool = field(metadata={"static": True})
    kernels: str = field(default="jnp", metadata={"static": True})  # the dsv41_jax.kernels switch
    # quantization-aware training (dsv41_jax.train): attention reads straight-through fake-quant views
    # (f32) of what the chunk writes, and the indexer's inputs are detached
    training: bool = field(default=False, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Published:
    """What the layers so far have published for the later ones."""

    sources: tuple  # SourceCache per kv source slot, after this chunk for the slots already run
    # training: per slot (main KV f32 [B, N, hd], index keys f32 [B, N, di]), the straight-through
    # fake-quant views of `sources` that attention and the indexer read; None per slot otherwise
    views: tuple
    topk_btk: jax.Array | None = None  # int32 [B, T, index_topk] of the latest index source
    pool_btn: jax.Array | None = None  # int32 [B, T, n_blocks] the candidate source's pool (ascending, -1 padded)
    key_owner_b: jax.Array | None = None  # int32 [B] "released" decode: slot whose index keys are read


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class IndexerRecord:
    """One indexing layer's training record for the indexer's KL objective (`train.indexer_kl`)."""

    layer: int = field(metadata={"static": True})
    scores_btn: jax.Array  # f32 [B, T, N], -inf outside the support
    q_bthd: jax.Array  # the layer's attention queries
    keys_bnd: jax.Array  # the compressed entries it attends (f32 views)
    scale: float = field(metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerAux:
    """By-products of one layer: its attention's (training views and records, the compressor's
    extension), then its block's (routed load, DSpark capture)."""

    window_view_btd: jax.Array | None = None  # training: f32 view of the chunk's window KV
    indexer: IndexerRecord | None = None  # training, indexing layers
    # kv sources with ratio > 1: (pending ++ chunk) projections (kv, score) f32 [B, m + T, hd] each,
    # from which dsv41_jax.dspark.commit re-cuts the pending group
    pending_ext: tuple[jax.Array, jax.Array] | None = None
    expert_load_e: jax.Array | None = None  # int32 [E] the MoE's routed assignments
    hidden_btd: jax.Array | None = None  # the block's input stream (after Engram) averaged over hc, when captured


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardAux:
    """By-products of `Transformer.forward(..., with_aux=True)`."""

    expert_load_le: jax.Array  # int32 [L, E] routed assignments per layer (padding included)
    layers: tuple[LayerAux, ...]  # per run layer
    views: tuple  # `Published.views` after the last layer (training)
    hidden_btf: jax.Array | None = None  # DSpark: target layers' input streams, concatenated (dspark.py)

    @property
    def indexer(self) -> list[IndexerRecord]:
        return [a.indexer for a in self.layers if a.indexer is not None]

    @property
    def pending_ext(self) -> list[tuple[jax.Array, jax.Array]]:
        """The ratio > 1 kv sources' extensions, in slot order."""
        return [a.pending_ext for a in self.layers if a.pending_ext is not None]

