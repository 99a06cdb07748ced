"""The byte layout of a self-checking record of named arrays, shared by the disk pages and the window store.

    MAGIC (8 B) | header length (u32 LE) | header (JSON) | payload | digest (16 B)

The header holds the format version, the fingerprint of what produced the record, its key, the caller's
own fields and the name, dtype and shape of every array; the payload is the arrays' bytes in that
order; the digest covers everything before it. A record that is not exactly what a reader expects is
never decoded into arrays: `decode` returns the reason instead (a short string, counted as a miss).
"""

from __future__ import annotations

import json
import struct

import numpy as np

from dsv41_jax.tiers.keys import CACHE_FORMAT_VERSION, _h

DIGEST = 16


def encode(magic: bytes, fingerprint: str, key: str, arrays: dict[str, np.ndarray], **fields) -> bytes:
    """The record of `arrays` under `key`, with `fields` added to its header."""
    arrs = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header = dict(version=CACHE_FORMAT_VERSION, fingerprint=fingerprint, key=key, **fields,
                  arrays=[[k, a.dtype.str, list(a.shape)] for k, a in arrs.items()])
    hb = json.dumps(header, sort_keys=True).encode()
    body = magic + struct.pack("<I", len(hb)) + hb + b"".join(a.tobytes() for a in arrs.values())
    h = _h()
    h.update(body)
    return body + h.digest()


def decode(data: bytes, magic: bytes, fingerprint: str, key: str, *, copy: bool = False, expect: dict | None = None,
           mismatch: str = "header", header_out: dict | None = None) -> dict[str, np.ndarray] | str:
    """The arrays of a record (views of `data`, or writable copies with copy=True), or why the bytes are not
    the record of `key` by `fingerprint` (`mismatch` when a header field differs from `expect`). A dict
    passed as `header_out` receives the header of a record that decodes (e.g. fields the caller added)."""
    if len(data) < len(magic) + 4 + DIGEST or not data.startswith(magic):
        return "bad_magic"
    h = _h()
    h.update(data[:-DIGEST])
    if h.digest() != data[-DIGEST:]:
        return "checksum"
    (hlen,) = struct.unpack_from("<I", data, len(magic))
    start = len(magic) + 4
    try:
        header = json.loads(data[start:start + hlen])
    except ValueError:
        return "bad_header"
    for field, want in (("version", CACHE_FORMAT_VERSION), ("fingerprint", fingerprint), ("key", key)):
        if header.get(field) != want:
            return field
    if any(header.get(f) != v for f, v in (expect or {}).items()):
        return mismatch
    out, off = {}, start + hlen
    for name, dt, shape in header["arrays"]:
        count = int(np.prod(shape, dtype=np.int64))
        n = count * np.dtype(dt).itemsize
        if off + n > len(data) - DIGEST:
            return "short_payload"
        a = np.frombuffer(data, dtype=dt, count=count, offset=off).reshape(shape)
        out[name] = a.copy() if copy else a
        off += n
    if off != len(data) - DIGEST:
        return "payload_size"
    if header_out is not None:
        header_out.update(header)
    return out
