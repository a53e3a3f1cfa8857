"""A model's parameters apart from any engine: their initial values (identical at any world size,
seeded by recipe seed and parameter name), their ties, and the bytes of model state a rank holds.
Every engine initializes from `init_value`, so fsdp2, fsdp1 and ddp start from the same weights.

Needs torch (and DTensor, to handle fsdp2's shards); never imports an engine module.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdprun.config import Dtype

TORCH_DTYPES = {Dtype.bf16: torch.bfloat16, Dtype.fp16: torch.float16, Dtype.fp32: torch.float32}


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
def init_weights(
    model: nn.Module, *, seed: int, device: torch.device, buffer_device: torch.device | None = None,
    roots: list[nn.Module] | None = None,
) -> None:  # fmt: skip
    """Materialize a meta model on `device` and initialize it the same way at any world size;
    its non-persistent buffers go to `buffer_device` (default `device`): the compute device when
    FSDP2 offloads the parameters to the CPU.

    Each parameter's full value comes from `init_value` and every rank keeps its own shard of it
    (`distribute_tensor` with src_data_rank=None slices locally, no communication). Random init
    directly on DTensors is not an option: on a CPU mesh it gives every shard the same values.
    Costs one full-size temporary per parameter.
    """
    ties = tied_names(model)
    for root in roots or [model]:
        root.to_empty(device=device)
    retie(model, ties)
    for name, param in model.named_parameters():
        set_full_value(param, init_value(model, name, param, seed=seed, device=device))
    model.init_buffers(buffer_device or device)


def set_full_value(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give `param` the value `full`; a DTensor keeps only its own shard of it (sliced locally:
    src_data_rank=None, no communication)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


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
