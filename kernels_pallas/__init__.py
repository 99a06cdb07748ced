"""Pallas kernels for the decode hot spots, with the contracts of `dsv41_jax.ops`.

GPU kernels lower through Triton (`gpu_*`; the Hopper kernels `gpu_wgmma` and `gpu_indexer_wgmma` through
Mosaic GPU), TPU kernels through Mosaic TPU (`tpu_*`); on a CPU both run in interpret mode (that is how CI
checks them), except the Mosaic GPU ones, which have none (a CPU checks their lowering and a bit model of
their decode). The functions below take the cache records of
`dsv41_jax.quant` in the released packed formats (the GPU index scans also Hopper's words,
`quant.INDEX_KEY_SM90`) and pick the platform from the default backend
unless `family` ("gpu" | "tpu") is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import (gpu_attention, gpu_attention_wgmma, gpu_grouped, gpu_hyper, gpu_indexer, gpu_indexer_wgmma,
                            gpu_norm, gpu_router, gpu_select, gpu_wgmma, tpu_attention, tpu_grouped, tpu_indexer,
                            tpu_select)

__all__ = ["indexer_scores_decode", "indexer_scores_pool_decode", "select_topk", "sparse_attention_decode",
           "grouped_matmuls_fp4", "rows_matmuls_fp4", "rows_matmuls_float", "fp8_matmuls", "hyper_input",
           "hyper_coefficients", "rms_norms", "route", "platform", "reads_index_words"]


def platform(family: str | None = None) -> tuple[str, bool]:
    """(kernel family "gpu" | "tpu", interpret?): `family`, or the default backend's; CPU runs the GPU
    kernels interpreted, and a family other than the backend's runs interpreted too."""
    backend = jax.default_backend()
    fam = family or ("tpu" if backend == "tpu" else "gpu")
    if fam not in ("gpu", "tpu"):
        raise ValueError(f"kernel family must be gpu|tpu, got {fam!r}")
    return fam, backend == "cpu" or (fam == "tpu") != (backend == "tpu")


def _gpu_only(kernel: str, instead: str, family: str | None = None) -> bool:
    """`platform`'s interpret flag for a kernel that exists for GPUs only (what it removes is GPU-specific);
    on the TPU family an error that names what to use there."""
    fam, interpret = platform(family)
    if fam == "tpu":
        raise ValueError(f"{kernel} has no TPU kernel: use {instead} on TPUs")
    return interpret


def _index_family(family, layout: str) -> tuple[str, bool]:
    """`platform` for an index-key scan of keys in word `layout` (`quant.Fp4Codec.word_layout`): Hopper's
    words are read by the GPU kernels only."""
    fam, interpret = platform(family)
    if fam == "tpu" and layout != "nibbles":
        raise ValueError(f"the TPU index scans read the released nibbles only, got word_layout {layout!r}: store "
                         "the index keys with index_key_layout='nibbles' (or 'auto') on TPUs")
    return fam, interpret


def reads_index_words(head_dim: int, family: str | None = None) -> bool:
    """True when the index scans here read keys of head_dim channels in Hopper's words (`quant.INDEX_KEY_SM90`):
    the GPU family's, from `gpu_indexer.WORDS_MIN_HEAD_DIM` channels."""
    return platform(family)[0] == "gpu" and head_dim >= gpu_indexer.WORDS_MIN_HEAD_DIM


def indexer_scores_decode(q_bhd, w_bh, key_rec, reachable_b, *, block: int | None = None, layout: str = "nibbles",
                          family=None):
    """f32 [B, N] scores, -inf past reachable (and block maxima [B, ceil(N/block)] with `block`). q: the model's
    indexer queries, on the FP4 grid: the GPU scans take them exactly (others are rounded, to bf16 or f16). On
    an H100/H200 while `gpu_indexer_wgmma.ON`: the wgmma scan, its block maxima by XLA after it (or, while
    `gpu_indexer_wgmma.FUSED_BLOCK_MAX`, by its epilogue where block is its BLOCK). layout: the keys' word layout
    ("nibbles" as released, "sm90": GPU only)."""
    fam, interpret = _index_family(family, layout)
    if fam == "gpu" and not interpret and gpu_indexer_wgmma.supported(q_bhd, key_rec["values"], block):
        b, n = key_rec["values"].shape[:2]
        fused = gpu_indexer_wgmma.FUSED_BLOCK_MAX and block == gpu_indexer_wgmma.BLOCK
        out = gpu_indexer_wgmma.indexer_scores_wgmma(q_bhd, w_bh, key_rec["values"], key_rec["scales"], reachable_b,
                                                     q_parts=1, layout=layout, block=block if fused else None)
        if fused or block is None:
            return out
        return out, out.reshape(b, n // block, block).max(axis=-1)
    mod, kw = (tpu_indexer, {}) if fam == "tpu" else (gpu_indexer, {"layout": layout})
    return mod.indexer_scores(q_bhd, w_bh, key_rec["values"], key_rec["scales"], reachable_b, block=block,
                              interpret=interpret, **kw)


def indexer_scores_pool_decode(q_bhd, w_bh, key_rec, blocks_bk, block: int, reachable_b, *, layout: str = "nibbles",
                               family=None):
    """f32 [B, K * block] scores of the candidate pool's positions only (`ops.indexer_scores_pool_decode`);
    layout as in `indexer_scores_decode`."""
    fam, interpret = _index_family(family, layout)
    mod, kw = (tpu_indexer, {}) if fam == "tpu" else (gpu_indexer, {"layout": layout})
    return mod.indexer_scores_pool(q_bhd, w_bh, key_rec["values"], key_rec["scales"], blocks_bk, reachable_b,
                                   block=block, interpret=interpret, **kw)


def select_topk(scores, k: int, *, family=None):
    """int32 [..., k] (`ops.select_topk`); candidate blocks are this over `ops.pin_newest_block` maxima."""
    fam, interpret = platform(family)
    mod = tpu_select if fam == "tpu" else gpu_select
    return mod.select_topk(scores, k, interpret=interpret)


def sparse_attention_decode(q_bhd, window_rec, window_valid_bw, entry_rec, idx_bk, sink_h, scale: float, *,
                            unrotate=None, out_dtype=jnp.float32, family=None):
    """f32 [B, H, D] (`ops.sparse_attention_decode`); with unrotate = (cos, sin) f32 [B, D/2], the output's
    channel pairs turned back by those angles (`gpu_attention.unrotated`: the rope's inverse) and cast to
    out_dtype, on a GPU in the kernel that merges the key ranges (the wgmma kernel's merged clusters, or
    `gpu_attention.combine_unrotated` after partials)."""
    fam, interpret = platform(family)
    args = (q_bhd, window_rec["values"], window_rec["scales"], window_valid_bw, entry_rec["values"],
            entry_rec["scales"], idx_bk, sink_h, float(scale))
    out = dict(unrotate=unrotate, out_dtype=out_dtype)
    if fam == "tpu":
        return gpu_attention.finish(tpu_attention.sparse_attention(*args, interpret=interpret), **out)
    if not interpret and q_bhd.shape[0] >= gpu_attention_wgmma.MIN_BATCH and gpu_attention_wgmma.supported(
            q_bhd, window_rec["values"], entry_rec["values"]):
        return gpu_attention_wgmma.sparse_attention_wgmma(*args, **out)
    # Other GPUs and head shapes: the Triton kernel. Tiles measured on the H200 at 128K (docs/BENCHMARKS.md, issue
    # 21): a few sequences are latency-bound, so heads go in blocks of 16 with 32-key tiles and 4 warps, and enough
    # key ranges to give ~132 SMs one program each (batch 1: 20.8 us against 35.1 us for the batch-64 tiles); many
    # sequences fill the GPU by themselves and keep all heads in one program (64-key tiles, 8 warps; 87.5 us at
    # batch 64).
    # Only batches 1 and 64 were measured: the cut at 8 is a guess between them.
    b, w = q_bhd.shape[0], window_rec["values"].shape[1]
    few = b <= 8
    block_k = next((t for t in ((32, 16) if few else (64, 32, 16)) if w % t == 0), None)
    if block_k is None:
        raise ValueError(f"the GPU attention kernel needs a window size that is a multiple of 16, got {w}")
    head_blocks = gpu_attention.padded_heads(q_bhd.shape[1]) // 16 if few else 1
    splits = max(1, min(20 if few else 8, -(-132 // (b * head_blocks))))
    return gpu_attention.sparse_attention(*args, splits=splits, block_k=block_k, head_block=16 if few else None,
                                          num_warps=4 if few else 8, interpret=interpret, **out)


def grouped_matmuls_fp4(x_mk, weights, sizes_e, *, family=None):
    """[f32 [M, N] per (values, scales) in `weights`]: sorted rows times their expert's packed FP4 weight
    (`dsv41_jax.grouped` contract); on GPU one launch for all the weights."""
    fam, interpret = platform(family)
    if fam == "tpu":
        return [tpu_grouped.grouped_matmul_fp4(x_mk, v, s, sizes_e, interpret=interpret) for v, s in weights]
    return gpu_grouped.grouped_matmuls_fp4(x_mk, weights, sizes_e, interpret=interpret)


def _one_or_all_rows(x_mk, m: int):
    """x [R, K] with R | M as the Triton row kernels read it: its one row, or M rows (row m = x[m // (M / R)])."""
    rows = x_mk.shape[0]
    return x_mk if rows in (1, m) else jnp.repeat(x_mk, m // rows, axis=0)


def rows_fp4_wgmma(x_mk, weights, m: int, *, family=None) -> bool:
    """True when `rows_matmuls_fp4` of x over m rows runs the Hopper wgmma kernel (compiled on an H100/H200)."""
    return platform(family) == ("gpu", False) and gpu_wgmma.supported(x_mk, weights, m)


def rows_matmuls_fp4(x_mk, weights, expert_m, *, family=None):
    """[f32 [M, N] per (values, scales) in `weights`]: row m times expert expert_m[m] (-1: zero row), the row
    contract of `dsv41_jax.grouped` (x [R, K], R | M: row m reads x[m // (M / R)]), in one launch. On an
    H100/H200 with bf16 x: the wgmma kernel (`gpu_wgmma`); other GPUs: the Triton kernel. GPU only: the TPU
    kernel takes rows sorted by expert (`grouped_matmuls_fp4`)."""
    fam, interpret = platform(family)
    if fam == "tpu":
        raise ValueError("no TPU row-form kernel: sort the rows by expert and call grouped_matmuls_fp4")
    m = expert_m.shape[0]
    if rows_fp4_wgmma(x_mk, weights, m, family=family):
        return gpu_wgmma.rows_matmuls_fp4_wgmma(x_mk, weights, expert_m)
    return gpu_grouped.rows_matmuls_fp4(_one_or_all_rows(x_mk, m), weights, expert_m, interpret=interpret)


def rows_matmuls_float(x_mk, weights, expert_m, *, family=None):
    """`rows_matmuls_fp4` for float experts [E, K, N] (`weight_format="float"`). GPU only: XLA's TPU
    lowering of one token's experts is a matrix-vector product already, not the GPU's column reduction."""
    interpret = _gpu_only("rows_matmuls_float", "grouped.rows_matmul (XLA)", family)
    return gpu_grouped.rows_matmuls_float(_one_or_all_rows(x_mk, expert_m.shape[0]), weights, expert_m,
                                          interpret=interpret)


def fp8_matmuls(x_mk, weights, *, family=None):
    """[f32 [M, N_i] = x @ W_i^T] for (E4M3 [N_i, K], E8M0 [N_i/32, K/32]) pairs in the released FP8 block
    format; on GPU one launch for all of them."""
    fam, interpret = platform(family)
    if fam == "tpu":
        return [tpu_grouped.fp8_matmul(x_mk, q, e, interpret=interpret) for q, e in weights]
    if not interpret and gpu_wgmma.fp8_supported(x_mk, weights):  # an H100/H200, up to 8 bf16 rows
        return gpu_wgmma.fp8_matmuls_wgmma(x_mk, list(weights))
    return gpu_grouped.fp8_matmuls(x_mk, list(weights), interpret=interpret)


def hyper_input(h_ncd, pre_mix_nc, norm_w_d, **statics):
    """A hyper-connected sub-layer's input for a few rows (`gpu_hyper.hyper_input`; GPU kernel only)."""
    return gpu_hyper.hyper_input(h_ncd, pre_mix_nc, norm_w_d, interpret=_gpu_only("hyper_input", "the jnp path"),
                                 **statics)


def hyper_coefficients(h_ncd, mixes_nm, scale, base, **statics):
    """A hyper-connected sub-layer's mHC coefficients for a few rows (`gpu_hyper.hyper_coefficients`; GPU kernel
    only)."""
    return gpu_hyper.hyper_coefficients(h_ncd, mixes_nm, scale, base,
                                        interpret=_gpu_only("hyper_coefficients", "the jnp path"), **statics)


def rms_norms(xs, weights, **statics):
    """RMSNorms of several projections' few rows in one launch (`gpu_norm.rms_norms`; GPU kernel only)."""
    return gpu_norm.rms_norms(tuple(xs), tuple(weights), interpret=_gpu_only("rms_norms", "the jnp path"), **statics)


def route(logits_ne, bias_e, **statics):
    """A decode step's top-k routing for a few rows (`gpu_router.route`; GPU kernel only)."""
    return gpu_router.route(logits_ne, bias_e, interpret=_gpu_only("route", "the jnp path"), **statics)
