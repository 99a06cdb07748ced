"""Config reading (both key styles), the CSA2 plan, validation errors, and the 890 B/token budget."""

import dataclasses
import json

import numpy as np
import pytest

import dsv41_jax as d
from dsv41_jax import api
from dsv41_jax.cache import cache_capacity
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import engram_primes
from dsv41_jax.plan import Mode, build_plan

RELEASED_INFERENCE = {  # the released inference-style config.json, text fields
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "n_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280,
    "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "kv_source_layers": [2, 8, 14, 20], "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4", "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "engram_n_heads": 8, "engram_head_dim": 256,
    "vision_n_layers": 32,
}

RELEASED_HF = {"model_type": "deepseek_v41", "text_config": {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "rms_norm_eps": 1e-20,
    "num_nextn_predict_layers": 3}}

ARCH_FIELDS = [f for f in ModelConfig.__dataclass_fields__ if f not in ("dtype", "param_dtype", "quantize_cache",
                                                                        "index_keys", "compress_ratios", "n_mtp_layers")]


def test_both_key_styles_give_the_released_preset(tmp_path):
    for raw in (RELEASED_INFERENCE, RELEASED_HF):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(raw))
        cfg = ModelConfig.from_json(path)
        ref = d.preset("v41-flash")
        if raw is RELEASED_HF:  # an HF text_config describes the text backbone only
            assert cfg.vision_n_layers == 0
            ref = ref.replace(vision_n_layers=0)
        for f in ARCH_FIELDS:
            assert getattr(cfg, f) == getattr(ref, f), f
        assert cfg.ratios == ref.ratios


def test_released_plan():
    plan = build_plan(d.preset("v41-flash"))
    modes = {m: [p.layer for p in plan if p.mode is m] for m in Mode}
    assert modes[Mode.WINDOW] == [0, 1]
    assert modes[Mode.FULL] == [2, 8, 14, 20]
    assert modes[Mode.REINDEX] == [24, 28, 32, 36]
    assert len(modes[Mode.REUSE]) == 30
    # decoder layers read the layer-20 source (causal encoder-decoder); reuse layers the latest top-k
    assert all(p.kv_source == 20 for p in plan[21:])
    assert plan[27].topk_source == 24 and plan[7].topk_source == 2
    assert [p.layer for p in plan if p.uses_candidates] == [24, 28, 32, 36]
    assert [p.layer for p in plan if p.is_candidate_source] == [20]
    assert all(p.yarn for p in plan[2:]) and not any(p.yarn for p in plan[:2])


def test_tiny_keeps_every_structural_feature():
    cfg = d.preset("tiny")
    plan = build_plan(cfg)
    modes = {p.mode for p in plan}
    assert modes == set(Mode)
    assert {p.ratio for p in plan if p.mode is Mode.FULL} == {1, 2}
    assert any(p.uses_candidates for p in plan)
    # the pool (blocks x block size) is smaller than the context a test uses, and larger than top-k
    assert cfg.index_topk < cfg.candidate_topk_blocks * cfg.candidate_block_size < 40
    assert cfg.engram_layer_ids and cfg.hc_mult > 1 and cfg.n_routed_experts > cfg.n_activated_experts


def test_the_plan_is_derived_once_per_config():
    """build_plan is cached by the frozen config: an equal config (another object) gets the same plan,
    and the cache and the api's checked calls reuse it instead of deriving it again."""
    cfg = d.preset("tiny", window_size=24)  # a config no other test derives
    plan = build_plan(cfg)
    assert build_plan(dataclasses.replace(cfg)) is plan
    derived = build_plan.cache_info().misses
    cache = d.init_cache(cfg, 2, 8)
    assert cache_capacity(cache, cfg) == 8
    with pytest.raises(ValueError, match="exceeds its capacity of 8"):  # checked before anything is traced
        api.prefill(cfg, None, cache, np.zeros((2, 9), np.int32), np.full(2, 9))
    assert build_plan.cache_info().misses == derived


@pytest.mark.parametrize("change,words", [
    (dict(kv_source_layers=(4,), index_source_layers=(4,)), ["layer 2", "before any kv source"]),
    (dict(compress_ratios=(0, 0, 2, 1, 1, 1, 1, 1)), ["compress_ratios[3]=1", "layer 2"]),
    (dict(kv_source_layers=(2, 4, 9)), ["kv_source_layers", "layer 9"]),
    (dict(index_source_layers=(2, 6)), ["kv_source_layers", "layer 4", "index_source_layers"]),
    (dict(candidate_source_layer=6), ["candidate_source_layer=6"]),
    (dict(n_heads=3), ["n_heads=3", "o_groups"]),
    (dict(kv_source_layers=(0, 4), index_source_layers=(0, 4, 6)), ["layer 0", "window-only"]),
])
def test_inconsistent_configs_are_rejected_with_field_and_layer(change, words):
    with pytest.raises(ValueError) as e:
        d.preset("tiny", **change)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_engram_table_sizes_follow_the_prime_layout():
    cfg = d.preset("v41-flash")
    primes = engram_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
    assert tuple(sum(p for per_n in layer for p in per_n) for layer in primes) == cfg.engram_num_embeddings


def test_v41_flash_measures_890_bytes_per_token():
    for capacity in (4096, 131072, 1 << 20):
        assert d.global_bytes_per_token(d.preset("v41-flash"), capacity) == 890.0
    # quantization off stores the same entries as raw bf16: 2.5 x (512 + 128) x 2 bytes
    assert d.global_bytes_per_token(d.preset("v41-flash", quantize_cache=False), 4096) == 2.5 * 640 * 2
