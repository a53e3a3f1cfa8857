"""What one rank keeps for backward: the activation estimate of a recipe for one micro-batch,
block by block, composed from each parallel dimension's own rule (tensor parallel's shares of
heads, columns and tokens, `fsdprun.engines.tp`; context parallel's slice of the sequence,
`fsdprun.engines.cp`), activation checkpointing and the loss. `fsdprun plan` prints it;
`ACTIVATION_FORMULA` says how it is counted.

Torch-free: plain arithmetic on the recipe's model shape (an HF folder's, once `ModelSpec.shape`
has read it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdprun.config import CheckpointMode, LossKind, RecipeConfig
from fsdprun.config.layout import Layout, cp_impl
from fsdprun.config.model_facts import model_facts
from fsdprun.engines.base import DTYPE_BYTES
from fsdprun.engines.cp import cp_local_seq, ring_working_bytes
from fsdprun.models import model_spec

ACTIVATION_FORMULA = (
    "per block and token, eager: 8*dim (the fp32 input of each RMSNorm) + c*(6*dim + 4*ffn_dim + "
    "2*kv_dim), c = bytes of param_dtype (each norm's value before and after its weight, q after "
    "RoPE, the attention output; k and v after RoPE; w1, w3, silu and product outputs); "
    "compiled (compile.enabled): c*(6*dim + 2*kv_dim + 3*ffn_dim) + 4*(n_heads + 2) (AOTAutograd "
    "recomputes the norms and keeps the fp32 statistics only); both counted with "
    "saved_tensors_hooks on a Llama block (within 2%). A checkpointed block keeps only its input, "
    "seq*micro*dim*c, and one block is recomputed at a time; plus the logits, "
    "seq*micro*vocab*(c + 8) eager (their fp32 copy and log-softmax in the loss) or "
    "seq*micro*(vocab*c + 8) with the loss compiled. Selective checkpointing (every block) keeps "
    "per token c*(5*dim + 2*kv_dim + 2*ffn_dim) + 4*n_heads (the block input, the matmul and "
    "attention outputs, attention's fp32 logsumexp), plus one block recomputed at a time. "
    "train.loss=chunked replaces the logits by seq*micro*dim*c + vocab*dim*(c + 4) (the "
    "gradients of the hidden states and the output weight, its fp32 accumulator) + "
    "chunk*vocab*(c + 12) (one chunk's logits, log-probabilities and their gradient)"
)


@dataclass(frozen=True)
class _TokenDims:
    """What one rank's activations are made of under tensor parallel degree tp (1 = none).

    Under sequence parallel the norms and the residual stream between blocks hold seq / tp
    tokens (`seq_tokens`); inside attention and the feed-forward every token is there, with the
    local heads (`dim`, `kv_dim`: the q/attention-output and k/v widths) and ffn / tp columns
    (`ffn`); the norm outputs are all-gathered on the sequence before the column-wise matmuls,
    which keep that full-sequence copy (`tokens` x dim) for backward; the row-wise matmuls
    (o, down) compute full-sequence partial sums before their reduce-scatter; the logits are
    vocab / tp wide (loss parallel). Rank 0's shares: ceil."""

    tokens: int  # seq x micro
    seq_tokens: int  # ceil(seq / tp) x micro
    dim: int  # ceil(n_heads / tp) x head_dim
    kv_dim: int
    ffn: int
    heads: int
    vocab: int


def _token_dims(cfg: RecipeConfig) -> _TokenDims:
    m, t, layout = cfg.model, cfg.train, Layout.of(cfg)
    tp = layout.tp
    head_dim = m.dim // m.n_heads
    plan = model_spec(m).tp_plan(m)
    seq_shards = 1 if isinstance(plan, str) else tp  # sequence parallel between blocks
    seq = cp_local_seq(t.seq_len, layout.cp)
    return _TokenDims(
        tokens=seq * t.micro_batch_size,
        seq_tokens=math.ceil(seq / seq_shards) * t.micro_batch_size,
        dim=math.ceil(m.n_heads / tp) * head_dim,
        kv_dim=math.ceil((m.n_kv_heads or m.n_heads) / tp) * head_dim,
        ffn=math.ceil(m.ffn_dim / tp),
        heads=math.ceil(m.n_heads / tp),
        vocab=math.ceil(m.vocab_size / tp),
    )


def block_activation_bytes(cfg: RecipeConfig) -> int:
    """Bytes one transformer block saves for backward for one micro-batch, not checkpointed
    (see ACTIVATION_FORMULA; under parallel.tp, `engines.tp.TP_ACTIVATION_FORMULA`)."""
    dim, c, d = cfg.model.dim, DTYPE_BYTES[cfg.precision.param_dtype], _token_dims(cfg)
    if cfg.compile.enabled:
        # Sequence-sharded: the block input, h, the two fp32 norm statistics; the rest as eager.
        return d.seq_tokens * (2 * c * dim + 8) + d.tokens * (
            c * (2 * dim + 2 * d.dim + 2 * d.kv_dim + 3 * d.ffn) + 4 * d.heads
        )
    # Sequence-sharded: each norm's fp32 input and its value before the weight.
    return d.seq_tokens * (8 * dim + 2 * c * dim) + d.tokens * c * (
        2 * dim + 2 * d.dim + 2 * d.kv_dim + 4 * d.ffn
    )


def selective_block_bytes(cfg: RecipeConfig) -> int:
    """Bytes one block keeps under selective checkpointing for one micro-batch (see
    ACTIVATION_FORMULA): the block input (sequence-sharded under TP), o's and down's outputs
    (whole: before their reduce-scatter), q, k, v, attention, gate and up outputs (local
    heads and columns) and attention's fp32 logsumexp."""
    dim, c, d = cfg.model.dim, DTYPE_BYTES[cfg.precision.param_dtype], _token_dims(cfg)
    return d.seq_tokens * c * dim + d.tokens * (
        c * (2 * dim + 2 * d.dim + 2 * d.kv_dim + 2 * d.ffn) + 4 * d.heads
    )


def loss_bytes(cfg: RecipeConfig) -> int:
    """Bytes the loss keeps for one micro-batch: the logits (plain) or the chunked loss's saved
    gradients plus one chunk (see ACTIVATION_FORMULA); vocab / tp wide under loss parallel."""
    m, t = cfg.model, cfg.train
    c, d = DTYPE_BYTES[cfg.precision.param_dtype], _token_dims(cfg)
    tokens, vocab = d.tokens, d.vocab
    if t.loss is LossKind.chunked:
        chunk = min(t.loss_chunk_size, tokens)
        return tokens * m.dim * c + vocab * m.dim * (c + 4) + chunk * vocab * (c + 12)
    if cfg.compile.enabled:  # the compiled loss keeps the logits and two fp32 values per token
        return tokens * (vocab * c + 8)
    return tokens * vocab * (c + 8)


def ring_bytes(cfg: RecipeConfig) -> int:
    """What the ring's attention holds while one layer runs, where parallel.cp_impl resolves
    to the ring (`engines.cp.RING_MEMORY_FORMULA`); 0 elsewhere (the all-to-all's buffers are
    the slice's own size and transient, as CP_ACTIVATION_FORMULA says)."""
    facts = model_facts(cfg.model)
    if not Layout.of(cfg).is_cp or cp_impl(cfg, facts) != "ring":
        return 0
    m, d = cfg.model, _token_dims(cfg)
    head_dim = m.dim // m.n_heads
    return ring_working_bytes(
        micro=cfg.train.micro_batch_size, heads=d.heads, kv_heads=d.kv_dim // head_dim,
        head_dim=head_dim, local_seq=d.tokens // cfg.train.micro_batch_size,
        dtype_bytes=DTYPE_BYTES[cfg.precision.param_dtype],
        softcap=facts is not None and facts.attn_softcap is not None,
    )  # fmt: skip


def activation_bytes(cfg: RecipeConfig) -> int:
    """Activations one rank keeps for backward for one micro-batch (estimate; see
    ACTIVATION_FORMULA), with the ring's working memory where it computes attention."""
    kept, recompute = _blocks_bytes(cfg, cfg.model.n_layers)
    # The ring's largest buffers exist while a block's attention backward runs, once the loss
    # has freed the logits: the peak holds one or the other.
    return kept + recompute + max(loss_bytes(cfg), ring_bytes(cfg))


def _blocks_bytes(cfg: RecipeConfig, n_layers: int) -> tuple[int, int]:
    """What `n_layers` blocks keep for one micro-batch under the recipe's checkpointing, and
    the one block recomputed at a time (0 without checkpointing)."""
    m = cfg.model
    c = DTYPE_BYTES[cfg.precision.param_dtype]
    block = block_activation_bytes(cfg)
    ac = cfg.activation_checkpointing
    checkpointed = {
        CheckpointMode.none: 0,
        CheckpointMode.full: n_layers,
        CheckpointMode.selective: n_layers,
        CheckpointMode.every_n: len(range(0, n_layers, max(ac.every_n, 1))),
    }[ac.mode]
    per_checkpointed = (  # a fully checkpointed block keeps its (sequence-sharded) input
        selective_block_bytes(cfg)
        if ac.mode is CheckpointMode.selective
        else _token_dims(cfg).seq_tokens * m.dim * c
    )
    kept = checkpointed * per_checkpointed + (n_layers - checkpointed) * block
    return kept, block if checkpointed else 0


def stage_activation_bytes(cfg: RecipeConfig, *, blocks: int, last: bool, held: float) -> int:
    """Activations a pipeline rank keeps for backward at its peak: `held` micro-batches
    (`config.schedule.in_flight`) through its `blocks` blocks, each with the loss's where the rank
    runs the last stage (its forward computes the loss), plus one block recomputed at a time
    under checkpointing (see ACTIVATION_FORMULA)."""
    kept, recompute = _blocks_bytes(cfg, blocks)
    loss = loss_bytes(cfg) if last else 0
    # The ring's buffers, where larger than one micro-batch's logits (as `activation_bytes`).
    return math.ceil(held * (kept + loss)) + recompute + max(0, ring_bytes(cfg) - loss)
