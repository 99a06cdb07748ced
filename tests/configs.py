"""Model configs shared by several test modules, so that their programs are the same ones (compiled once per
process, and once per run through the suite's compilation cache, conftest.py)."""

import dataclasses
import os

import pytest

import dsv41_jax as d
from dsv41_jax.config import ModelConfig

TINY = d.preset("tiny")


def covered_elsewhere(by: str):
    """A mark for a case that `by` (other tests of the default run) covers: skipped, saying so, unless DSV41_FULL=1
    (README), for the suite's time on the 2-core CI machine (under 15 minutes)."""
    return pytest.mark.skipif(os.environ.get("DSV41_FULL") != "1", reason=f"covered by {by}: DSV41_FULL=1 runs it")


def five_layers(cfg: ModelConfig) -> ModelConfig:
    """`cfg` (tiny, or a config made from it) with every layer mode of tiny in 5 layers instead of 8, for tests
    whose subject is not tiny's depth: each program builds in ~35-40% less time on the CPU (tracing, lowering,
    XLA). 0 window; 1 Full m=2 (kv source, Engram); 2 Full m=1 (kv source, candidate source); 3 Reindex inside
    the pool; 4 Reuse (of 2's KV and 3's top-k). As in tiny, two layers come after the last kv source (the
    decoder layers of bounded prefill), and the DSpark draft stages read an Engram layer (1, as tiny's 3) and
    the last layer (4, as tiny's 7). Everything else (widths, window, experts, cache formats, draft stages,
    vision tower) is `cfg`'s."""
    return dataclasses.replace(cfg, n_layers=5, compress_ratios=(0, 2, 1, 1, 1) + (0,) * cfg.n_mtp_layers,
                               kv_source_layers=(1, 2), index_source_layers=(1, 2, 3), candidate_source_layer=2,
                               engram_layer_ids=(1,), engram_num_embeddings=(),
                               dspark_target_layer_ids=(1, 4)).with_derived_engram()


TINY5 = five_layers(TINY)


def five_layer_presets(model_config):
    """`experiments.decode.model_config` (the CLIs' config from their arguments) with `--preset tiny` as
    `five_layers` of it; a checkpoint's or a run's config as it is."""
    def config(args):
        cfg = model_config(args)
        return five_layers(cfg) if args.preset == "tiny" and not (args.checkpoint or args.run) else cfg
    return config
