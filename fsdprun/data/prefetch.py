"""One-step-ahead loading for the training loop.

`BatchLoader.load_step(step)` returns that global step's micro-batches of this rank (a
`StepBatches`) and, before returning, starts assembling the next step's on a background thread, so
reading and stacking samples overlaps the current step's forward and backward. A step's
micro-batches are assembled together because the loss needs the step's count of trained targets
before its first backward (`StepBatches.num_targets`); on the host that count costs no device
sync. On an accelerator the assembled batches sit in pinned host memory and each is copied with
`non_blocking=True` when its micro-step asks for it: the copy is queued on the device stream and
the host goes on queueing the forward without waiting for it.

The batches are exactly those of `load_batch` (the sample-index arithmetic of `BatchLayout`).

Never imports the engines nor the training loop: it hands over `Batch`es.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fsdprun.data.batch import IGNORE_INDEX, Batch, collate


@dataclass(frozen=True)
class StepBatches:
    """The host micro-batches of one rank for one global step."""

    host: list[Batch]
    device: torch.device

    @property
    def every_target_trains(self) -> bool:
        """Windows and synthetic data (no positions): every target trains, none is IGNORE_INDEX,
        so a step's count of trained targets is known without reading or communicating."""
        return all(b.every_target_trains for b in self.host)

    def num_targets(self) -> int:
        """This rank's trained targets (not IGNORE_INDEX) over the step's micro-batches."""
        return sum(int((b.targets != IGNORE_INDEX).sum()) for b in self.host)

    def load(self, micro: int) -> Batch:
        """Micro-batch `micro` on the device."""
        return self.host[micro].to(self.device, non_blocking=True)


class BatchLoader:
    """The micro-batches of one rank, each step's prepared while the step before it trains."""

    def __init__(self, data, layout, rank: int, device: torch.device, *, steps: int):
        """`rank`: the global rank (its data-parallel rank reads, its cp rank slices)."""
        self.data, self.layout, self.rank = data, layout, rank
        self.device, self.steps = device, steps
        # Pinned memory needs an accelerator; on CPU the "copy" is the tensor itself.
        self.pin = device.type != "cpu"
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdprun-batch")
        self.pending: dict[int, Future] = {}

    def _host_batches(self, step: int) -> list[Batch]:
        batches = []
        for micro in range(self.layout.grad_accum_steps):
            indices = self.layout.indices(step, micro, self.layout.data_rank(self.rank))
            batch = self.layout.local(collate([self.data.sample(i) for i in indices]), self.rank)
            batches.append(batch.pin_memory() if self.pin else batch)
        return batches

    def load_step(self, step: int) -> StepBatches:
        """The micro-batches of global step `step` (0-based); the next step's are being
        prepared when this returns."""
        future = self.pending.pop(step, None)
        host = future.result() if future is not None else self._host_batches(step)
        for stale in self.pending.values():  # out of order (a restart): drop what was guessed
            stale.cancel()
        self.pending.clear()
        if step + 1 < self.steps:
            self.pending[step + 1] = self.pool.submit(self._host_batches, step + 1)
        return StepBatches(host, self.device)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
