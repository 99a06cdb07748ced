"""Images in the prompt: parity with DeepSeek's official code (preprocessing, vision embeddings, logits of
prompts with images; goldens made outside the repo, docs/PARITY.md "Vision"), the bad-image errors,
chunked prefill across an image, and prefix-cache keys that see the image content.

Golden (tests/golden/vision_fixture.npz), on `vision_fixture_config()` (2 backbone layers with Engram
on both, a 2-block vision tower) drawn by `make_tensors(seed=0)` (SHA-256 checked), float32
activations: two 60x90 / 50x30 random RGB images as PNG through the official `load_image` (patches,
grids), the official `encode_image` (aligner rows), and the official forward on 2 x 24 ids with the
images at 9..18 (row 0) and 0..10 (row 1): one prefill (`f32_{bf16|fp8}_prefill`), and a prefill of
19 then 5 one-token steps with the released index keys (`f32_{bf16|fp8}_decode_released`); `bf16` =
dequantized weights without activation quantization, `fp8` = the released fp8 mode. Plus the resize
plan of 13 image sizes under this config, the released one, and the released one with
vision_max_wh_ratio = 4.
"""

import io
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dsv41_jax as d
from dsv41_jax import api
from dsv41_jax.checkpoint import load_checkpoint
from dsv41_jax.checkpoint.synthetic import make_tensors, vision_fixture_config, write_checkpoint
from dsv41_jax.images import ImageError, ImageSpan, expand_prompt, plan_grid, prepare_image, span_types
from tests.configs import covered_elsewhere
from tests.near_ties import NearTies
from tests.test_parity import _fixture_hash

G = np.load(Path(__file__).parent / "golden" / "vision_fixture.npz")
CFG = vision_fixture_config()
IDS, N = G["ids"], int(G["decode_from"])
B, T = IDS.shape
STRICT = 1e-4  # x scale: float rounding (the text goldens' criterion, tests/test_parity.py)


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tensors = make_tensors(CFG, seed=0)
    assert _fixture_hash(tensors) == str(G["fixture_sha256"]), \
        "the fixture writer no longer draws the checkpoint the vision goldens were made from (docs/PARITY.md)"
    path = tmp_path_factory.mktemp("dsv41_vision") / "ckpt"
    write_checkpoint(path, CFG, tensors, sharded=True, config_style="inference")
    yield str(path)
    shutil.rmtree(path)


@lru_cache(maxsize=None)
def _model(ckpt: str, quant: bool):
    loaded = load_checkpoint(ckpt, dtype="float32", dequantize=not quant, activation_quant=quant, progress=False)
    assert loaded.notes == [] and loaded.cfg.vision_n_layers == 2
    return loaded.cfg, loaded.params


def _spans(cfg) -> list[list[ImageSpan]]:
    """Each row's image span, from the golden's pixels through our preprocessing."""
    return [[ImageSpan(int(G[f"start_{k}"]), prepare_image(_png(G[f"pixels_{k}"]), cfg))] for k in ("a", "b")]


def test_preprocessing_matches_official():
    for k in ("a", "b"):
        img = prepare_image(_png(G[f"pixels_{k}"]), CFG)
        assert [img.n_vit_h, img.n_vit_w, img.n_llm_h, img.n_llm_w] == G[f"grid_{k}"].tolist()
        np.testing.assert_array_equal(img.patches.view(np.uint16), G[f"patches_{k}"])  # bf16, bit for bit
        start = int(G[f"start_{k}"])
        row = 0 if k == "a" else 1
        np.testing.assert_array_equal(G["token_types"][row, start:start + img.n_tokens], span_types(img.n_llm_h,
                                                                                                  img.n_llm_w))
    released = d.preset("v41-flash")
    for tag, cfg in (("fixture", CFG), ("released", released), ("released_wh4", released.replace(vision_max_wh_ratio=4))):
        ours = [plan_grid(int(w), int(h), cfg) for w, h in G["plan_sizes"]]
        np.testing.assert_array_equal(np.array(ours), G[f"plan_{tag}"], err_msg=tag)


def test_prompt_expansion_places_each_image_at_its_placeholder():
    a, b = (prepare_image(_png(G[f"pixels_{k}"]), CFG) for k in ("a", "b"))
    ids, spans = expand_prompt([7, CFG.image_token_id, 8, 9, CFG.image_token_id], [a, b], CFG)
    assert [s.start for s in spans] == [1, 3 + a.n_tokens]
    assert ids.tolist() == [7] + [CFG.image_token_id] * a.n_tokens + [8, 9] + [CFG.image_token_id] * b.n_tokens
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        expand_prompt([7, CFG.image_token_id], [a, b], CFG)


def test_vision_embeddings_match_official_f32(ckpt):
    cfg, params = _model(ckpt, quant=False)
    for k in ("a", "b"):
        img = prepare_image(_png(G[f"pixels_{k}"]), cfg)
        span = np.asarray(api.encode_image(cfg, params, img))
        types = span_types(img.n_llm_h, img.n_llm_w)
        ref = G[f"f32_aligner_{k}"]
        err = np.abs(span[types == 1] - ref).max()
        print(f"image {k}: aligner rows max|d| {err:.3g} of scale {np.abs(ref).max():.3g}")
        assert err <= 1e-5 * np.abs(ref).max(), (k, err)
        flat = {name: np.asarray(params[name][...]) for name in ("image_start", "image_newline", "image_end")}
        for t, name in ((0, "image_start"), (2, "image_newline"), (3, "image_end")):
            np.testing.assert_array_equal(span[types == t], np.broadcast_to(flat[name], span[types == t].shape))


def _logits(cfg, params, decode: bool) -> np.ndarray:
    """Our [B, T, V]: one prefill of all T with the images, or a prefill of N then one-token steps
    (released index keys), fed the golden ids."""
    n = N if decode else T
    spans = _spans(cfg)
    logits, cache = d.prefill(cfg, params, d.init_cache(cfg, B, T), IDS, np.full(B, n), all_logits=True,
                              images=spans)
    out = [np.asarray(logits)[:, :n]]
    dec = cfg.replace(index_keys="released")
    for pos in range(n, T):
        step, cache = d.decode_step(dec, params, cache, IDS[:, pos])
        out.append(np.asarray(step)[:, None])
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("mode,kind", [("bf16", "prefill"), ("bf16", "decode_released"), ("fp8", "prefill")])
def test_prompt_with_images_matches_official_f32(ckpt, mode, kind):
    """Same criterion as the text goldens (tests/test_parity.py): every position within 1e-4 x the logit
    scale, or so after pushing at most 4 quantizer near-ties (within 16 ulps of a rounding boundary)
    across; the images move the logits by more than the scale, so a wrong merge cannot pass."""
    cfg, params = _model(ckpt, quant=mode == "fp8")
    ref = G[f"f32_{mode}_{kind}"]
    scale = np.abs(ref).max()
    n_loose = lambda x: int((np.abs(x - ref).max(-1) > STRICT * scale).sum())
    run = lambda: _logits(cfg, params, decode=kind != "prefill")
    ours = run()
    err, loose = np.abs(ours - ref).max(), n_loose(ours)
    print(f"{mode} {kind}: max|dlogit| {err:.3g} of scale {scale:.3g}; {loose} positions outside {STRICT:g} x scale")
    assert np.abs(G["f32_bf16_as_text"] - G["f32_bf16_prefill"]).max() > scale  # the images matter
    assert err <= 0.25 * scale and (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    if loose:
        flips, fixed = NearTies(16).explain(run, n_loose, 4)
        assert n_loose(fixed) == 0, (mode, kind, "not explained by near-tie flips", flips, np.abs(fixed - ref).max())


def test_chunked_prefill_across_images_equals_one_prefill(ckpt):
    """Chunks of 8 cut both images; the tower sees each image whole, so the logits are one prefill's."""
    cfg, params = _model(ckpt, quant=False)
    out = []
    for _, n, logits, _ in api.prefill_chunks(cfg, params, d.init_cache(cfg, B, T), IDS, 0, T, 8, all_logits=True,
                                              images=_spans(cfg)):
        out.append(np.asarray(logits)[:, :n])
    ref = G["f32_bf16_prefill"]
    np.testing.assert_allclose(np.concatenate(out, axis=1), ref, atol=STRICT * np.abs(ref).max(), rtol=0)


def test_prefill_with_images_on_a_mesh_matches_official(ckpt):
    """The same prompts with images on 8 devices (data=2 x expert=4, tp_ep: a sequence per `data` shard, experts
    over `expert`): the logits the golden has, to the text goldens' criterion (the tower runs on the placed
    params; `experiments.decode --image --mesh` takes this path)."""
    import jax

    from dsv41_jax import partitioning
    from dsv41_jax.sharding import shard_model

    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    cfg, params = _model(ckpt, quant=False)
    model = shard_model(cfg, params, partitioning.make_mesh(cfg, "data=2,expert=4", batch=B), "tp_ep", batch=B)
    logits, _ = model.prefill(model.init_cache(T), IDS, np.full(B, T), all_logits=True, images=_spans(cfg))
    ref = G["f32_bf16_prefill"]
    np.testing.assert_allclose(np.asarray(logits), ref, atol=STRICT * np.abs(ref).max(), rtol=0)


def test_bad_images_are_refused_before_any_model_work(tmp_path):
    with pytest.raises(ImageError, match="not a readable image"):
        prepare_image(b"GIF89a not really", CFG)
    (tmp_path / "cut.png").write_bytes(_png(G["pixels_a"])[:60])
    with pytest.raises(ImageError, match="cut.png: not a readable image"):
        prepare_image(tmp_path / "cut.png", CFG)
    with pytest.raises(ImageError, match="missing.png: cannot read it"):
        prepare_image(tmp_path / "missing.png", CFG)
    with pytest.raises(ImageError, match=r"too small \(10x40 pixels\)"):
        prepare_image(Image.new("RGB", (10, 40)), CFG)
    limit = (CFG.vision_max_n_token - 2) / 2  # 15:1 here
    with pytest.raises(ImageError, match="aspect ratio out of range"):
        prepare_image(Image.new("RGB", (14 * 16, 14)), CFG)
    assert prepare_image(Image.new("RGB", (14 * int(limit), 14)), CFG).n_tokens <= CFG.vision_max_n_token
    with pytest.raises(ValueError, match="no vision tower"):
        prepare_image(Image.new("RGB", (64, 64)), CFG.replace(vision_n_layers=0))


def test_image_spans_must_cover_image_tokens():
    cfg = d.preset("tiny")
    img = prepare_image(Image.new("RGB", (84, 84)), cfg)
    with pytest.raises(ValueError, match="must cover positions holding image_token_id"):
        d.prefill(cfg, None, d.init_cache(cfg, 1, 32), np.zeros((1, 16), np.int32), np.array([16]),
                  images=[[ImageSpan(0, img)]])


def test_prefix_keys_include_the_image_content():
    from dsv41_jax.tiers.keys import block_chain

    ids = np.arange(64) % 7
    plain = block_chain("fp", ids, 16)
    a = block_chain("fp", ids, 16, [(20, 30, "digest-a")])
    b = block_chain("fp", ids, 16, [(20, 30, "digest-b")])
    assert a[0] == b[0] == plain[0]  # block 0 ends before the image
    assert all(x != y for x, y in zip(a[1:], b[1:])) and all(x != y for x, y in zip(a[1:], plain[1:]))
    assert block_chain("fp", ids, 16, [(20, 30, "digest-a")]) == a  # stable


def test_engine_never_shares_pages_between_different_images(ckpt, tmp_path):
    """Equal ids, different images: cold each time (no page, no window of the other image); the same
    image again restores its own prefix exactly (the cold run's tokens)."""
    from dsv41_jax.serving import Engine, EngineConfig, Request

    cfg, params = _model(ckpt, quant=False)  # the fixture's 2 layers: short compiles
    ecfg = EngineConfig(slots=1, capacity=96, prefill_chunk=64, page_tokens=16, cache_dir=str(tmp_path),
                        progress=False, decode_chunk=4, bounded_prefill=False)
    eng = Engine(cfg, params, ecfg)
    rng = np.random.default_rng(3)
    img = {k: prepare_image(Image.fromarray(rng.integers(0, 256, (84, 84, 3), dtype=np.uint8)), cfg) for k in "ab"}
    prompt = [1, 40, cfg.image_token_id] + rng.integers(3, 250, 40).tolist()  # the span is in page 0
    run = lambda k: eng.generate([Request(prompt, max_new_tokens=4, images=(img[k],))])[0]
    first_a, first_b, again_a = run("a"), run("b"), run("a")
    for r in (first_a, first_b, again_a):
        assert r.error is None and r.metrics["image_tokens"] == img["a"].n_tokens
    assert first_a.metrics["prefix_path"] == first_b.metrics["prefix_path"] == "cold"
    assert first_b.metrics["disk_pages_hit"] == 0 and not first_b.metrics["host_window_hit"]
    # the image reaches the output (here through the tokens after the first: the prompt's last position is
    # a window past the span), so a page shared between the two would show
    assert first_a.tokens != first_b.tokens
    assert again_a.metrics["prefix_path"] == "host_restore" and again_a.metrics["reused_tokens"] >= 32
    assert again_a.tokens == first_a.tokens
    np.testing.assert_allclose(again_a.first_logits, first_a.first_logits, atol=1e-5)
    bad = eng.generate([Request(prompt + [cfg.image_token_id], max_new_tokens=4, images=(img["a"],))])[0]
    assert "2 image placeholder(s)" in bad.error and "1 image(s)" in bad.error


@covered_elsewhere("tests/test_engine_mesh.py's engine and test_prefill_with_images_on_a_mesh_matches_official")
def test_engine_on_a_mesh_takes_images(ckpt):
    """On 8 devices (data=2 x expert=4, dp_ep): a request with an image and one without emit the one-device
    engine's tokens, and the first logits agree to float rounding (the image's tower runs on the mesh's params,
    its prefill row replicated over the mesh)."""
    import jax

    from dsv41_jax.serving import Engine, EngineConfig, Request

    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    cfg, params = _model(ckpt, quant=False)
    rng = np.random.default_rng(3)
    img = prepare_image(Image.fromarray(rng.integers(0, 256, (84, 84, 3), dtype=np.uint8)), cfg)
    prompt = [1, 40, cfg.image_token_id] + rng.integers(3, 250, 40).tolist()
    reqs = [Request(prompt, max_new_tokens=6, images=(img,)), Request(prompt[:1] + prompt[3:], max_new_tokens=6)]

    def run(**kw):  # the settings of test_engine_never_shares_pages_between_different_images: its programs
        return Engine(cfg, params, EngineConfig(capacity=96, prefill_chunk=64, page_tokens=16, progress=False,
                                                decode_chunk=4, bounded_prefill=False, **kw)).generate(reqs)

    want, got = run(slots=1), run(slots=8, mesh="data=2,expert=4", layout="dp_ep")
    assert [r.error for r in got] == [None, None] and got[0].metrics["image_tokens"] == img.n_tokens
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for a, b in zip(got, want):
        assert np.abs(a.first_logits - b.first_logits).max() <= 1e-5 * np.abs(b.first_logits).max()


@pytest.mark.parametrize("case", ["unreadable", "too small", "aspect ratio", "placeholders"])
def test_decode_refuses_bad_images_before_building_the_model(case, tmp_path, capsys, monkeypatch):
    from experiments import decode
    from tests.test_cli import fails

    monkeypatch.setattr(d, "init_params", lambda *a, **k: pytest.fail("the model was built before the input was checked"))
    paths = {"unreadable": tmp_path / "x.png", "too small": tmp_path / "s.png", "aspect ratio": tmp_path / "w.png",
             "placeholders": tmp_path / "ok.png"}
    paths["unreadable"].write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    Image.new("RGB", (13, 200)).save(paths["too small"])
    Image.new("RGB", (14 * 40, 14)).save(paths["aspect ratio"])
    Image.new("RGB", (84, 84)).save(paths["placeholders"])
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([1, 319, 5, 319]))  # two placeholders of tiny, one image given
    extra = ["--prompt-ids", ids] if case == "placeholders" else []
    want = {"unreadable": "x.png: not a readable image", "too small": "image too small (13x200 pixels)",
            "aspect ratio": "aspect ratio out of range (560x14 pixels, 40:1): at most 31:1",
            "placeholders": "--image: the prompt has 2 image placeholder(s) (token id 319) but 1 image(s)"}[case]
    line = fails(decode.main, ["--image", paths[case], *extra], capsys)
    assert want in line, (want, line)
