"""The precision the model's matmuls ask for, decided in one place (`ModelConfig.matmul_precision`).

XLA's DEFAULT precision lets an accelerator cut an f32 dot short: a GPU runs it in TF32 (operands rounded to
10 mantissa bits), a TPU in one bf16 pass. So by default ("auto") a float32 model traces every dot under
HIGHEST, i.e. IEEE f32, as the reference computes (torch keeps TF32 off for matmuls by default). Measured on
the H200 (docs/PARITY.md, "On a GPU"): the f32 parity cases sat up to 1.12 of a logit scale of 4.26 from the
official goldens at DEFAULT, 1.3-1.7e-6 at HIGHEST. A bfloat16 model keeps the caller's setting (DEFAULT unless
set): its dots' operands are bf16, exact in TF32 and in a bf16 pass, except where a dot asks for itself
(`hyper.projection`: hc_fn is stored in f32, whatever the setting). "inherit" leaves every model at the caller's
setting (a float32 model trained in TF32 for speed); "highest" asks for IEEE f32 in any model.

The precision is read when a dot is traced, so `model_precision` wraps the functions through which the model
traces its dots: `Transformer.forward` (prefill, decode, generation, training), the draft stages'
(`dspark.draft`, `dspark.write_rings`, `dspark.distill_loss`) and the vision tower's (`vision.image_span`).
Kernels' own dots with f32 operands follow it too (Triton: IEEE; Mosaic TPU: an fp32 contraction); kernels that
round their operands on purpose (the sparse attention's f16 p in Triton, bf16 q and p on Hopper's wgmma) keep
their stated tolerances, so the exact path of a float32 model is `kernels="jnp"` (the api's default).
"""

from __future__ import annotations

import contextlib
import functools

import jax

from dsv41_jax.config import ModelConfig


def matmul_precision(cfg: ModelConfig) -> str | None:
    """jax.default_matmul_precision's value for the model's dots (None: leave the caller's)."""
    if cfg.matmul_precision == "auto":
        return "highest" if cfg.dtype == "float32" else None
    return None if cfg.matmul_precision == "inherit" else cfg.matmul_precision


def model_precision(fn):
    """`fn(model, ...)` (model: anything with a `cfg`) traced under `matmul_precision(model.cfg)`."""
    @functools.wraps(fn)
    def wrapped(model, *args, **kwargs):
        precision = matmul_precision(model.cfg)
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            return fn(model, *args, **kwargs)
    return wrapped
