"""One transformer block's two sub-layers wrapped in hyper-connections (mHC): attention, then the MoE.

Shared by the backbone's `model.Block` and the DSpark draft stages (`dspark.DSparkStage`), which differ
only in what their attention reads. Parameter names are the released ones (`attn`, `ffn`,
`attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.hyper import HyperMix, expand, sublayer_input
from dsv41_jax.layers import RMSNorm
from dsv41_jax.moe import MoE


class MixedBlock(nnx.Module):
    """attn_norm -> attention -> mHC expand, then ffn_norm -> MoE -> mHC expand."""

    def _build(self, cfg: ModelConfig, attn: nnx.Module, moe_cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        """Create the sub-layers (in the backbone's order of random draws); `attn` is built by the caller."""
        self.attn = attn
        self.ffn = MoE(moe_cfg, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mix = lambda: HyperMix(cfg.dim, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, rngs=rngs,
                               unroll=cfg.sinkhorn_unroll)
        self.hc_attn, self.hc_ffn = mix(), mix()

    def mix(self, h_btcd, pre_mix_btc, attend: Callable[[jax.Array], tuple[jax.Array, Any]], kernels: str,
            image_mask_bt: jax.Array | None = None):
        """h: [B, T, hc, dim]; pre_mix: [B, T, hc] from the previous block; attend: x [B, T, dim] ->
        (y [B, T, dim], whatever else the attention returns); image_mask: bool [B, T] (image-span tokens,
        routed with `bias_vl`) or None.
        Returns (h, next pre_mix, attend's other return, the MoE's routed load int32 [E]): as in the
        release, each sub-layer collapses with the `pre` the previous one computed."""
        attn_pre, post, comb, x_btd = sublayer_input(self.hc_attn, self.attn_norm, h_btcd, pre_mix_btc, kernels)
        x_btd, attn_state = attend(x_btd)
        h_btcd = expand(x_btd, h_btcd, post, comb)
        ffn_pre, post, comb, x_btd = sublayer_input(self.hc_ffn, self.ffn_norm, h_btcd, attn_pre, kernels)
        x_btd, load_e = self.ffn(x_btd, kernels=kernels, image_mask=image_mask_bt)
        return expand(x_btd, h_btcd, post, comb), ffn_pre, attn_state, load_e
