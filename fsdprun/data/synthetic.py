"""Synthetic data: learnable token sequences that need no files (the `debug` recipe's data).

Never imports another fsdprun module; torch only where it makes a sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Validation samples of synthetic data: indices from here on, which training never reaches.
VAL_FIRST_INDEX = 2**40


class SyntheticData:
    """Learnable synthetic token sequences: a random permutation `perm` of the vocabulary
    (fixed by the seed) and, per sample, a start s and a stride k in 1..4; token t is
    perm[(s + k*t) mod V], replaced by a uniform random token with probability `noise`.
    A model learns to infer k from context, so the loss falls towards the noise floor."""

    num_samples = None  # endless: sample i is a function of (seed, i)

    def __init__(
        self, *, vocab_size: int, seq_len: int, seed: int, noise: float, first_index: int = 0
    ):
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise
        self.first_index = first_index
        import torch  # not at the top: the data preflight loads this package without torch

        gen = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab_size, generator=gen)
        self.description = f"synthetic (noise {noise})"

    def sample(self, index: int) -> torch.Tensor:
        """Sample `index`: seq_len + 1 tokens (inputs are [:-1], targets [1:]), int64, CPU."""
        import torch

        index += self.first_index
        gen = torch.Generator().manual_seed(self.seed * 2_654_435_761 + index + 1)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, 5, (1,), generator=gen))
        positions = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        tokens = self.perm[positions]
        noisy = torch.rand(self.seq_len + 1, generator=gen) < self.noise
        random_tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)
        return torch.where(noisy, random_tokens, tokens)
