"""Rank memory of a recipe's FSDP units, the pieces `tools.plan` composes and prints.

Each unit's parameters with their real shapes (TP-local, ep-split, a pipeline rank's own) go
to the engine's memory rule (`engines.rank_memory`) under one sharding strategy; under pipeline
parallel each pipeline rank adds its stages' activations and torch's receive buffers, under
expert parallel the all-to-all's. The model is a meta-device build (`tools.plan.plan_memory`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from fsdprun.config import Engine, RecipeConfig, Sharding
from fsdprun.config.layout import (
    Layout,
    effective_sharding,
    stage_blocks,
)
from fsdprun.config.model_facts import model_facts
from fsdprun.config.schedule import bubble_fraction, in_flight
from fsdprun.engines import ParamShape, rank_memory
from fsdprun.engines.activations import activation_bytes, stage_activation_bytes
from fsdprun.engines.base import DTYPE_BYTES, UnitPlan, accumulation_steps
from fsdprun.engines.ep import EXPERT_PARAMS, ep_alltoall_bytes, ep_dispatch_bytes
from fsdprun.engines.float8 import Float8Plan, float8_linears
from fsdprun.engines.tp import tp_local_shape


@dataclass(frozen=True)
class PlannedUnit:
    """One FSDP unit as `apply_fsdp` would make it ("" = the root, last)."""

    path: str
    num_params: int
    unsharded_bytes: int  # gathered, in param_dtype
    shard_bytes: int  # fp32 master shard on rank 0
    reshard_after_forward: bool
    forward_prefetch: list[str]
    backward_prefetch: list[str] | str  # explicit unit paths, or "implicit"


@dataclass
class StrategyMemory:
    """Bytes on rank 0 under one sharding strategy."""

    shard_group: int
    params: int
    grads: int
    optimizer: int
    gathered_buffers: int
    activations: int
    accumulation: int = 0  # unsharded gradients kept between micro-steps (accumulate_unsharded)
    # Pipeline parallel: torch's receive buffers, one per micro-batch of the activations from
    # the previous stage and of their gradients from the next (`pipeline_buffer_bytes`).
    pipeline_buffers: int = 0
    dispatch: int = 0  # expert parallel's all-to-all buffers of one MoE layer (EP_FORMULA)
    total: int = 0
    fits: bool | None = None

    def __post_init__(self) -> None:
        self.total = (
            self.params + self.grads + self.accumulation + self.optimizer
            + self.gathered_buffers + self.activations + self.pipeline_buffers + self.dispatch
        )  # fmt: skip


def unit_params(
    model: nn.Module,
    paths: list[str],
    *,
    float8: Float8Plan | None,
    tp_dims: dict[int, int] | None = None,
    whole_grads: frozenset[int] = frozenset(),
    tp: int = 1,
    keep: set[int] | None = None,
    experts: list[str] = (),
    ep: int = 1,
) -> list[list[ParamShape]]:
    """Each unit's own parameters, as the engines take them: not yet taken, forward order, root
    last; marked trainable, a Linear's weight, gathered in float8 (`float8` with all-gather). Under
    tensor parallel (`tp` > 1) each shape is tensor-parallel rank 0's local shard: the dim in
    `tp_dims` (parameter id -> dim the TP plan shards) cut to ceil(n / tp), as DTensor's
    Shard(dim) chunks it; a parameter the plan does not shard (the norms) is whole on every TP
    rank. FSDP then shards that local tensor over the data-parallel ranks. Under expert
    parallel (`ep` > 1) the stacked parameters of the `experts` modules are split over ep
    ranks on their experts dim first (`ParamShape.ep`). `keep`: only these parameters (ids: a
    pipeline rank's stages), each in the unit it is in."""
    modules = dict(model.named_modules())
    stacked = {id(getattr(modules[e], name)) for e in experts for name in EXPERT_PARAMS}
    matmul = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    f8 = set()
    if float8 is not None and float8.all_gather:
        converted = float8_linears(model, mode=float8.mode, skip_small=float8.skip_small)[0]
        f8 = {id(modules[path].weight) for path in converted}
    tp_dims = tp_dims or {}
    taken: set[int] = set()
    units = []
    for root in [*(modules[path] for path in paths), model]:
        own = [p for p in root.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        if keep is not None and own and root is not model:
            own = [p for p in own if id(p) in keep]
            if not own:  # another pipeline rank's unit: this rank has no such unit at all
                continue
        elif keep is not None:
            own = [p for p in own if id(p) in keep]
        units.append([ParamShape(tp_local_shape(tuple(p.shape), tp_dims.get(id(p)), tp),
                                 p.requires_grad, id(p) in matmul, id(p) in f8,
                                 p.numel() if tp > 1 and id(p) in whole_grads else None,
                                 ep=ep if id(p) in stacked else 1)
                      for p in own])  # fmt: skip
    return units


def with_sharding(
    cfg: RecipeConfig, sharding: Sharding, engine: Engine | None = None
) -> RecipeConfig:
    """`cfg` under another sharding (and engine: a ddp recipe's sharded columns are fsdp2's)."""
    fsdp = dataclasses.replace(
        cfg.fsdp, sharding=sharding, reshard_after_forward=None, engine=engine or cfg.fsdp.engine
    )
    return dataclasses.replace(cfg, fsdp=fsdp)


@dataclass
class PipelineRank:
    """One pipeline rank (stage group): its stages and blocks, the micro-batches it holds in
    flight at its peak, and its memory (its stages' parameters, sharded over its data-parallel
    ranks, and those micro-batches' activations)."""

    rank: int
    stages: list[int]
    blocks: int
    first: bool  # holds the embedding
    last: bool  # holds the norm, head and loss
    in_flight: float
    memory: StrategyMemory


def _stage_plan(cfg: RecipeConfig, model: nn.Module):
    """(the family's stages, blocks per stage, the stages' blocks) of the recipe's model."""
    from fsdprun.engines.pp import plan_stages

    facts = model_facts(cfg.model)
    counts = stage_blocks(cfg, facts, model.args.n_layers)
    return facts.entry.stages, counts, plan_stages(model, facts.entry.stages, counts)


def rank_params(cfg: RecipeConfig, model: nn.Module, rank: int) -> set[int]:
    """Ids of the parameters pipeline rank `rank` holds: its stages' blocks, the embedding on
    the first stage, the norm and head on the last."""
    layout = Layout.of(cfg)
    declared, _, plan = _stage_plan(cfg, model)
    local = layout.pp_stages(rank)
    paths = [f"{declared.blocks}.{name}" for s in local for name in plan.blocks[s]]
    if 0 in local:
        paths += list(declared.first)
    if plan.num_stages - 1 in local:
        paths += list(declared.last)
    return {id(p) for path in paths for p in model.get_submodule(path).parameters()}


def pipeline_ranks(
    cfg: RecipeConfig, model: nn.Module, units_at, sharding: Sharding, engine: Engine
) -> list[PipelineRank]:
    """Each pipeline rank's memory under `sharding`: the units of its stages' parameters, their
    shards over its data-parallel ranks (x cp), and its peak micro-batches in flight of its
    blocks' activations (with the loss's on the last stage)."""
    layout = Layout.of(cfg)
    _, counts, plan = _stage_plan(cfg, model)
    micro = accumulation_steps(cfg)
    last = plan.num_stages - 1
    ranks = []
    for r in range(layout.pp):
        local = layout.pp_stages(r)
        held = in_flight(layout.pp_schedule, layout.pp, micro, layout.pp_stages_per_rank, r)
        blocks = sum(counts[s] for s in local)
        acts = stage_activation_bytes(cfg, blocks=blocks, last=last in local, held=held)
        memory = strategy_memory(cfg, units_at(layout.tp, rank_params(cfg, model, r), layout.ep),
                                 sharding, engine, activations=acts,
                                 pipeline_buffers=pipeline_buffer_bytes(cfg, local),
                                 carried=held > 1)  # fmt: skip
        ranks.append(PipelineRank(r, local, blocks, 0 in local, last in local, held, memory))
    return ranks


def pipeline_buffer_bytes(cfg: RecipeConfig, local: list[int]) -> int:
    """What torch's pipeline stages `local` allocate once and keep: for each micro-batch, a
    buffer for the activations a stage receives (all but the first) and one for the gradients
    it receives (all but the last), each micro_batch x seq / (cp x tp) x dim in param_dtype."""
    layout, t = Layout.of(cfg), cfg.train
    micro = accumulation_steps(cfg)
    one = (t.micro_batch_size * (t.seq_len // layout.row_group) * cfg.model.dim
           * DTYPE_BYTES[cfg.precision.param_dtype])  # fmt: skip
    last = layout.num_stages - 1
    return sum(micro * one * ((s != 0) + (s != last)) for s in local)


def pipeline_record(cfg: RecipeConfig, ranks: list[PipelineRank]) -> dict:
    """The plan's pipeline: schedule, blocks per stage, micro-batches, bubble, each rank."""
    layout, micro = Layout.of(cfg), accumulation_steps(cfg)
    return {
        "schedule": layout.pp_schedule.value,
        "stages_per_rank": layout.pp_stages_per_rank,
        "micro_batches": micro,
        "bubble": bubble_fraction(layout.pp_schedule, layout.pp, micro,
                                  layout.pp_stages_per_rank),
        "ranks": ranks,
    }  # fmt: skip


def full_counts(model: nn.Module, paths: list[str]) -> list[int]:
    """Each unit's own parameter count, unsharded (the units' shapes are TP-local)."""
    return [sum(p.numel for p in own) for own in unit_params(model, paths, float8=None)]


def sharded_engine(cfg: RecipeConfig) -> Engine:
    # The sharded rows of a ddp recipe show what fsdp2 would hold.
    return Engine.fsdp1 if cfg.fsdp.engine is Engine.fsdp1 else Engine.fsdp2


def planned_units(
    cfg: RecipeConfig, units: list[list[ParamShape]], rows: list[UnitPlan], counts: list[int]
) -> list[PlannedUnit]:
    """The engine's own unit plan `rows` (reshard and prefetch as its build applies them; ddp:
    no units, one bucketed all-reduce over the whole model) with each unit's bytes (TP- and
    ep-local)."""
    sharding = effective_sharding(cfg.fsdp)
    memory = rank_memory(
        cfg, units, sharding=sharding, shards=Layout.of(cfg).fsdp_shards,
        engine=sharded_engine(cfg),
    )  # fmt: skip
    return [
        PlannedUnit(
            path=row.path,
            num_params=counts[i],
            unsharded_bytes=memory.gathered_bytes[i],
            shard_bytes=memory.shard_bytes[i],
            reshard_after_forward=row.reshard_after_forward,
            forward_prefetch=row.forward_prefetch,
            backward_prefetch=row.backward_prefetch,
        )
        for i, row in enumerate(rows)
    ]


def strategy_memory(
    cfg: RecipeConfig, units: list[list[ParamShape]], strategy: Sharding, engine: Engine,
    *, activations: int | None = None, pipeline_buffers: int = 0, carried: bool = False,
) -> StrategyMemory:  # fmt: skip
    """Rank 0's memory under `strategy`: FSDP shards the (TP-local) `units` over its shard
    group of data-parallel ranks times cp (dp_shard x cp; ddp: none)."""
    shards = Layout.of(with_sharding(cfg, strategy, engine)).fsdp_shards
    m = rank_memory(cfg, units, sharding=strategy, shards=shards, engine=engine, carried=carried)
    return StrategyMemory(
        shards, params=m.params, grads=m.grads, optimizer=m.optimizer,
        gathered_buffers=m.buffers, accumulation=m.accumulation,
        activations=activation_bytes(cfg) if activations is None else activations,
        pipeline_buffers=pipeline_buffers, dispatch=_dispatch_bytes(cfg),
    )  # fmt: skip


def _dispatch_bytes(cfg: RecipeConfig) -> int:
    """Expert parallel's all-to-all buffers of one MoE layer in flight (`EP_FORMULA`)."""
    facts = model_facts(cfg.model)
    if not Layout.of(cfg).is_ep or facts is None or not facts.num_experts_per_tok:
        return 0
    t = cfg.train
    return ep_dispatch_bytes(tokens=t.micro_batch_size * t.seq_len,
                             top_k=facts.num_experts_per_tok, dim=cfg.model.dim,
                             param_bytes=DTYPE_BYTES[cfg.precision.param_dtype])  # fmt: skip


def alltoall_bytes(cfg: RecipeConfig, layers: int) -> int:
    """The bytes a rank sends by all-to-all in one step under expert parallel, over the
    model's `layers` mixture-of-experts layers."""
    facts = model_facts(cfg.model)
    layout, t = Layout.of(cfg), cfg.train
    if not layout.is_ep or facts is None or not facts.num_experts_per_tok:
        return 0
    return ep_alltoall_bytes(
        tokens=t.micro_batch_size * t.seq_len, top_k=facts.num_experts_per_tok,
        dim=cfg.model.dim, param_bytes=DTYPE_BYTES[cfg.precision.param_dtype], ep=layout.ep,
        layers=layers, micro_batches=accumulation_steps(cfg),
    )  # fmt: skip


def strategies_of(
    cfg: RecipeConfig, units: list[list[ParamShape]], *, rank0: tuple | None = None
) -> tuple[str, dict[str, StrategyMemory]]:
    """The recipe's strategy, and rank 0's memory under it and under ddp, full, grad_op and
    hybrid (one node's shard groups) to compare. Under TP there is no ddp column (DDP cannot
    hold DTensor shards), nor under CP (which needs fsdp2): `none` there is FSDP2 replicating
    over the data-parallel ranks; nor under ep (its experts are DTensors, which only FSDP2
    shards). `rank0`: under pipeline parallel, (pipeline rank 0's units, its activations, its
    pipeline buffers, whether its forwards overlap an earlier micro-batch's), which each
    strategy then holds instead (no ddp column either)."""
    fsdp, sharded = cfg.fsdp, sharded_engine(cfg)
    layout = Layout.of(cfg)
    acts, buffers, carried = None, 0, False
    if rank0 is not None:
        units, acts, buffers, carried = rank0
    strategies = {} if layout.is_tp or layout.is_cp or layout.is_pp or layout.is_ep else {
        "ddp": strategy_memory(cfg, units, Sharding.none, Engine.ddp)
    }  # fmt: skip
    for s in (Sharding.full, Sharding.grad_op, Sharding.hybrid):
        strategies[s.value] = strategy_memory(
            cfg, units, s, sharded, activations=acts, pipeline_buffers=buffers, carried=carried
        )
    recipe_strategy = "ddp" if fsdp.engine is Engine.ddp else effective_sharding(fsdp).value
    if recipe_strategy in ("hybrid_zero2", "none"):
        strategies[recipe_strategy] = strategy_memory(
            cfg,
            units,
            Sharding(recipe_strategy),
            sharded,
            activations=acts,
            pipeline_buffers=buffers,
            carried=carried,
        )
    return recipe_strategy, strategies


def layout_memory(
    at: RecipeConfig, units: list[list[ParamShape]], sharding: Sharding, *, model, units_at
) -> StrategyMemory:
    """Rank 0's memory of `at` (a degree's column) with fsdp2; under pipeline parallel the
    largest pipeline rank's."""
    if not Layout.of(at).is_pp:
        return strategy_memory(at, units, sharding, Engine.fsdp2)
    ranks = pipeline_ranks(at, model, units_at, sharding, Engine.fsdp2)
    return max((r.memory for r in ranks), key=lambda m: m.total)


def rank_moe_layers(cfg: RecipeConfig, model: nn.Module, experts: list[str]) -> int:
    """The MoE layers (`experts` modules) a rank runs: all of them, or under pipeline
    parallel the most any pipeline rank's stages hold."""
    layout = Layout.of(cfg)
    if not layout.is_pp:
        return len(experts)
    firsts = [id(next(model.get_submodule(e).parameters())) for e in experts]
    return max(sum(f in rank_params(cfg, model, r) for f in firsts) for r in range(layout.pp))
