"""Memory plan of a recipe before any GPU is rented: FSDP units and per-rank memory by component.

    fsdprun plan llama-70b --world-size 64 --device-memory 80GB

Works for every registered model family (`fsdprun.models`; an HF folder's shapes come from its
config.json). Never imports the launcher (`fsdprun.launch`) nor `fsdprun.report`: it computes,
the report draws.

The model is built on the meta device (no memory), the FSDP units come from `plan_units` exactly as
the engines wrap them, and each unit's parameters, with their real shapes, go to the engine's own
memory rule (`engines.rank_memory`: fsdp2.py, fsdp1.py and ddp.py each keep theirs beside their
unit plan and build). FSDP2 shards dim 0 and pads it to a multiple of the shard group, so rank 0
holds ceil(dim0 / N) rows (the shape `model_state_bytes` measures in a run); FSDP1 flattens each
unit into one flat parameter (aligned and padded as FSDP1 does) and rank 0 holds its first 1/N.
This module only builds the model, collects the rows and estimates activations. An 8B or 70B
recipe plans in about 4 s on a 2-core CPU VM: loading torch, and torch._dynamo, which torch's
Python meta kernels (weight init, RoPE tables) load. A fake process group is not needed: the
shard shapes follow from the shapes alone. tests/test_memory_contract.py holds the plan to what
ranks measure at 8 and 64 ranks (fake process group) for every engine and sharding, within 5%.

Model state follows the ZeRO paper's mixed-precision Adam accounting, as fsdprun keeps it:
fp32 master parameters (4 B), fp32 gradients (4 B), two fp32 Adam moments (8 B) = 16 B/param,
plus AdamW's 4-byte step counter per tensor. Strategies divide it differently:

- full    full sharding (ZeRO-3): parameters, gradients, optimizer state / N.
- grad_op (ZeRO-2): gradients and optimizer state / N; the fp32 parameter shards / N too, but
          every unit's gathered copy (param_dtype) stays from forward to backward: the whole
          model in param_dtype is counted under gathered buffers.
- hybrid  full sharding inside groups of fsdp.shard_group_size ranks (default: one node),
          replicated across groups.
- ddp     nothing sharded (DistributedDataParallel; also what `sharding: none` holds).
The same accounting holds for fsdp1 and fsdp2, each with its own padding. Gradient accumulation
adds nothing by default (gradients are reduce-scattered into their shards on every micro-step);
with fsdp.accumulate_unsharded every rank also holds the whole model's unsharded gradients.

Gathered buffers and activations are estimates: each engine's memory rule and each parallel
dimension's own (`engines.activations.ACTIVATION_FORMULA`, tensor parallel's and context
parallel's beside their code) say how they are computed; this module composes them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from fsdprun.config import (
    Engine,
    LossKind,
    RecipeConfig,
    Sharding,
    load_recipe,
)
from fsdprun.config.layout import (
    Layout,
    effective_sharding,
    layout_errors,
)
from fsdprun.config.model_facts import model_facts
from fsdprun.config.schedule import bubble_fraction
from fsdprun.engines import ParamShape, translate, unit_plan
from fsdprun.engines.activations import (
    ACTIVATION_FORMULA,
    ring_bytes,
)
from fsdprun.engines.base import UnitPlan, accumulation_steps, backward_prefetch_depth
from fsdprun.engines.cp import CP_ACTIVATION_FORMULA, RING_MEMORY_FORMULA
from fsdprun.engines.ep import (
    EP_FORMULA,
    expert_unit_paths,
    experts_paths,
)
from fsdprun.engines.float8 import MFU_CONVENTION, float8_plan
from fsdprun.engines.tp import (
    TP_ACTIVATION_FORMULA,
    tp_plan_problem,
    tp_refusal,
    tp_shard_dims,
    tp_whole_grads,
)
from fsdprun.engines.units import plan_units
from fsdprun.errors import UserError
from fsdprun.fmt import fmt_bytes
from fsdprun.loss import describe_loss
from fsdprun.models import model_spec
from fsdprun.models.lora import apply_lora, num_trainable_params
from fsdprun.tools.rank_plan import (
    PlannedUnit,
    StrategyMemory,
    alltoall_bytes,
    full_counts,
    layout_memory,
    pipeline_ranks,
    pipeline_record,
    planned_units,
    rank_moe_layers,
    rank_params,
    sharded_engine,
    strategies_of,
    strategy_memory,
    unit_params,
    with_sharding,
)

BUFFER_FORMULA = (
    "unsharded params in param_dtype, padded as the engine pads them. fsdp2: the peak over forward "
    "and backward of its all-gather outputs and unsharded parameters, unit by unit (in forward a "
    "unit's all-gather output is freed only after the next unit's copy-out: about root + 3 x the "
    "largest unit when resharding, the whole model + 2 units when not); fsdp1: root + the "
    "largest unit x (1 + prefetch, at most 1), or the whole model when not resharding; ddp: "
    "autocast's param_dtype copies of the matmul weights. precision.float8=tensorwise: 1 byte "
    "for the weights of converted Linears, gathered in float8"
)


@dataclass
class MemoryPlan:
    recipe: str
    world_size: int
    nnodes: int
    nproc_per_node: int
    num_params: int
    param_dtype: str
    recipe_strategy: str
    device_memory_bytes: int | None
    units: list[PlannedUnit]
    strategies: dict[str, StrategyMemory]
    engine: str = "fsdp2"
    num_trainable_params: int | None = None  # < num_params under LoRA
    knobs: list[dict] = field(default_factory=list)
    mesh: list[tuple[str, int]] = field(default_factory=list)  # the recipe's: (dim, size)
    tp: int = 1
    tp_degrees: list[dict] = field(default_factory=list)  # TpOption at each degree, side by side
    cp: int = 1
    cp_degrees: list[dict] = field(default_factory=list)  # CpOption at each degree, side by side
    pp: int = 1
    # parallel.pp > 1: the schedule, its bubble and each pipeline rank's memory (PipelineRank);
    # the strategies above are then pp rank 0's (its stages' units and activations).
    pipeline: dict | None = None
    pp_degrees: list[dict] = field(default_factory=list)  # PpOption at each degree, side by side
    ep: int = 1
    ep_degrees: list[dict] = field(default_factory=list)  # EpOption (a model with experts)
    activation_formula: str = ACTIVATION_FORMULA
    buffer_formula: str = BUFFER_FORMULA
    notes: list[str] = field(default_factory=list)
    # The device memory as the user gave it (`80GB`, `24GiB`; `launch.device_memory_gb` as GB).
    device_memory_text: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# The TP degrees `plan` puts side by side (with the recipe's own): TP spans one node's ranks.
TP_DEGREES = (1, 2, 4, 8)
CP_DEGREES = (1, 2, 4, 8)  # parallel.cp degrees plan compares beside the recipe's
PP_DEGREES = (1, 2, 4, 8)  # parallel.pp degrees plan compares beside the recipe's
EP_DEGREES = (1, 2, 4, 8)  # parallel.ep degrees, for a model with experts


def mesh_text(dims: list[tuple[str, int]]) -> str:
    """A mesh's dims as `plan` prints them: [dp_shard 8 x tp 8]."""
    return "[" + " x ".join(f"{name} {n}" for name, n in dims) + "]"


def tp_problem(cfg: RecipeConfig) -> str | None:
    """Why `cfg` cannot train at its parallel.tp and parallel.cp (None: it can): what the recipe
    checks refuse of its layout (`config.layout.layout_errors`, the same rules), for the model's
    own facts (an HF folder's: its config.json)."""
    return "; ".join(layout_errors(cfg, model_facts(cfg.model))) or None


@dataclass
class TpOption:
    """The recipe at one TP degree, same world size: its mesh and rank 0's memory, or why the
    degree is not possible (`missing`)."""

    tp: int
    mesh: str | None = None
    memory: StrategyMemory | None = None
    missing: str | None = None
    note: str | None = None  # what the column changes beside tp (e.g. compile off)


@dataclass
class EpOption:
    """The recipe at one expert-parallel degree, same world size: its mesh, rank 0's memory and
    the bytes it sends by all-to-all in a step, or why the degree is not possible (`missing`)."""

    ep: int
    mesh: str | None = None
    memory: StrategyMemory | None = None
    alltoall_bytes: int = 0  # per rank and step (`engines.ep.ep_alltoall_bytes`)
    missing: str | None = None
    note: str | None = None  # what the column changes beside ep (compile off)


@dataclass
class CpOption:
    """The recipe at one context-parallel degree, same world size and tp: its mesh and rank 0's
    memory, or why the degree is not possible (`missing`)."""

    cp: int
    mesh: str | None = None
    memory: StrategyMemory | None = None
    missing: str | None = None
    note: str | None = None  # what the column changes beside cp (compile off)


@dataclass
class PpOption:
    """The recipe at one pipeline degree, same world size, tp and cp: its mesh, the largest
    pipeline rank's memory and the schedule's bubble, or why not (`missing`)."""

    pp: int
    mesh: str | None = None
    memory: StrategyMemory | None = None
    largest_rank: int = 0
    bubble: float = 0.0
    missing: str | None = None


def _pp_degrees(cfg: RecipeConfig, model: nn.Module, units_at) -> list[PpOption]:
    """The recipe at PP_DEGREES and its own degree, same world size, tp and cp, under its
    sharding with fsdp2: the mesh, the largest pipeline rank's memory and the bubble of its
    schedule (1f1b where the recipe runs none, gpipe where the micro-batches are fewer than
    pp), or why not (what `fsdprun train` refuses)."""
    from fsdprun.config import PpSchedule

    fsdp2, sharding = _as_fsdp2(cfg)
    options = []
    for pp in sorted({*PP_DEGREES, Layout.of(cfg).pp}):
        at, problem, _ = _at_degree(fsdp2, sharding, pp, pp=pp)
        if pp > 1 and problem is not None and at.parallel.pp_schedule is PpSchedule.one_f_one_b:
            # Too few micro-batches for 1f1b: gpipe holds them all and runs.
            gpipe = dataclasses.replace(at, parallel=dataclasses.replace(
                at.parallel, pp_schedule=PpSchedule.gpipe))  # fmt: skip
            if tp_problem(gpipe) is None:
                at, problem = gpipe, None
        if problem is not None:
            options.append(PpOption(pp, missing=problem))
            continue
        layout = Layout.of(at)
        if pp == 1:
            memory = strategy_memory(at, units_at(layout.tp), sharding, Engine.fsdp2)
            options.append(PpOption(pp, mesh=mesh_text(layout.mesh_dims), memory=memory))
            continue
        ranks = pipeline_ranks(at, model, units_at, sharding, Engine.fsdp2)
        worst = max(ranks, key=lambda r: r.memory.total)
        options.append(PpOption(
            pp, mesh=mesh_text(layout.mesh_dims), memory=worst.memory, largest_rank=worst.rank,
            bubble=bubble_fraction(layout.pp_schedule, pp, accumulation_steps(at),
                                   layout.pp_stages_per_rank),
        ))  # fmt: skip
    return options


def plan_memory(
    cfg: RecipeConfig, *, recipe: str = "", device_memory_bytes: int | None = None,
    device_memory_text: str | None = None,
) -> MemoryPlan:  # fmt: skip
    """Plan units and per-rank memory of `cfg` at its launch.* world size, on the meta device.

    Args:
        cfg: a validated recipe (launch.nproc_per_node x launch.nnodes = the world size).
        recipe: its name, for the report.
        device_memory_bytes: memory of one device; None = launch.device_memory_gb, or unknown.
        device_memory_text: that memory as the user typed it (`80GB`), for the plot's label.

    Returns:
        The plan; `strategies[s].fits` is None when the device memory is unknown.
    """
    spec = model_spec(cfg.model)
    with torch.device("meta"):
        model = spec.build(cfg.model)
    # Before LoRA wraps its Linears: what `fsdprun train` checks (its TP columns say why not).
    tp_plan = spec.tp_plan(cfg.model)
    split_problem = tp_plan_problem(model, tp_plan, family=model.family_name)
    # The recipe's own degree: refused as `fsdprun train` refuses it (engines.preflight).
    if (refusal := tp_refusal(cfg, model)) is not None:
        raise UserError(refusal)
    facts = model_facts(cfg.model)
    # The experts modules (a mixture of experts), found as the worker finds them.
    experts = experts_paths(model, facts.entry.experts if facts is not None else None)
    adapted = apply_lora(model, cfg=cfg.lora)
    # The activation estimates read the model's shape: an HF folder's comes from its config.json.
    cfg = dataclasses.replace(cfg, model=spec.shape(cfg.model))
    paths = plan_units(model, cfg=cfg.fsdp)
    layout = Layout.of(cfg)

    def rows_at(ep: int) -> list[UnitPlan]:  # expert parallel's units: experts modules too
        return unit_plan(cfg, paths, experts if ep > 1 else None)

    float8 = float8_plan(cfg)
    # A plan that does not split this model has no TP memory (its columns say why).
    splits = tp_plan if split_problem is None else split_problem
    tp_dims = tp_shard_dims(model, splits)
    whole = tp_whole_grads(model, splits)

    def unit_paths(ep: int) -> list[str]:  # the engines' units, whatever the recipe's engine
        return expert_unit_paths(paths, experts) if ep > 1 else paths

    def units_at(
        tp: int, keep: set[int] | None = None, ep: int = layout.ep
    ) -> list[list[ParamShape]]:
        return unit_params(model, unit_paths(ep), float8=float8, tp_dims=tp_dims,
                            whole_grads=whole, tp=tp, keep=keep, experts=experts,
                            ep=ep)  # fmt: skip

    units = units_at(layout.tp)
    pipeline, rank0 = None, None
    if layout.is_pp:
        ranks = pipeline_ranks(cfg, model, units_at, effective_sharding(cfg.fsdp),
                                sharded_engine(cfg))  # fmt: skip
        pipeline = pipeline_record(cfg, ranks)
        # Each strategy is then pp rank 0's: its stages' units and activations.
        rank0 = (units_at(layout.tp, rank_params(cfg, model, 0)), ranks[0].memory.activations,
                 ranks[0].memory.pipeline_buffers, ranks[0].in_flight > 1)  # fmt: skip
    recipe_strategy, strategies = strategies_of(cfg, units, rank0=rank0)
    tp_degrees, cp_degrees, pp_degrees, ep_degrees = [], [], [], []
    if cfg.world_size > 1:
        tp_degrees = _tp_degrees(cfg, units_at, split_problem=split_problem, model=model)
        cp_degrees = _cp_degrees(cfg, units, model=model, units_at=units_at)
        pp_degrees = _pp_degrees(cfg, model, units_at)
        if facts is not None and facts.num_experts:
            ep_degrees = _ep_degrees(cfg, units_at, model=model, experts=experts)
    if device_memory_bytes is None and cfg.launch.device_memory_gb is not None:
        device_memory_bytes = int(cfg.launch.device_memory_gb * 10**9)
        device_memory_text = f"{cfg.launch.device_memory_gb:g}GB"
    if device_memory_bytes is not None:
        options = [*tp_degrees, *cp_degrees, *pp_degrees, *ep_degrees]
        stage_memory = [r.memory for r in pipeline["ranks"]] if pipeline else []
        for s in [*strategies.values(), *(o.memory for o in options if o.memory), *stage_memory]:
            s.fits = s.total <= device_memory_bytes
    return MemoryPlan(
        recipe=recipe,
        world_size=cfg.world_size,
        nnodes=cfg.launch.nnodes,
        nproc_per_node=cfg.launch.nproc_per_node,
        num_params=sum(p.numel() for p in model.parameters()),  # tied weights once
        num_trainable_params=num_trainable_params(model),
        param_dtype=cfg.precision.param_dtype.value,
        recipe_strategy=recipe_strategy,
        engine=cfg.fsdp.engine.value,
        knobs=[asdict(k) for k in translate(cfg)],
        device_memory_bytes=device_memory_bytes,
        device_memory_text=device_memory_text if device_memory_bytes is not None else None,
        units=planned_units(
            cfg, units, rows_at(layout.ep), full_counts(model, unit_paths(layout.ep))
        ),  # fmt: skip
        strategies=strategies,
        mesh=layout.mesh_dims,
        tp=layout.tp,
        tp_degrees=[asdict(o) for o in tp_degrees],
        cp=layout.cp,
        cp_degrees=[asdict(o) for o in cp_degrees],
        pp=layout.pp,
        pipeline=pipeline and {**pipeline, "ranks": [asdict(r) for r in pipeline["ranks"]]},
        pp_degrees=[asdict(o) for o in pp_degrees],
        ep=layout.ep,
        ep_degrees=[asdict(o) for o in ep_degrees],
        notes=_notes(
            cfg,
            model,
            num_adapted=len(adapted),
            tp_dims=tp_dims,
            moe_layers=rank_moe_layers(cfg, model, experts),
        ),
    )


def _as_fsdp2(cfg: RecipeConfig) -> tuple[RecipeConfig, Sharding]:
    """The recipe with fsdp2 (the engine TP and CP compose with) and the sharding its columns
    show: a ddp recipe's are what fsdp2 would hold, sharded fully."""
    sharding = Sharding.full if cfg.fsdp.engine is Engine.ddp else effective_sharding(cfg.fsdp)
    return dataclasses.replace(
        cfg, fsdp=dataclasses.replace(cfg.fsdp, engine=Engine.fsdp2)
    ), sharding


def _at_degree(
    fsdp2: RecipeConfig, sharding: Sharding, degree: int, **parallel: int
) -> tuple[RecipeConfig, str | None, str | None]:
    """`fsdp2` at `parallel` (tp= or cp=, of `degree`) under `sharding`: (the config, why
    `fsdprun train` would refuse it or None, a note). TP and CP refuse compile only with some
    other knobs (activation checkpointing): a degree refused only for compile is shown with
    compile off, as that is the run it could be."""
    at = with_sharding(
        dataclasses.replace(fsdp2, parallel=dataclasses.replace(fsdp2.parallel, **parallel)),
        sharding,
    )
    problem = tp_problem(at) if degree > 1 else None
    if problem is not None and at.compile.enabled:
        eager = dataclasses.replace(at, compile=dataclasses.replace(at.compile, enabled=False))
        if tp_problem(eager) is None:
            return eager, None, "compile off"
    return at, problem, None


def _degree_options(
    cfg: RecipeConfig,
    dim: str,
    degrees: tuple[int, ...],
    option: type,
    column,
    *,
    refusal=lambda degree: None,
) -> list:
    """The recipe at `degrees` of parallel.`dim` and its own degree, at its world size, under its
    sharding with fsdp2 (the engine tp, cp and ep compose with): each an `option` with its mesh
    and the fields `column(at, degree, sharding)` gives, or why not (what `fsdprun train`
    refuses, else `refusal(degree)`). A degree refused only because of compile is shown with
    compile off (`_at_degree`), as that is the run it could be."""
    fsdp2, sharding = _as_fsdp2(cfg)
    options = []
    for degree in sorted({*degrees, getattr(Layout.of(cfg), dim)}):
        at, problem, note = _at_degree(fsdp2, sharding, degree, **{dim: degree})
        problem = problem if problem is not None else refusal(degree)
        if problem is not None:
            options.append(option(degree, missing=problem))
            continue
        options.append(option(degree, mesh=mesh_text(Layout.of(at).mesh_dims), note=note,
                              **column(at, degree, sharding)))  # fmt: skip
    return options


def _tp_degrees(
    cfg: RecipeConfig, units_at, *, split_problem: str | None, model: nn.Module
) -> list[TpOption]:
    """The recipe at TP_DEGREES: rank 0's memory (under pp the largest pipeline rank's);
    `units_at(tp)` gives the units at a degree; `split_problem`: why the family's plan does not
    split the model (`engines.tp.tp_plan_problem`), or None."""
    return _degree_options(
        cfg, "tp", TP_DEGREES, TpOption,
        lambda at, tp, sharding: {"memory": layout_memory(
            at, units_at(tp), sharding, model=model, units_at=units_at)},
        refusal=lambda tp: split_problem if tp > 1 else None,
    )  # fmt: skip


def _cp_degrees(
    cfg: RecipeConfig, units: list[list[ParamShape]], *, model: nn.Module, units_at
) -> list[CpOption]:
    """The recipe at CP_DEGREES, at its tp: rank 0's memory (the ring refuses
    compile.fullgraph, tp compile with checkpointing: those degrees show compile off)."""
    return _degree_options(
        cfg, "cp", CP_DEGREES, CpOption,
        lambda at, cp, sharding: {"memory": layout_memory(
            at, units, sharding, model=model, units_at=units_at)},
    )  # fmt: skip


def _ep_degrees(
    cfg: RecipeConfig, units_at, *, model: nn.Module, experts: list[str]
) -> list[EpOption]:
    """The recipe at EP_DEGREES: rank 0's memory (under pp the largest pipeline rank's) and the
    all-to-all bytes a step over the MoE layers (`experts`) a rank holds; `units_at(tp, ep=)`
    gives the units at a degree."""
    tp = Layout.of(cfg).tp

    def column(at: RecipeConfig, ep: int, sharding: Sharding) -> dict:
        units = units_at(tp, ep=ep)
        return {
            "memory": layout_memory(at, units, sharding, model=model, units_at=units_at),
            "alltoall_bytes": alltoall_bytes(at, rank_moe_layers(at, model, experts)),
        }

    return _degree_options(cfg, "ep", EP_DEGREES, EpOption, column)


def _notes(
    cfg: RecipeConfig, model: nn.Module, *, num_adapted: int, tp_dims: dict[int, int],
    moe_layers: int = 0,
) -> list[str]:  # fmt: skip
    """What the plan counts and how, and what it leaves out."""
    fsdp, layout = cfg.fsdp, Layout.of(cfg)
    notes = []
    if layout.is_tp:
        replicated = [n for n, p in model.named_parameters() if id(p) not in tp_dims]
        whole = sum(p.numel() for p in model.parameters() if id(p) not in tp_dims)
        notes.append(
            f"tensor parallel {layout.tp}: each parameter is TP rank 0's local shard "
            "(column-wise q/k/v and gate/up, row-wise o and down, the embedding and output on "
            f"the vocab), then FSDP's over dp_shard; {len(replicated)} tensors ({whole:,} "
            "params: the norms) are whole on every TP rank, so they divide by dp_shard only. "
            f"Gathered buffers are 1/tp of each unit (FSDP gathers over the dp dims only). "
            f"{TP_ACTIVATION_FORMULA}"
        )
    if layout.is_ep:
        notes.append(
            f"expert parallel {layout.ep}: {EP_FORMULA}; here the all-to-all sends "
            f"{fmt_bytes(alltoall_bytes(cfg, moe_layers))} a step from each rank"
        )
    if layout.is_cp:
        ring = ring_bytes(cfg)
        notes.append(
            f"context parallel {layout.cp}: FSDP shards every parameter over dp_shard x "
            f"cp ({layout.fsdp_shards} ranks), so the cp ranks hold no duplicate state. "
            f"{CP_ACTIVATION_FORMULA}"
            + (f". {RING_MEMORY_FORMULA} ({ring:,} bytes here; the activations count the "
               "larger of it and the loss's, which is freed before)" if ring else "")
        )  # fmt: skip
    notes += [
        "model state: fp32 params 4 B + fp32 grads 4 B + Adam moments 8 B per param "
        "(+ 4 B step per tensor), from each parameter's rank-0 shard of ceil(dim0 / N) rows "
        "(fsdp2) or the first 1/N of each unit's padded flat parameter (fsdp1)",
        f"prefetch depth {max(fsdp.forward_prefetch, backward_prefetch_depth(fsdp))} (max of "
        "fsdp.forward_prefetch and fsdp.backward_prefetch)",
        "gradient accumulation: gradients are reduce-scattered into their shards on every "
        "micro-step; with fsdp.accumulate_unsharded every rank also keeps the whole model's "
        "unsharded gradients until the last micro-step (the unsharded grads row)",
        "not counted: allocator fragmentation and cache, communication buffers, the CUDA "
        "context, unsharded gradients before their reduce-scatter",
        "ddp: gathered buffers are autocast's param_dtype copies of the matmul weights; its fp32 "
        "norm activations are not modelled (the ddp total is the least certain)",
    ]
    if num_adapted:
        num_params = sum(p.numel() for p in model.parameters())
        notes.append(
            f"lora: rank {cfg.lora.rank} adapters on {num_adapted} Linear layers; "
            f"{num_trainable_params(model):,} of {num_params:,} params train: "
            "the frozen base keeps its fp32 shards but has no gradients and no AdamW state"
        )
    if cfg.train.loss is LossKind.chunked:
        notes.append(f"loss: {describe_loss(cfg.train)}")
    if cfg.precision.float8.value != "off":
        notes.append(f"float8: {float8_plan(cfg).describe(model)}")
        notes.append(MFU_CONVENTION)
    return notes


def plan_recipe(
    recipe: str,
    overrides: list[str],
    *,
    world_size: int | None = None,
    nnodes: int | None = None,
    device_memory_bytes: int | None = None,
    device_memory_text: str | None = None,
) -> MemoryPlan:
    """Resolve `recipe` at the asked world size and plan it.

    `world_size` keeps the recipe's nproc_per_node when it divides (more or fewer nodes), else
    puts all ranks on one node; with `nnodes` too, nproc_per_node = world_size / nnodes.

    Raises:
        UserError: an invalid recipe, or a world size the node count does not divide.
    """
    launch: list[str] = []
    if world_size is not None:
        if world_size < 1:
            raise UserError(f"--world-size must be >= 1 (got {world_size})")
        if nnodes is None:
            per_node = load_recipe(recipe, overrides, check=False).config.launch.nproc_per_node
            nnodes = world_size // per_node if world_size % per_node == 0 else 1
        if nnodes < 1 or world_size % nnodes:
            raise UserError(
                f"--world-size {world_size} is not divisible by --nnodes {nnodes}; ranks are "
                "spread evenly over the nodes"
            )
        launch = [f"launch.nproc_per_node={world_size // nnodes}", f"launch.nnodes={nnodes}"]
    elif nnodes is not None:
        launch = [f"launch.nnodes={nnodes}"]
    resolved = load_recipe(recipe, [*overrides, *launch])
    return plan_memory(
        resolved.config, recipe=resolved.name, device_memory_bytes=device_memory_bytes,
        device_memory_text=device_memory_text,
    )  # fmt: skip


# The pre-launch estimate of a step on CPU assumes this many FLOP/s per core: about the bf16
# peak of one AVX-512 core. Training reaches a fraction of it, so the estimate is a lower bound
# and a warning from it is never a false alarm about speed.
CPU_FLOPS_PER_CORE = 200e9
# A step estimated longer than this is "absurd" for the warning: no step line for minutes.
SLOW_STEP_S = 60.0


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def hardware_warnings(
    cfg: RecipeConfig,
    *,
    device_kind: str,
    memory_per_rank_bytes: int | None,
    memory_source: str,
    cpus_per_node: int,
) -> list[str]:
    """One line for each way the run looks absurd on the hardware found, from the plan: its
    peak memory per rank above what a rank has, and on CPU a step estimated over SLOW_STEP_S
    (FLOPs per step at CPU_FLOPS_PER_CORE on every core of every node).

    Args:
        cfg: the validated recipe about to launch.
        device_kind: what launch.device resolved to (cpu, cuda, ...).
        memory_per_rank_bytes: what one rank may use (a device's memory; on CPU the machine's
            RAM / ranks per node); None = unknown.
        memory_source: how that figure was found, for the line ("RAM 23.0 GiB / 2 ranks").
        cpus_per_node: CPU cores of one node.
    """
    plan = plan_memory(cfg)
    planned = plan.strategies[plan.recipe_strategy].total
    warnings = []
    if memory_per_rank_bytes is not None and planned > memory_per_rank_bytes:
        ranks = f"{cfg.world_size} rank{'s' if cfg.world_size > 1 else ''}"
        warnings.append(
            f"the plan puts {_gib(planned)} on each rank ({plan.recipe_strategy} sharding on "
            f"{ranks}) but a rank here has {_gib(memory_per_rank_bytes)} ({memory_source}): "
            "expect it to run out of memory (fsdprun plan shows the parts)"
        )
    if device_kind == "cpu":
        spec = model_spec(cfg.model)
        t = cfg.train
        flops = spec.flops_per_token(cfg.model, t.seq_len) * t.global_batch_size * t.seq_len
        rate = CPU_FLOPS_PER_CORE * cpus_per_node * cfg.launch.nnodes
        step_s = flops / rate
        if step_s > SLOW_STEP_S:
            warnings.append(
                f"a step of {flops / 1e12:,.0f} TFLOP on {cpus_per_node * cfg.launch.nnodes} CPU "
                f"cores takes at least ~{step_s:,.0f} s ({t.steps} steps: at least "
                f"~{step_s * t.steps / 3600:,.1f} h; an estimate at "
                f"{CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s per core, real runs are slower)"
            )
    return warnings
