"""Token cross-entropy of a causal LM, plain or chunked (`train.loss`).

`plain` lets the model return the logits and takes `cross_entropy` of them: with a vocabulary of
32k-128k the fp32 logits and their gradient are the largest activation of the step (8 x 2048
tokens x 128k x 4 B = 8 GiB). `chunked` never builds them: the model hands its final hidden
states and its output weight to `ChunkedCrossEntropy`, which walks over chunks of
`train.loss_chunk_size` tokens and, for each, computes the logits, the loss and at once the
gradients of the hidden states and of the output weight (the softmax gradient is
`softmax - one_hot`, known in forward). Only one chunk's logits exist at any time, in forward and
in backward, and no matmul is repeated: backward only scales the saved gradients by the incoming
gradient. What is kept for backward is the hidden-state gradient (tokens x dim) and the output
weight's gradient (vocab x dim), instead of the logits (tokens x vocab).

The chunking happens inside the model's forward (`model(tokens, head=...)`): under FSDP the
output weight is gathered only inside the root module's forward.

    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=4096)

Targets equal to IGNORE_INDEX (-100: prompt tokens, padding) are not trained: they add nothing to
the loss nor to any gradient. `reduction="mean"` divides by the number of trained targets of the
call; `reduction="sum"` returns the sum, for a training loop that divides by the global count of
trained targets of the step (`num_targets`, all-reduced), so that micro-batches and ranks holding
different numbers of targets still give the global token mean.

It sits at the package's ground floor, not in `train` nor in `engines`: the engines build the loss
the model's forward applies, the training loop counts trained targets, and `plan` and the run
header print `describe_loss`; none of them should reach into another's package for it. Never
imports an fsdprun module (torch only), so every package may import it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The target id of a token that is not trained (F.cross_entropy's default ignore_index).
IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum")


def describe_loss(train) -> str:
    """The run header's loss line, from the recipe's `train` section."""
    if train.loss.value == "plain":
        return "plain (whole logits, fp32 cross-entropy)"
    return f"chunked ({train.loss_chunk_size} tokens per chunk; the whole logits never exist)"


def num_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many targets are trained (not IGNORE_INDEX): an int64 0-d tensor on targets' device
    (no host sync; all-reduce it, then divide summed losses by it)."""
    return (targets != IGNORE_INDEX).sum()


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, reduction: str = "mean"
) -> torch.Tensor:
    """Token cross-entropy over the trained targets (not IGNORE_INDEX), computed in fp32 whatever
    the logits' dtype: their mean, or with `reduction="sum"` their sum (0 when none is trained)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )  # fmt: skip


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # hidden (n, dim), weight (vocab, dim): the sum of the chunk's trained token losses, fp32.
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_loss_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The chunk's loss sum and the gradients of `scale * loss sum` w.r.t. hidden and weight; the
    # weight's gradient in fp32 (it is accumulated over chunks). `scale` is a 0-d tensor so that
    # compiled kernels are not specialized (recompiled) on its value. Ignored targets gather at
    # index 0 and are then zeroed: their rows of the loss and of grad_logits are exactly 0.
    logits = (hidden @ weight.t()).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    trained = (targets != IGNORE_INDEX)[:, None]
    safe = torch.where(trained, targets[:, None], 0)
    loss = -(log_probs.gather(1, safe) * trained).sum()
    grad_logits = log_probs.exp()
    grad_logits.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad_logits.dtype))
    grad_logits = (grad_logits * (trained * scale)).to(hidden.dtype)
    grad_hidden = grad_logits @ weight
    grad_weight = (grad_logits.t() @ hidden).float()
    return loss, grad_hidden, grad_weight


_compiled: dict[str, Callable] = {}


def _kernels(compiled: bool) -> tuple[Callable, Callable]:
    if not compiled:
        return _chunk_loss, _chunk_loss_and_grads
    if not _compiled:
        # One graph per chunk shape (the last chunk may be shorter): no dynamic shapes needed.
        _compiled["loss"] = torch.compile(_chunk_loss, dynamic=False)
        _compiled["grads"] = torch.compile(_chunk_loss_and_grads, dynamic=False)
    return _compiled["loss"], _compiled["grads"]


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T` against `targets` (mean or sum over the trained
    targets), chunk by chunk; the logits of one chunk at a time. Gradients are computed in
    forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, with_grad, compiled, reduction="mean"):
        n = hidden.shape[0]
        loss_kernel, grad_kernel = _kernels(compiled)
        # A tensor, not a Python number: counting the trained targets needs no host sync.
        divisor = (
            num_targets(targets).float()
            if reduction == "mean"
            else hidden.new_ones((), dtype=torch.float32)
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if not with_grad:
            for start in range(0, n, chunk_size):
                end = start + chunk_size
                total += loss_kernel(hidden[start:end], weight, targets[start:end])
            return total / divisor
        scale = 1.0 / divisor
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, n, chunk_size):
            end = start + chunk_size
            loss, gh, gw = grad_kernel(hidden[start:end], weight, targets[start:end], scale)
            total += loss
            grad_hidden[start:end] = gh
            grad_weight += gw
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        # grad_output is a scalar (the accumulation divisor, the fp16 loss scale): no matmul.
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype),
            grad_weight * grad_output.to(grad_weight.dtype),
            None, None, None, None, None,
        )  # fmt: skip


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    compiled: bool = False,
    reduction: str = "mean",
) -> torch.Tensor:
    """Token cross-entropy of the logits `hidden @ weight.T`, never materialized whole: the mean
    over the trained targets (not IGNORE_INDEX), or their sum; gradients exactly those of
    `cross_entropy(hidden @ weight.T, targets, reduction=...)`.

    Args:
        hidden: final hidden states (..., dim), after the final norm.
        weight: the output projection (vocab, dim).
        targets: token ids (...), the shape of hidden without its last dim; IGNORE_INDEX = not
            trained.
        chunk_size: tokens per chunk.
        compiled: run each chunk through torch.compile'd kernels.
        reduction: "mean" or "sum" (0 when no target is trained).

    Under autocast (the ddp engine), hidden and weight are cast to the autocast dtype first, as
    autocast would cast the output projection's matmul.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    assert reduction in REDUCTIONS, reduction
    with torch.autocast(device_type, enabled=False):
        return ChunkedCrossEntropy.apply(
            hidden.flatten(0, -2), weight, targets.flatten(), chunk_size, with_grad, compiled,
            reduction,
        )  # fmt: skip
