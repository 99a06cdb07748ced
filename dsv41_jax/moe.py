"""Mixture of experts: sqrtsoftplus router with a selection-only bias, top-k routed experts through
`jax.lax.ragged_dot` (tokens sorted by expert, one grouped matmul per projection), one shared expert,
SwiGLU with the release's clamps (up branch to +-limit, gate branch from above).

With `weight_format="fp8"` the routed experts keep the released FP4 format: E2M1 codes packed two per
byte along the input axis (even element in the low nibble) in the checkpoint's output-major
orientation, w1/w3 [E, inter, dim/2] and w2 [E, dim, inter/2], plus one E8M0 scale per 32 inputs
(`w*_scale`, uint8 exponents); they are dequantized to the input-major form inside the computation.
With `activation_quant` the expert and shared-expert inputs are rounded to FP8 first (W4A8 / W8A8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.layers import (EXPERT_FP4, Buffer, activation_quant, normal_init, quantize_activation,
                              released_fp8_linear, weights_fp8)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


class Router(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.n_routed_experts, cfg.dim), jnp.float32))
        # aux-loss-free balancing: steers which experts are picked, never how much they weigh
        self.bias = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))
        self.k, self.func, self.scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale

    def __call__(self, x_nd: jax.Array):
        """Returns routing weights f32 [N, k], expert ids int32 [N, k], raw scores f32 [N, E]."""
        logits = jnp.einsum("nd,ed->ne", x_nd.astype(jnp.float32), self.weight[...])
        if self.func == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        elif self.func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jnp.sqrt(jax.nn.softplus(logits))
        _, ids = jax.lax.top_k(scores + jax.lax.stop_gradient(self.bias[...]), self.k)
        w = jnp.take_along_axis(scores, ids, axis=-1)
        if self.k > 1:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return w * self.scale, ids, scores


class MoE(nnx.Module):
    """Routed experts stored stacked and input-major: w1/w3 [E, dim, inter], w2 [E, inter, dim]
    (or packed FP4, output-major, with `weight_format="fp8"`: see the module docstring)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        e, d, f, dt = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.param_dtype
        self.router = Router(cfg, rngs=rngs)
        self.fp4 = weights_fp8(cfg)
        self.act_quant = activation_quant(cfg)
        for name, (d_out, d_in) in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
            w = normal_init(rngs, (e, d_out, d_in), jnp.float32 if self.fp4 else dt)
            if self.fp4:
                rec = EXPERT_FP4.encode(w)
                setattr(self, name, nnx.Param(rec["values"]))
                setattr(self, name + "_scale", nnx.Param(rec["scales"]))
            else:
                setattr(self, name, nnx.Param(w.transpose(0, 2, 1)))
        self.shared_w1 = released_fp8_linear(cfg, d, f, rngs=rngs)
        self.shared_w3 = released_fp8_linear(cfg, d, f, rngs=rngs)
        self.shared_w2 = released_fp8_linear(cfg, f, d, rngs=rngs)
        self.limit = cfg.swiglu_limit
        self.n_experts = e

    def expert_weight(self, name: str, dtype) -> jax.Array:
        """Stacked input-major expert weight [E, in, out] in `dtype` (dequantized from FP4 if stored so)."""
        w = getattr(self, name)[...]
        if not self.fp4:
            return w.astype(dtype)
        dense = EXPERT_FP4.decode({"values": w, "scales": getattr(self, name + "_scale")[...]})
        return dense.transpose(0, 2, 1).astype(dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        b, t, d = x_btd.shape
        x = x_btd.reshape(b * t, d)
        w, ids, _ = self.router(x)
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // k
        sizes = jnp.bincount(flat, length=self.n_experts).astype(jnp.int32)
        dt = x.dtype
        xq = quantize_activation(x) if self.act_quant else x  # per token, so before the gather
        xs = xq[token_of]
        h1 = jax.lax.ragged_dot(xs, self.expert_weight("w1", dt), sizes, preferred_element_type=jnp.float32)
        h3 = jax.lax.ragged_dot(xs, self.expert_weight("w3", dt), sizes, preferred_element_type=jnp.float32)
        act = (swiglu(h1, h3, self.limit) * w.reshape(-1)[order][:, None]).astype(dt)
        if self.act_quant:  # the release weights the activation before quantizing it for w2
            act = quantize_activation(act)
        ys = jax.lax.ragged_dot(act, self.expert_weight("w2", dt), sizes, preferred_element_type=jnp.float32)
        y = jnp.zeros((b * t, d), jnp.float32).at[token_of].add(ys)
        shared = self.shared_w2(swiglu(self.shared_w1(x, jnp.float32), self.shared_w3(x, jnp.float32),
                                       self.limit).astype(dt), jnp.float32)
        return (y + shared).astype(dt).reshape(b, t, d)
