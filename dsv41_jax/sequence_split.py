"""Which mesh axes split the sequences while a model is traced on a mesh, and per-device kernel calls.

`partitioning.Placement.active` sets the mesh and, with `split_over`, the axes its layout splits the
batch over (`data` in `tp_ep` / `dp`, `data` and `expert` in `dp_ep`). Two readers:
- the routed experts (expert_parallel.py) take their tokens where they already are;
- `per_sequence`: a Pallas kernel is a custom call, which GSPMD cannot split, so it would gather the
  whole batch (caches included) onto every device and run it there. `kernels` runs each kernel inside
  `jax.shard_map` instead, every device on its own sequences, when nothing else splits its operands.

A program traced under `split_over` must be cached per layout: `api` compiles one per `Placement`,
whose output shardings differ between two layouts whenever the split differs.
"""

from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager

import jax
from jax.sharding import PartitionSpec as P

_AXES = contextvars.ContextVar("sequence_split_axes", default=("data",))


@contextmanager
def split_over(axes: tuple[str, ...]):
    """Trace with the sequences split over these mesh axes (a layout's batch axes); default ("data",)."""
    token = _AXES.set(tuple(axes))
    try:
        yield
    finally:
        _AXES.reset(token)


def axes(mesh) -> tuple[str, ...]:
    """The axes of `mesh` (size > 1) that split the sequences."""
    return tuple(a for a in _AXES.get() if a in mesh.shape and mesh.shape[a] > 1)


def per_sequence(fn, *batched, shared=()):
    """fn(*batched, *shared) -- batched: arrays (or pytrees of them) that lead with the batch; shared:
    arrays every sequence uses (replicated); outputs lead with the batch -- run on each device for its
    own sequences when the ambient mesh splits them and nothing else (no `tensor` axis > 1, no axis
    already manual, a batch the split divides). Otherwise fn as it is, under GSPMD."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes or mesh.shape.get("tensor", 1) > 1:
        return fn(*batched, *shared)
    split = axes(mesh)
    rows = jax.tree.leaves(batched)[0].shape[0]
    if not split or rows % math.prod(mesh.shape[a] for a in split):
        return fn(*batched, *shared)
    specs = (*jax.tree.map(lambda _: P(split), batched), *jax.tree.map(lambda _: P(), tuple(shared)))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(split), check_vma=False)(*batched, *shared)
