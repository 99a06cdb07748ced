"""The two switches a released checkpoint adds to `ModelConfig`.

- `weight_format`: "float" (every weight a float param) or "fp8" (the release's FP8 dense / FP4 expert
  / FP8 Engram formats kept in the params and dequantized in the computation; see dsv41_jax.layers).
- `activation_quant`: round the inputs of the FP8/FP4 projections to FP8 as the release's `fp8`
  inference mode does (W8A8 dense, W4A8 experts).

They live in a subclass until ModelConfig carries them; the model reads both with getattr and
defaults to float weights without activation quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsv41_jax.config import ModelConfig


@dataclass(frozen=True)
class CheckpointConfig(ModelConfig):
    weight_format: Literal["float", "fp8"] = "float"
    activation_quant: bool = False

    def validate(self) -> None:
        super().validate()
        if self.weight_format not in ("float", "fp8"):
            raise ValueError(f"invalid ModelConfig: weight_format must be float|fp8, got {self.weight_format!r}")
        if self.weight_format == "fp8" or self.activation_quant:
            # FP8 activations and FP4 experts are quantized in groups of 32 along the input axis
            ins = {"dim": self.dim, "q_lora_rank": self.q_lora_rank, "moe_inter_dim": self.moe_inter_dim,
                   "o_groups * o_lora_rank": self.o_groups * self.o_lora_rank}
            if self.engram_layer_ids:
                ins["engram_head_dim"] = self.engram_head_dim
            bad = {k: v for k, v in ins.items() if v % 32}
            if bad:
                raise ValueError(f"invalid ModelConfig: FP8/FP4 formats quantize in groups of 32, but {bad} "
                                 "are not multiples of 32")


def as_checkpoint_config(cfg: ModelConfig, **changes) -> CheckpointConfig:
    """`cfg` as a CheckpointConfig (keeping every field), with `changes` applied."""
    from dataclasses import fields

    base = {f.name: getattr(cfg, f.name) for f in fields(ModelConfig)}
    base.update({k: getattr(cfg, k) for k in ("weight_format", "activation_quant") if hasattr(cfg, k)})
    base.update(changes)
    out = CheckpointConfig(**base)
    out.validate()
    return out
