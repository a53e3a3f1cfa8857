"""Document masking for packed sequences: causal attention that never crosses an example boundary.

A packed row holds several examples one after another; `doc_ids` (batch, seq) names the example
of each token, -1 for padding. A query at position q may attend to key k only when k <= q and
both tokens belong to the same example (block-diagonal causal). A padding token attends to itself
only: every query row keeps at least one key, so the softmax never sees an empty row (no NaN),
and padding never reads real tokens.

`build_attention_mask(doc_ids)` is called once per model forward and its result handed to every
block; `attend(q, k, v, mask)` is the one attention call the blocks make:

- `None` (no doc_ids): SDPA with `is_causal=True`, exactly the model without packing;
- a boolean tensor (batch, 1, seq, seq), True = may attend: SDPA with that mask, exact on every
  device, but O(seq^2) memory per row;
- a FlexAttention `BlockMask` (CUDA, head_dim >= 16): `flex_attention` skips the blocks the mask
  empties and never builds the dense mask. Its result equals SDPA's to kernel rounding. Inductor's
  flex kernel refuses smaller heads (torch 2.11, seen on an H200), so they take the dense mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

AttentionMask = torch.Tensor | BlockMask | None

# doc_ids of a padding token (the data pipeline's convention).
PAD_DOC_ID = -1

# The smallest head_dim the compiled flex_attention kernel takes ("NYI: embedding dimension of the
# query, key, and value must be at least 16"); smaller heads use the dense mask on CUDA too.
FLEX_MIN_HEAD_DIM = 16


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """The dense mask (batch, 1, seq, seq), True where a query may attend to a key.

    Args:
        doc_ids: (batch, seq) integer example ids; PAD_DOC_ID marks padding.
    """
    seq = doc_ids.shape[1]
    idx = torch.arange(seq, device=doc_ids.device)
    causal = idx[:, None] >= idx[None, :]
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] != PAD_DOC_ID)
    self_only = idx[:, None] == idx[None, :]
    return ((same & causal) | self_only)[:, None]


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The same mask as `document_causal_mask`, as a FlexAttention BlockMask (any device that
    FlexAttention compiles for; used on CUDA)."""
    batch, seq = doc_ids.shape

    def mask_mod(b, h, q, kv):
        same = (doc_ids[b, q] == doc_ids[b, kv]) & (doc_ids[b, q] != PAD_DOC_ID)
        return ((q >= kv) & same) | (q == kv)

    # On CUDA compiled, so the mask is built block by block, never as a dense (batch, seq, seq)
    # tensor; elsewhere (tests) eager, which skips a compile of ~20 s.
    create = _compiled_create_block_mask() if doc_ids.is_cuda else create_block_mask
    return create(mask_mod, batch, None, seq, seq, device=doc_ids.device)


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention is a slow reference that materializes the scores; compiled once, it
    # is the fused kernel. torch.compile'd blocks inline it into their own graph.
    return torch.compile(flex_attention)


def use_flex(device_type: str, *, head_dim: int | None) -> bool:
    """Whether packed rows on `device_type` get a FlexAttention BlockMask: on CUDA, for heads the
    flex kernel takes (`head_dim` None: not known, assumed large enough)."""
    return device_type == "cuda" and (head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM)


def build_attention_mask(
    doc_ids: torch.Tensor | None, *, flex: bool | None = None, head_dim: int | None = None
) -> AttentionMask:
    """The mask every block of one forward uses (see the module docstring).

    Args:
        doc_ids: (batch, seq) example ids, PAD_DOC_ID for padding; None = plain causal.
        flex: use a FlexAttention BlockMask; None = on CUDA, when `head_dim` (the attention's,
            if known) is at least FLEX_MIN_HEAD_DIM.
    """
    if doc_ids is None:
        return None
    if flex is None:
        flex = use_flex(doc_ids.device.type, head_dim=head_dim)
    return document_block_mask(doc_ids) if flex else document_causal_mask(doc_ids)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, *, enable_gqa: bool
) -> torch.Tensor:
    """Scaled dot-product attention of q (batch, heads, seq, head_dim) and k, v (batch, kv_heads,
    seq, head_dim) under `mask` (from `build_attention_mask`)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    if isinstance(mask, BlockMask):
        return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
