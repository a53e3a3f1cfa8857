"""Checks of data files before any worker starts: existence, kind, dtype, length, vocabulary.

Token ids are checked against the vocabulary the model will really have: model.vocab_size, or the
config.json of a model.hf_path folder (whose model ignores model.vocab_size).

Reads headers, sizes and descriptions only (milliseconds at any corpus size), except text data
that is not byte-tokenized .txt: its length and validation split depend on its token count,
so it is tokenized here too (once per process and version of the files; the workers tokenize it
at start anyway). A raw .bin token id beyond the vocabulary is reported by the worker that
reads it.

Never imports torch at module load: `fsdprun config` runs it without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from fsdprun.config import DataSource, RecipeConfig
from fsdprun.data.files import inspect_token_file
from fsdprun.data.sft import build_sft_datasets, is_sft
from fsdprun.data.text import NO_EOS, build_tokenizer, check_text_file, tokenize_files
from fsdprun.data.windows import num_val_windows
from fsdprun.errors import UserError


@dataclass(frozen=True)
class Vocabulary:
    """The token ids the model will embed: `size`, and what says so (for messages)."""

    size: int
    source: str  # "model.vocab_size", or the HF folder's config.json
    hf: bool

    def too_small(self, needed: int, what: str) -> str:
        """The end of a message for data needing `needed` ids: the real size and the real fix."""
        if not self.hf:
            return f"model.vocab_size is {self.size}; set model.vocab_size >= {needed}"
        return (
            f"the model has {self.size} embeddings ({self.source}); {what} with the model's own "
            "tokenizer (data.tokenizer: the model.hf_path folder), or train a model whose "
            "vocabulary holds it (model.vocab_size does not change a model.hf_path model)"
        )


def model_vocabulary(cfg: RecipeConfig) -> Vocabulary | None:
    """The vocabulary the model will really have: model.vocab_size, or for a model.hf_path
    model its config.json's vocab_size (None when that cannot be read: the worker's build then
    reports the folder)."""
    if cfg.model.hf_path is None:
        return Vocabulary(cfg.model.vocab_size, "model.vocab_size", hf=False)
    file = Path(cfg.model.hf_path) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    size = config.get("vocab_size")
    if size is None and isinstance(config.get("text_config"), dict):
        size = config["text_config"].get("vocab_size")  # a multimodal folder's language model
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return None
    return Vocabulary(size, f"vocab_size in {file}", hf=True)


def check_data(cfg: RecipeConfig) -> list[str]:
    """Problems with the recipe's data files, one message each (empty when fine)."""
    d = cfg.data
    window = cfg.train.seq_len + 1
    try:
        if is_sft(d):  # fine-tuning examples: their own checks (below)
            return _check_sft(cfg)
        if d.source is DataSource.tokens:
            return _check_tokens(cfg, window)
        if d.source is DataSource.text:
            return _check_text(cfg, window)
    except UserError as e:
        return [str(e)]
    return []


def _check_tokens(cfg: RecipeConfig, window: int) -> list[str]:
    d, errors = cfg.data, []
    vocab = model_vocabulary(cfg)
    num_windows = 0
    for key, paths in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
        for p in paths:
            tf = inspect_token_file(Path(p), token_dtype=d.token_dtype.value, key=key)
            if tf.num_tokens < window:
                errors.append(
                    f"{key}: {tf.path} has {tf.num_tokens} tokens, fewer than one sequence "
                    f"(train.seq_len + 1 = {window})"
                )
            elif key == "data.paths":
                num_windows += (tf.num_tokens - 1) // cfg.train.seq_len
            if vocab and tf.vocab_size is not None and tf.vocab_size > vocab.size:
                errors.append(
                    f"{key}: {tf.path} was tokenized with a {tf.vocab_size}-token vocabulary "
                    f"(tokenizer {tf.tokenizer}) but "
                    + vocab.too_small(tf.vocab_size, "tokenize the data again")
                )
    if not errors and d.val_fraction:
        errors += _check_split(num_windows, d.val_fraction)
    return errors


def _check_text(cfg: RecipeConfig, window: int) -> list[str]:
    d, errors = cfg.data, []
    for key, paths in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
        for p in paths:
            check_text_file(Path(p), key=key)
    tok = build_tokenizer(d.tokenizer, d.eos_token)
    vocab = model_vocabulary(cfg)
    if vocab and tok.vocab_size > vocab.size:
        errors.append(
            f"data.tokenizer {tok.name} has {tok.vocab_size} tokens but "
            + vocab.too_small(tok.vocab_size, "tokenize")
        )
    for key, paths in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
        if paths:
            num_tokens = _num_text_tokens(paths, d.tokenizer, d.eos_token, d.text_field)
            if num_tokens < window:
                errors.append(
                    f"{key}: {num_tokens} tokens in all, fewer than one sequence "
                    f"(train.seq_len + 1 = {window})"
                )
            elif key == "data.paths" and d.val_fraction:
                errors += _check_split((num_tokens - 1) // (window - 1), d.val_fraction)
    return errors


def _num_text_tokens(
    paths: list[str], tokenizer: str, eos_token: str | None, text_field: str
) -> int:
    if tokenizer == "byte" and all(p.endswith(".txt") for p in paths):
        # One token per byte plus end-of-text per file (unless data.eos_token is none): known
        # from the sizes.
        eos = 0 if eos_token == NO_EOS else 1
        return sum(Path(p).stat().st_size + eos for p in paths)
    files = tuple((p, *_stamp(p)) for p in paths)
    stamp = tokenizer != "byte" and _stamp(tokenizer)
    return _count_tokens(files, (tokenizer, stamp, eos_token), text_field)


def _stamp(path: str) -> tuple[int, int]:
    st = Path(path).stat()
    return st.st_size, st.st_mtime_ns


# Keyed by the files' sizes and modification times: `fsdprun train` checks the data when it
# reads the recipe and again just before launch, and tokenizing twice would double the wait.
@functools.lru_cache(maxsize=4)
def _count_tokens(files: tuple, tokenizer: tuple, text_field: str) -> int:
    tok = build_tokenizer(tokenizer[0], tokenizer[2])
    return sum(len(ids) for ids in tokenize_files([Path(f[0]) for f in files], tok, text_field))


def _check_split(num_windows: int, val_fraction: float) -> list[str]:
    num_val = num_val_windows(num_windows, val_fraction)
    if num_val < 1 or num_val >= num_windows:
        return [
            f"data.val_fraction={val_fraction} of {num_windows} windows leaves "
            f"{num_val} for validation and {num_windows - num_val} for training; both need at "
            "least one (change the fraction, or use data.val_paths)"
        ]
    return []


def _check_sft(cfg: RecipeConfig) -> list[str]:
    """Fine-tuning examples: every file and record readable (bad file, missing field, no
    messages, no assistant turn, a template that cannot be masked, a hub name: the first one
    found), at least one example fitting a row, a usable split, ids within the vocabulary."""
    d = cfg.data
    stamps = tuple(
        (p, *_stamp(p)) if Path(p).is_file() else (p, 0, 0) for p in [*d.paths, *d.val_paths]
    )
    fields = repr(sorted(dataclasses.asdict(d).items()))
    with_val = bool(d.val_paths or d.val_fraction)
    key = (stamps, fields, cfg.train.seq_len, with_val)
    if key not in _EXAMPLE_CHECKS:
        train, val = build_sft_datasets(
            d, vocab_size=2**62, seq_len=cfg.train.seq_len, seed=0, with_val=with_val
        )
        _EXAMPLE_CHECKS.clear()  # one recipe's data at a time
        _EXAMPLE_CHECKS[key] = max(
            int(ds.examples.tokens.max()) for ds in (train, val) if ds is not None
        )
    top = _EXAMPLE_CHECKS[key]
    vocab = model_vocabulary(cfg)
    if vocab and top >= vocab.size:
        if not vocab.hf:
            return [
                f"data: the examples hold token id {top} but model.vocab_size is "
                f"{vocab.size}; set model.vocab_size > {top} (the tokenizer's vocabulary)"
            ]
        return [
            f"data: the examples hold token id {top} but " + vocab.too_small(top + 1, "tokenize")
        ]
    return []


# The largest token id of the examples, keyed by the files' sizes and modification times and the
# data settings, like _count_tokens: `fsdprun train` checks the data twice before launch, and
# tokenizing is the slow part.
_EXAMPLE_CHECKS: dict[tuple, int] = {}
