"""Write random checkpoints in the released layout (tests, parity goldens, load benchmarks).

`make_tensors(cfg)` draws every tensor the backbone needs in the released names and dtypes: dense
projections FP8 E4M3 with E8M0 32x32 block scales, routed experts FP4 codes packed two per byte (I8)
with E8M0 scales per 32 inputs, Engram tables FP8 with E8M0 scales per 32 channels, the rest BF16 /
F32 as the release stores them. Magnitudes follow the release's measured statistics (norm weights
well below 1, embedding RMS ~0.12, projection gains above fan_in^-0.5) so a small random stack stays
as well conditioned as the real one. `to_hf_float` turns the same tensors into an HF-named, all-float
export (exact: every FP8/FP4 value is a bf16 value). `write_checkpoint` lays them out on disk with
config.json and tokenizer.json, as one file or as an index plus one shard per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint.layout import entries
from dsv41_jax.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE, write_safetensors
from dsv41_jax.config import ModelConfig

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
EMBED_STD = 0.12
# mean of each norm's weight (std 10% of it) and gain over fan_in^-0.5 of each projection, by module name
NORM_MEAN = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
             "k_norm": 0.5, "norm": 1.0}
GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5,
        "w2": 1.05}
F32_NAMES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
             "attn_sink", "gate.bias", "gate.bias_vl", "q_weight", "k_weight")


DSPARK_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
                 "dspark_n_routed_experts", "dspark_n_activated_experts")


def _e8m0_exponent(x: np.ndarray) -> np.ndarray:
    """uint8 biased exponent of 2^ceil(log2(x)) for positive f32 x (the release's scale rounding)."""
    bits = np.asarray(x, np.float32).view(np.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return np.clip(exp, 1, 254).astype(np.uint8)


def quantize_fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32 [out, in] -> (E4M3 [out, in], E8M0 exponents [ceil(out/32), ceil(in/32)])."""
    o, i = w.shape
    wp = np.pad(w, ((0, -o % 32), (0, -i % 32)))
    tiles = wp.reshape(wp.shape[0] // 32, 32, wp.shape[1] // 32, 32)
    exp = _e8m0_exponent(np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-4) * np.float32(1 / 448))
    scale = np.ldexp(np.float32(1), exp.astype(np.int32) - 127)
    q = np.clip(tiles / scale[:, None, :, None], -448, 448).astype(E4M3)
    return np.ascontiguousarray(q.reshape(wp.shape)[:o, :i]), exp


def quantize_fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32 [rows, d] -> (E4M3 [rows, d], E8M0 [rows, d/32]): the Engram table format."""
    g = w.reshape(w.shape[0], -1, 32)
    exp = _e8m0_exponent(np.maximum(np.abs(g).max(-1), 1e-4) * np.float32(1 / 448))
    scale = np.ldexp(np.float32(1), exp.astype(np.int32) - 127)
    return np.clip(g / scale[..., None], -448, 448).astype(E4M3).reshape(w.shape), exp


def _norm_mean(name: str) -> float:
    owner = name.rsplit(".weight", 1)[0]
    for key, mean in NORM_MEAN.items():
        if owner == key or owner.endswith("." + key):
            return mean
    return 1.0


def _gain(key: str) -> float:
    return GAIN.get(key.rsplit(".", 1)[-1], 1.0)


def make_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray | tuple[str, np.ndarray]]:
    """Every backbone tensor in the released names and dtypes ((dtype name, array) where numpy has none)."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for e in entries(cfg):
        for key in e.names:
            if e.kind == "plain":
                if key.endswith("norm.weight") or key.startswith("vision.") and key.endswith(("norm1.weight",
                                                                                               "norm2.weight")):
                    v = _norm_mean(key) * (1 + 0.1 * rng.standard_normal(e.shape))
                elif key in ("embed.weight",) or key.startswith("image_"):  # delimiters stand in for embeddings
                    v = EMBED_STD * rng.standard_normal(e.shape)
                elif key.endswith(".bias") and not key.endswith("gate.bias"):  # the vision tower's biases
                    v = 0.02 * rng.standard_normal(e.shape)
                elif len(e.shape) >= 2:
                    v = rng.standard_normal(e.shape) * e.shape[-1] ** -0.5 * _gain(key.rsplit(".weight", 1)[0])
                else:
                    v = 0.5 * rng.standard_normal(e.shape)
                f32 = any(key.endswith(n) for n in F32_NAMES)
                out[key] = v.astype(np.float32 if f32 else BF16)
            elif e.kind in ("dense", "dense_dequant"):
                w = rng.standard_normal(e.shape).astype(np.float32) * e.shape[1] ** -0.5 * _gain(key)
                q, s = quantize_fp8_blocks(w)
                out[key + ".weight"], out[key + ".scale"] = q, ("F8_E8M0", s)
            elif e.kind == "experts":
                # E2M1 codes drawn directly (RMS ~3.2) with one power-of-two scale per 32 inputs aiming
                # at an RMS of gain * fan_in^-0.5; quantizing gaussians would cost minutes at real sizes
                o, i = e.shape
                packed = rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
                base = round(np.log2(i ** -0.5 * _gain(key) / 3.2))
                exp = (127 + base + rng.integers(-1, 2, (o, i // 32))).astype(np.uint8)
                out[key + ".weight"], out[key + ".scale"] = ("I8", packed.view(np.int8)), ("F8_E8M0", exp)
            else:  # Engram table
                q, s = quantize_fp8_rows(0.5 * rng.standard_normal(e.shape).astype(np.float32))
                out[key + ".weight"], out[key + ".scale"] = q, ("F8_E8M0", s)
    return out


def _array(v) -> tuple[str | None, np.ndarray]:
    return v if isinstance(v, tuple) else (None, v)


def to_hf_float(tensors: dict) -> dict[str, np.ndarray]:
    """The same weights as an HF export: `model.` prefix, `lm_head.weight`, every weight BF16/F32."""
    def exp2(s):
        return np.ldexp(np.float32(1), s.astype(np.int32) - 127)

    out = {}
    for name, v in tensors.items():
        hint, arr = _array(v)
        if name.endswith(".scale"):
            continue
        if hint == "I8":  # FP4 expert [out, in/2] with scales [out, in/32]
            b = arr.view(np.uint8)
            codes = np.stack([b & 0x0F, b >> 4], -1).reshape(b.shape[0], -1)
            grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
            s = _array(tensors[name[:-len(".weight")] + ".scale"])[1]
            arr = (grid[codes] * np.repeat(exp2(s), 32, axis=1)).astype(BF16)
        elif arr.dtype == E4M3:
            s = _array(tensors[name[:-len(".weight")] + ".scale"])[1]
            o, i = arr.shape
            if s.shape == (o, i // 32):  # Engram rows
                scale = np.repeat(exp2(s), 32, axis=1)
            else:
                scale = np.repeat(np.repeat(exp2(s), 32, 0)[:o], 32, 1)[:, :i]
            arr = (arr.astype(np.float32) * scale).astype(BF16)
        out["lm_head.weight" if name == "head.weight" else "model." + name] = arr
    return out


def tokenizer_vocab(vocab_size: int) -> list[str]:
    """Fixture vocabulary: specials, then triples that normalize alike ("tok7", " Tok7", "TÓK7")."""
    words = ["<pad>", "<s>", "</s>"]
    k = 0
    while len(words) < vocab_size:
        words += [f"tok{k}", f" Tok{k}", f"T\u00d3K{k}"]
        k += 1
    return words[:vocab_size]


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models

    vocab = {w: i for i, w in enumerate(tokenizer_vocab(vocab_size))}
    Tokenizer(models.WordLevel(vocab, unk_token="<pad>")).save(str(path))


def config_json(cfg: ModelConfig, style: str = "hf") -> dict:
    """The config as the release writes it: HF (`text_config`, HF key names) or inference style."""
    ours = {
        "vocab_size": cfg.vocab_size, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_mtp_layers": cfg.n_mtp_layers,
        "n_heads": cfg.n_heads, "head_dim": cfg.head_dim, "rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "window_size": cfg.window_size, "norm_eps": cfg.norm_eps, "n_routed_experts": cfg.n_routed_experts,
        "n_activated_experts": cfg.n_activated_experts, "n_shared_experts": cfg.n_shared_experts,
        "moe_inter_dim": cfg.moe_inter_dim, "score_func": cfg.score_func, "route_scale": cfg.route_scale,
        "swiglu_limit": cfg.swiglu_limit, "compress_ratios": list(cfg.compress_ratios),
        "kv_source_layers": list(cfg.kv_source_layers), "index_source_layers": list(cfg.index_source_layers),
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "candidate_source_layer": cfg.candidate_source_layer, "candidate_topk_blocks": cfg.candidate_topk_blocks,
        "candidate_block_size": cfg.candidate_block_size, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta, "rope_factor": cfg.rope_factor,
        "original_seq_len": cfg.original_seq_len, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
        "max_seq_len": cfg.max_seq_len, "engram_layer_ids": list(cfg.engram_layer_ids),
        "engram_max_ngram_size": cfg.engram_max_ngram_size, "engram_n_heads": cfg.engram_n_heads,
        "engram_head_dim": cfg.engram_head_dim, "engram_vocab_size": cfg.engram_vocab_size,
        "engram_num_embeddings": list(cfg.engram_num_embeddings), "engram_pad_id": cfg.engram_pad_id,
        "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size, "dtype": "fp8", "expert_dtype": "fp4",
    }
    if cfg.has_dspark:
        ours.update({f: (list(v) if isinstance(v, tuple) else v) for f in DSPARK_FIELDS for v in [getattr(cfg, f)]})
    if style == "inference":
        if cfg.vision_n_layers:  # the vision keys exist in the inference style only (ModelConfig.vision_*)
            ours.update({k: getattr(cfg, k) for k in ("vision_n_layers", "vision_dim", "vision_n_heads",
                                                      "vision_inter_dim", "vision_patch_size", "vision_rope_theta",
                                                      "vision_downsample_ratio", "vision_max_n_token",
                                                      "vision_min_pixels", "vision_max_wh_ratio", "image_token_id")})
        return ours
    hf_names = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps", "window_size": "sliding_window",
                "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
                "candidate_source_layer": "candidate_source_layer_id", "moe_inter_dim": "moe_intermediate_size",
                "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func",
                "route_scale": "routed_scaling_factor", "max_seq_len": "max_position_embeddings",
                "n_mtp_layers": "num_nextn_predict_layers"}
    text = {hf_names.get(k, k): v for k, v in ours.items()
            if k not in ("rope_factor", "original_seq_len", "beta_fast", "beta_slow", "dtype", "expert_dtype")}
    text["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                            "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}
    text["model_type"] = "deepseek_v41_text"
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32],
                                    "scale_fmt": "ue8m0", "activation_scheme": "dynamic"},
            "text_config": text}


def _shard_key(name: str) -> str:
    """Shard grouping of the release: one backbone layer per shard, Engram tables on their own."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return f"engram{parts[1]}" if parts[2] == "engram" and parts[3] == "embed" else f"layer{int(parts[1]):04d}"
    return {"embed": "a_embed", "head": "z_head", "lm_head": "z_head", "norm": "z_head"}.get(parts[0], "z_other")


def write_checkpoint(directory: str | Path, cfg: ModelConfig, tensors: dict, *, sharded: bool = True,
                     config_style: str = "hf") -> int:
    """Write `tensors` (from make_tensors / to_hf_float) with config.json and tokenizer.json.

    sharded: `model.safetensors.index.json` + one shard per layer (the release's grouping), else one
    `model.safetensors`. Returns the payload bytes written.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config_json(cfg, config_style), indent=1))
    write_tokenizer(d / "tokenizer.json", cfg.vocab_size)
    if not sharded:
        return write_safetensors(d / SINGLE_FILE, tensors)
    groups: dict[str, dict] = {}
    for name, v in tensors.items():
        groups.setdefault(_shard_key(name), {})[name] = v
    keys = sorted(groups)
    total, weight_map = 0, {}
    for i, key in enumerate(keys):
        fname = f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors"
        total += write_safetensors(d / fname, groups[key])
        weight_map.update({n: fname for n in groups[key]})
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def fixture_config(**overrides):
    """A small config with every structural feature of the release and every quantized dimension a
    multiple of 32: 6 layers (0 window-only, 1 Full m=2, 2 Reuse, 3 Full m=1 candidate source,
    4 Reuse, 5 Reindex in-pool), Engram on a window-only layer and on a kv source as released,
    8 experts top-2, window 8 and top-4 so that sparse selection matters within a few dozen tokens."""
    from dsv41_jax.config import ModelConfig

    vocab = overrides.pop("vocab_size", 384)
    base = dict(
        vocab_size=vocab, dim=128, n_layers=6, n_mtp_layers=0,
        n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64, window_size=8,
        n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64, route_scale=1.5, swiglu_limit=10.0,
        compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3), index_source_layers=(1, 3, 5),
        index_n_heads=16, index_head_dim=64, index_topk=4,
        candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=2,
        original_seq_len=16, rope_factor=4.0, max_seq_len=256, compress_rope_theta=160000.0,
        engram_layer_ids=(0, 1), engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
        engram_vocab_size=101, engram_num_embeddings=(), engram_pad_id=2,
        engram_compressed_vocab_size=3 + -(-(vocab - 3) // 3),  # tokenizer_vocab: specials + triples
        dtype="float32", param_dtype="float32",
    )
    base.update(overrides)
    return ModelConfig(**base).with_derived_engram()


def vision_fixture_config(**overrides):
    """The parity fixture for images: 2 backbone layers (0 window-only, 1 Full m=2), Engram on both so
    that its image masking shows, and a 2-block vision tower (width 64, 2 heads, patch 14, 3x3
    downsample, at most 32 tokens per image); the image placeholder is the last id."""
    base = dict(n_layers=2, compress_ratios=(0, 2), kv_source_layers=(1,), index_source_layers=(1,),
                candidate_source_layer=-1, engram_layer_ids=(0, 1), vision_n_layers=2, vision_dim=64,
                vision_n_heads=2, vision_inter_dim=96, vision_max_n_token=32, vision_min_pixels=84 * 84,
                image_token_id=383)
    base.update(overrides)
    return fixture_config(**base)
def dspark_fixture_config():
    """`fixture_config` with two DSpark draft stages (blocks of 3, reading layers 1 and 5, Markov rank 32,
    4 experts top-2 of their own) and no Engram: the DSpark parity goldens' checkpoint."""
    return fixture_config(engram_layer_ids=(), n_mtp_layers=2, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0),
                          dspark_block_size=3, dspark_noise_token_id=383, dspark_target_layer_ids=(1, 5),
                          dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=2)


def bench_config(n_layers: int = 12, engram: bool = True):
    """A multi-GB config for load benchmarks: routed experts dominate the bytes, as in the release.
    engram=False drops the Engram layers (no tokenizer needed, e.g. on a runtime without `tokenizers`)."""
    from dsv41_jax.config import ModelConfig

    ratios = (0, 0) + (2,) * ((n_layers - 2) // 2) + (1,) * (n_layers - 2 - (n_layers - 2) // 2)
    first_m1 = ratios.index(1)
    return ModelConfig(
        vocab_size=32768, dim=2048, n_layers=n_layers, n_mtp_layers=0, n_heads=16, head_dim=256,
        rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512, window_size=128,
        n_routed_experts=64, n_activated_experts=4, moe_inter_dim=1536, compress_ratios=ratios,
        kv_source_layers=(2, first_m1), index_source_layers=(2, first_m1), index_n_heads=16, index_head_dim=128,
        index_topk=256, candidate_source_layer=first_m1, candidate_topk_blocks=64, candidate_block_size=8,
        engram_layer_ids=(1, 2) if engram else (), engram_max_ngram_size=3, engram_n_heads=8, engram_head_dim=256,
        engram_vocab_size=100000, engram_num_embeddings=(), engram_compressed_vocab_size=3 + -(-(32768 - 3) // 3),
        max_seq_len=65536, dtype="bfloat16", param_dtype="bfloat16").with_derived_engram()


def _bench(directory: str, engram: bool = True) -> None:
    """Write a multi-GB released-layout checkpoint (if absent) and time loading it."""
    import time

    from dsv41_jax.checkpoint import load_checkpoint

    cfg = bench_config(engram=engram)
    d = Path(directory)
    if not (d / INDEX_FILE).exists():
        t0 = time.perf_counter()
        n = write_checkpoint(d, cfg, make_tensors(cfg, seed=0), sharded=True)
        print(f"wrote {n / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s to {d}")
    loaded = load_checkpoint(d)
    print(f"loaded {loaded.bytes_read / 1e9:.2f} GB in {loaded.seconds:.1f} s: {loaded.gbps:.2f} GB/s "
          f"(weights {loaded.cfg.weight_format}, device {jax_device()})")


def jax_device() -> str:
    import jax

    return str(jax.devices()[0])


if __name__ == "__main__":
    import sys

    if len(sys.argv) not in (3, 4) or sys.argv[1] != "--bench":
        raise SystemExit("usage: python -m dsv41_jax.checkpoint.synthetic --bench DIR [--no-engram]")
    _bench(sys.argv[2], engram="--no-engram" not in sys.argv)
