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
applied before the exchange. The model is told which tokens of each row it holds
(`cp_attention_modules`), so that rope types whose factors depend on the length (an HF folder's
longrope or dynamic) take the whole row's documents' (`fsdprun.models.rope`).

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
with matmuls in float32 (no fused kernel), per kv head over its group of query heads (k and v
are never repeated), `ROW_CHUNK_HEAD_DIMS x head_dim` query rows at a time (`ring_chunk_rows`),
so memory holds one rank's keys and values besides this rank's own and scores a multiple of this
rank's queries: everything scales with the slice, nothing with the whole row
(`ring_working_bytes`, `RING_MEMORY_FORMULA`: what `fsdprun plan` counts). It takes the whole row's
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

# The ring takes a chunk pair's query rows this many times the head dim at a time
# (`ring_chunk_rows`): a chunk's float32 scores are then this many times this rank's queries in
# float32, so the ring's memory scales with the slice (seq / cp), as the rest of a rank's does.
ROW_CHUNK_HEAD_DIMS = 2

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


def _apply_mask(s: torch.Tensor, mask: torch.Tensor | None, group: int) -> torch.Tensor:
    """Scores s (batch, kv_heads, group x rows, cols) with a block's (batch or 1, 1, rows, cols)
    mask applied in place: -inf where a query may not attend (bool), or the float mask added."""
    import torch

    if mask is None:
        return s
    b, hk, _, cols = s.shape
    by_head = s.view(b, hk, group, -1, cols)
    mask = mask[:, :, None]  # (batch or 1, 1, 1, rows, cols): every head of every kv group
    if mask.dtype == torch.bool:
        by_head.masked_fill_(mask.logical_not(), float("-inf"))
    else:
        by_head.add_(mask)
    return s


def ring_chunk_rows(head_dim: int, rows: int) -> int:
    """Query rows of a chunk pair taken at a time: ROW_CHUNK_HEAD_DIMS x the head dim (at most
    the pair's `rows`), so that a chunk's float32 scores take ROW_CHUNK_HEAD_DIMS x the bytes of
    this rank's queries in float32 (head_dim a row): the ring's working memory is a multiple of
    its slice, whatever cp."""
    return max(1, min(rows, ROW_CHUNK_HEAD_DIMS * head_dim))


def _row_chunks(rows: slice, step: int) -> list[slice]:
    """`rows` (a chunk of this rank's local query rows) `step` at a time."""
    return [slice(i, min(i + step, rows.stop)) for i in range(rows.start, rows.stop, step)]


def _grouped(t: torch.Tensor, rows: slice, kv_heads: int) -> torch.Tensor:
    """Rows `rows` of t (batch, heads, seq, dim) as float32 (batch, kv_heads, heads / kv_heads x
    rows, dim): each kv head's query heads one after another, so that one matmul against a kv
    head's keys serves its whole group (grouped-query attention without repeating k and v).
    May be a view of t: read only."""
    b, _, _, d = t.shape
    return t[:, :, rows].reshape(b, kv_heads, -1, d).float()


def _softcap_(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scores capped in place where the model caps them (Gemma 2: cap x tanh(s / cap), before
    the mask, as its eager attention does)."""
    return s.div_(softcap).tanh_().mul_(softcap) if softcap else s


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


@functools.cache
def _ring_function():
    import torch

    class RingAttention(torch.autograd.Function):
        """Ring attention of this rank's q chunks against every cp rank's k, v chunks.

        Memory (`ring_working_bytes` counts it for `fsdprun plan`): the float32 accumulators
        of this rank's output (forward) or query gradient (backward), the keys and values in
        hand and the ones arriving (with their float32 gradients in backward), and per chunk of
        query rows its scores (one buffer forward, two backward: the probabilities and their
        gradient, each computed in place; three with soft-capping, whose derivative is kept).
        Nothing of the size of the whole row, nor a pair's whole scores, ever exists; k and v
        are never repeated for their query heads (the matmuls run per kv head over its
        group)."""

        @staticmethod
        def forward(ctx, q, k, v, mask, scale, softcap, window, ring):
            b, h, n, d = q.shape
            hk, group = k.shape[1], h // k.shape[1]
            out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float32, device=q.device)
            lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
            out_g, lse_g = out.view(b, hk, group, n, -1), lse.view(b, hk, group, n)
            kv = [k.contiguous(), v.contiguous()]  # sent as they are
            for step in range(ring.size):
                wait = ring.start(kv) if step < ring.size - 1 else None
                pairs = ring.pairs((ring.rank - step) % ring.size, n, window)
                kf, vf = (t.float() for t in kv) if pairs else (None, None)
                for (qi, rows), (ki, cols) in pairs:
                    bm = _block_mask(mask, rows, cols, b, q.device, window)
                    kc, vc = kf[:, :, ki], vf[:, :, ki]
                    for c in _row_chunks(qi, ring_chunk_rows(d, qi.stop - qi.start)):
                        at = slice(c.start - qi.start, c.stop - qi.start)  # rows of the pair
                        s = _grouped(q, c, hk).mul(scale) @ kc.transpose(-1, -2)
                        s = _apply_mask(_softcap_(s, softcap), None if bm is None else
                                        bm[:, :, at], group)  # fmt: skip
                        top = s.amax(-1)  # (b, hk, group x rows)
                        # A row that has seen no key yet (a chunk masked whole for it, e.g. a
                        # document that starts later) keeps -inf: its weights are 0, not NaN.
                        top = top.masked_fill(top == float("-inf"), 0)
                        p = s.sub_(top[..., None]).exp_()  # in place: the scores' buffer
                        total = p.sum(-1)
                        old = lse_g[:, :, :, c].reshape(total.shape)
                        new = torch.logaddexp(old, top + total.log())
                        base = new.masked_fill(new == float("-inf"), 0)
                        keep = (old - base).exp().view(b, hk, group, -1, 1)
                        add = (top - base).exp().masked_fill(total == 0, 0)[..., None]
                        part = (p @ vc).mul_(add).view(b, hk, group, c.stop - c.start, -1)
                        out_g[:, :, :, c].mul_(keep).add_(part)
                        lse_g[:, :, :, c] = new.view(b, hk, group, -1)
                        del s, p
                del kf, vf
                if wait is not None:
                    kv = wait()
            out = out.to(q.dtype)  # saved as returned: backward's softmax term reads it
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mask, ctx.scale, ctx.softcap, ctx.window = mask, scale, softcap, window
            ctx.ring = ring
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, lse = ctx.saved_tensors
            mask, scale, softcap, window, ring = (ctx.mask, ctx.scale, ctx.softcap, ctx.window,
                                                  ctx.ring)  # fmt: skip
            b, h, n, d = q.shape
            hk, group = k.shape[1], h // k.shape[1]
            delta = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
            for c in _row_chunks(slice(0, n), ring_chunk_rows(d, n)):  # the softmax's term
                delta[:, :, c] = (grad_out[:, :, c].float() * out[:, :, c].float()).sum(-1)
            dq = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
            dq_g, delta_g, lse_g = (dq.view(b, hk, group, n, d), delta.view(b, hk, group, n),
                                    lse.view(b, hk, group, n))  # fmt: skip
            # The keys and values travel with the float32 gradients of their keys and values
            # so far.
            kk, vv = k.contiguous(), v.contiguous()
            dk = torch.zeros(kk.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(vv.shape, dtype=torch.float32, device=q.device)
            for step in range(ring.size):
                pairs = ring.pairs((ring.rank - step) % ring.size, n, window)
                kf, vf = (kk.float(), vv.float()) if pairs else (None, None)
                for (qi, rows), (ki, cols) in pairs:
                    bm = _block_mask(mask, rows, cols, b, q.device, window)
                    kc, vc, m = kf[:, :, ki], vf[:, :, ki], ki.stop - ki.start
                    dk_b = dk[:, :, ki].reshape(b * hk, m, -1)
                    dv_b = dv[:, :, ki].reshape(b * hk, m, -1)
                    for c in _row_chunks(qi, ring_chunk_rows(d, qi.stop - qi.start)):
                        r, at = c.stop - c.start, slice(c.start - qi.start, c.stop - qi.start)
                        qc = _grouped(q, c, hk).mul(scale)  # (b, hk, group x r, d)
                        do = _grouped(grad_out, c, hk)
                        s = qc @ kc.transpose(-1, -2)
                        dcap = None
                        if softcap:  # keep tanh for the cap's derivative, 1 - tanh^2
                            dcap = s.div_(softcap).tanh_()
                            s = dcap.mul(softcap)
                        s = _apply_mask(s, None if bm is None else bm[:, :, at], group)
                        own = lse_g[:, :, :, c].reshape(b, hk, -1, 1)
                        p = s.sub_(own).exp_()  # the probabilities, in the scores' buffer
                        dv_b.baddbmm_(p.view(b * hk, -1, m).transpose(1, 2),
                                      do.reshape(b * hk, group * r, -1))  # fmt: skip
                        term = delta_g[:, :, :, c].reshape(b, hk, -1, 1)
                        ds = (do @ vc.transpose(-1, -2)).sub_(term).mul_(p)
                        del s, p
                        if dcap is not None:
                            ds.mul_(dcap.mul_(dcap).neg_().add_(1))
                            del dcap
                        dq_g[:, :, :, c] += (ds @ kc).mul_(scale).view(b, hk, group, r, d)
                        dk_b.baddbmm_(ds.view(b * hk, -1, m).transpose(1, 2),
                                      qc.reshape(b * hk, group * r, d))  # fmt: skip
                        del ds
                    dk[:, :, ki] = dk_b.view(b, hk, m, -1)
                    dv[:, :, ki] = dv_b.view(b, hk, m, -1)
                del kf, vf
                # After the last step the keys are one rank short of home: one more send.
                if step < ring.size - 1:
                    kk, vv, dk, dv = ring.start([kk, vv, dk, dv])()
            dk, dv = ring.start([dk, dv])() if ring.size > 1 else (dk, dv)
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


RING_MEMORY_FORMULA = (
    "parallel.cp_impl=ring: besides what it saves (q, k, v, its output and the log-sum-exp, "
    "as SDPA does), the ring's attention holds while it runs, at most one layer at a time: "
    "in backward, the float32 query gradient (micro*heads*n*head_dim*4, n = seq/cp), the "
    "softmax term (micro*heads*n*4), the keys and values in hand in param_dtype with their "
    "float32 gradients (2*micro*kv_heads*n*head_dim*(c + 4), float32 copies besides when "
    f"c < 4), and per chunk of r = min(n/2, {ROW_CHUNK_HEAD_DIMS}*head_dim) query rows of a "
    "zig-zag chunk pair two float32 score buffers against the n/2 keys of the pair "
    "(2*micro*heads*r*n/2*4; three with soft-capping) with the chunk's queries and output "
    "gradients (2*micro*heads*r*head_dim*4); while the keys travel, two of them; in forward "
    "the float32 output, the keys in hand and the ones arriving, one score buffer: the larger "
    "of the two"
)


def ring_working_bytes(
    *, micro: int, heads: int, kv_heads: int, head_dim: int, local_seq: int, dtype_bytes: int,
    softcap: bool = False,
) -> int:  # fmt: skip
    """Bytes the ring's attention allocates on a rank while one layer's forward or backward
    runs, beyond the tensors it is given and saves (RING_MEMORY_FORMULA; `RingAttention`'s
    buffers, counted as it allocates them). Every term scales with the slice, `local_seq`
    tokens (two zig-zag chunks of local_seq / 2): none with the whole row."""
    n, d, c = local_seq, head_dim, dtype_bytes
    half = max(n // 2, 1)  # the tokens of one zig-zag chunk: a pair's rows and columns
    r = ring_chunk_rows(d, half)
    q4, lse = micro * heads * n * d * 4, micro * heads * n * 4
    k4, kc = micro * kv_heads * n * d * 4, micro * kv_heads * n * d * c
    scores, rows4 = micro * heads * r * half * 4, micro * heads * r * d * 4
    cast = 2 * k4 if c != 4 else 0  # float32 copies of the keys and values in hand
    chunk_k4 = micro * kv_heads * half * d * 4  # a pair's key gradients, gathered and put back
    forward = q4 + lse + 4 * kc + cast + scores + 2 * rows4
    compute = 2 * kc + 2 * k4 + cast + (3 if softcap else 2) * scores + 3 * rows4 + 2 * chunk_k4
    travel = 4 * kc + 4 * k4
    backward = q4 + lse + max(compute, travel)
    return max(forward, backward)


def cp_local_seq(seq_len: int, cp: int) -> int:
    """The tokens of each row a rank holds under context parallel degree `cp`: its slice,
    from the embedding to the loss (inside the all-to-all's attention the whole sequence of
    heads / cp heads: the same bytes)."""
    return -(-seq_len // max(cp, 1))
