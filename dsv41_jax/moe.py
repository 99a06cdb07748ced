"""Mixture of experts: sqrtsoftplus router with a selection-only bias, top-k routed experts through
`jax.lax.ragged_dot` (tokens sorted by expert, one grouped matmul per projection), one shared expert,
SwiGLU with the release's clamps (up branch to +-limit, gate branch from above).

With `weight_format="fp8"` the routed experts keep the released FP4 format: E2M1 codes packed two per
byte along the input axis (even element in the low nibble) in the checkpoint's output-major
orientation, w1/w3 [E, inter, dim/2] and w2 [E, dim, inter/2], plus one E8M0 scale per 32 inputs
(`w*_scale`, uint8 exponents). `dsv41_jax.grouped` says how they are read: only the experts that
tokens are routed to, and on GPU in their stored bytes (kernels.grouped_matmuls / rows_matmuls).
With `activation_quant` the expert and shared-expert inputs are rounded to FP8 first (W4A8 / W8A8).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import expert_parallel
from dsv41_jax.config import ModelConfig
from dsv41_jax.grouped import EXPERT_FP4, sort_by_group
from dsv41_jax.kernels import expert_rows_on, grouped_matmuls, route, route_on, rows_matmuls, twin_gradient
from dsv41_jax.layers import (Buffer, activation_quant, linears, normal_init, quantize_activation,
                              released_fp8_linear, weights_fp8)
from dsv41_jax.sequence_split import per_sequence


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        # the release stores it in bf16 (its reference upcasts both operands): param_dtype, not f32, halves the
        # bytes a decode step reads (7.9 -> 3.9 MB a layer at the released width)
        self.weight = nnx.Param(normal_init(rngs, (cfg.n_routed_experts, cfg.dim), cfg.param_dtype))
        # aux-loss-free balancing: steers which experts are picked, never how much they weigh
        self.bias = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))
        if cfg.vision_n_layers:  # the same for image-span tokens, trained apart (the release's bias_vl)
            self.bias_vl = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32))
        self.k, self.func, self.scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale

    def __call__(self, x_nd: jax.Array, image_mask_n: jax.Array | None = None, kernels: str = "jnp"):
        """Returns routing weights f32 [N, k], expert ids int32 [N, k], raw scores f32 [N, E].
        image_mask_n: bool [N], True where the selection uses `bias_vl` (image-span tokens). kernels: a GPU
        decode step's few rows pick and weigh their experts in one launch (`kernels.route`)."""
        # f32 sums of exact products: bf16 x bf16 products are exact in f32, as the reference's f32 upcast of both;
        # an f32 operand (a float32 model, or f32 params) promotes the other
        logits = jnp.einsum("nd,ed->ne", x_nd, self.weight[...], preferred_element_type=jnp.float32)
        scores = router_scores(logits, self.func)
        if image_mask_n is None and route_on(kernels, *logits.shape):
            w, ids = _route_kernel((self.k, self.func, self.scale), logits, jax.lax.stop_gradient(self.bias[...]))
            return w, ids, scores
        bias = self.bias[...]
        if image_mask_n is not None:
            bias = jnp.where(image_mask_n[:, None], self.bias_vl[...], bias)
        return (*_select(scores, jax.lax.stop_gradient(bias), self.k, self.scale), scores)


def router_scores(logits: jax.Array, func: str) -> jax.Array:
    """f32 expert scores of router logits [..., E] by the config's `score_func` (also traced inside the GPU
    routing kernel, `kernels_pallas.gpu_router`)."""
    if func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def routing_weights(chosen: jax.Array, total: jax.Array, k: int, scale: float) -> jax.Array:
    """The weights of the k chosen experts from their scores and the scores' sum (also traced inside the GPU
    routing kernel on scalars): normalized over the k (k > 1), times route_scale."""
    return (chosen / (total + 1e-20) if k > 1 else chosen) * scale


def _select(scores, bias, k: int, scale: float):
    """(w f32 [N, k], ids int32 [N, k]): the top-k of scores [N, E] + the selection bias ([E] or [N, E]) and
    their weights."""
    # per device on its own tokens on a mesh: GSPMD would gather the rows of a top-k
    _, ids = per_sequence(lambda s: jax.lax.top_k(s, k), scores + bias)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    return routing_weights(w, w.sum(axis=-1, keepdims=True), k, scale), ids


def _route_reference(consts, logits, bias):
    """(w, ids) of logits [N, E]: the jnp path, the routing kernel's twin."""
    k, func, scale = consts
    return _select(router_scores(logits, func), bias, k, scale)


def _route_by_kernel(consts, logits, bias):
    k, func, scale = consts
    return route(logits, bias, k=k, scores=router_scores, func=func, weights=routing_weights, scale=scale)


# differentiable through the jnp path: a training forward of few tokens on a GPU reaches the kernel
_route_kernel = twin_gradient(_route_by_kernel, _route_reference)


class MoE(nnx.Module):
    """Routed experts stored stacked and input-major: w1/w3 [E, dim, inter], w2 [E, inter, dim]
    (or packed FP4, output-major, with `weight_format="fp8"`: see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
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

    def _raw_experts(self) -> dict:
        """The stored routed-expert arrays by param name (a shard of them inside shard_map)."""
        names = ("w1", "w2", "w3") + (("w1_scale", "w2_scale", "w3_scale") if self.fp4 else ())
        return {n: getattr(self, n)[...] for n in names}

    def _stored(self, raw: dict, name: str):
        """One expert matrix in the form `grouped` takes: FP4 records or the float [E, in, out] array."""
        return {"values": raw[name], "scales": raw[name + "_scale"]} if self.fp4 else raw[name]

    def _routed(self, x_nd, w_nk, ids_nk, raw, first_expert, n_local: int, kernels: str) -> jax.Array:
        """Sum over each token's assignments to experts [first_expert, first_expert + n_local): f32 [N, D].

        One token (a batch-1 decode step): its k experts are distinct, so each assignment is a row that
        names its expert (`kernels.rows_matmuls`): the same expert bytes with no sort, counts or scatter
        around them (on the GPU those were ~12 small kernels per layer). A few tokens on an H100/H200
        (`kernels.expert_rows_on`) the same way: an expert two tokens share is read twice, which costs less
        than the sort and the grouped kernel. Otherwise: assignments sorted by expert into ragged groups (an
        expert shared by several tokens is read once); assignments to other experts sort last and fall
        outside the groups (zero rows).
        """
        n, k = ids_nk.shape
        local = ids_nk.reshape(-1) - first_expert
        stored = lambda names: [self._stored(raw, m) for m in names]  # noqa: E731
        if n == 1 or expert_rows_on(kernels, x_nd, stored(("w1", "w3")), n * k):
            expert = local if n_local == self.n_experts and isinstance(first_expert, int) and not first_expert \
                else jnp.where((local >= 0) & (local < n_local), local, -1)  # (all local: no select kernel)
            mm = lambda a, *names: rows_matmuls(a, stored(names), expert, kernels=kernels)  # noqa: E731
            xs, w_rows = x_nd, w_nk.reshape(-1)  # row m reads token m // k's row (no broadcast copy)
            combine = lambda ys: jnp.sum(ys.reshape(n, k, -1), axis=1)  # noqa: E731
        else:
            order, sizes = sort_by_group(local, n_local)  # grouped by expert, foreign assignments last
            mm = lambda a, *names: grouped_matmuls(a, stored(names), sizes, kernels=kernels)  # noqa: E731
            xs, w_rows = x_nd[order // k], w_nk.reshape(-1)[order]
            combine = lambda ys: jnp.zeros(x_nd.shape, jnp.float32).at[order // k].add(ys)  # noqa: E731
        h1, h3 = mm(xs, "w1", "w3")
        act = (swiglu(h1, h3, self.limit) * w_rows[:, None]).astype(x_nd.dtype)
        if self.act_quant:  # the release weights the activation before quantizing it for w2
            act = quantize_activation(act)
        (ys,) = mm(act, "w2")
        return combine(ys)

    def __call__(self, x_btd: jax.Array, *, kernels: str = "jnp",
                 image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (y [B, T, D], this layer's routed load int32 [E]: assignments per expert over all
        B*T tokens, padding included, for aux-loss-free balancing). kernels: the `dsv41_jax.kernels`
        switch of the expert and FP8 matmuls. image_mask: bool [B, T] or None, the image-span tokens
        (routed with `bias_vl`)."""
        b, t, d = x_btd.shape
        x = x_btd.reshape(b * t, d)
        w, ids, _ = self.router(x, None if image_mask is None else image_mask.reshape(b * t), kernels)
        load_e = jnp.bincount(ids.reshape(-1), length=self.n_experts)
        dt = x.dtype
        xq = quantize_activation(x) if self.act_quant else x  # per token, so before the gather
        mesh = jax.sharding.get_abstract_mesh()
        if expert_parallel.applies(mesh):  # on a mesh: tokens to their experts' devices and back
            y = expert_parallel.routed(partial(self._routed, kernels=kernels), xq, w, ids, self._raw_experts(), mesh)
        else:
            y = self._routed(xq, w, ids, self._raw_experts(), 0, self.n_experts, kernels)
        h1, h3 = linears(x, [self.shared_w1, self.shared_w3], jnp.float32, kernels=kernels)
        shared = self.shared_w2(swiglu(h1, h3, self.limit).astype(dt), jnp.float32, kernels=kernels)
        return (y + shared).astype(dt).reshape(b, t, d), load_e
