"""Expert parallelism (`parallel.ep`, docs/expert-parallel.md): each mixture-of-experts layer's
experts are sharded over the ep ranks of a group, and every token goes to the rank of each of
its experts by an all-to-all, and comes back by another. Also the load-balance figures: the
tokens each expert receives, per layer and (with ep) per rank, which the training loop logs.

The experts module a family declares (`fsdprun.families.Family.experts`: stacked `gate_up_proj`
and `down_proj`, `forward(hidden, top_k_index, top_k_weights)` after the family's own router)
keeps its parameters' names and global shapes: `apply_ep` makes each a DTensor sharded on the
experts dim (`Shard(0)`) over the mesh's `ep` dim, so ep rank r holds experts r x E/ep ..
(r + 1) x E/ep - 1, and FSDP2 then shards those over the `dp_shard_mod_ep` dim
(`fsdprun.engines.mesh`). DCP saves them with their placements: a checkpoint loads at any other
ep degree, or without ep, and exports as the same stacked tensors.

The dispatch (`dispatch`, the experts module's forward under ep), dropless as transformers
computes it:
1. the (token, k) pairs are sorted by expert; the count each expert receives goes to every ep
   rank by one all-to-all of E integers, and is read on the host (a device sync: the next
   all-to-all's split sizes);
2. the pairs' hidden states go to their experts' ranks by `all_to_all_single` with those
   uneven splits (autograd's: its backward is the reverse all-to-all of the gradients);
3. a rank regroups what it received by local expert and runs its experts on it
   (`fsdprun.models.moe.expert_ffn`: one grouped matmul on CUDA in bf16, a loop elsewhere);
4. the outputs go back by the reverse all-to-all, and each token's output is its experts'
   outputs weighted by the router and summed, as without ep.
The router is the family's own and runs on every rank's own tokens: its auxiliary loss is per
micro-batch as without ep.

Gradients: an expert's gradient on its rank holds what every token of its ep group sent it;
FSDP's reduce-scatter over dp_shard_mod_ep adds the other groups' and divides by that mesh's
size, where the dense parameters' is divided by all the data-parallel ranks, ep times more. The
dispatch scales the local experts' gradients by 1 / ep in backward (an identity in forward).
FSDP's own `set_gradient_divide_factor` would say it, but torch 2.13 divides twice by it on a
mesh of one rank (dp_shard_mod_ep 1: ep = the data-parallel ranks; measured: expert gradients
1 / ep of one rank's), and gloo lacks the pre-multiplied sum it takes elsewhere. The gradient
norm is taken per mesh and combined (`fsdp2.clip_grad_norm`).

The rules (the degree, the mesh's dims, what is refused) are torch-free, in
`fsdprun.config.layout`. The memory and communication rules (`EP_FORMULA`, `ep_dispatch_bytes`,
`ep_alltoall_bytes`) are composed by `fsdprun plan`. This module imports torch where it runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fsdprun.config.layout import Layout
from fsdprun.engines.base import UnitPlan
from fsdprun.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# The experts' stacked parameters the dispatch computes with (`Family.experts`).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")

EP_FORMULA = (
    "expert parallel: each rank holds experts / ep of every mixture-of-experts layer's experts, "
    "which FSDP shards over dp_shard_mod_ep (= data-parallel ranks / ep): the expert state per "
    "rank is the same experts x expert size / data-parallel ranks as without ep, but a rank "
    "gathers only its own experts (the gathered buffers). Dispatch buffers per micro-batch: the "
    "sorted (token, k) pairs' hidden states sent and those received, and the same of the "
    "outputs coming back (micro-batch tokens x top-k x hidden x 4, in param_dtype, balanced "
    "routing); the all-to-all volume per step: each layer sends (ep - 1) / ep of its pairs "
    "out and back, forward and backward"
)


def experts_paths(model: nn.Module, experts: str | None) -> list[str]:
    """The module path of each decoder block's experts (`Family.experts`, relative to the
    block), in forward order; a block without one (a dense layer) is skipped. Ask before FSDP
    wraps the model (an HF model finds its blocks by their class, which FSDP2 changes)."""
    if experts is None:
        return []
    modules = dict(model.named_modules())
    return [p for block in model.block_paths() if (p := f"{block}.{experts}") in modules]


def _within(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def outside_experts(paths: list[str], experts: list[str]) -> list[str]:
    """The wrap policy's unit `paths` without the experts modules and what they hold: under
    expert parallel each experts module is a unit of its own (`with_expert_units`)."""
    return [p for p in paths if not any(_within(p, e) for e in experts)]


def expert_unit_paths(paths: list[str], experts: list[str]) -> list[str]:
    """The wrap policy's unit `paths` under expert parallel, the root left out: each of the
    `experts` modules a unit of its own just before the unit that holds it, those outside every
    unit last (`with_expert_units` gives their reshard and prefetch)."""
    out, left = [], list(experts)
    for path in outside_experts(paths, experts):
        out += [e for e in left if _within(e, path)]
        left = [e for e in left if not _within(e, path)]
        out.append(path)
    return out + left


def with_expert_units(rows: list[UnitPlan], experts: list[str], *, reshard: bool) -> list[UnitPlan]:
    """The FSDP units under expert parallel: the engine's `rows` (the root last) with each of the
    `experts` modules a unit of its own over the expert mesh, just before the unit that holds
    it and resharding as that one does; one outside every unit (fsdp.wrap=none) comes before
    the root and reshards as `reshard` says. What `fsdp2.apply_fsdp` builds and plan counts."""
    out, left = [], list(experts)
    for row in rows[:-1]:
        mine = [e for e in left if _within(e, row.path)]
        out += [UnitPlan(e, row.reshard_after_forward, [], "implicit") for e in mine]
        left = [e for e in left if e not in mine]
        out.append(row)
    return [*out, *(UnitPlan(e, reshard, [], "implicit") for e in left), rows[-1]]


def ep_problem(model: nn.Module, experts: str | None, *, family: str) -> str | None:
    """Why the experts modules of `model` cannot be dispatched under expert parallel (one
    clause), or None: none found where the family says, or one without the stacked
    parameters and activation the dispatch computes with."""
    from torch import nn

    paths = experts_paths(model, experts)
    if not paths:
        return f"{family} has no experts modules at {experts} of its decoder layers"
    module = model.get_submodule(paths[0])
    missing = [n for n in EXPERT_PARAMS if not isinstance(getattr(module, n, None), nn.Parameter)]
    if missing or not callable(getattr(module, "act_fn", None)):
        lacks = ", ".join(missing) if missing else "act_fn"
        return (
            f"{family}'s experts ({type(module).__name__} at {experts}) lack {lacks}: the "
            "dispatch computes stacked gate_up_proj / down_proj SwiGLU experts"
        )
    return None


def check_ep(model: nn.Module, layout: Layout, experts: str | None, *, family: str) -> None:
    """Refuse before launch, in one line, a model whose experts the dispatch cannot take.

    Raises:
        UserError: `ep_problem` has an answer.
    """
    if layout.ep > 1 and (problem := ep_problem(model, experts, family=family)) is not None:
        raise UserError(f"parallel.ep={layout.ep}: {problem}; set parallel.ep=1")


def apply_ep(model: nn.Module, *, mesh: DeviceMesh, paths: list[str]) -> None:
    """Shard the stacked parameters of the experts modules at `paths` (`experts_paths`) on the
    experts dim over `mesh` (the ep dim: `Shard(0)` DTensors, on the meta device before FSDP)
    and give each the all-to-all dispatch as its forward."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    for path in paths:
        module = model.get_submodule(path)
        for name in EXPERT_PARAMS:
            param = getattr(module, name)
            sharded = distribute_tensor(param, mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        # The instance's forward: the class's (transformers', decorated) is left alone. Not
        # compiled: its shapes depend on the routing (a compiled block breaks its graph here
        # once instead of at each host read and collective).
        module.forward = torch.compiler.disable(functools.partial(dispatch, module,
                                                                  mesh.get_group()))  # fmt: skip


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """`all_to_all_single` with uneven splits and autograd (its backward sends the gradients
    back the reverse way)."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits,
                                                        group))  # fmt: skip


def dispatch(
    module: nn.Module, group, hidden: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The experts module's forward under expert parallel (the module docstring's steps):
    `hidden` (tokens, dim) and the router's `top_k_index` / `top_k_weights` (tokens, k) of this
    rank's tokens; returns their outputs (tokens, dim)."""
    import torch
    import torch.distributed as dist

    from fsdprun.models.moe import combine, expert_ffn, sort_by_expert

    gate_up, down = module.gate_up_proj, module.down_proj
    num_experts = gate_up.shape[0]  # the DTensor's global shape
    ep = dist.get_world_size(group)
    local = num_experts // ep
    k = top_k_index.shape[-1]
    order, counts = sort_by_expert(top_k_index, num_experts)
    # received[s, j]: the pairs ep rank s sends to this rank's local expert j. Zeros, not
    # empty: a fake process group (the memory contract's) moves no data.
    received = torch.zeros_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    # One device-to-host copy of both (a sync: the split sizes are host integers).
    host = torch.cat([counts, received]).tolist()
    sent_counts, got = host[:num_experts], host[num_experts:]
    send = [sum(sent_counts[r * local : (r + 1) * local]) for r in range(ep)]
    by_source = [got[s * local : (s + 1) * local] for s in range(ep)]
    recv = [sum(row) for row in by_source]
    x = _all_to_all(hidden[order // k], recv, send, group)
    # Regroup by local expert (the pairs arrive by source rank, each source's by expert).
    blocks = torch.tensor([n for row in by_source for n in row], device=x.device)
    source_expert = torch.arange(ep * local, device=x.device).repeat_interleave(blocks)
    key = (source_expert % local) * ep + source_expert // local  # expert-major
    regroup = torch.argsort(key, stable=True)
    per_expert = [sum(by_source[s][j] for s in range(ep)) for j in range(local)]
    # 1 / ep: FSDP divides the experts' gradients by dp_shard_mod_ep, the rest's by ep times
    # that (the module docstring's Gradients).
    weights = [_scaled_grad(w.to_local(), 1 / ep) for w in (gate_up, down)]
    y = expert_ffn(x[regroup], per_expert, *weights, module.act_fn)
    back = torch.empty_like(y)
    back[regroup] = y
    out = _all_to_all(back, send, recv, group)
    return combine(out, order, top_k_weights).to(hidden.dtype)


@functools.cache
def _scale_grad_function() -> type:
    import torch

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    return ScaleGrad


def _scaled_grad(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """`weight` itself in forward (a view: nothing is copied), its gradient times `scale` in
    backward (the module docstring's Gradients)."""
    return _scale_grad_function().apply(weight, scale)


# ---- the load-balance figures ----


class ExpertLoad:
    """The tokens each expert receives, per MoE layer: counted from what each experts
    module's forward receives (its `top_k_index`: the family's own router's choice), summed
    over a step's micro-batches (training forwards only) and summarized at each logging step
    over the steps since the last (`summary`), and over the run (`run_summary`).

    With expert parallel, also the tokens each rank's experts compute, per layer: a hot
    expert makes its rank the straggler of every all-to-all.
    """

    def __init__(self, model: nn.Module, paths: list[str], *, num_experts: int,
                 ep_group=None, replicas: int = 1, device: torch.device) -> None:  # fmt: skip
        """`replicas`: how many ranks route the same tokens (a tensor-parallel group's)."""
        import torch

        blocks = model.block_paths()
        # Each MoE layer's block index (a dense layer among sparse ones has none).
        self.layers = [next(i for i, b in enumerate(blocks) if p.startswith(f"{b}."))
                       for p in paths]  # fmt: skip
        self.modules = [model.get_submodule(p) for p in paths]
        self.num_experts, self.ep_group, self.replicas = num_experts, ep_group, replicas
        self.window = torch.zeros(len(paths), num_experts, dtype=torch.int64, device=device)
        self.total: list[list[int]] | None = None  # the run's, on every rank
        self.rank_total: list[list[int]] | None = None  # with ep: (ranks, layers)
        for module in self.modules:
            # First of the module's hooks: tensor parallel's rewrites the indices to its
            # rank's local experts (`engines.tp_styles.ExpertsParallel`).
            module.register_forward_pre_hook(_keep_routed(num_experts), with_kwargs=True,
                                             prepend=True)  # fmt: skip

    def add(self) -> None:
        """Add the counts of the forward just run (after each training micro-batch's forward:
        activation checkpointing's recomputation in backward then counts nothing twice)."""
        import torch

        self.window += torch.stack([m.routed for m in self.modules])

    def summary(self) -> dict[str, Any]:
        """The figures of the window since the last call, on every rank (collectives: every
        rank calls it at the same steps): per layer, the tokens (token x k pairs) of the
        busiest expert, the mean over experts and their ratio, and which expert; with ep, the
        same of the tokens each rank's experts computed."""
        import torch
        import torch.distributed as dist

        counts = self.window.clone()
        dist.all_reduce(counts)
        counts //= self.replicas  # each of a TP group's ranks counted the group's tokens
        figures = _figures(counts.tolist(), "expert")
        self.total = _add(self.total, counts.tolist())
        if self.ep_group is not None:
            group = self.window.clone()
            dist.all_reduce(group, group=self.ep_group)
            ep, rank = dist.get_world_size(self.ep_group), dist.get_rank(self.ep_group)
            local = self.num_experts // ep
            mine = group[:, rank * local : (rank + 1) * local].sum(dim=1)
            ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, mine)
            per_rank = torch.stack(ranks).t().tolist()  # (layers, ranks)
            figures["ranks"] = _figures(per_rank, "rank")
            self.rank_total = _add(self.rank_total, per_rank)
        self.window.zero_()
        return figures

    def run_summary(self) -> dict[str, Any] | None:
        """The figures over every logged step of the run (None before the first)."""
        if self.total is None:
            return None
        figures = {"layers": self.layers, **_figures(self.total, "expert")}
        if self.rank_total is not None:
            figures["ranks"] = _figures(self.rank_total, "rank")
        return figures


def _keep_routed(num_experts: int):
    """A forward pre-hook that keeps in `module.routed` the count of (token, k) pairs each
    expert receives in this forward (assigned, not added: a recomputation under activation
    checkpointing assigns the same)."""
    from fsdprun.models.moe import routed_counts

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        module.routed = routed_counts(index, num_experts)

    return hook


def _add(total: list[list[int]] | None, counts: list[list[int]]) -> list[list[int]]:
    if total is None:
        return [list(row) for row in counts]
    return [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(total, counts, strict=True)]


def _figures(counts: list[list[int]], what: str) -> dict[str, Any]:
    """Per layer (a row of counts, one per expert or rank): the busiest's count, the mean, their
    ratio (1.0: perfectly balanced; 0 tokens: 1.0) and the busiest's index; and the worst
    layer's ratio."""
    busiest = [max(range(len(row)), key=row.__getitem__) for row in counts]
    most = [row[i] for row, i in zip(counts, busiest, strict=True)]
    mean = [sum(row) / len(row) for row in counts]
    ratio = [m / a if a else 1.0 for m, a in zip(most, mean, strict=True)]
    return {"max": most, "mean": mean, "max_over_mean": ratio, f"busiest_{what}": busiest,
            "worst_max_over_mean": max(ratio) if ratio else 1.0}  # fmt: skip


# ---- plan's rules ----


def ep_dispatch_bytes(*, tokens: int, top_k: int, dim: int, param_bytes: int) -> int:
    """The dispatch buffers of one MoE layer on a rank (balanced routing): the sorted pairs'
    hidden states sent and received, and the outputs sent back and received, each `tokens`
    (the micro-batch's on this rank) x top-k x hidden in param_dtype (`EP_FORMULA`)."""
    return 4 * tokens * top_k * dim * param_bytes


def ep_alltoall_bytes(
    *, tokens: int, top_k: int, dim: int, param_bytes: int, ep: int, layers: int,
    micro_batches: int,
) -> int:  # fmt: skip
    """Bytes a rank sends by all-to-all in one step (balanced routing): each MoE layer's
    (ep - 1) / ep of its `tokens` x top-k pairs out and back, in forward and again in backward
    (the gradients), for each micro-batch."""
    per_layer = tokens * top_k * dim * param_bytes * (ep - 1) // ep
    return 4 * per_layer * layers * micro_batches
