"""Text files → token ids: local tokenizers, reading .txt/.jsonl, and `fsdprun prepare-data`.

    fsdprun prepare-data corpus/*.txt --out data/corpus --val-fraction 0.05
    fsdprun prepare-data docs.jsonl --out data/docs --tokenizer path/to/tokenizer.json

Documents are tokenized one after another, each followed by the tokenizer's end-of-text token,
into one stream. The byte tokenizer is built in (no download); a HuggingFace `tokenizer.json`
is read through the optional `tokenizers` package.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdprun.data.files import DESCRIPTION, check_input_file, token_dtype_for
from fsdprun.errors import UserError
from fsdprun.staging import staged_folder

TEXT_SUFFIXES = (".txt", ".jsonl")
# End-of-text tokens of common HuggingFace tokenizers, tried in this order.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
# .txt files are read in pieces of whole lines of about this many characters.
TXT_CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 ends a document."""

    name: str = "byte"
    vocab_size: int = 257
    eos_id: int | None = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)


class HFTokenizer:
    """A HuggingFace `tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(
                f"data.tokenizer {path} needs the `tokenizers` package: pip install "
                "'fsdprun[text]' (or pip install tokenizers), or use data.tokenizer=byte"
            ) from None
        if not path.is_file():
            raise UserError(f"tokenizer {path} does not exist (a tokenizer.json path or `byte`)")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"tokenizer {path} cannot be read: {first}") from e
        self.name = str(path)
        # The ids the model must embed: one past the largest (a vocabulary may have gaps).
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        ids = (self._tok.token_to_id(t) for t in EOS_CANDIDATES)
        self.eos_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """`byte` or the path of a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec))


def check_text_file(path: Path, *, key: str) -> None:
    check_input_file(
        path, key=key, suffixes=TEXT_SUFFIXES,
        wrong_kind="is not a text file (.txt or .jsonl); token files need data.source=tokens",
    )  # fmt: skip


def iter_documents(path: Path, text_field: str) -> Iterator[list[str]]:
    """The documents of a file, each as pieces of text (a .txt file is one document, read in
    pieces of whole lines so a large file is never held at once; a .jsonl line is one)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path} line {n}: not JSON ({e})") from e
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    fields = sorted(record) if isinstance(record, dict) else []
                    raise UserError(
                        f"{path} line {n}: no text field '{text_field}' (fields: {fields}); "
                        "set data.text_field (--text-field)"
                    )
                yield [record[text_field]]
        return
    yield _txt_pieces(path)


def _txt_pieces(path: Path) -> Iterator[str]:
    # newline="": the text verbatim (a byte-tokenized .txt has exactly its size in tokens).
    with path.open(encoding="utf-8", newline="") as f:
        while True:
            piece = f.read(TXT_CHUNK_CHARS)
            if not piece:
                return
            piece += f.readline()  # end on a line boundary: tokenizers split there anyway
            yield piece


def tokenize_files(
    paths: list[Path], tokenizer: ByteTokenizer | HFTokenizer, text_field: str
) -> Iterator[np.ndarray]:
    """Token ids of every document of `paths`, in order, each followed by end-of-text."""
    eos = (
        np.array([tokenizer.eos_id], dtype=np.uint32)
        if tokenizer.eos_id is not None
        else np.zeros(0, dtype=np.uint32)
    )
    for path in paths:
        try:
            for pieces in iter_documents(path, text_field):
                for piece in pieces:
                    yield tokenizer.encode(piece)
                yield eos
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def tokenize_to_array(
    paths: list[Path], tokenizer: ByteTokenizer | HFTokenizer, text_field: str
) -> np.ndarray:
    parts = list(tokenize_files(paths, tokenizer, text_field))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def prepare_data(
    inputs: list[Path],
    out: Path,
    *,
    tokenizer: str = "byte",
    val_fraction: float = 0.0,
    text_field: str = "text",
) -> dict[str, Any]:
    """Tokenize text files into OUT/train.bin (and OUT/val.bin: the last `val_fraction` of the
    tokens) plus OUT/data.json. Streams: memory stays small at any corpus size.

    Returns:
        The description written to OUT/data.json.

    Raises:
        UserError: a missing or unreadable input, a non-empty OUT, a bad fraction.
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if not inputs:
        raise UserError("no input files; pass .txt or .jsonl files")
    for path in inputs:
        check_text_file(path, key="input")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder (nothing is overwritten)")
    tok = build_tokenizer(tokenizer)
    dtype = token_dtype_for(tok.vocab_size)
    # Written into a folder beside OUT that becomes OUT at the end: a run that fails halfway (a
    # bad input line, a full disk) leaves nothing, and the retry is not refused.
    with staged_folder(out) as stage:
        train = stage / "train.bin"
        total = 0
        with train.open("wb") as f:
            for ids in tokenize_files(inputs, tok, text_field):
                f.write(ids.astype(dtype).tobytes())
                total += len(ids)
        if total == 0:
            raise UserError("the inputs hold no text")
        files = {"train.bin": {"num_tokens": total}}
        num_val = round(total * val_fraction)
        if num_val:
            # The tail of the stream becomes val.bin; train.bin is then cut short.
            itemsize = np.dtype(dtype).itemsize
            tail = np.memmap(train, dtype=dtype, mode="r", offset=(total - num_val) * itemsize)
            (stage / "val.bin").write_bytes(tail.tobytes())
            del tail
            os.truncate(train, (total - num_val) * itemsize)
            files = {
                "train.bin": {"num_tokens": total - num_val},
                "val.bin": {"num_tokens": num_val},
            }
        description = {
            "format": "fsdprun-tokens",
            "version": 1,
            "dtype": dtype,
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.name,
            "eos_id": tok.eos_id,
            "num_tokens": total,
            "files": files,
            "sources": [str(p) for p in inputs],
            "text_field": text_field,
        }
        (stage / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    return description
