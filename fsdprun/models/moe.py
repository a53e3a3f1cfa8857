"""Mixtures of experts: the built-in Llama's (the model.moe_* keys), the expert computation every
family's experts share under fsdprun, the router's load-balancing loss and the count of the
tokens each experts module receives.

The built-in MoE is transformers' Qwen3-MoE feed-forward in fsdprun's Llama: a linear router
(`moe.gate`, weight [experts, dim]) takes a softmax over the experts, keeps each token's top-k
and, with `norm_topk_prob`, renormalizes them to sum to 1 (Mixtral always does); the experts are
SwiGLUs stacked into `gate_up_proj` [experts, 2 x ffn, dim] and `down_proj` [experts, dim, ffn],
the names, layout and math of transformers' experts modules; an optional shared expert (a dense
SwiGLU every token passes through) is added to their output. Dropless: every routed token is
computed, with no capacity factor, as transformers computes it.

The experts compute their tokens sorted by expert (`expert_ffn`): one grouped matmul for all of
them where the device has one (`torch._grouped_mm`: CUDA, bf16), else a loop over the experts,
the same math. Expert parallel (`fsdprun.engines.ep`) replaces an experts module's forward by
its all-to-all dispatch around the same `expert_ffn`.

Never imports torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Top-k routing as transformers' Qwen3-MoE router computes it: the logits, each token's
    top-k probabilities (renormalized with `norm_topk_prob`), and their expert indices."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # (tokens, experts)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index


class Experts(nn.Module):
    """`num_experts` SwiGLU experts of hidden size `ffn_dim`, stacked (transformers' layout).
    `forward(hidden, top_k_index, top_k_weights)` as transformers' experts modules take it: each
    token's output is the sum of its top-k experts' outputs, each times its weight."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.act_fn = F.silu

    # Not compiled: the experts' shapes depend on the routing (a compiled block breaks its graph
    # here once instead of at the host read of the counts and each expert's shapes).
    @torch.compiler.disable
    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        order, counts = sort_by_expert(top_k_index, self.num_experts)
        k = top_k_index.shape[-1]
        # This is a CPU-GPU sync: the loop (or the grouped matmul's offsets) needs the counts.
        out = expert_ffn(hidden[order // k], counts.tolist(), self.gate_up_proj, self.down_proj,
                         self.act_fn)  # fmt: skip
        return combine(out, order, top_k_weights)


class SwiGLU(nn.Module):
    """A dense SwiGLU (the shared expert): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A block's mixture-of-experts feed-forward: router, experts, optional shared expert. The
    router's logits of the last forward stay in `router_logits` (the model's auxiliary loss
    reads them)."""

    def __init__(
        self, dim: int, *, num_experts: int, top_k: int, ffn_dim: int, shared_ffn_dim: int,
        norm_topk_prob: bool,
    ):  # fmt: skip
        super().__init__()
        self.gate = Router(dim, num_experts, top_k, norm_topk_prob=norm_topk_prob)
        self.experts = Experts(dim, ffn_dim, num_experts)
        self.shared_expert = SwiGLU(dim, shared_ffn_dim) if shared_ffn_dim else None
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        self.router_logits, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(shape)


def sort_by_expert(
    top_k_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs ordered by expert (a stable sort of the flattened `top_k_index`:
    `order // k` is each pair's token) and the count of each expert's pairs (on the device)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, routed_counts(flat, num_experts)


def routed_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, k) pairs each expert receives (int64, no device sync: a scatter-add,
    not bincount, whose output size depends on the data)."""
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def combine(out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each token's output from its experts' outputs `out` (in `order`, by expert): put back in
    (token, k) order, weighted by the router and summed over k."""
    tokens, k = top_k_weights.shape
    back = torch.empty_like(out)
    back[order] = out
    weighted = back.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(dim=1)


def grouped_mm_available(weight: torch.Tensor) -> bool:
    """Whether `expert_ffn` takes torch's grouped matmul for `weight`: on CUDA of compute
    capability 8.0 or newer, in bf16 (its kernel's dtype) and where torch has it (2.9+: an
    experimental `torch._grouped_mm`). Elsewhere, the CPU included, a loop over the experts."""
    return (
        weight.device.type == "cuda"
        and weight.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    )


def expert_ffn(
    x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The SwiGLU of expert e on its `counts[e]` rows of `x` (rows sorted by expert): `gate_up`
    [experts, 2 x ffn, dim], `down` [experts, dim, ffn], as plain tensors (an expert-parallel
    rank's local experts). Every expert takes part, with no rows too: each gets a (zero)
    gradient on every rank, which FSDP's reduce-scatter of the experts needs."""
    if grouped_mm_available(gate_up):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x.to(gate_up.dtype), gate_up.transpose(-2, -1), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offsets)
    outs = []
    for e, rows in enumerate(x.split(counts)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
    real: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Switch Transformer's load-balancing loss of one forward's router logits (one
    [tokens, experts] tensor per layer), as transformers' `load_balancing_loss_func` computes
    it: num_experts x sum over experts of (the share of top-k assignments it receives) x (its
    mean router probability), both over every layer's tokens together. `real` (batch, seq):
    1 for a real token, 0 for padding, which then counts in neither."""
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if real is None else real.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        weight = torch.ones(chosen.shape[0], device=device) if mask is None else mask
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + weight.sum()
    return (assigned / rows * prob_sum / rows).sum() * num_experts
