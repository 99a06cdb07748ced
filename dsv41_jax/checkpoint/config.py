"""The runtime fields a loaded checkpoint sets on `ModelConfig`, with the block-size checks the
released formats need.

`weight_format` ("float" | "fp8": keep the release's FP8 dense / FP4 expert / FP8 Engram formats in
the params, dequantized in the computation) and `activation_quant` (the release's `fp8` inference
mode) are ModelConfig fields; see dsv41_jax.layers for what they do.
"""

from __future__ import annotations

from dsv41_jax.config import ModelConfig


def with_formats(cfg: ModelConfig, **changes) -> ModelConfig:
    """`cfg` with `changes`; raises ValueError when a quantized format meets a dimension that is not
    a multiple of its 32-wide scale groups."""
    out = cfg.replace(**changes)
    if out.weight_format == "fp8" or out.activation_quant:
        ins = {"dim": out.dim, "q_lora_rank": out.q_lora_rank, "moe_inter_dim": out.moe_inter_dim,
               "o_groups * o_lora_rank": out.o_groups * out.o_lora_rank}
        if out.engram_layer_ids:
            ins["engram_head_dim"] = out.engram_head_dim
        bad = {k: v for k, v in ins.items() if v % 32}
        if bad:
            raise ValueError(f"invalid ModelConfig: FP8/FP4 formats quantize in groups of 32, but {bad} are not "
                             "multiples of 32")
    return out
