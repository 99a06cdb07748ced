"""Orbax save / restore of our params (any weight format), onto any mesh.

Params are stored as a flat {param path: array} dict ("layers/3/attn/wq_a/weight"), so a checkpoint
does not depend on how the nnx.State was sharded or nested when it was written. Restoring builds
the target from `abstract_params(cfg)` and places every array with the sharding asked for, which
may belong to a different mesh than the one that saved it (orbax reshards on read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import jax
from flax import nnx

from dsv41_jax.api import abstract_params


def _key(path) -> str:
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def flat_params(state) -> dict[str, jax.Array]:
    """{param path: leaf} of an nnx.State (paths as in `nnx.split`, joined with '/')."""
    out = {}
    jax.tree_util.tree_map_with_path(lambda p, x: out.__setitem__(_key(p), x), state)
    return out


def save_params(path: str | Path, params: nnx.State) -> None:
    """Write `params` to directory `path` (must not exist yet; orbax commits it atomically)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(Path(path).absolute(), flat_params(params))


def restore_params(path: str | Path, cfg, shardings: Mapping[str, jax.sharding.Sharding]
                   | Callable[[str, tuple], jax.sharding.Sharding] | None = None) -> nnx.State:
    """Params of `cfg` from `save_params`, bit-exact, placed per `shardings` (path -> Sharding, or a
    callable(path, shape)); the default device otherwise. Raises ValueError naming params that are
    missing or unexpected (another config or weight format)."""
    import orbax.checkpoint as ocp

    state = abstract_params(cfg)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(p, leaf):
        key = _key(p)
        s = shardings(key, leaf.shape) if callable(shardings) else (shardings or {}).get(key)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s or default)

    want = {}
    jax.tree_util.tree_map_with_path(lambda p, x: want.__setitem__(_key(p), target(p, x)), state)
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(path)
        names = set(getattr(stored, "item_metadata", stored) or {})
        missing, extra = sorted(set(want) - names), sorted(names - set(want))
        if missing or extra:
            raise ValueError(f"{path} does not hold the params of this config: {len(missing)} missing "
                             f"(e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]}); restore with the "
                             "config (weight_format included) the params were saved with")
        got = ckpt.restore(path, want)
    return jax.tree_util.tree_map_with_path(lambda p, x: got[_key(p)], state)
