"""The vision tower as the release builds it: a ViT over one image's patches, then the aligner that turns
r x r patches into one LLM token, and the learned embeddings of an image span's delimiters.

    span_bnd = model.image_span(patches_nc, grid)   # [n_span, dim]: what the prompt's image span holds

- ViT (`vision_*` fields): patches of p x p pixels (3 * p * p values, channel-major), a biased linear
  patch embedding, `vision_n_layers` pre-norm blocks of full bidirectional attention (one image, no
  mask) with 2D RoPE, a SwiGLU MLP, and a final RMSNorm (eps 1e-6, the release's vision default; the
  backbone's `norm_eps` is not used here).
- 2D RoPE: per patch the angles are [row * inv_freq, col * inv_freq] (head_dim / 2 of them; inv_freq
  over head_dim / 2 channels with `vision_rope_theta`), applied "rotate half" style: channel i pairs
  with channel i + head_dim / 2 (not the backbone's interleaved pairs).
- Aligner: the [n_h, n_w] grid of ViT outputs, zero-padded at the bottom / right to multiples of r,
  is cut into r x r cells (row-major); each cell's r * r * vision_dim values (channel-major, then cell
  row, then cell column: torch's `unfold` order) go through Linear + exact GELU + Linear to `dim`.
- Span: [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]; IMAGE slots take
  the aligner rows in reading order, the others the learned `image_start` / `image_newline` /
  `image_end` vectors (dsv41_jax.images builds the grid and the span layout).

Weights follow the checkpoint ([out, in] projections with biases, names `vision.*`, `aligner.*`,
`image_*`); every op runs in the activation dtype with f32 norms, RoPE and softmax.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.images import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, span_types
from dsv41_jax.layers import Linear, RMSNorm, normal_init
from dsv41_jax.precision import model_precision

VISION_NORM_EPS = 1e-6


class BiasedLinear(Linear):
    """`Linear` plus a bias [out] (the vision tower's projections carry one)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype="float32"):
        super().__init__(d_in, d_out, rngs=rngs, dtype=dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x, jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


@lru_cache(maxsize=64)
def rope_tables(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32 [n_h * n_w, 1, head_dim / 2] of patch (row, col) in reading order."""
    half = head_dim // 2
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))).astype(np.float32)
    rows, cols = np.meshgrid(np.arange(n_h), np.arange(n_w), indexing="ij")
    ang = np.stack([rows, cols], -1).reshape(-1, 2, 1).astype(np.float32) * inv  # [N, 2, half / 2]
    ang = ang.reshape(-1, half)
    return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, H, hd] rotated by pairing channel i with i + hd / 2 (in f32, back to x's dtype)."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.vision_dim, cfg.param_dtype
        self.n_heads, self.head_dim = cfg.vision_n_heads, d // cfg.vision_n_heads
        self.wqkv = BiasedLinear(d, 3 * d, rngs=rngs, dtype=dt)
        self.wo = BiasedLinear(d, d, rngs=rngs, dtype=dt)

    def __call__(self, x_nd: jax.Array, cos, sin) -> jax.Array:
        n = x_nd.shape[0]
        q, k, v = (t.reshape(n, self.n_heads, self.head_dim) for t in jnp.split(self.wqkv(x_nd), 3, axis=-1))
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        s = jnp.einsum("nhd,mhd->hnm", q, k, preferred_element_type=jnp.float32) * self.head_dim ** -0.5
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("hnm,mhd->nhd", p, v, preferred_element_type=jnp.float32).astype(x_nd.dtype)
        return self.wo(o.reshape(n, -1))


class VisionMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, dt = cfg.vision_dim, cfg.vision_inter_dim, cfg.param_dtype
        self.w1 = Linear(d, 2 * f, rngs=rngs, dtype=dt)  # [gate; up]
        self.w2 = Linear(f, d, rngs=rngs, dtype=dt)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.w1(x, jnp.float32), 2, axis=-1)
        return self.w2((jax.nn.silu(gate) * up).astype(x.dtype))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS)
        self.attn = VisionAttention(cfg, rngs=rngs)
        self.norm2 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS)
        self.mlp = VisionMLP(cfg, rngs=rngs)

    def __call__(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.proj = BiasedLinear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim, rngs=rngs, dtype=cfg.param_dtype)

    def __call__(self, patches_nc: jax.Array) -> jax.Array:
        return self.proj(patches_nc)


class ViT(nnx.Module):
    """Full bidirectional attention over one image's patches with 2D RoPE."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.patch_embed = PatchEmbed(cfg, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(cfg, rngs=rngs) for _ in range(cfg.vision_n_layers)])
        self.norm = RMSNorm(cfg.vision_dim, VISION_NORM_EPS)
        self.head_dim, self.theta = cfg.vision_dim // cfg.vision_n_heads, cfg.vision_rope_theta

    def __call__(self, patches_nc: jax.Array, n_h: int, n_w: int) -> jax.Array:
        """patches [n_h * n_w, 3 * p * p] in reading order -> features [n_h * n_w, vision_dim]."""
        cos, sin = (jnp.asarray(t) for t in rope_tables(n_h, n_w, self.head_dim, self.theta))
        x = self.patch_embed(patches_nc)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.r = cfg.vision_downsample_ratio
        self.w1 = BiasedLinear(cfg.vision_dim * self.r ** 2, cfg.dim, rngs=rngs, dtype=cfg.param_dtype)
        self.w2 = BiasedLinear(cfg.dim, cfg.dim, rngs=rngs, dtype=cfg.param_dtype)

    def __call__(self, x_nc: jax.Array, n_h: int, n_w: int) -> jax.Array:
        """ViT features [n_h * n_w, C] -> tokens [ceil(n_h / r) * ceil(n_w / r), dim] in reading order."""
        r, c = self.r, x_nc.shape[-1]
        x = jnp.pad(x_nc.reshape(n_h, n_w, c), ((0, -n_h % r), (0, -n_w % r), (0, 0)))
        gh, gw = x.shape[0] // r, x.shape[1] // r
        cells = x.reshape(gh, r, gw, r, c).transpose(0, 2, 4, 1, 3).reshape(gh * gw, c * r * r)
        return self.w2(jax.nn.gelu(self.w1(cells), approximate=False))


def build_vision(cfg: ModelConfig, *, rngs: nnx.Rngs) -> dict:
    """The vision modules and params a Transformer holds under the checkpoint's top-level names:
    `vision`, `aligner`, `image_start`, `image_newline`, `image_end`."""
    delim = lambda: nnx.Param(normal_init(rngs, (cfg.dim,), cfg.param_dtype, std=0.12))
    return dict(vision=ViT(cfg, rngs=rngs), aligner=Aligner(cfg, rngs=rngs), image_start=delim(),
                image_newline=delim(), image_end=delim())


@model_precision
def image_span(model, patches_nc: jax.Array, n_vit_h: int, n_vit_w: int, n_llm_h: int, n_llm_w: int) -> jax.Array:
    """Embeddings [n_span, dim] (activation dtype) of one image's prompt span (module docstring)."""
    dt = jnp.dtype(model.cfg.dtype)
    tokens = model.aligner(model.vision(patches_nc.astype(dt), n_vit_h, n_vit_w), n_vit_h, n_vit_w)
    assert tokens.shape[0] == n_llm_h * n_llm_w, (tokens.shape, n_llm_h, n_llm_w)
    types = span_types(n_llm_h, n_llm_w)
    # row of [tokens; start; newline; end] that each span position takes
    row = np.empty(types.size, np.int32)
    row[types == IMAGE] = np.arange(n_llm_h * n_llm_w)
    for t, extra in ((IMAGE_START, 0), (IMAGE_NEW_LINE, 1), (IMAGE_END, 2)):
        row[types == t] = n_llm_h * n_llm_w + extra
    delims = jnp.stack([model.image_start[...], model.image_newline[...], model.image_end[...]]).astype(dt)
    return jnp.concatenate([tokens.astype(dt), delims])[row]
