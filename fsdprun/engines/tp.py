"""Tensor parallelism (`parallel.tp`): the device mesh with its `tp` dim, the family's plan
(`ModelSpec.tp_plan`) applied with torch's public ParallelStyles, and the loss-parallel context
the training step runs in.

Order of a build (the worker's `_build`, torchtitan's): `apply_tp` on the meta model, then
activation checkpointing, then per-block compile, then FSDP2's `fully_shard` over the
data-parallel dims (`dp_mesh`), then materialization. Every tensor-parallel parameter is then a
DTensor on the root mesh (FSDP's shard dims x tp), which DCP saves with its placements, so a
checkpoint reshards to any other tp or dp size on load.

A family's plan (`fsdprun.families.TPPlan`) is data: the HF model types' plans are entries of
`fsdprun.families.HF_FAMILIES`, the built-in Llama's sits beside its model.

The rules (which degrees are refused, the mesh's dims) are torch-free, in `fsdprun.engines.mesh`;
`plan_rows` is torch-free too. The other functions import torch where they run.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

from fsdprun.config import RecipeConfig
from fsdprun.engines.mesh import mesh_dims, tp_degree
from fsdprun.errors import UserError
from fsdprun.families import TP_STYLES, TPPlan

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def plan_rows(block_paths: list[str], plan: TPPlan) -> list[tuple[str, str]]:
    """(module path, style) of every module `apply_tp` parallelizes, in application order:
    the top-level modules, then each block's (what the run header and `plan` print)."""
    rows = list(plan.top.items())
    for block in block_paths:
        rows += [(f"{block}.{rel}", style) for rel, style in plan.blocks.items()]
    return rows


def describe_style(style: str, plan: TPPlan) -> str:
    """One line for a style of `plan` (the knob table's and plan's text)."""
    return TP_STYLES[style]


def build_device_mesh(cfg: RecipeConfig, device_kind: str, world_size: int) -> DeviceMesh:
    """The recipe's device mesh with named dims (`fsdprun.engines.mesh.mesh_dims`): with
    parallel.tp or parallel.cp > 1, [dp_replicate,] dp_shard, [cp,] [tp]; tp innermost, so a TP
    group is consecutive ranks (one node), then cp."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = mesh_dims(cfg, world_size)
    if len(dims) == 1:
        return init_device_mesh(device_kind, (world_size,))
    names = tuple(name for name, _ in dims)
    return init_device_mesh(device_kind, tuple(n for _, n in dims), mesh_dim_names=names)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dims `fully_shard` shards over: dp_shard alone (full, grad_op) or dp_replicate x
    dp_shard (hybrid, hybrid_zero2, none); with a `cp` dim, dp_shard x cp flattened into one
    (`dp_shard_cp`), so that the cp ranks share one copy of the model state (torchtitan's)."""
    names = mesh.mesh_dim_names or ()
    shard = "dp_shard"
    if "cp" in names:
        shard = "dp_shard_cp"
        mesh[("dp_shard", "cp")]._flatten(shard)
    dims = [*(["dp_replicate"] if "dp_replicate" in names else []), shard]
    return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The `tp` dim of the mesh: one TP group per data-parallel rank."""
    return mesh["tp"]


def _style(style: str, plan: TPPlan, path: str):
    """torch's ParallelStyle for one style name of `plan` (sequence parallel: the activations
    between blocks are sharded on the sequence, dim 1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1)  # the activations between blocks
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if style == "norm":
        return SequenceParallel()
    if style == "residual_norm":
        # Added to the residual stream, which is the plain local shard (RowwiseParallel's and
        # the embedding's local output): a DTensor would not add to it.
        return SequenceParallel(use_local_output=True)
    if style == "head_norm":
        # (batch, seq, local heads, head_dim) after the column-wise q/k: the heads are dim 2.
        # The weight's gradient, summed over each rank's heads, is all-reduced by DTensor.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise_split":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "output":
        # Logits stay vocab-sharded DTensors: cross-entropy under loss_parallel never gathers
        # them (each rank holds batch x seq x vocab / tp).
        return ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                               use_local_output=False)  # fmt: skip
    if style == "block_input":
        n = plan.block_inputs[path.rsplit(".", 1)[-1]] if plan.block_inputs else 0
        if n == 0:
            return PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        rest = (None,) * (n - 1)
        return PrepareModuleInput(input_layouts=(Shard(1), *rest),
                                  desired_input_layouts=(Replicate(), *rest))  # fmt: skip
    raise AssertionError(f"unknown TP style {style!r}")


# The module class each style splits: torch's ColwiseParallel / RowwiseParallel shard a Linear's
# or an Embedding's weight as fsdprun applies them; `norm` and `block_input` split no weight
# (SequenceParallel replicates it; PrepareModuleInput only redistributes the inputs).
_STYLE_CLASSES = {"colwise": "Linear", "rowwise": "Linear", "output": "Linear",
                  "colwise_gather": "Linear", "rowwise_split": "Linear",
                  "embedding": "Embedding"}  # fmt: skip


# The weight dim each style shards (as _STYLE_CLASSES's modules hold it); the others replicate.
_STYLE_WEIGHT_DIMS = {"colwise": 0, "colwise_gather": 0, "output": 0, "embedding": 0,
                      "rowwise": 1, "rowwise_split": 1}  # fmt: skip


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """(name, first name) of each parameter that is another's tensor (tied embeddings)."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            pairs.append((name, first[id(param)]))
    return pairs


def _fold(paths: list[str], blocks: list[str]) -> str:
    """Module paths as a list that names each block's modules once (`self_attn.q_norm,
    self_attn.k_norm of each decoder layer`), the others (outside the blocks) as they are."""
    top: list[str] = []
    inner: list[str] = []
    for path in paths:
        block = next((b for b in blocks if path.startswith(f"{b}.")), None)
        names, name = (top, path) if block is None else (inner, path.removeprefix(f"{block}."))
        if name not in names:
            names.append(name)
    parts = [f"{', '.join(inner)} of each decoder layer"] if inner else []
    return ", ".join([*parts, *top])


def tp_plan_problem(model: nn.Module, plan: TPPlan | str, *, family: str) -> str | None:
    """Why `plan` (a family's plan, or why it has none) is not verified for `model`'s module
    layout (one clause), or None.

    Verified means: every module the plan names exists and is of the class its style splits,
    and every module that holds parameters, in a decoder block or outside, is one the plan
    names. A module it does not name would keep whole weights that meet split activations (a
    Qwen3's per-head q_norm/k_norm after column-wise q/k: a rank dies in aten.stack with a mesh
    mismatch, or worse, computes on the wrong heads silently); a module it names that is not
    there, or of another kind (a fused qkv_proj), cannot be split as the plan says. Checked on
    the meta model, whatever the family's model_type says: a layout is what the plan splits.
    """
    if isinstance(plan, str):
        return f"{family} has no tensor-parallel plan: {plan}"
    blocks = model.block_paths()
    modules = dict(model.named_modules())
    rows = plan_rows(blocks, plan)
    missing = [path for path, _ in rows if path not in modules]
    wrong = [
        path for path, style in rows
        if path in modules and style in _STYLE_CLASSES
        and _STYLE_CLASSES[style] not in {c.__name__ for c in type(modules[path]).__mro__}
    ]  # fmt: skip
    planned = dict(rows)
    # A tied tensor (Gemma's embedding and output) stays one parameter only where both of its
    # modules split it alike: `apply_tp` ties the output to the split embedding again.
    untied = [
        f"{first} and {name}" for name, first in _tied(model)
        if len({_STYLE_WEIGHT_DIMS.get(planned.get(n.rpartition(".")[0], ""))
                for n in (name, first)}) > 1
    ]  # fmt: skip
    uncovered = [
        path for path, module in modules.items()
        if path not in planned and next(module.parameters(recurse=False), None) is not None
    ]  # fmt: skip
    problems = []
    if uncovered:
        problems.append(f"the plan does not cover {_fold(uncovered, blocks)}")
    if missing:
        problems.append(f"the model has no {_fold(missing, blocks)}, which the plan splits")
    if wrong:
        problems.append(
            f"{_fold(wrong, blocks)} are not the Linear / Embedding modules the plan splits"
        )
    if untied:
        problems.append(f"{', '.join(untied)} are one tied tensor the plan splits two ways")
    if not problems:
        return None
    return f"{family} has no verified tensor-parallel plan: {'; '.join(problems)}"


def check_tp_plan(cfg: RecipeConfig) -> None:
    """Refuse, before any worker starts, a recipe whose model the family's TP plan does not
    verifiably split (`tp_plan_problem`); builds the model on the meta device (an HF folder's:
    its config.json alone, no weights).

    Raises:
        UserError: one line naming the family, the modules and the fix.
    """
    if not is_tp(cfg):
        return
    import torch

    from fsdprun.models import model_spec

    spec = model_spec(cfg.model)
    with torch.device("meta"):
        model = spec.build(cfg.model)
    problem = tp_plan_problem(model, spec.tp_plan(cfg.model), family=model.family_name)
    if problem is not None:
        raise UserError(f"parallel.tp={cfg.parallel.tp}: {problem}; set parallel.tp=1")


def apply_tp(model: nn.Module, *, tp_mesh: DeviceMesh, plan: TPPlan | str) -> list[tuple[str, str]]:
    """Parallelize `model` (on the meta device or materialized, before checkpointing, compile
    and FSDP) over `tp_mesh` with the family's `plan` (a str: why it has none), in place;
    parameter names do not change.

    Returns:
        (module path, style) of every module parallelized, as `plan_rows` lists them.

    Raises:
        UserError: the plan does not verifiably split the model (`tp_plan_problem`; the
            launcher refuses it first, a rank started by torchrun or srun here).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    problem = tp_plan_problem(model, plan, family=model.family_name)
    if problem is not None:
        raise UserError(f"parallel.tp={tp_mesh.size()}: {problem}; set parallel.tp=1")
    rows = plan_rows(model.block_paths(), plan)
    tied = _tied(model)
    for path, style in rows:
        parallelize_module(model.get_submodule(path), tp_mesh, _style(style, plan, path))
    # Each style made its module a split parameter of its own: a tied one (checked above to be
    # split alike) is the first module's again, one tensor with one gradient, as unsplit.
    for name, first in tied:
        path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(path), attr, model.get_parameter(first))
    return rows


@functools.cache
def _wait_function():
    """A differentiable identity that waits on an AsyncCollectiveTensor and returns its plain
    inner tensor (the gradient passes through unchanged)."""
    import torch

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, act):
            return act.trigger_wait()

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Wait


def _wait_async(x):
    """`x` as a plain tensor if it is an AsyncCollectiveTensor (the `to_local()` of an async
    redistribute); any other value as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return _wait_function().apply(x) if isinstance(x, AsyncCollectiveTensor) else x


def wait_block_inputs(model: nn.Module) -> None:
    """Hand each (compiled) block plain tensors instead of AsyncCollectiveTensors, in place.

    The first block's input is the embedding's output, which torch's RowwiseParallel
    redistributes with `async_op=True` and hands on `to_local()`: an AsyncCollectiveTensor
    that requires grad around an inner tensor that does not. torch.compile (AOTAutograd,
    torch 2.13: pytorch#179849 unwraps such inputs with `trigger_wait()`; the re-sync of
    requires_grad is pytorch#191113) then traces that input as not requiring grad, and the
    embedding silently gets no gradient. Waiting here, outside the compiled graph, with a
    differentiable identity keeps the edge; the graph would wait at its first op anyway.
    """
    for path in model.block_paths():
        block = model.get_submodule(path)
        compiled = block.forward

        # Not functools.wraps: that would copy torch.compile's attributes onto the wrapper.
        def forward(*args, _compiled=compiled, **kwargs):
            args = tuple(_wait_async(a) for a in args)
            kwargs = {k: _wait_async(v) for k, v in kwargs.items()}
            return _compiled(*args, **kwargs)

        block.forward = forward


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """torch's loss_parallel around forward and backward of a micro-batch (and eval's forward):
    cross-entropy of the vocab-sharded logits, computed with one all-reduce of the per-token
    max and sum instead of gathering the logits. Not re-entrant (torch's context is not)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The replicated DTensor loss of loss parallel as a plain tensor (the same value on every
    rank of the TP group; differentiable), which the training loop sums and all-reduces."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss


def is_tp(cfg: RecipeConfig) -> bool:
    return tp_degree(cfg) > 1
