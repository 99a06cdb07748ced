"""dsv41_jax: DeepSeek-V4.1-Flash in JAX / Flax NNX.

Data flows one way: config -> layer plan -> params -> cache -> step functions.
"""

__version__ = "0.1.0"  # the same as pyproject.toml's (tests/test_packaging.py checks); also on a bare checkout

from dsv41_jax.api import (abstract_params, decode_step, forward, freeze, generate, init_params, prefill,
                           prefill_chunks)
from dsv41_jax.cache import Cache, cache_bytes, global_bytes_per_token, init_cache
from dsv41_jax.config import PRESETS, ModelConfig, preset
from dsv41_jax.plan import LayerPlan, Mode, build_plan

__all__ = [
    "ModelConfig", "preset", "PRESETS", "build_plan", "LayerPlan", "Mode",
    "init_params", "abstract_params", "freeze", "init_cache", "Cache", "prefill", "prefill_chunks", "decode_step", "generate", "forward",
    "cache_bytes", "global_bytes_per_token",
]
