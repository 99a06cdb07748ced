"""Expert parallelism: the routed experts split over the `expert` mesh axis, tokens sent to the devices
that own their experts and the partial outputs sent back (dispatch / combine by all-to-all), in
`jax.shard_map`.

The devices that differ only in their `expert` coordinate form an expert group: each holds
E / ep experts and its own slice of the group's tokens. In `dp_ep` the sequences are already split
that way (over `data` and `expert`: `sequence_split`), so nothing moves to get there; in `tp_ep`
every expert shard holds the same tokens, takes its 1/ep slice, and the outputs are all-gathered over
`expert` at the end. One call:

1. route (outside, in moe.py): weights f32 [n, k] and expert ids int32 [n, k] per local token;
2. dispatch: each token goes once to every shard that owns at least one of its k experts, with its k
   ids and weights (not once per assignment);
3. compute: the shard's grouped matmul over what it received (`expert_fn`: moe.MoE._routed with the
   shard's first expert; assignments to other shards' experts fall outside its groups), f32 [rows, D]
   per received token, summed over that shard's assignments of the token. The receive buffer holds
   ep x n tokens x k assignment slots (the static worst case); when that exceeds
   `kernels.WEIGHT_KERNEL_ROWS` but one sender's block does not (decode at batch 64 per device, ep = 2:
   768 vs 384), each sender's block is its own call, so the decode kernels still run (an expert hit
   from two blocks is then read twice);
4. combine: those rows go back to the token's device, which adds them up (f32).

Buffers are static: block j of the send buffer [ep, n, ...] holds the c_j tokens bound for shard j
(first, in token order); receiving block s holds what shard s sent. Two transports, same values:
`ragged_all_to_all` moves only the c_j rows (GPU default); `all_to_all` moves whole blocks, capacity n
per destination, so nothing is ever dropped (elsewhere: XLA:CPU of jax 0.11.2 rejects the
ragged-all-to-all opcode). Rows past the counts are masked on arrival, so the two agree exactly.

Traffic per device and step with the ragged transport: sum_j c_j rows of D in the activation dtype out
(and 2k int32 words of routing per row), the same rows in f32 back. c_j <= n, and a token reaches at
most min(k, ep) shards, so the traffic follows the tokens routed to each shard -- at ep = 2 and top-6
almost every token reaches both shards (as much as gathering them all); at ep = 8 of 384 experts about
(1 - (7/8)^6) = 55% of the (token, shard) pairs are sent. The replaced scheme all-gathered every token
to every shard and summed [N, D] partial outputs with a psum.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax import kernels, sequence_split

AXIS = "expert"

# "auto": ragged_all_to_all on GPU (moves only the routed rows), all_to_all with full capacity elsewhere
TRANSPORT = "auto"


def transport() -> str:
    """The dispatch / combine collective this process uses: "ragged" or "dense" (see the module doc)."""
    if TRANSPORT not in ("auto", "ragged", "dense"):
        raise ValueError(f"expert_parallel.TRANSPORT must be auto|ragged|dense, got {TRANSPORT!r}")
    if TRANSPORT == "auto":
        return "ragged" if jax.default_backend() in ("gpu", "cuda") else "dense"
    return TRANSPORT


def _exchange(x_jn, send_j, recv_j, kind: str):
    """Block j of x [ep, n, ...] (its first send_j[j] rows) to shard j; returns [ep, n, ...] whose
    block s holds what shard s sent (first recv_j[s] rows; the rest zero with "ragged", whatever the
    sender's block held with "dense")."""
    if kind == "dense":
        return jax.lax.all_to_all(x_jn, AXIS, 0, 0, tiled=True)
    ep, n = x_jn.shape[:2]
    flat = x_jn.reshape(ep * n, *x_jn.shape[2:])
    me = jax.lax.axis_index(AXIS)
    starts = jnp.arange(ep, dtype=jnp.int32) * n
    out = jax.lax.ragged_all_to_all(flat, jnp.zeros_like(flat), starts, send_j.astype(jnp.int32),
                                    jnp.full((ep,), me * n, jnp.int32), recv_j.astype(jnp.int32), axis_name=AXIS)
    return out.reshape(x_jn.shape)


def dispatch_plan(ids_nk: jax.Array, n_local: int, ep: int) -> tuple[jax.Array, jax.Array]:
    """Which tokens go to which shard: (send_j int32 [ep]: how many tokens shard j gets, order_jn int32
    [ep, n]: row p < send_j[j] of block j is the token index sent there, in token order).

    A token goes once to each shard that owns at least one of its experts (shard = id // n_local);
    ids -1 (padding) go nowhere."""
    shard_nk = jnp.where(ids_nk >= 0, ids_nk // n_local, -1)
    need_nj = (shard_nk[:, :, None] == jnp.arange(ep)).any(axis=1)
    order_jn = jnp.argsort(~need_nj.T, axis=-1, stable=True).astype(jnp.int32)  # bound for j first
    return need_nj.sum(axis=0).astype(jnp.int32), order_jn


def _group_step(expert_fn, x_nd, w_nk, ids_nk, experts, n_local: int, ep: int, kind: str) -> jax.Array:
    """One device's dispatch, compute and combine (inside shard_map): f32 [n, D] routed output of its
    n tokens. ids -1: a padding token, sent nowhere."""
    n, k = ids_nk.shape
    send_j, order_jn = dispatch_plan(ids_nk, n_local, ep)
    recv_j = jax.lax.all_to_all(send_j, AXIS, 0, 0, tiled=True)
    meta_nk2 = jnp.concatenate([ids_nk, jax.lax.bitcast_convert_type(w_nk.astype(jnp.float32), jnp.int32)], -1)
    x_in = _exchange(x_nd[order_jn], send_j, recv_j, kind)
    meta_in = _exchange(meta_nk2[order_jn], send_j, recv_j, kind)
    valid = (jnp.arange(n)[None, :] < recv_j[:, None]).reshape(ep * n, 1)
    ids_in = jnp.where(valid, meta_in[..., :k].reshape(ep * n, k), -1)
    w_in = jnp.where(valid, jax.lax.bitcast_convert_type(meta_in[..., k:], jnp.float32).reshape(ep * n, k), 0.0)
    first = jax.lax.axis_index(AXIS) * n_local
    x_in = x_in.reshape(ep * n, -1)
    if ep * n * k > kernels.WEIGHT_KERNEL_ROWS >= n * k:  # one call per sender keeps the decode kernels
        y_in = jnp.concatenate([expert_fn(x_in[s * n:(s + 1) * n], w_in[s * n:(s + 1) * n], ids_in[s * n:(s + 1) * n],
                                          experts, first, n_local) for s in range(ep)])
    else:
        y_in = expert_fn(x_in, w_in, ids_in, experts, first, n_local)  # zero on masked rows
    y_back = _exchange(y_in.reshape(ep, n, -1), recv_j, send_j, kind)  # rows past send_j: zero either way
    return jnp.zeros((n, y_back.shape[-1]), jnp.float32).at[order_jn.reshape(-1)].add(
        y_back.reshape(ep * n, -1))


def applies(mesh) -> bool:
    """True when the routed experts of a model traced on `mesh` (the ambient abstract mesh; empty off
    a mesh) run here: experts split over `expert`, or tokens split over the mesh (each device then
    sorts and multiplies its own tokens; under plain GSPMD the sort over all tokens gathers them)."""
    return not mesh.empty and (mesh.shape.get(AXIS, 1) > 1 or bool(sequence_split.axes(mesh)))


def routed(expert_fn: Callable, x_nd: jax.Array, w_nk: jax.Array, ids_nk: jax.Array, experts: dict,
           mesh) -> jax.Array:
    """Routed-expert output f32 [N, D] of N tokens on `mesh` (where `applies(mesh)`).

    x_nd: [N, D] expert inputs (activation dtype); w_nk f32 / ids_nk int32 [N, k]: routing weights and
    global expert ids; experts: the stored expert arrays, each leading with E (split over `expert`).
    expert_fn(x [M, D], w [M, k], ids [M, k], experts_local, first_expert, n_local) -> f32 [M, D]: the
    local computation (moe.MoE._routed), run on each shard for the tokens it holds or received.
    Tokens come and go split as `sequence_split` says; when that leaves them whole on every expert
    shard (`tp_ep`), each shard takes its 1/ep slice and the outputs are gathered over `expert` at the end.
    Without an expert axis (`dp`) each device runs its own tokens through all experts, nothing moves.
    """
    ep = mesh.shape.get(AXIS, 1)
    n_experts = jax.tree.leaves(experts)[0].shape[0]
    if n_experts % ep:
        raise ValueError(f"mesh axis expert={ep} does not divide the {n_experts} routed experts; "
                         "choose an expert axis size that divides them")
    axes = sequence_split.axes(mesh)
    whole = ep > 1 and AXIS not in axes  # every expert shard holds the same tokens: slice, gather at the end
    shards = math.prod(mesh.shape[a] for a in axes) * (ep if whole else 1)
    n = x_nd.shape[0]
    pad = -n % shards  # a token count the shards do not divide (a short prefill): padding goes nowhere
    if pad:
        x_nd = jnp.pad(x_nd, ((0, pad), (0, 0)))
        w_nk = jnp.pad(w_nk, ((0, pad), (0, 0)))
        ids_nk = jnp.pad(ids_nk, ((0, pad), (0, 0)), constant_values=-1)

    def body(x, w, ids, experts_local):
        if ep == 1:
            return expert_fn(x, w, ids, experts_local, 0, n_experts)
        if whole:
            mine = lambda a: jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(AXIS) * (a.shape[0] // ep),
                                                          a.shape[0] // ep)
            x, w, ids = mine(x), mine(w), mine(ids)
        y = _group_step(expert_fn, x, w, ids, experts_local, n_experts // ep, ep, transport())
        return jax.lax.all_gather(y, AXIS, tiled=True) if whole else y

    tok, ex = P(axes), P(AXIS) if ep > 1 else P()
    y = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, jax.tree.map(lambda _: ex, experts)),
                      out_specs=tok, check_vma=False)(x_nd, w_nk, ids_nk, experts)
    return y[:n]
