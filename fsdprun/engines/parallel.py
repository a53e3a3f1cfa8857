"""Turning a meta-device model into a sharded, trainable one: activation checkpointing, compile,
FSDP2 (`fully_shard`) per the recipe's wrap policy, and initialization identical at any world size.

Order matters and follows torchtitan: checkpointing wraps a block's forward, compile wraps that,
and `fully_shard` puts its hooks around the whole so its all-gathers stay outside compiled graphs.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
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
    Dtype,
    FsdpConfig,
    Sharding,
    WrapPolicy,
)
from fsdprun.engines.mesh import backward_prefetch_depth, effective_sharding
from fsdprun.errors import UserError

TORCH_DTYPES = {Dtype.bf16: torch.bfloat16, Dtype.fp16: torch.float16, Dtype.fp32: torch.float32}


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


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP unit as planned: its module path ("" = root) and its parameter count."""

    path: str
    num_params: int
    reshard_after_forward: bool


def _shared_params(model: nn.Module) -> dict[int, set[str]]:
    """Parameters owned directly by more than one module (tied weights) → owner paths."""
    owners: dict[int, set[str]] = {}
    for path, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(path)
    return {pid: paths for pid, paths in owners.items() if len(paths) > 1}


def _within(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def plan_units(model: nn.Module, *, cfg: FsdpConfig) -> list[str]:
    """Module paths to wrap as their own FSDP units, in forward (registration) order; the root
    is wrapped last and is not listed.

    A module that shares a parameter with a module outside it (tied embeddings) is never a unit
    of its own: one parameter can belong to only one FSDP unit.
    """
    shared = _shared_params(model)
    modules = dict(model.named_modules())

    def wrappable(path: str) -> bool:
        # FSDP hooks run around forward: containers without one (ModuleDict) cannot be units.
        return type(modules[path]).forward is not nn.Module.forward and not splits_tied(path)

    def splits_tied(path: str) -> bool:
        for p in modules[path].parameters():
            owners = shared.get(id(p))
            if owners and not all(_within(o, path) for o in owners):
                return True
        return False

    if cfg.wrap is WrapPolicy.none:
        return []
    if cfg.wrap is WrapPolicy.block:
        return model.block_paths()
    if cfg.wrap is WrapPolicy.classes:
        known = sorted({type(m).__name__ for m in modules.values()})
        unknown = [c for c in cfg.wrap_classes if c not in known]
        if unknown:
            raise UserError(
                f"fsdp.wrap_classes: {', '.join(unknown)} not in this model; its classes are "
                f"{', '.join(known)}"
            )
        chosen = [
            path for path, m in modules.items()
            if path and type(m).__name__ in cfg.wrap_classes and wrappable(path)
        ]  # fmt: skip
        return chosen
    # size: post-order, counting only parameters not yet taken by a unit below.
    taken: set[int] = set()
    chosen = []

    def visit(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)
        if not path:
            return
        free = [p for p in module.parameters() if id(p) not in taken]
        if sum(p.numel() for p in free) >= cfg.min_num_params and wrappable(path):
            chosen.append(path)
            taken.update(id(p) for p in free)

    visit("", model)
    order = {path: i for i, path in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    cfg: FsdpConfig,
    param_dtype: Dtype,
    reduce_dtype: Dtype,
    pin_memory: bool,
) -> list[FsdpUnit]:
    """Shard `model` with `fully_shard` per the wrap policy, then set explicit prefetch.

    Returns:
        The units in forward order, the root last.
    """
    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype is Dtype.fp32 else TORCH_DTYPES[param_dtype],
        reduce_dtype=TORCH_DTYPES[reduce_dtype],
    )
    common: dict = {"mesh": mesh, "mp_policy": mp}
    if cfg.cpu_offload:
        # pin_memory needs an accelerator; on a CPU-only host it must be off.
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    reshard_after_forward = effective_sharding(cfg) in (Sharding.full, Sharding.hybrid)
    backward_depth = backward_prefetch_depth(cfg)
    paths = plan_units(model, cfg=cfg)
    modules = dict(model.named_modules())
    units: list[FsdpUnit] = []
    wrapped: list[nn.Module] = []
    for i, path in enumerate(paths):
        # The last unit's parameters are needed again as soon as backward starts: resharding
        # them after forward would only buy an immediate second all-gather.
        reshard = reshard_after_forward and i < len(paths) - 1
        module = modules[path]
        before = sum(p.numel() for p in module.parameters() if not isinstance(p, DTensor))
        fully_shard(module, reshard_after_forward=reshard, **common)
        wrapped.append(module)
        units.append(FsdpUnit(path, before, reshard))
    root_params = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
    fully_shard(model, reshard_after_forward=reshard_after_forward, **common)
    units.append(FsdpUnit("", root_params, False))

    for i, module in enumerate(wrapped):
        if cfg.forward_prefetch > 0 and i + 1 < len(wrapped):
            module.set_modules_to_forward_prefetch(wrapped[i + 1 : i + 1 + cfg.forward_prefetch])
        if backward_depth > 1 and i > 0:
            ahead = wrapped[max(0, i - backward_depth) : i]
            module.set_modules_to_backward_prefetch(list(reversed(ahead)))
    return units


def _param_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes and Python versions (hash() is salted).
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_value(
    model: nn.Module, name: str, param: torch.Tensor, *, seed: int, device: torch.device
) -> torch.Tensor:
    """The full initial value of parameter `name` (shape and dtype of `param`): ones for norm
    weights, else normal(0, model.init_std(name)) from a generator seeded by (seed, name)."""
    std = model.init_std(name)
    gen_device = param.device if param.device.type != "meta" else device
    if std is None:
        return torch.ones(param.shape, dtype=param.dtype, device=gen_device)
    gen = torch.Generator(device=gen_device).manual_seed(_param_seed(seed, name))
    full = torch.empty(param.shape, dtype=param.dtype, device=gen_device)
    return full.normal_(0.0, std, generator=gen)


def tied_names(model: nn.Module) -> dict[str, str]:
    """Tied weights: each parameter name that aliases another → the name registered first
    (the one `named_parameters()` yields, and the one that seeds its initial value)."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[name] = first[id(p)]
        else:
            first[id(p)] = name
    return ties


def retie(model: nn.Module, ties: dict[str, str]) -> None:
    """Point every tied name at its first name's parameter again. `to_empty` gives each module
    its own new tensor, which silently unties shared weights (ddp, fsdp1); FSDP2 keeps them."""
    for name, first in ties.items():
        path, _, leaf = name.rpartition(".")
        module, param = model.get_submodule(path), model.get_parameter(first)
        if module._parameters[leaf] is not param:
            setattr(module, leaf, param)


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, device: torch.device) -> None:
    """Materialize a meta model on `device` and initialize it the same way at any world size.

    Each parameter's full value comes from `init_value` and every rank keeps its own shard of it
    (`distribute_tensor` with src_data_rank=None slices locally, no communication). Random init
    directly on DTensors is not an option: on a CPU mesh it gives every shard the same values.
    Costs one full-size temporary per parameter.
    """
    ties = tied_names(model)
    model.to_empty(device=device)
    retie(model, ties)
    for name, param in model.named_parameters():
        full = init_value(model, name, param, seed=seed, device=device)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
    model.init_buffers(device)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of model state this rank actually holds: parameter shards, gradients, optimizer
    state (local shards of DTensors; the gathered copies FSDP makes transiently not included)."""
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
