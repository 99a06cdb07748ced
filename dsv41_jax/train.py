"""Training support: the loss, a jitted optax train step, aux-loss-free expert balancing, checkpoints.

    cfg = dsv41_jax.preset("tiny")
    params = dsv41_jax.init_params(cfg)                   # the api's state: Params and Buffers
    opt = optax.adamw(3e-4)
    opt_state = init_opt_state(opt, params)
    step = make_train_step(cfg, opt)
    params, opt_state, metrics = step(params, opt_state, {"tokens": tokens_bt1})   # int32 [B, T + 1]

What one step trains, as the release does (DeepSeek-V3.2 / V4 recipe):

- The backbone by next-token cross-entropy, through the quantization-aware forward
  (`Transformer.forward(training=True)`): window KV (FP8), compressed latent (FP4/E4M3) and indexer
  q/k (FP4/E8M0) are fake-quantized with a straight-through estimator exactly where inference
  quantizes, so the forward sees the cache's values and gradients pass through as identity.
- The indexer by a KL objective: for each query, KL(p || softmax(indexer scores)) where p is the main
  attention's distribution over the same compressed positions (per-head softmax of q.k over the
  indexer's support, averaged over heads). The indexer's inputs are detached inside the forward and p
  is detached here, so the LM loss never reaches the indexer and the KL never reaches the backbone.
  The support is every reachable compressed position the indexer scores (inside the candidate pool
  for Reindex layers): the dense "warm-up" form of the objective, which trains the ranking of what
  top-k leaves out too. It costs one [B, T, H, N] score tensor per indexing layer.
- The router's selection bias outside the gradient (DeepSeek-V3's aux-loss-free balancing): after
  each step, bias_e += rate * sign(mean load - load_e) per layer, from the step's routed counts.

`params` is the whole model state of `dsv41_jax.init_params`; the optimizer sees only its
`nnx.Param` leaves (Buffers: router biases, token maps), the DSpark draft stages (`mtp`) excepted.
Training needs float weights (`weight_format="float"`).

`make_draft_train_step` trains the draft stages alone on a frozen target (self-distillation,
`dspark.distill_loss`): the target runs its forward (the training one, equal to the inference one for a
chunk from an empty cache), the draft learns its distribution at
the positions it will draft. The draft experts' selection biases are not balanced (left at zero).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv41_jax import dspark
from dsv41_jax.api import graphdef
from dsv41_jax.cache import init_cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.step import IndexerRecord

__all__ = ["split_trainable", "init_opt_state", "loss_fn", "indexer_kl", "update_expert_bias",
           "make_train_step", "split_draft", "init_draft_opt_state", "draft_loss_fn", "make_draft_train_step",
           "save_checkpoint", "restore_checkpoint"]

_DRAFT = nnx.All(nnx.Param, nnx.PathContains("mtp"))


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(trainable nnx.Param leaves of the backbone, everything else, draft stages included)."""
    return nnx.split_state(params, nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp"))), ...)


def split_draft(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the draft stages' nnx.Param leaves, everything else)."""
    return nnx.split_state(params, _DRAFT, ...)


def init_draft_opt_state(optimizer: optax.GradientTransformation, params: nnx.State):
    return optimizer.init(split_draft(params)[0])


def init_opt_state(optimizer: optax.GradientTransformation, params: nnx.State):
    return optimizer.init(split_trainable(params)[0])


def indexer_kl(rec: IndexerRecord) -> tuple[jax.Array, jax.Array]:
    """KL(main attention || indexer) of one indexing layer, summed over queries with a non-empty
    support, and the number of those queries (f32 scalars).

    rec: the layer's scores f32 [B, T, N] (-inf outside the support), attention queries [B, T, H, hd],
    the entries they attend [B, N, hd] and the softmax scale, as the training forward returns it
    (`ForwardAux.indexer`).
    """
    scores = rec.scores_btn
    support = scores > -jnp.inf  # [B, T, N]
    q = jax.lax.stop_gradient(rec.q_bthd).astype(jnp.float32)
    k = jax.lax.stop_gradient(rec.keys_bnd).astype(jnp.float32)
    logits = jnp.einsum("bthd,bnd->bthn", q, k) * rec.scale
    # a finite fill keeps empty rows NaN-free; they are dropped below
    p_heads = jax.nn.softmax(jnp.where(support[:, :, None], logits, -1e30), axis=-1)
    target = jnp.where(support, p_heads.mean(axis=2), 0.0)
    log_q = jax.nn.log_softmax(jnp.where(support, scores, -1e30), axis=-1)
    log_p = jnp.log(jnp.where(target > 0, target, 1.0))
    kl_bt = jnp.sum(jnp.where(target > 0, target * (log_p - log_q), 0.0), axis=-1)
    rows = support.any(axis=-1)
    return jnp.sum(jnp.where(rows, kl_bt, 0.0)), jnp.sum(rows).astype(jnp.float32)


def _training_forward(trainable: nnx.State, rest: nnx.State, cfg: ModelConfig, tokens_bt: jax.Array):
    """(model, logits f32 [B, T, V], forward aux) of tokens_bt int32 [B, T] as one chunk from an empty cache."""
    model = nnx.merge(graphdef(cfg), trainable, rest)
    b, t = tokens_bt.shape
    logits, _, fwd = model.forward(init_cache(cfg, b, t), tokens_bt, jnp.full((b,), t, jnp.int32), all_logits=True,
                                   training=True, with_aux=True)
    return model, logits, fwd


def forward_logits(trainable: nnx.State, rest: nnx.State, cfg: ModelConfig, tokens_bt: jax.Array) -> jax.Array:
    """Logits f32 [B, T, V] of the training forward (what `loss_fn` scores), e.g. for a teacher-forced probe."""
    return _training_forward(trainable, rest, cfg, tokens_bt)[1]


def loss_fn(trainable: nnx.State, rest: nnx.State, cfg: ModelConfig, tokens_bt1: jax.Array,
            kl_weight: float = 1.0, weights_bt: jax.Array | None = None):
    """(LM term + kl_weight * indexer_kl, aux) for full sequences tokens_bt1 int32 [B, T + 1].

    LM term: the mean next-token cross entropy, or with weights_bt (f32 [B, T], one per target) its weighted
    mean sum(w * ce) / sum(w). aux: lm_loss (the unweighted mean, whatever the weights), indexer_kl (mean
    over indexing layers and queries), expert_load int32 [L, E] and, with weights, heavy_ce: the mean cross
    entropy of the targets weighted above 1 (e.g. a retrieval task's answers; 0 when there are none).
    Each sequence is one chunk from an empty cache (capacity T).
    """
    inputs, targets = tokens_bt1[:, :-1], tokens_bt1[:, 1:]
    _, logits, fwd = _training_forward(trainable, rest, cfg, inputs)
    ce_bt = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    lm = ce_bt.mean()
    term = lm if weights_bt is None else jnp.sum(weights_bt * ce_bt) / jnp.sum(weights_bt)
    per_layer = [indexer_kl(r) for r in fwd.indexer]
    kl = (sum(s / jnp.maximum(n, 1.0) for s, n in per_layer) / len(per_layer)) if per_layer else jnp.float32(0)
    aux = {"lm_loss": lm, "indexer_kl": kl, "expert_load": fwd.expert_load_le}
    if weights_bt is not None:
        heavy = weights_bt > 1
        aux["heavy_ce"] = jnp.sum(jnp.where(heavy, ce_bt, 0.0)) / jnp.maximum(jnp.sum(heavy), 1)
    return term + kl_weight * kl, aux


def draft_loss_fn(draft: nnx.State, rest: nnx.State, cfg: ModelConfig, tokens_bt: jax.Array,
                  anchors: tuple[int, ...]):
    """(loss, aux) of the draft stages on the frozen target's forward over tokens_bt int32 [B, T] (one chunk
    from an empty cache); see `dspark.distill_loss` for the anchors and the loss."""
    # The training forward: for one chunk from an empty cache it gives the inference forward's logits and
    # hidden streams (tests/test_dspark.py), and compiles in a fraction of its time on a GPU (the inference
    # forward of `small` at batch 8 x 256 did not compile within 220 s on the H200).
    model, logits, fwd = _training_forward(draft, rest, cfg, tokens_bt)
    return dspark.distill_loss(model, fwd.hidden_btf, logits, tokens_bt, anchors)


def _optimizer_step(loss, split, optimizer, params, opt_state, *args):
    """One optimizer step on the part of `params` that `split` puts first: (updated part, the rest,
    opt_state, loss value, loss aux, grads). loss(part, rest, *args) -> (value, aux)."""
    part, rest = split(params)
    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(part, rest, *args)
    updates, opt_state = optimizer.update(grads, opt_state, part)
    return optax.apply_updates(part, updates), rest, opt_state, value, aux, grads


def make_draft_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, anchors: tuple[int, ...]):
    """A jitted draft_step(params, opt_state, batch) -> (params, opt_state, metrics) that updates only the
    draft stages (opt_state from `init_draft_opt_state`). batch: {"tokens": int32 [B, T]}; anchors: the
    cached lengths at which each sequence is drafted (1 <= n <= T - dspark_block_size)."""
    _check_trainable(cfg)
    if not cfg.has_dspark:
        raise ValueError("this config has no DSpark draft stages to train (n_mtp_layers or dspark_block_size is 0)")

    @jax.jit
    def draft_step(params, opt_state, batch):
        draft, rest, opt_state, loss, aux, grads = _optimizer_step(draft_loss_fn, split_draft, optimizer, params,
                                                                   opt_state, cfg, batch["tokens"], anchors)
        return nnx.merge_state(draft, rest), opt_state, {"loss": loss, **aux, "grad_norm": optax.tree.norm(grads)}

    return draft_step


def update_expert_bias(rest: nnx.State, load_le: jax.Array, rate: float) -> nnx.State:
    """Aux-loss-free balancing: each layer's router bias += rate * sign(mean load - load) per expert.

    load_le: routed assignments [L, E] in layer order. Returns `rest` with the biases moved.
    """
    mean = load_le.astype(jnp.float32).mean(axis=-1, keepdims=True)
    delta = rate * jnp.sign(mean - load_le.astype(jnp.float32))
    flat = []
    for path, var in nnx.to_flat_state(rest):
        if path[0] == "layers" and path[-3:] == ("ffn", "router", "bias"):
            var = var.replace(var[...] + delta[path[1]])
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def _check_trainable(cfg: ModelConfig) -> None:
    if cfg.weight_format != "float":
        raise ValueError(f"training needs float weights, got weight_format={cfg.weight_format!r}: "
                         "load the checkpoint with weight_format='float' (dequantized) to fine-tune it")


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, *, kl_weight: float = 1.0,
                    bias_rate: float = 1e-3):
    """A jitted, pure train_step(params, opt_state, batch) -> (params, opt_state, metrics).

    batch: {"tokens": int32 [B, T + 1]}, optionally "weights": f32 [B, T] (see `loss_fn`). metrics: loss,
    lm_loss, indexer_kl, grad_norm, load_imbalance (max over layers of max_e load / mean load, before the
    bias update) and, with weights, heavy_ce.
    """
    _check_trainable(cfg)

    @jax.jit
    def train_step(params, opt_state, batch):
        trainable, rest, opt_state, loss, aux, grads = _optimizer_step(loss_fn, split_trainable, optimizer, params,
                                                                       opt_state, cfg, batch["tokens"], kl_weight,
                                                                       batch.get("weights"))
        load = aux["expert_load"].astype(jnp.float32)
        rest = update_expert_bias(rest, load, bias_rate)
        metrics = {"loss": loss, "lm_loss": aux["lm_loss"], "indexer_kl": aux["indexer_kl"],
                   "grad_norm": optax.tree.norm(grads),
                   "load_imbalance": jnp.max(load.max(axis=-1) / load.mean(axis=-1)),
                   **({"heavy_ce": aux["heavy_ce"]} if "heavy_ce" in aux else {})}
        return nnx.merge_state(trainable, rest), opt_state, metrics

    return train_step


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | Path, params: nnx.State, opt_state, step: int) -> None:
    """Write params, optimizer state (None: none, a run to evaluate, not to resume) and the step number to
    directory `path` (orbax; must not exist)."""
    from dsv41_jax.checkpoint.orbax_io import save_tree

    save_tree(path, {"params": params, "step": jnp.int32(step),
                     **({} if opt_state is None else {"opt_state": opt_state})})


def restore_checkpoint(path: str | Path, params_like: nnx.State, opt_state_like=None, param_shardings=None):
    """(params, opt_state, step) from `save_checkpoint`, shaped like the templates given (arrays or
    ShapeDtypeStructs: e.g. `abstract_params` / `init_opt_state` of the same config and optimizer). Values restore
    bit-exactly. Without `opt_state_like`: the params and step only, whatever optimizer wrote the checkpoint
    (opt_state None), for evaluating a run. param_shardings: callable(param path, shape) -> Sharding placing each
    param as it is read (`partitioning.param_sharding` on a mesh); the default device otherwise."""
    from dsv41_jax.checkpoint.orbax_io import restore_tree

    like = {"params": params_like, "step": jnp.int32(0)}

    def placed(name, shape):  # the checkpoint's names are the params' paths under "params/"
        return param_shardings(name.removeprefix("params/"), shape) if name.startswith("params/") else None

    shardings = placed if param_shardings is not None else None
    if opt_state_like is None:
        got = restore_tree(path, like, shardings, hint="; restore with a template made from the same config",
                           partial=True)
        return got["params"], None, int(got["step"])
    got = restore_tree(path, {**like, "opt_state": opt_state_like}, shardings,
                       hint="; restore with templates made from the same config and optimizer")
    return got["params"], got["opt_state"], int(got["step"])
