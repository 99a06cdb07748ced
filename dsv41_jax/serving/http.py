"""An OpenAI-compatible HTTP server over the engine (FastAPI; `experiments.serve` runs it with uvicorn).

    app = Server(engine, tokenizer, model_name="tiny", max_queue=64).app

Endpoints: POST /v1/completions and /v1/chat/completions (streaming by server-sent events with
"stream": true), GET /v1/models, /health and /metrics (Prometheus text format: queue, running slots,
requests by outcome, tokens, TTFT, prefix hits per tier, prefix paths, replays, window-store errors).
One driver thread (`serving.driver`) owns the engine and batches every running request into each
decode step; handlers only submit, read tokens and cancel.

Request fields beyond OpenAI's: `stop_token_ids` (ids that end the request, checked on the device),
`ignore_eos` (do not stop at the tokenizer's end-of-sequence id). Every choice carries `token_ids`,
the generated ids behind its text (a stream chunk: the ids behind its delta), so a client can compare
ids exactly rather than through a detokenizer. `n` must be 1 and `prompt` a single prompt (text or ids).

Images (a model with a vision tower): a chat message's content parts may be `image_url` parts whose URL is a
base64 data URL (the server fetches nothing). Each becomes the tokenizer's text for the image token where the
part stands (a released tokenizer's special token; "<image>" for the byte tokenizer), and its image goes to the
engine with the request (`Request.images`); usage counts the image's prompt tokens. Any other part type is a 400.

Errors are OpenAI's shape, {"error": {"message", "type", "code"}}: 400 for a request that cannot run
(missing or mistyped fields, a prompt plus max_tokens longer than a slot, max_tokens < 1), 404 for an
unknown model, 429 (with Retry-After) when `max_queue` requests already wait beyond the free slots, 500
when the engine fails (the traceback goes to the server's stderr; later requests are served). A client
that disconnects cancels its request, freeing the slot at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import time
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict

from dsv41_jax.images import ImageError, prepare_image
from dsv41_jax.serving.driver import Driver, QueueFull
from dsv41_jax.serving.engine import Engine, Request, Result
from dsv41_jax.serving.text import TextStream, render_chat

FINISH = {"stop_token": "stop", "max_new_tokens": "length", "cancelled": "abort"}


class _Body(BaseModel):
    # strict: "10" is not a number and 1.5 not a token count; unknown OpenAI fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    temperature: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    max_tokens: int = 16


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]


class ChatBody(_Body):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status,
                        headers=headers)


class Metrics:
    """Prometheus series of one server (its own registry, so several servers can live in one process)."""

    def __init__(self, driver: Driver, slots: int):
        self.registry = r = CollectorRegistry()
        Gauge("dsv41_queue_length", "requests waiting for a slot", registry=r).set_function(driver.waiting)
        Gauge("dsv41_running_slots", "slots decoding a request", registry=r).set_function(driver.running)
        Gauge("dsv41_slots", "decode slots of the engine", registry=r).set(slots)
        self.requests = Counter("dsv41_requests", "finished HTTP generation requests by outcome", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated = Counter("dsv41_generated_tokens", "tokens generated (rate() = tokens/s)", registry=r)
        self.ttft = Histogram("dsv41_ttft_seconds", "time from the HTTP request to its first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.prefix_hits = Counter("dsv41_prefix_hits", "requests whose prompt prefix came from a tier "
                                   "(hit rate = this / dsv41_requests_total)", ["tier"], registry=r)
        self.reused = Counter("dsv41_prefix_reused_tokens", "prompt tokens restored from the tiers", registry=r)
        self.replays = Counter("dsv41_replays", "prefix hits that took bounded replay (no window state)",
                               registry=r)
        self.paths = Counter("dsv41_prefix_paths", "admitted requests by how the state at their cached prefix was "
                             "obtained: cold, host_restore, bounded_replay, recompute", ["path"], registry=r)
        Gauge("dsv41_window_store_errors", "failed calls to the shared window store (each one a miss, then a "
              "back-off)", registry=r).set_function(lambda: driver.engine.prefix.host.stats["store_errors"]
                                                   if driver.engine.prefix is not None else 0)

    def finished(self, res: Result) -> None:
        m = res.metrics
        if m.get("disk_pages_hit"):
            self.prefix_hits.labels("disk").inc()
        if m.get("host_window_hit"):
            self.prefix_hits.labels("host").inc()
        if m.get("prefix_path") == "bounded_replay":
            self.replays.inc()
        if "prefix_path" in m:  # not for a request cancelled before it reached a slot
            self.paths.labels(m["prefix_path"]).inc()
        self.reused.inc(m.get("reused_tokens", 0))


class Server:
    """The FastAPI `app` of one engine; `app`'s lifespan starts and stops the driver thread."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, max_queue: int = 64,
                 chat_template: str | None = None):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.chat_template = chat_template
        self.driver = Driver(engine, max_queue)
        self.metrics = Metrics(self.driver, engine.n_slots)
        self.created = int(time.time())

        @asynccontextmanager
        async def lifespan(_):
            self.driver.start()
            yield
            self.driver.close()

        self.app = app = FastAPI(title="dsv41_jax", lifespan=lifespan)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc: RequestValidationError):
            self.metrics.requests.labels("bad_request").inc()
            where = lambda e: ".".join(str(x) for x in e["loc"] if x != "body") or "body"
            return error(400, "; ".join(f"{where(e)}: {e['msg']}" for e in exc.errors()[:5]), "invalid_request_error")

        @app.exception_handler(BadRequest)
        async def bad(_, exc: BadRequest):
            self.metrics.requests.labels("bad_request" if exc.status < 429 else "queue_full").inc()
            headers = {"Retry-After": "1"} if exc.status == 429 else None
            return error(exc.status, str(exc), exc.kind, headers)

        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)

    # ------------------------------------------------------------------ small endpoints
    async def health(self):
        return {"status": "ok", "slots": self.engine.n_slots, "running": self.driver.running(),
                "waiting": self.driver.waiting()}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "dsv41_jax"}]}

    # ------------------------------------------------------------------ generation
    async def completions(self, body: CompletionBody, http: HTTPRequest):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise BadRequest(f"prompt: {len(p)} prompts in one request; send one prompt per request")
            p = p[0]
        ids = self.tok.encode(p) if isinstance(p, str) else p
        return await self._respond(body, ids, body.max_tokens, http, chat=False)

    async def chat(self, body: ChatBody, http: HTTPRequest):
        if not body.messages:
            raise BadRequest("messages: empty; give at least one message")
        images, msgs = [], []
        for i, m in enumerate(body.messages):
            text = m.content
            if isinstance(text, list):  # parts: text, and images as their placeholder's text, in order
                text = "".join(self._part(part, f"messages[{i}].content[{j}]", images) for j, part in enumerate(text))
            msgs.append({"role": m.role, "content": text})
        try:
            ids = self.tok.encode(render_chat(msgs, self.chat_template))
        except ValueError as e:
            raise BadRequest(f"messages: {e}") from None
        limit = body.max_completion_tokens or body.max_tokens
        # no limit given: the rest of the slot (at least 1, so an over-long prompt is refused as too long)
        room = self.engine.ecfg.capacity - len(ids) - sum(im.n_tokens - 1 for im in images)
        return await self._respond(body, ids, limit or max(1, room), http, chat=True, images=tuple(images))

    def _part(self, part: dict, where: str, images: list) -> str:
        """A chat content part's text: a text part's own, an image_url part's placeholder (the image decoded and
        prepared for the vision tower, appended to `images`); BadRequest for anything else."""
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            return part["text"]
        if kind != "image_url":  # dropping it would answer a question the client did not ask
            raise BadRequest(f"{where}: a part of type {kind!r} is not served here (text and image_url parts)")
        cfg = self.engine.cfg
        text = self.tok.special_text(cfg.image_token_id) if cfg.vision_n_layers else None
        if text is None:
            raise BadRequest(f"{where}: this model takes no images" + (
                "" if not cfg.vision_n_layers else " through this tokenizer (no text encodes to its image token "
                f"{cfg.image_token_id})"))
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        head, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
        if not (head.startswith("data:") and head.endswith(";base64")):
            raise BadRequest(f"{where}: image_url must be a data URL (data:image/png;base64,...); this server does "
                             "not fetch URLs")
        try:
            images.append(prepare_image(base64.b64decode(data, validate=True), cfg, source=where))
        except (binascii.Error, ValueError) as e:  # ImageError is a ValueError
            raise BadRequest(f"{where}: {e}" if isinstance(e, ImageError) else f"{where}: not base64 ({e})") from None
        return text

    def _request(self, body: _Body, ids: list[int], max_tokens: int, images: tuple = ()) -> tuple[Request, int]:
        """(The engine request of a body, its prompt tokens with image spans expanded), or BadRequest saying which
        field is wrong."""
        if body.model != self.model_name:
            raise BadRequest(f"model {body.model!r} is not served here; use {self.model_name!r} (GET /v1/models)",
                             404, "not_found_error")
        if body.n != 1:
            raise BadRequest(f"n: {body.n} choices asked; this server returns one choice per request (n=1)")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
        stops = list(body.stop_token_ids)
        if self.tok.eos_id is not None and not body.ignore_eos:
            stops.append(self.tok.eos_id)
        seed = secrets.randbits(32) if body.seed is None else body.seed
        if not 0 <= seed < 2**32:
            raise BadRequest(f"seed must be in [0, 2**32), got {seed}")
        req = Request(list(ids), max_new_tokens=max_tokens, temperature=body.temperature, seed=seed,
                      stop_tokens=tuple(stops), images=images)
        try:
            n_prompt = len(self.engine.validate(req))
        except ValueError as e:
            raise BadRequest(f"{e} (max_tokens: {max_tokens})" if "too long" in str(e) else str(e)) from None
        return req, n_prompt

    async def _respond(self, body: _Body, ids: list[int], max_tokens: int, http: HTTPRequest, chat: bool,
                       images: tuple = ()):
        t0 = time.perf_counter()
        req, n_prompt = self._request(body, ids, max_tokens, images)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        first = [True]

        def on_event(new: list[int], final: Result | None):  # on the driver thread
            if new and first[0]:
                first[0] = False
                self.metrics.ttft.observe(time.perf_counter() - t0)
                self.metrics.prompt_tokens.inc(n_prompt)
            self.metrics.generated.inc(len(new))
            if final is not None:
                self.metrics.finished(final)
            loop.call_soon_threadsafe(queue.put_nowait, (new, final))

        try:
            rid = self.driver.submit(req, on_event)
        except QueueFull as e:
            raise BadRequest(f"server busy: {e}; retry later", 429, "rate_limit_error") from None
        pieces = self._pieces(rid, queue, stop)
        head = dict(id=rid, created=int(time.time()), model=self.model_name)
        if body.stream:
            return StreamingResponse(self._sse(pieces, head, chat), media_type="text/event-stream")
        task = asyncio.ensure_future(self._collect(pieces))
        while not task.done():  # a non-streaming client that goes away cancels its request too
            await asyncio.wait({task}, timeout=0.2)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                self.driver.cancel(rid)
                return Response(status_code=499)
        text, toks, finish = task.result()
        if finish == "error":
            return error(500, "the engine failed while running this request; see the server log", "server_error")
        choice = ({"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None})
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [{"index": 0, **choice, "finish_reason": finish, "token_ids": toks}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(toks),
                          "total_tokens": n_prompt + len(toks)}}

    async def _pieces(self, rid: str, queue: asyncio.Queue, stop: list[str]):
        """(text delta, token ids, finish_reason or None) as tokens arrive; cancels the request when a stop
        string appears or when the consumer goes away (a closed stream)."""
        text, tokens, finished = TextStream(self.tok, stop), [], False
        try:
            while True:
                new, final = await queue.get()
                for t in new:  # one token at a time: the ids reported are exactly those up to the stop string
                    tokens.append(t)
                    delta = text.feed(tokens)
                    if text.stopped:
                        self.driver.cancel(rid)
                        finished = True
                        self.metrics.requests.labels("stop").inc()
                        yield delta, [t], "stop"
                        return
                    yield delta, [t], None
                if final is not None:
                    finished = True
                    finish = "error" if final.error else FINISH[final.stop_reason]
                    self.metrics.requests.labels(finish).inc()
                    yield text.feed(tokens, final=True), [], finish
                    return
        finally:
            if not finished:
                self.driver.cancel(rid)
                self.metrics.requests.labels("client_gone").inc()

    @staticmethod
    async def _collect(pieces):
        text, toks, finish = [], [], None
        async for delta, ids, reason in pieces:
            text.append(delta)
            toks += ids
            finish = reason
        return "".join(text), toks, finish

    @staticmethod
    async def _sse(pieces, head: dict, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(delta: str, ids: list[int], finish: str | None, role: bool = False) -> str:
            if chat:
                choice = {"delta": ({"role": "assistant"} if role else {}) | ({"content": delta} if delta else {})}
            else:
                choice = {"text": delta, "logprobs": None}
            return "data: " + json.dumps({**head, "object": kind, "choices": [
                {"index": 0, **choice, "finish_reason": finish, "token_ids": ids}]}) + "\n\n"

        if chat:
            yield event("", [], None, role=True)
        async for delta, ids, finish in pieces:
            if finish == "error":
                yield "data: " + json.dumps({"error": {"message": "the engine failed while running this request; "
                                                       "see the server log", "type": "server_error"}}) + "\n\n"
                return
            yield event(delta, ids, finish)
        yield "data: [DONE]\n\n"
