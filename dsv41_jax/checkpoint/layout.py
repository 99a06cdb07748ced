"""Which checkpoint tensor fills which param, derived from the config (never hard-coded per layer).

Two naming schemes are accepted:

- "released": what DeepSeek published, no prefix: `embed.weight`, `layers.{L}.attn.wq_a.weight` (+
  `.scale`), `layers.{L}.ffn.experts.{E}.w1.weight`, `layers.{L}.hc_attn_fn`, `head.weight`, ...
- "hf": HF transformers' names for the same modules: `model.` + the released name, and
  `lm_head.weight` for `head.weight`.

Two storage forms: "quantized" (the release: dense projections FP8 E4M3 with one E8M0 scale per 32x32
block, routed experts FP4 packed two per byte in I8 with one E8M0 scale per 32 inputs, Engram tables
FP8 with one E8M0 scale per 32 channels) or "float" (every weight a plain float, e.g. an HF export).

The DSpark draft stages (`mtp.{s}.*`: mHC blocks like the backbone's, window-only attention, their own
expert counts; stage 0 adds `main_proj` / `main_norm`, the last stage `norm`, `markov_head.{embed,head}`
and `confidence_head.proj`; embed and head are the backbone's) fill the `mtp/{s}/...` params of a config
with draft stages and are skipped with a note otherwise. The vision tower (`vision.*`, `aligner.*`, `image_start` / `image_newline` /
`image_end`, BF16 as released, projections with biases) and the routing bias of image tokens
(`layers.{L}.ffn.gate.bias_vl` and the stages' `mtp.{s}.ffn.gate.bias_vl`, F32) are loaded when the config has one (`vision_n_layers > 0`), and
recognised and skipped otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv41_jax.config import ModelConfig
from dsv41_jax.plan import build_plan

FLOATS = ("F32", "BF16", "F16", "F64")
SKIPPED = {
    r"(vision|aligner)\.|image_(start|end|newline)$": "vision tower (the config has vision_n_layers == 0)",
    r"layers\.\d+\.ffn\.gate\.bias_vl$": "MoE routing bias for image tokens (no vision tower in the config)",
    r"mtp\.": "DSpark draft-stage tensors this config does not use (no draft stages: n_mtp_layers or "
               "dspark_block_size is 0; or the stages' image biases without a vision tower)",
}


@dataclass(frozen=True)
class Entry:
    """One param (or stacked param group) and the checkpoint tensors that fill it.

    kind: "plain" (a float tensor -> `param`), "dense" (a projection the release ships in FP8:
    `<param>/weight` [+ `<param>/scale`]), "dense_dequant" (shipped in FP8 but always run dequantized:
    wo_a), "experts" (one [out, in] tensor per routed expert, stacked into `param` [+ `param`_scale]),
    "table" (an Engram table -> `param` [+ `param`_scale]).
    """

    param: str
    names: tuple[str, ...]  # released base names (without .weight / .scale for dense kinds)
    kind: str
    shape: tuple[int, ...]  # logical float shape of each tensor ([out, in] for projections)


def _ceil32(n: int) -> int:
    return -(-n // 32)


def vision_entries(cfg: ModelConfig) -> list[Entry]:
    """The vision tower's params (all plain float tensors), when the config has one."""
    c, vd = cfg, cfg.vision_dim
    if not c.vision_n_layers:
        return []
    plain = lambda name, shape: Entry(name.replace(".", "/"), (name,), "plain", shape)

    def biased(name, d_out, d_in):
        return [plain(name + ".weight", (d_out, d_in)), plain(name + ".bias", (d_out,))]

    out = biased("vision.patch_embed.proj", vd, 3 * c.vision_patch_size ** 2)
    for i in range(c.vision_n_layers):
        b = f"vision.blocks.{i}."
        out += [plain(b + "norm1.weight", (vd,)), plain(b + "norm2.weight", (vd,))]
        out += biased(b + "attn.wqkv", 3 * vd, vd) + biased(b + "attn.wo", vd, vd)
        out += [plain(b + "mlp.w1.weight", (2 * c.vision_inter_dim, vd)),
                plain(b + "mlp.w2.weight", (vd, c.vision_inter_dim))]
    out += [plain("vision.norm.weight", (vd,))]
    out += biased("aligner.w1", c.dim, vd * c.vision_downsample_ratio ** 2) + biased("aligner.w2", c.dim, c.dim)
    return out + [plain(name, (c.dim,)) for name in ("image_start", "image_newline", "image_end")]


def _block_entries(out: list, c, P: str, r: str, n_experts: int, image_bias: bool = False,
                   attention_extra: list[Entry] = ()) -> None:
    """What every mHC block holds (backbone layer or draft stage): norms, hyper-connections, the
    attention's query / window KV / output / sink, then `attention_extra` (a layer's compressor and
    indexer), the router (with the image-token bias `bias_vl` if image_bias), routed and shared experts.
    The order is the synthetic fixtures' draw order: the parity goldens depend on it."""
    mix, hc_dim = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.dim
    hd, h = c.head_dim, c.n_heads

    def plain(param, name, shape):
        out.append(Entry(P + param, (r + name,), "plain", shape))

    def dense(param, name, d_out, d_in, kind="dense"):
        out.append(Entry(P + param, (r + name,), kind, (d_out, d_in)))

    plain("attn_norm/weight", "attn_norm.weight", (c.dim,))
    plain("ffn_norm/weight", "ffn_norm.weight", (c.dim,))
    for site in ("attn", "ffn"):
        plain(f"hc_{site}/fn", f"hc_{site}_fn", (mix, hc_dim))
        plain(f"hc_{site}/base", f"hc_{site}_base", (mix,))
        plain(f"hc_{site}/scale", f"hc_{site}_scale", (3,))
    dense("attn/wq_a", "attn.wq_a", c.q_lora_rank, c.dim)
    plain("attn/q_norm/weight", "attn.q_norm.weight", (c.q_lora_rank,))
    dense("attn/wq_b", "attn.wq_b", h * hd, c.q_lora_rank)
    dense("attn/wkv", "attn.wkv", hd, c.dim)
    plain("attn/kv_norm/weight", "attn.kv_norm.weight", (hd,))
    dense("attn/wo_a", "attn.wo_a", c.o_groups * c.o_lora_rank, h * hd // c.o_groups, "dense_dequant")
    dense("attn/wo_b", "attn.wo_b", c.dim, c.o_groups * c.o_lora_rank)
    plain("attn/attn_sink", "attn.attn_sink", (h,))
    out.extend(attention_extra)
    plain("ffn/router/weight", "ffn.gate.weight", (n_experts, c.dim))
    plain("ffn/router/bias", "ffn.gate.bias", (n_experts,))
    if image_bias:
        plain("ffn/router/bias_vl", "ffn.gate.bias_vl", (n_experts,))
    for w, (d_out, d_in) in (("w1", (c.moe_inter_dim, c.dim)), ("w3", (c.moe_inter_dim, c.dim)),
                             ("w2", (c.dim, c.moe_inter_dim))):
        names = tuple(f"{r}ffn.experts.{e}.{w}" for e in range(n_experts))
        out.append(Entry(P + f"ffn/{w}", names, "experts", (d_out, d_in)))
        dense(f"ffn/shared_{w}", f"ffn.shared_experts.{w}", d_out, d_in)


def entries(cfg: ModelConfig) -> list[Entry]:
    """Every param of the model (except the tokenizer-derived engram_token_map), draft stages included."""
    c = cfg
    out = [Entry("embed/weight", ("embed.weight",), "plain", (c.vocab_size, c.dim)),
           Entry("head/weight", ("head.weight",), "plain", (c.vocab_size, c.dim)),
           Entry("norm/weight", ("norm.weight",), "plain", (c.dim,))] + vision_entries(c)
    rows = dict(zip(c.engram_layer_ids, c.engram_num_embeddings))
    hd = c.head_dim
    for p in build_plan(c):
        L, r = p.layer, f"layers.{p.layer}."
        P = f"layers/{L}/"

        extra: list[Entry] = []  # the compressor and indexer, between the attention and the MoE

        def plain(param, name, shape, to=extra):
            to.append(Entry(P + param, (r + name,), "plain", shape))

        def dense(param, name, d_out, d_in, kind="dense", to=extra):
            to.append(Entry(P + param, (r + name,), kind, (d_out, d_in)))

        if p.compresses:
            plain("attn/compressor/wkv/weight", "attn.compressor.wkv.weight", (hd, c.dim))
            if p.ratio > 1:
                plain("attn/compressor/wgate/weight", "attn.compressor.wgate.weight", (hd, c.dim))
            plain("attn/compressor/norm/weight", "attn.compressor.norm.weight", (hd,))
        if p.has_indexer:
            dense("attn/indexer/wq_b", "attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            plain("attn/indexer/weights_proj/weight", "attn.indexer.weights_proj.weight", (c.index_n_heads, c.dim))
            if p.compresses:
                plain("attn/indexer/wk/weight", "attn.indexer.wk.weight", (c.index_head_dim, hd))
                plain("attn/indexer/k_norm/weight", "attn.indexer.k_norm.weight", (c.index_head_dim,))
        _block_entries(out, c, P, r, c.n_routed_experts, c.vision_n_layers > 0, extra)
        if L in rows:
            n_cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads
            out.append(Entry(P + "engram/table", (r + "engram.embed",), "table", (rows[L], c.engram_head_dim)))
            dense("engram/wkv", "engram.wkv", c.dim * (c.hc_mult + 1), n_cols * c.engram_head_dim, to=out)
            plain("engram/q_weight", "engram.q_weight", (c.hc_mult, c.dim), to=out)
            plain("engram/k_weight", "engram.k_weight", (c.hc_mult, c.dim), to=out)
    if c.has_dspark:
        out += _dspark_entries(c)
    return out


def _dspark_entries(c) -> list[Entry]:
    out: list[Entry] = []
    rank = c.dspark_markov_rank
    for s in range(c.n_mtp_layers):
        P, r = f"mtp/{s}/", f"mtp.{s}."
        _block_entries(out, c, P, r, c.dspark_moe().n_routed_experts, image_bias=c.vision_n_layers > 0)
        if s == 0:
            out.append(Entry(P + "main_proj", (r + "main_proj",), "dense",
                             (c.dim, c.dim * len(c.dspark_target_layer_ids))))
            out.append(Entry(P + "main_norm/weight", (r + "main_norm.weight",), "plain", (c.dim,)))
        if s == c.n_mtp_layers - 1:
            out.append(Entry(P + "norm/weight", (r + "norm.weight",), "plain", (c.dim,)))
            out.append(Entry(P + "markov_head/embed/weight", (r + "markov_head.embed.weight",), "plain",
                             (c.vocab_size, rank)))
            out.append(Entry(P + "markov_head/head/weight", (r + "markov_head.head.weight",), "plain",
                             (c.vocab_size, rank)))
            out.append(Entry(P + "confidence_head/proj/weight", (r + "confidence_head.proj.weight",), "plain",
                             (1, c.dim + rank)))
    return out


@dataclass(frozen=True)
class Expect:
    """What a checkpoint must hold under one name: its shape and the dtypes accepted."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    optional: bool = False


def expected_tensors(cfg: ModelConfig, quantized: bool) -> dict[str, Expect]:
    """Released name -> Expect, for a quantized (as released) or all-float checkpoint."""
    out: dict[str, Expect] = {}
    for e in entries(cfg):
        for name in e.names:
            if e.kind == "plain":
                out[name] = Expect(e.shape, FLOATS)
            elif not quantized:
                out[name + ".weight"] = Expect(e.shape, FLOATS)
                if e.kind == "table":  # HF keeps a (unused) scale next to a float table
                    out[name + ".scale"] = Expect((e.shape[0], e.shape[1] // 32), FLOATS + ("F8_E8M0",), True)
            elif e.kind in ("dense", "dense_dequant"):
                out[name + ".weight"] = Expect(e.shape, ("F8_E4M3",))
                out[name + ".scale"] = Expect((_ceil32(e.shape[0]), _ceil32(e.shape[1])), ("F8_E8M0",))
            elif e.kind == "experts":
                out[name + ".weight"] = Expect((e.shape[0], e.shape[1] // 2), ("I8", "U8"))
                out[name + ".scale"] = Expect((e.shape[0], e.shape[1] // 32), ("F8_E8M0",))
            else:  # table
                out[name + ".weight"] = Expect(e.shape, ("F8_E4M3",))
                out[name + ".scale"] = Expect((e.shape[0], e.shape[1] // 32), ("F8_E8M0",))
    return out


def to_released_name(name: str) -> tuple[str, str]:
    """(released name, scheme) of a checkpoint name in either scheme."""
    if name == "lm_head.weight":
        return "head.weight", "hf"
    if name.startswith("model."):
        return name[len("model."):], "hf"
    return name, "released"


def skip_reason(released_name: str) -> str | None:
    for pattern, why in SKIPPED.items():
        if re.match(pattern, released_name):
            return why
    return None
