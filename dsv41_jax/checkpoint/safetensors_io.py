"""Safetensors headers and payloads, read tensor by tensor (never a whole file in memory).

Our own reader and writer because the release uses dtypes (F8_E4M3, F8_E8M0, nibble-packed FP4 in
I8) that not every safetensors binding maps to numpy. The format: an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}} (offsets relative to the
end of the header), then the payload.

E8M0 tensors come back as `uint8` holding the biased exponent (value = 2^(byte - 127)), the same
convention as dsv41_jax.quant; everything else maps to its numpy / ml_dtypes dtype.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

NUMPY_DTYPE = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype name (safetensors spelling), shape, byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for one safetensors file (reads only the header)."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file ({len(raw)} bytes)")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes); "
                             "the file is truncated or not safetensors")
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        out[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + b, base + e)
    return out


def list_checkpoint(directory: str | Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """All tensors of a checkpoint directory: `model.safetensors`, or the index and its shards.

    Returns (tensors, problems). Problems are what makes the listing untrustworthy (a shard the index
    names but that is missing, a tensor the index assigns to a shard whose header lacks it, a payload
    cut short); they are reported together with the model-level checks, never raised one by one.
    """
    directory = Path(directory)
    problems: list[str] = []
    tensors: dict[str, TensorInfo] = {}
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        headers = {}
        for shard in shards:
            p = directory / shard
            if not p.exists():
                problems.append(f"shard {shard} is named by {INDEX_FILE} but missing from {directory}")
                continue
            try:
                headers[shard] = read_header(p)
            except (ValueError, json.JSONDecodeError) as e:
                problems.append(f"shard {shard}: unreadable header ({e})")
        for name, shard in weight_map.items():
            if shard not in headers:
                continue
            info = headers[shard].get(name)
            if info is None:
                problems.append(f"{name}: {INDEX_FILE} places it in {shard}, whose header does not have it")
            else:
                tensors[name] = info
        for shard, hdr in headers.items():
            for name in hdr:
                if weight_map.get(name) != shard:
                    problems.append(f"{name}: in shard {shard} but {INDEX_FILE} does not place it there")
    elif (directory / SINGLE_FILE).exists():
        tensors = read_header(directory / SINGLE_FILE)
    else:
        raise FileNotFoundError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}: "
                                "point --checkpoint at the directory holding the safetensors files")
    problems += _truncated_files(tensors.values())
    for name, info in tensors.items():
        if info.dtype in NUMPY_DTYPE:
            want = int(np.prod(info.shape, dtype=np.int64)) * NUMPY_DTYPE[info.dtype].itemsize
            if want != info.nbytes:
                problems.append(f"{name}: header says {info.dtype}{list(info.shape)} = {want} bytes but "
                                f"its byte range holds {info.nbytes}")
    return tensors, problems


def _truncated_files(infos) -> list[str]:
    """One problem per file whose tensors end past its size (a truncated download cuts off every tensor
    after the cut: naming each would bury the one fact that matters, the file and how much of it is there)."""
    need: dict[Path, list[int]] = {}  # file -> end of each of its tensors
    for info in infos:
        need.setdefault(info.file, []).append(info.end)
    out = []
    for f, ends in sorted(need.items()):
        size = f.stat().st_size
        cut = sum(e > size for e in ends)
        if cut:
            out.append(f"{f.name}: {size:,d} of {max(ends):,d} bytes ({cut} of its {len(ends)} tensors cut off; "
                       "truncated download?)")
    return out


def read_tensor(info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """The payload of one tensor as a numpy array in its own dtype (E8M0 as uint8 exponents).

    out: a C-contiguous array of the tensor's byte size to read into (e.g. a slice of a stacked
    param), saving a copy."""
    dt = NUMPY_DTYPE[info.dtype]
    if out is not None:
        if not out.flags.c_contiguous or out.nbytes != info.nbytes:
            raise ValueError(f"read_tensor: destination of {out.nbytes} bytes for a {info.nbytes}-byte tensor")
        buf = out.reshape(-1).view(np.uint8)
    else:
        buf = np.empty(info.nbytes, np.uint8)
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.begin)
        view = memoryview(buf)
        got = 0
        while got < info.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise IOError(f"{info.file}: payload ended after {got} of {info.nbytes} bytes")
            got += n
    return buf.view(dt).reshape(info.shape)


def map_tensor(info: TensorInfo) -> np.ndarray:
    """The payload of one tensor as a read-only `np.memmap` view of its file (nothing read until used).

    Pages come from the OS page cache on access; on the CPU backend `jax.device_put` may alias such an
    array instead of copying it, so the file must not be modified while the array is in use."""
    dt = NUMPY_DTYPE[info.dtype]
    if info.nbytes == 0:
        return np.empty(info.shape, dt)
    raw = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.begin, shape=(info.nbytes,))
    return raw.view(dt).reshape(info.shape)


def _dtype_name(arr: np.ndarray, hint: str | None) -> str:
    if hint is not None:
        return hint
    for name, dt in NUMPY_DTYPE.items():
        if dt == arr.dtype and name != "F8_E8M0":
            return name
    raise TypeError(f"no safetensors dtype for numpy dtype {arr.dtype}")


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray | tuple[str, np.ndarray]]) -> int:
    """Write a safetensors file. Values are arrays, or (dtype name, array) to force a spelling
    (("F8_E8M0", uint8 exponents), ("I8", packed FP4 bytes)). Returns the bytes written."""
    entries, offset = {}, 0
    arrays = []
    for name, value in tensors.items():
        hint, arr = value if isinstance(value, tuple) else (None, value)
        arr = np.ascontiguousarray(arr)
        dtype = _dtype_name(arr, hint)
        entries[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # payload 8-byte aligned, as the reference writer does
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for arr in arrays:
            f.write(arr.view(np.uint8).reshape(-1).data)
    os.replace(tmp, path)
    return 8 + len(header) + offset
