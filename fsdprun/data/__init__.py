"""Training data. Sample i of a dataset is a function of (seed, i) only, and a global step reads
a fixed range of sample indices, so a step sees the same samples at any world size and the data
position is a single global sample index (what a checkpoint stores).

Global step g reads samples [g*B, (g+1)*B) for global batch B; within it, micro-step m of
data-parallel rank r reads the `micro_batch_size` samples starting at
g*B + (m*world_size + r)*micro_batch_size, world_size being the data-parallel ranks. With tensor
parallelism (`parallel.tp`) the tp consecutive ranks of one TP group are one data-parallel rank
(r = rank // tp) and read the same samples; with context parallelism (`parallel.cp`) the cp x tp
consecutive ranks are (r = rank // (cp x tp)), and cp rank j keeps slice j of each row's
sequence, or under ring attention its two zig-zag chunks j and 2 cp - 1 - j
(`Batch.sequence_shard`, `config.layout.cp_chunks`): which tokens a rank holds is a function of
its rank and the layout alone, never stored, so a run resumes under any cp degree or attention.
With pipeline parallelism (`parallel.pp`, the outermost dim) the pp stages of one pipeline are
one data-parallel rank and read the same samples (r = rank mod (world / pp) // (cp x tp)).

The front door is `describe_data` (see `spec`): the one description of the dataset a recipe asks
for (its kind, files, tokenizer, token counts, masks) that the launcher's checks (`preflight`)
and `build_datasets` here both read, and that keeps what it tokenized for the other. Kinds:
`synthetic` (no files), `tokens` (pre-tokenized .bin/.npy files, see `files`), `text`
(.txt/.jsonl tokenized at start, see `text`); token and text data become shuffled windows
(`windows`). Fine-tuning examples (`chat`, `instruct`, `hf_dataset`, see `sft_examples`, or a
folder `prepare-data` made of them, see `prepared`) become rows of whole examples with masked
targets (`sft`).
`load_batch` gives a `Batch` (see `batch`) for either. Validation data is built the same way
from data.val_paths, or from the last data.val_fraction of the training windows (examples).

The modules of this package import torch inside the functions that use it: the data preflight
(`preflight`, reached from `fsdprun config`) reads files with numpy alone, and a command that
only checks a recipe must not wait seconds for torch to load.

The package never imports the engines, the training loop, the launcher or the models (`engines`,
`train`, `launch`, `models`): the loop takes its `Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fsdprun.config import DataConfig
from fsdprun.data.batch import IGNORE_INDEX, Batch, Row, collate
from fsdprun.data.sft import build_sft_datasets
from fsdprun.data.spec import DataKind, DataSpec, describe_data, forget_data, save_tokenized
from fsdprun.data.synthetic import VAL_FIRST_INDEX, SyntheticData
from fsdprun.data.windows import ShuffledWindows, TokenWindows, num_val_windows
from fsdprun.errors import UserError

if TYPE_CHECKING:
    import torch

    from fsdprun.config import TrainConfig
    from fsdprun.config.layout import Layout

__all__ = [
    "IGNORE_INDEX", "Batch", "BatchLayout", "DataKind", "DataSpec", "Dataset", "Row",
    "SyntheticData", "build_datasets", "describe_data", "forget_data", "load_batch",
    "save_tokenized",
]  # fmt: skip


class Dataset(Protocol):
    description: str

    @property
    def num_samples(self) -> int | None:
        """Samples in one epoch (later indices wrap to a reshuffled epoch); None = endless."""

    def sample(self, index: int) -> torch.Tensor | Row:
        """Sample `index`: seq_len + 1 token ids (inputs [:-1], targets [1:]), int64, CPU; or,
        for fine-tuning examples, a `Row` (targets masked, positions, document ids)."""


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch splits over data-parallel ranks (`world_size` of them) and
    micro-steps; `cp x tp` ranks (a context- and tensor-parallel group) share each data-parallel
    rank's samples, each cp rank keeping its chunks of the sequence."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    tp: int = 1
    cp: int = 1
    zigzag: bool = (
        False  # cp ranks hold zig-zag chunks (the ring's layout: `fsdprun.config.layout.cp_chunks`)
    )
    pp: int = 1  # pipeline stages: each is a copy of the layout above (pp is the outermost dim)

    @classmethod
    def of(cls, layout: Layout, train: TrainConfig, *, zigzag: bool = False) -> BatchLayout:
        """The batch layout of the parallel `layout` (its degrees and data-parallel size, decided
        there) for `train`'s batch sizes."""
        return cls(train.global_batch_size, train.micro_batch_size, layout.dp, layout.tp,
                   layout.cp, zigzag=zigzag, pp=layout.pp)  # fmt: skip

    @property
    def num_ranks(self) -> int:
        """Every rank of the run: pp x data-parallel ranks x cp x tp."""
        return self.pp * self.world_size * self.cp * self.tp

    @property
    def reduce_ranks(self) -> int:
        """The ranks FSDP averages each gradient over: data-parallel ranks x cp (the cp ranks'
        gradients are partial sums over their tokens)."""
        return self.world_size * self.cp

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank` (cp and tp are the innermost mesh dims, pp the
        outermost: the stages of one pipeline read the same samples)."""
        return rank % (self.world_size * self.cp * self.tp) // (self.cp * self.tp)

    def local(self, batch: Batch, rank: int) -> Batch:
        """The part of a data-parallel rank's `batch` that global `rank` computes: all of it,
        or under context parallel its cp rank's slice of the sequence."""
        if self.cp == 1:
            return batch
        return batch.sequence_shard((rank // self.tp) % self.cp, self.cp, zigzag=self.zigzag)

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def indices(self, step: int, micro_step: int, rank: int) -> range:
        """Sample indices of (0-based) global `step`, `micro_step`, `rank`."""
        offset = (micro_step * self.world_size + rank) * self.micro_batch_size
        start = step * self.global_batch_size + offset
        return range(start, start + self.micro_batch_size)


def build_datasets(
    cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int, with_val: bool = False,
    saved: Path | None = None,
) -> tuple[Dataset, Dataset | None]:  # fmt: skip
    """The training dataset and, when `with_val`, the validation dataset of the data `cfg`
    describes (`describe_data`: what the preflight tokenized in this process is reused, or
    read from `saved`, the folder where the launcher saved it for spawned workers).

    Raises:
        UserError: text of fewer tokens than one sequence (the preflight's message: its files
            changed since the checks).
    """
    spec = describe_data(cfg, saved=saved)
    if spec.kind is DataKind.synthetic:
        common = dict(vocab_size=vocab_size, seq_len=seq_len, seed=seed, noise=cfg.noise)
        val = SyntheticData(**common, first_index=VAL_FIRST_INDEX) if with_val else None
        return SyntheticData(**common), val
    if spec.masked:  # chat, instruct, hf_dataset, or their prepared folder
        return build_sft_datasets(
            spec, vocab_size=vocab_size, seq_len=seq_len, seed=seed, with_val=with_val
        )

    def stream(key: str) -> TokenWindows:
        paths = spec.paths(key)
        if spec.kind is DataKind.tokens:
            files = spec.token_files(key)
            return TokenWindows([f.open() for f in files], seq_len=seq_len, names=paths)
        # The launcher's tokens (in this process, or saved for spawned workers); byte-tokenized
        # .txt, which the checks count from file sizes, each rank tokenizes itself. For a large
        # corpus, run `fsdprun prepare-data` once and train on the token files instead.
        tokens = spec.text_tokens(key)
        if short := spec.short_text(key, len(tokens), seq_len):  # files changed since the checks
            raise UserError(short)
        return TokenWindows([tokens], seq_len=seq_len, names=[", ".join(paths)])

    def dataset(windows: TokenWindows, ids: range, name: str, num_files: int) -> ShuffledWindows:
        # data.tokenizer as written: naming it needs no tokenizer loaded (a spawned worker reads
        # the launcher's tokens).
        kind = "tokens" if spec.kind is DataKind.tokens else f"text ({cfg.tokenizer} tokenizer)"
        return ShuffledWindows(
            windows, ids, seed=seed, stream=name, vocab_size=vocab_size,
            description=f"{kind}: {num_files} file(s), {len(ids):,} windows of {seq_len + 1} "
            "tokens",
        )  # fmt: skip

    train_windows = stream("data.paths")
    n = train_windows.num_windows
    num_val = num_val_windows(n, cfg.val_fraction)
    train = dataset(train_windows, range(n - num_val), "train", len(spec.paths("data.paths")))
    if not with_val:
        return train, None
    if cfg.val_paths:
        val_windows = stream("data.val_paths")
        val_ids = range(val_windows.num_windows)
        return train, dataset(val_windows, val_ids, "val", len(spec.paths("data.val_paths")))
    return train, dataset(
        train_windows, range(n - num_val, n), "val", len(spec.paths("data.paths"))
    )


def load_batch(data: Dataset, indices: range, device: torch.device) -> Batch:
    """The samples `indices` of `data` as one `Batch` on `device`."""
    return collate([data.sample(i) for i in indices]).to(device, non_blocking=True)
