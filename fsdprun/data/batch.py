"""What the training loop receives: a `Batch` of inputs and targets, with per-token positions and
document ids when rows hold whole fine-tuning examples.

A dataset's sample is either a tensor of seq_len + 1 token ids (windows, synthetic data: inputs
are [:-1], targets [1:], every target trains) or a `Row` (fine-tuning examples, see `sft`), whose
targets are IGNORE_INDEX wherever nothing may be learned: prompt tokens, padding, and the first
token of each packed example (it would be predicted from the example before it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from fsdprun.config.layout import cp_chunks

if TYPE_CHECKING:
    import torch

# torch.nn.functional.cross_entropy's default ignore_index: such targets add nothing to the loss.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Row:
    """One sample of fine-tuning data (CPU, int64).

    tokens: seq_len + 1 ids (inputs are tokens[:-1]); targets, positions, doc_ids: seq_len each,
    aligned with the inputs. positions restart at 0 with each example; doc_ids number the
    examples of the row 0, 1, ... and are -1 on padding.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor


@dataclass(frozen=True)
class Batch:
    """A micro-batch: inputs and targets [B, S] int64 (targets IGNORE_INDEX = not trained);
    positions and doc_ids [B, S] for fine-tuning rows, None for windows and synthetic data."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None

    def _map(self, fn) -> Batch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: None if v is None else fn(v) for k, v in values.items()})

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def sequence_shard(self, index: int, count: int, *, zigzag: bool = False) -> Batch:
        """Context parallel's part of this batch for cp rank `index` of `count`: its chunks of
        the sequence (`fsdprun.config.layout.cp_chunks`) of the inputs, targets and positions
        (windows get their chunks' positions: the rotary angles of where the tokens are in the
        row), and the whole row's doc_ids, from which attention, which sees whole rows, builds
        its mask."""
        import torch

        seq = self.inputs.shape[1]
        parts = cp_chunks(seq, index, count, zigzag=zigzag)
        positions = self.positions
        if positions is None:
            positions = torch.arange(seq).expand(self.inputs.shape[0], -1)

        def cut(t: torch.Tensor) -> torch.Tensor:
            return (
                torch.cat([t[:, part] for part in parts], dim=1)
                if len(parts) > 1
                else t[:, parts[0]]
            )

        return Batch(cut(self.inputs), cut(self.targets), cut(positions), self.doc_ids)

    @property
    def every_target_trains(self) -> bool:
        """Windows and synthetic data (no doc_ids: not rows of fine-tuning examples): every
        target trains, none is IGNORE_INDEX."""
        return self.doc_ids is None


def collate(samples: list) -> Batch:
    """Stack samples (all tensors, or all `Row`s) into a host `Batch`."""
    import torch

    if isinstance(samples[0], Row):
        return Batch(
            inputs=torch.stack([s.tokens[:-1] for s in samples]),
            targets=torch.stack([s.targets for s in samples]),
            positions=torch.stack([s.positions for s in samples]),
            doc_ids=torch.stack([s.doc_ids for s in samples]),
        )
    tokens = torch.stack(samples)
    return Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:])
