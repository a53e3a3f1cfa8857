"""What the three engines share: the `Engine` a run trains through, the knob record, the rules all
of them read (which sharding reshards after forward, how accumulation reduces), the records of
their memory rules (`ParamShape` in, `RankMemory` out) and the table that names the module of
each engine.

Never imports torch at module load: `fsdprun plan`, the run header and config validation read
these rules on machines (and in commands) that have not loaded torch. The few methods that need
torch import it where they run, after `build_engine` has loaded it anyway.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fsdprun.config import Dtype, FsdpConfig, RecipeConfig, Sharding
from fsdprun.config import Engine as EngineKind
from fsdprun.config.layout import BACKWARD_PREFETCH_MODES, Layout

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdprun.data.batch import Batch

# Each engine's module holds its knob translation (`knobs`, `accumulation`), its build (`build`),
# its unit plan and memory rules (`unit_plan`, `memory`: read by `fsdprun plan`) and its run-time
# differences (`micro_step`, `clip_grad_norm`, `grad_scaler`). All three are torch-free at load.
ENGINE_MODULES = {
    EngineKind.fsdp2: "fsdprun.engines.fsdp2",
    EngineKind.fsdp1: "fsdprun.engines.fsdp1",
    EngineKind.ddp: "fsdprun.engines.ddp",
}


def engine_module(kind: EngineKind) -> ModuleType:
    """The module that implements engine `kind`."""
    return importlib.import_module(ENGINE_MODULES[kind])


# How gradients are reduced on the micro-steps before the last one of a step (`accumulation_mode`).
REDUCE = "reduce"  # reduce-scatter into the gradient shards every time
DEFER_ALL_REDUCE = "defer_all_reduce"  # the same, but a 2-D mesh's replica all-reduce waits
LOCAL = "local"  # no communication: whole unsharded gradients accumulate on every rank

# The knob texts of accumulation that more than one engine prints.
REDUCE_TEXT = "reduce-scatter into the gradient shards on every micro-step"
WHOLE_GRADS_TEXT = "no_sync() on accumulation micro-steps (the gradients are whole anyway)"


def unsharded_grads_text(call: str) -> str:
    """The accumulation knob of `fsdp.accumulate_unsharded`, `call` being the engine's switch."""
    return (
        f"{call} on accumulation micro-steps: every rank keeps the whole model's unsharded "
        "gradients until the last one"
    )


def reshards_after_forward(sharding: Sharding) -> bool:
    """Whether units free their gathered parameters after forward (ZeRO-3) under `sharding`;
    grad_op, hybrid_zero2 and none keep them until backward. Engines may keep a unit or the root
    gathered anyway (their `unit_plan` says which)."""
    return sharding in (Sharding.full, Sharding.hybrid)


@dataclass(frozen=True)
class Knob:
    """One recipe key and what the chosen engine does with it."""

    key: str
    value: str
    applied: str


class KnobTable(list):
    """The knobs of one translation, in the order they are added."""

    def add(self, key: str, value: object, applied: str) -> None:
        if isinstance(value, bool):
            text = str(value).lower()
        else:
            text = value.value if hasattr(value, "value") else str(value)
        self.append(Knob(key, text, applied))


DTYPE_NAMES = {
    Dtype.bf16: "torch.bfloat16",
    Dtype.fp16: "torch.float16",
    Dtype.fp32: "torch.float32",
}


# Model-state bytes per element, as fsdprun keeps it (the ZeRO paper's mixed-precision Adam).
DTYPE_BYTES = {Dtype.bf16: 2, Dtype.fp16: 2, Dtype.fp32: 4}
MASTER_BYTES = 4  # sharded parameters and their gradients are fp32 whatever param_dtype is
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
ADAM_STEP_BYTES = 4  # AdamW's per-tensor `step`, a 0-d fp32 tensor


@dataclass(frozen=True)
class ParamShape:
    """One parameter as the engines' memory rules see it, read from a meta-device model."""

    shape: tuple[int, ...]
    trainable: bool = True  # False: frozen (the base under LoRA): no gradient, no AdamW state
    matmul: bool = False  # a Linear's weight: autocast keeps a param_dtype copy of it
    float8: bool = False  # a converted Linear's weight: all-gathered in float8 (1 byte)
    # Elements of its unsharded gradient where that is not `shape`'s: under tensor parallel the
    # embedding's (torch's backward of a vocab-sharded embedding gives a replicated gradient).
    unsharded_grad_numel: int | None = None
    # Expert parallel: the ranks its dim 0 (the experts) is split over first; FSDP then shards
    # the ep rank's local tensor over its unit's ranks / ep (dp_shard_mod_ep).
    ep: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape FSDP shards: an ep rank's ceil(experts / ep) of them under expert parallel,
        else the whole `shape`."""
        if self.ep <= 1:
            return self.shape
        return (math.ceil(self.shape[0] / self.ep), *self.shape[1:])

    @property
    def grad_numel(self) -> int:
        """Elements of the gradient before FSDP reduce-scatters it into its shard."""
        if self.unsharded_grad_numel is not None:
            return self.unsharded_grad_numel
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class RankMemory:
    """Rank 0's bytes of model state under one engine, sharding and shard group (an engine's
    `memory` rule), units in forward order, the root last."""

    shard_bytes: list[int]  # each unit's fp32 master shard
    gathered_bytes: list[int]  # each unit's gathered copy (param_dtype, padded as the engine pads)
    params: int
    grads: int
    optimizer: int  # AdamW's moments and step counters
    buffers: int  # peak gathered (unsharded) parameters, or ddp's autocast copies
    accumulation: int  # unsharded gradients kept between micro-steps (accumulate_unsharded)


def accumulation_steps(cfg: RecipeConfig) -> int:
    """Micro-steps per optimizer step at the recipe's world size: the batch splits over the
    data-parallel ranks (world size / (tp x cp); a TP x CP group shares its micro-batches)."""
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * Layout.of(cfg).dp)


def backward_prefetch_depth(fsdp: FsdpConfig) -> int:
    """fsdp.backward_prefetch as a depth: pre/post = 1 unit, none = 0, N = N (validated)."""
    value = str(fsdp.backward_prefetch)
    if value in BACKWARD_PREFETCH_MODES:
        return 0 if value == "none" else 1
    return int(value)


def gathered_bytes(units: list[list[ParamShape]], elems: list[int], param_bytes: int) -> list[int]:
    """Each unit's gathered copy in bytes: `elems` (padded) in param_dtype, the weights of
    float8 Linears at 1 byte."""
    saved = [sum(p.numel for p in own if p.float8) * (param_bytes - 1) for own in units]
    return [n * param_bytes - s for n, s in zip(elems, saved, strict=True)]


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP unit as built: its module path ("" = root) and its parameter count."""

    path: str
    num_params: int
    reshard_after_forward: bool


@dataclass(frozen=True)
class UnitPlan:
    """One unit as an engine wraps it, before any model is built: what `fsdprun plan` prints and
    the FSDP2 build applies. Prefetch lists name unit paths; FSDP1 names its backward mode."""

    path: str
    reshard_after_forward: bool
    forward_prefetch: list[str]
    backward_prefetch: list[str] | str


_FSDP1_PREFIX = "_fsdp_wrapped_module."
_DDP_PREFIX = "module."


def clean_name(name: str) -> str:
    """A wrapped model's parameter name as the unwrapped model spells it."""
    name = name.replace(_FSDP1_PREFIX, "")
    return name[len(_DDP_PREFIX) :] if name.startswith(_DDP_PREFIX) else name


@dataclass
class Engine:
    """A wrapped model and the few things the training loop does differently per engine (each
    engine's module says how: the methods hand over to it)."""

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
    loss: Callable | None = None
    # train.loss=chunked: the chunked loss (chunk size bound) the model applies to its hidden
    # states inside its own forward, where FSDP has gathered the output weight.
    chunked_loss: Callable | None = None
    # Tied weights of the unwrapped model: name → the name it shares its tensor with (a checkpoint
    # stores both; its manifest says which, so inspect and export count the tensor once).
    tied: dict[str, str] = field(default_factory=dict)
    # parallel.tp > 1: the logits are vocab-sharded DTensors and the loss is loss parallel's.
    loss_parallel: bool = False
    # parallel.tp > 1: (module path, TP style) of every module the family's plan split.
    tp_plan: list[tuple[str, str]] = field(default_factory=list)
    # parallel.pp > 1: this rank's stages and their schedule (`fsdprun.engines.pp.Pipeline`),
    # which run a step's micro-batches in place of the loop's micro-steps.
    pipeline: Any = None
    # A mixture of experts: the tokens each expert receives (`fsdprun.engines.ep.ExpertLoad`),
    # counted after each training forward.
    expert_load: Any = None

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        """The SUM of the token losses of one micro-batch over its trained targets (not -100):
        `loss(model(inputs), targets)`, or the chunked loss inside the model's forward. Packed
        rows' `positions` and `doc_ids` go to the model. A sum, not a mean: the training loop
        divides by the step's global count of trained targets (micro-batches and ranks hold
        different counts with fine-tuning data). A model that keeps a router auxiliary loss
        (`HFCausalLM.router_aux_loss`) has it added, weighted by the trained targets."""
        model_kwargs = {}
        if batch.positions is not None:
            model_kwargs = {"positions": batch.positions, "doc_ids": batch.doc_ids}
        return self.loss_of(self.model, batch.inputs, batch.targets, model_kwargs)

    def loss_of(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict
    ) -> torch.Tensor:
        """`forward_loss` of `model` (the whole model, or a pipeline's last stage, whose
        pruned embedding hands `inputs`, the previous stage's activations, on)."""
        if self.loss_parallel:
            from fsdprun.engines.tp import local_loss

            # A replicated DTensor (the same sum on every rank of the TP group) as a tensor.
            logits = model(inputs, **model_kwargs)
            loss = local_loss(self.loss(logits, targets, reduction="sum"))
        elif self.chunked_loss is None:
            loss = self.loss(model(inputs, **model_kwargs), targets, reduction="sum")
        else:
            head = functools.partial(self.chunked_loss, targets=targets, reduction="sum")
            loss = model(inputs, head=head, **model_kwargs)
        self._count_experts()
        aux = getattr(self.inner, "router_aux_loss", None)  # set by the forward just run
        if aux is None:
            return loss
        # A mixture of experts' router auxiliary loss (`HFCausalLM`), a mean over the micro-batch
        # as transformers adds it to its token-mean loss: weighted by the micro-batch's trained
        # targets here, the step's division by N makes each micro-batch's share what its tokens
        # are of the step's, as fsdprun weighs its token-mean losses.
        from fsdprun.loss import num_targets

        return loss + aux * num_targets(targets)

    def _count_experts(self) -> None:
        # Training forwards only (evaluation's are not the load the steps put on the experts).
        if self.expert_load is not None and self.model.training:
            self.expert_load.add()

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
        return engine_module(self.kind).micro_step(self, sync)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around forward and backward of a micro-batch: loss parallel under tensor
        parallelism (its backward needs it too), else nothing."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from fsdprun.engines.tp import loss_context

        return loss_context(True)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` on the global gradient norm; returns that norm (before clipping).
        Under pipeline parallel the norm is over every stage's parameters."""
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(self.model, max_norm)
        return engine_module(self.kind).clip_grad_norm(self.model, max_norm)

    def grad_scaler(self):
        """The loss scaler fp16 needs (sharded for the FSDP engines)."""
        return engine_module(self.kind).grad_scaler(self.device_type)

    def is_matrix(self, name: str, param: nn.Parameter) -> bool:
        return clean_name(name) in self.matrix_names


def by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` grouped by their gradients' mesh: expert parallel's experts are DTensors on
    another mesh (dp_shard_mod_ep x ep) than the rest, and DTensor ops take one mesh."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of `params`' gradients over every rank that holds a shard of them, a plain
    tensor: each mesh's norm (`by_mesh`), then theirs."""
    import torch
    from torch.distributed.tensor import DTensor

    norms = [torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
             for group in by_mesh(params)]  # fmt: skip
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
