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
before it trains in the same process. Workers started by `spawn` (accelerators) tokenize it
again: the launcher lets its copy go first (`forget_data`), so it holds no second copy for the
whole run.

Never imports torch (the preflight runs without it); numpy only where it tokenizes.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fsdprun.config import DataConfig, DataSource
from fsdprun.data.files import TokenFile, inspect_token_file
from fsdprun.data.lazy_numpy import np
from fsdprun.data.sft import concat_examples, open_prepared, prepared_description
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
    # What this spec tokenized, by key ("data.paths"/"data.val_paths"): token arrays (text) or
    # `LoadedExamples` (examples).
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
        tokenized once per spec."""
        if key not in self._tokenized:
            paths = [Path(p) for p in self.paths(key)]
            self._tokenized[key] = tokenize_to_array(paths, self.tokenizer, self.cfg.text_field)
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

    def examples(self, key: str) -> LoadedExamples:
        """The fine-tuning examples of `key`: tokenized once per spec, or memory-mapped from a
        prepared folder.

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
        examples, tok = tokenize_examples(paths, self.cfg, key=key)
        what = self.cfg.source.value
        if self.cfg.source is DataSource.chat:
            what += f" ({self.cfg.chat_turns.value} assistant turns)"
        kind = f"{what}: {len(paths)} file(s), {tok.name} tokenizer"
        self._tokenized[key] = LoadedExamples(examples, kind, tok.eos_id or 0)
        return self._tokenized[key]


def _kind(cfg: DataConfig) -> DataKind:
    if cfg.source in SFT_SOURCES:
        return DataKind.examples
    if cfg.source is DataSource.tokens:
        # A folder `prepare-data` made of examples says so in its data.json.
        return DataKind.prepared if prepared_description(cfg.paths) else DataKind.tokens
    return DataKind(cfg.source.value)


def _stamp(path: str) -> tuple[str, int, int]:
    """A file or folder as its size and modification time: a change means tokenizing again."""
    try:
        st = Path(path).stat()
    except OSError:
        return path, 0, 0  # missing: the checks name it
    return path, st.st_size, st.st_mtime_ns


# The last spec described, under the data settings and the stamps of the files it read: one
# recipe's data at a time.
_LAST: tuple[tuple, DataSpec] | None = None


def describe_data(cfg: DataConfig) -> DataSpec:
    """The dataset `cfg` asks for; the same `DataSpec` (and so what it tokenized) as the last
    call while the settings and the files are unchanged.

    Raises:
        UserError: a data.json beside the token files that cannot be read.
    """
    global _LAST
    files = [*cfg.paths, *cfg.val_paths]
    if cfg.source is not DataSource.synthetic and cfg.tokenizer != "byte":
        files.append(cfg.tokenizer)
    key = (repr(sorted(dataclasses.asdict(cfg).items())), tuple(_stamp(p) for p in files))
    if _LAST is None or _LAST[0] != key:
        _LAST = (key, DataSpec(cfg, _kind(cfg)))
    return _LAST[1]


def forget_data() -> None:
    """Let the last spec go (with what it tokenized): for a launcher whose workers will not
    inherit it."""
    global _LAST
    _LAST = None
