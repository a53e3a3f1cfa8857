"""Checks of data files before any worker starts: existence, kind, dtype, length, vocabulary.

Token ids are checked against the vocabulary the model will really have: model.vocab_size, or the
config.json of a model.hf_path folder (whose model ignores model.vocab_size).

What the data is comes from `describe_data` (the package's front door, `spec`). Reads headers,
sizes and descriptions only (milliseconds at any corpus size), except text data that is not
byte-tokenized .txt and fine-tuning examples: their length, split and token ids depend on their
tokens, so they are tokenized here, once (the `DataSpec` keeps the tokens for the workers: see
`spec`). A raw .bin token id beyond the vocabulary is reported by the worker that reads it.

Never imports torch at module load: `fsdprun config` runs it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fsdprun.config import RecipeConfig
from fsdprun.config.model_facts import model_facts
from fsdprun.data.sft import fit_examples, split_examples
from fsdprun.data.spec import FILE_KEYS, DataKind, DataSpec, describe_data
from fsdprun.data.text import check_text_file
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
    """The vocabulary the model will really have (`model_facts`): model.vocab_size, or for a
    model.hf_path model its config.json's vocab_size (a multimodal folder's text_config's; None
    when that cannot be read: the worker's build then reports the folder)."""
    if cfg.model.hf_path is None:
        return Vocabulary(cfg.model.vocab_size, "model.vocab_size", hf=False)
    facts = model_facts(cfg.model)
    if facts is None or facts.vocab_size is None:
        return None
    return Vocabulary(facts.vocab_size, f"vocab_size in {facts.source}", hf=True)


def check_data(cfg: RecipeConfig) -> list[str]:
    """Problems with the recipe's data files, one message each (empty when fine)."""
    window = cfg.train.seq_len + 1
    try:
        spec = describe_data(cfg.data)
        if spec.masked:  # fine-tuning examples: their own checks (below)
            return _check_sft(cfg, spec)
        if spec.kind is DataKind.tokens:
            return _check_tokens(cfg, spec, window)
        if spec.kind is DataKind.text:
            return _check_text(cfg, spec, window)
    except UserError as e:
        return [str(e)]
    return []


def _check_tokens(cfg: RecipeConfig, spec: DataSpec, window: int) -> list[str]:
    errors = []
    vocab = model_vocabulary(cfg)
    num_windows = 0
    for key in FILE_KEYS:
        for tf in spec.token_files(key):
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
    if not errors and cfg.data.val_fraction:
        errors += _check_split(num_windows, cfg.data.val_fraction)
    return errors


def _check_text(cfg: RecipeConfig, spec: DataSpec, window: int) -> list[str]:
    d, errors = cfg.data, []
    for key in FILE_KEYS:
        for p in spec.paths(key):
            check_text_file(Path(p), key=key)
    tok = spec.tokenizer
    vocab = model_vocabulary(cfg)
    if vocab and tok.vocab_size > vocab.size:
        errors.append(
            f"data.tokenizer {tok.name} has {tok.vocab_size} tokens but "
            + vocab.too_small(tok.vocab_size, "tokenize")
        )
    for key in FILE_KEYS:
        if spec.paths(key):
            num_tokens = spec.num_text_tokens(key)
            if short := spec.short_text(key, num_tokens, cfg.train.seq_len):
                errors.append(short)
            elif key == "data.paths" and d.val_fraction:
                errors += _check_split((num_tokens - 1) // (window - 1), d.val_fraction)
    return errors


def _check_split(num_windows: int, val_fraction: float) -> list[str]:
    num_val = num_val_windows(num_windows, val_fraction)
    if num_val < 1 or num_val >= num_windows:
        return [
            f"data.val_fraction={val_fraction} of {num_windows} windows leaves "
            f"{num_val} for validation and {num_windows - num_val} for training; both need at "
            "least one (change the fraction, or use data.val_paths)"
        ]
    return []


def _check_sft(cfg: RecipeConfig, spec: DataSpec) -> list[str]:
    """Fine-tuning examples: every file and record readable (bad file, missing field, no
    messages, no assistant turn, a template that cannot be masked, a hub name: the first one
    found), a usable split, at least one example of each stream fitting a row, ids within the
    vocabulary. The steps that the workers' rows take (`split_examples`, `fit_examples`), on
    the examples the `DataSpec` keeps for them; no rows are built."""
    d, row_len, top = cfg.data, cfg.train.seq_len + 1, 0
    for stream, loaded in split_examples(spec, with_val=bool(d.val_paths or d.val_fraction)):
        fit_examples(loaded.examples, row_len=row_len, truncate=d.truncate, stream=stream)
        top = max(top, int(loaded.examples.tokens.max()))
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
