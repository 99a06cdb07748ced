"""Engram's compressed vocabulary, derived from `tokenizer.json` the way the release derives it.

Each token id is decoded on its own and normalized (NFKC, NFD, accents stripped, lower case, runs of
spaces / tabs / newlines collapsed to one space, surrounding spaces stripped, except that a token that
is exactly one space stays one space); tokens that normalize alike share one compressed id, numbered
in first-seen order of token id. A token whose decoding is a partial UTF-8 sequence (it contains
U+FFFD) is keyed by its raw vocabulary string instead. The n-gram hash multipliers derive from the
number of compressed ids, so it must equal the config's `engram_compressed_vocab_size`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv41_jax.text_tokenizers import read_tokenizer_json

_SPACE_SENTINEL = "\ue000"  # private-use char: keeps a lone space from being stripped to ""


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def compressed_token_map(tokenizer_json: str | Path) -> tuple[np.ndarray, int]:
    """(int32 [n_tokens] compressed id of each token id, number of compressed ids)."""
    tok = read_tokenizer_json(tokenizer_json)
    norm = _normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int] = {}
    out = np.empty(n, np.int32)
    for t in range(n):
        text = tok.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(t)
        else:
            key = norm.normalize_str(text) or text
        out[t] = ids.setdefault(key, len(ids))
    return out, len(ids)


def engram_token_map(tokenizer_json: str | Path, vocab_size: int, compressed_vocab_size: int) -> np.ndarray:
    """int32 [vocab_size]: the model's `engram_token_map` buffer built from `tokenizer_json`.

    Ids past the tokenizer's own vocabulary (the embedding is padded) map to compressed id 0; no text
    produces them. Raises ValueError when the derived size differs from the config's.
    """
    lookup, size = compressed_token_map(tokenizer_json)
    if size != compressed_vocab_size:
        raise ValueError(f"{tokenizer_json} yields {size} compressed Engram token ids but the config says "
                         f"engram_compressed_vocab_size={compressed_vocab_size}; every n-gram hash would "
                         "land in the wrong rows. Use the tokenizer.json released with these weights.")
    if len(lookup) > vocab_size:
        raise ValueError(f"{tokenizer_json} has {len(lookup)} tokens, more than the model's vocab_size={vocab_size}")
    full = np.zeros(vocab_size, np.int32)
    full[: len(lookup)] = lookup
    return full
