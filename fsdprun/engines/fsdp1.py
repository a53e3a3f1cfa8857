"""The fsdp1 engine (`FullyShardedDataParallel`, one flat parameter per unit): what it does with
each `fsdp.*` key (`knobs`), its units as `fsdprun plan` shows them (`unit_plan`), what they hold
on a rank (`memory`: flat parameters aligned and padded as FSDP1 pads them), and the build that
applies exactly those (`build`). Its sharding-strategy and backward-prefetch tables below
are the only spelling of them: the knob table, the plan and the build all read them.

Never imports torch at module load (the knob table and unit plan are read without it); the build
imports it where it runs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import TYPE_CHECKING

from fsdprun.config import (
    Dtype,
    FsdpConfig,
    RecipeConfig,
    Sharding,
    WrapPolicy,
)
from fsdprun.config.layout import Layout, effective_sharding
from fsdprun.engines.base import (
    ADAM_STATE_BYTES,
    ADAM_STEP_BYTES,
    DTYPE_BYTES,
    DTYPE_NAMES,
    LOCAL,
    MASTER_BYTES,
    REDUCE,
    REDUCE_TEXT,
    WHOLE_GRADS_TEXT,
    Engine,
    FsdpUnit,
    ParamShape,
    RankMemory,
    UnitPlan,
    accumulation_steps,
    backward_prefetch_depth,
    clean_name,
    gathered_bytes,
    reshards_after_forward,
    unsharded_grads_text,
)
from fsdprun.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdprun.engines.hf_weights import HFWeights

# fsdp.sharding (effective) → the ShardingStrategy member FSDP1 is given.
STRATEGIES = {
    Sharding.full: "FULL_SHARD",
    Sharding.grad_op: "SHARD_GRAD_OP",
    Sharding.hybrid: "HYBRID_SHARD",
    Sharding.hybrid_zero2: "_HYBRID_SHARD_ZERO2",
    Sharding.none: "NO_SHARD",
}
# fsdp.backward_prefetch → the BackwardPrefetch member (None: off). A depth N is BACKWARD_PRE:
# FSDP1 prefetches one unit at most.
BACKWARD_PREFETCH = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}
_HYBRID = (Sharding.hybrid, Sharding.hybrid_zero2)


def _backward_prefetch(fsdp: FsdpConfig) -> str | None:
    return BACKWARD_PREFETCH.get(str(fsdp.backward_prefetch), "BACKWARD_PRE")


def _mixed_precision_off(cfg: RecipeConfig) -> bool:
    p = cfg.precision
    return p.param_dtype is Dtype.fp32 and p.reduce_dtype is Dtype.fp32 and p.buffer_dtype is None


def accumulation(cfg: RecipeConfig) -> str:
    """REDUCE, or LOCAL with NO_SHARD or fsdp.accumulate_unsharded. FSDP1 cannot skip only
    HYBRID_SHARD's all-reduce: it syncs fully on every micro-step."""
    if cfg.fsdp.accumulate_unsharded or effective_sharding(cfg.fsdp) is Sharding.none:
        return LOCAL
    return REDUCE


def _accumulation_text(cfg: RecipeConfig) -> str:
    sharding = effective_sharding(cfg.fsdp)
    if accumulation(cfg) == REDUCE:
        if sharding in _HYBRID:
            return REDUCE_TEXT + ", replica all-reduce too (FSDP1 cannot defer only the all-reduce)"
        return REDUCE_TEXT
    if sharding is Sharding.none:
        return WHOLE_GRADS_TEXT
    return unsharded_grads_text("no_sync()")


def _mixed_precision_text(cfg: RecipeConfig) -> str:
    p = cfg.precision
    if _mixed_precision_off(cfg):
        return "mixed_precision=None (fp32)"
    buffers = (
        DTYPE_NAMES[p.buffer_dtype] if p.buffer_dtype is not None
        else "None (the RoPE table stays fp32)"
    )  # fmt: skip
    return (
        f"MixedPrecision(param_dtype={DTYPE_NAMES[p.param_dtype]}, reduce_dtype="
        f"{DTYPE_NAMES[p.reduce_dtype]}, buffer_dtype={buffers})"
    )


def knobs(cfg: RecipeConfig, layout: Layout, add) -> None:
    """Add what FullyShardedDataParallel does with each `fsdp.*` and precision key under
    `layout`."""
    f = cfg.fsdp
    sharding, group = layout.sharding, layout.shard_group
    mesh = (f" on a ({layout.dp_replicate} x {group}) replicate x shard mesh"
            if sharding in _HYBRID else "")  # fmt: skip
    add("fsdp.engine", "fsdp1", "FullyShardedDataParallel (flat parameters per unit)")
    add(
        "fsdp.sharding",
        f.sharding,
        f"sharding_strategy=ShardingStrategy.{STRATEGIES[sharding]}{mesh}",
    )
    if f.shard_group_size is not None or sharding in _HYBRID:
        add("fsdp.shard_group_size", f.shard_group_size, f"{group} ranks per shard group")
    wrap = {WrapPolicy.block: "ModuleWrapPolicy({transformer block class})",
            WrapPolicy.size: f"size_based_auto_wrap_policy(min_num_params={f.min_num_params})",
            WrapPolicy.classes: f"ModuleWrapPolicy({{{', '.join(f.wrap_classes)}}})",
            WrapPolicy.none: "none (one unit: the root)"}[f.wrap]  # fmt: skip
    add("fsdp.wrap", f.wrap, f"auto_wrap_policy={wrap}")
    add("precision.param_dtype", cfg.precision.param_dtype, _mixed_precision_text(cfg))
    bwd, mode = str(f.backward_prefetch), _backward_prefetch(f)
    bp = f"BackwardPrefetch.{mode}" if mode else "None"
    if bwd not in BACKWARD_PREFETCH:
        bp += f" (FSDP1 prefetches one unit, not {backward_prefetch_depth(f)})"
    add("fsdp.backward_prefetch", bwd, f"backward_prefetch={bp}")
    fwd = "True (one unit ahead)" if f.forward_prefetch > 0 else "False"
    if f.forward_prefetch > 1:
        fwd += f"; FSDP1 cannot prefetch {f.forward_prefetch} units"
    add("fsdp.forward_prefetch", f.forward_prefetch, f"forward_prefetch={fwd}")
    add(
        "fsdp.limit_all_gathers",
        f.limit_all_gathers,
        f"limit_all_gathers={f.limit_all_gathers}",
    )
    add("fsdp.use_orig_params", f.use_orig_params, f"use_orig_params={f.use_orig_params}")
    add(
        "fsdp.cpu_offload",
        f.cpu_offload,
        "cpu_offload=CPUOffload(offload_params=True)" if f.cpu_offload else "cpu_offload=None",
    )
    add("fsdp.accumulate_unsharded", f.accumulate_unsharded, _accumulation_text(cfg))


def unit_plan(paths: list[str], fsdp: FsdpConfig) -> list[UnitPlan]:
    """The units FSDP1 makes of the wrap policy's `paths`, the root last: every unit but the
    root reshards as the strategy says, prefetches at most one unit forward and names its
    backward mode."""
    reshard = reshards_after_forward(effective_sharding(fsdp))
    backward = _backward_prefetch(fsdp) or "none"
    rows = [
        UnitPlan(path, reshard, paths[i + 1 : i + 2] if fsdp.forward_prefetch > 0 else [], backward)
        for i, path in enumerate(paths)
    ]
    rows.append(UnitPlan("", False, [], []))  # the root is not resharded after forward
    return rows


def _flat_shards(
    units: list[list[ParamShape]], shards: int, *, pad_to: int, align: int, orig_params: bool
) -> tuple[list[int], int]:
    """Each unit one flat parameter. With use_orig_params every parameter starts at a multiple
    of `align` elements (16 bytes of the compute dtype) and the whole is padded to a multiple of
    `pad_to` (the ranks of the process group); rank 0 holds the first ceil(numel / shards)
    elements. AdamW keeps state for the original parameters that overlap that range (for their
    overlap), or for the flat parameter itself. Returns rank 0's elements per unit, AdamW's
    bytes."""
    optimizer = 0
    unit_shards = []
    for own in units:
        total, spans = 0, []
        for p in own:
            if orig_params and total % align:
                total += align - total % align
            spans.append((total, p.numel))
            total += p.numel
        if orig_params and total % pad_to:
            total += pad_to - total % pad_to
        shard = math.ceil(total / shards)
        unit_shards.append(shard)
        if orig_params:
            local = [max(0, min(start + n, shard) - start) for start, n in spans]
            optimizer += sum(ADAM_STATE_BYTES * n + ADAM_STEP_BYTES for n in local if n)
        elif own:
            optimizer += ADAM_STATE_BYTES * shard + ADAM_STEP_BYTES
    return unit_shards, optimizer


def memory(
    units: list[list[ParamShape]], cfg: RecipeConfig, *, sharding: Sharding, shards: int
) -> RankMemory:
    """What rank 0 holds when `units` (each unit's own parameters, the root last) are flattened
    and sharded over `shards` ranks under `sharding`."""
    f, pbytes = cfg.fsdp, DTYPE_BYTES[cfg.precision.param_dtype]
    # FSDP1 pads to its process group: the shard group, or every rank under NO_SHARD.
    shard, optimizer = _flat_shards(
        units, shards, pad_to=shards if shards > 1 else cfg.world_size, align=16 // pbytes,
        orig_params=f.use_orig_params,
    )  # fmt: skip
    gathered = [n * shards for n in shard]
    sizes = gathered_bytes(units, gathered, pbytes)
    blocks, root, whole = sizes[:-1], sizes[-1], sum(sizes)
    if sharding is Sharding.none:
        # NO_SHARD computes on the flat parameter itself unless mixed precision casts it.
        buffers = whole if cfg.precision.param_dtype is not Dtype.fp32 else 0
    elif reshards_after_forward(sharding):
        # FSDP1 prefetches at most one unit.
        depth = max(f.forward_prefetch, backward_prefetch_depth(f))
        buffers = root + max(blocks, default=0) * (1 + min(depth, 1))
    else:
        buffers = whole  # ZeRO-2 keeps every unit gathered from forward to backward
    unsharded_grads = 0
    if accumulation(cfg) == LOCAL and accumulation_steps(cfg) > 1 and shards > 1:
        # Each unit's padded flat gradient, in param_dtype, until the last micro-step.
        unsharded_grads = sum(gathered) * pbytes
    params = MASTER_BYTES * sum(shard)
    return RankMemory(
        shard_bytes=[MASTER_BYTES * n for n in shard], gathered_bytes=sizes, params=params,
        grads=params, optimizer=optimizer, buffers=buffers, accumulation=unsharded_grads,
    )  # fmt: skip


def refuse_tied_pretrained(weights: HFWeights | None, ties: dict[str, str]) -> None:
    """FSDP1 materializes each module's own copy of its parameters, so a pretrained folder's tied
    weights would train untied: refused before wrapping.

    Raises:
        UserError: pretrained weights for a model with tied parameters.
    """
    if weights is None or not ties:
        return
    from fsdprun.models.hf import HF_PREFIX

    name, first = next(iter(ties.items()))
    raise UserError(
        f"model.hf_path: {weights.path} ties {name.removeprefix(HF_PREFIX)} to "
        f"{first.removeprefix(HF_PREFIX)}, which fsdp.engine=fsdp1 would train untied; "
        "use fsdp.engine=fsdp2 or ddp"
    )


def _auto_wrap_policy(model: nn.Module, fsdp: FsdpConfig):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    from fsdprun.engines.units import plan_units

    if fsdp.wrap is WrapPolicy.none:
        return None
    if fsdp.wrap is WrapPolicy.size:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=fsdp.min_num_params)
    # block: the model's block classes; classes: the recipe's (validated by plan_units).
    modules = dict(model.named_modules())
    return ModuleWrapPolicy({type(modules[path]) for path in plan_units(model, cfg=fsdp)})


def _param_init_fn(model: nn.Module, *, seed: int, device: torch.device, weights):
    """FSDP1 calls this for each module still on meta, before flattening its unit: the same full
    values as fsdp2 and ddp, one unit in memory at a time. to_empty gives each module its own
    tensor: a tied weight is pointed back at the one materialized first."""
    import torch

    from fsdprun.engines.weights import init_value, tied_names

    paths_of = {id(m): path for path, m in model.named_modules()}
    ties = tied_names(model)
    materialized: dict[str, nn.Parameter] = {}

    @torch.no_grad()
    def param_init_fn(module: nn.Module) -> None:
        prefix = paths_of[id(module)]
        module.to_empty(device=device, recurse=False)
        for name, param in list(module.named_parameters(recurse=False)):
            full_name = f"{prefix}.{name}" if prefix else name
            first = ties.get(full_name, full_name)
            if first in materialized:
                setattr(module, name, materialized[first])
                continue
            if weights is not None:
                param.copy_(weights.full(first))
            else:
                param.copy_(init_value(model, first, param, seed=seed, device=device))
            materialized[first] = param

    return param_init_fn


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
    """Wrap the meta `model` in FullyShardedDataParallel, which materializes each unit (from
    `weights` or the seeded initial values) before flattening it."""
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )

    from fsdprun.engines.mesh import build_device_mesh
    from fsdprun.engines.units import own_params
    from fsdprun.engines.weights import TORCH_DTYPES

    f, p = cfg.fsdp, cfg.precision
    sharding = effective_sharding(f)
    refuse_tied_pretrained(weights, common["tied"])
    mp = None
    if not _mixed_precision_off(cfg):
        mp = MixedPrecision(
            param_dtype=TORCH_DTYPES[p.param_dtype], reduce_dtype=TORCH_DTYPES[p.reduce_dtype],
            buffer_dtype=TORCH_DTYPES[p.buffer_dtype] if p.buffer_dtype is not None else None,
        )  # fmt: skip
    prefetch = _backward_prefetch(f)
    kwargs = {}
    if sharding in _HYBRID:
        kwargs["device_mesh"] = build_device_mesh(Layout.of(cfg, world_size), device_kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP1's deprecation notice
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=getattr(ShardingStrategy, STRATEGIES[sharding]),
            auto_wrap_policy=_auto_wrap_policy(model, f),
            mixed_precision=mp,
            backward_prefetch=getattr(BackwardPrefetch, prefetch) if prefetch else None,
            forward_prefetch=f.forward_prefetch > 0,
            limit_all_gathers=f.limit_all_gathers,
            cpu_offload=CPUOffload(offload_params=True) if f.cpu_offload else None,
            use_orig_params=f.use_orig_params,
            device_id=device,
            param_init_fn=_param_init_fn(
                model, seed=cfg.train.seed, device=device, weights=weights
            ),
            **kwargs,
        )
    model.init_buffers(device)  # the RoPE table (not a parameter, not in any unit's init)
    unit_paths = [
        clean_name(path).removesuffix(".") for path, m in wrapped.named_modules()
        if isinstance(m, FullyShardedDataParallel) and path
    ]  # fmt: skip
    owned = own_params(model, unit_paths)
    reshard = reshards_after_forward(sharding)
    units = [FsdpUnit(path, owned[path], reshard) for path in unit_paths]
    units.append(FsdpUnit("", owned[""], False))
    return Engine(model=wrapped, units=units, **common)


def micro_step(engine: Engine, sync: bool) -> contextlib.AbstractContextManager:
    """LOCAL: no_sync() until the last micro-step."""
    return contextlib.nullcontext() if sync else engine.model.no_sync()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """FSDP1's own clip: it reduces the norm over the flat gradient shards."""
    return model.clip_grad_norm_(max_norm)


def grad_scaler(device_type: str):
    """The sharded scaler; its device defaults to cuda, and it disables itself anywhere else."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)
