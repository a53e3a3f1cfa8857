"""The data package's front door: what dataset a recipe's `data` section asks for, in one place.

`describe_data(cfg)` answers each question about the data once: which kind it is (no files,
token files, text, fine-tuning examples, a prepared folder of examples), which files each key
names, which tokenizer reads them, how many tokens they hold, whether rows carry masks. The
launcher's preflight (`preflight.check_data`) and the workers' `build_datasets` both start here.

Tokenizing is the slow part of starting a run on text or fine-tuning examples, and both sides
need the tokens: the preflight to count them and check their ids, the workers to train on them.
A `DataSpec` keeps what it tokenized, and `describe_data` hands out the same `DataSpec` while
the recipe's data settings and its files' sizes and modification times stay the same. So the
launcher tokenizes once for its checks (it checks twice before launch), and what it made is
reused by the workers it forks (CPU runs) and by a torchrun or srun rank, which checks its data
before it trains in the same process. For workers started by `spawn` (accelerators), which
inherit nothing, the launcher writes it into the run directory (`save_tokenized`, then lets its
copy go, and deletes it when the run ends) and they memory-map it (`describe_data(cfg,
saved=...)`): one copy in the page cache for every rank of the node, nothing tokenized twice.

    RUN_DIR/tokenized/<key>/tokenized.json       what each data key holds (kind, pad id)
    RUN_DIR/tokenized/<key>/paths.tokens.npy     data.paths' tokens (text or examples)
    RUN_DIR/tokenized/<key>/paths.mask.npy       examples: 1 = a target
    RUN_DIR/tokenized/<key>/paths.offsets.npy    examples: example k is tokens[offsets[k]:...]
    RUN_DIR/tokenized/<key>/val_paths.*          the same for data.val_paths

<key> is a digest of the data settings and of the files' sizes and modification times (those
of a folder's files for a folder, such as a tokenizer's): the key `describe_data` reuses a
spec under, so a worker reads only tokens of the data it would have tokenized itself, and
tokenizes for itself what it does not find there.

Never imports torch (the preflight runs without it); numpy only where it tokenizes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fsdprun.config import DataConfig, DataSource
from fsdprun.data.files import TokenFile, inspect_token_file
from fsdprun.data.lazy_numpy import np
from fsdprun.data.prepared import concat_examples, open_prepared, prepared_description
from fsdprun.data.sft_examples import SFT_SOURCES, Examples, tokenize_examples
from fsdprun.data.text import NO_EOS, ByteTokenizer, HFTokenizer, build_tokenizer, tokenize_to_array

# The recipe keys that name files, in the order the checks read them.
FILE_KEYS = ("data.paths", "data.val_paths")


class DataKind(enum.Enum):
    """What the data is, which decides how it becomes samples."""

    synthetic = "synthetic"  # no files: sample i from (seed, i)
    tokens = "tokens"  # token files: windows
    text = "text"  # .txt/.jsonl tokenized at start: windows
    examples = "examples"  # chat, instruct or hf_dataset records tokenized at start: masked rows
    prepared = "prepared"  # a `prepare-data` folder of examples: masked rows, nothing tokenized


@dataclass(frozen=True)
class LoadedExamples:
    """The fine-tuning examples of one key, what they are (for the run header) and the id that
    pads their rows."""

    examples: Examples
    kind: str
    pad_id: int


@dataclass(frozen=True, eq=False)
class DataSpec:
    """The dataset `cfg` asks for (see the module doc); build it with `describe_data`."""

    cfg: DataConfig
    kind: DataKind
    digest: str = ""  # of the settings and the files' stamps (`describe_data`)
    saved: Path | None = None  # a folder of `save_tokenized`, read rather than tokenizing
    # What this spec tokenized (or read from `saved`), by key ("data.paths"/"data.val_paths"):
    # token arrays (text) or `LoadedExamples` (examples).
    _tokenized: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def masked(self) -> bool:
        """Whether samples are rows of whole examples with masked targets (fine-tuning data),
        rather than windows of a token stream."""
        return self.kind in (DataKind.examples, DataKind.prepared)

    def paths(self, key: str) -> list[str]:
        """The files recipe key `key` (one of FILE_KEYS) names."""
        return {"data.paths": self.cfg.paths, "data.val_paths": self.cfg.val_paths}[key]

    @cached_property
    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        """The tokenizer of text data (data.tokenizer, with data.eos_token)."""
        return build_tokenizer(self.cfg.tokenizer, self.cfg.eos_token)

    def token_files(self, key: str) -> list[TokenFile]:
        """What each token file of `key` holds, from headers and sizes.

        Raises:
            UserError: the first file missing, of an unknown kind, of a wrong dtype or size.
        """
        dtype = self.cfg.token_dtype.value
        return [inspect_token_file(Path(p), token_dtype=dtype, key=key) for p in self.paths(key)]

    def text_tokens(self, key: str) -> np.ndarray:
        """The text of `key` tokenized into one stream (each document followed by end-of-text);
        tokenized once per spec, or read from the launcher's (`saved`)."""
        if key not in self._tokenized:
            tokens = self._read_saved(key)
            if tokens is None:
                paths = [Path(p) for p in self.paths(key)]
                tokens = tokenize_to_array(paths, self.tokenizer, self.cfg.text_field)
            self._tokenized[key] = tokens
        return self._tokenized[key]

    def num_text_tokens(self, key: str) -> int:
        """How many tokens the text of `key` holds: from the file sizes for byte-tokenized .txt
        files (one token per byte plus end-of-text per file, unless data.eos_token is none), so
        `fsdprun config` answers without numpy; by tokenizing otherwise."""
        paths = self.paths(key)
        if self.cfg.tokenizer == "byte" and all(p.endswith(".txt") for p in paths):
            eos = 0 if self.cfg.eos_token == NO_EOS else 1
            return sum(Path(p).stat().st_size + eos for p in paths)
        return len(self.text_tokens(key))

    def short_text(self, key: str, num_tokens: int, seq_len: int) -> str | None:
        """The problem of `key`'s text when its `num_tokens` make no sequence of seq_len + 1
        tokens (the preflight's count, or a worker's tokens), else None."""
        if num_tokens >= seq_len + 1:
            return None
        return (f"{key}: {num_tokens} tokens in all, fewer than one sequence "
                f"(train.seq_len + 1 = {seq_len + 1})")  # fmt: skip

    def examples(self, key: str) -> LoadedExamples:
        """The fine-tuning examples of `key`: tokenized once per spec (or read from the
        launcher's, `saved`), or memory-mapped from a prepared folder.

        Raises:
            UserError: a bad file or record (see `tokenize_examples`), an incomplete folder.
        """
        if key in self._tokenized:
            return self._tokenized[key]
        paths = self.paths(key)
        if self.kind is DataKind.prepared:
            parts = [open_prepared(Path(p), key=key) for p in paths]
            desc = parts[0][1]
            examples = parts[0][0] if len(parts) == 1 else concat_examples([e for e, _ in parts])
            kind = f"prepared {desc['source']} examples ({desc['tokenizer']} tokenizer)"
            return LoadedExamples(examples, kind, desc.get("eos_id") or 0)
        loaded = self._read_saved(key)
        if loaded is None:
            examples, tok = tokenize_examples(paths, self.cfg, key=key)
            what = self.cfg.source.value
            if self.cfg.source is DataSource.chat:
                what += f" ({self.cfg.chat_turns.value} assistant turns)"
            kind = f"{what}: {len(paths)} file(s), {tok.name} tokenizer"
            loaded = LoadedExamples(examples, kind, tok.eos_id or 0)
        self._tokenized[key] = loaded
        return loaded

    def _read_saved(self, key: str) -> np.ndarray | LoadedExamples | None:
        """What `save_tokenized` wrote of `key` for this spec's data, memory-mapped; None
        when nothing was (a missing or unreadable folder: tokenized here instead)."""
        if self.saved is None:
            return None
        folder, stem = self.saved / self.digest, key.removeprefix("data.")
        try:
            entry = json.loads((folder / SAVED_INDEX).read_text())[key]
            arrays = {part: np.load(folder / f"{stem}.{part}.npy", mmap_mode="r")
                      for part in entry["parts"]}  # fmt: skip
        except (OSError, ValueError, KeyError):
            return None
        if "kind" not in entry:
            return arrays["tokens"]
        examples = Examples(arrays["tokens"], arrays["mask"], arrays["offsets"])
        return LoadedExamples(examples, entry["kind"], entry["pad_id"])


def _kind(cfg: DataConfig) -> DataKind:
    if cfg.source in SFT_SOURCES:
        return DataKind.examples
    if cfg.source is DataSource.tokens:
        # A folder `prepare-data` made of examples says so in its data.json.
        return DataKind.prepared if prepared_description(cfg.paths) else DataKind.tokens
    return DataKind(cfg.source.value)


def _stamp(path: str) -> tuple:
    """A file as its size and modification time, a folder as those of its files: a change
    means tokenizing again."""
    p = Path(path)
    try:
        if p.is_dir():
            return path, tuple(_stamp(str(f)) for f in sorted(p.iterdir()) if f.is_file())
        st = p.stat()
    except OSError:
        return path, 0, 0  # missing: the checks name it
    return path, st.st_size, st.st_mtime_ns


# The last spec described, under the data settings and the stamps of the files it read: one
# recipe's data at a time.
_LAST: tuple[tuple, DataSpec] | None = None
SAVED_INDEX = "tokenized.json"  # in a `save_tokenized` folder: written last


def describe_data(cfg: DataConfig, *, saved: Path | None = None) -> DataSpec:
    """The dataset `cfg` asks for; the same `DataSpec` (and so what it tokenized) as the last
    call while the settings and the files are unchanged.

    Args:
        saved: a folder `save_tokenized` wrote (RUN_DIR/tokenized): a new spec reads its tokens
            from there where they are of the same data, rather than tokenizing.

    Raises:
        UserError: a data.json beside the token files that cannot be read.
    """
    global _LAST
    files = [*cfg.paths, *cfg.val_paths]
    if cfg.source is not DataSource.synthetic and cfg.tokenizer != "byte":
        files.append(cfg.tokenizer)
    key = (repr(sorted(dataclasses.asdict(cfg).items())), tuple(_stamp(p) for p in files))
    if _LAST is None or _LAST[0] != key:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        _LAST = (key, DataSpec(cfg, _kind(cfg), digest, saved))
    return _LAST[1]


def forget_data() -> None:
    """Let the last spec go (with what it tokenized): for a launcher whose workers will not
    inherit it."""
    global _LAST
    _LAST = None


def save_tokenized(cfg: DataConfig, folder: Path) -> None:
    """Write what the checks tokenized of `cfg` into `folder` (see the module doc) for workers
    that do not inherit this process, and let it go. Nothing is written when nothing was
    tokenized, or when `folder` holds it already (an earlier session's, another node's).

    Raises:
        OSError: the folder cannot be written (nothing is left half written).
    """
    spec = describe_data(cfg)
    forget_data()
    target = folder / spec.digest
    if not spec._tokenized or (target / SAVED_INDEX).is_file():
        return
    # Written beside it, then renamed: a worker finds all of it or none.
    stage = folder / f".{spec.digest}.tmp-{os.getpid()}"
    try:
        stage.mkdir(parents=True)
        index = {}
        for key, value in spec._tokenized.items():
            stem = key.removeprefix("data.")
            if isinstance(value, LoadedExamples):
                ex = value.examples
                parts = {"tokens": ex.tokens, "mask": ex.mask, "offsets": ex.offsets}
                index[key] = {"parts": list(parts), "kind": value.kind, "pad_id": value.pad_id}
            else:
                parts = {"tokens": value}
                index[key] = {"parts": ["tokens"]}
            for part, array in parts.items():
                np.save(stage / f"{stem}.{part}.npy", np.asarray(array))
        (stage / SAVED_INDEX).write_text(json.dumps(index))
        try:
            stage.rename(target)
        except OSError:
            if not (target / SAVED_INDEX).is_file():
                raise
            # Another node's launcher wrote the same tokens first (a shared run directory).
    finally:
        shutil.rmtree(stage, ignore_errors=True)
