"""Images into the prompt as the release prepares them (Pillow): the resize plan, the patches, the span
layout, and the prompt with its placeholders expanded.

An image becomes an n_vit_h x n_vit_w grid of p x p patches for the ViT and an n_llm_h x n_llm_w grid
of tokens after the aligner's r x r merge (ceil of n_vit / r), which the prompt holds as the span

    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]

of n_llm_h * (n_llm_w + 1) + 2 positions, every one carrying `image_token_id`; only the span layout
(`span_types`) tells them apart. A prompt names where each image goes by one `image_token_id`
placeholder, which `expand_prompt` replaces by that image's span.

The resize plan (`plan_grid`), as released: a wider than `vision_max_wh_ratio` image is planned at that
width; one below `vision_min_pixels` pixels is planned scaled up to it; sides round up to whole
patches; if the span would exceed `vision_max_n_token` positions, the largest aspect-preserving size
whose span fits is taken. The pixels are then fitted into that size keeping the aspect ratio
(`ImageOps.pad`, grey 127 borders, centred), or stretched (`resize`) when the image was wider than
`vision_max_wh_ratio`; scaled to [-1, 1] and rounded to bfloat16 (what the release feeds the ViT).

Refused with `ImageError` (a ValueError naming the image), before any model work:
- unreadable: not an image Pillow can decode (or a file that cannot be read);
- too small: a side below one patch (`vision_patch_size` pixels). The release scales anything up to
  `vision_min_pixels`; below one patch per side nearly every pixel it would see is interpolated, so
  we ask for a real picture instead (our choice, not the release's);
- aspect ratio out of range: long side / short side above (vision_max_n_token - 2) / 2 (511 as
  released). Beyond it the release's plan, when it has to shrink a tall image, collapses it to a
  single token column (its "very tall" fallback; wide images collapse to one row past
  vision_max_n_token - 3) and the picture's content is lost. We refuse both orientations at that
  ratio (our choice: the release accepts them silently).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv41_jax.config import ModelConfig

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


class ImageError(ValueError):
    """An image that cannot go into a prompt; the message names it and says what to change."""


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the vision tower.

    patches: bfloat16 [n_vit_h * n_vit_w, 3 * p * p], patches in reading order, each channel-major
    (channel, row, column), values (pixel / 255 - 0.5) / 0.5. digest: SHA-256 of the patches and the
    grid (what the model sees), for cache keys.
    """

    patches: np.ndarray
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    digest: str
    source: str = "<image>"

    @property
    def n_tokens(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """int8 [span_length]: IMAGE_START, then per token row n_llm_w IMAGE and one IMAGE_NEW_LINE, then IMAGE_END."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return np.array([IMAGE_START] + row * n_llm_h + [IMAGE_END], np.int8)


def _llm_grid(height: int, width: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((height // p) / r), math.ceil((width // p) / r)


def _fit_budget(height: float, width: float, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """Largest aspect-preserving pixel size (whole patches) whose span fits `max_tokens`, as released."""
    ratio = height / width
    max_w = math.sqrt((max_tokens - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    cell = p * r
    if max_w < 1.0:  # very tall: one token column
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: one token row
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_grid(width: int, height: int, cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(n_llm_h, n_llm_w, pixel height, pixel width) the release plans for an image of this size."""
    p, r, n_max = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    w, h = width, height
    if cfg.vision_max_wh_ratio is not None and w > h * cfg.vision_max_wh_ratio:
        w = h * cfg.vision_max_wh_ratio
    if 0 < w * h < cfg.vision_min_pixels:
        scale = (cfg.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    n_h, n_w = _llm_grid(best_h, best_w, p, r)
    if span_length(n_h, n_w) > n_max:
        best_h, best_w = _fit_budget(h, w, p, r, n_max)
        n_h, n_w = _llm_grid(best_h, best_w, p, r)
    return n_h, n_w, best_h, best_w


def max_aspect(cfg: ModelConfig) -> float:
    """Long side / short side beyond which an image is refused (module docstring)."""
    return (cfg.vision_max_n_token - 2) / 2


def check_size(width: int, height: int, cfg: ModelConfig, source: str) -> None:
    """ImageError unless an image of this pixel size can go into a prompt of this model."""
    p = cfg.vision_patch_size
    if min(width, height) < p:
        raise ImageError(f"{source}: image too small ({width}x{height} pixels): each side needs at least one "
                         f"{p}-pixel patch; give a larger image")
    limit = max_aspect(cfg)
    if max(width, height) / min(width, height) > limit:
        raise ImageError(f"{source}: aspect ratio out of range ({width}x{height} pixels, "
                         f"{max(width, height) / min(width, height):.0f}:1): at most {limit:g}:1 fits this model's "
                         f"{cfg.vision_max_n_token}-token image budget; crop the image")


def _open_rgb(data: bytes, source: str):
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Image.UnidentifiedImageError:
        raise ImageError(f"{source}: not a readable image (unknown format or damaged header); give a PNG, JPEG "
                         "or another format Pillow decodes") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"{source}: not a readable image ({type(e).__name__}: {e}); give a PNG, JPEG or "
                         "another format Pillow decodes") from None


def prepare_image(image, cfg: ModelConfig, source: str | None = None) -> PreparedImage:
    """A path, encoded bytes or a PIL image -> PreparedImage for `cfg`'s vision tower (module docstring).

    Raises ImageError for an unreadable, too small or too elongated image, and ValueError when the model
    has no vision tower.
    """
    if not cfg.vision_n_layers:
        raise ValueError("this model has no vision tower (vision_n_layers == 0): it cannot take images")
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ImageError("reading images needs Pillow, which is not installed: pip install pillow "
                         "(constraints.txt pins the tested version)") from None

    if isinstance(image, (str, Path)):
        source = source or str(image)
        try:
            data = Path(image).read_bytes()
        except OSError as e:
            raise ImageError(f"{source}: cannot read it ({e.strerror or e})") from None
        img = _open_rgb(data, source)
    elif isinstance(image, (bytes, bytearray)):
        source = source or "<image bytes>"
        img = _open_rgb(bytes(image), source)
    elif isinstance(image, Image.Image):
        source = source or "<PIL image>"
        img = image.convert("RGB")
    else:
        raise TypeError(f"an image is a path, encoded bytes or a PIL image, got {type(image).__name__}")
    check_size(img.width, img.height, cfg, source)
    p = cfg.vision_patch_size
    n_llm_h, n_llm_w, best_h, best_w = plan_grid(img.width, img.height, cfg)
    ratio = cfg.vision_max_wh_ratio
    if ratio is not None and img.width >= ratio * img.height:
        img = img.resize((best_w, best_h))
    else:
        img = ImageOps.pad(img, (best_w, best_h), color=(127, 127, 127))
    x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)
    x = ((x - np.float32(0.5)) / np.float32(0.5)).astype(ml_dtypes.bfloat16)
    n_vit_h, n_vit_w = best_h // p, best_w // p
    patches = x.reshape(3, n_vit_h, p, n_vit_w, p).transpose(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3 * p * p)
    patches = np.ascontiguousarray(patches)
    h = hashlib.sha256(f"{n_vit_h}x{n_vit_w}/{n_llm_h}x{n_llm_w}/".encode())
    h.update(patches.view(np.uint16).tobytes())
    return PreparedImage(patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w, h.hexdigest(), source)


@dataclass(frozen=True)
class ImageSpan:
    """Where an image sits in a prompt: positions [start, start + image.n_tokens)."""

    start: int
    image: PreparedImage

    @property
    def stop(self) -> int:
        return self.start + self.image.n_tokens


@dataclass(frozen=True)
class EncodedSpan:
    """An image span with its embeddings already computed (`api.encode_spans`): f32 [n_tokens, dim]
    at positions [start, start + n_tokens)."""

    start: int
    embeds: np.ndarray

    @property
    def stop(self) -> int:
        return self.start + self.embeds.shape[0]


def expand_prompt(ids, images, cfg: ModelConfig) -> tuple[np.ndarray, list[ImageSpan]]:
    """Replace the k-th `image_token_id` of `ids` by the span of images[k].

    Returns (int32 [n'] prompt ids, every span position `image_token_id`; the spans). ValueError when
    the placeholders and the images do not pair up.
    """
    ids = np.asarray(ids, np.int32).reshape(-1)
    slots = np.flatnonzero(ids == cfg.image_token_id)
    if len(slots) != len(images):
        raise ValueError(f"the prompt has {len(slots)} image placeholder(s) (token id {cfg.image_token_id}) but "
                         f"{len(images)} image(s) were given; put one placeholder where each image goes")
    out, spans, prev = [], [], 0
    for slot, image in zip(slots, images):
        out.append(ids[prev:slot])
        start = sum(len(a) for a in out)
        spans.append(ImageSpan(start, image))
        out.append(np.full(image.n_tokens, cfg.image_token_id, np.int32))
        prev = slot + 1
    out.append(ids[prev:])
    return np.concatenate(out).astype(np.int32), spans


def image_mask(spans, n: int) -> np.ndarray:
    """bool [n]: True at the positions of the spans (that lie inside [0, n))."""
    m = np.zeros(n, bool)
    for s in spans:
        m[s.start:min(s.stop, n)] = True
    return m
