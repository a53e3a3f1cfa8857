"""Training data. Sample i of a dataset is a function of (seed, i) only, and a global step reads
a fixed range of sample indices, so a step sees the same samples at any world size and the data
position is a single global sample index (what a checkpoint stores).

Global step g reads samples [g*B, (g+1)*B) for global batch B; within it, micro-step m of rank r
reads the `micro_batch_size` samples starting at g*B + (m*world_size + r)*micro_batch_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdprun.config import DataConfig


class SyntheticData:
    """Learnable synthetic token sequences: a random permutation `perm` of the vocabulary
    (fixed by the seed) and, per sample, a start s and a stride k in 1..4; token t is
    perm[(s + k*t) mod V], replaced by a uniform random token with probability `noise`.
    A model learns to infer k from context, so the loss falls towards the noise floor."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, noise: float):
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise
        gen = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab_size, generator=gen)

    def sample(self, index: int) -> torch.Tensor:
        """Sample `index`: seq_len + 1 tokens (inputs are [:-1], targets [1:]), int64, CPU."""
        gen = torch.Generator().manual_seed(self.seed * 2_654_435_761 + index + 1)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, 5, (1,), generator=gen))
        positions = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        tokens = self.perm[positions]
        noisy = torch.rand(self.seq_len + 1, generator=gen) < self.noise
        random_tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)
        return torch.where(noisy, random_tokens, tokens)


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch splits over ranks and micro-steps."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def indices(self, step: int, micro_step: int, rank: int) -> range:
        """Sample indices of (0-based) global `step`, `micro_step`, `rank`."""
        offset = (micro_step * self.world_size + rank) * self.micro_batch_size
        start = step * self.global_batch_size + offset
        return range(start, start + self.micro_batch_size)


def build_dataset(cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int) -> SyntheticData:
    return SyntheticData(vocab_size=vocab_size, seq_len=seq_len, seed=seed, noise=cfg.noise)


def load_batch(
    data: SyntheticData, indices: range, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.stack([data.sample(i) for i in indices])
    tokens = tokens.to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]
