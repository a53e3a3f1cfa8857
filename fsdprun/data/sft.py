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

The examples come from the data's `DataSpec` (tokenized once, or a prepared folder: see
`prepared`). The preflight checks them with the same two steps the rows take, `split_examples`
and `fit_examples`, without building rows.

Never imports torch at module load (the preflight runs without it); the row builders import it
where they make tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdprun.config import Truncate
from fsdprun.data.batch import IGNORE_INDEX, Row
from fsdprun.data.lazy_numpy import np
from fsdprun.data.windows import VOCAB_FIX, EpochOrder, epoch_seed
from fsdprun.errors import UserError

if TYPE_CHECKING:
    from fsdprun.data.sft_examples import Examples
    from fsdprun.data.spec import DataSpec, LoadedExamples


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
    examples: Examples, *, row_len: int, truncate: Truncate, stream: str
) -> tuple[np.ndarray, np.ndarray, FitCounts]:
    """Starts and lengths (into the flat arrays) of the examples of `stream` (`train` or `val`)
    kept for rows of `row_len` (train.seq_len + 1) tokens, and the counts.

    Raises:
        UserError: no example kept (too long under data.truncate=drop, or no trained token).
    """
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
    if counts.kept == 0:
        raise UserError(
            f"{stream} data: none of its {counts.examples} examples fits "
            f"train.seq_len + 1 = {row_len} tokens with a trained token ({counts}); "
            "raise train.seq_len or set data.truncate=truncate"
        )
    return starts[keep], lengths[keep], counts


def pack_rows(
    lengths: np.ndarray, *, row_len: int, pack: bool, seed: int, stream: str
) -> list[np.ndarray]:
    """The kept examples of each row (indices into `lengths`)."""
    if not pack:
        return [np.array([k]) for k in range(len(lengths))]
    rng = np.random.Generator(np.random.PCG64(epoch_seed(seed, f"{stream}/pack", 0)))
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
            examples, row_len=seq_len + 1, truncate=truncate, stream=stream
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
# Building rows from a DataSpec


def split_examples(spec: DataSpec, *, with_val: bool) -> Iterator[tuple[str, LoadedExamples]]:
    """The examples of the training rows, then, when `with_val`, those of the validation rows:
    data.val_paths, or the last data.val_fraction of the examples (in file order). Each is
    yielded as `(stream, examples)`; data.val_paths is read only when its turn comes, so a
    caller that checks the training examples first reports their problem first.

    Raises:
        UserError: a data.val_fraction that leaves no example on one side, or what
            `DataSpec.examples` raises.
    """
    cfg = spec.cfg
    loaded = spec.examples("data.paths")
    examples = loaded.examples
    n = examples.num_examples
    num_val = round(n * cfg.val_fraction)
    if cfg.val_fraction and not 0 < num_val < n:
        raise UserError(
            f"data.val_fraction={cfg.val_fraction} of {n} examples leaves {num_val} for "
            f"validation and {n - num_val} for training; both need at least one"
        )
    train = examples.take(range(n - num_val)) if num_val else examples
    yield "train", dataclasses.replace(loaded, examples=train)
    if not with_val:
        return
    if cfg.val_paths:
        val = spec.examples("data.val_paths")  # both streams pad with the training data's id
        yield "val", dataclasses.replace(val, pad_id=loaded.pad_id)
    else:
        yield "val", dataclasses.replace(loaded, examples=examples.take(range(n - num_val, n)))


def build_sft_datasets(
    spec: DataSpec, *, vocab_size: int, seq_len: int, seed: int, with_val: bool
) -> tuple[SFTData, SFTData | None]:
    """The training rows and, when `with_val`, the validation rows of fine-tuning data (see
    `split_examples`)."""
    cfg = spec.cfg

    def rows(stream: str, loaded: LoadedExamples) -> SFTData:
        return SFTData(
            loaded.examples, seq_len=seq_len, seed=seed, stream=stream, pack=cfg.pack,
            truncate=cfg.truncate, vocab_size=vocab_size, pad_id=loaded.pad_id, kind=loaded.kind,
        )  # fmt: skip

    # The training rows are built (and checked) before data.val_paths is read.
    built = {
        stream: rows(stream, loaded) for stream, loaded in split_examples(spec, with_val=with_val)
    }
    return built["train"], built.get("val")
