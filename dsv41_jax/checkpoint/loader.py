"""Load a DeepSeek-V4.1 checkpoint directory (as released, or an HF float export) into our params.

    loaded = load_checkpoint("DeepSeek-V4.1-Flash/")           # FP8/FP4 kept, dequantized in compute
    logits, cache = prefill(loaded.cfg, loaded.params, init_cache(loaded.cfg, 1, 4096), ids, lens)

Order of work: read config.json and every safetensors header; check every tensor the model needs
against what is there (missing, unexpected, wrong shape, wrong dtype, all reported together in one
CheckpointError before a payload byte is read); then stream shard by shard, tensor by tensor, each
one converted on the host and handed to the device on its own. Routed experts are stacked per layer
in a host buffer that is released as soon as its last expert arrives.

`engram_on_host=True` leaves the Engram tables (and their scales) in host memory: they are mapped
from their shards (`np.memmap`, no read buffer) and put in the `pinned_host` memory of the device
(or of the sharding given for them); `Engram.lookup` then gathers their rows on the host inside the
jitted step. The released tables are ~190 GiB: this is how they stay out of HBM.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dsv41_jax import kernels, quant
from dsv41_jax.api import abstract_params
from dsv41_jax.checkpoint.config import with_formats
from dsv41_jax.checkpoint.layout import Entry, entries, expected_tensors, skip_reason, to_released_name
from dsv41_jax.checkpoint.safetensors_io import TensorInfo, list_checkpoint, map_tensor, read_tensor
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram import HOST_MEMORY_KIND
from dsv41_jax.pytree_paths import flat_params, unflatten_like
from dsv41_jax.engram_vocab import engram_token_map

Shardings = Mapping[str, jax.sharding.Sharding] | Callable[[str, tuple], jax.sharding.Sharding] | None


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; `problems` lists every mismatch by tensor name."""

    def __init__(self, directory, problems: list[str]):
        self.directory, self.problems = directory, problems
        shown = "\n  ".join(problems[:200])
        more = f"\n  ... and {len(problems) - 200} more" if len(problems) > 200 else ""
        super().__init__(f"{directory}: {len(problems)} problem(s), nothing was loaded:\n  {shown}{more}\n"
                         "Check that config.json belongs to these weights and that every shard downloaded "
                         "completely.")


@dataclass
class Inventory:
    """The outcome of checking a tensor listing against the config (no payload read)."""

    scheme: str  # "released" | "hf"
    quantized: bool
    problems: list[str]
    notes: list[str]
    names: dict[str, str] = field(default_factory=dict)  # released name -> name in the checkpoint


def check_tensors(cfg: ModelConfig, listing: Mapping[str, tuple[str, tuple[int, ...]]]) -> Inventory:
    """Check a checkpoint's tensor listing {name: (safetensors dtype, shape)} against `cfg`.

    Accepts both naming schemes and both storage forms (see layout.py); reports every missing,
    unexpected, mis-shaped and mis-typed tensor.
    """
    names, schemes, problems, skipped = {}, set(), [], defaultdict(int)
    for name in listing:
        released, scheme = to_released_name(name)
        schemes.add(scheme)
        names[released] = name
    scheme = "hf" if schemes == {"hf"} else "released"
    if len(schemes) > 1:
        problems.append("names mix the released scheme and HF's `model.` prefix; use one scheme throughout")
    quantized = any(dt in ("F8_E4M3", "I8") for dt, _ in listing.values())
    expected = expected_tensors(cfg, quantized)
    for released, ckpt_name in sorted(names.items()):
        want = expected.get(released)
        dtype, shape = listing[ckpt_name]
        if want is None:
            why = skip_reason(released)
            if why is None:
                problems.append(f"{ckpt_name}: unexpected tensor {dtype}{list(shape)} (the config has no place for it)")
            else:
                skipped[why] += 1
            continue
        if tuple(shape) != want.shape:
            problems.append(f"{ckpt_name}: shape {list(shape)}, expected {list(want.shape)}")
        if dtype not in want.dtypes:
            form = "quantized (FP8/FP4 as released)" if quantized else "all-float"
            problems.append(f"{ckpt_name}: dtype {dtype}, expected one of {list(want.dtypes)} in a {form} checkpoint")
    for released, want in expected.items():
        if released not in names and not want.optional:
            prefix = "model." if scheme == "hf" else ""
            shown = "lm_head.weight" if scheme == "hf" and released == "head.weight" else prefix + released
            problems.append(f"{shown}: missing ({'/'.join(want.dtypes)}{list(want.shape)})")
    notes = [f"skipped {n} tensor(s): {why}" for why, n in skipped.items()]
    return Inventory(scheme, quantized, problems, notes, names)


# ----------------------------------------------------------------------------- conversions (host)
def _e8m0(exp: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float32(1), exp.astype(np.int32) - 127).astype(np.float32)


def _dequant_dense(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    o, i = w.shape
    scale = np.repeat(np.repeat(_e8m0(s), 32, axis=0)[:o], 32, axis=1)[:, :i]
    return w.astype(np.float32) * scale


def _dequant_fp4(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    """I8/U8 [out, in/2] (even element in the low nibble) x E8M0 [out, in/32] -> f32 [out, in]."""
    b = packed.view(np.uint8)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)
    vals = quant.FP4_VALUES[codes]
    return vals * np.repeat(_e8m0(s), 32, axis=1)


def _dequant_rows(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    return w.astype(np.float32) * np.repeat(_e8m0(s), 32, axis=1)


class _Sink:
    """Receives converted host arrays by param path and puts them on the device, one at a time."""

    def __init__(self, abstract: dict[str, jax.ShapeDtypeStruct], shardings: Shardings,
                 host_paths: frozenset[str] = frozenset()):
        self.abstract, self.shardings, self.values = abstract, shardings, {}
        self.host_paths = host_paths  # params placed in host memory (HOST_MEMORY_KIND)
        self.stacks: dict[str, tuple[np.ndarray, set]] = {}

    def _sharding(self, path, shape):
        if self.shardings is None:
            s = None
        elif callable(self.shardings):
            s = self.shardings(path, shape)
        else:
            s = self.shardings.get(path)
        if path in self.host_paths:
            s = host_sharding(s)
        return s

    def put(self, path: str, arr: np.ndarray) -> None:
        want = self.abstract[path]
        if tuple(arr.shape) != tuple(want.shape):
            raise AssertionError(f"internal: {path} converted to {arr.shape}, param is {want.shape}")
        arr = np.asarray(arr).astype(want.dtype, copy=False)
        s = self._sharding(path, want.shape)
        self.values[path] = jax.device_put(arr, s) if s is not None else jax.device_put(arr)

    def slot(self, path: str, index: int) -> np.ndarray:
        """Slice `index` of the host buffer of stacked param `path` (allocated on first use)."""
        want = self.abstract[path]
        return self.stacks.setdefault(path, (np.empty(want.shape, want.dtype), set()))[0][index]

    def filled(self, path: str, index: int, n: int, read: np.ndarray | None = None) -> None:
        """Slice `index` of `n` is written (`read`: that slice, as a job that read into it delivers it);
        the stack goes to the device when all are."""
        buf, seen = self.stacks[path]
        seen.add(index)
        if len(seen) == n:
            del self.stacks[path]
            self.put(path, buf)

    def put_slice(self, path: str, index: int, n: int, arr: np.ndarray) -> None:
        self.slot(path, index)[...] = arr
        self.filled(path, index, n)


def host_sharding(s: jax.sharding.Sharding | None = None) -> jax.sharding.Sharding:
    """`s` (default: the default device) with its arrays in host memory; refused where the devices have none."""
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if s is None else s
    for dev in s.device_set:
        kinds = {m.kind for m in dev.addressable_memories()}
        if HOST_MEMORY_KIND not in kinds:
            raise ValueError(f"engram_on_host: device {dev} has no {HOST_MEMORY_KIND!r} memory (it has "
                             f"{sorted(kinds)}); load without engram_on_host on this backend")
    return s.with_memory_kind(HOST_MEMORY_KIND)


@dataclass(frozen=True)
class Job:
    """One checkpoint tensor to read, and what receives it. Jobs run in file order; `deliver` gets the
    array read (for `into` jobs: the filled buffer slice, already in place)."""

    info: TensorInfo
    deliver: Callable[[np.ndarray], None]
    into: Callable[[], np.ndarray] | None = None  # the buffer to read into (a slice of a stacked param)
    mmap: bool = False  # map the tensor from its file instead of reading it (engram_on_host tables)


@dataclass
class _Pair:
    """A quantized weight and its scale, read as two jobs and converted together once both arrived."""

    convert: Callable[[np.ndarray, np.ndarray], None]  # (weight, scale) -> puts the result in the sink
    weight: np.ndarray | None = None
    scale: np.ndarray | None = None

    def got_weight(self, arr: np.ndarray) -> None:
        self.weight = arr
        self._maybe_done()

    def got_scale(self, arr: np.ndarray) -> None:
        self.scale = arr
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.weight is not None and self.scale is not None:
            w, s, self.weight, self.scale = self.weight, self.scale, None, None  # release the buffers
            self.convert(w, s)


@dataclass
class Loaded:
    cfg: ModelConfig
    params: nnx.State
    notes: list[str]
    bytes_read: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9


def read_config(directory: str | Path, **runtime) -> ModelConfig:
    """config.json of a checkpoint directory (HF `text_config` or inference key style) + runtime fields."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs its config.json")
    return with_formats(ModelConfig.from_dict(json.loads(path.read_text())).with_derived_engram(), **runtime)


def load_checkpoint(directory: str | Path, *, dequantize: bool = False, dtype: str = "bfloat16",
                    param_dtype: str | None = None, activation_quant: bool | None = None,
                    index_keys: str = "consistent", quantize_cache: bool = True, shardings: Shardings = None,
                    engram_on_host: bool = False, tokenizer: str | Path | None = None,
                    progress: bool = True) -> Loaded:
    """Load `directory` (config.json, safetensors single file or index + shards, tokenizer.json).

    dequantize: turn FP8/FP4 weights into `param_dtype` floats (default: keep them, `weight_format="fp8"`).
    activation_quant: the release's fp8 mode (inputs of FP8/FP4 projections rounded to FP8); defaults to
    on for a quantized checkpoint, off for a float one.
    shardings: param path -> Sharding (a mapping or a callable(path, shape)); default device otherwise.
    engram_on_host: put the Engram tables and their scales in host memory (`pinned_host`, over the
    devices of their sharding), mapped from the shards rather than read into a buffer; the steps then
    gather table rows on the host (see dsv41_jax.engram). Everything else is placed as usual.
    Raises CheckpointError listing every problem before any payload is read.
    """
    directory = Path(directory)
    cfg, tensors, inv, problems = _inventory(directory)
    token_map = None
    if cfg.engram_layer_ids:
        tok_path = Path(tokenizer) if tokenizer else directory / "tokenizer.json"
        if not tok_path.exists():
            problems.append(f"{tok_path}: missing; Engram hashes token ids through the compressed vocabulary "
                            "derived from the tokenizer, so tokenizer.json must sit next to the weights")
        else:
            try:
                token_map = engram_token_map(tok_path, cfg.vocab_size, cfg.engram_compressed_vocab_size)
            except ValueError as e:
                problems.append(str(e))
    if problems:
        raise CheckpointError(directory, problems)

    cfg = _formats(cfg, tensors, inv, dequantize=dequantize, dtype=dtype, param_dtype=param_dtype,
                   activation_quant=activation_quant, index_keys=index_keys, quantize_cache=quantize_cache)
    state = abstract_params(cfg)
    abstract = flat_params(state)
    tables = [e.param for e in entries(cfg) if e.kind == "table"]
    host_paths = frozenset(p for t in tables for p in (t, t + "_scale") if p in abstract) if engram_on_host \
        else frozenset()
    sink = _Sink(abstract, shardings, host_paths)
    for path in sorted(host_paths):
        sink._sharding(path, abstract[path].shape)  # no host memory here: refuse before reading anything

    # one job per checkpoint tensor; scales travel with their weights
    tensor = {released: tensors[name] for released, name in inv.names.items()}
    jobs = [job for e in entries(cfg)
            for job in _entry_jobs(e, tensor, sink, inv.quantized, cfg.weight_format == "fp8",
                                   mmap=e.param in host_paths)]
    if token_map is not None:
        sink.put("engram_token_map", token_map)

    total = sum(job.info.nbytes for job in jobs)
    jobs.sort(key=lambda j: (str(j.info.file), j.info.begin))  # shard by shard, sequential reads
    bar = None
    if progress:
        try:
            from tqdm import tqdm
        except ImportError:  # a bare runtime without tqdm: load silently rather than fail
            tqdm = None
    if progress and tqdm is not None:
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading {directory.name}")
    t0 = time.perf_counter()
    for job, arr in _prefetch(jobs):
        job.deliver(arr)
        if bar is not None:
            bar.update(job.info.nbytes)
    jax.block_until_ready(list(sink.values.values()))
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    missing = sorted(set(abstract) - set(sink.values))
    if missing:
        raise AssertionError(f"internal: the layout left params unfilled: {missing[:10]}")
    notes = list(inv.notes)
    wide = kernels.scales_beyond_fast_decode(sink.values)
    if wide:
        notes.append(f"{len(wide)} weight(s) with E8M0 scales beyond the GPU weight kernels' bf16 decode (e.g. "
                     f"{wide[0]}): run bf16 decode with kernels='jnp' on this checkpoint")
        warnings.warn(notes[-1], stacklevel=2)
    return Loaded(cfg, unflatten_like(state, sink.values), notes, total, seconds)


def loaded_config(directory: str | Path, *, dequantize: bool = False, dtype: str = "bfloat16",
                  param_dtype: str | None = None, activation_quant: bool | None = None, index_keys: str = "consistent",
                  quantize_cache: bool = True) -> ModelConfig:
    """The config `load_checkpoint(directory, ...)` (same keywords) returns, from config.json and the safetensors
    headers alone: whether the weights stay FP8/FP4, their dtype (e.g. to plan memory before reading any). Raises
    CheckpointError as `load_checkpoint` would for a listing that does not fit the config."""
    cfg, tensors, inv, problems = _inventory(Path(directory))
    if problems:
        raise CheckpointError(directory, problems)
    return _formats(cfg, tensors, inv, dequantize=dequantize, dtype=dtype, param_dtype=param_dtype,
                    activation_quant=activation_quant, index_keys=index_keys, quantize_cache=quantize_cache)


def _inventory(directory: Path):
    """(config.json's config, the tensors' headers, their check against it, every problem so far)."""
    cfg = read_config(directory)
    tensors, problems = list_checkpoint(directory)
    inv = check_tensors(cfg, {n: (t.dtype, t.shape) for n, t in tensors.items()})
    return cfg, tensors, inv, problems + inv.problems


def _formats(cfg: ModelConfig, tensors, inv: Inventory, *, dequantize: bool, dtype: str, param_dtype: str | None,
             activation_quant: bool | None, index_keys: str, quantize_cache: bool) -> ModelConfig:
    """`cfg` with the formats the loaded params have: FP8/FP4 kept unless dequantized, param_dtype the embedding's
    (F32: float32, else bfloat16) unless given, activation_quant on for a quantized checkpoint unless given."""
    fp8 = inv.quantized and not dequantize
    if param_dtype is None:
        param_dtype = "float32" if tensors[inv.names["embed.weight"]].dtype == "F32" else "bfloat16"
    return with_formats(cfg, dtype=dtype, param_dtype=param_dtype, index_keys=index_keys,
                        quantize_cache=quantize_cache, weight_format="fp8" if fp8 else "float",
                        activation_quant=inv.quantized if activation_quant is None else activation_quant)


def _read(job: Job) -> np.ndarray:
    if job.mmap:
        return map_tensor(job.info)
    return read_tensor(job.info, job.into() if job.into is not None else None)


def _prefetch(jobs: list[Job], workers: int = 4, window_bytes: int = 1 << 30):
    """(job, array) in job order, read by a thread pool up to `window_bytes` ahead (bounds host memory)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        queue, ahead, it = deque(), 0, iter(jobs)
        for job in it:
            queue.append((job, pool.submit(_read, job)))
            ahead += job.info.nbytes
            while ahead > window_bytes or (queue and len(queue) > 4 * workers):
                done, fut = queue.popleft()
                ahead -= done.info.nbytes
                yield done, fut.result()
        while queue:
            done, fut = queue.popleft()
            yield done, fut.result()


def _pair(tensor: Mapping[str, TensorInfo], key: str, convert: Callable[[np.ndarray, np.ndarray], None],
          mmap: bool = False) -> list[Job]:
    """The jobs of `key`.weight and `key`.scale (quantized form), converted together by `convert`."""
    pair = _Pair(convert)
    return [Job(tensor[key + ".weight"], pair.got_weight, mmap=mmap),
            Job(tensor[key + ".scale"], pair.got_scale, mmap=mmap)]


def _put_dequant(sink: _Sink, path: str, dequant: Callable, w: np.ndarray, s: np.ndarray) -> None:
    """Param `path` from a weight and its scale through `dequant` (one of the _dequant_* above)."""
    sink.put(path, dequant(w, s))


def _put_expert(sink: _Sink, path: str, index: int, n: int, w: np.ndarray) -> None:
    """Expert `index` of `n` of stacked param `path` from its checkpoint weight [out, in] (float)."""
    sink.put_slice(path, index, n, w.T)


def _put_fp4_expert(sink: _Sink, path: str, index: int, n: int, w: np.ndarray, s: np.ndarray) -> None:
    """Expert `index` of `n` of stacked param `path` from its FP4 weight and E8M0 scale, dequantized."""
    _put_expert(sink, path, index, n, _dequant_fp4(w, s))


def _entry_jobs(e: Entry, tensor: Mapping[str, TensorInfo], sink: _Sink, quantized: bool, fp8: bool,
                mmap: bool = False) -> list[Job]:
    """The reads that fill the params of one layout entry (mmap: map its tensors from their files)."""
    if e.kind == "plain":
        return [Job(tensor[e.names[0]], partial(sink.put, e.param))]
    key = e.names[0]
    if e.kind in ("dense", "dense_dequant"):
        if not quantized:
            return [Job(tensor[key + ".weight"], partial(sink.put, e.param + "/weight"))]
        if fp8 and e.kind == "dense":
            return [Job(tensor[key + ".weight"], partial(sink.put, e.param + "/weight")),
                    Job(tensor[key + ".scale"], partial(sink.put, e.param + "/scale"))]
        return _pair(tensor, key, partial(_put_dequant, sink, e.param + "/weight", _dequant_dense))
    if e.kind == "experts":
        n, jobs = len(e.names), []
        for i, key in enumerate(e.names):
            if not quantized:
                jobs.append(Job(tensor[key + ".weight"], partial(_put_expert, sink, e.param, i, n)))
            elif fp8:  # the dominant bytes: read straight into the stacked buffers
                for part, p in ((".weight", e.param), (".scale", e.param + "_scale")):
                    jobs.append(Job(tensor[key + part], partial(sink.filled, p, i, n), into=partial(sink.slot, p, i)))
            else:
                jobs += _pair(tensor, key, partial(_put_fp4_expert, sink, e.param, i, n))
        return jobs
    # table
    if not quantized:
        return [Job(tensor[key + ".weight"], partial(sink.put, e.param), mmap=mmap)]
    if fp8:
        return [Job(tensor[key + ".weight"], partial(sink.put, e.param), mmap=mmap),
                Job(tensor[key + ".scale"], partial(sink.put, e.param + "_scale"), mmap=mmap)]
    return _pair(tensor, key, partial(_put_dequant, sink, e.param, _dequant_rows), mmap=mmap)
