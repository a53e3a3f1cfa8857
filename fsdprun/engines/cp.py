"""Context parallelism (`parallel.cp`, docs/context-parallel.md): each sequence is split across
the cp ranks of a group, and attention is computed across the split in one of two ways
(`parallel.cp_impl`): an all-to-all over heads (DeepSpeed-Ulysses), or a ring that passes keys and
values from rank to rank (ring attention) where the heads do not divide.

Every rank of a cp group holds `seq_len / cp` tokens of each row from the embedding to the loss
(`fsdprun.data.Batch.sequence_shard`); only attention needs the other tokens. Under the
all-to-all cp rank j holds the j-th consecutive slice. Before attention, one all-to-all trades
this rank's slice of every head of q, k and v for the whole sequence of `heads / cp` heads (cp
rank j gets heads j*h/cp .. (j+1)*h/cp - 1, and the kv heads that those query heads read under
grouped-query attention); attention then runs on whole rows with whatever kernel and mask the
model uses (SDPA's causal path and its fused kernels for plain rows, the dense or FlexAttention
mask of packed rows, built from the whole row's document ids; a family's sliding window and
soft-capping as the model applies them); a second all-to-all gives each rank its slice of every
head back. The rotary positions are those of the slice (`positions` cut from the whole row's),
applied before the exchange. The model is told which
tokens of each row it holds (`cp_attention_modules`), so that rope types whose factors depend on
the length (an HF folder's longrope or dynamic) take the whole row's documents'
(`fsdprun.models.rope`).

The ring (`ring_attention`) keeps every head and this rank's queries: the keys and values of each
cp rank's tokens go round the group (cp - 1 sends), and each rank computes its queries'
attention to each arriving part, chunk pair by chunk pair, merging the pairs' softmaxes by their
log-sum-exp (exact, as flash attention merges tiles). Its ranks hold zig-zag chunks
(`fsdprun.config.layout.cp_chunks`): of 2 cp equal chunks of a row, cp rank j holds chunks j
and 2 cp - 1 - j, so that under a causal mask every rank computes 2 cp + 1 of the chunk pairs
(with consecutive slices rank j would compute j + 1 whole blocks and the last rank would set the
pace). A pair whose keys all come after its queries is skipped (every mask fsdprun builds is
causal), and so is one wholly outside a sliding window. The backward sends the keys and values
round again with their gradients, which arrive home after the last step. Each pair is computed
with matmuls in float32 (no fused kernel), `ROW_CHUNK_BYTES` of scores at a time, so memory holds
one rank's keys and values besides this rank's own, not the whole row. It takes the whole row's
mask as the all-to-all does: None (causal), a dense mask (boolean, or additive for eager
attention), or a FlexAttention BlockMask (its mask_mod evaluated per pair), and transformers'
`scaling`, `softcap` and `sliding_window` arguments.

Parameters are sharded by FSDP2 over `dp_shard x cp` (the mesh's flattened `dp_shard_cp` dim,
torchtitan's layout): each cp rank's gradient is the part its tokens contribute, and the
reduce-scatter sums them. The rules (what is refused, the mesh's dims) are torch-free, in
`fsdprun.config.layout`; the mesh is built by `fsdprun.engines.mesh`. What context parallel does
to a rank's activations (`cp_local_seq`, `CP_ACTIVATION_FORMULA`) is the rule `fsdprun plan`
composes. This module imports torch where it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdprun.errors import UserError

# The scores (and, in the backward, their gradients) of at most this many bytes exist at a time
# in the ring's block computation: the query rows of a block are taken this many at a time.
ROW_CHUNK_BYTES = 256 * 2**20

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


def _visible(rows: slice, cols: slice, window: int | None) -> bool:
    """Whether any query at whole-row positions `rows` may see a key at `cols`: not where the
    keys all come after the queries (every mask fsdprun builds is causal), nor where they all
    lie outside a sliding `window` (a query sees the `window` positions up to its own)."""
    if cols.start >= rows.stop:
        return False
    return window is None or rows.start - (cols.stop - 1) < window


def _block_mask(
    mask, rows: slice, cols: slice, batch: int, device, window: int | None = None
) -> torch.Tensor | None:
    """What queries at whole-row positions `rows` may see of keys at `cols`: a boolean
    (batch or 1, 1, rows, cols) mask (True: may attend), a float mask to add to the scores, or
    None for all of them; `mask` as `attend` gets it: None (causal), a dense (batch, 1, seq, seq)
    mask, or a FlexAttention BlockMask; a sliding `window` is cut into any of them."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    r = torch.arange(rows.start, rows.stop, device=device)[:, None]
    c = torch.arange(cols.start, cols.stop, device=device)[None, :]
    if mask is None:
        if rows.start >= cols.stop and (window is None or rows.stop - cols.start <= window):
            return None  # keys wholly before the queries, and inside every query's window
        block = (r >= c)[None, None]
    elif isinstance(mask, BlockMask):
        b = torch.arange(batch, device=device)[:, None, None]
        h = torch.zeros((), dtype=torch.long, device=device)
        block = mask.mask_mod(b, h, r[None], c[None])[:, None]
    else:
        block = mask[:, :, rows, cols]
    if window is None:
        return block
    inside = r - c < window
    return block & inside if block.dtype == torch.bool else block.masked_fill(~inside, -torch.inf)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None):  # fmt: skip
    """Scaled q k^T, soft-capped where the model caps its scores (Gemma 2: cap x tanh(s / cap),
    before the mask, as its eager attention does), with a block's mask applied (-inf where a
    query may not attend); and the soft-cap's derivative (None without one) for backward."""
    import torch

    s = (q @ k.transpose(-1, -2)) * scale
    dcap = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = t * softcap, 1 - t * t
    if mask is None:
        return s, dcap
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf")), dcap
    return s + mask, dcap


def _row_chunks(batch: int, heads: int, rows: int, cols: int, start: int = 0):
    """Slices of a block's query rows (from local row `start`) whose scores take at most
    ROW_CHUNK_BYTES (float32); each with its slice of the block's own rows."""
    step = max(1, ROW_CHUNK_BYTES // max(1, batch * heads * cols * 4))
    return [(slice(start + i, start + min(i + step, rows)), slice(i, min(i + step, rows)))
            for i in range(0, rows, step)]  # fmt: skip


class _Ring:
    """The cp group's ring: send to the next cp rank, receive from the previous one. Its ranks
    hold the zig-zag chunks of each row (`fsdprun.config.layout.cp_chunks`)."""

    def __init__(self, mesh: DeviceMesh):
        import torch.distributed as dist

        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def chunks(self, owner: int, local: int) -> list[tuple[slice, slice]]:
        """cp rank `owner`'s chunks of a row of which each rank holds `local` tokens, as
        (where among its local tokens, where in the whole row)."""
        from fsdprun.config.layout import cp_chunks

        out, at = [], 0
        for part in cp_chunks(local * self.size, owner, self.size, zigzag=True):
            out.append((slice(at, at + part.stop - part.start), part))
            at += part.stop - part.start
        return out

    def pairs(self, owner: int, local: int, window: int | None):
        """The (query chunk, key chunk) pairs of this rank's queries and `owner`'s keys that
        are not masked whole: each chunk as (local slice, whole-row slice). With the zig-zag
        layout every rank gets 2 cp + 1 such pairs of a causal row over the whole ring."""
        return [(q, k) for q in self.chunks(self.rank, local) for k in self.chunks(owner, local)
                if _visible(q[1], k[1], window)]  # fmt: skip

    def start(self, tensors: list[torch.Tensor]):
        """Send `tensors` on and start receiving the previous rank's (same shapes); returns a
        function that waits for both and gives the received tensors."""
        import torch
        import torch.distributed as dist

        tensors = [t.contiguous() for t in tensors]  # gloo sends and receives dense buffers
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, self.prev, self.group) for g in got]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            for w in works:
                w.wait()
            return got

        return wait


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v (batch, kv_heads, seq, dim) with each kv head repeated for its query heads."""
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def _reduce_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand_kv`: the query heads' parts summed per kv head."""
    b, h, s, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, s, d).sum(2) if h != kv_heads else t


@functools.cache
def _ring_function():
    import torch

    class RingAttention(torch.autograd.Function):
        """Ring attention of this rank's q chunks against every cp rank's k, v chunks."""

        @staticmethod
        def forward(ctx, q, k, v, mask, scale, softcap, window, ring):
            b, h, n, _ = q.shape
            qf = q.float()
            out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float32, device=q.device)
            lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
            kv = [k, v]
            for step in range(ring.size):
                wait = ring.start(kv) if step < ring.size - 1 else None
                pairs = ring.pairs((ring.rank - step) % ring.size, n, window)
                kf, vf = (_expand_kv(t, h).float() for t in kv) if pairs else (None, None)
                for (qi, rows), (ki, cols) in pairs:
                    bm = _block_mask(mask, rows, cols, b, q.device, window)
                    for r, c in _row_chunks(b, h, qi.stop - qi.start, ki.stop - ki.start, qi.start):
                        s, _ = _scores(qf[:, :, r], kf[:, :, ki], None if bm is None else
                                       bm[:, :, c], scale, softcap)  # fmt: skip
                        new = torch.logaddexp(lse[:, :, r], torch.logsumexp(s, dim=-1))
                        # A row that has seen no key yet (a chunk masked whole for it, e.g. a
                        # document that starts later) keeps -inf: its weights are 0, not NaN.
                        safe = new.masked_fill(new == float("-inf"), 0.0)
                        out[:, :, r] = out[:, :, r] * torch.exp(lse[:, :, r] - safe)[..., None] + (
                            torch.exp(s - safe[..., None]) @ vf[:, :, ki]
                        )
                        lse[:, :, r] = new
                if wait is not None:
                    kv = wait()
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mask, ctx.scale, ctx.softcap, ctx.window = mask, scale, softcap, window
            ctx.ring = ring
            return out.to(q.dtype)

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, lse = ctx.saved_tensors
            mask, scale, softcap, window, ring = (ctx.mask, ctx.scale, ctx.softcap, ctx.window,
                                                  ctx.ring)  # fmt: skip
            b, h, n, _ = q.shape
            qf, do = q.float(), grad_out.float()
            delta = (do * out).sum(-1)  # (b, h, n): the softmax's backward term
            dq = torch.zeros_like(qf)
            # Each slice travels with the gradients of its keys and values so far.
            travel = [k, v, torch.zeros_like(k, dtype=torch.float32),
                      torch.zeros_like(v, dtype=torch.float32)]  # fmt: skip
            for step in range(ring.size):
                kk, vv, dk, dv = travel
                pairs = ring.pairs((ring.rank - step) % ring.size, n, window)
                if pairs:
                    kf, vf = _expand_kv(kk, h).float(), _expand_kv(vv, h).float()
                    dkf, dvf = torch.zeros_like(kf), torch.zeros_like(vf)
                for (qi, rows), (ki, cols) in pairs:
                    bm = _block_mask(mask, rows, cols, b, q.device, window)
                    for r, c in _row_chunks(b, h, qi.stop - qi.start, ki.stop - ki.start, qi.start):
                        s, dcap = _scores(qf[:, :, r], kf[:, :, ki], None if bm is None else
                                          bm[:, :, c], scale, softcap)  # fmt: skip
                        p = torch.exp(s - lse[:, :, r, None])
                        dvf[:, :, ki] += p.transpose(-1, -2) @ do[:, :, r]
                        ds = p * (
                            do[:, :, r] @ vf[:, :, ki].transpose(-1, -2) - delta[:, :, r, None]
                        )
                        if dcap is not None:
                            ds = ds * dcap
                        dq[:, :, r] += (ds @ kf[:, :, ki]) * scale
                        dkf[:, :, ki] += (ds.transpose(-1, -2) @ qf[:, :, r]) * scale
                if pairs:
                    dk = dk + _reduce_kv(dkf, kk.shape[1])
                    dv = dv + _reduce_kv(dvf, vv.shape[1])
                # After the last step the slice is one rank short of home: one more send.
                travel = (
                    ring.start([kk, vv, dk, dv])() if step < ring.size - 1 else [kk, vv, dk, dv]
                )
            dk, dv = ring.start([travel[2], travel[3]])() if ring.size > 1 else travel[2:]
            grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
            return (*grads, None, None, None, None, None)

    return RingAttention


def ring_attention(mesh: DeviceMesh) -> Callable:
    """`attend(q, k, v, mask, **kwargs)` computed by ring attention over the cp group `mesh`
    (module docstring): q (batch, heads, seq / cp, head_dim), k and v (batch, kv_heads, ...) of
    this rank's zig-zag chunks; the mask is the whole row's. transformers' arguments apply: the
    scale is 1/sqrt(head_dim) unless `scaling` names another, `softcap` caps the scores and
    `sliding_window` cuts them. Dropout is not applied: a caller that asks for it is refused."""
    ring = _Ring(mesh)
    function = _ring_function()

    def attend_ring(q, k, v, mask, **kwargs):
        if kwargs.get("dropout"):
            raise UserError(
                "parallel.cp_impl=ring: attention dropout is not supported by the ring; set the "
                "model's attention dropout to 0 or use parallel.cp_impl=alltoall"
            )
        scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
        softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
        return function.apply(q, k, v, mask, scale, softcap, window, ring)

    return attend_ring


def apply_cp(model: nn.Module, *, mesh: DeviceMesh, impl: str = "alltoall") -> int:
    """Make every decoder block's attention (`cp_attention_modules()`, whose `attend` this
    wraps or, for `impl` "ring", replaces) compute across the cp group `mesh`, in place (on the
    meta model, before activation checkpointing and FSDP; parameters do not change). The ring
    expects its ranks' tokens in the zig-zag layout (`fsdprun.config.layout.cp_zigzag`).

    Returns:
        The number of attention modules changed.

    Raises:
        UserError: the model's family does not declare its attention for context parallel
            (the launcher refuses it first; a rank started by torchrun or srun here).
    """
    modules = model.cp_attention_modules(
        index=mesh.get_local_rank(), count=mesh.size(), zigzag=impl == "ring"
    )
    if not modules:
        raise UserError(
            f"parallel.cp={mesh.size()}: {model.family_name}'s family does not declare its "
            "attention for context parallel (cp_attention in fsdprun/families.py); set "
            "parallel.cp=1"
        )
    for attention in modules:
        if impl == "ring":
            attention.attend = ring_attention(mesh)
        else:
            attention.attend = alltoall_attention(attention.attend, mesh)
    return len(modules)


# ---- memory: what context parallel leaves on a rank (`fsdprun plan`) ----

CP_ACTIVATION_FORMULA = (
    "Activations under context parallel: every rank holds seq/cp tokens of each row from the "
    "embedding to the loss, and inside attention the whole sequence of heads/cp heads (the "
    "same bytes), so every figure above is counted at seq/cp tokens; not counted: the "
    "all-to-all's send and receive buffers (transient) and, for packed rows, the dense "
    "seq x seq document mask every rank builds on CPU (FlexAttention's block mask on CUDA)"
)


def cp_local_seq(seq_len: int, cp: int) -> int:
    """The tokens of each row a rank holds under context parallel degree `cp`: its slice,
    from the embedding to the loss (inside the all-to-all's attention the whole sequence of
    heads / cp heads: the same bytes)."""
    return -(-seq_len // max(cp, 1))
