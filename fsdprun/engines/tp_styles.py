"""The tensor-parallel styles fsdprun writes itself, where torch's ColwiseParallel and
RowwiseParallel (which split an `nn.Linear` or `nn.Embedding` only) do not reach: LoRA's adapted
Linears (`LoraParallel`) and a mixture of experts (`MoEBlockParallel`, `RouterParallel`,
`ExpertsParallel`). `fsdprun.engines.tp` picks them by the family's plan and the module it meets;
each is a public `ParallelStyle` built on `distribute_module` and DTensor's placements only.

**LoRA** (`models.lora.LoraLinear`: `base(x) + scale * B(A(x))`, the base weight its own): the
adapters are split so that each rank computes its share of the same sum, as torch splits the
base. Column-wise (the output features split): W and its bias Shard(0), A replicated (it reads the
whole input, as every rank has it), B Shard(0) (its rows are output features); each rank's
columns of base and adapter are then exactly the unsplit layer's. Row-wise (the input features
split): W Shard(1), its bias replicated, A Shard(1) (it reads the input features), B replicated;
`A x` is then a partial sum, `B (A x)` too (linear in it), and both partial sums are reduced by
the one reduce-scatter the base needs anyway. DTensor carries each gradient to its parameter's
placement (A's partial gradient under column-wise is summed over the TP group by FSDP2's
redistribution), so the adapters train as on one rank.

**A mixture of experts** (transformers' stacked experts: `gate_up_proj` [experts, 2 x ffn,
hidden], `down_proj` [experts, hidden, ffn], and a router): each TP rank holds experts / tp whole
experts (Shard(0) of both stacks), not a column/row split of every expert. transformers keeps the
gate and up projections of an expert in one tensor whose output its model halves (`chunk(2)`): a
contiguous Shard(1) would give rank 0 the gates and rank 1 the ups, and the interleaved split
transformers' own TP plan uses (`packed_colwise`) needs torch's private `_StridedShard`. Split by
experts, the block costs what a dense MLP under TP costs: its input all-gathered on the sequence
(sequence parallel), its output reduce-scattered back; each rank runs its experts on the tokens
routed to them (the others are sentinels the experts module skips, as transformers' own expert
parallel marks them), and the reduce-scatter sums the ranks' shares. The router is replicated and
routes every token on every rank alike, so the routing and the auxiliary loss are one rank's. The
gradients of the router's outputs and of the block input that reach the experts are partial
(each rank's experts' share): they are summed over the TP group where they leave the experts.

Imports torch at load: `fsdprun.engines.tp` imports this module where it applies a plan.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    """Parameter `name` (a dotted path under `module`) as a DTensor of `placement` over `mesh`;
    on the meta device or materialized (each rank slices its part locally: no communication)."""
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path)
    param = getattr(owner, leaf)
    dist = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
    owner.register_parameter(leaf, nn.Parameter(dist, requires_grad=param.requires_grad))


def _to_dtensor(x: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """`x` as a DTensor of `placements` (a local tensor is taken to be laid out so)."""
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, placements, run_check=False)


class LoraParallel(ParallelStyle):
    """Column-wise (`columns`) or row-wise parallel for a `LoraLinear` (the module docstring):
    the same input, output and sequence-parallel layouts as torch's ColwiseParallel /
    RowwiseParallel of the layer it adapts."""

    def __init__(
        self, *, columns: bool, input_layouts: Placement, output_layouts: Placement,
        use_local_output: bool = True,
    ):  # fmt: skip
        super().__init__()
        self.columns = columns
        self.input_layouts = (input_layouts,)
        self.desired_input_layouts = (Replicate(),) if columns else (Shard(-1),)
        self.output_layouts = (output_layouts,)
        self.use_local_output = use_local_output

    def placements(self, module: nn.Module) -> dict[str, Placement]:
        """Each parameter of the LoraLinear (by its name under it) and its placement."""
        if self.columns:
            out = {"weight": Shard(0), "bias": Shard(0), "lora_A.weight": Replicate(),
                   "lora_B.weight": Shard(0)}  # fmt: skip
        else:
            out = {"weight": Shard(1), "bias": Replicate(), "lora_A.weight": Shard(1),
                   "lora_B.weight": Replicate()}  # fmt: skip
        if module.bias is None:
            del out["bias"]
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            if submodule is module:
                for param, placement in self.placements(module).items():
                    _distribute(module, param, mesh, placement)

        def prepare_input(mod, inputs, mesh):
            x = _to_dtensor(inputs[0], mesh, self.input_layouts)
            if x.placements != self.desired_input_layouts:
                x = x.redistribute(placements=self.desired_input_layouts, async_op=True)
            return x

        def prepare_output(mod, output, mesh):
            # Column-wise: Shard(-1), the base's and the adapter's columns added. Row-wise: the
            # base's and the adapter's partial sums added, reduced here once.
            if output.placements != self.output_layouts:
                output = output.redistribute(placements=self.output_layouts, async_op=True)
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


def _local_parameters(module: nn.Module) -> list[tuple[nn.Module, str, DTensor]]:
    """Put every DTensor parameter under `module` in place as its local tensor (the experts' and
    the router's code computes on plain tensors: sorts, grouped matmuls, index adds); returns
    what `_restore` puts back. Differentiable: each gradient reaches its DTensor parameter with
    its placement. FSDP2 has registered its unsharded parameters before the block runs and
    reshards after it: the swap lives inside the block's forward."""
    swapped = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if isinstance(param, DTensor):
                # Not setattr: nn.Module takes only a Parameter under a parameter's name.
                owner._parameters[name] = param.to_local()
                swapped.append((owner, name, param))
    return swapped


def _restore(swapped: list[tuple[nn.Module, str, DTensor]]) -> None:
    for owner, name, param in swapped:
        owner._parameters[name] = param


class MoEBlockParallel(ParallelStyle):
    """A mixture of experts' block (router and experts) under TP with sequence parallel: its
    input (sharded on the sequence between blocks) all-gathered, its parameters local inside,
    and its output (each rank's experts' share) reduce-scattered back onto the sequence.

    The block runs eagerly inside a compiled decoder layer (a graph break): compiled with it,
    the gradients under TP were wrong on torch 2.13 (the first step's gradient norm 0.69458
    where eager and one rank give 0.69502; the cause was not found), and with the break they
    are exact; routing's sorts and index adds gain little from compile."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sequence = (Shard(1),)
        forward = module.forward

        @torch.compiler.disable
        def parallel_forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            # Every rank's gradient of the whole rows is whole (the experts' partial ones are
            # summed where they leave the experts): the backward keeps this rank's slice.
            whole = _to_dtensor(x, device_mesh, sequence).redistribute(placements=(Replicate(),))
            swapped = _local_parameters(module)
            try:
                output = forward(whole.to_local(), *args, **kwargs)
            finally:
                _restore(swapped)
            partial = DTensor.from_local(output, device_mesh, (Partial(),), run_check=False)
            return partial.redistribute(placements=sequence).to_local()

        # The parameters are the router's and the experts' (their own styles).
        module.forward = parallel_forward
        return module


class RouterParallel(ParallelStyle):
    """A mixture of experts' router: its parameters replicated on every TP rank (it routes the
    whole rows, the same on each); computed on local tensors inside `MoEBlockParallel`."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)  # no partition: every one replicated


def _sum_gradient(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x` unchanged; its gradient summed over `mesh` (each rank's is a partial sum)."""
    if not x.requires_grad:
        return x
    replicated = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return replicated.to_local(grad_placements=(Partial(),))


class ExpertsParallel(ParallelStyle):
    """transformers' stacked experts split by experts over the TP group (Shard(0)): this rank's
    experts / tp experts run on the tokens routed to them; a token's other choices are the
    sentinel id (the local expert count) that transformers' experts implementations skip in
    expert parallel (`_is_expert_parallel`). The output is this rank's share of the sum, which
    `MoEBlockParallel` reduces."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        local = module.num_experts // size
        first = rank * local
        signature = inspect.signature(module.forward)

        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            if submodule is module:
                for param, _ in list(module.named_parameters(recurse=False)):
                    _distribute(module, param, mesh, Shard(0))

        def prepare_input(mod, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            hidden, index, weights = bound.args[:3]
            index = index - first
            index = index.masked_fill((index < 0) | (index >= local), local)
            hidden = _sum_gradient(hidden, device_mesh)
            weights = _sum_gradient(weights, device_mesh)
            return (hidden, index, weights, *bound.args[3:]), bound.kwargs

        module.num_experts = local
        module._is_expert_parallel = True
        distribute_module(module, device_mesh, partition)
        module.register_forward_pre_hook(prepare_input, with_kwargs=True)
        return module
