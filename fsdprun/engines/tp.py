"""Tensor parallelism (`parallel.tp`): the family's plan (`ModelSpec.tp_plan`) applied with
torch's public ParallelStyles over the mesh's `tp` dim (torchao's float8 ones for float8
Linears, fsdprun's own for LoRA's adapted Linears and a mixture of experts:
`fsdprun.engines.tp_styles`), the loss-parallel context the training
step runs in, and what a plan does to memory (the shape each parameter keeps on a TP rank, and
the activations under sequence parallel, `TP_ACTIVATION_FORMULA`), which `fsdprun plan` composes.

Order of a build (the worker's `_build`, torchtitan's): `apply_tp` on the meta model, then
activation checkpointing, then per-block compile, then FSDP2's `fully_shard` over the
data-parallel dims (`dp_mesh`), then materialization. Every tensor-parallel parameter is then a
DTensor on the root mesh (FSDP's shard dims x tp), which DCP saves with its placements, so a
checkpoint reshards to any other tp or dp size on load.

A family's plan (`fsdprun.families.TPPlan`) is data: the HF model types' plans are entries of
`fsdprun.families.HF_FAMILIES`, the built-in Llama's sits beside its model.

The rules (which degrees are refused, the mesh's dims) are torch-free, in
`fsdprun.config.layout`; the mesh is built by `fsdprun.engines.mesh`. `plan_rows` and the
memory rules are torch-free too. The other functions import torch where they run.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import TYPE_CHECKING

from fsdprun.config import RecipeConfig
from fsdprun.config.layout import Layout
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


# Each Linear style's layouts as torch's ColwiseParallel / RowwiseParallel take them: whether it
# splits the output features (column-wise) or the input features, the layout its input arrives
# in, the layout its output leaves in, and whether the output is handed on as a local tensor.
# Sequence parallel: the activations between blocks are sharded on the sequence, dim 1.
_LINEAR_STYLES = {
    "colwise": (True, "replicate", "shard_last", True),
    "colwise_gather": (True, "replicate", "replicate", True),
    # Logits stay vocab-sharded DTensors: cross-entropy under loss_parallel never gathers
    # them (each rank holds batch x seq x vocab / tp).
    "output": (True, "sequence", "shard_last", False),
    "rowwise": (False, "shard_last", "sequence", True),
    "rowwise_split": (False, "replicate", "sequence", True),
}
# The styles of a block's modules that read the input its `block_input` gathers.
_INPUT_READERS = ("colwise", "colwise_gather", "router", "experts")


def _style(style: str, plan: TPPlan, path: str, module: nn.Module, *, float8: bool = False):
    """torch's ParallelStyle for one style name of `plan` at `path` (`module`: a LoRA-adapted
    Linear takes `LoraParallel`; with `float8`, a tensorwise float8 Linear takes torchao's float8
    style, and a block input read by such Linears only `PrepareFloat8ModuleInput`, which casts
    it to float8 before its all-gather)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from fsdprun.engines import tp_styles
    from fsdprun.engines.float8 import tensorwise
    from fsdprun.models.lora import LoraLinear

    between = Shard(1)  # the activations between blocks
    if style in _LINEAR_STYLES:
        columns, into, out, local = _LINEAR_STYLES[style]
        layouts = {"replicate": Replicate(), "shard_last": Shard(-1), "sequence": between}
        kwargs = {"input_layouts": layouts[into], "output_layouts": layouts[out],
                  "use_local_output": local}  # fmt: skip
        if isinstance(module, LoraLinear):
            return tp_styles.LoraParallel(columns=columns, **kwargs)
        if float8 and style in ("colwise", "rowwise") and tensorwise(module):
            from torchao.float8.float8_tensor_parallel import (
                Float8ColwiseParallel,
                Float8RowwiseParallel,
            )

            return (Float8ColwiseParallel if columns else Float8RowwiseParallel)(**kwargs)
        return (ColwiseParallel if columns else RowwiseParallel)(**kwargs)
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
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "block_input":
        n = plan.block_inputs[path.rsplit(".", 1)[-1]] if plan.block_inputs else 0
        prepare = PrepareModuleInput
        if float8 and _float8_readers(plan, path, module):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            prepare = PrepareFloat8ModuleInput
        if n == 0:
            return prepare(
                input_kwarg_layouts={"hidden_states": between},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        rest = (None,) * (n - 1)
        return prepare(input_layouts=(between, *rest), desired_input_layouts=(Replicate(), *rest))
    moe = {"moe": tp_styles.MoEBlockParallel, "router": tp_styles.RouterParallel,
           "experts": tp_styles.ExpertsParallel}  # fmt: skip
    if style in moe:
        return moe[style]()
    raise AssertionError(f"unknown TP style {style!r}")


def _float8_readers(plan: TPPlan, path: str, module: nn.Module) -> bool:
    """Whether every module of the block input at `path` that reads it is a column-wise,
    tensorwise float8 Linear: then the input may be cast to float8 once, before its all-gather
    (a reader of another kind would be handed float8 values it cannot take)."""
    from fsdprun.engines.float8 import tensorwise

    name = path.rsplit(".", 1)[-1]
    readers = [(rel.removeprefix(f"{name}."), style) for rel, style in plan.blocks.items()
               if rel.startswith(f"{name}.") and style in _INPUT_READERS]  # fmt: skip
    return bool(readers) and all(
        style == "colwise" and tensorwise(module.get_submodule(rel)) for rel, style in readers
    )


def _splits(style: str, module: nn.Module) -> bool:
    """Whether `module` is what `style` splits: torch's ColwiseParallel / RowwiseParallel split
    a Linear's (or a LoRA-adapted one's, `LoraParallel`) or an Embedding's weight as fsdprun
    applies them; `experts` a stack of experts that transformers can run in expert parallel
    (its `_is_expert_parallel` sentinels); the other styles split no weight (SequenceParallel
    and the router replicate theirs; `block_input` and `moe` only redistribute activations)."""
    classes = {c.__name__ for c in type(module).__mro__}
    if style in _LINEAR_STYLES:
        return bool({"Linear", "LoraLinear"} & classes)
    if style == "embedding":
        return "Embedding" in classes
    if style == "experts":
        count = getattr(module, "num_experts", None)
        return hasattr(module, "_is_expert_parallel") and isinstance(count, int)
    return True


# What each style shards, by parameter name under the module it applies to: a Linear's weight
# is (out, in), an Embedding's (vocab, dim). Column-wise (and the vocab-sharded output) splits a
# Linear's outputs: dim 0 and its bias, and a LoRA adapter's B (A replicated); row-wise its
# inputs: dim 1 and A's (the bias and B replicated); the embedding its vocab rows; `experts`
# every stacked parameter by experts ("*": dim 0). The norms and the router keep their
# parameters whole on every TP rank (`block_input` and `moe` own none). The LoRA and experts
# rows say what `engines.tp_styles` places; tests/test_plan_tp.py checks plan against them.
_COLUMNS = {"weight": 0, "bias": 0, "lora_B.weight": 0}
_ROWS = {"weight": 1, "lora_A.weight": 1}
_STYLE_DIMS: dict[str, dict[str, int]] = {
    "colwise": _COLUMNS,
    "colwise_gather": _COLUMNS,
    "output": _COLUMNS,
    "rowwise": _ROWS,
    "rowwise_split": _ROWS,
    "embedding": {"weight": 0},
    "experts": {"*": 0},
}


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
    """Why `plan` (a family's plan, or why it has none) does not fit `model`'s module
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
    wrong = [path for path, style in rows if path in modules and not _splits(style, modules[path])]
    planned = dict(rows)
    # A tied tensor (Gemma's embedding and output) stays one parameter only where both of its
    # modules split it alike: `apply_tp` ties the output to the split embedding again.
    untied = [
        f"{first} and {name}" for name, first in _tied(model)
        if len({_STYLE_DIMS.get(planned.get(n.rpartition(".")[0], ""), {}).get("weight")
                for n in (name, first)}) > 1
    ]  # fmt: skip
    # A LoRA adapter's A and B are split by its LoraLinear's style.
    adapted = {p for p, m in modules.items() if p in planned and type(m).__name__ == "LoraLinear"}
    uncovered = [
        path for path, module in modules.items()
        if path not in planned and path.rpartition(".")[0] not in adapted
        and next(module.parameters(recurse=False), None) is not None
    ]  # fmt: skip
    problems = []
    if uncovered:
        problems.append(f"the plan does not cover {_fold(uncovered, blocks)}")
    if missing:
        problems.append(f"the model has no {_fold(missing, blocks)}, which the plan splits")
    if wrong:
        problems.append(
            f"{_fold(wrong, blocks)} are not the Linear / Embedding / experts modules the plan "
            "splits"
        )
    if untied:
        problems.append(f"{', '.join(untied)} are one tied tensor the plan splits two ways")
    if not problems:
        return None
    return f"{family} has no tensor-parallel plan that fits its modules: {'; '.join(problems)}"


def tp_refusal(cfg: RecipeConfig, model: nn.Module) -> str | None:
    """Why the family's TP plan does not verifiably split `model` (built on the meta device,
    before LoRA wraps its Linears) at the recipe's parallel.tp (`tp_plan_problem`), as the one
    line `fsdprun train` and `plan` refuse it with; None without TP or where the plan splits
    it."""
    layout = Layout.of(cfg)
    if not layout.is_tp:
        return None
    from fsdprun.models import model_spec

    plan = model_spec(cfg.model).tp_plan(cfg.model)
    problem = tp_plan_problem(model, plan, family=model.family_name)
    return None if problem is None else f"parallel.tp={layout.tp}: {problem}; set parallel.tp=1"


def apply_tp(
    model: nn.Module, *, tp_mesh: DeviceMesh, plan: TPPlan | str, float8: bool = False
) -> list[tuple[str, str]]:
    """Parallelize `model` (on the meta device or materialized, after LoRA and float8's
    conversion, before checkpointing, compile and FSDP) over `tp_mesh` with the family's `plan`
    (a str: why it has none), in place; parameter names do not change.

    `float8`: the column- and row-wise float8 Linears of the tensorwise recipe take torchao's
    float8 TP styles (their inputs cast to float8 before the all-gather, their output gradients
    before the reduction: `_style`); without it torch's own styles split them, and the float8
    Linears cast what reaches them (the rowwise recipe, which torchao's styles do not take).

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
    # torch's SequenceParallel makes each norm weight a new Parameter that requires grad: a
    # frozen one (LoRA's base) would train.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for path, style in rows:
        module = model.get_submodule(path)
        parallelize_module(module, tp_mesh, _style(style, plan, path, module, float8=float8))
    # Each style made its module a split parameter of its own: a tied one (checked above to be
    # split alike) is the first module's again, one tensor with one gradient, as unsplit.
    for name, first in tied:
        path, _, attr = name.rpartition(".")
        setattr(model.get_submodule(path), attr, model.get_parameter(first))
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
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


# ---- memory: what a plan leaves on a TP rank (`fsdprun plan`) ----

TP_ACTIVATION_FORMULA = (
    "Activations under TP (sequence parallel): the norms' fp32 inputs and their values before "
    "the weight, the blocks' inputs (all a checkpointed block keeps) hold seq/tp tokens; the "
    "norm outputs are all-gathered on the sequence before q/k/v and gate/up, which keep that "
    "full copy; q, k, v and the attention output hold the local heads, gate/up and their "
    "products ffn/tp columns, for every token; the logits vocab/tp (loss parallel). The built-in "
    "Llama and HF Llama-family folders both shard the sequence; a family whose plan has no "
    "sequence parallel would keep every token between blocks and in its norms"
)
# torch's backward of the vocab-sharded embedding (RowwiseParallel on nn.Embedding) gives a
# replicated, whole gradient; FSDP redistributes it to the vocab shard only when it reduces it.
# Kept between micro-steps (fsdp.accumulate_unsharded), it is the whole table on every rank
# (measured: tests/test_memory_contract.py, its unsharded tp8 cell).
_WHOLE_GRAD_STYLES = ("embedding",)


def tp_local_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    """Tensor-parallel rank 0's local shape of a parameter of `shape` sharded on `dim` (None:
    replicated) over `tp` ranks: Shard(dim) chunks as torch.chunk does, ceil(n / tp) first."""
    if dim is None or tp == 1:
        return shape
    return (*shape[:dim], math.ceil(shape[dim] / tp), *shape[dim + 1 :])


def tp_whole_grads(model: nn.Module, plan: TPPlan | str) -> frozenset[int]:
    """Ids of the parameters whose unsharded gradient is whole under TP (_WHOLE_GRAD_STYLES)."""
    if isinstance(plan, str):
        return frozenset()
    return frozenset(
        id(p) for path, style in plan_rows(model.block_paths(), plan)
        if style in _WHOLE_GRAD_STYLES
        for p in model.get_submodule(path).parameters(recurse=False)
    )  # fmt: skip


def tp_shard_dims(model: nn.Module, plan: TPPlan | str) -> dict[int, int]:
    """Parameter id -> the dim the family's TP `plan` shards it on (as `apply_tp` applies it:
    `plan_rows`); the parameters it does not list are replicated on the TP ranks."""
    dims: dict[int, int] = {}
    if isinstance(plan, str):
        return dims
    for path, style in plan_rows(model.block_paths(), plan):
        rule = _STYLE_DIMS.get(style, {})
        for name, p in model.get_submodule(path).named_parameters():
            dim = rule.get(name, rule.get("*") if "." not in name else None)
            if dim is not None:
                dims[id(p)] = dim
    return dims
