"""Token files on disk: what a file holds, read from its header, size and description only.

A token file is a flat array of token ids: `.bin` (raw uint16/uint32, no header: the nanoGPT
layout) or `.npy` (a 1-D uint16/uint32 array). `fsdprun prepare-data` writes `.bin` files plus a
`data.json` beside them (`DESCRIPTION`) saying the dtype, the vocabulary size and the tokenizer;
a `.bin` file without one is read as uint16 unless `data.token_dtype` says otherwise.

Never imports torch (the preflight reads headers with numpy alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdprun.data.lazy_numpy import np
from fsdprun.errors import UserError

DESCRIPTION = "data.json"
TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32")
_ITEMSIZE = {"uint16": 2, "uint32": 4}


def token_dtype_for(vocab_size: int) -> str:
    """The smallest token dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class TokenFile:
    path: Path
    dtype: str
    num_tokens: int
    offset: int  # bytes before the first token (the .npy header)
    vocab_size: int | None  # from the description, when there is one
    tokenizer: str | None

    def open(self) -> np.ndarray:
        """The tokens as a read-only memory map (nothing is read until sliced)."""
        return np.memmap(
            self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.num_tokens,)
        )


def read_description(folder: Path) -> dict[str, Any] | None:
    path = folder / DESCRIPTION
    if not path.is_file():
        return None
    try:
        desc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable data description ({e})") from e
    if not isinstance(desc, dict) or not isinstance(desc.get("files"), dict):
        raise UserError(f"{path}: not an fsdprun data description (no 'files' mapping)")
    return desc


def check_input_file(path: Path, *, key: str, suffixes: tuple[str, ...], wrong_kind: str) -> None:
    """`path` (named by recipe key `key`) exists, is a file and has one of `suffixes`.

    Raises:
        UserError: one line naming the key and the path; `wrong_kind` says what else to do.
    """
    if not path.exists():
        raise UserError(f"{key}: {path} does not exist")
    if not path.is_file():
        raise UserError(f"{key}: {path} is not a file")
    if path.suffix not in suffixes:
        raise UserError(f"{key}: {path} {wrong_kind}")


def inspect_token_file(path: Path, *, token_dtype: str, key: str) -> TokenFile:
    """What a token file holds (header, size and description only).

    Args:
        path: the file.
        token_dtype: `auto`, `uint16` or `uint32` (data.token_dtype; for `.bin` files).
        key: the recipe key that named the file, for messages.

    Raises:
        UserError: missing, of an unknown kind, of a wrong dtype or size.
    """
    check_input_file(
        path, key=key, suffixes=TOKEN_SUFFIXES,
        wrong_kind="is not a token file (.bin or .npy); text files need data.source=text, or "
        "turn them into token files with `fsdprun prepare-data`",
    )  # fmt: skip
    desc = read_description(path.parent)
    listed = desc["files"].get(path.name) if desc else None
    vocab = desc.get("vocab_size") if listed is not None else None
    tokenizer = desc.get("tokenizer") if listed is not None else None
    if path.suffix == ".npy":
        dtype, shape, offset = _npy_header(path, key)
        if len(shape) != 1 or dtype not in TOKEN_DTYPES:
            raise UserError(
                f"{key}: {path} holds a {dtype} array of shape {tuple(shape)}; token files must "
                "be 1-D uint16 or uint32 arrays"
            )
        return TokenFile(path, dtype, shape[0], offset, vocab, tokenizer)
    described = listed is not None and desc.get("dtype")
    if token_dtype == "auto":
        dtype = described or "uint16"
    else:
        dtype = token_dtype
        if described and described != dtype:
            raise UserError(
                f"{key}: data.token_dtype is {dtype} but {path.parent / DESCRIPTION} says "
                f"{path.name} holds {described}; set data.token_dtype=auto"
            )
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"{path.parent / DESCRIPTION}: dtype '{dtype}' is not uint16 or uint32")
    size = path.stat().st_size
    itemsize = _ITEMSIZE[dtype]
    if size % itemsize:
        raise UserError(
            f"{key}: {path} has {size} bytes, not a whole number of {dtype} tokens; is "
            "data.token_dtype right?"
        )
    return TokenFile(path, dtype, size // itemsize, 0, vocab, tokenizer)


def _npy_header(path: Path, key: str) -> tuple[str, tuple[int, ...], int]:
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read(f)
            return str(dtype), shape, f.tell()
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: {path} is not a readable .npy file ({e})") from e
