"""Partitioning rules: logical axes -> mesh axes, in one place (the tables at the top of this file).

1. `PARAM_AXES` / `CACHE_AXES`: the logical axes of every parameter and cache array (first matching
   path pattern wins; unlisted params are replicated). `annotate_params`, run at the end of
   `Transformer.__init__`, writes each param's axes into its Flax NNX metadata (`out_sharding`, with
   `eager_sharding=False`: the names are logical, nothing is placed at construction), so every params
   State -- `init_params`, `abstract_params`, a loaded checkpoint -- carries them.
2. `LAYOUTS`: for each layout, a Flax logical-axis rule set: (logical axis, mesh axis) pairs.

`param_shardings` resolves the params' metadata through the layout's rules with
`nnx.get_partition_spec` under `nnx.logical_axis_rules`; cache arrays are plain pytrees, so their
`CACHE_AXES` go through the same rule lookup (`flax.core.spmd.from_sharding_rules`, what
`nnx.get_partition_spec` applies to a Variable's `out_sharding`). A mesh axis the mesh lacks, of size 1,
or that does not divide the dimension (derived scale blocks) leaves that dimension replicated.

The mesh has up to three axes: `data` (sequences), `tensor` (attention / indexer heads, shared-expert
hidden units, vocabulary) and `expert` (routed experts, Engram table rows; in `dp_ep` also sequences).
Layouts: `tp_ep` (heads over `tensor`, experts over `expert`, sequences over `data`), `dp` (everything
replicated, sequences over `data`) and `dp_ep` (the DeepSeek serving layout: sequences over `data` x
`expert`, dense weights replicated, experts over `expert`). Collectives come from GSPMD (`jax.jit` with
`NamedSharding`s) except for the routed experts, which run inside `jax.shard_map` over the `expert` axis
with an all-to-all dispatch / combine (expert_parallel.py). A bad mesh is refused here (`check_mesh`),
before anything is traced.

`place` turns a mesh and a layout into a `Placement`: the shardings of one model's params and caches,
which `api`'s entry points take as `placement=` (see `sharding.shard_model`). This module imports no
model code: the model imports it while it is built.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv41_jax import sequence_split
from dsv41_jax.cache import Cache, init_cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.pytree_paths import is_engram_table, path_str

MESH_AXES = ("data", "tensor", "expert")

# Logical axes per parameter, by path ("layers/3/attn/wq_b/weight"). FP8 `scale` blocks and FP4
# `*_scale` arrays follow their weight's axes.
PARAM_AXES: tuple[tuple[str, tuple], ...] = (
    (r"^embed/weight$", ("vocab", None)),
    (r"^head/(weight|scale)$", ("vocab", None)),
    (r"attn/wq_b/(weight|scale)$", ("heads", None)),  # [H*hd, q_lora]
    (r"attn/wo_a/(weight|scale)$", ("heads", None)),  # [G*o_lora, H*hd/G]: whole groups per shard
    (r"attn/wo_b/(weight|scale)$", (None, "heads")),  # [dim, G*o_lora]
    (r"attn/attn_sink$", ("heads",)),
    (r"indexer/wq_b/(weight|scale)$", ("index_heads", None)),
    (r"indexer/weights_proj/(weight|scale)$", ("index_heads", None)),
    (r"ffn/w[123](_scale)?$", ("experts", None, None)),
    (r"ffn/shared_w[13]/(weight|scale)$", ("mlp", None)),
    (r"ffn/shared_w2/(weight|scale)$", (None, "mlp")),
    (r"engram/(table|table_scale|embed/weight|embed/scale)$", ("table_rows", None)),
)

# Logical axes per cache array, by path ("window/values", "sources/0/entries/scale"), padded with None to
# the array's rank. Window rings [L, B, W, ...] and window_start [L, B] lead with the layer; every other
# cache array leads with the batch.
CACHE_AXES: tuple[tuple[str, tuple], ...] = (
    (r"^window", (None, "batch")),
    (r".", ("batch",)),
)

# Flax logical-axis rules per layout. Every logical axis has a rule in every layout (None: replicated).
LAYOUTS: dict[str, tuple[tuple[str, str | None], ...]] = {
    # tensor + expert + data parallel decode (the 8-GPU host / TPU slice plan)
    "tp_ep": (("batch", "data"), ("heads", "tensor"), ("index_heads", "tensor"), ("mlp", "tensor"),
              ("vocab", "tensor"), ("experts", "expert"), ("table_rows", "expert")),
    # weights replicated, sequences split: for models that fit one device
    "dp": (("batch", "data"), ("heads", None), ("index_heads", None), ("mlp", None), ("vocab", None),
           ("experts", None), ("table_rows", None)),
    # the DeepSeek serving layout: attention data-parallel over every device (each its own sequences and
    # their caches; the dense weights, shared expert and head replicated), routed experts and Engram rows
    # split over `expert`, tokens sent to their experts by all-to-all (expert_parallel.py)
    "dp_ep": (("batch", ("data", "expert")), ("heads", None), ("index_heads", None), ("mlp", None),
              ("vocab", None), ("experts", "expert"), ("table_rows", "expert")),
}


class MeshError(ValueError):
    """A mesh that cannot be built or cannot hold the model: bad input, which command lines report in one line."""


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,expert=4' -> {'data': 2, 'expert': 4}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1:
            raise MeshError(f"bad mesh entry {part!r}: expected axis=size with axis in {MESH_AXES} and size >= 1")
        if name in out:
            raise MeshError(f"mesh axis {name!r} given twice in {text!r}")
        out[name] = int(size)
    return out


def batch_axes(layout: str) -> tuple[str, ...]:
    """The mesh axes that split the sequences in `layout`."""
    axes = dict(_rules(layout))["batch"]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def check_mesh(cfg: ModelConfig, sizes: dict[str, int], batch: int | None = None,
               n_devices: int | None = None, layout: str = "tp_ep") -> None:
    """Refuse a mesh that cannot hold this model, with the reason, before anything is compiled."""
    n_devices = len(jax.devices()) if n_devices is None else n_devices
    total = math.prod(sizes.values())
    if total != n_devices:
        raise MeshError(f"mesh {sizes} has {total} devices but {n_devices} are available; "
                         "make the product of the axis sizes equal the device count")
    tp, ep = sizes.get("tensor", 1), sizes.get("expert", 1)
    checks = [("tensor", "n_heads", cfg.n_heads, tp), ("tensor", "o_groups", cfg.o_groups, tp),
              ("tensor", "index_n_heads", cfg.index_n_heads, tp), ("tensor", "moe_inter_dim", cfg.moe_inter_dim, tp),
              ("tensor", "vocab_size", cfg.vocab_size, tp), ("expert", "n_routed_experts", cfg.n_routed_experts, ep)]
    if batch is not None:
        split = [a for a in batch_axes(layout) if sizes.get(a, 1) > 1] or ["data"]
        checks.append(("*".join(split), "batch", batch, math.prod(sizes.get(a, 1) for a in split)))
    for axis, name, value, size in checks:
        if value % size:
            raise MeshError(f"mesh axis {axis}={size} does not divide {name}={value}; choose a size that divides it"
                            + (f" (layout {layout} splits the sequences over {axis})" if name == "batch" else ""))


def make_mesh(cfg: ModelConfig, spec: str | dict[str, int], batch: int | None = None, devices=None,
              layout: str = "tp_ep") -> Mesh:
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    devices = list(jax.devices() if devices is None else devices)
    check_mesh(cfg, sizes, batch, len(devices), layout)
    names = tuple(a for a in MESH_AXES if a in sizes) or ("data",)
    shape = tuple(sizes.get(a, 1) for a in names)
    return Mesh(np.asarray(devices).reshape(shape), names)


def _rules(layout: str):
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    return LAYOUTS[layout]


def _on_mesh(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """A resolved spec, each mesh axis kept where this mesh splits that dimension evenly (a dimension
    split over several axes keeps those that this mesh has, if their product divides it)."""
    out = []
    for m, dim in zip(spec, shape):
        names = (m,) if isinstance(m, str) else tuple(m or ())
        for a in names:
            if a not in MESH_AXES:
                raise ValueError(f"logical axis {a!r} has no rule in this layout; add one to LAYOUTS")
        names = tuple(a for a in names if a in mesh.shape and mesh.shape[a] > 1)
        # a derived array (scale blocks) whose dim the mesh does not divide stays replicated there
        if not names or dim % math.prod(mesh.shape[a] for a in names):
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    return P(*out)


def logical_to_mesh(logical: tuple, layout: str) -> P:
    """Logical axis names -> mesh axis names by the layout's rules: the lookup `nnx.get_partition_spec`
    applies to a Variable's `out_sharding` (`flax.core.spmd.from_sharding_rules`)."""
    return P(*flax_spmd.from_sharding_rules(logical, _rules(layout)))


def _first_match(table, path: str) -> tuple | None:
    return next((axes for pattern, axes in table if re.search(pattern, path)), None)


def param_logical_axes(path: str) -> tuple | None:
    """The `PARAM_AXES` entry of a param path (None: not listed, replicated)."""
    return _first_match(PARAM_AXES, path)


def cache_logical_axes(path: str, ndim: int) -> tuple:
    """The `CACHE_AXES` entry of a cache array's path, padded with None to `ndim` axes."""
    axes = _first_match(CACHE_AXES, path)
    return axes + (None,) * (ndim - len(axes))


def annotate_params(model: nnx.Module) -> None:
    """Write `PARAM_AXES` into the NNX metadata of `model`'s variables: `out_sharding` = logical axes.

    `eager_sharding=False`: the names are logical (resolved per layout by `param_specs`), so a Variable
    re-created from this metadata (e.g. optimizer state) is not placed on a mesh by Flax."""
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            axes = param_logical_axes("/".join(map(str, path)))
            if axes is not None:
                var.set_metadata(out_sharding=axes, eager_sharding=False)


def param_specs(params, mesh, layout: str = "tp_ep"):
    """PartitionSpec of every leaf of an (abstract or real) params State: each Variable's `out_sharding`
    metadata resolved through the layout's rules by `nnx.get_partition_spec` (no metadata: replicated),
    then fitted to `mesh` (a `Mesh` or an `AbstractMesh`)."""
    with nnx.logical_axis_rules(_rules(layout)):
        specs = nnx.get_partition_spec(params)
    return jax.tree.map(lambda spec, leaf: _on_mesh(spec, leaf.shape, mesh), specs, params)


def param_shardings(params, mesh: Mesh, layout: str = "tp_ep"):
    """NamedSharding for every leaf of an (abstract or real) params State, from `param_specs`.

    A leaf that lives in host memory (Engram tables loaded with `engram_on_host=True`) keeps its
    memory kind: it is split over the mesh like any other but stays out of device memory."""

    def one(spec, leaf):
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None)
        return NamedSharding(mesh, spec, memory_kind=kind if kind and "host" in kind else None)

    return jax.tree.map(one, param_specs(params, mesh, layout), params)


def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh, layout: str = "tp_ep") -> NamedSharding:
    """The NamedSharding `param_shardings` gives a param, from its path (`PARAM_AXES`) and shape alone: for a
    loader that places each array as it reads it (`checkpoint.load_checkpoint(shardings=...)`)."""
    axes = param_logical_axes(path)
    return NamedSharding(mesh, P() if axes is None else _on_mesh(logical_to_mesh(axes, layout), shape, mesh))


def cache_specs(cache: Cache, mesh, layout: str = "tp_ep"):
    """PartitionSpec of every cache array: `CACHE_AXES` through the layout's rules, fitted to `mesh`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _on_mesh(logical_to_mesh(cache_logical_axes(path_str(path), leaf.ndim), layout),
                                    leaf.shape, mesh),
        cache)


def bytes_per_device(tree, specs, mesh) -> tuple[int, float]:
    """(total bytes, bytes of one device) of the leaves of an (abstract or real) `tree` split by `specs` (its
    PartitionSpecs: `param_specs`, `cache_specs`) over `mesh` (a Mesh or an AbstractMesh); a dimension split
    over several axes (dp_ep's sequences) is divided by all of them."""
    total = per_device = 0.0
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                          strict=True):
        n = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        axes = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
        total += n
        per_device += n / math.prod(mesh.shape[a] for a in axes)
    return int(total), per_device


def param_bytes(params, mesh, layout: str = "tp_ep") -> dict[str, tuple[int, float]]:
    """`bytes_per_device` of an (abstract or real) params State by `param_specs`, the Engram tables (and their
    scales) apart since they may live in host memory: {"weights": ..., "engram_tables": ...}."""
    specs = jax.tree.leaves(param_specs(params, mesh, layout), is_leaf=lambda x: isinstance(x, P))
    sides = {"weights": ([], []), "engram_tables": ([], [])}
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs, strict=True):
        leaves, side_specs = sides["engram_tables" if is_engram_table(path_str(path)) else "weights"]
        leaves.append(leaf)
        side_specs.append(spec)
    return {name: bytes_per_device(leaves, side_specs, mesh) for name, (leaves, side_specs) in sides.items()}


def cache_shardings(cache: Cache, mesh: Mesh, layout: str = "tp_ep"):
    """NamedSharding for every cache array, from `cache_specs`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(cache, mesh, layout))


@dataclass(frozen=True, eq=False)
class Placement:
    """Where one model's arrays live on a mesh, for caches of `batch` sequences (any capacity: only
    the batch dimension of a cache array is split). `api`'s entry points take it as `placement=`:
    they put the inputs there and compile programs whose outputs stay there. Compared by identity,
    so it keys those compiled programs."""

    mesh: Mesh
    layout: str
    batch: int
    params: Any  # NamedSharding per params leaf
    cache: Any  # NamedSharding per cache leaf (a Cache pytree)
    rows: NamedSharding  # arrays that lead with the batch (tokens, lengths, logits, sampled ids)

    @contextmanager
    def active(self):
        """Trace and run on this placement: its mesh set, and the traced model told which mesh
        axes split the sequences (`sequence_split.split_over`)."""
        with jax.set_mesh(self.mesh), sequence_split.split_over(batch_axes(self.layout)):
            yield

    def new_cache(self, cfg: ModelConfig, capacity: int) -> Cache:
        """An empty cache for the placement's batch made on the mesh: each device writes only its own shards (made
        on one device and then placed, a cache sized to the devices' memory would not fit the first one)."""
        return _empty_cache_program(self, cfg, capacity)()

    def put_cache(self, cache: Cache) -> Cache:
        """`cache` on the mesh (arrays already there stay as they are)."""
        if cache.batch != self.batch:
            raise ValueError(f"the cache holds {cache.batch} sequences but the model was placed for batch "
                             f"{self.batch}; make the cache with that batch or place the model again")
        if _placed(jax.tree.leaves(cache), jax.tree.leaves(self.cache)):
            # the previous call's output (or a row put into it): a device_put of the whole tree costs more than this
            return cache
        return jax.device_put(cache, self.cache)

    def window_shardings(self, window) -> dict:
        """NamedSharding per DSpark draft ring ([stages, B, W, ...], `api.init_draft_window`; abstract or real):
        split like the cache's window rings, whose layout they share."""
        return jax.tree.map(lambda leaf: NamedSharding(self.mesh, _on_mesh(
            logical_to_mesh(cache_logical_axes("window", leaf.ndim), self.layout), leaf.shape, self.mesh)), window)

    def new_window(self, cfg: ModelConfig) -> dict:
        """Empty DSpark draft rings (`api.init_draft_window`) for the placement's batch made on the mesh, split like
        the cache's window rings: each device writes only its own shards (as `new_cache`). A config without draft
        stages is refused (`dspark.check_stages`)."""
        from dsv41_jax import dspark  # dspark's modules import this one

        dspark.check_stages(cfg)
        return _empty_window_program(self, cfg)()

    def put_window(self, window: dict) -> dict:
        """DSpark draft rings on the mesh (arrays already there stay as they are)."""
        want = self.window_shardings(window)
        return window if _placed(jax.tree.leaves(window), jax.tree.leaves(want)) else jax.device_put(window, want)

    def put_rows(self, x):
        """An int32 array that leads with the batch, split over the mesh like the sequences."""
        if _placed([x], [self.rows]) and x.dtype == np.int32:
            return x
        return jax.device_put(np.asarray(x, np.int32) if not isinstance(x, jax.Array) else x.astype(np.int32),
                              self.rows)


@lru_cache(maxsize=16)
def _empty_cache_program(placement: Placement, cfg: ModelConfig, capacity: int):
    """`Placement.new_cache`'s program, compiled once per placement, config and capacity."""
    return jax.jit(lambda: init_cache(cfg, placement.batch, capacity), out_shardings=placement.cache)


@lru_cache(maxsize=16)
def _empty_window_program(placement: Placement, cfg: ModelConfig):
    """`Placement.new_window`'s program, compiled once per placement and config."""
    from dsv41_jax import dspark  # dspark's modules import this one

    make = lambda: dspark.init_draft_window(cfg, placement.batch)  # noqa: E731
    return jax.jit(make, out_shardings=placement.window_shardings(jax.eval_shape(make)))


def _placed(arrays: list, shardings: list) -> bool:
    """Every array a jax.Array placed as its sharding says, or equivalently (P() and P(None, None) alike)."""
    return all(isinstance(a, jax.Array) and (a.sharding == s or a.sharding.is_equivalent_to(s, a.ndim))
               for a, s in zip(arrays, shardings))


def place_row(cfg: ModelConfig, params, mesh: Mesh, layout: str = "tp_ep") -> Placement:
    """The placement of one sequence (the serving engine's prefill row) on `mesh`: `place`'s for batch 1 without
    its batch check, so its cache and rows are replicated over the layout's sequence axes, which one sequence
    cannot be split over (the routed experts still split its tokens, `expert_parallel.routed`)."""
    return _placement(cfg, params, mesh, layout, 1, None)


def place(cfg: ModelConfig, params, mesh: Mesh, layout: str = "tp_ep", *, batch: int) -> Placement:
    """The shardings of `params` (abstract or real) and of `cfg`'s caches for `batch` sequences on
    `mesh` by the layout's rules; a bad layout or mesh is refused first."""
    return _placement(cfg, params, mesh, layout, batch, batch)


def _placement(cfg: ModelConfig, params, mesh: Mesh, layout: str, batch: int, checked_batch: int | None) -> Placement:
    """`place`'s Placement; the mesh checked against checked_batch (None: not against a batch). A dimension the
    mesh does not divide (batch 1) stays replicated (`_on_mesh`)."""
    _rules(layout)
    check_mesh(cfg, dict(mesh.shape), checked_batch, mesh.size, layout)
    abstract_cache = jax.eval_shape(lambda: init_cache(cfg, batch, 1))  # capacity does not change the specs
    axis = _on_mesh(logical_to_mesh(("batch",), layout), (batch,), mesh)[0]
    return Placement(mesh, layout, batch, param_shardings(params, mesh, layout),
                     cache_shardings(abstract_cache, mesh, layout), NamedSharding(mesh, P(axis)))
