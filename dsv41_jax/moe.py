"""Mixture of experts: sqrtsoftplus router with a selection-only bias, top-k routed experts through
`jax.lax.ragged_dot` (tokens sorted by expert, one grouped matmul per projection), one shared expert,
SwiGLU with the release's clamps (up branch to +-limit, gate branch from above)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.layers import Buffer, Linear, normal_init


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
    """Routed experts stored stacked and input-major: w1/w3 [E, dim, inter], w2 [E, inter, dim]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        e, d, f, dt = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.param_dtype
        self.router = Router(cfg, rngs=rngs)
        self.w1 = nnx.Param(normal_init(rngs, (e, f, d), dt).transpose(0, 2, 1))
        self.w3 = nnx.Param(normal_init(rngs, (e, f, d), dt).transpose(0, 2, 1))
        self.w2 = nnx.Param(normal_init(rngs, (e, d, f), dt).transpose(0, 2, 1))
        self.shared_w1 = Linear(d, f, rngs=rngs, dtype=dt)
        self.shared_w3 = Linear(d, f, rngs=rngs, dtype=dt)
        self.shared_w2 = Linear(f, d, rngs=rngs, dtype=dt)
        self.limit = cfg.swiglu_limit
        self.n_experts = e

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        b, t, d = x_btd.shape
        x = x_btd.reshape(b * t, d)
        w, ids, _ = self.router(x)
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // k
        sizes = jnp.bincount(flat, length=self.n_experts).astype(jnp.int32)
        xs = x[token_of]
        dt = x.dtype
        h1 = jax.lax.ragged_dot(xs, self.w1[...].astype(dt), sizes, preferred_element_type=jnp.float32)
        h3 = jax.lax.ragged_dot(xs, self.w3[...].astype(dt), sizes, preferred_element_type=jnp.float32)
        act = swiglu(h1, h3, self.limit) * w.reshape(-1)[order][:, None]
        ys = jax.lax.ragged_dot(act.astype(dt), self.w2[...].astype(dt), sizes, preferred_element_type=jnp.float32)
        y = jnp.zeros((b * t, d), jnp.float32).at[token_of].add(ys)
        shared = self.shared_w2(swiglu(self.shared_w1(x, jnp.float32), self.shared_w3(x, jnp.float32),
                                       self.limit).astype(dt), jnp.float32)
        return (y + shared).astype(dt).reshape(b, t, d)
