"""Names of pytree leaves: one spelling of a key path as a string, used by every checkpoint and sharding
rule ("layers/3/attn/wq_b/weight"; optimizer state: "0/mu/layers/3/attn/wq_b/weight").

No dsv41_jax imports: every module may use it.
"""

from __future__ import annotations

from typing import Any

import jax


def path_str(path) -> str:
    """'layers/3/attn/wq_b/weight' from a pytree key path: the name of every key (dict key, sequence
    index, attribute) joined by '/', a Variable's own trailing `.value` dropped."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def is_engram_table(path: str) -> bool:
    """True for an Engram table or its scales ("layers/1/engram/table", ".../engram/table_scale"): the params that
    may live in host memory and that a decode step reads only rows of."""
    return "engram/table" in path


def flat_params(tree) -> dict[str, Any]:
    """{path_str: leaf} of a pytree (an nnx.State, optimizer state, or a dict of them)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {path_str(p): leaf for p, leaf in leaves}
    if len(out) != len(leaves):
        raise ValueError(f"{len(leaves) - len(out)} leaves of the tree share a path string with another leaf")
    return out


def unflatten_like(like, named: dict[str, Any]):
    """`like`'s tree with every leaf replaced by named[path_str of its path] (KeyError: one is missing)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: named[path_str(p)], like)
