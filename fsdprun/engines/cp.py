"""Context parallelism (`parallel.cp`, docs/context-parallel.md): each sequence is split across
the cp ranks of a group, and attention is computed across the split with an all-to-all over
heads (DeepSpeed-Ulysses).

Every rank of a cp group holds `seq_len / cp` consecutive tokens of each row (cp rank j the j-th
slice: `fsdprun.data.Batch.sequence_shard`) from the embedding to the loss; only attention needs
the other tokens. Before it, one all-to-all trades this rank's slice of every head of q, k and v
for the whole sequence of `heads / cp` heads (cp rank j gets heads j*h/cp .. (j+1)*h/cp - 1, and
the kv heads that those query heads read under grouped-query attention); attention then runs on
whole rows with whatever kernel and mask the model uses (SDPA's causal, the dense or
FlexAttention mask of packed rows, built from the whole row's document ids); a second all-to-all
gives each rank its slice of every head back. The rotary positions are those of the slice
(`positions` cut from the whole row's), applied before the exchange.

Parameters are sharded by FSDP2 over `dp_shard x cp` (the mesh's flattened `dp_shard_cp` dim,
torchtitan's layout): each cp rank's gradient is the part its tokens contribute, and the
reduce-scatter sums them. The rules (what is refused, the mesh's dims) are torch-free, in
`fsdprun.engines.mesh`; this module imports torch where it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdprun.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def _exchange(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All-to-all of dim 0 (cp chunks) over the cp group: chunk j goes to cp rank j, and chunk j
    of the result came from cp rank j. Differentiable (its backward is the reverse all-to-all)."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_to_all_single_autograd(x.contiguous(), None, None, mesh))


def heads_to_seq(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Attention's output back onto the sequence split: (batch, heads / cp, seq, dim) of this
    rank's heads -> (batch, heads, seq / cp, dim) of its slice."""
    cp = mesh.size()
    b, h, s, d = x.shape
    chunks = x.view(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # chunk j: cp rank j's slice
    got = _exchange(chunks, mesh)  # got[j]: my slice of cp rank j's heads
    return got.transpose(0, 1).reshape(b, cp * h, s // cp, d)


def alltoall_attention(attend: Callable, mesh: DeviceMesh) -> Callable:
    """`attend(q, k, v, mask, **kwargs)` (q, k, v: batch, heads, seq / cp, head_dim) as
    DeepSpeed-Ulysses computes it over the cp group `mesh`: q, k and v are exchanged in one
    all-to-all (packed on the head dim), `attend` runs on whole rows of heads / cp heads, and
    its output is exchanged back. The mask is the whole row's."""
    import torch

    def attend_cp(q, k, v, mask, **kwargs):
        cp = mesh.size()
        heads = [q.shape[1] // cp, k.shape[1] // cp, v.shape[1] // cp]
        b, _, s, d = q.shape

        def by_rank(t):  # chunk j (dim 0): the heads cp rank j takes
            return t.view(b, cp, -1, s, d).transpose(0, 1)

        got = _exchange(torch.cat([by_rank(t) for t in (q, k, v)], dim=2), mesh)
        whole = got.permute(1, 2, 0, 3, 4).reshape(b, sum(heads), cp * s, d)
        q, k, v = whole.split(heads, dim=1)
        out = attend(q, k, v, mask, **kwargs)
        return heads_to_seq(out, mesh)

    return attend_cp


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The `cp` dim of the mesh: one cp group per data-parallel (and tp) rank."""
    return mesh["cp"]


def apply_cp(model: nn.Module, *, mesh: DeviceMesh) -> int:
    """Make every decoder block's attention (`cp_attention_modules()`, whose `attend` this
    wraps) compute across the cp group `mesh`, in place (on the meta model, before activation
    checkpointing and FSDP; parameters do not change).

    Returns:
        The number of attention modules changed.

    Raises:
        UserError: the model's attention has not been verified under context parallel (the
            launcher refuses it first; a rank started by torchrun or srun here).
    """
    modules = model.cp_attention_modules()
    if not modules:
        raise UserError(
            f"parallel.cp={mesh.size()}: {model.family_name}'s attention has not been verified "
            "under context parallel; set parallel.cp=1"
        )
    for attention in modules:
        attention.attend = alltoall_attention(attention.attend, mesh)
    return len(modules)
