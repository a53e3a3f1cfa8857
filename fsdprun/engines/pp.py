"""Pipeline parallelism (`parallel.pp`): the model cut into stages by its family's own
description (`fsdprun.families.Stages`: the modules before the blocks, the blocks, the modules
after them), each rank's stages run by a schedule of `torch.distributed.pipelining`, and the
global gradient norm over the stages.

How a model becomes this rank's stages, keeping every parameter's name (so checkpoints resume
on any pp degree and on none, and inspect and export read them as any other):
- the modules the rank's stages do not run are removed (torchtitan's pruning): a block of a
  `ModuleDict` is deleted (its siblings keep their keys), a block of a `ModuleList` and a
  first or last module that holds parameters are replaced by a `PassThrough` (a module without
  parameters that hands its first input on), so the model's own forward runs unchanged: on a
  later stage the embedding hands the received activations on, on an earlier one the final
  norm hands the last block's output on. Modules without parameters (the rotary embedding) stay
  on every stage: each stage computes its positions itself.
- a rank of an interleaved schedule holds several stages: the pruned model keeps all of their
  modules (what the optimizer and checkpoints see), and each stage runs a shell of it whose
  blocks container holds only that stage's blocks (`_shell`: new module objects along the paths
  to the pruned containers, every other module shared). Each stage (the whole model with one
  stage a rank) is its own FSDP root; its blocks are FSDP units as without pp.

The pipeline's micro-batches are the step's gradient-accumulation micro-batches: the step's
rows are concatenated and the schedule splits them again, micro-batch i being the loop's
micro-batch i. Every stage of a pipeline reads the same rows (its ranks are one data-parallel
rank), so the packed rows' positions and document ids and the targets reach every stage
through the schedule's keyword arguments (split per micro-batch as the inputs are): no side
channel keyed by micro-batch index is needed, and none can go out of step with the schedule's
order (interleaved and zero-bubble schedules run micro-batches out of order). The last stage
computes the micro-batch's summed token loss inside its forward (the chunked loss needs the
output weight gathered there), which the schedule's loss function scales by the step's
`world / N` exactly as the non-pipelined loop scales each micro-batch's loss, so the gradients
are the same sums. The stages are not FSDP modules to the schedule (an `_StageModule` wraps
each root): FSDP2 reduces each micro-batch's gradients into its shards as without pp
(fsdprun's REDUCE accumulation), rather than torch's pipelining keeping every stage's
unsharded gradients until the last micro-batch.

Imports torch at load: only the worker's build (`fsdprun.engines.fsdp2`) imports it. The
rules (degrees, splits, refusals, the bubble) are torch-free in `fsdprun.config.layout`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdprun.config.layout import Layout
from fsdprun.config.schedule import PP_SCHEDULES
from fsdprun.errors import UserError
from fsdprun.families import Stages


class PassThrough(nn.Module):
    """A pruned module: no parameters, hands its first input (positional, or transformers'
    `hidden_states` keyword) on unchanged."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


def _owns_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage runs: block names of the blocks container, per stage."""

    blocks: list[list[str]]

    @property
    def num_stages(self) -> int:
        return len(self.blocks)


def plan_stages(model: nn.Module, stages: Stages, counts: list[int]) -> StagePlan:
    """The blocks container's children, in order, cut into consecutive stages of `counts`."""
    names = list(model.get_submodule(stages.blocks)._modules)
    assert sum(counts) == len(names), (counts, len(names))  # layout_errors refused otherwise
    cuts, start = [], 0
    for n in counts:
        cuts.append(names[start : start + n])
        start += n
    return StagePlan(cuts)


def _prune(root: nn.Module, stages: Stages, *, keep: set[str], first: bool, last: bool) -> None:
    """Remove from `root` (in place) what a rank running blocks `keep` does not run: the first
    modules unless `first`, the last ones unless `last` (those holding parameters)."""
    for path, on in [(p, first) for p in stages.first] + [(p, last) for p in stages.last]:
        if not on and _owns_params(root.get_submodule(path)):
            root.set_submodule(path, PassThrough())
    container = root.get_submodule(stages.blocks)
    for name in list(container._modules):
        if name in keep:
            continue
        if isinstance(container, nn.ModuleDict):
            del container[name]
        else:
            container._modules[name] = PassThrough()


def _shell(root: nn.Module, stages: Stages) -> nn.Module:
    """A copy of `root` whose modules on the way to the first, last and blocks modules are new
    objects (their children, hooks and FSDP state their own), every other module shared, and
    the parameters and buffers of the copied modules the original's (one dict each), so that
    materializing or re-assigning a buffer (the rotary table) through either reaches both."""

    def copied(module: nn.Module) -> nn.Module:
        new = copy.copy(module)
        for key, value in module.__dict__.items():
            if isinstance(value, dict) and key not in ("_parameters", "_buffers"):
                new.__dict__[key] = type(value)(value)
        assert not module._parameters, "a stage path module owns parameters"
        return new

    shell = copied(root)
    done = {id(root): shell}
    # The parents of the first and last modules (which a stage replaces), and the blocks
    # container with its parents (whose children a stage removes).
    chains = [p.split(".")[:-1] for p in (*stages.first, *stages.last)]
    for names in [*chains, stages.blocks.split(".")]:
        parent, original = shell, root
        for name in names:
            original = original._modules[name]
            if id(original) not in done:
                done[id(original)] = copied(original)
            parent._modules[name] = done[id(original)]
            parent = done[id(original)]
    return shell


def prune_model(
    model: nn.Module, *, stages: Stages, counts: list[int], local: list[int]
) -> StagePlan:
    """Prune `model` in place to the stages `local` (of `len(counts)`) this rank runs, names
    kept (before tensor parallel, checkpointing, compile and FSDP touch it); returns the plan."""
    plan = plan_stages(model, stages, counts)
    mine = {name for s in local for name in plan.blocks[s]}
    _prune(model, stages, keep=mine, first=0 in local, last=plan.num_stages - 1 in local)
    return plan


def stage_parts(
    model: nn.Module, *, stages: Stages, plan: StagePlan, local: list[int]
) -> list[nn.Module]:
    """The module each local stage runs (after every transform but FSDP, which makes each one
    an FSDP root): the pruned `model` itself for one stage a rank, else one shell per stage
    (`_shell`) holding that stage's blocks."""
    if len(local) == 1:
        return [model]
    last = plan.num_stages - 1
    parts = []
    for s in local:
        shell = _shell(model, stages)
        _prune(shell, stages, keep=set(plan.blocks[s]), first=s == 0, last=s == last)
        parts.append(shell)
    return parts


def stage_tp_plan(plan, model: nn.Module):
    """The family's TP plan for a pruned model: its top-level modules the stage holds (the
    embedding on the first stage, the norm and output on the last)."""
    from fsdprun.families import TPPlan

    if isinstance(plan, str):
        return plan
    top = {
        path: style for path, style in plan.top.items()
        if not isinstance(model.get_submodule(path), PassThrough)
    }  # fmt: skip
    return TPPlan(plan.blocks, top, plan.block_inputs)


class StageRoot(nn.Module):
    """One stage's FSDP root: the inputs (token ids on the first stage, the previous stage's
    activations on the others) through the stage's `part` of the model, and on the last stage
    the micro-batch's summed token loss over `targets` (shape [1]), computed inside the root's
    forward where FSDP has the output weight gathered (the chunked loss needs it)."""

    def __init__(self, part: nn.Module, *, last: bool):
        super().__init__()
        self.part, self.last = part, last
        self.loss_of: Callable | None = None  # the engine's (`Engine.loss_of`), set once built

    def block_paths(self) -> list[str]:
        """The stage's blocks: what the `block` wrap policy makes FSDP units."""
        return [f"part.{path}" for path in self.part.block_paths()]

    def forward(self, inputs, targets, positions=None, doc_ids=None):
        extras = {} if positions is None else {"positions": positions, "doc_ids": doc_ids}
        if not self.last:
            return self.part.forward_hidden(inputs, **extras)
        return self.loss_of(self.part, inputs, targets, extras).float().reshape(1)


class _Unsharded(nn.Module):
    """What the schedule calls for a stage: its `StageRoot`, which torch's pipelining then does
    not see as an FSDP module. Its FSDP2 hooks reduce-scatter each micro-batch's gradients into
    the shards, as the loop without pp does, where torch would keep the stage's unsharded
    gradients (and gathered parameters) until the last micro-batch."""

    def __init__(self, root: StageRoot):
        super().__init__()
        self.root = root

    def forward(self, *args, **kwargs):
        return self.root(*args, **kwargs)


def stage_roots(parts: list[nn.Module], *, layout: Layout, rank: int) -> list[StageRoot]:
    """A `StageRoot` for each of this rank's stages (`parts`, as `stage_parts` returns them)."""
    last = layout.num_stages - 1
    local = layout.local_stages(rank)
    return [StageRoot(part, last=s == last) for s, part in zip(local, parts, strict=True)]


class Pipeline:
    """This rank's stages and their schedule: one training step's forward and backward over
    the step's micro-batches, and evaluation's forwards."""

    def __init__(
        self, roots: list[StageRoot], *, layout: Layout, rank: int, mesh, device: torch.device,
        micro_batches: int, micro_batch_size: int, seq_len: int, dim: int,
        dtype: torch.dtype, loss_of: Callable,
    ) -> None:  # fmt: skip
        from torch.distributed import pipelining

        name = PP_SCHEDULES[layout.pp_schedule][0]
        if not hasattr(pipelining, name):
            raise UserError(
                f"parallel.pp_schedule={layout.pp_schedule.value}: torch {torch.__version__} "
                f"has no torch.distributed.pipelining.{name}; choose another schedule or "
                "upgrade torch"
            )
        self.group = mesh["pp"].get_group()
        self.local = layout.local_stages(rank)
        num = layout.num_stages
        self.has_first, self.has_last = 0 in self.local, num - 1 in self.local
        self.micro_batches = micro_batches
        self.whole_positions = layout.is_tp
        # The activations between stages: the residual stream, sharded on the sequence by
        # cp and (sequence parallel) tp; FSDP2 casts each unit's inputs to param_dtype, so the
        # blocks hand on param_dtype. Given to torch (static shapes), which then runs no probe
        # forward and backward of its own on the first step.
        meta = torch.device("meta")
        tokens = torch.empty(micro_batch_size, seq_len // layout.cp, dtype=torch.int64, device=meta)
        # requires_grad: a gradient of the same shape goes back for each of them.
        hidden = torch.empty(micro_batch_size, seq_len // layout.row_group, dim, dtype=dtype,
                             device=meta, requires_grad=True)  # fmt: skip
        loss = torch.empty(1, dtype=torch.float32, device=meta)
        self.stages = []
        for index, root in zip(self.local, roots, strict=True):
            root.loss_of = loss_of
            self.stages.append(pipelining.PipelineStage(
                _Unsharded(root), index, num, device,
                input_args=tokens if index == 0 else hidden,
                output_args=loss if index == num - 1 else hidden, group=self.group,
            ))  # fmt: skip
        self.scale: float | torch.Tensor = 1.0
        self.poison = False
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        self.scaler = None
        cls = getattr(pipelining, name)
        first = self.stages if PP_SCHEDULES[layout.pp_schedule][1] else self.stages[0]
        # scale_grads=False: the loss function already scales each micro-batch's summed loss
        # by world / N, as the loop without pp does; torch's default would divide by the
        # micro-batches once more.
        self.schedule = cls(first, n_microbatches=micro_batches, loss_fn=self._loss,
                            scale_grads=False)  # fmt: skip

    def _loss(self, loss_sum: torch.Tensor, _targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: keep the micro-batch's sum (the
        logged loss), return what backward starts from (scaled as the loop scales it)."""
        self.loss_sum += loss_sum.detach().sum()
        if self.poison:
            loss_sum = loss_sum * float("inf")
        scaled = (loss_sum * self.scale).sum()
        return self.scaler.scale(scaled) if self.scaler is not None else scaled

    def _run(self, micro: list, *, train: bool) -> torch.Tensor:
        """The micro-batches `micro` (`Batch`es) through the schedule; the sum of their token
        losses on a rank holding the last stage, zero elsewhere."""
        inputs = torch.cat([b.inputs for b in micro])
        targets = torch.cat([b.targets for b in micro])
        extras = {"targets": targets}
        for key in ("positions", "doc_ids"):
            if getattr(micro[0], key) is not None:
                extras[key] = torch.cat([getattr(b, key) for b in micro])
        if "positions" not in extras and self.whole_positions:
            # Later stages get sequence-sharded activations (tp): the model could not count
            # the row's positions from their length, as it does from the token ids.
            seq = inputs.shape[1]
            extras["positions"] = torch.arange(seq, device=inputs.device).expand(len(inputs), -1)
        self.loss_sum = torch.zeros_like(self.loss_sum)
        args = (inputs,) if self.has_first else ()
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=targets, **extras)
        return self.loss_sum

    def forward_backward(self, micro: list, *, scale, scaler=None, poison: bool = False):
        """One step's forward and backward over its micro-batches (`Batch`es), each last-stage
        loss scaled by `scale` (world / N) and by the fp16 `scaler`; `poison` makes the loss
        infinite (a drill). Returns this rank's summed token loss (zero off the last stage)."""
        self.scale, self.scaler, self.poison = scale, scaler, poison
        try:
            return self._run(micro, train=True)
        finally:
            self.scaler, self.poison = None, False

    def evaluate(self, micro: list) -> torch.Tensor:
        """Forwards only (no gradients) of `micro`; the summed token loss as above."""
        self.scale = 1.0
        with torch.no_grad():
            return self._run(micro, train=False)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip on the global gradient norm over every stage: each stage's norm (FSDP's, over its
        data-parallel and tp ranks) squared, summed over the pp group, then the root; every
        rank then scales its gradients by the same factor."""
        from fsdprun.engines.base import by_mesh, grad_norm

        params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
        total = grad_norm(params).float() ** 2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        total = total.sqrt()
        for group in by_mesh(params):  # expert parallel's experts are on a mesh of their own
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
        return total
