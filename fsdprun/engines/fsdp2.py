"""The fsdp2 engine (`fully_shard`, per-parameter DTensor shards; the default): what it does with
each `fsdp.*` key (`knobs`), its units as `fsdprun plan` shows them (`unit_plan`), what they hold
on a rank (`memory`: dim-0 shards padded to the shard group, the gathered peak unit by unit), and
the build that applies exactly those (`apply_fsdp`, `build`).

Never imports torch at module load (the knob table and unit plan are read without it); the build
imports it where it runs.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

from fsdprun.config import (
    Dtype,
    FsdpConfig,
    RecipeConfig,
    Sharding,
    WrapPolicy,
)
from fsdprun.config.layout import Layout, cp_impl, effective_sharding
from fsdprun.config.model_facts import model_facts
from fsdprun.engines.base import (
    ADAM_STATE_BYTES,
    ADAM_STEP_BYTES,
    DEFER_ALL_REDUCE,
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
    by_mesh,
    gathered_bytes,
    grad_norm,
    reshards_after_forward,
    unsharded_grads_text,
)
from fsdprun.engines.ep import outside_experts, with_expert_units

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from fsdprun.engines.hf_weights import HFWeights

# 2-D (replicate x shard) meshes: their replica all-reduce can wait for the last micro-step.
_TWO_D = (Sharding.hybrid, Sharding.hybrid_zero2, Sharding.none)


def accumulation(cfg: RecipeConfig) -> str:
    """REDUCE on 1-D meshes, DEFER_ALL_REDUCE on 2-D ones, LOCAL with fsdp.accumulate_unsharded."""
    if cfg.fsdp.accumulate_unsharded:
        return LOCAL
    return DEFER_ALL_REDUCE if effective_sharding(cfg.fsdp) in _TWO_D else REDUCE


def _accumulation_text(cfg: RecipeConfig) -> str:
    mode = accumulation(cfg)
    if mode == DEFER_ALL_REDUCE:
        return (
            "reduce-scatter into the gradient shards on every micro-step; the replica all-reduce "
            "on the last one only (set_requires_all_reduce)"
        )
    if mode == REDUCE:
        return REDUCE_TEXT
    if effective_sharding(cfg.fsdp) is Sharding.none:
        return WHOLE_GRADS_TEXT
    return unsharded_grads_text("set_requires_gradient_sync(False)")


def _backward_prefetch_text(bwd: str, depth: int) -> str:
    if bwd == "post":
        return (
            "FSDP2 has no post-gradient prefetch: its implicit prefetch of the next unit (as pre)"
        )
    if bwd == "none":
        return "FSDP2 cannot turn backward prefetch off: its implicit one-unit prefetch stays"
    if depth <= 1:
        return "FSDP2's implicit prefetch of the next unit"
    return f"set_modules_to_backward_prefetch: {depth} units ahead"


def knobs(cfg: RecipeConfig, layout: Layout, add) -> None:
    """Add what fully_shard does with each `fsdp.*` and precision key under `layout`."""
    f, p = cfg.fsdp, cfg.precision
    sharding, group, ws = layout.sharding, layout.shard_group, layout.world_size
    dims = layout.mesh_dims
    if layout.is_tp or layout.is_cp or layout.is_pp or layout.is_ep:
        dp = [f"{n} {name}" for name, n in dims if name not in ("tp", "pp")]
        flat = " (dp_shard x cp flattened into one)" if layout.is_cp else ""
        if layout.is_ep:
            flat = (" (dp_shard_mod_ep x ep flattened back into one dp_shard; each expert over "
                    "dp_shard_mod_ep only)")  # fmt: skip
        mesh = f"fully_shard over the {' x '.join(dp)} dims of the mesh{flat}"
    elif sharding in _TWO_D:
        mesh = f"2-D mesh ({layout.dp_replicate} replicate x {group} shard)"
    else:
        mesh = f"1-D mesh of {ws} ranks"
    add("fsdp.engine", "fsdp2", "fully_shard (per-parameter DTensor shards)")
    if layout.is_tp:
        add(
            "parallel.tp",
            layout.tp,
            f"device mesh {layout.describe()}: parallelize_module with the family's plan over "
            "the tp dim (ranks of one TP group read the same batch; loss parallel on "
            "vocab-sharded logits), then fully_shard over the data-parallel dims",
        )
    if layout.is_pp:
        sched = cfg.parallel.pp_schedule.value
        add(
            "parallel.pp",
            layout.pp,
            f"device mesh {layout.describe()}: the layers cut into {layout.num_stages} stages "
            f"(parallel.pp_schedule={sched}), each stage a fully_shard root over its own "
            "data-parallel ranks; activations and their gradients go between stages once per "
            "micro-batch; each micro-batch's gradients reduce-scattered as it finishes",
        )
    if layout.is_cp:
        cp = layout.cp
        add(
            "parallel.cp",
            cp,
            f"device mesh {layout.describe()}: each row's sequence split over {cp} ranks "
            f"(seq_len / {cp} "
            "tokens each, with their rotary positions); parameters sharded over dp_shard x cp",
        )
        impl = cp_impl(cfg, model_facts(cfg.model))
        add(
            "parallel.cp_impl",
            cfg.parallel.cp_impl,
            f"{impl}: one all-to-all before each attention trades this rank's slice of "
            f"every head for the whole sequence of heads / {cp}, one after trades back "
            "(DeepSpeed-Ulysses); attention then sees whole rows and the whole mask"
            if impl == "alltoall"
            else f"{impl}: each rank's keys and values go round the {cp} ranks of its cp group "
            f"({cp - 1} sends), every rank attends its queries to each part as it arrives, "
            "merged by log-sum-exp (ring attention; every head stays on every rank); cp rank j "
            f"holds zig-zag chunks j and {2 * cp - 1}-j of {2 * cp}, the same causal work on "
            "every rank",
        )
    if layout.is_ep:
        ep = layout.ep
        add(
            "parallel.ep",
            ep,
            f"device mesh {layout.describe()}: each MoE layer's experts sharded over {ep} ranks "
            f"(experts / {ep} each, Shard(0) DTensors) and each expert over the "
            f"{layout.expert_shards} dp_shard_mod_ep ranks; tokens go to their experts' ranks "
            "and back by all-to-all (dropless)",
        )
    add(
        "fsdp.sharding",
        f.sharding,
        f"{mesh}, reshard_after_forward={reshards_after_forward(sharding)}"
        + (f" ({_unsharded_text(layout)})" if sharding is Sharding.none else ""),
    )
    if f.reshard_after_forward is not None:
        add(
            "fsdp.reshard_after_forward",
            f.reshard_after_forward,
            f"overrides fsdp.sharding: effective sharding {sharding.value}",
        )
    if f.shard_group_size is not None or sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        add("fsdp.shard_group_size", f.shard_group_size, _shard_group_text(layout))
    wrap = {WrapPolicy.block: "fully_shard on each transformer block, then the root",
            WrapPolicy.size: f"fully_shard on modules with >= {f.min_num_params} params not yet "
                             "wrapped, then the root",
            WrapPolicy.classes: f"fully_shard on {', '.join(f.wrap_classes)} modules, then "
                                "the root",
            WrapPolicy.none: "fully_shard on the root only"}[f.wrap]  # fmt: skip
    add("fsdp.wrap", f.wrap, wrap)
    param = "None" if p.param_dtype is Dtype.fp32 else DTYPE_NAMES[p.param_dtype]
    mp = f"MixedPrecisionPolicy(param_dtype={param}, reduce_dtype={DTYPE_NAMES[p.reduce_dtype]})"
    add("precision.param_dtype", p.param_dtype, mp)
    if p.buffer_dtype is not None:
        add(
            "precision.buffer_dtype",
            p.buffer_dtype,
            "no effect: FSDP2 does not cast buffers (the RoPE table is cast where it is used)",
        )
    bwd = str(f.backward_prefetch)
    add("fsdp.backward_prefetch", bwd, _backward_prefetch_text(bwd, backward_prefetch_depth(f)))
    add(
        "fsdp.forward_prefetch",
        f.forward_prefetch,
        f"set_modules_to_forward_prefetch: {f.forward_prefetch} units ahead"
        if f.forward_prefetch
        else "none (all-gather when each unit's forward starts)",
    )
    add(
        "fsdp.limit_all_gathers",
        f.limit_all_gathers,
        "no effect: FSDP2 frees gathered memory with stream events and needs no rate limiter",
    )
    add(
        "fsdp.use_orig_params",
        f.use_orig_params,
        "no effect: FSDP2 always keeps the original parameters",
    )
    add("fsdp.cpu_offload", f.cpu_offload, "CPUOffloadPolicy" if f.cpu_offload else "off")
    add("fsdp.accumulate_unsharded", f.accumulate_unsharded, _accumulation_text(cfg))


def _split_text(layout: Layout) -> str:
    """The ranks besides the shard group that split one copy of the model state: FSDP2 shards
    over dp_shard x cp, and tensor parallel splits each parameter over tp."""
    parts = [f"{n} {name} ranks" for name, n in (("cp", layout.cp), ("tp", layout.tp)) if n > 1]
    return " x ".join(parts)


def _unsharded_text(layout: Layout) -> str:
    """What fsdp.sharding=none leaves on a rank: the whole state, or under cp and tp its share
    of one copy (none replicates across data-parallel ranks only)."""
    if layout.state_ranks == 1:
        return "no sharding: every rank holds the whole model state"
    return (
        f"no sharding across data-parallel ranks: each of the {layout.dp} holds a whole copy, "
        f"split over its {_split_text(layout)}: 1/{layout.state_ranks} of the model state a rank"
    )


def _shard_group_text(layout: Layout) -> str:
    """fsdp.shard_group_size counts data-parallel ranks: under cp, FSDP2 shards over them times
    the cp ranks; under tp, each parameter is split over the tp ranks besides."""
    group = layout.shard_group
    if layout.state_ranks == group:
        return f"{group} ranks per shard group"
    return (
        f"{group} data-parallel ranks per shard group, each with its {_split_text(layout)}: "
        f"one copy of the model state split over {layout.state_ranks} ranks"
    )


def unit_plan(paths: list[str], fsdp: FsdpConfig) -> list[UnitPlan]:
    """The units `apply_fsdp` makes of the wrap policy's `paths`, the root last: whether each
    reshards after forward and which units it prefetches (explicitly, or "implicit")."""
    reshard = reshards_after_forward(effective_sharding(fsdp))
    depth = backward_prefetch_depth(fsdp)
    rows = []
    for i, path in enumerate(paths):
        # The last unit's parameters are needed again as soon as backward starts: resharding
        # them after forward would only buy an immediate second all-gather.
        backward = list(reversed(paths[max(0, i - depth) : i])) if depth > 1 else "implicit"
        forward = paths[i + 1 : i + 1 + fsdp.forward_prefetch]
        rows.append(UnitPlan(path, reshard and i < len(paths) - 1, forward, backward))
    rows.append(UnitPlan("", False, [], []))  # the root is not resharded after forward
    return rows


def _rank0_elems(shape: tuple[int, ...], shards: int) -> int:
    # Shard(0) pads dim 0 to a multiple of `shards`: rank 0 gets ceil(dim0 / shards) rows.
    if not shape:
        return 1
    rows = min(shape[0], math.ceil(shape[0] / shards))
    return rows * math.prod(shape[1:])


def _gathered_elems(shape: tuple[int, ...], shards: int) -> int:
    # The all-gather output of one parameter: dim 0 padded to a multiple of `shards`.
    if not shape:
        return shards
    return math.ceil(shape[0] / shards) * shards * math.prod(shape[1:])


def dim0_shards(
    units: list[list[ParamShape]], shards: int
) -> tuple[list[int], list[int], int, int]:
    """Every parameter sharded on dim 0 on its own (ddp: shards=1) over `shards` ranks; under
    expert parallel an ep rank's experts (`ParamShape.local_shape`) over shards / ep. Returns,
    per unit, the elements of rank 0's shard and of the gathered copy; AdamW's bytes; the
    trained elements of rank 0's shard (frozen parameters, the base under LoRA, have no
    gradient and no state)."""

    def over(p: ParamShape) -> int:  # an ep rank's experts: over the unit's ranks / ep
        return max(shards // p.ep, 1)

    trained = [p for own in units for p in own if p.trainable]
    trainable = sum(_rank0_elems(p.local_shape, over(p)) for p in trained)
    return (
        [sum(_rank0_elems(p.local_shape, over(p)) for p in own) for own in units],
        [sum(_gathered_elems(p.local_shape, over(p)) for p in own) for own in units],
        ADAM_STATE_BYTES * trainable + ADAM_STEP_BYTES * len(trained),
        trainable,
    )


def _gathered_peak(
    units: list[int], kept: list[bool], root: int, root_kept: bool, *, forward: int,
    backward: int, inner: list[list[int]] | None = None, carried: bool = False,
) -> int:  # fmt: skip
    """Peak unsharded bytes on one rank, unit by unit (root first in forward).

    A unit is all-gathered into one flat output, then copied out into its unsharded parameters
    (the same size). In forward, FSDP2 frees a unit's flat output only after the next unit's
    copy-out (to overlap that copy with the next all-gather); in backward, right after its own.
    `kept` units are not resharded after forward. Prefetch: `forward` units ahead explicitly,
    in backward `backward` units ahead (implicitly one). `inner[k]`: the sizes of the units that
    run inside unit k (expert parallel's experts inside their block), which reshard as unit k
    does; unit k's parameters stay gathered while they run, in forward and in backward.
    `carried`: a forward runs while an earlier micro-batch's waits for its backward (a pipeline
    schedule's, as 1F1B's warm-up): the `kept` units (and their inner ones) are then still
    gathered from that one.
    """
    inner = inner or [[] for _ in units]

    def forward_peak(carry: int) -> int:
        """One forward's peak, with `carry` bytes of kept units still gathered (which it then
        does not gather again)."""
        peak = 2 * root + carry  # the root's copy-out: its flat output and its parameters
        held, prev_flat = root + carry, root
        for k, size in enumerate(units):
            if carry and kept[k]:
                continue  # still gathered from the earlier micro-batch: no all-gather
            early = sum(units[k + 1 : k + forward]) if k else 0  # prefetched by earlier units
            peak = max(peak, held + prev_flat + 2 * size + early)
            if forward:  # after its copy-out, a unit prefetches the next `forward` units
                peak = max(peak, held + 2 * size + sum(units[k + 1 : k + 1 + forward]))
            prev_flat = size
            for child in inner[k]:  # unit k's flat output is freed after this copy-out
                peak = max(peak, held + size + prev_flat + 2 * child)
                prev_flat = child
            held += size + sum(inner[k]) if kept[k] else 0
        return peak

    peak = forward_peak(0)
    if carried:  # the next micro-batch's forward, the kept units still gathered
        peak = max(peak, forward_peak(sum(s + sum(inner[k]) for k, s in enumerate(units)
                                          if kept[k])))  # fmt: skip
    held = sum(size + sum(inner[k])
               for k, (size, keep) in enumerate(zip(units, kept, strict=True)) if keep)  # fmt: skip
    if not root_kept:
        peak = max(peak, held + 2 * root)
    held += root
    depth = max(backward, 1)
    for k in reversed(range(len(units))):
        if not kept[k]:
            early = sum(units[i] for i in range(max(0, k - depth + 1), k) if not kept[i])
            peak = max(peak, held + 2 * units[k] + early)
            held += units[k]
            for child in inner[k]:  # gathered and released inside unit k's backward
                peak = max(peak, held + 2 * child + early)
        ahead = sum(units[i] for i in range(max(0, k - depth), k) if not kept[i])
        peak = max(peak, held + ahead)
        held -= units[k] + (sum(inner[k]) if kept[k] else 0)
    return peak


def memory(
    units: list[list[ParamShape]], cfg: RecipeConfig, *, sharding: Sharding, shards: int,
    carried: bool = False,
) -> RankMemory:  # fmt: skip
    """What rank 0 holds when `units` (each unit's own parameters, the root last) are sharded
    over `shards` ranks under `sharding`; `carried`: a pipeline rank that runs a micro-batch's
    forward while an earlier one waits for its backward (`_gathered_peak`)."""
    pbytes = DTYPE_BYTES[cfg.precision.param_dtype]
    shard, gathered, optimizer, trainable = dim0_shards(units, shards)
    sizes = gathered_bytes(units, gathered, pbytes)
    root = sizes[-1]
    blocks, inner = _nested(units[:-1], sizes[:-1])
    reshard = reshards_after_forward(sharding)
    if sharding is Sharding.none:
        buffers = sum(sizes)  # no all-gather: each unit's parameters are cast once and kept
    else:
        # The last block stays gathered for backward; without resharding every unit and the root.
        kept = [not reshard or i == len(blocks) - 1 for i in range(len(blocks))]
        buffers = _gathered_peak(
            blocks, kept, root, not reshard, forward=cfg.fsdp.forward_prefetch,
            backward=backward_prefetch_depth(cfg.fsdp), inner=inner, carried=carried,
        )  # fmt: skip
    unsharded_grads = 0
    if accumulation(cfg) == LOCAL and accumulation_steps(cfg) > 1 and shards > 1:
        # Every trained parameter's whole gradient, in reduce_dtype, until the last micro-step.
        trained = sum(p.grad_numel for own in units for p in own if p.trainable)
        unsharded_grads = trained * DTYPE_BYTES[cfg.precision.reduce_dtype]
    return RankMemory(
        shard_bytes=[MASTER_BYTES * n for n in shard], gathered_bytes=sizes,
        params=MASTER_BYTES * sum(shard), grads=MASTER_BYTES * trainable, optimizer=optimizer,
        buffers=buffers, accumulation=unsharded_grads,
    )  # fmt: skip


def _nested(units: list[list[ParamShape]], sizes: list[int]) -> tuple[list[int], list[list[int]]]:
    """The units' gathered `sizes` as the peak sees them (`_gathered_peak`): an experts unit of
    expert parallel (its parameters split over ep ranks; `engines.ep.with_expert_units` puts it
    before its block) runs inside the unit after it. Returns the other units' sizes and the
    sizes of the units inside each."""
    outer: list[int] = []
    inner: list[list[int]] = []
    waiting: list[int] = []
    for own, size in zip(units, sizes, strict=True):
        if own and all(p.ep > 1 for p in own):
            waiting.append(size)
            continue
        outer.append(size)
        inner.append(waiting)
        waiting = []
    return outer, inner


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    cfg: FsdpConfig,
    param_dtype: Dtype,
    reduce_dtype: Dtype,
    pin_memory: bool,
    experts: list[str] | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> list[FsdpUnit]:
    """Shard `model` with `fully_shard` per `unit_plan`, then set explicit prefetch.

    Under expert parallel, each of the `experts` modules (already sharded over the ep mesh,
    `fsdprun.engines.ep.apply_ep`) is a unit of its own over `expert_mesh`, made just before the
    unit that holds it (resharding as that one does); the wrap policy's units never include
    one.

    Returns:
        The units in forward order (an experts unit before its block), the root last.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from fsdprun.engines.units import plan_units
    from fsdprun.engines.weights import TORCH_DTYPES

    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype is Dtype.fp32 else TORCH_DTYPES[param_dtype],
        reduce_dtype=TORCH_DTYPES[reduce_dtype],
    )
    common: dict = {"mesh": mesh, "mp_policy": mp}
    if cfg.cpu_offload:
        # pin_memory needs an accelerator; on a CPU-only host it must be off.
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    experts = list(experts or [])
    rows = unit_plan(outside_experts(plan_units(model, cfg=cfg), experts), cfg)
    rows = with_expert_units(rows, experts, reshard=reshards_after_forward(effective_sharding(cfg)))
    modules = dict(model.named_modules())
    units: list[FsdpUnit] = []
    # Parameters an earlier unit took (not "already a DTensor": tensor parallel makes every
    # parameter one before FSDP); counted at their full size. fully_shard replaces a unit's
    # parameters by new DTensor ones, whose ids are taken too.
    taken: set[int] = set()

    def own(module: nn.Module) -> int:
        mine = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        return sum(p.numel() for p in mine)

    for row in rows[:-1]:
        module = modules[row.path]
        before = own(module)
        # An experts unit shards over its own mesh (`fsdprun.engines.ep.with_expert_units`).
        mesh_of = {"mesh": expert_mesh} if row.path in experts else {}
        fully_shard(module, reshard_after_forward=row.reshard_after_forward,
                    **{**common, **mesh_of})  # fmt: skip
        taken.update(id(p) for p in module.parameters())
        units.append(FsdpUnit(row.path, before, row.reshard_after_forward))
    root_params = own(model)
    # FSDP2 keeps the root gathered after forward whatever its flag (backward needs it first).
    reshard_root = reshards_after_forward(effective_sharding(cfg))
    fully_shard(model, reshard_after_forward=reshard_root, **common)
    units.append(FsdpUnit("", root_params, False))

    for row in rows[:-1]:
        if row.forward_prefetch:
            modules[row.path].set_modules_to_forward_prefetch(
                [modules[p] for p in row.forward_prefetch]
            )
        if isinstance(row.backward_prefetch, list) and row.backward_prefetch:
            modules[row.path].set_modules_to_backward_prefetch(
                [modules[p] for p in row.backward_prefetch]
            )
    return units


def build(
    model: nn.Module,
    cfg: RecipeConfig,
    *,
    device: torch.device,
    device_kind: str,
    world_size: int,
    weights: HFWeights | None,
    common: dict,
    mesh: DeviceMesh | None = None,
    parts: list[nn.Module] | None = None,
) -> Engine:
    """Shard the meta `model`, then fill each rank's shards: pretrained `weights` read shard-wise,
    or the seeded initial values. `mesh`: the mesh tensor, context, pipeline or expert parallel
    split the model over (`fsdprun.engines.tp`, `cp`, `pp`, `ep`); fully_shard shards over its
    data-parallel dims, and each expert under ep over dp_shard_mod_ep. `parts`: under pipeline
    parallel, the module each of this rank's stages runs (`fsdprun.engines.pp`), each sharded as
    its own root; `model` (the pruned model that holds them all) is what the optimizer and
    checkpoints see."""
    import torch

    from fsdprun.engines.adapters import init_adapters
    from fsdprun.engines.ep import experts_paths
    from fsdprun.engines.mesh import build_device_mesh, dp_mesh, expert_mesh
    from fsdprun.engines.weights import init_weights

    layout = Layout.of(cfg, world_size)
    fsdp_mesh = dp_mesh(mesh) if mesh is not None else build_device_mesh(layout, device_kind)
    roots = [model]
    if parts is not None:
        from torch.distributed import get_rank

        from fsdprun.engines.pp import stage_roots

        roots = stage_roots(parts, layout=layout, rank=get_rank())
    # The experts `apply_ep` sharded over the mesh's ep dim, named in each root (a pipeline
    # stage's root holds the pruned model as its `part`); found before any root is wrapped.
    experts = [{} for _ in roots]
    if layout.is_ep:
        where = model_facts(cfg.model).entry.experts
        experts = [{"experts": experts_paths(root, where), "expert_mesh": expert_mesh(mesh)}
                   for root in roots]  # fmt: skip
    units = [
        unit for root, ep in zip(roots, experts, strict=True) for unit in apply_fsdp(
            root, mesh=fsdp_mesh, cfg=cfg.fsdp, param_dtype=cfg.precision.param_dtype,
            reduce_dtype=cfg.precision.reduce_dtype, pin_memory=device_kind != "cpu", **ep,
        )
    ]  # fmt: skip
    # Offloaded parameters live on the CPU from the start: FSDP2 refuses to offload parameters
    # materialized elsewhere ("should be materialized on CPU", seen on an H200); the buffers
    # (rotary tables) stay on the compute device.
    params_on = torch.device("cpu") if cfg.fsdp.cpu_offload else device
    if weights is not None:
        weights.load(model, device=params_on, buffer_device=device, roots=roots)
        init_adapters(model, seed=cfg.train.seed, device=params_on)  # LoRA: not in the files
    else:
        init_weights(model, seed=cfg.train.seed, device=params_on, buffer_device=device,
                     roots=roots)  # fmt: skip
    engine = Engine(model=model, units=units, **common)
    if parts is not None:
        from fsdprun.engines.pp import Pipeline
        from fsdprun.engines.weights import TORCH_DTYPES

        layout, t = Layout.of(cfg, world_size), cfg.train
        engine.pipeline = Pipeline(
            roots, layout=layout, rank=get_rank(), mesh=mesh, device=device,
            micro_batches=accumulation_steps(cfg), micro_batch_size=t.micro_batch_size,
            seq_len=t.seq_len, dim=model.args.dim,
            dtype=TORCH_DTYPES[cfg.precision.param_dtype], loss_of=engine.loss_of,
        )  # fmt: skip
    return engine


def micro_step(engine: Engine, sync: bool) -> contextlib.AbstractContextManager:
    """DEFER_ALL_REDUCE: only the 2-D mesh's replica all-reduce waits; LOCAL: all sync waits."""
    if engine.accumulation == DEFER_ALL_REDUCE:
        engine.model.set_requires_all_reduce(sync)
    else:
        engine.model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip over DTensor gradients: the norm is `get_total_norm`, global over the mesh,
    reduced once to a plain tensor; `clip_grads_with_norm_` then multiplies every gradient by
    `max_norm / (norm + 1e-6)` clamped at 1 in one foreach multiply (the scalar is replicated
    implicitly). One launch per tensor chunk, where a multiply per gradient was 147 kernel
    launches a step for llama-1b, and no per-gradient `to_local` either: the host dispatches
    what the plain loop's clip dispatches (tests/test_perf.py counts them).
    """
    import torch
    from torch.distributed.tensor import DTensor

    # Frozen parameters (the base under LoRA) have no gradient and take no part.
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    groups = by_mesh(params)
    if len(groups) > 1:
        whole = grad_norm(params)
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, whole, foreach=True)
        return whole
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    whole = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, whole, foreach=True)
    return norm


def grad_scaler(device_type: str):
    """The sharded scaler; its device defaults to cuda, and it disables itself anywhere else."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)
