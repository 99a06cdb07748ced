"""Sharded entry points: a model placed on a mesh, run through the same checked `api` as on one device.

    mesh = partitioning.make_mesh(cfg, "data=2,expert=4", batch=8)
    model = shard_model(cfg, params, mesh, "tp_ep", batch=8)
    logits, cache = model.prefill(model.init_cache(capacity=256), tokens_bt, lengths_b, kernels="auto")
    toks, emitted, cache = model.generate(cache, next_b, 32, kernels="auto")
    # DSpark: model.speculative_prefill / speculative_generate with model.init_draft_window()

Each method is the `api` function of the same name with this model's cfg, params and `placement`:
the same input checks, the same `kernels` switch, the same traced code (`api.forward`); only where
the arrays live differs (`partitioning.Placement`, from the layout's rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from dsv41_jax import api
from dsv41_jax.cache import Cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.partitioning import Placement, place


@dataclass(frozen=True)
class ShardedModel:
    """Params placed on a mesh and the placement of its caches."""

    cfg: ModelConfig
    params: object  # the placed nnx.State
    placement: Placement

    def __post_init__(self):  # what the calls pass: flattened once (api.freeze says why)
        object.__setattr__(self, "_frozen", api.freeze(self.params))

    @property
    def mesh(self) -> Mesh:
        return self.placement.mesh

    def init_cache(self, capacity: int) -> Cache:
        """An empty cache for the placement's batch, made on the mesh (each device its own shards)."""
        return self.placement.new_cache(self.cfg, capacity)

    def place_cache(self, cache: Cache) -> Cache:
        return self.placement.put_cache(cache)

    def prefill(self, cache: Cache, tokens_bt, lengths_b, **kw):
        """`api.prefill` on the mesh (keywords as there)."""
        return api.prefill(self.cfg, self._frozen, cache, tokens_bt, lengths_b, placement=self.placement, **kw)

    def decode_step(self, cache: Cache, tokens_b, active_b=None, **kw):
        """`api.decode_step` on the mesh (keywords as there); tokens may be the previous step's output."""
        return api.decode_step(self.cfg, self._frozen, cache, tokens_b, active_b, placement=self.placement, **kw)

    def generate(self, cache: Cache, tokens_b, n_steps: int, **kw):
        """`api.generate` on the mesh (keywords as there); the cache is donated."""
        return api.generate(self.cfg, self._frozen, cache, tokens_b, n_steps, placement=self.placement, **kw)

    def init_draft_window(self) -> dict:
        """Empty DSpark draft rings for the placement's batch, made on the mesh (split like the cache's window)."""
        return self.placement.new_window(self.cfg)

    def speculative_prefill(self, cache: Cache, window: dict, tokens_bt, lengths_b, **kw):
        """`api.speculative_prefill` on the mesh (keywords as there); cache and window are donated."""
        return api.speculative_prefill(self.cfg, self._frozen, cache, window, tokens_bt, lengths_b,
                                       placement=self.placement, **kw)

    def speculative_generate(self, cache: Cache, window: dict, tokens_b, n_steps: int, **kw):
        """`api.speculative_generate` on the mesh (keywords as there); cache and window are donated."""
        return api.speculative_generate(self.cfg, self._frozen, cache, window, tokens_b, n_steps,
                                        placement=self.placement, **kw)


def shard_model(cfg: ModelConfig, params, mesh: Mesh, layout: str = "tp_ep", *, batch: int) -> ShardedModel:
    """Place params on `mesh` by the layout's rules, for caches of `batch` sequences (a bad layout or
    mesh is refused before anything is placed). params: an nnx.State or `api.freeze`'s."""
    params = api.freeze(params).state
    placement = place(cfg, params, mesh, layout, batch=batch)
    return ShardedModel(cfg, jax.device_put(params, placement.params), placement)


def init_model(cfg: ModelConfig, mesh: Mesh, layout: str = "tp_ep", *, batch: int, seed: int = 0) -> ShardedModel:
    """`shard_model` of random params drawn straight into their shards: no device holds more than its own
    (`api.init_params` then `shard_model` first puts them all on one device, which the full v41-flash's 288 GiB
    of weights cannot fit). The draw is one XLA program: the values are `api.init_params(cfg, seed)`'s up to the
    last bit of some (XLA fuses the scaling of the normals), the same distribution."""
    placement = place(cfg, api.abstract_params(cfg), mesh, layout, batch=batch)
    params = jax.jit(lambda: api.init_params(cfg, seed), out_shardings=placement.params)()
    return ShardedModel(cfg, params, placement)


def greedy(cfg: ModelConfig, params, tokens_bt, lengths_b, capacity: int, n_steps: int,
           model: ShardedModel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prefill logits [B, V], n_steps greedy tokens int [B, n_steps]) as host arrays, on one device or on
    `model`'s mesh (same cfg and params): what a layout must not change (tests/test_expert_parallel.py and
    the 2-GPU session script compare the two)."""
    if model is None:
        logits, cache = api.prefill(cfg, params, api.init_cache(cfg, len(lengths_b), capacity), tokens_bt, lengths_b)
        toks, _, _ = api.generate(cfg, params, cache, np.asarray(logits).argmax(-1), n_steps)
    else:
        logits, cache = model.prefill(model.init_cache(capacity), tokens_bt, lengths_b)
        toks, _, _ = model.generate(cache, np.asarray(logits).argmax(-1), n_steps)
    return np.asarray(logits), np.asarray(toks)
