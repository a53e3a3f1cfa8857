"""Samples from token streams: fixed windows of seq_len + 1 tokens, shuffled per epoch.

Window w of a stream starts at token w * seq_len (consecutive windows share one token, so every
token but the first is a target exactly once per epoch) and never spans two files. Sample i of a
dataset is window perm_e[i mod n] with e = i // n: one permutation of the n windows per epoch,
drawn from (seed, stream, e) alone — the same at any world size and after any resume.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from fsdprun.data.lazy_numpy import np
from fsdprun.errors import UserError

if TYPE_CHECKING:
    import torch


class TokenWindows:
    """Windows of seq_len + 1 tokens over several token arrays (one per file)."""

    def __init__(self, arrays: list[np.ndarray], *, seq_len: int, names: list[str]):
        self.arrays, self.seq_len, self.names = arrays, seq_len, names
        counts = [max(0, (len(a) - 1) // seq_len) for a in arrays]
        self.ends = np.cumsum(counts)
        self.num_windows = int(self.ends[-1]) if counts else 0

    def window(self, w: int) -> tuple[np.ndarray, str]:
        """Window `w` (its tokens, and the name of the file it comes from)."""
        f = int(np.searchsorted(self.ends, w, side="right"))
        local = w - (int(self.ends[f - 1]) if f else 0)
        start = local * self.seq_len
        return self.arrays[f][start : start + self.seq_len + 1], self.names[f]


def num_val_windows(num_windows: int, val_fraction: float) -> int:
    """How many windows (the last ones) data.val_fraction holds out for validation."""
    return round(num_windows * val_fraction)


def epoch_seed(seed: int, stream: str, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{stream}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


class EpochOrder:
    """The order of `num_samples` samples in each epoch: a permutation set by (seed, stream,
    epoch) alone, cached one epoch at a time."""

    def __init__(self, num_samples: int, *, seed: int, stream: str):
        self.num_samples, self.seed, self.stream = num_samples, seed, stream
        self._perm: tuple[int, np.ndarray] | None = None

    def __call__(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            import torch  # not at the top: the data preflight imports this module without torch

            gen = torch.Generator().manual_seed(epoch_seed(self.seed, self.stream, epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=gen).numpy())
        return self._perm[1]


# How a token id beyond the model's vocabulary is fixed (the model's size is model.vocab_size, or
# its config.json's for a model.hf_path model, which model.vocab_size does not change).
VOCAB_FIX = (
    "(model.vocab_size, or the vocab_size of model.hf_path's config.json); tokenize the data "
    "with the model's own tokenizer, or (without model.hf_path) set model.vocab_size to at least "
    "the tokenizer's vocabulary size"
)


class ShuffledWindows:
    """A dataset over the windows `ids` of a `TokenWindows`, in an order set by the seed.

    Args:
        windows: the windows.
        ids: which of them belong to this dataset (training or validation).
        seed: train.seed.
        stream: `train` or `val`, so the two orders differ.
        vocab_size: the model's; a token id at or above it fails with a clear message.
        description: one line for the run header.
    """

    def __init__(
        self, windows: TokenWindows, ids: range, *, seed: int, stream: str, vocab_size: int,
        description: str,
    ):  # fmt: skip
        assert len(ids) > 0, "checked by the preflight"
        self.windows, self.ids, self.seed, self.stream = windows, ids, seed, stream
        self.vocab_size, self.description = vocab_size, description
        self.num_samples = len(ids)
        # The permutation of window positions used in each epoch.
        self.order = EpochOrder(self.num_samples, seed=seed, stream=stream)

    def sample(self, index: int) -> torch.Tensor:
        """Sample `index`: seq_len + 1 tokens, int64, CPU."""
        import torch

        epoch, k = divmod(index, self.num_samples)
        tokens, name = self.windows.window(self.ids[int(self.order(epoch)[k])])
        out = torch.from_numpy(tokens.astype(np.int64))
        # Cheap (one window) and it turns an index error deep in the embedding into a message.
        top = int(out.max())
        if top >= self.vocab_size:
            raise UserError(
                f"{name} holds token id {top} but the model embeds {self.vocab_size} ids "
                f"{VOCAB_FIX}"
            )
        return out
