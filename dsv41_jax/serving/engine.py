"""Many sequences decoding together in the fixed slots of one jitted step, with prefix reuse.

    eng = Engine(cfg, params, EngineConfig(slots=4, capacity=512, cache_dir="/tmp/kv"))
    results = eng.generate([Request(prompt=ids, max_new_tokens=64), ...])

Slots (the HBM tier). The engine owns one batched cache of `slots` rows of `capacity` tokens; every
decode step runs all slots through `decode_step(..., active_b=)`, so requests join and leave without
recompiling. `slots_for_budget` derives the slot count from an HBM byte budget and the measured bytes
of one row (global KV + window rings + state): a slot-based pool rather than a paged one, which keeps
the decode step dense and costs the unused tail of each row. When every slot is busy new requests
wait in a FIFO queue; nothing is evicted from HBM while it is live.

Prefill runs one request at a time on its own row (batch 1, fixed chunk width: one compile per layer
range), in chunks of `prefill_chunk` tokens. It always splits at P = the last page boundary before the
prompt's last token, so the state at P is a reusable prefix:
- *decoder-side bounded prefill* (`bounded_prefill`, on by default): the layers up to the last kv
  source (`plan.encoder_depth`) run on every prompt token, so the global KV is exact; the D layers
  after it, which publish no global KV, run only on [P - W, n) (W = window_size, n the prompt length:
  the last window before P and the at most one page after it), their window rings starting empty at
  P - W (`Cache.window_start`), the approximation bounded replay makes. The state at P then depends
  on the prefix alone, so the host tier can hold it, and a host hit on P continues exactly like the
  cold run (a longer prompt whose own P' - W lies before a restored prefix keeps the restored rings,
  which have seen more than W tokens). It is exact, bit for bit, when the last token's dependency
  cone fits, n - (P - W) >= D (W - 1) + 1 (tiny: 46 tokens); otherwise it drifts (released: D = 19,
  a 2,414-token cone, so always): measured by `experiments.prefix_reuse`, bounded in
  tests/test_engine.py. bounded_prefill=False runs every layer on every token.
- after [0, P) the pages of global KV and the window rings at P go to the tiers, and a later prompt
  that starts with cached pages restores the state at its prefix from them, exactly (with the window)
  or by bounded replay: the protocol is `PrefixCache`'s (serving/prefix_cache.py), the engine runs the
  model work it asks for.

Decode calls are queued (plain decoding): each `step` dispatches the next `decode_chunk`-step call before it
reads the previous call's tokens back, so the host's work between calls (reading tokens, finishing requests,
the next launch) overlaps the device's. A slot's next call starts from its previous call's last token, count
and remaining budget, computed on the device (`_carry`); the host reads those tokens one step later, so a
request's tokens stream one call behind, and a slot whose request finished in a call is freed (and admits the
next request) one call later. Tokens are exactly those of a call at a time (tests/test_engine.py).

Speculative decoding (`EngineConfig.speculative="dspark"`, a model with DSpark stages): each compiled
decode call runs `decode_chunk` draft-verify steps (`api.speculative_generate`) instead of plain steps,
emitting 1 to dspark_block_size + 1 tokens per step; at temperature 0 the tokens are exactly the plain
engine's. Each slot has its draft rings beside its cache row; a prompt's tail after its last page
boundary is prefilled with `api.speculative_prefill`, which fills them, and the decode keeps them
filled (the rings of a slot start from that tail, so the first drafts after a long prompt see fewer
tokens than `experiments.decode --speculative` gives them). Text prompts only.

On a mesh (`EngineConfig.mesh`, e.g. "data=2,expert=4", and `layout`): the params are placed by the layout's
rules (`sharding.shard_model`), the slots' cache is split over the layout's sequence axes (so they must divide
the slot count), and each decode call runs there (`api`'s `placement=`). A request is prefilled on its own
batch-1 row, which no axis can split: the row lives on the mesh replicated over the sequence axes
(`partitioning.place_row`; the routed experts still split its tokens), and `put_row` moves it into its slot's
shard. Images too (their tower runs on the mesh's params), and DSpark steps (the draft rings split like the
cache's window rings).

Images (`Request.images`, each a `dsv41_jax.images.PreparedImage`; the prompt holds one
`image_token_id` placeholder per image): the prompt is expanded to its image spans, each image is
encoded once per request, and every chunk (replay included) gets the rows of the spans that reach it,
so spans may straddle chunks and pages. Page and window keys hash each image's content digest with
the blocks its span reaches (`tiers.keys.block_chain`): two prompts whose ids are equal but whose
images differ never share a page or a window; the same image again reuses them.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from dsv41_jax import api, partitioning, sharding
from dsv41_jax.cache import Cache, cache_bytes, init_cache
from dsv41_jax.compile_notice import compiling
from dsv41_jax.config import ModelConfig
from dsv41_jax.images import expand_prompt
from dsv41_jax.plan import build_plan, encoder_depth
from dsv41_jax.sampling import sample
from dsv41_jax.serving import slots as rows
from dsv41_jax.serving.prefix_cache import PrefixCache, full_ratios


def slot_bytes(cfg: ModelConfig, capacity: int) -> int:
    """Measured bytes of one slot row (every cache array, from the abstract cache)."""
    return sum(cache_bytes(jax.eval_shape(lambda: init_cache(cfg, 1, capacity))).values())


def slots_for_budget(cfg: ModelConfig, capacity: int, budget_bytes: int, max_slots: int = 256) -> int:
    per = slot_bytes(cfg, capacity)
    n = min(max_slots, budget_bytes // per)
    if n < 1:
        raise ValueError(f"an HBM budget of {budget_bytes:,d} B holds no slot: one sequence of capacity {capacity} "
                         f"needs {per:,d} B; raise the budget or lower the capacity")
    return int(n)


def plan_slots(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """The slot count an engine of `ecfg` gets for `cfg`; ValueError saying what to change when it cannot
    serve it. Cheap (no weights, nothing allocated): callers can check settings before the slow setup."""
    lcm = math.lcm(*full_ratios(cfg))  # 1 without Full layers
    if ecfg.page_tokens < 1 or ecfg.page_tokens % lcm:
        raise ValueError(f"page_tokens={ecfg.page_tokens} must be a positive multiple of every compression ratio "
                         f"(lcm {lcm}) so a page ends on complete groups")
    if ecfg.capacity < 2 or ecfg.prefill_chunk < 1:
        raise ValueError(f"need capacity >= 2 and prefill_chunk >= 1, got {ecfg.capacity}, {ecfg.prefill_chunk}")
    if ecfg.capacity > cfg.max_seq_len:
        raise ValueError(f"capacity={ecfg.capacity} exceeds the model's max_seq_len={cfg.max_seq_len}")
    if ecfg.speculative not in (None, "dspark"):
        raise ValueError(f"speculative must be None or 'dspark', got {ecfg.speculative!r}")
    if ecfg.speculative and not cfg.has_dspark:
        raise ValueError("speculative='dspark' needs a model with DSpark draft stages (n_mtp_layers and "
                         "dspark_block_size > 0); this config has none")
    split = slot_split(cfg, ecfg) if ecfg.mesh else 1
    n = ecfg.slots or split * slots_for_budget(cfg, ecfg.capacity, ecfg.hbm_budget_bytes or 1 << 30)
    if n % split:
        raise partitioning.MeshError(f"slots={n}: layout {ecfg.layout} splits the slots over {split} devices of "
                                     f"mesh {ecfg.mesh}; use a multiple of {split} slots")
    return n


def slot_split(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """Over how many devices the mesh splits the slots (the layout's sequence axes); MeshError for a mesh the
    engine cannot serve on, saying what to change. With a budget, hbm_budget_bytes is per device."""
    sizes = partitioning.parse_mesh(ecfg.mesh)
    partitioning.check_mesh(cfg, sizes, layout=ecfg.layout)
    return math.prod(sizes.get(a, 1) for a in partitioning.batch_axes(ecfg.layout))


@dataclass
class EngineConfig:
    slots: int | None = None  # None: from hbm_budget_bytes
    hbm_budget_bytes: int | None = None  # per device (on a mesh: per device of the slots' split)
    capacity: int = 512  # tokens per slot (prompt + generated)
    prefill_chunk: int = 256
    page_tokens: int = 64  # a multiple of every compression ratio
    cache_dir: str | None = None  # None: no disk tier (and so no prefix reuse)
    retention_s: float = 72 * 3600
    host_pool_bytes: int | None = None  # None: 10% of host memory
    host_ttl_s: float = 300.0
    window_store: str | None = None  # redis://..., unix:///socket or mooncake://master: a pool shared by engines
    prefix_reuse: bool = True
    replay: bool = True  # bounded replay of the last window on a disk hit without window state
    bounded_prefill: bool = True  # decoder-side bounded prefill (see the module docstring)
    weights_revision: str | None = None  # None: a digest of the parameter bytes
    kernels: str = "jnp"
    decode_chunk: int = 8  # decode steps per compiled call (api.generate); requests join between calls
    speculative: str | None = None  # "dspark": draft-verify decode steps (module docstring)
    progress: bool = True  # chunk bars and "compiling ..." notices on stderr
    mesh: str | None = None  # "data=2,expert=4": run on a device mesh (module docstring); None: one device
    layout: str = "tp_ep"  # the mesh's sharding rules (partitioning.LAYOUTS)


@dataclass
class Request:
    prompt: list | np.ndarray
    max_new_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    stop_tokens: tuple = ()
    id: str | None = None
    # PreparedImage per `image_token_id` placeholder of the prompt, in order; without images the prompt is
    # text, whatever ids it holds (random-id prompts may contain the image token id)
    images: tuple = ()


@dataclass
class Result:
    id: str
    tokens: list = field(default_factory=list)
    error: str | None = None
    stop_reason: str | None = None
    metrics: dict = field(default_factory=dict)
    first_logits: np.ndarray | None = None  # f32 [V] that chose the first token (for drift checks)


@dataclass
class _Live:
    req: Request
    res: Result
    prompt: np.ndarray
    t_submit: float
    t_first: float = 0.0
    spans: list = field(default_factory=list)  # ImageSpan of each image in `prompt`


@dataclass
class _Call:
    """A dispatched decode call whose tokens the host has not read yet: its outputs and per-slot inputs on the
    device, and the request each slot held when it was dispatched."""
    toks: jax.Array  # int32 [B, n]
    emitted: jax.Array  # bool [B, n]
    tok: jax.Array  # int32 [B]: the tokens it fed first
    count: jax.Array  # int32 [B]: tokens each slot had sampled before it (its sampling step)
    remain: jax.Array  # int32 [B]: tokens each slot could still sample before it (0: idle)
    slots: dict  # slot -> _Live


@jax.jit
def _carry(carried_b, tok_b, count_b, remain_b, toks, emitted, tok, count, remain):
    """The next call's (newest token, sampled tokens, tokens it may still sample) per slot: the host's values
    (the first three [B]), and for the slots `carried_b` (bool [B]) that the previous call ran for the same
    request, that call's outcome from its outputs and inputs (as `_Call` holds them), computed on the device
    without reading anything back. (A request that ended in that call on a stop id has budget left here: its
    slot samples on for one more call, whose tokens `_collect` drops.)"""
    n_em = emitted.sum(axis=1, dtype=jnp.int32)
    last = jnp.take_along_axis(toks, jnp.maximum(n_em - 1, 0)[:, None], axis=1)[:, 0]
    after = (jnp.where(n_em > 0, last, tok), count + n_em, remain - n_em)
    return tuple(jnp.where(carried_b, a, h) for a, h in zip(after, (tok_b, count_b, remain_b)))


class Engine:
    def __init__(self, cfg: ModelConfig, params, ecfg: EngineConfig | None = None):
        ecfg = EngineConfig() if ecfg is None else ecfg
        self.cfg, self.ecfg = cfg, ecfg
        self.n_slots = plan_slots(cfg, ecfg)
        # where the slots' cache and a prefill row live (None: one device)
        self.placement = self._row_placement = None
        if ecfg.mesh:
            mesh = partitioning.make_mesh(cfg, ecfg.mesh, layout=ecfg.layout)
            model = sharding.shard_model(cfg, params, mesh, ecfg.layout, batch=self.n_slots)
            params, self.placement = model.params, model.placement
            self._row_placement = partitioning.place_row(cfg, params, mesh, ecfg.layout)
        # frozen: the engine passes its params to a jitted call per step chunk (api.freeze says why)
        self.params = api.freeze(params)
        self.cache = (self.placement.new_cache(cfg, ecfg.capacity) if self.placement
                      else init_cache(cfg, self.n_slots, ecfg.capacity))
        self.window = None
        if ecfg.speculative:  # the draft rings, made on the mesh with one (each device its own shards)
            self.window = self.placement.new_window(cfg) if self.placement else api.init_draft_window(cfg, self.n_slots)
        self._window_row = None  # speculative: the draft rings the last prefill filled (batch 1)
        self._empty_row = rows.to_host(rows.take_row(self.cache, 0))
        self.encoder_depth = encoder_depth(build_plan(cfg))
        # the tiers below HBM (None: no cache_dir, no prefix reuse)
        self.prefix = PrefixCache(cfg, self.params.state, ecfg, self._empty_row) if ecfg.cache_dir else None
        self.live: dict[int, _Live] = {}
        self.queue: list[_Live] = []
        self.done: list[Result] = []
        self._n = 0
        self._inflight: _Call | None = None  # the decode call dispatched by the last step, not read yet

    # ------------------------------------------------------------------ requests
    def validate(self, req: Request) -> np.ndarray:
        """The prompt as int32 [n] (image placeholders expanded to their spans), or ValueError saying what
        is wrong with the request."""
        return self._checked(req)[0]

    def _checked(self, req: Request) -> tuple[np.ndarray, list]:
        """(prompt int32 [n] with its image spans expanded, the spans), or ValueError (see `validate`)."""
        p = np.asarray(req.prompt)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"empty prompt (shape {p.shape}): give at least one token id")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompt must be integer token ids, got dtype {p.dtype}")
        v = self.cfg.vocab_size
        if p.min() < 0 or p.max() >= v:
            raise ValueError(f"prompt has ids outside [0, {v}): min {p.min()}, max {p.max()}")
        spans = []
        if req.images:
            if not self.cfg.vision_n_layers:
                raise ValueError("this model has no vision tower (vision_n_layers == 0): it cannot take images")
            p, spans = expand_prompt(p, list(req.images), self.cfg)
        if not isinstance(req.max_new_tokens, (int, np.integer)) or req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        if self.ecfg.speculative and spans:
            raise ValueError("speculative decoding takes text prompts only; run an engine without speculative "
                             "for requests with images")
        spare = self.cfg.dspark_block_size if self.ecfg.speculative else 0  # a verify appends a whole block
        if p.size + req.max_new_tokens + spare > self.ecfg.capacity:
            raise ValueError(f"request too long: {p.size} prompt + {req.max_new_tokens} new tokens"
                             f"{f' + {spare} for a speculative block' if spare else ''} exceeds the slot capacity of "
                             f"{self.ecfg.capacity}; shorten it or run the engine with a larger capacity")
        t = req.temperature
        if not isinstance(t, (int, float, np.floating)) or not np.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if any(not (0 <= int(s) < v) for s in req.stop_tokens):
            raise ValueError(f"stop tokens must be ids in [0, {v}), got {list(req.stop_tokens)}")
        return p.astype(np.int32), spans

    def submit(self, req: Request) -> str:
        """Queue a request; raises ValueError (and queues nothing) when it is malformed."""
        prompt, spans = self._checked(req)
        rid = req.id or f"req{self._n}"
        self._n += 1
        self.queue.append(_Live(req, Result(rid), prompt, time.perf_counter(), spans=spans))
        return rid

    def generate(self, requests: list[Request]) -> list[Result]:
        """Run requests to completion; malformed ones get Result.error and do not disturb the others."""
        order = []
        for r in requests:
            try:
                order.append(self.submit(r))
            except ValueError as e:
                rid = r.id or f"req{self._n}"
                self._n += 1
                self.done.append(Result(rid, error=str(e)))
                order.append(rid)
        while self.queue or self.live:
            self.step()
        by_id = {r.id: r for r in self.done}
        return [by_id[i] for i in order]

    def running(self) -> list[Result]:
        """The results of the requests in slots: their `tokens` grow as `step` emits, so a server can
        stream them before the request finishes."""
        return [lv.res for lv in self.live.values()]

    def cancel(self, rid: str) -> bool:
        """Finish request `rid` now with stop_reason "cancelled" (its slot is free for the next `step`),
        or drop it from the queue; False when it is neither live nor queued (already finished)."""
        for slot, lv in self.live.items():
            if lv.res.id == rid:
                self._finish(slot, "cancelled")
                return True
        for i, lv in enumerate(self.queue):
            if lv.res.id == rid:
                del self.queue[i]
                lv.res.stop_reason = "cancelled"
                self.done.append(lv.res)
                return True
        return False

    def drain(self) -> list[Result]:
        """The finished results since the last call, removed from `done` (a long-running server would
        otherwise keep every result it ever produced)."""
        out, self.done = self.done, []
        return out

    # ------------------------------------------------------------------ scheduling
    def step(self) -> None:
        """Admit waiting requests into free slots (prefill), dispatch `decode_chunk` decode steps for all live
        slots in one compiled call (`api.generate`: sampling and stops on device, the cache donated), then read
        back and emit the tokens of the call the previous step dispatched (module docstring: queued calls)."""
        free = [s for s in range(self.n_slots) if s not in self.live]
        while free and self.queue:
            self._admit(self.queue.pop(0), free.pop(0))
        if self.ecfg.speculative:
            if self.live:
                self._speculative_chunk(*self._host_inputs())
            return
        prev, self._inflight = self._inflight, self._dispatch(self._inflight) if self.live else None
        if prev is not None:
            self._collect(prev)

    def _host_inputs(self):
        """Per-slot inputs of a decode call from the host's view of the live requests: (newest token,
        temperature, seed, sampled tokens, tokens left to sample, stop ids [B, S] -1 padded); idle slots
        have nothing left to sample."""
        b = self.n_slots
        tok, budget = np.zeros(b, np.int32), np.zeros(b, np.int32)
        temp, seed, count = np.zeros(b, np.float32), np.zeros(b, np.uint32), np.zeros(b, np.int32)
        width = max([4] + [len(lv.req.stop_tokens) for lv in self.live.values()])
        stops = np.full((b, 1 << (width - 1).bit_length()), -1, np.int32)  # few widths: few compiles
        for s, lv in self.live.items():
            tok[s], budget[s] = lv.res.tokens[-1], lv.req.max_new_tokens - len(lv.res.tokens)
            temp[s], seed[s], count[s] = lv.req.temperature, lv.req.seed, len(lv.res.tokens)
            stops[s, :len(lv.req.stop_tokens)] = lv.req.stop_tokens
        return tok, temp, seed, count, budget, stops

    def _dispatch(self, prev: _Call | None) -> _Call:
        """Queue a decode call for the live slots, nothing read back: a slot that `prev` ran for the same
        request starts from prev's outcome on the device (`_carry`), the others from the host's view."""
        n = self.ecfg.decode_chunk
        tok, temp, seed, count, remain, stops = self._host_inputs()
        carried = np.zeros(self.n_slots, bool)
        if prev is not None:
            carried[[s for s, lv in self.live.items() if prev.slots.get(s) is lv]] = True
        if carried.any():
            tok, count, remain = _carry(carried, tok, count, remain, prev.toks, prev.emitted, prev.tok, prev.count,
                                        prev.remain)
        b = self.n_slots
        with compiling(("decode", self.cfg, b, n, stops.shape[1], self.ecfg.capacity, self.ecfg.kernels,
                        self.placement),
                       f"decode [B={b}, capacity={self.ecfg.capacity}, {n} steps per call]", self.ecfg.progress):
            toks, emitted, self.cache = api.generate(self.cfg, self.params, self.cache, tok, n, temperature_b=temp,
                                                     seed_b=seed, step_b=count, budget_b=jnp.minimum(remain, n),
                                                     stop_ids_bs=stops, kernels=self.ecfg.kernels, validate=False,
                                                     placement=self.placement)
        return _Call(toks, emitted, *(jnp.asarray(a) for a in (tok, count, remain)), dict(self.live))

    def _collect(self, call: _Call) -> None:
        """Read a call's tokens back and emit them for the slots that still hold the request they held when
        it was dispatched (a cancelled or finished request's slot may have taken another since)."""
        toks, emitted = np.asarray(call.toks), np.asarray(call.emitted)
        for s, lv in call.slots.items():
            for t in toks[s][emitted[s]]:  # the device stopped each sequence where _emit finishes it
                if self.live.get(s) is not lv:
                    break
                self._emit(s, int(t))

    def _speculative_chunk(self, tok, temp, seed, count, budget, stops) -> None:
        """`decode_chunk` DSpark steps for all live slots (`api.speculative_generate`), their tokens emitted."""
        b, n, k = self.n_slots, self.ecfg.decode_chunk, self.cfg.dspark_block_size
        with compiling(("speculative", self.cfg, b, n, stops.shape[1], self.ecfg.capacity, self.ecfg.kernels,
                        self.placement),
                       f"speculative decode [B={b}, capacity={self.ecfg.capacity}, {n} steps per call]",
                       self.ecfg.progress):
            toks, n_out, accepted, _, self.cache, self.window = api.speculative_generate(
                self.cfg, self.params, self.cache, self.window, tok, n, temperature_b=temp, seed_b=seed,
                step_b=count, budget_b=np.minimum(budget, n * (k + 1)), stop_ids_bs=stops, kernels=self.ecfg.kernels,
                placement=self.placement)
        toks, n_out, accepted = np.asarray(toks), np.asarray(n_out), np.asarray(accepted)
        for s in list(self.live):
            m = self.live[s].res.metrics
            steps = n_out[s] > 0
            m["speculative_steps"] = m.get("speculative_steps", 0) + int(steps.sum())
            m["accepted_drafts"] = m.get("accepted_drafts", 0) + int(accepted[s][steps].sum())
            for i in np.flatnonzero(steps):
                for t in toks[s, i, :n_out[s, i]]:
                    if s in self.live:  # the device emits nothing past a stop or the budget
                        self._emit(s, int(t))

    def _emit(self, slot: int, token: int) -> None:
        lv = self.live[slot]
        lv.res.tokens.append(token)
        reason = None
        if token in lv.req.stop_tokens:
            reason = "stop_token"
        elif len(lv.res.tokens) >= lv.req.max_new_tokens:
            reason = "max_new_tokens"
        if reason:
            self._finish(slot, reason)

    def _finish(self, slot: int, reason: str) -> None:
        lv = self.live.pop(slot)
        now = time.perf_counter()
        m = lv.res.metrics
        n = len(lv.res.tokens)
        m.update(generated_tokens=n, total_s=now - lv.t_submit,
                 decode_tokens_per_s=(n - 1) / (now - lv.t_first) if n > 1 and now > lv.t_first else float("nan"))
        if m.get("speculative_steps"):  # tokens per verify step: accepted drafts + the target's own token
            m["acceptance_length"] = (n - 1) / m["speculative_steps"]
        lv.res.stop_reason = reason
        self.done.append(lv.res)

    # ------------------------------------------------------------------ prefill and prefix reuse
    def _chunks(self, row: Cache, ids: np.ndarray, lo: int, hi: int, desc: str, layers: int | None = None, enc=()):
        """Prefill tokens [lo, hi) of ids onto a device row in fixed-width chunks through the first `layers`
        layers (None: all), with the encoded image spans `enc`; (logits [1, V] | None, row)."""
        cw, logits = self.ecfg.prefill_chunk, None
        n_chunks = len(range(lo, hi, cw))
        if not n_chunks:
            return logits, row
        chunks = api.prefill_chunks(self.cfg, self.params, row, ids[None], lo, hi, cw, layers=layers,
                                    kernels=self.ecfg.kernels, images=[list(enc)] if enc else None,
                                    placement=self._row_placement)
        part = "" if layers in (None, self.cfg.n_layers) else f", layers 0-{layers - 1}"
        with compiling(("prefill", self.cfg, cw, self.ecfg.capacity, layers, self.ecfg.kernels, bool(enc),
                        self._row_placement),
                       f"prefill [B=1, T={cw}{part}{', images' if enc else ''}]", self.ecfg.progress):
            _, _, logits, row = next(chunks)
        # the bar starts after the compile, so its rate and ETA are the chunks'
        for chunk_out in tqdm(chunks, total=n_chunks - 1, desc=desc, unit="chunk", file=sys.stderr,
                              leave=False, disable=not self.ecfg.progress or n_chunks < 8):
            _, _, logits, row = chunk_out
        return logits, row

    def prefill(self, ids: np.ndarray, spans=()) -> tuple[jax.Array, Cache, dict]:
        """Prefill one prompt (int32 [n], image spans `spans` expanded in it) through the tiers: (logits f32
        [1, V] at its last token, its device row (a batch-1 `Cache`), metrics). Reads and writes the tiers
        as a request does; occupies no slot.

        Metrics: prefix_path (how the state at the cached prefix was obtained: "cold", nothing usable cached;
        "host_restore", pages + window from the host pool, exact; "bounded_replay", pages + the last window
        recomputed, approximate; "recompute", pages found but unused, replay being off), reused_tokens
        (restored from the tiers), replayed_tokens, prefilled_tokens (run through
        the layers up to the last kv source, replay included), decoder_prefill_tokens (run through the
        layers after it), and what each tier read and wrote.
        """
        pt, n, m = self.ecfg.page_tokens, ids.size, {}
        split = (n - 1) // pt * pt  # the last page boundary before the last prompt token
        keys = self.prefix.keys(ids[:split], spans) if self.prefix else []
        m.update(prompt_tokens=int(n), prefix_path="cold", disk_pages_hit=0, host_window_hit=False, replayed_tokens=0,
                 disk_bytes_read=0, disk_bytes_written=0, host_bytes_read=0, host_bytes_written=0,
                 image_tokens=int(sum(s.image.n_tokens for s in spans)))
        enc = api.encode_spans(self.cfg, self.params, spans) if spans else []  # once per request
        row, start, exact = None, 0, True
        if self.prefix:
            def replay(dev: Cache, lo: int, hi: int) -> Cache:
                return self._chunks(dev, ids, lo, hi, "replay", enc=enc)[1]

            row, start, exact = self.prefix.restore(ids, keys, m, replay, enc)
        if row is None:
            row = (self._row_placement.put_cache(self._empty_row) if self._row_placement
                   else jax.device_put(self._empty_row))
        m["reused_tokens"] = start
        mid = self._decoder_start(start, split)
        _, row = self._chunks(row, ids, start, mid, "prefill", layers=self.encoder_depth, enc=enc)
        _, row = self._chunks(row, ids, mid, split, "prefill", enc=enc)
        if self.prefix and exact and split > start:
            self.prefix.publish(row, ids, keys, start, split, m)
        if self.ecfg.speculative:
            logits, row, self._window_row = self._speculative_tail(row, ids, split, n)
        else:
            logits, row = self._chunks(row, ids, split, n, "prefill", enc=enc)
        m["prefilled_tokens"] = int(n - start) + m["replayed_tokens"]
        m["decoder_prefill_tokens"] = int(n - mid) + m["replayed_tokens"]
        return logits, row, m

    def _speculative_tail(self, row: Cache, ids: np.ndarray, lo: int, hi: int):
        """Prefill tokens [lo, hi) (>= 1 of them) with `api.speculative_prefill` in fixed-width chunks, filling
        fresh draft rings: (logits [1, V], row, the rings of batch 1)."""
        cw, window = self.ecfg.prefill_chunk, api.init_draft_window(self.cfg, 1)
        for a in range(lo, hi, cw):
            t = np.zeros((1, cw), np.int32)
            t[0, :min(cw, hi - a)] = ids[a:min(a + cw, hi)]
            with compiling(("spec_prefill", self.cfg, cw, self.ecfg.capacity, self.ecfg.kernels, self._row_placement),
                           f"speculative prefill [B=1, T={cw}]", self.ecfg.progress):
                logits, row, window = api.speculative_prefill(self.cfg, self.params, row, window, t,
                                                              np.array([min(cw, hi - a)], np.int32),
                                                              kernels=self.ecfg.kernels,
                                                              placement=self._row_placement)
        return logits, row, window

    def _decoder_start(self, start: int, split: int) -> int:
        """First token the layers after the last kv source run on, when the prompt's new tokens are
        [start, n) and the state is published at `split`: split - W with bounded prefill, else start."""
        if not self.ecfg.bounded_prefill or self.encoder_depth == self.cfg.n_layers:
            return start
        return max(start, split - self.cfg.window_size)

    def _admit(self, lv: _Live, slot: int) -> None:
        t0 = time.perf_counter()
        logits, row, m = self.prefill(lv.prompt, lv.spans)
        m = lv.res.metrics = {"queue_s": t0 - lv.t_submit, **m}
        self.cache = rows.put_row(self.cache, slot, row)
        if self.window is not None:
            self.window = rows.put_window_row(self.window, slot, self._window_row)
        first = int(np.asarray(sample(logits, jnp.asarray([lv.req.temperature], jnp.float32),
                                      jnp.asarray([lv.req.seed], jnp.uint32), jnp.zeros(1, jnp.int32)))[0])
        lv.t_first = time.perf_counter()
        lv.res.first_logits = np.asarray(logits[0])
        m.update(ttft_s=lv.t_first - lv.t_submit, prefill_s=lv.t_first - t0)
        self.live[slot] = lv
        self._emit(slot, first)
