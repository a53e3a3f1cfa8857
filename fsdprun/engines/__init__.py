"""Data-parallel engines: FSDP2 (`fully_shard`, the default), FSDP1 (`FullyShardedDataParallel`)
and DDP (`DistributedDataParallel`, the unsharded baseline), behind one small interface.

The recipe's `fsdp.*` keys state intent once. Each engine's module (`fsdp2`, `fsdp1`, `ddp`)
keeps, side by side, what it does with every key (`translate`: printed in the run header and by
`fsdprun plan`, so nothing is dropped silently), the units it makes (`unit_plan`) and what they
hold on a rank (`rank_memory`: its padding, gathered peak and accumulation bytes), both what
`plan` counts, and the build that applies exactly those (`build_engine`). `base` holds what they
share: the `Engine` the training loop calls, and the reshard and accumulation rules. Apart from the
engines: `transforms` (activation checkpointing, compile), `weights` (initial values identical
at any world size, ties, model-state bytes), `units` (the wrap policy, the device mesh) and
`float8`. Checkpoints go through `torch.distributed.checkpoint.state_dict` for all three, whose
keys are the unwrapped model's, so a run saved under one engine resumes under another.

This package and the engine modules never import torch at module load (config and `plan` read
the rules without it); `build_engine` imports the engine's torch code when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdprun.config import Engine as EngineKind
from fsdprun.config import LossKind, RecipeConfig, Sharding
from fsdprun.config.layout import Layout
from fsdprun.engines.base import (
    DTYPE_BYTES,
    Engine,
    Knob,
    KnobTable,
    ParamShape,
    RankMemory,
    UnitPlan,
    engine_module,
    reshards_after_forward,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from fsdprun.engines.hf_weights import HFWeights

# What other packages import from here (the engines' modules are imported by `engine_module`).
__all__ = [
    "DTYPE_BYTES", "Engine", "Knob", "ParamShape", "accumulation_mode", "build_engine",
    "rank_memory", "translate", "unit_plan",
]  # fmt: skip


def translate(cfg: RecipeConfig, world_size: int | None = None) -> list[Knob]:
    """What the recipe's engine does with each `fsdp.*` and precision key (no model needed)."""
    knobs = KnobTable()
    engine_module(cfg.fsdp.engine).knobs(cfg, Layout.of(cfg, world_size), knobs.add)
    return list(knobs)


def accumulation_mode(cfg: RecipeConfig) -> str:
    """How the recipe's engine reduces gradients on accumulation micro-steps: REDUCE,
    DEFER_ALL_REDUCE or LOCAL (see `Engine.micro_step`)."""
    return engine_module(cfg.fsdp.engine).accumulation(cfg)


def unit_plan(
    cfg: RecipeConfig, paths: list[str], experts: list[str] | None = None
) -> list[UnitPlan]:
    """The units the recipe's engine makes of the wrap policy's `paths` (from
    `units.plan_units`), the root last; none for ddp. Under expert parallel each of the
    `experts` modules is a unit of its own (`fsdprun.engines.ep.with_expert_units`)."""
    from fsdprun.config.layout import effective_sharding
    from fsdprun.engines.ep import outside_experts, with_expert_units

    if not experts:
        return engine_module(cfg.fsdp.engine).unit_plan(paths, cfg.fsdp)
    rows = engine_module(cfg.fsdp.engine).unit_plan(outside_experts(paths, experts), cfg.fsdp)
    reshard = reshards_after_forward(effective_sharding(cfg.fsdp))
    return with_expert_units(rows, experts, reshard=reshard)


def rank_memory(
    cfg: RecipeConfig,
    units: list[list[ParamShape]],
    *,
    sharding: Sharding,
    shards: int,
    engine: EngineKind | None = None,
    carried: bool = False,
) -> RankMemory:
    """What rank 0 holds under `engine` (default: the recipe's) when `units` (each unit's own
    parameters as the wrap policy takes them, the root last) are sharded over `shards` ranks
    under `sharding`: the engine's own padding, gathered peak and accumulation rules.
    `carried`: a pipeline rank's forwards overlap an earlier micro-batch's (fsdp2 only, the
    engine pipeline parallel takes)."""
    extra = {"carried": True} if carried else {}
    return engine_module(engine or cfg.fsdp.engine).memory(
        units, cfg, sharding=sharding, shards=shards, **extra
    )


def build_engine(
    model: nn.Module,
    cfg: RecipeConfig,
    *,
    device: torch.device,
    device_kind: str,
    world_size: int,
    weights: HFWeights | None = None,
    mesh: DeviceMesh | None = None,
    tp_plan: list[tuple[str, str]] | None = None,
    parts: list[nn.Module] | None = None,
) -> Engine:
    """Wrap a meta-device model (checkpointing and compile already applied) with the recipe's
    engine and materialize it on `device`.

    Args:
        weights: pretrained weights (`model.hf_path`) instead of the seeded initial ones: read
            shard-wise into fsdp2's shards, whole into ddp's model before wrapping, and unit by
            unit as FSDP1 materializes each unit before flattening it.
        mesh: the device mesh `fsdprun.engines.mesh.build_device_mesh` built for a model that
            `apply_tp` already split (parallel.tp > 1; fsdp2 only): fully_shard shards over
            its data-parallel dims. None: the engine builds its own.
        tp_plan: what `apply_tp` returned (the run header's plan).
        parts: under pipeline parallel, the module each of this rank's stages runs
            (`fsdprun.engines.pp.stage_parts`; fsdp2 only).
    """
    import functools

    import torch

    from fsdprun.engines.weights import tied_names
    from fsdprun.loss import chunked_cross_entropy, cross_entropy

    compiled = cfg.compile.enabled
    tp = mesh is not None and "tp" in (mesh.mesh_dim_names or ())
    chunked = None
    if cfg.train.loss is LossKind.chunked:
        chunked = functools.partial(
            chunked_cross_entropy, chunk_size=cfg.train.loss_chunk_size, compiled=compiled
        )
    common = {"kind": cfg.fsdp.engine, "inner": model, "knobs": translate(cfg, world_size),
              "matrix_names": frozenset(n for n, p in model.named_parameters() if p.ndim >= 2),
              "device_type": device.type, "chunked_loss": chunked, "tied": tied_names(model),
              # Under TP the loss runs eagerly on DTensor logits, under loss parallel.
              "loss": torch.compile(cross_entropy) if compiled and not tp else cross_entropy,
              "accumulation": accumulation_mode(cfg), "loss_parallel": tp,
              "tp_plan": tp_plan or []}  # fmt: skip
    extra = {"mesh": mesh} if mesh is not None else {}
    if parts is not None:
        extra["parts"] = parts
    return engine_module(cfg.fsdp.engine).build(
        model, cfg, device=device, device_kind=device_kind, world_size=world_size,
        weights=weights, common=common, **extra,
    )  # fmt: skip
