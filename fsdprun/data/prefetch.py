"""One-batch-ahead loading for the training loop.

`BatchLoader.load(step, micro)` returns that micro-batch and, before returning, starts
assembling the next one (the next micro-step, or micro-step 0 of the next step) on a background
thread, so reading and stacking samples overlaps the current step's forward and backward. On an
accelerator the assembled batch sits in pinned host memory and is copied with
`non_blocking=True`: the copy is queued on the device stream and the host goes on queueing the
forward without waiting for it.

The batches are exactly those of `load_batch` (the sample-index arithmetic of `BatchLayout`).

Never imports the engines nor the training loop: it hands over `Batch`es.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fsdprun.data.batch import Batch, collate


class BatchLoader:
    """Micro-batches of one rank, each prepared while the one before it is trained on."""

    def __init__(self, data, layout, rank: int, device: torch.device, *, steps: int):
        self.data, self.layout, self.rank = data, layout, rank
        self.device, self.steps = device, steps
        # Pinned memory needs an accelerator; on CPU the "copy" is the tensor itself.
        self.pin = device.type != "cpu"
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdprun-batch")
        self.pending: dict[tuple[int, int], Future] = {}

    def _host_batch(self, step: int, micro: int) -> Batch:
        indices = self.layout.indices(step, micro, self.rank)
        batch = collate([self.data.sample(i) for i in indices])
        return batch.pin_memory() if self.pin else batch

    def _after(self, step: int, micro: int) -> tuple[int, int] | None:
        if micro + 1 < self.layout.grad_accum_steps:
            return step, micro + 1
        return (step + 1, 0) if step + 1 < self.steps else None

    def load(self, step: int, micro: int) -> Batch:
        """The `Batch` of micro-step `micro` of global step `step` (0-based), on the device;
        the next micro-batch is being prepared when this returns."""
        future = self.pending.pop((step, micro), None)
        batch = future.result() if future is not None else self._host_batch(step, micro)
        for stale in self.pending.values():  # out of order (a restart): drop what was guessed
            stale.cancel()
        self.pending.clear()
        following = self._after(step, micro)
        if following is not None:
            self.pending[following] = self.pool.submit(self._host_batch, *following)
        return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
