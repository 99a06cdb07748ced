"""Orbax save / restore of pytrees (our params in any weight format, training state), onto any mesh.

Every checkpoint is one flat {leaf name: array} dict, the name being `pytree_paths.path_str`
("layers/3/attn/wq_a/weight"; a training checkpoint prefixes "params/", "opt_state/" and has "step"),
so a checkpoint does not depend on how the tree was sharded or nested when it was written. Restoring
builds the target from a template (for params: `abstract_params(cfg)`) and places every array with the
sharding asked for, which may belong to a different mesh than the one that saved it (orbax reshards on
read). Training checkpoints written before this format (nested {"params": {jax keystr: array}, ...}) are
still read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dsv41_jax.api import abstract_params
from dsv41_jax.config import ModelConfig
from dsv41_jax.pytree_paths import flat_params, path_str, unflatten_like

Shardings = Mapping[str, jax.sharding.Sharding] | Callable[[str, tuple], jax.sharding.Sharding] | None


def save_tree(path: str | Path, tree) -> None:
    """Write the arrays of `tree` to directory `path` as {path_str: array} (the directory must not exist
    yet; orbax commits it atomically)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(Path(path).absolute(), flat_params(tree))


def restore_tree(path: str | Path, like, shardings: Shardings = None, hint: str = "", partial: bool = False):
    """`like` (a pytree of arrays or ShapeDtypeStructs) with every leaf read from the `save_tree`
    checkpoint at `path`, bit-exact in the template's dtype, placed per `shardings` (leaf name -> Sharding,
    or a callable(name, shape)); the default device otherwise. Raises ValueError naming leaves that are
    missing or unexpected (unexpected ones are skipped with `partial`: e.g. the params of a training
    checkpoint, whatever its optimizer state), followed by `hint` (what to restore with instead)."""
    import orbax.checkpoint as ocp

    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(name, leaf):
        s = shardings(name, leaf.shape) if callable(shardings) else (shardings or {}).get(name)
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=s or default)

    want = {name: target(name, leaf) for name, leaf in flat_params(like).items()}
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(path)
        stored = getattr(stored, "item_metadata", stored) or {}
        layout = None
        if isinstance(like, dict) and set(stored) == set(like) and not set(stored) >= set(want):
            layout = _keystr_layout(like)  # a training checkpoint written before the flat format
            where = {v: k for k, v in layout.items()}
            names = {where.get((top, k), top if k is None else f"{top}{k}") for top, sub in stored.items()
                     for k in (sub if isinstance(sub, Mapping) else [None])}
        else:
            names = set(stored)
        missing, extra = sorted(set(want) - names), [] if partial else sorted(names - set(want))
        if missing or extra:
            raise ValueError(f"{path} does not hold the leaves of this template: {len(missing)} missing "
                             f"(e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]}){hint}")
        if layout is None and partial:
            with ocp.PyTreeCheckpointer() as reader:
                got = reader.restore(path, args=ocp.args.PyTreeRestore(
                    item=want, restore_args=ocp.checkpoint_utils.construct_restore_args(want), partial_restore=True))
        elif layout is None:
            got = ckpt.restore(path, want)
        else:
            target = {}
            for name, (top, k) in layout.items():
                if k is None:
                    target[top] = want[name]
                else:
                    target.setdefault(top, {})[k] = want[name]
            nested = ckpt.restore(path, target)
            got = {name: nested[top] if k is None else nested[top][k] for name, (top, k) in layout.items()}
    return unflatten_like(like, got)


def _keystr_layout(like: dict) -> dict[str, tuple[str, str | None]]:
    """path_str of every leaf of `like` -> where the earlier training layout stored it: (top key, the
    `jax.tree_util.keystr` of the path below it), or (top key, None) for a top key that is a leaf ("step")."""
    out = {}
    for top, sub in like.items():
        for p, _ in jax.tree_util.tree_flatten_with_path(sub)[0]:
            out[path_str((jax.tree_util.DictKey(top), *p))] = (top, jax.tree_util.keystr(p) if p else None)
    return out


def save_params(path: str | Path, params: nnx.State) -> None:
    """Write `params` to directory `path` (must not exist yet; orbax commits it atomically)."""
    save_tree(path, params)


def restore_params(path: str | Path, cfg: ModelConfig, shardings: Shardings = None) -> nnx.State:
    """Params of `cfg` from `save_params`, bit-exact, placed per `shardings` (path -> Sharding, or a
    callable(path, shape)); the default device otherwise. Raises ValueError naming params that are
    missing or unexpected (another config or weight format)."""
    return restore_tree(path, abstract_params(cfg), shardings,
                        "; restore with the config (weight_format included) the params were saved with")
