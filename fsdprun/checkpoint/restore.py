"""Resuming: which checkpoint to resume from, loading it into a model and optimizer (resharding
to the current world size), and setting aside the later checkpoints a resume abandons.

What a checkpoint holds (written by `fsdprun.checkpoint.save.build_state`): `model.*` and
`optim.*` as sharded DTensors, `train_state` (a uint8 tensor holding JSON: step, tokens seen,
data position, scheduler, grad scaler, optimizer param groups) and `rng.rank<R>`. Only tensors
are loaded: an item stored as a pickled object is refused, never unpickled. A LoRA checkpoint's
`model.*` is its adapters only: the model it loads into already holds the base, rebuilt as the
run built it (the worker's build, plus `load_model_weights` for a `checkpoint.load_from` base).

`find_resume_checkpoint` and `set_aside_after` read and rename folders only; the loaders run
DCP's collectives and are called by every rank at the same point. Never imports the saving side
(`save`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdprun.checkpoint.manifest import (
    CheckpointStatus,
    check_checkpoint,
    describe_base,
    list_checkpoints,
    verify_checkpoint,
)
from fsdprun.errors import UserError
from fsdprun.models.lora import is_adapter_name
from fsdprun.rundir import checkpoint_root


def find_resume_checkpoint(
    run_dir: Path, step: int | None = None, *, verify: bool = False
) -> tuple[CheckpointStatus, list]:
    """The newest complete checkpoint (or that of `step`), and the incomplete ones skipped.

    Args:
        verify: also read every file and compare checksums (slow: reads the whole checkpoint);
            a mismatch makes a checkpoint incomplete.

    Raises:
        UserError: no usable checkpoint.
    """
    statuses = list_checkpoints(run_dir)
    if verify:
        statuses = [_verified(s) for s in statuses]
    bad = [s for s in statuses if not s.complete]
    if step is not None:
        match = [s for s in statuses if s.step == step]
        if not match:
            steps = ", ".join(str(s.step) for s in statuses if s.complete) or "none"
            raise UserError(f"{run_dir}: no checkpoint of step {step} (complete ones: {steps})")
        if not match[0].complete:
            raise UserError(
                f"{match[0].path} is incomplete: {match[0].reason}; pick another --step"
            )
        return match[0], bad
    good = [s for s in statuses if s.complete]
    if not good:
        if bad:
            raise UserError(
                f"{run_dir}: no complete checkpoint ({len(bad)} incomplete: "
                f"{bad[-1].path.name}: {bad[-1].reason})"
            )
        raise UserError(
            f"{run_dir}: no checkpoints to resume from (looked in {checkpoint_root(run_dir)})"
        )
    return good[-1], bad


def _verified(status: CheckpointStatus) -> CheckpointStatus:
    if not status.complete:
        return status
    problems = verify_checkpoint(status.path)
    if not problems:
        return status
    reason = f"checksum verification failed: {'; '.join(problems)}"
    return CheckpointStatus(status.path, status.step, False, reason, status.manifest)


def move_aside(path: Path) -> Path | None:
    """Keep a checkpoint folder under another name (`*.oldN`, which no step-* lookup matches);
    returns the new path, or None when there is no such folder."""
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{path.name}.old{n}").exists():
        n += 1
    return path.rename(path.with_name(f"{path.name}.old{n}"))


def set_aside_after(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoint folders of steps after `step` aside (`*.oldN`, nothing is deleted).

    A resume from `step` abandons the run's later checkpoints; left in place, an elastic
    restart (or a later resume), which takes the newest complete checkpoint, would continue the
    abandoned run instead of this one. Returns the folders' new paths.
    """
    later = [s.path for s in list_checkpoints(run_dir) if s.step is not None and s.step > step]
    return [moved for path in later if (moved := move_aside(path)) is not None]


def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(t.tolist()).decode())


class NoPickleLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only: a checkpoint item stored as a pickled object is refused rather than
    unpickled (DCP's default planner would run `torch.load(weights_only=False)` on it)."""

    def load_bytes(self, read_item, value) -> None:
        raise UserError(
            f"checkpoint item '{read_item.dest_index.fqn}' is a pickled object; fsdprun loads "
            "tensors only and does not unpickle checkpoint data"
        )


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (empty before the first step) so a checkpoint can be
    loaded into them: one step with zero gradients at lr 0 leaves the parameters unchanged."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def load_checkpoint(path: Path, model, optimizer, *, rank: int) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG state in place (resharding as needed); returns
    the train state."""
    metadata = FileSystemReader(str(path)).read_metadata()
    init_optimizer_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = metadata.state_dict_metadata
    # An adapters-only (LoRA) checkpoint: load what it holds into the rebuilt base model; a
    # checkpoint lacking anything else still fails in DCP, naming the missing key.
    adapters_only = any(map(is_adapter_name, model_sd)) and not any(
        f"model.{k}" in saved for k in model_sd if not is_adapter_name(k)
    )
    if adapters_only:
        model_sd = {k: v for k, v in model_sd.items() if is_adapter_name(k)}
    train_meta = saved["train_state"]
    state: dict[str, Any] = {
        "model": model_sd,
        "optim": {"state": optim_sd["state"]},
        "train_state": torch.empty(train_meta.size, dtype=torch.uint8),
    }
    # A rank that did not exist at save time (a larger world) has no RNG state to restore; the
    # training step uses no randomness, so it keeps the seeded one.
    has_rng = f"rng.rank{rank}" in metadata.state_dict_metadata
    if has_rng:
        state["rng"] = {f"rank{rank}": torch.empty_like(torch.get_rng_state())}
    dcp.load(state, checkpoint_id=str(path), planner=NoPickleLoadPlanner())
    train_state = tensor_json(state["train_state"])
    groups = _with_own_groups(train_state["optim_param_groups"], optim_sd["param_groups"])
    optim_sd = {"state": state["optim"]["state"], "param_groups": groups}
    set_state_dict(
        model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
        options=StateDictOptions(strict=not adapters_only),
    )  # fmt: skip
    if has_rng:
        torch.set_rng_state(state["rng"][f"rank{rank}"])
    return train_state


def _with_own_groups(saved: list[dict], current: list[dict]) -> list[dict]:
    """The saved param groups (settings keyed by parameter names), plus a group for each of this
    rank's groups whose names none of them holds: the checkpoint keeps one copy of the train
    state, whose groups name the parameters of the rank that wrote it, and a pipeline stage's
    rank holds others (its settings: the saved group of the same weight decay)."""
    known = {name for group in saved for name in group["params"]}
    extra = []
    for group in current:
        names = [n for n in group["params"] if n not in known]
        if names:
            decay = group.get("weight_decay")
            like = next((g for g in saved if g.get("weight_decay") == decay), saved[0])
            extra.append({**like, "params": names})
    return [*saved, *extra]


def load_model_weights(path: Path, model) -> None:
    """Only the model's weights, from any complete fsdprun checkpoint (fine-tuning)."""
    status = check_checkpoint(path)
    if not status.complete:
        raise UserError(
            f"checkpoint.load_from: {path} is not a complete checkpoint: {status.reason}"
        )
    base = (status.manifest or {}).get("lora_base")
    if base is not None:
        raise UserError(
            f"checkpoint.load_from: {path} holds only LoRA adapters (its base is "
            f"{describe_base(base)}); export it merged (`fsdprun export {path} --format hf`) and "
            "fine-tune from that folder as model.hf_path"
        )
    model_sd = get_model_state_dict(model)
    # LoRA on a base checkpoint: the base weights come from it, and adapters it lacks keep
    # their init (a LoRA checkpoint's adapters are loaded).
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    base_sd = {
        k: v for k, v in model_sd.items() if not is_adapter_name(k) or f"model.{k}" in saved
    }  # fmt: skip
    dcp.load({"model": base_sd}, checkpoint_id=str(path), planner=NoPickleLoadPlanner())
    strict = StateDictOptions(strict=len(base_sd) == len(model_sd))
    set_model_state_dict(model, base_sd, options=strict)
