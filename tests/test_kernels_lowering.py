"""What a CPU can check of the GPU decode step: the whole step of the released shapes (the 6-layer v41 slice,
FP8 / FP4 weights), of `small` and of `tiny` (float32: its dots in IEEE f32, dsv41_jax.precision), lowered for an
H200 with the Pallas kernels compiled (not interpreted), uses exactly the kernels each batch should, and every
operation of their bodies has a Triton lowering.
Compiling the Triton modules, and their values, need a GPU (tests/test_kernels_gpu.py and the kernels' own
tests, compiled there). The same for a TPU: the step lowered for TPU v5e and v6e with the TPU kernels by Mosaic
(their values: interpret mode, tests/test_kernels_tpu.py; compiling them needs a TPU)."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import dsv41_jax as d
import kernels_pallas
from dsv41_jax import api
from dsv41_jax.cache import init_cache
from experiments.bench_decode import slice_config
from tests.kernel_checks import lower_for_h200, lower_for_tpu

# the cache side; `combine_unrotated` merges the attention's key ranges and undoes the rope (all but b64 on wgmma)
SCAN = {"indexer_scores", "indexer_scores_pool", "topk_from_levels", "sparse_attention", "combine_unrotated"}
FEW = {"hyper_input", "hyper_coefficients", "route", "rms_norms"}  # decode rows <= 8
MOSAIC = {"rows_matmuls_fp4_wgmma", "fp8_matmuls_wgmma", "indexer_scores_wgmma", "sparse_attention_wgmma"}  # the rest Triton
HOPPER_SCAN = SCAN - {"indexer_scores"} | {"indexer_scores_wgmma"}  # an H100/H200: the full scans on wgmma
WEIGHTS = MOSAIC - {"indexer_scores_wgmma", "sparse_attention_wgmma"}  # the weight kernels on wgmma
HOPPER = HOPPER_SCAN - {"sparse_attention"} | {"sparse_attention_wgmma"}  # ... and the attention at every batch
KERNELS = SCAN | FEW | MOSAIC | {"fp8_matmuls", "rows_matmuls_fp4", "grouped_matmuls_fp4", "rows_matmuls_float"}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU compiles the step for real")
@pytest.mark.parametrize("preset,batch,hopper,want", [
    ("v41-slice", 1, False, SCAN | FEW | {"fp8_matmuls", "rows_matmuls_fp4"}),  # one token: its experts as rows
    ("v41-slice", 8, False, SCAN | FEW | {"fp8_matmuls", "grouped_matmuls_fp4"}),
    ("v41-slice", 1, True, HOPPER | FEW | WEIGHTS),  # an H100/H200: the wgmma experts, every FP8 projection, attention
    ("v41-slice", 8, True, HOPPER | FEW | WEIGHTS),  # ... for a few tokens' rows too
    ("v41-slice", 64, False, SCAN | {"fp8_matmuls", "grouped_matmuls_fp4"}),
    # past EXPERT_ROWS_TOKENS; the attention's 2 key ranges merged in its kernel (no combine after it)
    ("v41-slice", 64, True, HOPPER - {"combine_unrotated"} | {"fp8_matmuls", "grouped_matmuls_fp4"}),
    ("small", 1, False, SCAN | FEW | {"rows_matmuls_float"}),  # float weights: only the row form has a kernel
    ("tiny", 1, False, SCAN | FEW | {"rows_matmuls_float"}),  # float32: its kernels traced under HIGHEST lower too
])
def test_decode_step_lowers_for_an_h200(preset, batch, hopper, want):
    _check_lowering(preset, batch, hopper, want)


def _check_lowering(preset, batch, hopper, want):
    cfg = slice_config(weight_format="fp8") if preset == "v41-slice" else d.preset(preset)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, 4096))
    rows = lambda *shape: jax.ShapeDtypeStruct((batch, *shape), jnp.int32)
    compiled = lambda family=None: ("gpu", False)  # the kernels as on a GPU, not interpreted
    with mock.patch.object(kernels_pallas, "platform", compiled), \
            mock.patch.object(kernels_pallas.gpu_wgmma, "is_hopper", lambda: hopper), \
            mock.patch.object(kernels_pallas.gpu_indexer_wgmma, "is_hopper", lambda: hopper), \
            mock.patch.object(kernels_pallas.gpu_wgmma, "ON", True), \
            mock.patch.object(kernels_pallas.gpu_indexer_wgmma, "ON", True):
        text = lower_for_h200(lambda p, c, t, n: api.forward(cfg, p, c, t, n, kernels="pallas"),
                              api.abstract_params(cfg), cache, rows(1), rows())
    # each kernel's jitted wrapper is a function of the module (a repeated one gets a numbered name)
    found = {re.sub(r"_\d+$", "", f) for f in re.findall(r"func\.func private @(\w+)", text)} & KERNELS
    assert found == want
    assert text.count("xla.gpu.triton") >= len(want - MOSAIC)
    assert text.count("mosaic_gpu") >= len(want & MOSAIC)


TPU_SCAN = {"indexer_scores", "indexer_scores_pool", "select_topk", "sparse_attention"}  # no GPU-only kernel
TPU_WEIGHTS = {"fp8_matmul", "grouped_matmul_fp4"}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowered here for a TPU the CPU stands in for")
@pytest.mark.parametrize("preset,batch,tokens,context,device_kind,want", [
    ("v41-slice", 1, 1, 4096, "TPU v5 lite", TPU_SCAN | TPU_WEIGHTS),  # the weight kernels too
    ("v41-slice", 64, 1, 4096, "TPU v6 lite", TPU_SCAN | TPU_WEIGHTS),
    ("v41-slice", 8, 1, 131072, "TPU v6 lite", TPU_SCAN | TPU_WEIGHTS),  # long rows: scans and selects of 128K
    ("v41-slice", 1, 1, 1 << 20, "TPU v5 lite", TPU_SCAN | TPU_WEIGHTS),  # ... and of 1M positions
    # a prefill chunk: the selection and the FP8 projections (<= 384 rows); XLA's experts and attention
    ("v41-slice", 1, 256, 4096, "TPU v5 lite", {"select_topk", "fp8_matmul"}),
    ("small", 1, 1, 4096, "TPU v5 lite", TPU_SCAN),  # float weights: XLA's dots
])
def test_forward_lowers_for_a_tpu(preset, batch, tokens, context, device_kind, want):
    cfg = slice_config(weight_format="fp8") if preset == "v41-slice" else d.preset(preset)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context))
    rows = lambda *shape: jax.ShapeDtypeStruct((batch, *shape), jnp.int32)
    with mock.patch.object(kernels_pallas, "platform", lambda family=None: ("tpu", False)):  # compiled, not interpreted
        text = lower_for_tpu(lambda p, c, t, n: api.forward(cfg, p, c, t, n, kernels="pallas"),
                             api.abstract_params(cfg), cache, rows(tokens), rows(), device_kind=device_kind)
    found = {re.sub(r"_\d+$", "", f) for f in re.findall(r"func\.func private @(\w+)", text)}
    assert found & (KERNELS | TPU_SCAN | TPU_WEIGHTS) == want
    assert text.count("tpu_custom_call") >= len(want) and "xla.gpu.triton" not in text
