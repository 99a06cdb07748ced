"""Parameter counts from the abstract params tree (nothing allocated)."""

from __future__ import annotations

from flax import nnx

from dsv41_jax.api import abstract_params
from dsv41_jax.config import ModelConfig
from dsv41_jax.plan import build_plan, encoder_depth
from dsv41_jax.pytree_paths import is_engram_table


def _kind(path: str) -> str:
    if path.startswith(("vision/", "aligner/", "image_")):
        return "vision"
    if is_engram_table(path):
        return "engram_table"
    if path.startswith("embed/"):
        return "embedding"
    if "/ffn/w1" in path or "/ffn/w2" in path or "/ffn/w3" in path:
        return "routed_experts"
    return "dense"


def param_counts(cfg: ModelConfig) -> dict[str, float]:
    """Totals by kind, and parameters active per token.

    - decode: every dense weight, the k routed experts picked per layer (k/E of them), the Engram rows
      looked up; the embedding counts one row (a lookup).
    - prefill: with decoder-side bounded prefill, layers after the last kv source run only on the last
      window of the prompt, so per prompt token only layers up to that source are active.
    The vision tower (`vision_tower`) runs once per image, not per token: it is in neither count nor
    in `total`.
    """
    state = abstract_params(cfg)
    per_layer: dict[int, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for path, leaf in nnx.to_flat_state(state):
        p = "/".join(map(str, path))
        if not isinstance(leaf, nnx.Param):
            continue
        n = int(leaf.value.size) if hasattr(leaf, "value") else int(leaf.size)
        k = _kind(p)
        totals[k] = totals.get(k, 0) + n
        layer = int(path[1]) if path[0] == "layers" else -1
        per_layer.setdefault(layer, {}).setdefault(k, 0)
        per_layer[layer][k] += n
    frac = cfg.n_activated_experts / cfg.n_routed_experts
    rows = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    engram_active = rows * len(cfg.engram_layer_ids)

    def active(layers) -> float:
        a = cfg.dim  # one embedding row
        for l in layers:
            c = per_layer.get(l, {})
            a += c.get("dense", 0) + frac * c.get("routed_experts", 0)
            if l in cfg.engram_layer_ids:
                a += rows
        a += per_layer.get(-1, {}).get("dense", 0)  # final norm + head
        return a

    backbone = totals.get("dense", 0) + totals.get("routed_experts", 0) + totals.get("embedding", 0)
    return {
        "backbone_total": backbone,
        "engram_tables": totals.get("engram_table", 0),
        "total": backbone + totals.get("engram_table", 0),
        "routed_experts": totals.get("routed_experts", 0),
        "active_decode": active(range(cfg.n_layers)),
        "active_prefill": active(range(encoder_depth(build_plan(cfg)))),
        "engram_active_rows": engram_active,
        "vision_tower": totals.get("vision", 0),
    }
