"""One switch between the plain-jnp reference ops and the Pallas kernels.

`kernels` is "jnp" (reference, any device), "pallas" (kernels_pallas; GPU or TPU, or interpret mode
on CPU) or "auto": the kernels on GPU/TPU when the record formats are the released packed ones
(`quant.Fp4Codec` / `quant.Fp8Codec` with the released scale blocks), jnp otherwise (CPU, or e.g.
`RawCodec` caches). The model passes `ModelConfig.kernels`; users override it with
`cfg.replace(kernels=...)`.

The weight matmuls (`grouped_matmul` for routed experts, `fp8_matmuls` for FP8 projections) use the
kernels for the released packed weight formats (GPU: `gpu_grouped` (Triton) and on an H100/H200 `gpu_wgmma`
(Mosaic GPU) for bf16 decode batches, compiled and measured on an H200; TPU: `tpu_grouped`,
interpret-tested only), for decode-sized inputs only: up to `WEIGHT_KERNEL_ROWS`
rows: the expert kernel was measured on the H200 up to 384 rows (batch 64 x top-6), the FP8 one up
to 64.
Prefill chunks keep the XLA path (dequantize, then one GEMM), whose speed is what was measured before
the kernels. Their outputs agree with jnp to f32 summation order (the decoded weights are exact in the
compute dtype).

On a mesh that splits the sequences (and nothing else splits the operands), each kernel runs inside
`jax.shard_map` on each device's own sequences (`sequence_split.per_sequence`): a Pallas kernel is a
custom call that GSPMD would otherwise run on the gathered whole batch on every device.

Agreement with jnp (tests/test_kernels_*.py): selection is exact; indexer scores (full scan and pool
scan) agree to ~1e-7 relative (FP4-grid operands make every product exact, only the summation order
differs); attention to ~3e-3 relative on an H100/H200 (wgmma: q and p in bf16), ~1e-4 on other GPUs (Triton:
float16 tensor-core operands) and ~1e-5 on TPU (bf16 hi/lo splits).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

# Imported with this module, never first inside a trace: importing the Pallas modules registers a
# trace-context option (jax's `pallas_fuser_disable_nested_fuse`), and every jit traced before that
# import misses jax's trace cache after it, so each program compiled before a first kernel call (or
# beside it, in another thread) compiled a second time (experiments.decode --speculative on the H200).
import kernels_pallas as _kp
from dsv41_jax import grouped, ops, quant
from dsv41_jax.rope import apply_rope, pair_angles
from dsv41_jax.sequence_split import per_sequence

_KERNEL_FORMATS = {  # what the kernels decode: the released record layouts (the GPU's also Hopper's index key words)
    "index_key": (quant.INDEX_KEY, quant.INDEX_KEY_SM90),
    "main_kv": (quant.MAIN_KV,),
    "window_kv": (quant.WINDOW_KV,),
}


def index_key_layout(cfg) -> str:
    """The index keys' word layout a model config stores (`ModelConfig.index_key_layout`): "auto" is "sm90"
    where the dispatch's full scan is Hopper's wgmma scan (a GPU backend, an H100/H200, that scan on and its
    shapes) and `gpu_indexer_wgmma.SM90_KEYS` is on (its decode takes 12 instructions a word there against 17 for
    the released nibbles), else "nibbles"."""
    if cfg.index_key_layout != "auto":
        return cfg.index_key_layout
    wgmma = _kp.gpu_indexer_wgmma
    gpu = jax.default_backend() in ("gpu", "cuda")
    return "sm90" if gpu and wgmma.SM90_KEYS and wgmma.takes(cfg.index_n_heads, cfg.index_head_dim) else "nibbles"


def resolve(kernels: str) -> str:
    """Validate `kernels`; "auto" stays "auto" on GPU/TPU (decided per call from the codecs), else "jnp"."""
    if kernels not in ("auto", "jnp", "pallas"):
        raise ValueError(f"kernels must be auto|jnp|pallas, got {kernels!r}")
    if kernels == "auto":
        return "auto" if jax.default_backend() in ("gpu", "cuda", "tpu") else "jnp"
    return kernels


def _pallas(kernels: str, index_head_dim: int | None = None, **codecs) -> bool:
    """True when this call runs the Pallas kernels; "pallas" with other record formats is an error (index keys in
    Hopper's words: where `kernels_pallas.reads_index_words(index_head_dim)`)."""
    kernels = resolve(kernels)
    if kernels == "jnp":
        return False
    odd = [f"{name}={codec!r}" for name, codec in codecs.items()
           if codec not in _KERNEL_FORMATS[name]
           or (codec == quant.INDEX_KEY_SM90 and not _kp.reads_index_words(index_head_dim))]
    if odd and kernels == "pallas":
        raise ValueError(f"the Pallas kernels read the released packed formats only (and Hopper's index key words "
                         f"on GPUs, head_dim >= {_kp.gpu_indexer.WORDS_MIN_HEAD_DIM}), got {', '.join(odd)}; "
                         "use kernels='jnp' or 'auto' with these cache formats")
    return not odd


def indexer_scores_decode(q_bhd, w_bh, key_rec, reachable_b, codec, *, block=None, kernels="jnp"):
    """f32 [B, N] decode scores (`ops.indexer_scores_decode`); with `block`, also their block maxima
    f32 [B, ceil(N / block)], which the Pallas scan writes in the same pass."""
    if _pallas(kernels, q_bhd.shape[-1], index_key=codec):
        return per_sequence(lambda *a: _kp.indexer_scores_decode(*a, block=block, layout=codec.word_layout),
                            q_bhd, w_bh, key_rec, reachable_b)
    scores = ops.indexer_scores_decode(q_bhd, w_bh, key_rec, reachable_b, codec)
    return scores if block is None else (scores, ops.block_maxima(scores, block))


def indexer_scores_pool_decode(q_bhd, w_bh, key_rec, blocks_bk, block, reachable_b, codec, *, kernels="jnp"):
    """f32 [B, K * block] scores of the pool positions only (`ops.indexer_scores_pool_decode`)."""
    if _pallas(kernels, q_bhd.shape[-1], index_key=codec):
        return per_sequence(lambda q, w, k, b, r: _kp.indexer_scores_pool_decode(q, w, k, b, block, r,
                                                                                 layout=codec.word_layout),
                            q_bhd, w_bh, key_rec, blocks_bk, reachable_b)
    return ops.indexer_scores_pool_decode(q_bhd, w_bh, key_rec, blocks_bk, block, reachable_b, codec)


def select_topk(scores, k, *, kernels="jnp"):
    """Per device on its own sequences on a mesh, either way: GSPMD gathers the rows of a top-k."""
    if _pallas(kernels):
        return per_sequence(lambda s: _kp.select_topk(s, k), scores)
    return per_sequence(lambda s: ops.select_topk(s, k), scores)


def select_pool_topk(scores_bp, blocks_bk, block, k, *, kernels="jnp"):
    """int32 [B, k] absolute positions: the top-k of pool scores [B, K * block], ascending, -1 padded."""
    return ops.pool_topk_positions(select_topk(scores_bp, k, kernels=kernels), blocks_bk, block)


def candidate_blocks(bmax, reachable, n_blocks, block, *, kernels="jnp"):
    """int32 [..., n_blocks] pool block ids from block maxima [..., NB]: `ops.candidate_blocks` after its
    `ops.block_maxima` step."""
    return select_topk(ops.pin_newest_block(bmax, reachable, block), n_blocks, kernels=kernels)


def sparse_attention_decode(q_bhd, window_rec, window_valid, window_codec, entry_rec, idx_bk, entry_codec,
                            sink_h, scale, pos_b, inv_freq, dtype, *, kernels="jnp"):
    """[B, H, D] in `dtype`: `ops.sparse_attention_decode` with the query's rotation taken off its output
    (`apply_rope(inverse=True)` at positions pos_b [B], what the attention's output projection reads). The
    Pallas path merges its key ranges and turns the pairs back in one kernel; the jnp one is the model's own
    ops, as before."""
    if _pallas(kernels, window_kv=window_codec, main_kv=entry_codec):
        cos_bp, sin_bp = pair_angles(pos_b, inv_freq, q_bhd.shape[-1])
        return per_sequence(lambda q, w, v, e, i, c, s, sink: _kp.sparse_attention_decode(
            q, w, v, e, i, sink, scale, unrotate=(c, s), out_dtype=dtype),
            q_bhd, window_rec, window_valid, entry_rec, idx_bk, cos_bp, sin_bp, shared=(sink_h,))
    o_bhd = ops.sparse_attention_decode(q_bhd, window_rec, window_valid, window_codec, entry_rec, idx_bk,
                                        entry_codec, sink_h, scale)
    return apply_rope(o_bhd[:, None], pos_b[:, None], inv_freq, inverse=True)[:, 0].astype(dtype)


def _rows_on(kernels: str, rows: int, limit: int, gpu_only: bool = False) -> bool:
    """True when a kernel for up to `limit` rows runs: `kernels` not jnp (the kernels on a GPU / TPU, or
    interpreted on a CPU with "pallas"), and no TPU for a GPU-only kernel."""
    return rows <= limit and resolve(kernels) != "jnp" and not (gpu_only and jax.default_backend() == "tpu")


HYPER_IN_ROWS = 8  # rows (tokens) up to which a sub-layer's input side runs as GPU kernels: decode batches


def hyper_in_on(kernels: str, rows: int, hc: int, dim: int) -> bool:
    """True when a sub-layer's input side runs its kernels (`hyper_input`, `hyper_coefficients`): up to
    HYPER_IN_ROWS rows of a stream they take (`gpu_hyper.supported`), on a GPU (or "pallas" interpreted on a
    CPU). No TPU kernel: what they remove is the GPU's launches of small kernels."""
    return _rows_on(kernels, rows, HYPER_IN_ROWS, gpu_only=True) and _kp.gpu_hyper.supported(hc, dim)


def hyper_input(h_ncd, pre_mix_nc, norm_w_d, **statics):
    """x [N, D]: a hyper-connected sub-layer's input (`kernels_pallas.gpu_hyper.hyper_input`, statics as there),
    per device on a mesh."""
    return per_sequence(lambda h, p, w: _kp.hyper_input(h, p, w, **statics), h_ncd, pre_mix_nc, shared=(norm_w_d,))


def hyper_coefficients(h_ncd, mixes_nm, scale, base, **statics):
    """(pre, post [N, hc], comb [N, hc, hc]): a hyper-connected sub-layer's mHC coefficients
    (`kernels_pallas.gpu_hyper.hyper_coefficients`, statics as there), per device on a mesh."""
    return per_sequence(lambda h, m, *shared: _kp.hyper_coefficients(h, m, *shared, **statics), h_ncd, mixes_nm,
                        shared=(scale, base))


NORM_ROWS = 8  # rows (tokens) up to which an attention layer's q / kv norms run as one GPU kernel


def rms_norms_on(kernels: str, rows: int, dims) -> bool:
    """True when `rms_norms` runs its kernel: up to NORM_ROWS rows of widths it takes (`gpu_norm.supported`), on
    a GPU (or "pallas" interpreted on a CPU). No TPU kernel: what it removes is the GPU's launches of small
    kernels."""
    return _rows_on(kernels, rows, NORM_ROWS, gpu_only=True) and all(_kp.gpu_norm.supported(d) for d in dims)


def rms_norms(xs, weights, **statics):
    """[x_i normalized, in out_dtype] for rows x_i [N, D_i] of one N: RMSNorms in one GPU launch
    (`kernels_pallas.gpu_norm.rms_norms`, statics as there), per device on a mesh."""
    return per_sequence(lambda xs, *ws: _kp.rms_norms(xs, ws, **statics), list(xs), shared=tuple(weights))


# Rows (tokens) up to which a decode step's routing runs as one GPU kernel. The slice's batch-1 step on the
# H200 (sixteenth session, docs/BENCHMARKS.md "Tenth pass"): the routers' 18 kernels, 63.9 us per step ->
# 12, 42.1 us (the kernel 3.2 us per call where XLA's top-k took 5.7).
ROUTE_ROWS = 8


def route_on(kernels: str, rows: int, n_experts: int) -> bool:
    """True when `route` runs its kernel: up to ROUTE_ROWS rows of up to 4096 experts, on a GPU (or "pallas"
    interpreted on a CPU). No TPU kernel: what it removes is XLA's GPU top-k and its small neighbours."""
    return _rows_on(kernels, rows, ROUTE_ROWS, gpu_only=True) and n_experts <= 4096


def route(logits_ne, bias_e, **statics):
    """(weights f32 [N, k], ids int32 [N, k]): the top-k routing of a few rows in one GPU launch
    (`kernels_pallas.gpu_router.route`, statics as there), per device on a mesh."""
    return per_sequence(lambda lg, bias: _kp.route(lg, bias, **statics), logits_ne, shared=(bias_e,))


WEIGHT_KERNEL_ROWS = 384  # rows of x up to which the weight matmuls run the kernels (see the module doc)


def _weight_kernels(kernels: str, rows: int) -> bool:
    """True when the weight-matmul kernels run (GPU / TPU, or interpret mode on CPU with "pallas")."""
    return _rows_on(kernels, rows, WEIGHT_KERNEL_ROWS)


def grouped_matmuls(x_mk, ws, sizes_e, *, kernels="jnp"):
    """[f32 [M, N] per weight in `ws`]: rows sorted by expert times their expert's stored weight
    (`grouped.grouped_matmul`); on the kernels, weights of one shape share one launch (w1 and w3)."""
    if all(grouped.is_packed(w) for w in ws) and _weight_kernels(kernels, x_mk.shape[0]):
        return _kp.grouped_matmuls_fp4(x_mk, [(w["values"], w["scales"]) for w in ws], sizes_e)
    return [grouped.grouped_matmul(x_mk, w, sizes_e) for w in ws]


def grouped_matmul(x_mk, w, sizes_e, *, kernels="jnp"):
    """`grouped_matmuls` for one weight."""
    return grouped_matmuls(x_mk, [w], sizes_e, kernels=kernels)[0]


def rows_matmuls(x_mk, ws, expert_m, *, kernels="jnp"):
    """[f32 [M, N] per weight in `ws`]: row m (x [R, K], R | M: row m reads x[m // (M / R)]) times expert
    expert_m[m] (int32 [M], -1: zero row) of each stored weight (`grouped.rows_matmul`). On the kernels,
    weights of one shape share one launch: packed FP4 on GPU and TPU; float experts on the GPU, where XLA's
    form is a slow column reduction."""
    m = expert_m.shape[0]
    on, gpu = _weight_kernels(kernels, m), _kp.platform()[0] != "tpu"
    if on and gpu and all(grouped.is_packed(w) for w in ws):
        return _kp.rows_matmuls_fp4(x_mk, [(w["values"], w["scales"]) for w in ws], expert_m)
    _, k, n = grouped.grouped_shape(ws[0])
    if on and gpu and not any(grouped.is_packed(w) for w in ws) and k % 32 == 0 and n % 16 == 0:
        return _rows_float(None, x_mk, list(ws), expert_m)
    if not (on and all(grouped.is_packed(w) for w in ws)):
        return [grouped.rows_matmul(x_mk, w, expert_m) for w in ws]
    pairs = [(w["values"], w["scales"]) for w in ws]
    # the TPU kernel takes rows sorted by expert (no row-form TPU kernel yet): sort, run, put back
    order, sizes = grouped.sort_by_group(expert_m, pairs[0][0].shape[0])
    x_mk = jnp.repeat(x_mk, m // x_mk.shape[0], axis=0)
    return [jnp.zeros_like(y).at[order].set(y) for y in _kp.grouped_matmuls_fp4(x_mk[order], pairs, sizes)]


# Tokens up to which a decode step's routed experts run as rows on the Hopper wgmma kernel (below). The slice
# on the H200 (seventeenth session, docs/BENCHMARKS.md "Eleventh pass"): batch 8's experts 2,129 -> 1,689 us
# per step against the Triton grouped kernel. Batch 64 was not measured with it: its 384 assignments hold
# ~250 distinct experts, which the grouped kernel reads once each and the rows form ~1.5 times.
EXPERT_ROWS_TOKENS = 8


def expert_rows_on(kernels: str, x_mk, ws, m: int) -> bool:
    """True when `rows_matmuls` of x [R, K] (R <= EXPERT_ROWS_TOKENS tokens) over m rows runs the Hopper wgmma
    kernel (`kernels_pallas.gpu_wgmma`): then a decode step's few tokens take their experts as rows (each
    assignment reads its expert; an expert that two tokens share is read twice) rather than sorted into
    groups, as one token's always do."""
    return (x_mk.shape[0] <= EXPERT_ROWS_TOKENS and _weight_kernels(kernels, m) and all(grouped.is_packed(w) for w in ws)
            and _kp.rows_fp4_wgmma(x_mk, [(w["values"], w["scales"]) for w in ws], m))


def twin_gradient(kernel, twin):
    """`kernel` made differentiable through its jnp twin: f(static, *arrays) runs kernel(static, *arrays); its
    backward differentiates twin(static, *arrays) (`static` hashable and not differentiated; integer arrays
    get no cotangent). For the kernels a training forward can reach (a few tokens on a GPU)."""
    f = jax.custom_vjp(kernel, nondiff_argnums=(0,))
    f.defvjp(lambda static, *arrays: (kernel(static, *arrays), arrays),
             lambda static, arrays, grads: jax.vjp(lambda *a: twin(static, *a), *arrays)[1](grads))
    return f


_rows_float = twin_gradient(lambda _, x_mk, ws, expert_m: _kp.rows_matmuls_float(x_mk, ws, expert_m),
                            lambda _, x_mk, ws, expert_m: [grouped.rows_matmul(x_mk, w, expert_m) for w in ws])


def fp8_matmuls(x_mk, weights, *, kernels="jnp"):
    """[f32 [M, N_i] = x @ W_i^T] for FP8 block-format (E4M3, E8M0) pairs in `weights` (`grouped.fp8_matmul`);
    on the kernels, projections of one input share one launch."""
    k = x_mk.shape[1]
    if all(q.shape[0] % 32 == 0 for q, _ in weights) and k % 32 == 0 and _weight_kernels(kernels, x_mk.shape[0]):
        return per_sequence(_kp.fp8_matmuls, x_mk, shared=(list(weights),))
    return [grouped.fp8_matmul(x_mk, q, e) for q, e in weights]


def fp8_matmul(x_mk, q_nk, exp, *, kernels="jnp"):
    """`fp8_matmuls` for one weight."""
    return fp8_matmuls(x_mk, [(q_nk, exp)], kernels=kernels)[0]


def scales_beyond_fast_decode(flat_params) -> list[str]:
    """Paths of the E8M0 scale params (routed experts `.../w{1,2,3}_scale`, FP8 projections `.../scale`) whose
    largest byte is beyond what the GPU weight kernels' bf16 decode can fold into one bf16 factor
    (`kernels_pallas.gpu_grouped.FP4_FAST_MAX` / `FP8_FAST_MAX`: weights of magnitude 12 / 57344 and up).
    Released checkpoints are far inside; the checkpoint loader reports any such param."""
    from kernels_pallas.gpu_grouped import FP4_FAST_MAX, FP8_FAST_MAX

    limits = {}
    for path in flat_params:
        leaf = path.rsplit("/", 1)[-1]
        if leaf in ("w1_scale", "w2_scale", "w3_scale"):
            limits[path] = FP4_FAST_MAX
        elif leaf == "scale":
            limits[path] = FP8_FAST_MAX
    # One reduction at a time, each read back before the next starts: dispatched back to back, two
    # mesh-sharded reductions could run their all-reduces in opposite orders on two CPU device threads (a
    # deadlock, seen under load with 2 simulated devices). One jitted program over all of them would also
    # serialize them, but compiles per checkpoint layout (hundreds of inputs for the full model).
    return [p for p in limits if int(jax.numpy.max(flat_params[p])) > limits[p]]
