"""Multi-query associative recall (MQAR) in byte tokens: key-value pairs planted in filler text, queried
at the end, so a model must fetch values from a known distance back (the retrieval study, issue 20).

One example of exactly `length` ids (ByteTokenizer ids, as `experiments.corpus`):

    <bos> filler ... "\\n# let kqzx = 4821\\n" ... filler ... "\\n# let abcd = 0375\\n" ... filler
    "\\n# get abcd: 0375\\n" "\\n# get kqzx: 4821\\n" ...          <- the query block, at the end

Keys are 4 random lowercase letters (distinct within an example), values 4 random digits. Every planted
pair is queried once, in random order. The answer of a query is its value's 4 digits; the model predicts
digit j at the position before it. The distance of a query is the number of tokens from its planted
value to its answer (what the attention must reach back). `max_distance` places every planted line
within that many tokens of the query block (a curriculum over distance grows it during training); the
query block sits at fixed positions, so every example of a batch has the same answer positions.
"""

from __future__ import annotations

import math

import numpy as np

from dsv41_jax.text_tokenizers import ByteTokenizer

TOK = ByteTokenizer()  # the ids of experiments.corpus

KEY_CHARS, VALUE_DIGITS = 4, 4
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
_DIGITS = np.array(list("0123456789"))


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), np.uint8).astype(np.int32) + TOK.offset


PLANT_LEN = len(f"\n# let {'k' * KEY_CHARS} = {'0' * VALUE_DIGITS}\n")
PLANT_VALUE_AT = len(f"\n# let {'k' * KEY_CHARS} = ")  # value offset inside a planted line
QUERY_LEN = len(f"\n# get {'k' * KEY_CHARS}: {'0' * VALUE_DIGITS}\n")
QUERY_VALUE_AT = len(f"\n# get {'k' * KEY_CHARS}: ")


def min_distance(n_pairs: int) -> int:
    """The smallest `max_distance` that leaves room for n_pairs planted lines before the query block."""
    return n_pairs * (PLANT_LEN + QUERY_LEN) + 1


def min_length(n_pairs: int, min_fill: int = 16) -> int:
    """The shortest example of n_pairs pairs: <bos>, the planted lines, the query block, some filler."""
    return 1 + n_pairs * (PLANT_LEN + QUERY_LEN) + min_fill


def answer_positions(length: int, n_pairs: int) -> np.ndarray:
    """int [n_pairs, VALUE_DIGITS]: the positions of each query's answer digits (the same in every example)."""
    q0 = length - n_pairs * QUERY_LEN + np.arange(n_pairs) * QUERY_LEN + QUERY_VALUE_AT
    return q0[:, None] + np.arange(VALUE_DIGITS)


def example(filler: np.ndarray, length: int, n_pairs: int, max_distance: int | None,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [length], distance int [n_pairs] of each query in query order); see the module doc.

    max_distance: every query's distance is below this (None: anywhere in the example); at least
    `min_distance(n_pairs)`.
    """
    n_fill = length - min_length(n_pairs, 0)
    if n_fill < 16:
        raise ValueError(f"an MQAR example of {n_pairs} pairs needs at least {min_length(n_pairs)} tokens, "
                         f"got length {length}")
    keys = set()
    while len(keys) < n_pairs:
        keys.add("".join(rng.choice(_LETTERS, KEY_CHARS)))
    keys = sorted(keys)
    rng.shuffle(keys)
    values = ["".join(rng.choice(_DIGITS, VALUE_DIGITS)) for _ in keys]
    # where in the filler each planted line goes: offsets within the last `reach` filler tokens
    block = n_pairs * QUERY_LEN
    reach = n_fill if max_distance is None else max_distance - n_pairs * PLANT_LEN - block
    if reach < 1:
        raise ValueError(f"max_distance={max_distance} leaves no room for {n_pairs} planted pairs before the "
                         f"query block (needs more than {n_pairs * PLANT_LEN + block})")
    offsets = np.sort(rng.integers(max(0, n_fill - reach), n_fill + 1, n_pairs))
    start = int(rng.integers(0, filler.size - n_fill))
    fill = filler[start:start + n_fill]
    parts, plant_at, pos, prev = [np.array([TOK.bos_id], np.int32)], [], 1, 0
    for k, v, off in zip(keys, values, offsets):
        parts.append(fill[prev:off])
        pos += off - prev
        plant_at.append(pos + PLANT_VALUE_AT)
        parts.append(_encode(f"\n# let {k} = {v}\n"))
        pos += PLANT_LEN
        prev = off
    parts.append(fill[prev:])
    order = rng.permutation(n_pairs)
    parts += [_encode(f"\n# get {keys[i]}: {values[i]}\n") for i in order]
    ids = np.concatenate(parts).astype(np.int32)
    assert ids.size == length, (ids.size, length)
    distance = answer_positions(length, n_pairs)[:, 0] - np.asarray(plant_at)[order]
    return ids, distance


def batch(filler: np.ndarray, size: int, length: int, n_pairs: int, max_distance: int | None,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [size, length], distances int [size, n_pairs]) of `size` independent examples."""
    rows = [example(filler, length, n_pairs, max_distance, rng) for _ in range(size)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def curriculum(step: int, steps: int, start: int, end: int) -> int:
    """The max distance at training step `step` of `steps`: geometric from `start` to `end` (both included)
    over the first half, then `end`."""
    frac = min(1.0, step / max(1, steps // 2))
    return int(round(start * (end / start) ** frac))


def scores(logits_bqdv: np.ndarray, ids_bt: np.ndarray, length: int, n_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """(whole value right bool [B, Q], value NLL f32 [B, Q] in nats summed over its digits) from the logits
    that predict each answer digit (those of the positions before the digits, [B, Q, VALUE_DIGITS, V])."""
    target = ids_bt[:, answer_positions(length, n_pairs)]  # [B, Q, D]
    right = (logits_bqdv.argmax(-1) == target).all(-1)
    z = logits_bqdv - logits_bqdv.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    nll = (lse - np.take_along_axis(z, target[..., None], axis=-1)[..., 0]).sum(-1)
    return right, nll


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k / n ((0, 1) when n == 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def by_distance(right: np.ndarray, distance: np.ndarray, edges: list[int]) -> list[dict]:
    """Accuracy per distance bin [edges[i], edges[i + 1]): [{lo, hi, n, acc, ci95}] (bins without queries
    included, n = 0)."""
    right, distance = np.asarray(right).ravel(), np.asarray(distance).ravel()
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (distance >= lo) & (distance < hi)
        n, k = int(sel.sum()), int(right[sel].sum())
        out.append({"lo": lo, "hi": hi, "n": n, "acc": k / n if n else float("nan"), "ci95": wilson(k, n)})
    return out


def paired_difference(right: np.ndarray, base: np.ndarray, distance: np.ndarray, edges: list[int],
                      z: float = 1.959964) -> list[dict]:
    """Accuracy of `right` minus that of `base` on the same queries, per distance bin [edges[i], edges[i + 1]):
    [{lo, hi, n, diff, ci95}], the interval from the paired differences' standard error (normal
    approximation; (0, 0) when every query agrees, nan when a bin is empty). Paired, it sees differences that
    two independent intervals would hide: most queries are right (or wrong) under both."""
    d_all = np.asarray(right, np.float64).ravel() - np.asarray(base, np.float64).ravel()
    distance = np.asarray(distance).ravel()
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        d = d_all[(distance >= lo) & (distance < hi)]
        n = d.size
        diff = float(d.mean()) if n else float("nan")
        half = z * float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else float("nan")
        out.append({"lo": lo, "hi": hi, "n": n, "diff": diff, "ci95": (diff - half, diff + half)})
    return out
