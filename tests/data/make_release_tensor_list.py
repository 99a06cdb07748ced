"""Write `dsv41_flash_tensors.json.gz`: every tensor of the released DeepSeek-V4.1-Flash checkpoint
(name -> [safetensors dtype, shape, shard]) with no weights, reconstructed from the public header audit
(lvyufeng/RelicLLM docs/performance/deepseek_v4_1_shard_audit.md) and the released config.json.

The audit gives the per-layer partition (2,334 tensors per plain layer: 384 experts x 6 plus 30
others; +8 on a Full CSA2 layer, +7 on the ratio-1 source, +3 on a Reindex layer, +6 per Engram
layer), the MTP stage counts (801 / 798 / 802), the vision count (266), the shard of each group and
the shapes/dtypes of representative tensors. This script restates those facts and asserts the audit's
totals (96,085 tensors, 475.24 GiB, 94,464 expert tensors = 275.67 GiB, 12 Engram tensors = 189.13 GiB),
so the list does not depend on our loader's own layout code. Run: python tests/data/make_release_tensor_list.py
"""

import gzip
import json
from pathlib import Path

CFG = json.loads((Path(__file__).parent / "dsv41_flash_config.json").read_text())
SIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


def build() -> dict:
    c = CFG
    dim, hd, h, q, inter = c["dim"], c["head_dim"], c["n_heads"], c["q_lora_rank"], c["moe_inter_dim"]
    og, olr, hc = c["o_groups"], c["o_lora_rank"], c["hc_mult"]
    out = {}

    def add(name, dtype, shape, shard):
        out[name] = [dtype, list(shape), shard]

    def fp8(name, o, i, shard):
        add(name + ".weight", "F8_E4M3", (o, i), shard)
        add(name + ".scale", "F8_E8M0", (-(-o // 32), -(-i // 32)), shard)

    def block(p, shard, n_experts, window_only=True):
        add(p + "attn_norm.weight", "BF16", (dim,), shard)
        add(p + "ffn_norm.weight", "BF16", (dim,), shard)
        for site in ("attn", "ffn"):
            add(p + f"hc_{site}_fn", "F32", ((2 + hc) * hc, hc * dim), shard)
            add(p + f"hc_{site}_base", "F32", ((2 + hc) * hc,), shard)
            add(p + f"hc_{site}_scale", "F32", (3,), shard)
        fp8(p + "attn.wq_a", q, dim, shard)
        fp8(p + "attn.wq_b", h * hd, q, shard)
        fp8(p + "attn.wkv", hd, dim, shard)
        fp8(p + "attn.wo_a", og * olr, h * hd // og, shard)
        fp8(p + "attn.wo_b", dim, og * olr, shard)
        add(p + "attn.q_norm.weight", "BF16", (q,), shard)
        add(p + "attn.kv_norm.weight", "BF16", (hd,), shard)
        add(p + "attn.attn_sink", "F32", (h,), shard)
        add(p + "ffn.gate.weight", "BF16", (n_experts, dim), shard)
        add(p + "ffn.gate.bias", "F32", (n_experts,), shard)
        add(p + "ffn.gate.bias_vl", "F32", (n_experts,), shard)
        for e in range(n_experts):
            for w, (o, i) in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
                add(p + f"ffn.experts.{e}.{w}.weight", "I8", (o, i // 2), shard)
                add(p + f"ffn.experts.{e}.{w}.scale", "F8_E8M0", (o, i // 32), shard)
        for w, (o, i) in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
            fp8(p + f"ffn.shared_experts.{w}", o, i, shard)

    add("embed.weight", "BF16", (c["vocab_size"], dim), 1)
    for L in range(c["n_layers"]):
        p, shard, m = f"layers.{L}.", L + 3, c["compress_ratios"][L]
        block(p, shard, c["n_routed_experts"])
        if L in c["kv_source_layers"]:
            add(p + "attn.compressor.wkv.weight", "BF16", (hd, dim), shard)
            if m > 1:
                add(p + "attn.compressor.wgate.weight", "BF16", (hd, dim), shard)
            add(p + "attn.compressor.norm.weight", "BF16", (hd,), shard)
            add(p + "attn.indexer.wk.weight", "BF16", (c["index_head_dim"], hd), shard)
            add(p + "attn.indexer.k_norm.weight", "BF16", (c["index_head_dim"],), shard)
        if L in c["index_source_layers"]:
            add(p + "attn.indexer.weights_proj.weight", "BF16", (c["index_n_heads"], dim), shard)
            fp8(p + "attn.indexer.wq_b", c["index_n_heads"] * c["index_head_dim"], q, shard)
        if L in c["engram_layer_ids"]:
            i = c["engram_layer_ids"].index(L)
            shard_e, rows, ehd = 47 + i, c["engram_num_embeddings"][i], c["engram_head_dim"]
            add(p + "engram.embed.weight", "F8_E4M3", (rows, ehd), shard_e)
            add(p + "engram.embed.scale", "F8_E8M0", (rows, ehd // 32), shard_e)
            n_cols = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
            fp8(p + "engram.wkv", dim * (hc + 1), n_cols * ehd, shard_e)
            add(p + "engram.q_weight", "BF16", (hc, dim), shard_e)
            add(p + "engram.k_weight", "BF16", (hc, dim), shard_e)
    add("head.weight", "BF16", (c["vocab_size"], dim), 43)
    add("norm.weight", "BF16", (dim,), 43)
    for s in range(c["n_mtp_layers"]):
        p = f"mtp.{s}."
        block(p, 44 + s, c["dspark_n_routed_experts"])
        if s == 0:
            fp8(p + "main_proj", dim, dim * len(c["dspark_target_layer_ids"]), 44)
            add(p + "main_norm.weight", "BF16", (dim,), 44)
        if s == c["n_mtp_layers"] - 1:
            add(p + "norm.weight", "BF16", (dim,), 44 + s)
            rank = c["dspark_markov_rank"]
            add(p + "markov_head.embed.weight", "BF16", (c["vocab_size"], rank), 44 + s)
            add(p + "markov_head.head.weight", "BF16", (c["vocab_size"], rank), 44 + s)
            add(p + "confidence_head.proj.weight", "BF16", (1, dim + rank), 44 + s)
    vd, vi, ps = c["vision_dim"], c["vision_inter_dim"], c["vision_patch_size"]
    add("vision.patch_embed.proj.weight", "BF16", (vd, 3 * ps * ps), 2)
    add("vision.patch_embed.proj.bias", "BF16", (vd,), 2)
    for L in range(c["vision_n_layers"]):
        p = f"vision.blocks.{L}."
        for n, shape in (("norm1.weight", (vd,)), ("norm2.weight", (vd,)), ("attn.wqkv.weight", (3 * vd, vd)),
                         ("attn.wqkv.bias", (3 * vd,)), ("attn.wo.weight", (vd, vd)), ("attn.wo.bias", (vd,)),
                         ("mlp.w1.weight", (2 * vi, vd)), ("mlp.w2.weight", (vd, vi))):
            add(p + n, "BF16", shape, 2)
    add("vision.norm.weight", "BF16", (vd,), 2)
    r = c["vision_downsample_ratio"]
    for n, shape in (("aligner.w1.weight", (dim, vd * r * r)), ("aligner.w1.bias", (dim,)),
                     ("aligner.w2.weight", (dim, dim)), ("aligner.w2.bias", (dim,)),
                     ("image_start", (dim,)), ("image_end", (dim,)), ("image_newline", (dim,))):
        add(n, "BF16", shape, 2)
    return out


def nbytes(entry) -> int:
    dtype, shape, _ = entry
    n = SIZE[dtype]
    for s in shape:
        n *= s
    return n


def check(t: dict) -> None:
    gib = lambda names: round(sum(nbytes(t[n]) for n in names) / 2**30, 2)
    assert len(t) == 96085, len(t)
    assert gib(t) == 475.24, gib(t)
    experts = [n for n in t if ".experts." in n]
    assert len(experts) == 94464 and gib(experts) == 275.67, (len(experts), gib(experts))
    engram = [n for n in t if ".engram." in n]
    assert len(engram) == 12 and gib(engram) == 189.13, (len(engram), gib(engram))
    per_layer = {L: sum(n.startswith(f"layers.{L}.") for n in t) for L in range(40)}
    assert per_layer[0] == 2334 and per_layer[1] == 2340 and per_layer[2] == per_layer[8] == 2342
    assert per_layer[14] == 2348 and per_layer[20] == 2341 and per_layer[24] == 2337, per_layer
    per_shard = {}
    for _dtype, _shape, shard in t.values():
        per_shard[shard] = per_shard.get(shard, 0) + 1
    assert per_shard[43] == 2 and (per_shard[44], per_shard[45], per_shard[46]) == (801, 798, 802)
    assert per_shard[47] == per_shard[48] == 6 and sorted(per_shard) == list(range(1, 49))
    vision = [n for n in t if n.startswith(("vision.", "aligner.", "image_"))]
    assert len(vision) == 266 and gib(vision) == 0.90, (len(vision), gib(vision))


if __name__ == "__main__":
    tensors = build()
    check(tensors)
    path = Path(__file__).parent / "dsv41_flash_tensors.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(tensors, f, separators=(",", ":"))
    print(f"{len(tensors)} tensors -> {path} ({path.stat().st_size} bytes)")
