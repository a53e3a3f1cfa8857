"""AdamW and the learning-rate schedule (linear warm-up, then cosine/linear/constant decay).

Never imports the engines, the models nor the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from fsdprun.config import Decay, OptimConfig, OptimImpl, ScheduleConfig

# Devices whose AdamW has a fused kernel that works on FSDP's DTensor parameters. On CPU too
# (torch >= 2.4): one op per parameter group, so DTensor's sharding propagation runs once per
# group instead of once per foreach op; measured on 2 gloo ranks (debug model), the first
# step's AdamW costs 0.10 CPU s instead of 0.33, and later ones 2 ms instead of 4.
_FUSED_DEVICES = {"cuda", "xpu", "npu", "cpu"}


def resolved_implementation(
    impl: OptimImpl, device_kind: str, *, sharded_scaler: bool = False
) -> OptimImpl:
    """What `optim.implementation` means: `auto` is fused where the device has the kernel, and
    foreach elsewhere and under the sharded gradient scaler that fp16 uses with fsdp1/fsdp2:
    torch's fused AdamW step fails with it (the scaler's inf flag has shape [1], the step
    counters shape []), so an explicit `fused` there is refused before launch
    (fsdprun.config.validate)."""
    if impl is OptimImpl.auto:
        fused = device_kind in _FUSED_DEVICES and not sharded_scaler
        return OptimImpl.fused if fused else OptimImpl.foreach
    return impl


def build_optimizer(
    model: nn.Module,
    *,
    cfg: OptimConfig,
    device_kind: str,
    is_matrix: Callable[[str, nn.Parameter], bool] | None = None,
    scaler: object | None = None,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (requires_grad: under LoRA the adapters only, so
    AdamW keeps no state for the frozen base); weight decay on matrices only (not on norm
    weights).

    `is_matrix(name, param)` says which parameters are matrices where the wrapped parameters no
    longer show their shape (FSDP1 flattens them); default: param.ndim >= 2. `scaler`: the
    run's gradient scaler (fp16), which decides what `auto` picks.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = is_matrix(name, p) if is_matrix is not None else p.ndim >= 2
        (decay if matrix else no_decay).append(p)
    # No empty group: DCP's optimizer state dict keys each group's settings by its parameters'
    # names, so an empty group (FSDP1's flat parameters are all 1-D) comes back from a
    # checkpoint without lr or betas.
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if params
    ]
    sharded_scaler = isinstance(scaler, ShardedGradScaler)
    impl = resolved_implementation(cfg.implementation, device_kind, sharded_scaler=sharded_scaler)
    kwargs = {
        OptimImpl.fused: {"fused": True},
        OptimImpl.foreach: {"foreach": True},
        OptimImpl.for_loop: {"foreach": False},
    }[impl]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def lr_factor(step: int, *, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index `step`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay is Decay.constant:
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay is Decay.linear:
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, cfg: ScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg=cfg, total_steps=total_steps)
    )


def resume_lr_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Continue the schedule at the optimizer step with 0-based index `step`: every group's lr
    becomes this schedule's lr for that step.

    The schedule is a function of the step alone, so a saved scheduler state adds nothing, and
    it may not fit: it was built for the saved train.steps (a resume may train longer) and for
    the saved run's param groups (FSDP1's flat parameters make one group, the others two).
    """
    scheduler.last_epoch = step - 1
    scheduler.step()  # sets every group's lr for `step`
