"""The HTTP server through a real client (the `openai` package) on 127.0.0.1: completions, chat,
streaming, stop strings and ids, max_tokens, seeds, greedy ids equal to `experiments.decode`'s, 400 for
bad requests while another request streams, 429 when the queue is full, and a client that goes away
freeing its slot.

One server (tiny preset in 5 layers, 2 slots, queue of 2) for the module, run by uvicorn in a thread; the first
request compiles the prefill and decode programs, the rest reuse them.
"""

import base64
import json
import re
import time

import httpx2 as httpx
import jax
import numpy as np
import openai
import pytest
from PIL import Image

from dsv41_jax.images import prepare_image
from dsv41_jax.pytree_paths import path_str
from dsv41_jax.serving.text import TextStream, load_chat_template, render_chat
from dsv41_jax.text_tokenizers import ByteTokenizer
from experiments import decode, load_test, serve, serve_bench
from tests.configs import five_layer_presets
from tests.http_server import serving

PROMPT = "The quick brown fox jumps over the lazy dog. "
NEW = 24
EXACT = {"ignore_eos": True}  # the reference runs know no end-of-sequence id


@pytest.fixture(scope="module", autouse=True)
def five_layer_model():
    """`--preset tiny` as tiny's layer modes in 5 layers (tests/configs.py), for the server and for the reference
    runs of experiments.decode alike: what is checked is the serving layer, not tiny's depth, at ~40% less compile
    time per program."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve, "model_config", five_layer_presets(serve.model_config))
        mp.setattr(decode, "model_config", five_layer_presets(decode.model_config))
        yield


@pytest.fixture(scope="module")
def server():
    # 8 decode steps per call: the engine of `experiments.decode --engine` (EngineConfig's default), so that the
    # reference runs of it below reuse the server's decode program
    srv = serve.build_server(serve.parse_args(["--preset", "tiny", "--slots", "2", "--capacity", "256",
                                               "--max-queue", "2", "--decode-chunk", "8", "--kernels", "jnp"]))
    srv.engine.ecfg.progress = False
    with serving(srv.app) as url:
        srv.url = url
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy completion of PROMPT (NEW tokens): the reference of most tests."""
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body=EXACT)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_models_health_and_metrics(server, client, greedy):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "slots": 2, "running": 0, "waiting": 0}
    assert metric(server, "dsv41_generated_tokens_total") >= NEW
    assert metric(server, "dsv41_ttft_seconds_count") >= 1 and metric(server, "dsv41_slots") == 2


def test_greedy_completion_equals_experiments_decode(greedy, tmp_path):
    out = tmp_path / "run.json"
    decode.main(["--preset", "tiny", "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--kernels", "jnp",
                 "--output-json", str(out)])
    ids = json.loads(out.read_text())["generated_ids"][0]
    choice = greedy.choices[0]
    assert choice.token_ids == ids and choice.finish_reason == "length"
    assert choice.text == ByteTokenizer().decode(ids)
    assert greedy.usage.completion_tokens == NEW and greedy.usage.prompt_tokens == len(ByteTokenizer().encode(PROMPT))


def test_prompt_as_token_ids_and_chat_template(client, greedy):
    ids = ByteTokenizer().encode(PROMPT)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=NEW, temperature=0, extra_body=EXACT)
    assert r.choices[0].token_ids == greedy.choices[0].token_ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, extra_body=EXACT)
    assert render_chat(msgs, None) == f"<|system|>\nBe brief.\n<|user|>\n{PROMPT}\n<|assistant|>\n"
    plain = client.completions.create(model="tiny", prompt=render_chat(msgs, None), max_tokens=8, temperature=0,
                                      extra_body=EXACT)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].token_ids == plain.choices[0].token_ids
    assert chat.choices[0].message.content == plain.choices[0].text


def test_chat_with_an_image_answers_as_experiments_decode(server, client, tmp_path):
    """An image_url part (a PNG as a data URL) between two text parts: the tokens of `experiments.decode --engine`
    with the same engine settings on the rendered conversation, the image at its placeholder ("<image>", the
    byte tokenizer's text for tiny's image token); usage counts the image's tokens. Bad image parts are 400s."""
    png = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (84, 84, 3), dtype=np.uint8)).save(png)
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    part = lambda u: {"type": "image_url", "image_url": {"url": u}}
    content = [{"type": "text", "text": "Look: "}, part(url), {"type": "text", "text": " What is it?"}]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=NEW, temperature=0, extra_body=EXACT)
    text = render_chat([{"role": "user", "content": "Look: <image> What is it?"}], None)
    out = tmp_path / "run.json"
    decode.main(["--preset", "tiny", "--engine", "--prompt", text, "--image", str(png), "--max-new-tokens", str(NEW),
                 "--capacity", "256", "--slots", "2", "--decode-chunk", "8", "--kernels", "jnp", "--output-json",
                 str(out)])
    assert chat.choices[0].token_ids == json.loads(out.read_text())["generated_ids"][0]
    n_image = prepare_image(png, server.engine.cfg).n_tokens
    assert chat.usage.prompt_tokens == len(ByteTokenizer().encode(text.replace("<image>", ""))) + n_image
    bad = {"image_url must be a data URL": part("https://example.com/a.png"),
           "not base64": part("data:image/png;base64,***"),
           "not a readable image": part("data:image/png;base64," + base64.b64encode(b"not a png").decode()),
           "a part of type 'audio' is not served here": {"type": "audio", "audio": "x"}}
    for message, p in bad.items():
        with pytest.raises(openai.BadRequestError, match=re.escape("messages[0].content[1]: ") + ".*" + message):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [content[0], p]}])


def test_tokenizers_write_the_image_token(tmp_path):
    """The text that encodes to a model's image token: the byte tokenizer's "<image>" (when given the id), a
    tokenizer.json's special token; None where no text does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dsv41_jax.text_tokenizers import FileTokenizer

    tok = ByteTokenizer(319)
    assert tok.encode("a<image>b<image>") == [1, ord("a") + 3, 319, ord("b") + 3, 319]
    assert tok.special_text(319) == "<image>" and tok.special_text(5) is None
    assert 319 not in ByteTokenizer().encode("<image>") and ByteTokenizer().special_text(319) is None
    hf = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<image>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    file_tok = FileTokenizer(tmp_path)
    assert file_tok.special_text(3) == "<image>" and file_tok.special_text(0) is None  # "aab" is one unknown word


def test_streaming_gives_the_same_tokens_and_text(client, greedy):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True,
                                            extra_body=EXACT))
    assert [i for c in chunks for i in c.choices[0].token_ids] == greedy.choices[0].token_ids
    assert "".join(c.choices[0].text for c in chunks) == greedy.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].token_ids) for c in chat) == 5


def test_stop_strings_stop_ids_and_max_tokens(client, greedy):
    ids, text, tok = greedy.choices[0].token_ids, greedy.choices[0].text, ByteTokenizer()
    printable = lambda c: c.isascii() and c.isprintable() and c.strip()
    stop = next(tok.decode([t]) for t in ids[3:] if printable(tok.decode([t])))  # an ASCII character it generates
    need = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[stop],
                                      stream=stream, extra_body=EXACT)
        parts = list(r) if stream else [r]
        assert "".join(p.choices[0].text for p in parts) == text[:text.find(stop)]
        assert [i for p in parts for i in p.choices[0].token_ids] == ids[:need]
        assert parts[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                  extra_body={"stop_token_ids": [ids[5]], **EXACT})
    assert r.choices[0].token_ids == ids[:ids.index(ids[5]) + 1] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, extra_body=EXACT)
    assert r.choices[0].token_ids == ids[:3] and r.choices[0].finish_reason == "length"


def test_sampling_follows_the_seed(client):
    run = lambda seed: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                                 seed=seed, extra_body=EXACT).choices[0].token_ids
    a, b = run(7), run(8)
    assert run(7) == a and a != b


def test_requests_join_and_leave_without_recompiling(client, greedy):
    """Continuous batching: requests of other prompt lengths, budgets, temperatures and stops join the
    running batch and leave it at other steps, and nothing compiles again (after one request of each
    prefill layer range: a prompt past the first page also runs the bounded-prefill split)."""
    import concurrent.futures

    import jax

    def run(prompt: str, n: int, **kw):
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True, **kw)
        return [i for c in chunks for i in c.choices[0].token_ids]

    long = PROMPT * 3  # 135 bytes: two pages of 64
    assert len(run(long, 4, temperature=0, extra_body=EXACT)) == 4  # may compile its prefill split once
    compiles = []
    # a program new to this process: compiled, or read from the run's persistent compilation cache (conftest)
    new_program = ("backend_compile_duration", "cache_retrieval_time_sec")
    listener = lambda name, *_, **__: compiles.append(name) if name.endswith(new_program) else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jobs = [(PROMPT, 20, dict(temperature=0, extra_body=EXACT)),
                (long, 7, dict(temperature=1.0, seed=3, extra_body=EXACT)),
                (PROMPT[:9], 13, dict(temperature=0.5, seed=4, stop=["zz"], extra_body=EXACT)),
                (long[:70], 3, dict(temperature=0, extra_body={"stop_token_ids": [1, 2, 3], **EXACT}))]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # 2 in slots, 2 waiting for one
            outs = list(pool.map(lambda j: run(*j[:2], **j[2]), jobs))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert outs[0] == greedy.choices[0].token_ids[:20]  # joined with others: still the greedy tokens
    assert len(outs[1]) == 7 and 1 <= len(outs[2]) <= 13 and 1 <= len(outs[3]) <= 3  # budgets, or a stop
    assert compiles == []


def test_bad_requests_are_400_while_another_request_streams(server, client):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                       extra_body=EXACT)
    it = iter(stream)
    got = [next(it)]  # running in a slot now
    post = lambda body: httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    bad = {
        "prompt: Field required": {"model": "tiny", "max_tokens": 4},
        "max_tokens: Input should be a valid integer": {"model": "tiny", "prompt": "x", "max_tokens": "4"},
        "temperature: Input should be a valid number": {"model": "tiny", "prompt": "x", "temperature": "hot"},
        "max_tokens must be >= 1, got 0": {"model": "tiny", "prompt": "x", "max_tokens": 0},
        "exceeds the slot capacity of 256": {"model": "tiny", "prompt": "x" * 250, "max_tokens": 10},
        "prompt has ids outside [0, 320)": {"model": "tiny", "prompt": [5, 999], "max_tokens": 2},
    }
    for message, body in bad.items():
        r = post(body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (message, r.text)
    assert post({"model": "gpt-4", "prompt": "x"}).status_code == 404
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny"}, timeout=30)
    assert r.status_code == 400 and "messages: Field required" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages: Input should be a valid list"):
        client.chat.completions.create(model="tiny", messages="hi")
    got += list(it)
    assert sum(len(c.choices[0].token_ids) for c in got) == 100 and got[-1].choices[0].finish_reason == "length"


def test_queue_full_is_429_and_gone_clients_free_their_slots(server, client):
    gone0, length0 = metric(server, 'dsv41_requests_total{outcome="client_gone"}'), \
        metric(server, 'dsv41_requests_total{outcome="length"}')
    open_stream = lambda: client.completions.create(model="tiny", prompt="x", max_tokens=250, temperature=0,
                                                    stream=True, extra_body=EXACT)
    streams = [open_stream() for _ in range(4)]  # 2 in slots, 2 waiting: the queue holds 2
    health = lambda: httpx.get(server.url + "/health").json()
    deadline = time.time() + 60
    while (health()["running"], health()["waiting"]) != (2, 2):
        assert time.time() < deadline, health()
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError, match="server busy: 2 requests already wait"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4)
    for s in streams:
        s.close()
    while health()["running"] or health()["waiting"]:
        assert time.time() < deadline, health()
        time.sleep(0.05)
    assert metric(server, 'dsv41_requests_total{outcome="client_gone"}') - gone0 == 4
    assert metric(server, 'dsv41_requests_total{outcome="length"}') == length0  # none ran to its end
    assert metric(server, 'dsv41_requests_total{outcome="queue_full"}') >= 1


def test_an_engine_failure_is_a_500_and_the_server_keeps_serving(server, client, greedy, monkeypatch, capsys):
    def broken():
        monkeypatch.undo()  # fails once
        raise RuntimeError("injected failure")

    monkeypatch.setattr(server.engine, "step", broken)
    with pytest.raises(openai.InternalServerError, match="the engine failed while running this request"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert "RuntimeError: injected failure" in capsys.readouterr().err  # the traceback is in the server log
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body=EXACT)
    assert r.choices[0].token_ids == greedy.choices[0].token_ids


def test_text_stream_holds_back_a_possible_stop_and_cut_characters():
    tok = ByteTokenizer()
    ids = tok.encode("ab\u00e9c END")[1:]  # é is two bytes: two tokens
    ts = TextStream(tok, ["END"])
    out = [ts.feed(ids[:n]) for n in range(1, len(ids) + 1)]
    assert out[2] == "" and out[3] == "\u00e9"  # the first byte of é alone is held back
    assert "".join(out) == "ab\u00e9c " and ts.stopped and ts.n_tokens == len(ids)
    ts = TextStream(tok, ["END"])
    assert ts.feed(tok.encode("x EN")[1:]) == "x " and ts.feed(tok.encode("x EN")[1:], final=True) == "EN"


def test_checkpoint_chat_template_is_rendered_in_a_sandbox(tmp_path):
    assert load_chat_template(str(tmp_path)) is None  # no tokenizer_config.json: the simple template
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs, load_chat_template(str(tmp_path)), "<s>") == "<s>[user]hi[assistant]"
    with pytest.raises(ValueError, match="refused the conversation: no system"):
        render_chat(msgs, "{{ raise_exception('no system') }}")


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(decode, "device_memory", lambda n: (139.8 * 2**30, "an H200"))  # not this machine's
    cases = ((["--preset", "v41-flash"], "error: v41-flash does not fit: its weights (1421.7 GiB in all) need 1421.7 GiB "
                                         "on one device, and an H200 holds 139.8 GiB"),
             (["--preset", "v41-flash", "--weight-format", "fp8"], "error: v41-flash does not fit: its weights (476.6 "
                                                                   "GiB in all) need 476.6 GiB on one device"),
             (["--checkpoint", tmp_path / "missing"], f"error: --checkpoint {tmp_path / 'missing'}: no such directory"),
             (["--capacity", "100000"], "error: --capacity 100000: exceeds the model's max_seq_len of 4096"),
             (["--window-store", "redis://x"], "error: --window-store: needs --cache-dir"),
             (["--window-store", "memcached://h:1", "--cache-dir", tmp_path],
              "error: --window-store 'memcached://h:1': unknown window store; give redis://"),
             (["--window-store", "mooncake://h", "--cache-dir", tmp_path],
              "error: --window-store 'mooncake://h': a Mooncake Store URL is mooncake://MASTER_HOST:RPC_PORT"),
             (["--cache-dir", tmp_path / "f.txt", "--port", "1"], f"error: --cache-dir {tmp_path / 'f.txt'}: not "
                                                                   "writable (it is a file"),
             (["--mesh", "data=2,expert=4", "--layout", "dp_ep"], "error: engine settings (--mesh, --layout, --slots): "
              "slots=4: layout dp_ep splits the slots over 8 devices of mesh data=2,expert=4; use a multiple of 8"),
             (["--mesh", "tensor=8"], "error: engine settings (--mesh, --layout, --slots): mesh axis tensor=8 does not "
                                     "divide n_heads=4"))
    (tmp_path / "f.txt").write_text("x")
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            serve.main([str(a) for a in argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1 and len(err) == 1 and err[0].startswith(message), err


def test_mesh_flags_draw_the_weights_into_their_shards_and_place_the_engine(monkeypatch):
    """--mesh reaches the engine (experiments.decode --engine shares the code: engine_config, random_engine_params):
    the random weights are drawn on the mesh, the experts split over `expert`, the slots' cache there too. That an
    engine on a mesh emits one device's tokens: tests/test_engine_mesh.py. The model: tiny cut to 2 layers (window,
    Full m=1) without draft stages, as where it is placed does not depend on the depth, and the draw is one program
    that compiles in ~40% of the 5 layers' time."""
    if len(jax.devices()) < 8:
        pytest.skip("needs --xla_force_host_platform_device_count=8 (set in conftest.py)")
    five_layers = serve.model_config
    monkeypatch.setattr(serve, "model_config", lambda args: five_layers(args).replace(
        n_layers=2, n_mtp_layers=0, compress_ratios=(0, 1), kv_source_layers=(1,), index_source_layers=(1,),
        candidate_source_layer=1, engram_layer_ids=(), engram_num_embeddings=()))
    eng = serve.build_server(serve.parse_args(["--mesh", "tensor=2,expert=4", "--slots", "2", "--capacity", "64"])).engine
    assert dict(eng.placement.mesh.shape) == {"tensor": 2, "expert": 4} and eng.placement.batch == 2
    args = decode.parse_args(["--engine", "--mesh", "data=2,expert=4", "--layout", "dp_ep", "--batch", "3"])
    assert decode.engine_config(args, decode.model_config(args), 64, 3).slots == 8  # the requests' 3, filled up
    w1 = [a for p, a in jax.tree_util.tree_leaves_with_path(eng.params.state) if path_str(p).endswith("ffn/w1")]
    assert w1 and all(a.sharding.spec[0] == "expert" and len(a.sharding.device_set) == 8 for a in w1)
    assert all(len(a.sharding.device_set) == 8 for a in jax.tree.leaves(eng.cache))


def test_serve_bench_reports_a_server_that_does_not_start(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match="the server exited with status 1"):
        serve_bench.main(["--out", str(out), "--serve-arg=--capacity=100000"])
    report = json.loads(out.read_text())
    assert "error: --capacity 100000: exceeds the model's max_seq_len" in report["server_log_tail"]
    assert report["load_test"] is None and (tmp_path / "r.log").is_file()


def test_load_test_against_the_server(server):
    res = load_test.main(["--url", server.url, "--clients", "3", "--requests", "2", "--max-tokens", "4"])
    assert res["completed"] == 6 and res["errors"] == 0 and res["ttft_p99_s"] >= res["ttft_p50_s"] > 0
