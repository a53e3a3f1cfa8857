"""Data-parallel engines: FSDP2 (`fully_shard`, the default), FSDP1 (`FullyShardedDataParallel`)
and DDP (`DistributedDataParallel`, the unsharded baseline), behind one small interface.

The recipe's `fsdp.*` keys state intent once; `translate` says what each engine does with every
key (printed in the run header and by `fsdprun plan`, so nothing is dropped silently), and
`build_engine` applies exactly that. What differs per engine at run time is small and lives on
`Engine`: how gradients are reduced on accumulation micro-steps (`accumulation_mode`), how the
global gradient norm is computed, autocast (DDP only), and which grad scaler fp16 needs.
Checkpoints go through `torch.distributed.checkpoint.state_dict` for all three, whose keys are
the unwrapped model's, so a run saved under one engine resumes under another.

Initialization is the same for all three: every parameter's full value comes from
`parallel.init_value` (seeded by recipe seed and parameter name), or from a HuggingFace folder's
files (`fsdprun.hf.HFWeights`), so the engines start from identical weights at any world size.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdprun.adapters import init_adapters
from fsdprun.config import (
    Dtype,
    LossKind,
    RecipeConfig,
    Sharding,
    WrapPolicy,
    backward_prefetch_depth,
    effective_sharding,
    shard_group_size,
)
from fsdprun.config import (
    Engine as EngineKind,
)
from fsdprun.errors import UserError
from fsdprun.loss import chunked_cross_entropy, cross_entropy
from fsdprun.parallel import (
    TORCH_DTYPES,
    FsdpUnit,
    apply_fsdp,
    init_value,
    init_weights,
    plan_units,
    tied_names,
)

if TYPE_CHECKING:
    from fsdprun.hf import HFWeights  # needs safetensors, which comes with the optional hf extra

_FSDP1_PREFIX = "_fsdp_wrapped_module."
_DDP_PREFIX = "module."

# How gradients are reduced on the micro-steps before the last one of a step (`accumulation_mode`).
REDUCE = "reduce"  # reduce-scatter into the gradient shards every time
DEFER_ALL_REDUCE = "defer_all_reduce"  # the same, but a 2-D mesh's replica all-reduce waits
LOCAL = "local"  # no communication: whole unsharded gradients accumulate on every rank


@dataclass(frozen=True)
class Knob:
    """One recipe key and what the chosen engine does with it."""

    key: str
    value: str
    applied: str


_DTYPE_NAMES = {
    Dtype.bf16: "torch.bfloat16",
    Dtype.fp16: "torch.float16",
    Dtype.fp32: "torch.float32",
}


def _dtype_name(d: Dtype) -> str:
    return _DTYPE_NAMES[d]


class _Knobs(list):
    def add(self, key: str, value: object, applied: str) -> None:
        if isinstance(value, bool):
            text = str(value).lower()
        else:
            text = value.value if hasattr(value, "value") else str(value)
        self.append(Knob(key, text, applied))


def translate(cfg: RecipeConfig, world_size: int | None = None) -> list[Knob]:
    """What the recipe's engine does with each `fsdp.*` and precision key (no model needed)."""
    ws = world_size if world_size is not None else cfg.world_size
    knobs = _Knobs()
    build = {EngineKind.ddp: _ddp_knobs, EngineKind.fsdp1: _fsdp1_knobs,
             EngineKind.fsdp2: _fsdp2_knobs}[cfg.fsdp.engine]  # fmt: skip
    build(cfg, ws, knobs.add)
    return list(knobs)


def accumulation_mode(cfg: RecipeConfig) -> str:
    """How the recipe's engine reduces gradients on accumulation micro-steps: REDUCE,
    DEFER_ALL_REDUCE or LOCAL (see `Engine.micro_step`)."""
    f = cfg.fsdp
    sharding = effective_sharding(f)
    if f.engine is EngineKind.ddp or f.accumulate_unsharded:
        return LOCAL
    if f.engine is EngineKind.fsdp1:
        # FSDP1 cannot skip only HYBRID_SHARD's all-reduce: it syncs fully on every micro-step.
        return LOCAL if sharding is Sharding.none else REDUCE
    if sharding in (Sharding.hybrid, Sharding.hybrid_zero2, Sharding.none):  # 2-D meshes
        return DEFER_ALL_REDUCE
    return REDUCE


def _accumulation_knob(cfg: RecipeConfig, add) -> None:
    mode, kind = accumulation_mode(cfg), cfg.fsdp.engine
    if mode == DEFER_ALL_REDUCE:
        applied = (
            "reduce-scatter into the gradient shards on every micro-step; the replica all-reduce "
            "on the last one only (set_requires_all_reduce)"
        )
    elif mode == REDUCE:
        applied = "reduce-scatter into the gradient shards on every micro-step"
        if effective_sharding(cfg.fsdp) in (Sharding.hybrid, Sharding.hybrid_zero2):
            applied += ", replica all-reduce too (FSDP1 cannot defer only the all-reduce)"
    elif kind is EngineKind.ddp or effective_sharding(cfg.fsdp) is Sharding.none:
        applied = "no_sync() on accumulation micro-steps (the gradients are whole anyway)"
    else:
        call = "set_requires_gradient_sync(False)" if kind is EngineKind.fsdp2 else "no_sync()"
        applied = (
            f"{call} on accumulation micro-steps: every rank keeps the whole model's unsharded "
            "gradients until the last one"
        )
    add("fsdp.accumulate_unsharded", cfg.fsdp.accumulate_unsharded, applied)


def _ddp_knobs(cfg: RecipeConfig, ws: int, add) -> None:
    f, p = cfg.fsdp, cfg.precision
    add("fsdp.engine", "ddp", "DistributedDataParallel: every rank holds the whole model state")
    add("fsdp.sharding", f.sharding, "ignored: DDP replicates everything")
    autocast = (
        "off (fp32)"
        if p.param_dtype is Dtype.fp32
        else f"torch.autocast({_dtype_name(p.param_dtype)})"
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
    _accumulation_knob(cfg, add)


def _fsdp1_knobs(cfg: RecipeConfig, ws: int, add) -> None:
    f, p = cfg.fsdp, cfg.precision
    sharding, group = effective_sharding(f), shard_group_size(cfg, ws)
    bwd, depth = str(f.backward_prefetch), backward_prefetch_depth(f)
    strategy = {Sharding.full: "FULL_SHARD", Sharding.grad_op: "SHARD_GRAD_OP",
                Sharding.hybrid: "HYBRID_SHARD", Sharding.hybrid_zero2: "_HYBRID_SHARD_ZERO2",
                Sharding.none: "NO_SHARD"}[sharding]  # fmt: skip
    mesh = f" on a ({ws // group} x {group}) replicate x shard mesh" if sharding in (
        Sharding.hybrid, Sharding.hybrid_zero2) else ""  # fmt: skip
    add("fsdp.engine", "fsdp1", "FullyShardedDataParallel (flat parameters per unit)")
    add("fsdp.sharding", f.sharding, f"sharding_strategy=ShardingStrategy.{strategy}{mesh}")
    if f.shard_group_size is not None or sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        add("fsdp.shard_group_size", f.shard_group_size, f"{group} ranks per shard group")
    wrap = {WrapPolicy.block: "ModuleWrapPolicy({transformer block class})",
            WrapPolicy.size: f"size_based_auto_wrap_policy(min_num_params={f.min_num_params})",
            WrapPolicy.classes: f"ModuleWrapPolicy({{{', '.join(f.wrap_classes)}}})",
            WrapPolicy.none: "none (one unit: the root)"}[f.wrap]  # fmt: skip
    add("fsdp.wrap", f.wrap, f"auto_wrap_policy={wrap}")
    if _fsdp1_mixed_precision_off(cfg):
        mp = "mixed_precision=None (fp32)"
    else:
        buffers = (
            _dtype_name(p.buffer_dtype) if p.buffer_dtype is not None
            else "None (the RoPE table stays fp32)"
        )  # fmt: skip
        mp = (
            f"MixedPrecision(param_dtype={_dtype_name(p.param_dtype)}, reduce_dtype="
            f"{_dtype_name(p.reduce_dtype)}, buffer_dtype={buffers})"
        )
    add("precision.param_dtype", p.param_dtype, mp)
    bp = {"pre": "BackwardPrefetch.BACKWARD_PRE", "post": "BackwardPrefetch.BACKWARD_POST",
          "none": "None"}.get(
        bwd, f"BackwardPrefetch.BACKWARD_PRE (FSDP1 prefetches one unit, not {depth})"
    )  # fmt: skip
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
    _accumulation_knob(cfg, add)


def _fsdp2_knobs(cfg: RecipeConfig, ws: int, add) -> None:
    f, p = cfg.fsdp, cfg.precision
    sharding, group = effective_sharding(f), shard_group_size(cfg, ws)
    bwd, depth = str(f.backward_prefetch), backward_prefetch_depth(f)
    reshard = sharding in (Sharding.full, Sharding.hybrid)
    if sharding in (Sharding.hybrid, Sharding.hybrid_zero2, Sharding.none):
        mesh = f"2-D mesh ({ws // group} replicate x {group} shard)"
    else:
        mesh = f"1-D mesh of {ws} ranks"
    add("fsdp.engine", "fsdp2", "fully_shard (per-parameter DTensor shards)")
    add(
        "fsdp.sharding",
        f.sharding,
        f"{mesh}, reshard_after_forward={reshard}"
        + (" (no sharding: shard groups of 1)" if sharding is Sharding.none else ""),
    )
    if f.reshard_after_forward is not None:
        add(
            "fsdp.reshard_after_forward",
            f.reshard_after_forward,
            f"overrides fsdp.sharding: effective sharding {sharding.value}",
        )
    if f.shard_group_size is not None or sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        add("fsdp.shard_group_size", f.shard_group_size, f"{group} ranks per shard group")
    wrap = {WrapPolicy.block: "fully_shard on each transformer block, then the root",
            WrapPolicy.size: f"fully_shard on modules with >= {f.min_num_params} params not yet "
                             "wrapped, then the root",
            WrapPolicy.classes: f"fully_shard on {', '.join(f.wrap_classes)} modules, then "
                                "the root",
            WrapPolicy.none: "fully_shard on the root only"}[f.wrap]  # fmt: skip
    add("fsdp.wrap", f.wrap, wrap)
    param = "None" if p.param_dtype is Dtype.fp32 else _dtype_name(p.param_dtype)
    mp = f"MixedPrecisionPolicy(param_dtype={param}, reduce_dtype={_dtype_name(p.reduce_dtype)})"
    add("precision.param_dtype", p.param_dtype, mp)
    if p.buffer_dtype is not None:
        add(
            "precision.buffer_dtype",
            p.buffer_dtype,
            "no effect: FSDP2 does not cast buffers (the RoPE table is cast where it is used)",
        )
    if bwd == "post":
        applied = (
            "FSDP2 has no post-gradient prefetch: its implicit prefetch of the next unit (as pre)"
        )
    elif bwd == "none":
        applied = "FSDP2 cannot turn backward prefetch off: its implicit one-unit prefetch stays"
    elif depth <= 1:
        applied = "FSDP2's implicit prefetch of the next unit"
    else:
        applied = f"set_modules_to_backward_prefetch: {depth} units ahead"
    add("fsdp.backward_prefetch", bwd, applied)
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
    _accumulation_knob(cfg, add)


def _fsdp1_mixed_precision_off(cfg: RecipeConfig) -> bool:
    p = cfg.precision
    return p.param_dtype is Dtype.fp32 and p.reduce_dtype is Dtype.fp32 and p.buffer_dtype is None


def clean_name(name: str) -> str:
    """A wrapped model's parameter name as the unwrapped model spells it."""
    name = name.replace(_FSDP1_PREFIX, "")
    return name[len(_DDP_PREFIX) :] if name.startswith(_DDP_PREFIX) else name


@dataclass
class Engine:
    """A wrapped model and the few things the training loop does differently per engine."""

    kind: EngineKind
    model: nn.Module  # call this one
    inner: nn.Module  # the unwrapped model (args, names)
    units: list[FsdpUnit]
    knobs: list[Knob]
    matrix_names: frozenset[str]  # parameters with ndim >= 2 before wrapping (weight decay)
    autocast_dtype: torch.dtype | None = None
    device_type: str = "cpu"
    accumulation: str = LOCAL  # accumulation_mode of the recipe
    # The loss; compiled with the model (compile.enabled), so the fp32 upcast, log-softmax and
    # their backward fuse instead of writing fp32 copies of the logits.
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    # train.loss=chunked: tokens per chunk of the loss computed inside the model's forward.
    loss_chunk_size: int | None = None
    compiled: bool = False

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss of one micro-batch: `loss(model(inputs), targets)`, or (chunked) the
        model applies the chunked loss to its hidden states inside its own forward, where FSDP
        has gathered the output weight."""
        if self.loss_chunk_size is None:
            return self.loss(self.model(inputs), targets)
        head = functools.partial(
            chunked_cross_entropy, targets=targets, chunk_size=self.loss_chunk_size,
            compiled=self.compiled,
        )  # fmt: skip
        return self.model(inputs, head=head)
    # Tied weights of the unwrapped model: name → the name it shares its tensor with (a checkpoint
    # stores both; its manifest says which, so inspect and export count the tensor once).
    tied: dict[str, str] = field(default_factory=dict)

    def micro_step(self, sync: bool) -> contextlib.AbstractContextManager:
        """Around forward and backward of one micro-batch; `sync` on the last one of a step.

        REDUCE: every micro-step reduce-scatters, and the gradient shards are the accumulator, so
        a rank never holds more than its shard of the gradients. (With gradient sync off, FSDP
        keeps every parameter's whole unsharded gradient until the last micro-step: at 8 ranks,
        8 times the shard.) DEFER_ALL_REDUCE: the same, and the replica all-reduce of fsdp2's
        2-D meshes waits for `sync` (FSDP2 keeps the partial sums, shard-sized). LOCAL: no
        communication until `sync`.
        """
        if self.accumulation == REDUCE:
            return contextlib.nullcontext()
        if self.kind is EngineKind.fsdp2:
            if self.accumulation == DEFER_ALL_REDUCE:
                self.model.set_requires_all_reduce(sync)
            else:
                self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` on the global gradient norm; returns that norm (before clipping)."""
        if self.kind is EngineKind.fsdp1:
            return self.model.clip_grad_norm_(max_norm)
        # Frozen parameters (the base under LoRA) have no gradient and take no part.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.nn.utils.clip_grad_norm_(trainable, max_norm)

    def grad_scaler(self):
        """The loss scaler fp16 needs (sharded for the FSDP engines)."""
        if self.kind is EngineKind.ddp:
            return torch.amp.GradScaler(self.device_type)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # Its device defaults to cuda, and it disables itself anywhere else (cpu, xpu, npu).
        return ShardedGradScaler(self.device_type)

    def is_matrix(self, name: str, param: nn.Parameter) -> bool:
        return clean_name(name) in self.matrix_names


def _mesh(cfg: RecipeConfig, device_kind: str, world_size: int) -> DeviceMesh:
    """1-D over all ranks for full/grad_op; replicate x shard for the hybrid modes and none, even
    where one of the two dims is 1 (FSDP1's hybrid strategies require a 2-D mesh)."""
    group = shard_group_size(cfg, world_size)
    if effective_sharding(cfg.fsdp) in (Sharding.full, Sharding.grad_op):
        return init_device_mesh(device_kind, (world_size,))
    return init_device_mesh(
        device_kind, (world_size // group, group), mesh_dim_names=("replicate", "shard")
    )


def build_engine(
    model: nn.Module,
    cfg: RecipeConfig,
    *,
    device: torch.device,
    device_kind: str,
    world_size: int,
    weights: HFWeights | None = None,
) -> Engine:
    """Wrap a meta-device model (checkpointing and compile already applied) with the recipe's
    engine and materialize it on `device`.

    Args:
        weights: pretrained weights (`model.hf_path`) instead of the seeded initial ones: read
            shard-wise into fsdp2's shards, whole into ddp's model before wrapping, and unit by
            unit as FSDP1 materializes each unit before flattening it.
    """
    kind = cfg.fsdp.engine
    knobs = translate(cfg, world_size)
    matrix_names = frozenset(n for n, p in model.named_parameters() if p.ndim >= 2)
    loss = torch.compile(cross_entropy) if cfg.compile.enabled else cross_entropy
    chunk = cfg.train.loss_chunk_size if cfg.train.loss is LossKind.chunked else None
    common = {"kind": kind, "inner": model, "knobs": knobs, "matrix_names": matrix_names,
              "device_type": device.type, "loss": loss, "loss_chunk_size": chunk,
              "compiled": cfg.compile.enabled, "tied": tied_names(model),
              "accumulation": accumulation_mode(cfg)}  # fmt: skip
    if kind is EngineKind.fsdp2:
        units = apply_fsdp(
            model, mesh=_mesh(cfg, device_kind, world_size), cfg=cfg.fsdp,
            param_dtype=cfg.precision.param_dtype, reduce_dtype=cfg.precision.reduce_dtype,
            pin_memory=device_kind != "cpu",
        )  # fmt: skip
        if weights is not None:
            weights.load(model, device=device)
            init_adapters(model, seed=cfg.train.seed, device=device)  # LoRA: not in the files
        else:
            init_weights(model, seed=cfg.train.seed, device=device)
        return Engine(model=model, units=units, **common)
    if kind is EngineKind.ddp:
        return _build_ddp(model, cfg, device=device, weights=weights, **common)
    return _build_fsdp1(model, cfg, device=device, device_kind=device_kind,
                        world_size=world_size, weights=weights, **common)  # fmt: skip


def _build_ddp(
    model: nn.Module, cfg: RecipeConfig, *, device: torch.device, weights: HFWeights | None,
    **common,
) -> Engine:  # fmt: skip
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

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
    if reduce is not Dtype.fp32:
        hook = (
            default_hooks.bf16_compress_hook
            if reduce is Dtype.bf16
            else default_hooks.fp16_compress_hook
        )
        ddp.register_comm_hook(state=None, hook=hook)
    param = cfg.precision.param_dtype
    return Engine(
        model=ddp, units=[],
        autocast_dtype=None if param is Dtype.fp32 else TORCH_DTYPES[param], **common,
    )  # fmt: skip


def _own_params(model: nn.Module, unit_paths: list[str]) -> dict[str, int]:
    """Parameters each unit owns (not those of units nested in it); "" = the root."""
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    for path in ["", *sorted(unit_paths, key=len)]:  # deeper units claim their params last
        for p in modules[path].parameters():
            owner[id(p)] = path
    counts = dict.fromkeys(["", *unit_paths], 0)
    for p in model.parameters():  # shared (tied) parameters come once
        counts[owner[id(p)]] += p.numel()
    return counts


def _build_fsdp1(
    model: nn.Module,
    cfg: RecipeConfig,
    *,
    device: torch.device,
    device_kind: str,
    world_size: int,
    weights: HFWeights | None,
    **common,
) -> Engine:
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    f, p = cfg.fsdp, cfg.precision
    sharding = effective_sharding(f)
    strategy = {Sharding.full: ShardingStrategy.FULL_SHARD,
                Sharding.grad_op: ShardingStrategy.SHARD_GRAD_OP,
                Sharding.hybrid: ShardingStrategy.HYBRID_SHARD,
                Sharding.hybrid_zero2: ShardingStrategy._HYBRID_SHARD_ZERO2,
                Sharding.none: ShardingStrategy.NO_SHARD}[sharding]  # fmt: skip
    modules = dict(model.named_modules())
    if f.wrap is WrapPolicy.none:
        policy = None
    elif f.wrap is WrapPolicy.size:
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=f.min_num_params)
    else:
        # block: the model's block classes; classes: the recipe's (validated by plan_units).
        paths = plan_units(model, cfg=f)
        policy = ModuleWrapPolicy({type(modules[path]) for path in paths})
    mp = None
    if not _fsdp1_mixed_precision_off(cfg):
        mp = MixedPrecision(
            param_dtype=TORCH_DTYPES[p.param_dtype], reduce_dtype=TORCH_DTYPES[p.reduce_dtype],
            buffer_dtype=TORCH_DTYPES[p.buffer_dtype] if p.buffer_dtype is not None else None,
        )  # fmt: skip
    modes = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST,
             "none": None}  # fmt: skip
    prefetch = modes.get(str(f.backward_prefetch), BackwardPrefetch.BACKWARD_PRE)
    kwargs = {}
    if sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        kwargs["device_mesh"] = _mesh(cfg, device_kind, world_size)

    paths_of = {id(m): path for path, m in model.named_modules()}
    seed = cfg.train.seed
    ties = tied_names(model)
    materialized: dict[str, nn.Parameter] = {}

    @torch.no_grad()
    def param_init_fn(module: nn.Module) -> None:
        # FSDP1 calls this for each module still on meta, before flattening its unit: the same
        # full values as fsdp2 and ddp, one unit in memory at a time. to_empty gives each module
        # its own tensor: a tied weight is pointed back at the one materialized first.
        prefix = paths_of[id(module)]
        module.to_empty(device=device, recurse=False)
        for name, param in list(module.named_parameters(recurse=False)):
            full_name = f"{prefix}.{name}" if prefix else name
            first = ties.get(full_name, full_name)
            if weights is not None and first != full_name:
                weights.full(full_name)  # a tied HF folder: refused in one line (untested here)
            if first in materialized:
                setattr(module, name, materialized[first])
                continue
            if weights is not None:
                param.copy_(weights.full(first))
            else:
                param.copy_(init_value(model, first, param, seed=seed, device=device))
            materialized[first] = param

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP1's deprecation notice
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=strategy,
            auto_wrap_policy=policy,
            mixed_precision=mp,
            backward_prefetch=prefetch,
            forward_prefetch=f.forward_prefetch > 0,
            limit_all_gathers=f.limit_all_gathers,
            cpu_offload=CPUOffload(offload_params=True) if f.cpu_offload else None,
            use_orig_params=f.use_orig_params,
            device_id=device,
            param_init_fn=param_init_fn,
            **kwargs,
        )
    model.init_buffers(device)  # the RoPE table (not a parameter, not in any unit's init)
    unit_paths = [
        clean_name(path) for path, m in wrapped.named_modules()
        if isinstance(m, FullyShardedDataParallel) and path
    ]  # fmt: skip
    unit_paths = [p.removesuffix(".") for p in unit_paths]
    owned = _own_params(model, unit_paths)
    reshard = sharding in (Sharding.full, Sharding.hybrid)
    units = [FsdpUnit(path, owned[path], reshard) for path in unit_paths]
    units.append(FsdpUnit("", owned[""], False))
    return Engine(model=wrapped, units=units, **common)
