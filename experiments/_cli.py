"""Command-line input to values, or one `error: ...` line: what every `experiments.*` entry point does
with input it cannot use (a missing or undecodable file, a flag the model cannot honour, a directory it
cannot write), instead of a traceback or a silent loss discovered later.

Each helper turns the failures of one kind of input into a `UserError` naming the flag or the file;
`entry_point` ends the run on it with exit status 1. Only these conversions are caught: an exception
anywhere else is a bug and keeps its traceback. argparse's own usage errors stay as they are (exit 2).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import numpy as np


class UserError(Exception):
    """Input from the command line that cannot be used; the message names the flag or file and what to do."""


def entry_point(main):
    """Wrap `main(argv=None)`: a UserError prints `error: <message>` on stderr and exits with status 1."""

    @functools.wraps(main)
    def run(argv=None):
        try:
            return main(argv)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return run


def read_text(path: str, flag: str) -> str:
    """The UTF-8 text of a file given by `flag`."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                        "convert it, e.g. iconv -t UTF-8") from None
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def load_ids(path: str, flag: str) -> np.ndarray:
    """Integer token ids [tokens] or [rows, tokens] from a .npy file given by `flag`."""
    try:
        ids = np.load(path, allow_pickle=False)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, EOFError):  # not .npy, cut short, or pickled objects
        raise UserError(f"{flag} {path}: not a .npy array of token ids; write one with numpy.save") from None
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise UserError(f"{flag} {path}: expected integer token ids [tokens] or [rows, tokens], "
                        f"got {ids.dtype}{list(ids.shape)}")
    return ids


def check_ids(ids: np.ndarray, vocab_size: int, flag: str, path: str) -> None:
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise UserError(f"{flag} {path}: ids must be in [0, {vocab_size}) for this model, "
                        f"got {ids.min()}..{ids.max()}")


def input_dir(path: str, flag: str) -> Path:
    """An existing directory given by `flag`."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{flag} {path}: {'not a directory' if p.exists() else 'no such directory'}")
    return p


def writable_dir(path: str, flag: str) -> Path:
    """A directory given by `flag` (created if missing) that files can really be written to.

    Checked by writing, syncing and removing a probe file rather than by permission bits, which say
    nothing about read-only mounts, full disks or root: a store that cannot write only shows up later as
    counters, with every result lost."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path}: not writable (it is a file, not a directory); give a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".write-probe-")
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: not writable ({e.strerror or e}); give a directory you can write to") from None
    return p


def output_file(path: str | None, flag: str) -> None:
    """Refuse, before any work, an output file (given by `flag`) that could not be written at the end."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: directory {parent} is not writable")


def tokenizer(path: str | None, vocab_size: int, flag: str = "--tokenizer", image_token_id: int | None = None):
    """The byte-level tokenizer (path None; "<image>" is image_token_id) or a tokenizer.json that fits the model's
    vocabulary."""
    from dsv41_jax.text_tokenizers import load_tokenizer

    try:
        return load_tokenizer(path, vocab_size, image_token_id)
    except (OSError, ValueError) as e:  # missing, unparsable, larger than the vocabulary: each names the file
        raise UserError(f"{flag}: {e}") from None


def checkpoint_config(path: str, flag: str = "--checkpoint"):
    """The ModelConfig of a checkpoint directory from its config.json alone (no weights read)."""
    from dsv41_jax.checkpoint import read_config

    input_dir(path, flag)
    try:
        return read_config(path)
    except (OSError, ValueError, TypeError, KeyError) as e:  # missing, not JSON, keys that make no config
        raise UserError(f"{flag} {path}: config.json: {e}") from None


def load_checkpoint(path: str, flag: str = "--checkpoint", *, config_only: bool = False, **kw):
    """`dsv41_jax.checkpoint.load_checkpoint` (with `config_only`: `loaded_config`, what it would return as config,
    no payload read), its listing of what does not fit the config as one line."""
    from dsv41_jax.checkpoint import CheckpointError, load_checkpoint, loaded_config

    input_dir(path, flag)
    try:
        return loaded_config(path, **kw) if config_only else load_checkpoint(path, **kw)
    except FileNotFoundError as e:  # no safetensors at all
        raise UserError(f"{flag} {e}") from None
    except CheckpointError as e:
        shown = "; ".join(e.problems[:5]) + (f"; ... and {len(e.problems) - 5} more" if len(e.problems) > 5 else "")
        raise UserError(f"{flag} {path}: {len(e.problems)} problem(s), nothing was loaded: {shown}. Check that "
                        "config.json belongs to these weights and that every shard downloaded completely") from None
