"""Text for training and evaluating small models offline: the Python standard library's own sources as
bytes, and a passkey-retrieval task built on top of them (shared by train_small and quality).

Token ids are those of `dsv41_jax.text_tokenizers.ByteTokenizer` (bytes + 3, <bos> = 1).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from dsv41_jax.text_tokenizers import ByteTokenizer
from experiments import recall_task
from experiments._cli import UserError

TOK = ByteTokenizer()
KEY_DIGITS = 6


def load_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, validation ids) int32 from the stdlib's .py files, each file prefixed with <bos>.

    Every 20th file (sorted by path) is held out for validation.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise UserError(f"no .py files under {root}: this Python has no standard library sources; use one that has")
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    size = 0
    for i, path in enumerate(files):
        data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32) + TOK.offset
        parts[i % 20 == 0].append(np.concatenate([[TOK.bos_id], data]).astype(np.int32))
        size += data.size
        if size >= max_bytes:
            break
    return np.concatenate(parts[False]), np.concatenate(parts[True])


def windows(ids: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """int32 [batch, length]: random windows of `ids`."""
    start = rng.integers(0, ids.size - length, batch)
    return ids[start[:, None] + np.arange(length)]


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), np.uint8).astype(np.int32) + TOK.offset


def _key_lines(key: str) -> tuple[np.ndarray, np.ndarray]:
    """The planted line and the recall line of a passkey example."""
    return _encode(f"\n# passkey: {key}\n"), _encode(f"\n# recall passkey: {key}\n")


MIN_FILL = 16
PASSKEY_MIN_LENGTH = 1 + sum(x.size for x in _key_lines("0" * KEY_DIGITS)) + MIN_FILL  # <bos>, key lines, filler


def passkey(filler: np.ndarray, length: int, depth: float, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One retrieval example of exactly `length` ids and the index of the answer's first digit.

    Layout: <bos> filler[:a] "\\n# passkey: DDDDDD\\n" filler[a:] "\\n# recall passkey: DDDDDD\\n", with
    the key line `depth` (0..1) of the way through the filler. The model must copy the 6 random digits
    from far back; the recall line's digits are the answer.
    """
    key = "".join(rng.choice(list("0123456789"), KEY_DIGITS))
    plant, ask = _key_lines(key)
    n_fill = length - 1 - plant.size - ask.size
    if n_fill < MIN_FILL:
        raise ValueError(f"passkey example of {length} tokens is too short (needs at least {PASSKEY_MIN_LENGTH})")
    start = int(rng.integers(0, filler.size - n_fill))
    fill = filler[start:start + n_fill]
    a = int(depth * n_fill)
    ids = np.concatenate([[TOK.bos_id], fill[:a], plant, fill[a:], ask]).astype(np.int32)
    answer = length - 1 - KEY_DIGITS  # the trailing "\n" follows the digits
    return ids, answer


def passkey_batch(filler: np.ndarray, batch: int, length: int, depth: float | None,
                  rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """int32 [batch, length] examples (depth None: uniform in [0, 0.9] per example), answer index."""
    rows = [passkey(filler, length, rng.uniform(0, 0.9) if depth is None else depth, rng) for _ in range(batch)]
    return np.stack([r[0] for r in rows]), rows[0][1]


def training_batches(ids: np.ndarray, batch: int, seq: int, retrieval_frac: float, rng: np.random.Generator,
                     recall_frac: float = 0.0, recall_pairs: int = 8, max_distance=lambda: None,
                     answer_weight: float = 1.0):
    """Endless train-step batches {"tokens": int32 [batch, seq + 1], "weights": f32 [batch, seq]}: random
    windows of `ids`, a `retrieval_frac` share of them replaced by passkey examples and a `recall_frac` share
    by multi-query recall examples (`experiments.recall_task`, `recall_pairs` pairs each, within
    `max_distance()` tokens of their queries: read per batch, so a caller can grow it), filler from the same
    ids. weights: the loss weight of each target, 1 except the answer digits of those examples
    (`answer_weight`: a few dozen answer digits in thousands of text targets otherwise give the retrieval
    task too little of the gradient to be learned in minutes)."""
    answers = recall_task.answer_positions(seq + 1, recall_pairs).ravel() if recall_frac else None
    while True:
        rows = windows(ids, batch, seq + 1, rng)
        weights = np.ones((batch, seq), np.float32)
        u = rng.random(batch)
        for r in np.flatnonzero(u < retrieval_frac):
            rows[r], at = passkey(ids, seq + 1, rng.uniform(0, 0.9), rng)
            weights[r, at - 1:at - 1 + KEY_DIGITS] = answer_weight  # target i predicts token i + 1
        for r in np.flatnonzero((u >= retrieval_frac) & (u < retrieval_frac + recall_frac)):
            rows[r] = recall_task.example(ids, seq + 1, recall_pairs, max_distance(), rng)[0]
            weights[r, answers - 1] = answer_weight
        yield {"tokens": rows, "weights": weights}
