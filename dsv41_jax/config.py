"""Model configuration: the released `config.json` (either key style) and the presets.

`ModelConfig` holds the architecture with the inference-code key names (`kv_source_layers`, ...);
`ModelConfig.from_json` also reads the HF `text_config` names (`kv_source_layer_ids`, ...).
Runtime switches (compute dtype, cache quantization) live in `RuntimeConfig`-like fields at the end
so that one frozen, hashable object can be a static jit argument.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dsv41_jax.plan import build_plan  # the layer plan carries the CSA2 checks (plan.py imports config for types only)

# HF `text_config` name -> our (inference-code) name. Keys not listed are shared by both styles.
_HF_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "max_position_embeddings": "max_seq_len",
    "num_nextn_predict_layers": "n_mtp_layers",
}


# ModelConfig fields that are choices of how to run, not part of a checkpoint's config
RUNTIME_FIELDS = ("dtype", "param_dtype", "quantize_cache", "index_keys", "index_key_layout", "weight_format",
                  "activation_quant", "sinkhorn_unroll", "matmul_precision")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the text backbone. Defaults are the released DeepSeek-V4.1-Flash values."""

    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    n_mtp_layers: int = 3  # DSpark draft stages (`mtp.*`); their compress_ratios entries (past n_layers) are 0
    # attention: one shared latent KV head (MQA), low-rank query, grouped low-rank output
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    norm_eps: float = 1e-20
    # MoE
    n_routed_experts: int = 384
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2304
    score_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # CSA2: compression schedule, sharing and the sparse indexer
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20  # < 0 disables the hierarchical candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # RoPE: window-only layers use rope_theta without YaRN; compressing layers compress_rope_theta + YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    max_seq_len: int = 1048576
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # vision tower (ViT + aligner, dsv41_jax/vision.py); vision_n_layers == 0 means text only. As in the
    # release's ModelArgs the tower is off by default; the released config.json (and `v41_flash()`) turn
    # it on. Read from inference-style config.json only (an HF `text_config` is the text backbone).
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14  # pixels per patch side
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3  # the aligner merges r x r patches into one LLM token
    vision_max_n_token: int = 1024  # LLM tokens per image at most, delimiters included
    vision_min_pixels: int = 544 * 544  # smaller images are scaled up to this many pixels
    vision_max_wh_ratio: int | None = None  # wider images are squeezed to this width/height (None: no limit)
    image_token_id: int = 129264  # every position of an image span carries this id
    # DSpark speculative decoding (dsv41_jax.dspark): n_mtp_layers stages draft dspark_block_size tokens at
    # once from noise tokens, reading the target's hidden streams at the inputs of dspark_target_layer_ids;
    # the last stage adds a low-rank Markov head and a confidence head. On iff n_mtp_layers and block > 0.
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128  # 0: the backbone's n_routed_experts
    dspark_n_activated_experts: int = 3  # 0: the backbone's n_activated_experts
    # ---- runtime switches (not part of the checkpoint) ----
    dtype: Literal["float32", "bfloat16"] = "bfloat16"  # activations / compute
    param_dtype: Literal["float32", "bfloat16"] = "bfloat16"  # random-init params
    quantize_cache: bool = True  # FP4/FP8 cache formats + in-model quantize-dequantize
    index_keys: Literal["consistent", "released"] = "consistent"
    # the cached index keys' 32-bit words (`quant.Fp4Codec.word_layout`, same bytes and codes): "sm90" is the
    # layout the Hopper scan decodes in 12 instructions a word instead of 17; "auto" takes it where that scan
    # runs (an H100/H200) once `gpu_indexer_wgmma.SM90_KEYS` is on (`kernels.index_key_layout`), the released
    # nibbles elsewhere
    index_key_layout: Literal["auto", "nibbles", "sm90"] = "auto"
    weight_format: Literal["float", "fp8"] = "float"  # "fp8": keep the released FP8/FP4 weight formats
    activation_quant: bool = False  # the release's fp8 mode: FP8-round the inputs of FP8/FP4 projections
    # Sinkhorn loop of mHC: "auto" unrolls on accelerators (fused steps, 2.6x faster decode on the H200,
    # but 36-99 s first compiles) and keeps it rolled on CPU; "rolled" compiles fast everywhere
    sinkhorn_unroll: Literal["auto", "unrolled", "rolled"] = "auto"
    # what the model's dots ask for (dsv41_jax.precision): "auto" is IEEE f32 for a float32 model and the
    # caller's jax.default_matmul_precision for a bfloat16 one; "inherit" always the caller's (e.g. TF32 on a
    # GPU at XLA's default, to train a float32 model faster); "highest" always IEEE f32. A dot that asks for
    # itself keeps it either way (`hyper.projection`: hc_fn is stored in f32)
    matmul_precision: Literal["auto", "inherit", "highest"] = "auto"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a released config dict in either key style (HF `text_config` or inference).

        Unknown keys (vision, DSpark, dtype, ...) are ignored; the result is validated (see `validate`).
        """
        if "text_config" in raw:
            raw = {**raw, **raw["text_config"]}
        d: dict[str, Any] = {}
        for key, value in raw.items():
            d[_HF_KEYS.get(key, key)] = value
        rope_scaling = raw.get("rope_scaling") or {}
        if rope_scaling:
            d.setdefault("rope_factor", rope_scaling.get("factor"))
            d.setdefault("beta_fast", rope_scaling.get("beta_fast"))
            d.setdefault("beta_slow", rope_scaling.get("beta_slow"))
            d.setdefault("original_seq_len", rope_scaling.get("original_max_position_embeddings"))
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key not in names or key in RUNTIME_FIELDS or value is None:
                continue
            default = getattr(cls, key, None)
            if isinstance(default, tuple):
                value = tuple(value)
            elif isinstance(default, float):
                value = float(value)
            kwargs[key] = value
        kwargs.update(overrides)
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> "ModelConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f), **overrides)

    def replace(self, **changes: Any) -> "ModelConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def with_derived_engram(self) -> "ModelConfig":
        """Fill engram_num_embeddings from the prime layout (the release lists it explicitly)."""
        if not self.engram_layer_ids or self.engram_num_embeddings:
            self.validate()
            return self
        from dsv41_jax.engram_hash import engram_primes

        primes = engram_primes(self.engram_layer_ids, self.engram_max_ngram_size, self.engram_n_heads,
                               self.engram_vocab_size)
        sizes = tuple(int(sum(p for per_n in layer for p in per_n)) for layer in primes)
        return self.replace(engram_num_embeddings=sizes)

    # ------------------------------------------------------------------ derived
    @property
    def ratios(self) -> tuple[int, ...]:
        """Compression ratio of each backbone layer (draft-layer entries dropped)."""
        return tuple(self.compress_ratios[: self.n_layers])

    @property
    def has_dspark(self) -> bool:
        """True when the config has DSpark draft stages (the release: 3 stages, blocks of 5)."""
        return self.n_mtp_layers > 0 and self.dspark_block_size > 0

    def dspark_moe(self) -> "ModelConfig":
        """This config with the draft stages' expert counts in the backbone's MoE fields."""
        return dataclasses.replace(
            self, n_routed_experts=self.dspark_n_routed_experts or self.n_routed_experts,
            n_activated_experts=self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def validate(self) -> None:
        """Raise ValueError naming the field (and layer) of the first inconsistency found."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"invalid ModelConfig: {msg}")

        need(self.n_layers > 0, f"n_layers must be positive, got {self.n_layers}")
        need(len(self.compress_ratios) >= self.n_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries, fewer than n_layers={self.n_layers}")
        need(self.head_dim % 32 == 0, f"head_dim={self.head_dim} must be a multiple of 32 (FP8 scale blocks)")
        need(self.index_head_dim % 32 == 0,
             f"index_head_dim={self.index_head_dim} must be a multiple of 32 (FP4 E8M0 scale blocks)")
        need(0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim) and self.rope_head_dim % 2 == 0,
             f"rope_head_dim={self.rope_head_dim} must be even and fit head_dim and index_head_dim")
        need(self.n_heads % self.o_groups == 0, f"n_heads={self.n_heads} not divisible by o_groups={self.o_groups}")
        need(0 < self.n_activated_experts <= self.n_routed_experts,
             f"n_activated_experts={self.n_activated_experts} must be in 1..n_routed_experts={self.n_routed_experts}")
        need(self.n_shared_experts == 1, f"n_shared_experts must be 1 (the released design), got {self.n_shared_experts}")
        need(self.score_func in ("sqrtsoftplus", "softmax", "sigmoid"), f"unknown score_func {self.score_func!r}")
        need(self.dtype in ("float32", "bfloat16"), f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        need(self.index_keys in ("consistent", "released"), f"index_keys must be consistent|released, got {self.index_keys!r}")
        need(self.index_key_layout in ("auto", "nibbles", "sm90"),
             f"index_key_layout must be auto|nibbles|sm90, got {self.index_key_layout!r}")
        need(self.weight_format in ("float", "fp8"), f"weight_format must be float|fp8, got {self.weight_format!r}")
        need(self.sinkhorn_unroll in ("auto", "unrolled", "rolled"),
             f"sinkhorn_unroll must be auto|unrolled|rolled, got {self.sinkhorn_unroll!r}")
        need(self.matmul_precision in ("auto", "inherit", "highest"),
             f"matmul_precision must be auto|inherit|highest, got {self.matmul_precision!r}")
        need(self.window_size > 0, "window_size must be positive")
        for name in ("engram_layer_ids",):
            for l in getattr(self, name):
                need(0 <= l < self.n_layers, f"{name} has layer {l}, outside 0..{self.n_layers - 1}")
        if self.engram_layer_ids:
            need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size must be >= 2")
            need(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
                 f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                 f"{len(self.engram_layer_ids)} engram_layer_ids")
        if self.vision_n_layers:
            need(self.vision_n_layers > 0, f"vision_n_layers must be >= 0, got {self.vision_n_layers}")
            need(self.vision_dim % self.vision_n_heads == 0 and (self.vision_dim // self.vision_n_heads) % 4 == 0,
                 f"vision_dim={self.vision_dim} / vision_n_heads={self.vision_n_heads} must be a head size divisible "
                 "by 4 (2D RoPE rotates two halves of even size)")
            need(self.vision_patch_size > 0 and self.vision_downsample_ratio > 0,
                 "vision_patch_size and vision_downsample_ratio must be positive")
            need(self.vision_max_n_token >= 4, f"vision_max_n_token={self.vision_max_n_token} must be >= 4 "
                 "(one token plus its row end and the two span delimiters)")
            need(0 <= self.image_token_id < self.vocab_size,
                 f"image_token_id={self.image_token_id} outside the vocabulary (0..{self.vocab_size - 1})")
        if self.has_dspark:
            extra = self.compress_ratios[self.n_layers:]
            need(not any(extra), f"compress_ratios past n_layers (the draft stages) must be 0, got {list(extra)}")
            need(len(self.dspark_target_layer_ids) > 0, "dspark_target_layer_ids is empty: DSpark reads target layers")
            for l in self.dspark_target_layer_ids:
                need(0 <= l < self.n_layers, f"dspark_target_layer_ids has layer {l}, outside 0..{self.n_layers - 1}")
            need(0 <= self.dspark_noise_token_id < self.vocab_size,
                 f"dspark_noise_token_id={self.dspark_noise_token_id} outside the vocabulary")
            need(self.dspark_block_size + 1 <= self.window_size,
                 f"dspark_block_size={self.dspark_block_size} + 1 must fit the window ({self.window_size}): "
                 "a verified block must not wrap a window ring")
            need(self.dspark_markov_rank > 0, "dspark_markov_rank must be positive")
            moe = self.dspark_moe()
            need(0 < moe.n_activated_experts <= moe.n_routed_experts,
                 f"dspark experts: {moe.n_activated_experts} activated of {moe.n_routed_experts}")
        build_plan(self)  # CSA2 consistency


def tiny() -> ModelConfig:
    """CPU scale, every structural feature kept.

    8 layers: 0-1 window-only; 2 Full (m=2); 3 Reuse; 4 Full (m=1, candidate source); 5 Reuse;
    6 Reindex (scores only inside the pool of 3 blocks x 4 = 12 positions); 7 Reuse.
    Engram at layers 1 and 3; 4 hyper-connection copies; 8 experts, top-2. A 2-block vision tower
    (patch 14, 3x3 downsample, at most 64 tokens per image); the image token is the last id.
    DSpark: 2 stages drafting blocks of 3 from the inputs of layers 3 (an Engram layer) and 7.
    """
    return ModelConfig(
        vocab_size=320, dim=64, n_layers=8, n_mtp_layers=2,
        n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32,
        window_size=16,
        n_routed_experts=8, n_activated_experts=2, moe_inter_dim=32, route_scale=1.5, swiglu_limit=10.0,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0),
        kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
        index_n_heads=4, index_head_dim=32, index_topk=8,
        candidate_source_layer=4, candidate_topk_blocks=3, candidate_block_size=4,
        hc_mult=4, hc_sinkhorn_iters=20,
        original_seq_len=64, rope_factor=4.0, max_seq_len=4096,
        engram_layer_ids=(1, 3), engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=16,
        engram_vocab_size=101, engram_num_embeddings=(), engram_pad_id=2,
        engram_compressed_vocab_size=320,
        vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=64, vision_max_n_token=64,
        vision_min_pixels=84 * 84, image_token_id=319,
        dspark_block_size=3, dspark_noise_token_id=318, dspark_target_layer_ids=(3, 7), dspark_markov_rank=16,
        dspark_n_routed_experts=8, dspark_n_activated_experts=2,
        dtype="float32", param_dtype="float32",
    ).with_derived_engram()


def small() -> ModelConfig:
    """About 0.6B parameters for one GPU: the released structure, scaled down.

    12 layers: 0-1 window-only; 2, 5 Full (m=2); 7 Full (m=1, candidate source); 9, 11 Reindex.
    A 4-block vision tower of width 256 (at most 256 tokens per image).
    DSpark fields sized for it (one stage, blocks of 4, reading layers 9-11) but no stages
    (n_mtp_layers=0): `small(n_mtp_layers=1)` adds the stage that `experiments.train_draft`
    trains on a frozen target.
    """
    return ModelConfig(
        vocab_size=129280, dim=1024, n_layers=12, n_mtp_layers=0,
        n_heads=16, head_dim=256, rope_head_dim=64, q_lora_rank=384, o_groups=4, o_lora_rank=256,
        window_size=128,
        n_routed_experts=16, n_activated_experts=2, moe_inter_dim=384,
        compress_ratios=(0, 0) + (2,) * 5 + (1,) * 5,
        kv_source_layers=(2, 5, 7), index_source_layers=(2, 5, 7, 9, 11),
        index_n_heads=16, index_head_dim=128, index_topk=512,
        candidate_source_layer=7, candidate_topk_blocks=512, candidate_block_size=8,
        engram_layer_ids=(1, 5), engram_max_ngram_size=3, engram_n_heads=4, engram_head_dim=128,
        engram_vocab_size=16384, engram_num_embeddings=(), engram_compressed_vocab_size=129280,
        dspark_block_size=4, dspark_noise_token_id=128799, dspark_target_layer_ids=(9, 10, 11),
        dspark_markov_rank=64, dspark_n_routed_experts=16, dspark_n_activated_experts=2,
        max_seq_len=262144,
        vision_n_layers=4, vision_dim=256, vision_n_heads=4, vision_inter_dim=704, vision_max_n_token=256,
        vision_min_pixels=224 * 224, image_token_id=129264,
        dtype="bfloat16", param_dtype="bfloat16",
    ).with_derived_engram()


def v41_flash() -> ModelConfig:
    """The released DeepSeek-V4.1-Flash: the text backbone and its 32-block vision tower."""
    return ModelConfig(vision_n_layers=32)


PRESETS = {"tiny": tiny, "small": small, "v41-flash": v41_flash}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
