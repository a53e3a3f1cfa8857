"""Fine-tuning examples as training rows: fit to the sequence length, pack or pad, mask.

Examples (see `sft_examples`) longer than seq_len + 1 tokens are dropped or cut (data.truncate);
an example left with no trained token is dropped. The kept examples become rows of seq_len + 1
tokens, once, before training:

- data.pack=true: the examples in a seeded order (from train.seed alone), each appended to the
  current row while it fits, else starting the next one; the tail of a row is padding.
- data.pack=false: one example per row, padded.

Row r's targets are the next tokens where they are trained and belong to the same example;
prompt tokens, padding and the first token of each example (it would be predicted from the
example before it) are IGNORE_INDEX. Positions restart at 0 with each example; document ids
number a row's examples (padding: -1). Sample i is row perm_e[i mod R] with e = i // R, one
permutation per epoch from (seed, stream, e) — the same rows in the same order at any world
size, as for token windows.

`prepare_sft_data` (`fsdprun prepare-data --source chat|instruct|hf_dataset`) writes the
tokenized examples once; `data.source: tokens` on its train.bin then trains without tokenizing:

    OUT/train.bin          token ids (uint16 or uint32, as data.json's dtype), all examples
    OUT/train.mask.bin     uint8, one per token: 1 = a target
    OUT/train.offsets.npy  int64 [num_examples + 1]: example k is tokens[offsets[k]:offsets[k+1]]
    OUT/val.*              the same for the validation examples (--val-fraction)
    OUT/data.json          {"format": "fsdprun-sft", "dtype", "vocab_size", "tokenizer", ...}

Never imports torch at module load (prepare-data and the preflight run without it); the row
builders import it where they make tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdprun.config import CHAT_ROLES, ChatTurns, DataConfig, DataSource, Truncate
from fsdprun.data.batch import IGNORE_INDEX, Row
from fsdprun.data.files import DESCRIPTION, read_description, token_dtype_for
from fsdprun.data.lazy_numpy import np
from fsdprun.data.sft_examples import SFT_SOURCES, Examples, tokenize_examples
from fsdprun.data.windows import VOCAB_FIX, EpochOrder, _epoch_seed
from fsdprun.errors import UserError
from fsdprun.staging import staged_folder

if TYPE_CHECKING:
    from fsdprun.data.spec import DataSpec

SFT_FORMAT = "fsdprun-sft"


@dataclass(frozen=True)
class FitCounts:
    examples: int
    kept: int
    dropped: int  # too long under `drop`, or no trained token left after cutting
    truncated: int
    trained_tokens: int

    def __str__(self) -> str:
        return (
            f"{self.examples:,} examples, {self.kept:,} kept, {self.dropped:,} dropped, "
            f"{self.truncated:,} truncated, {self.trained_tokens:,} trained tokens"
        )


def fit_examples(
    examples: Examples, *, row_len: int, truncate: Truncate
) -> tuple[np.ndarray, np.ndarray, FitCounts]:
    """Starts and lengths (into the flat arrays) of the examples kept for rows of `row_len`
    tokens, and the counts."""
    offsets = np.asarray(examples.offsets, dtype=np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    long = lengths > row_len
    if truncate is Truncate.drop:
        keep = ~long
    else:
        keep = np.ones(len(lengths), dtype=bool)
        lengths = np.minimum(lengths, row_len)
    # The first token of an example is never a target (nothing of the example precedes it).
    cum = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(examples.mask, dtype=np.int64)])
    trained = cum[starts + lengths] - cum[np.minimum(starts + 1, starts + lengths)]
    keep &= trained > 0
    counts = FitCounts(
        examples=len(lengths),
        kept=int(keep.sum()),
        dropped=int((~keep).sum()),
        truncated=int((long & keep).sum()) if truncate is Truncate.truncate else 0,
        trained_tokens=int(trained[keep].sum()),
    )
    return starts[keep], lengths[keep], counts


def pack_rows(
    lengths: np.ndarray, *, row_len: int, pack: bool, seed: int, stream: str
) -> list[np.ndarray]:
    """The kept examples of each row (indices into `lengths`)."""
    if not pack:
        return [np.array([k]) for k in range(len(lengths))]
    rng = np.random.Generator(np.random.PCG64(_epoch_seed(seed, f"{stream}/pack", 0)))
    rows, current, used = [], [], 0
    for k in rng.permutation(len(lengths)):
        n = int(lengths[k])
        if used + n > row_len:
            rows.append(np.array(current))
            current, used = [], 0
        current.append(int(k))
        used += n
    if current:
        rows.append(np.array(current))
    return rows


class SFTData:
    """Rows of whole fine-tuning examples, in an order set by the seed (see the module doc).

    Args:
        examples: the tokenized examples (in memory or memory-mapped).
        seq_len: train.seq_len (rows hold seq_len + 1 tokens).
        seed: train.seed.
        stream: `train` or `val`.
        pack: data.pack.
        truncate: data.truncate.
        vocab_size: the model's; a larger token id fails with a clear message.
        pad_id: the token id of padding (never trained, never attended from a real token when
            the model masks documents).
        kind: what the data is, for the description line.
    """

    def __init__(
        self, examples: Examples, *, seq_len: int, seed: int, stream: str, pack: bool,
        truncate: Truncate, vocab_size: int, pad_id: int, kind: str,
    ):  # fmt: skip
        self.examples, self.seq_len, self.seed, self.stream = examples, seq_len, seed, stream
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.starts, self.lengths, self.counts = fit_examples(
            examples, row_len=seq_len + 1, truncate=truncate
        )
        if self.counts.kept == 0:
            raise UserError(
                f"{stream} data: none of its {self.counts.examples} examples fits "
                f"train.seq_len + 1 = {seq_len + 1} tokens with a trained token ({self.counts}); "
                "raise train.seq_len or set data.truncate=truncate"
            )
        self.rows = pack_rows(
            self.lengths, row_len=seq_len + 1, pack=pack, seed=seed, stream=stream
        )
        self.num_samples = len(self.rows)
        layout = "packed" if pack else "padded, one example each"
        self.description = (
            f"{kind}: {self.counts}; {self.num_samples:,} rows of {seq_len + 1} tokens ({layout})"
        )
        # The permutation of rows used in each epoch.
        self.order = EpochOrder(self.num_samples, seed=seed, stream=stream)

    def sample(self, index: int) -> Row:
        """Sample `index`: a `Row` of seq_len + 1 tokens, CPU int64."""
        import torch

        epoch, k = divmod(index, self.num_samples)
        size = self.seq_len + 1
        tokens = np.full(size, self.pad_id, dtype=np.int64)
        trained = np.zeros(size, dtype=bool)
        positions = np.zeros(size, dtype=np.int64)
        doc = np.full(size, -1, dtype=np.int64)
        at = 0
        for j, e in enumerate(self.rows[int(self.order(epoch)[k])]):
            s, n = int(self.starts[e]), int(self.lengths[e])
            tokens[at : at + n] = self.examples.tokens[s : s + n]
            trained[at : at + n] = self.examples.mask[s : s + n]
            positions[at : at + n] = np.arange(n)
            doc[at : at + n] = j
            at += n
        top = int(tokens.max())
        if top >= self.vocab_size:
            raise UserError(
                f"{self.stream} data holds token id {top} but the model embeds "
                f"{self.vocab_size} ids {VOCAB_FIX}"
            )
        same = (doc[1:] == doc[:-1]) & (doc[1:] >= 0)
        targets = np.where(trained[1:] & same, tokens[1:], IGNORE_INDEX)
        return Row(
            tokens=torch.from_numpy(tokens),
            targets=torch.from_numpy(targets),
            positions=torch.from_numpy(positions[:-1]),
            doc_ids=torch.from_numpy(doc[:-1]),
        )


# --------------------------------------------------------------------------------------------
# Reading prepared folders, and building rows from a DataSpec


def prepared_description(paths: list[str]) -> dict[str, Any] | None:
    """The data.json of a prepared fine-tuning folder whose files `paths` are, else None."""
    if not paths:
        return None
    desc = read_description(Path(paths[0]).parent)
    if desc is None or desc.get("format") != SFT_FORMAT:
        return None
    return desc


def open_prepared(path: Path, *, key: str) -> tuple[Examples, dict[str, Any]]:
    """The examples of a prepared train.bin / val.bin (memory-mapped: nothing read yet)."""
    desc = read_description(path.parent)
    if desc is None or desc.get("format") != SFT_FORMAT or path.name not in desc["files"]:
        raise UserError(
            f"{key}: {path} is not a file of a prepared fine-tuning folder (its data.json must "
            f"say format {SFT_FORMAT} and list it); list only such files"
        )
    stem = path.name.removesuffix(".bin")
    try:
        tokens = np.memmap(path, dtype=desc["dtype"], mode="r")
        mask = np.memmap(path.parent / f"{stem}.mask.bin", dtype=np.uint8, mode="r")
        offsets = np.load(path.parent / f"{stem}.offsets.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: {path.parent} is incomplete ({e}); prepare it again") from e
    if len(mask) != len(tokens) or int(offsets[-1]) != len(tokens):
        raise UserError(f"{key}: {path.parent} has mismatched files; prepare it again")
    return Examples(tokens, mask, offsets), desc


def concat_examples(parts: list[Examples]) -> Examples:
    """The examples of several prepared files as one `Examples`, in order."""
    sizes = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
    offsets = [parts[0].offsets[:1]] + [
        p.offsets[1:] + s for p, s in zip(parts, sizes, strict=True)
    ]
    return Examples(
        np.concatenate([np.asarray(p.tokens) for p in parts]),
        np.concatenate([np.asarray(p.mask) for p in parts]),
        np.concatenate([np.asarray(o, dtype=np.int64) for o in offsets]),
    )


def build_sft_datasets(
    spec: DataSpec, *, vocab_size: int, seq_len: int, seed: int, with_val: bool
) -> tuple[SFTData, SFTData | None]:
    """The training rows and, when `with_val`, the validation rows of fine-tuning data: from
    data.val_paths, or the last data.val_fraction of the examples (in file order)."""
    cfg = spec.cfg
    loaded = spec.examples("data.paths")
    examples, kind, pad_id = loaded.examples, loaded.kind, loaded.pad_id

    def rows(ex: Examples, stream: str, kind: str) -> SFTData:
        return SFTData(
            ex, seq_len=seq_len, seed=seed, stream=stream, pack=cfg.pack, truncate=cfg.truncate,
            vocab_size=vocab_size, pad_id=pad_id, kind=kind,
        )  # fmt: skip

    n = examples.num_examples
    num_val = round(n * cfg.val_fraction)
    if cfg.val_fraction and not 0 < num_val < n:
        raise UserError(
            f"data.val_fraction={cfg.val_fraction} of {n} examples leaves {num_val} for "
            f"validation and {n - num_val} for training; both need at least one"
        )
    train = rows(examples.take(range(n - num_val)) if num_val else examples, "train", kind)
    if not with_val:
        return train, None
    if cfg.val_paths:
        val = spec.examples("data.val_paths")
        return train, rows(val.examples, "val", val.kind)
    return train, rows(examples.take(range(n - num_val, n)), "val", kind)


# --------------------------------------------------------------------------------------------
# prepare-data


def _write_examples(stage: Path, stem: str, examples: Examples, dtype: str) -> dict[str, int]:
    (stage / f"{stem}.bin").write_bytes(np.asarray(examples.tokens).astype(dtype).tobytes())
    (stage / f"{stem}.mask.bin").write_bytes(np.asarray(examples.mask).astype(np.uint8).tobytes())
    np.save(stage / f"{stem}.offsets.npy", np.asarray(examples.offsets, dtype=np.int64))
    return {
        "num_tokens": len(examples.tokens),
        "num_examples": examples.num_examples,
        "num_trained_tokens": int(np.count_nonzero(examples.mask)),
    }


def prepare_sft_data(cfg: DataConfig, out: Path, *, val_fraction: float = 0.0) -> dict[str, Any]:
    """Tokenize the fine-tuning examples of `cfg` (source chat, instruct or hf_dataset; paths,
    tokenizer, fields, template, chat_turns) into OUT (see the module doc): train.* and, with
    `val_fraction`, val.* holding the last examples. Fitting to a sequence length and packing
    happen at training time, so one folder serves any train.seq_len.

    Returns:
        The description written to OUT/data.json.

    Raises:
        UserError: a bad input (as for training), a non-empty OUT, a fraction leaving no examples.
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if not cfg.paths:
        raise UserError("no inputs; pass example files or a saved dataset folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder (nothing is overwritten)")
    examples, tok = tokenize_examples(cfg.paths, cfg, key="input")
    n = examples.num_examples
    num_val = round(n * val_fraction)
    if val_fraction and not 0 < num_val < n:
        raise UserError(
            f"--val-fraction {val_fraction} of {n} examples leaves {num_val} for validation and "
            f"{n - num_val} for training; both need at least one"
        )
    dtype = token_dtype_for(tok.vocab_size)
    with staged_folder(out) as stage:
        files = {
            "train.bin": _write_examples(stage, "train", examples.take(range(n - num_val)), dtype)
        }
        if num_val:
            files["val.bin"] = _write_examples(
                stage, "val", examples.take(range(n - num_val, n)), dtype
            )
        description = {
            "format": SFT_FORMAT,
            "version": 1,
            "dtype": dtype,
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.name,
            "eos_id": tok.eos_id,
            "source": cfg.source.value,
            "num_examples": n,
            "num_tokens": len(examples.tokens),
            "files": files,
            "sources": list(cfg.paths),
            "chat_turns": cfg.chat_turns.value,
            "prompt_field": cfg.prompt_field,
            "response_field": cfg.response_field,
            "template": cfg.template,
        }
        (stage / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    return description


def prepare_sft_examples(
    inputs: list[Path],
    out: Path,
    *,
    source: str,
    tokenizer: str,
    val_fraction: float,
    chat_turns: str = "all",
    prompt_field: str = "prompt",
    response_field: str = "response",
    template: str | None = None,
    roles: list[str] | None = None,
    max_line_bytes: int = 1 << 20,
    eos_token: str | None = None,
) -> dict[str, Any]:
    """`prepare_sft_data` from command-line values (checked here, one line each); `roles` are
    `--role NAME=ROLE` values (data.roles)."""

    def choice(enum_type, value: str, flag: str):
        try:
            return enum_type(value)
        except ValueError:
            names = ", ".join(e.value for e in enum_type)
            raise UserError(f"{flag} {value!r} is not one of: {names}") from None

    kind = choice(DataSource, source, "--source")
    if kind not in SFT_SOURCES:
        raise UserError(f"--source {source}: prepare-data takes text, chat, instruct or hf_dataset")
    if max_line_bytes <= 0:
        raise UserError(f"--max-line-bytes must be > 0 (got {max_line_bytes})")
    role_map = {}
    for spec in roles or []:
        name, eq, to = spec.partition("=")
        if not (eq and name and (to in CHAT_ROLES or to == name)):
            raise UserError(
                f"--role {spec!r} is not NAME=ROLE with ROLE one of {', '.join(CHAT_ROLES)} "
                "(or NAME itself, to pass the role to the chat template as it is)"
            )
        role_map[name] = to
    cfg = DataConfig(
        source=kind, paths=[str(p.resolve()) for p in inputs], tokenizer=tokenizer,
        chat_turns=choice(ChatTurns, chat_turns, "--chat-turns"), prompt_field=prompt_field,
        response_field=response_field, roles=role_map, max_line_bytes=max_line_bytes,
        eos_token=eos_token,
    )  # fmt: skip
    if template is not None:
        cfg.template = template
    if kind is DataSource.instruct and "{prompt}" not in cfg.template:
        raise UserError(
            f"--template {cfg.template!r} has no {{prompt}}; put it where the prompt goes"
        )
    return prepare_sft_data(cfg, out, val_fraction=val_fraction)
