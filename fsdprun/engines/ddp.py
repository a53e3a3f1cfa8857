"""The ddp engine (`DistributedDataParallel`, the unsharded baseline): what it does with each
`fsdp.*` key (`knobs`: most have no effect, and the table says so), what a rank holds
(`memory`: everything, plus autocast's copies of the matmul weights), and its build. It has no
units: `unit_plan` is empty and `fsdprun plan` counts one bucketed all-reduce of the whole model.

Never imports torch at module load (the knob table is read without it); the build imports it
where it runs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from fsdprun.config import Dtype, FsdpConfig, RecipeConfig, Sharding
from fsdprun.config.layout import Layout
from fsdprun.engines.base import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    LOCAL,
    MASTER_BYTES,
    WHOLE_GRADS_TEXT,
    Engine,
    ParamShape,
    RankMemory,
    UnitPlan,
    gathered_bytes,
)
from fsdprun.engines.fsdp2 import dim0_shards
from fsdprun.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdprun.engines.hf_weights import HFWeights

# precision.reduce_dtype → the comm hook that all-reduces in it (fp32: none).
_COMM_HOOKS = {
    Dtype.fp32: None,
    Dtype.bf16: "bf16_compress_hook",
    Dtype.fp16: "fp16_compress_hook",
}


def accumulation(cfg: RecipeConfig) -> str:
    """LOCAL: DDP's gradients are whole on every rank anyway."""
    return LOCAL


def knobs(cfg: RecipeConfig, layout: Layout, add) -> None:
    """Add what DistributedDataParallel does with each `fsdp.*` and precision key."""
    f, p = cfg.fsdp, cfg.precision
    add("fsdp.engine", "ddp", "DistributedDataParallel: every rank holds the whole model state")
    add("fsdp.sharding", f.sharding, "ignored: DDP replicates everything")
    autocast = (
        "off (fp32)"
        if p.param_dtype is Dtype.fp32
        else f"torch.autocast({DTYPE_NAMES[p.param_dtype]})"
    )
    add(
        "precision.param_dtype",
        p.param_dtype,
        f"parameters stay fp32; compute under {autocast}",
    )
    hook = {Dtype.fp32: "none (gradients all-reduced in fp32)",
            Dtype.bf16: "bf16_compress_hook (all-reduce in bf16; NCCL/XCCL only)",
            Dtype.fp16: "fp16_compress_hook (all-reduce in fp16)"}[p.reduce_dtype]  # fmt: skip
    add("precision.reduce_dtype", p.reduce_dtype, f"comm hook {hook}")
    if p.buffer_dtype is not None:
        add("precision.buffer_dtype", p.buffer_dtype, "no effect: DDP does not cast buffers")
    for key in ("wrap", "forward_prefetch", "backward_prefetch", "limit_all_gathers",
                "use_orig_params", "reshard_after_forward"):  # fmt: skip
        add(f"fsdp.{key}", getattr(f, key), "no effect: DDP has no units to gather")
    add("fsdp.accumulate_unsharded", f.accumulate_unsharded, WHOLE_GRADS_TEXT)


def unit_plan(paths: list[str], fsdp: FsdpConfig) -> list[UnitPlan]:
    """None: DDP wraps the whole model once and gathers nothing."""
    return []


def memory(
    units: list[list[ParamShape]], cfg: RecipeConfig, *, sharding: Sharding, shards: int
) -> RankMemory:
    """What every rank holds: the whole model state (`sharding` and `shards` do not apply)."""
    pbytes = DTYPE_BYTES[cfg.precision.param_dtype]
    shard, gathered, optimizer, trainable = dim0_shards(units, 1)
    # Autocast keeps a param_dtype copy of every matmul weight for backward (DDP's only
    # "buffer"); the embedding lookup and the norms run on the fp32 parameters.
    matmul = sum(p.numel for own in units for p in own if p.matmul)
    return RankMemory(
        shard_bytes=[MASTER_BYTES * n for n in shard],
        gathered_bytes=gathered_bytes(units, gathered, pbytes),
        params=MASTER_BYTES * sum(shard),
        grads=MASTER_BYTES * trainable,
        optimizer=optimizer,
        buffers=matmul * pbytes if cfg.precision.param_dtype is not Dtype.fp32 else 0,
        accumulation=0,  # its gradients are whole on every rank anyway: counted under grads
    )


def build(
    model: nn.Module,
    cfg: RecipeConfig,
    *,
    device: torch.device,
    device_kind: str,
    world_size: int,
    weights: HFWeights | None,
    common: dict,
) -> Engine:
    """Materialize the whole meta `model` (from `weights` or the seeded initial values), then
    wrap it in DistributedDataParallel with the reduce_dtype comm hook.

    Raises:
        UserError: reduce_dtype bf16 off NCCL/XCCL.
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from fsdprun.engines.adapters import init_adapters
    from fsdprun.engines.weights import TORCH_DTYPES, init_weights

    reduce = cfg.precision.reduce_dtype
    if reduce is Dtype.bf16 and dist.get_backend() not in ("nccl", "xccl"):
        # torch's bf16 hook checks for NCCL/XCCL itself and fails with a TypeError.
        raise UserError(
            f"precision.reduce_dtype=bf16 with fsdp.engine=ddp needs NCCL or XCCL (this run uses "
            f"{dist.get_backend()}); use reduce_dtype fp16 or fp32"
        )
    if weights is not None:
        weights.load(model, device=device)
        init_adapters(model, seed=cfg.train.seed, device=device)  # LoRA: not in the files
    else:
        init_weights(model, seed=cfg.train.seed, device=device)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no copy
    )
    if _COMM_HOOKS[reduce] is not None:
        ddp.register_comm_hook(state=None, hook=getattr(default_hooks, _COMM_HOOKS[reduce]))
    param = cfg.precision.param_dtype
    return Engine(
        model=ddp, units=[],
        autocast_dtype=None if param is Dtype.fp32 else TORCH_DTYPES[param], **common,
    )  # fmt: skip


def micro_step(engine: Engine, sync: bool) -> contextlib.AbstractContextManager:
    """LOCAL: no_sync() until the last micro-step."""
    return contextlib.nullcontext() if sync else engine.model.no_sync()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip: every rank holds the whole (all-reduced) gradients."""
    import torch

    # Frozen parameters (the base under LoRA) have no gradient and take no part.
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.nn.utils.clip_grad_norm_(trainable, max_norm)


def grad_scaler(device_type: str):
    """The plain scaler: DDP's gradients are not sharded."""
    import torch

    return torch.amp.GradScaler(device_type)
