"""Text <-> token ids for the experiments: a byte-level tokenizer for random-weight presets, or a
`tokenizer.json` through the `tokenizers` package."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes shifted past three specials: 0 <pad>, 1 <bos>, 2 <eos>. Needs vocab_size >= 259.
    image_token_id: the text IMAGE_TEXT encodes to that one id (a model's image placeholder, as a released
    tokenizer's special token does); None: it is bytes like any text."""

    pad_id, bos_id, eos_id = 0, 1, 2
    offset = 3
    size = 259
    IMAGE_TEXT = "<image>"

    def __init__(self, image_token_id: int | None = None):
        self.image_token_id = image_token_id

    def encode(self, text: str) -> list[int]:
        if self.image_token_id is None:
            return [self.bos_id] + [b + self.offset for b in text.encode("utf-8")]
        ids = [self.bos_id]
        for i, part in enumerate(text.split(self.IMAGE_TEXT)):
            ids += ([self.image_token_id] if i else []) + [b + self.offset for b in part.encode("utf-8")]
        return ids

    def special_text(self, token_id: int) -> str | None:
        """The text that encodes to exactly `token_id` (None: no text does)."""
        return self.IMAGE_TEXT if token_id == self.image_token_id else None

    def decode(self, ids) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.size)
        return data.decode("utf-8", errors="replace")


class FileTokenizer:
    """A HuggingFace `tokenizer.json`."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tok = read_tokenizer_json(path)
        self.size = self.tok.get_vocab_size()
        self.eos_id = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def special_text(self, token_id: int) -> str | None:
        """The token's text when encoding it (with text around it) gives `token_id` once, as an added special
        token's does (None: no such text)."""
        text = self.tok.id_to_token(int(token_id))
        return text if text and self.encode(f"a{text}b").count(int(token_id)) == 1 else None


def read_tokenizer_json(path: str | Path):
    """A `tokenizers.Tokenizer` from `path`; ValueError naming the file when it does not parse (the
    package's own exception names neither the file nor the cause's place in it in a useful way)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every parse failure
        raise ValueError(f"{path}: not a valid tokenizer.json ({e}); download it again or pass another") from e


def load_tokenizer(path: str | None, vocab_size: int, image_token_id: int | None = None):
    """A tokenizer.json at `path`, or the byte-level one (None) with `image_token_id`'s placeholder text."""
    tok = FileTokenizer(path) if path else ByteTokenizer(image_token_id)
    if tok.size > vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tok.size} ids but the model's vocab_size is {vocab_size}; "
                         "use the tokenizer made for this model")
    return tok
