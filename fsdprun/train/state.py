"""The train state: what a checkpoint keeps of a run besides its model and optimizer tensors.

It is stored as JSON, in the checkpoint's `train_state` item and in its manifest (where
`inspect-checkpoint`, `export` and `fsdprun status` read it). Its keys are part of the checkpoint
format: the golden test pins them, and checkpoints written by earlier versions must still load,
so a new key needs a default for checkpoints without it. `fsdprun.checkpoint.build_state` adds
the optimizer's param groups (`optim_param_groups`) to the same record.

Pure data: never imports torch or torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainState:
    """The train state after `step` optimizer steps (field order is the stored key order)."""

    step: int
    tokens_seen: int
    # The global index of the next sample: the same samples come next at any world size because
    # the global batch is kept.
    data_position: int
    global_batch_size: int
    world_size: int  # of the run that saved it
    skipped_steps: int  # non-finite steps skipped so far
    # Stored for inspection: a resume follows its own recipe's schedule (`resume_lr_scheduler`).
    scheduler: dict[str, Any]
    grad_scaler: dict[str, Any] | None  # fp16 only
    # Tied weights: name -> the name it shares its tensor with. None in checkpoints written before
    # ties were recorded (inspect then finds them from the recipe).
    tied_params: dict[str, str] | None

    @classmethod
    def at_step(
        cls, step: int, *, global_batch_size: int, seq_len: int, world_size: int,
        skipped_steps: int, scheduler: dict[str, Any], grad_scaler: dict[str, Any] | None,
        tied_params: dict[str, str],
    ) -> TrainState:  # fmt: skip
        return cls(
            step=step,
            tokens_seen=step * global_batch_size * seq_len,
            data_position=step * global_batch_size,
            global_batch_size=global_batch_size,
            world_size=world_size,
            skipped_steps=skipped_steps,
            scheduler=scheduler,
            grad_scaler=grad_scaler,
            tied_params=tied_params,
        )

    def to_dict(self) -> dict[str, Any]:
        """The record to store (its values are the objects given, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        """The train state of a loaded checkpoint (keys it does not define, such as the
        optimizer's param groups, are left out)."""
        # Absent from checkpoints written before non-finite skipping, fp16 scaling and tie
        # records existed.
        defaults = {"skipped_steps": 0, "grad_scaler": None, "tied_params": None}
        return cls(**{
            f.name: saved[f.name] if f.name in saved else defaults[f.name]
            for f in dataclasses.fields(cls)
        })  # fmt: skip
