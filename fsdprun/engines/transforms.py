"""Model transforms applied before any engine wraps the model: activation checkpointing and
compile, in place, so parameter names (and with them checkpoint keys) do not change.

Order matters and follows torchtitan: checkpointing wraps a block's forward, compile wraps that,
and the engine puts its hooks around the whole so its all-gathers stay outside compiled graphs.
Never imports torch.distributed or an engine module.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdprun.config import (
    ActivationCheckpointingConfig,
    CheckpointMode,
    CompileConfig,
    CompileMode,
)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [model.get_submodule(path) for path in model.block_paths()]


# Selective checkpointing keeps the outputs of these ops and recomputes everything else (norms,
# RoPE, SiLU, the elementwise product, residual adds: cheap, memory-bound). torchtitan's list is
# the reference: matmuls and attention are what backward would pay most to recompute, and
# float8's scaled matmul and amax (`max`) keep their results too. Ops a torch build lacks are
# left out.
SELECTIVE_SAVE_OPS = (
    "mm", "addmm", "bmm", "_scaled_mm", "max",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)  # fmt: skip


def _selective_save_set() -> frozenset:
    ops = [getattr(torch.ops.aten, name, None) for name in SELECTIVE_SAVE_OPS]
    return frozenset(op.default for op in ops if op is not None and hasattr(op, "default"))


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The op-level policy of `activation_checkpointing.mode=selective`."""
    if op in _SELECTIVE_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_SAVE = _selective_save_set()


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


def apply_activation_checkpointing(model: nn.Module, *, cfg: ActivationCheckpointingConfig) -> int:
    """Recompute the activations of the chosen blocks in backward; returns how many blocks.

    The block's own `forward` is replaced (rather than wrapping the module) so parameter names,
    and with them checkpoint keys, do not change. `selective` checkpoints every block with the
    op-level policy `selective_policy`.
    """
    if cfg.mode is CheckpointMode.none:
        return 0
    extra = {"context_fn": _selective_contexts} if cfg.mode is CheckpointMode.selective else {}
    count = 0
    for i, block in enumerate(_blocks(model)):
        if cfg.mode is not CheckpointMode.every_n or i % cfg.every_n == 0:
            block.forward = functools.partial(
                checkpoint, block.forward, use_reentrant=False, **extra
            )
            count += 1
    return count


def apply_compile(model: nn.Module, *, cfg: CompileConfig) -> None:
    """torch.compile each block's forward (or the whole model's), in place: names are kept."""
    if not cfg.enabled:
        return
    mode = None if cfg.mode is CompileMode.default else cfg.mode.value
    targets = _blocks(model) if cfg.per_block else [model]
    for module in targets:
        module.forward = torch.compile(module.forward, fullgraph=cfg.fullgraph, mode=mode)
