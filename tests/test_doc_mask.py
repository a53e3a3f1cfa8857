"""Packed sequences without cross-talk, and the masked token-sum loss (issue 15).

A row packing three examples (positions restarting at 0, `doc_ids` naming the example, -1 for
padding) must give each example the loss and the gradient it gets alone (fp32, 1e-5), for the
built-in Llama and for a transformers model (the shipped tiny HF Llama, whose packed logits must
also equal the built-in Llama's with the same weights). Padding gives finite outputs and no loss.
Without doc_ids the forward is bit-identical to the plain causal computation. Activation
checkpointing passes the mask through, FSDP2 at world 2 gives the single-process gradients, and
the chunked loss with ignored targets equals the plain one (values and gradients, 1e-6). The
FlexAttention path is checked against the dense mask on CPU here and on CUDA (`gpu`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from fsdprun.config import ActivationCheckpointingConfig, CheckpointMode
from fsdprun.engines.transforms import apply_activation_checkpointing
from fsdprun.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy, num_targets
from fsdprun.models.attention import (
    FLEX_MIN_HEAD_DIM,
    attend,
    build_attention_mask,
    document_causal_mask,
    use_flex,
)
from fsdprun.models.llama import ModelArgs, Transformer, rope_at

TOL = 1e-5
HF_DIR = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
VOCAB = 257  # the shipped tiny HF Llama's
LENGTHS = (5, 9, 4)  # three examples, then padding up to SEQ
SEQ = 22


def _llama(args: ModelArgs | None = None) -> Transformer:
    torch.manual_seed(0)
    args = args or ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                             vocab_size=VOCAB, max_seq_len=32)  # fmt: skip
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # large enough that attention is far from uniform
    return model


def _hf_pair():
    """The shipped tiny HF Llama (through HFCausalLM) and the built-in Llama with its weights."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from fsdprun.models.hf import HFCausalLM
    from fsdprun.models.llama import hf_llama_name

    hf = HFCausalLM.from_folder(HF_DIR)
    weights = load_file(HF_DIR / "model.safetensors")
    hf.hf.load_state_dict(weights)
    ours = Transformer(hf.args)
    ours.load_state_dict({name: weights[hf_llama_name(name)] for name in ours.state_dict()})
    return hf, ours


def _examples(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets) of each example; the first two tokens of each are an untrained prompt."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        targets = torch.randint(0, VOCAB, (n,), generator=gen)
        targets[:2] = IGNORE_INDEX
        out.append((tokens, targets))
    return out


def _pack(examples) -> dict[str, torch.Tensor]:
    """One packed row (batch 1) padded to SEQ, as the data pipeline gives it."""
    pad = SEQ - sum(len(t) for t, _ in examples)
    tokens = torch.cat([t for t, _ in examples] + [torch.zeros(pad, dtype=torch.long)])
    targets = torch.cat([y for _, y in examples] + [torch.full((pad,), IGNORE_INDEX)])
    positions = torch.cat([torch.arange(len(t)) for t, _ in examples] + [torch.arange(pad)])
    doc_ids = torch.cat(
        [torch.full((len(t),), i) for i, (t, _) in enumerate(examples)] + [torch.full((pad,), -1)]
    )
    return {k: v[None] for k, v in dict(tokens=tokens, targets=targets, positions=positions,
                                         doc_ids=doc_ids).items()}  # fmt: skip


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Per-token cross-entropy (0 at ignored targets), fp32: an independent reference.
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(targets.shape)  # fmt: skip


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _alone(model, examples):
    """Per-example loss sums and the summed gradients of all examples, each run alone."""
    model.zero_grad(set_to_none=True)
    losses = []
    for tokens, targets in examples:
        loss = cross_entropy(model(tokens[None]), targets[None], reduction="sum")
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), _grads(model)


def _packed(model, batch, head=None):
    """Per-example loss sums (plain path), their total (through `head` if given) and the
    gradients of that total, on one packed row."""
    model.zero_grad(set_to_none=True)
    kw = dict(positions=batch["positions"], doc_ids=batch["doc_ids"])
    logits = model(batch["tokens"], **kw)
    per_token = _token_losses(logits, batch["targets"])
    assert torch.isfinite(logits).all()  # padding included: it attends to itself
    doc = batch["doc_ids"][0]
    per_doc = torch.stack([per_token[0, doc == i].sum() for i in range(len(LENGTHS))])
    assert per_token[0, doc == -1].abs().sum() == 0  # padding never counts
    total = cross_entropy(logits, batch["targets"], reduction="sum") if head is None else model(
        batch["tokens"], head=head, **kw
    )  # fmt: skip
    total.backward()
    return per_doc.detach(), total.detach(), _grads(model)


def _assert_grads_close(got: dict, expected: dict, tol: float = TOL) -> None:
    """Close to `tol` of each tensor's own scale: a gradient summed over many tokens (the
    embedding's reaches 71 here) differs by float32 rounding in its largest terms, which lands
    on small elements too (4.6e-5 on AVX-512, 2026-12); what packing gets wrong is of the
    gradient's own size."""
    assert got.keys() == expected.keys()
    for name in expected:
        scale = max(1.0, expected[name].abs().max().item())
        torch.testing.assert_close(got[name], expected[name], atol=tol * scale, rtol=tol, msg=name)


@pytest.mark.parametrize("chunked", [False, True])
def test_packed_examples_give_their_own_losses_and_gradients(chunked: bool):
    model = _llama()
    examples = _examples(0)
    batch = _pack(examples)
    head = None
    if chunked:
        head = functools.partial(chunked_cross_entropy, targets=batch["targets"], chunk_size=5,
                                 reduction="sum")  # fmt: skip
    alone_losses, alone_grads = _alone(model, examples)
    per_doc, total, grads = _packed(model, batch, head)
    assert (alone_losses > 1.0).all()
    torch.testing.assert_close(per_doc, alone_losses, atol=TOL, rtol=TOL)
    torch.testing.assert_close(total, alone_losses.sum(), atol=TOL, rtol=TOL)
    _assert_grads_close(grads, alone_grads)


def test_without_the_mask_examples_would_leak_into_each_other():
    # The promise above is not vacuous: restarted positions alone (plain causal attention over
    # the whole row) change the later examples' losses.
    model = _llama()
    examples = _examples(0)
    batch = _pack(examples)
    alone_losses, _ = _alone(model, examples)
    with torch.no_grad():
        logits = model(batch["tokens"], positions=batch["positions"])
    per_token = _token_losses(logits, batch["targets"])[0]
    second = per_token[batch["doc_ids"][0] == 1].sum()
    assert (second - alone_losses[1]).abs() > 1e-2


def test_a_batch_of_packed_rows_is_masked_row_by_row():
    model = _llama()
    rows = [_pack(_examples(1)), _pack(_examples(2)[::-1])]
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    with torch.no_grad():
        both = model(batch["tokens"], positions=batch["positions"], doc_ids=batch["doc_ids"])
        for i, row in enumerate(rows):
            one = model(row["tokens"], positions=row["positions"], doc_ids=row["doc_ids"])
            torch.testing.assert_close(both[i : i + 1], one, atol=TOL, rtol=TOL)


def _reference_causal_forward(
    model: Transformer, tokens: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The built-in Llama's logits written out with plain `is_causal` SDPA: what the model
    computed before packing support (an independent transcription, not the model's forward);
    with `positions`, RoPE angles recomputed at those positions."""
    args = model.args
    bsz, seq = tokens.shape
    if positions is None:
        cos = model.rope[:seq, :, 0][None, :, None, :]
        sin = model.rope[:seq, :, 1][None, :, None, :]
    else:
        half = args.head_dim // 2
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(half).float() / half))
        angles = positions.float()[..., None] * inv_freq
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        a = layer.attention
        x = layer.attention_norm(h)
        q = rope(a.wq(x).view(bsz, seq, args.n_heads, args.head_dim)).transpose(1, 2)
        k = rope(a.wk(x).view(bsz, seq, args.n_kv_heads, args.head_dim)).transpose(1, 2)
        v = a.wv(x).view(bsz, seq, args.n_kv_heads, args.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + a.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))


def test_without_doc_ids_the_forward_is_bit_identical_to_plain_causal_attention():
    model = _llama()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens)
        assert torch.equal(logits, _reference_causal_forward(model, tokens))
        # Per-token RoPE at 0..seq-1 reads the same table rows: the same bits.
        positions = torch.arange(SEQ).expand(2, SEQ)
        assert torch.equal(rope_at(model.rope, positions)[0], model.rope[:SEQ])
        assert torch.equal(model(tokens, positions=positions), logits)
        # One document spanning the row: the dense mask is the causal mask (other kernel).
        one_doc = model(tokens, doc_ids=torch.zeros_like(tokens))
        torch.testing.assert_close(one_doc, logits, atol=TOL, rtol=TOL)


def test_rope_follows_the_given_positions():
    # RoPE is relative: within masked examples restarting positions change nothing, so check
    # the positions where they matter, on a row without doc_ids.
    model = _llama()
    batch = _pack(_examples(3))
    with torch.no_grad():
        got = model(batch["tokens"], positions=batch["positions"])
        expected = _reference_causal_forward(model, batch["tokens"], batch["positions"])
        torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)
        assert (got - model(batch["tokens"])).abs().max() > 1e-2


def test_dense_mask_is_block_diagonal_causal_and_padding_sees_itself():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1, -1]])
    mask = document_causal_mask(doc_ids)[0, 0]
    for q in range(7):
        for k in range(7):
            same = doc_ids[0, q] == doc_ids[0, k] and doc_ids[0, q] != -1
            assert mask[q, k].item() == ((k <= q and same) or q == k), (q, k)


@pytest.mark.parametrize("mode", [CheckpointMode.full, CheckpointMode.selective])
def test_activation_checkpointing_passes_the_mask_to_the_blocks(mode):
    examples = _examples(4)
    batch = _pack(examples)
    reference = _packed(_llama(), batch)
    model = _llama()
    assert apply_activation_checkpointing(model, cfg=ActivationCheckpointingConfig(mode=mode)) == 2
    per_doc, total, grads = _packed(model, batch)
    alone_losses, _ = _alone(_llama(), examples)
    torch.testing.assert_close(per_doc, alone_losses, atol=TOL, rtol=TOL)
    torch.testing.assert_close(total, reference[1], atol=1e-6, rtol=1e-6)
    _assert_grads_close(grads, reference[2], tol=1e-6)


def test_hf_model_packs_like_alone_and_like_the_builtin_llama():
    hf, ours = _hf_pair()
    examples = _examples(5)
    batch = _pack(examples)
    kw = dict(positions=batch["positions"], doc_ids=batch["doc_ids"])
    positions = {"positions": batch["positions"]}
    with torch.no_grad():
        for inputs in (kw, positions):  # positions alone: no packing inferred by transformers
            torch.testing.assert_close(
                hf(batch["tokens"], **inputs), ours(batch["tokens"], **inputs), atol=TOL, rtol=TOL
            )
    alone_losses, alone_grads = _alone(hf, examples)
    per_doc, total, grads = _packed(hf, batch)
    torch.testing.assert_close(per_doc, alone_losses, atol=TOL, rtol=TOL)
    _assert_grads_close(grads, alone_grads)
    # The chunked head through the wrapper's forward_hidden gets the same packed inputs.
    head = functools.partial(chunked_cross_entropy, targets=batch["targets"], chunk_size=6,
                             reduction="sum")  # fmt: skip
    _, c_total, c_grads = _packed(hf, batch, head)
    torch.testing.assert_close(c_total, total, atol=TOL, rtol=TOL)
    _assert_grads_close(c_grads, grads)


def test_hf_model_with_activation_checkpointing_keeps_the_mask():
    hf, _ = _hf_pair()
    batch = _pack(_examples(6))
    reference = _packed(hf, batch)
    cfg = ActivationCheckpointingConfig(mode=CheckpointMode.full)
    assert apply_activation_checkpointing(hf, cfg=cfg) == 2
    per_doc, total, grads = _packed(hf, batch)
    torch.testing.assert_close(per_doc, reference[0], atol=1e-6, rtol=1e-6)
    _assert_grads_close(grads, reference[2], tol=1e-6)


# The chunked loss with ignored targets, against torch's own masked cross-entropy.


def _masked_targets(n_rows: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, (n_rows, seq), generator=gen)
    targets[torch.rand(n_rows, seq, generator=gen) < 0.4] = IGNORE_INDEX
    targets[1] = IGNORE_INDEX  # a fully masked row
    return targets


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk", [4, 1000])
def test_chunked_loss_with_ignored_targets_equals_plain(reduction: str, chunk: int):
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = _masked_targets(3, 11, 50, seed=8)
    results = []
    for loss_fn in (
        lambda: cross_entropy(hidden @ weight.t(), targets, reduction=reduction),
        lambda: chunked_cross_entropy(
            hidden, weight, targets, chunk_size=chunk, reduction=reduction
        ),  # fmt: skip
    ):
        loss = loss_fn()
        (loss * 3.0).backward()  # a non-unit incoming gradient (accumulation, loss scaling)
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    (plain, plain_gh, plain_gw), (chunked, chunked_gh, chunked_gw) = results
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked_gh, plain_gh, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked_gw, plain_gw, atol=1e-6, rtol=1e-6)
    assert chunked_gh[1].abs().sum() == 0  # the fully masked row trains nothing
    trained = targets != IGNORE_INDEX
    assert num_targets(targets).item() == trained.sum().item() > 0
    per_token = _token_losses(hidden.detach() @ weight.detach().t(), targets)
    expected = per_token.sum() / (trained.sum() if reduction == "mean" else 1)
    torch.testing.assert_close(chunked, expected, atol=1e-6, rtol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(
            chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk, reduction=reduction),
            plain, atol=1e-6, rtol=1e-6,
        )  # fmt: skip


def test_nothing_trained_sums_to_zero_with_zero_gradients():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    targets = torch.full((6,), IGNORE_INDEX)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=4, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and num_targets(targets).item() == 0
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0
    assert cross_entropy(hidden[None] @ weight.t(), targets[None], reduction="sum").item() == 0


# FlexAttention: the same mask as a BlockMask.


def _flex_matches_dense(device: str) -> None:
    gen = torch.Generator().manual_seed(9)
    doc_ids = torch.stack([_pack(_examples(1))["doc_ids"][0], _pack(_examples(2))["doc_ids"][0]])
    q, k, v = (torch.randn(2, h, SEQ, 16, generator=gen).to(device) for h in (4, 2, 2))
    doc_ids = doc_ids.to(device)
    flex = attend(q, k, v, build_attention_mask(doc_ids, flex=True), enable_gqa=True)
    dense = attend(q, k, v, build_attention_mask(doc_ids, flex=False), enable_gqa=True)
    assert torch.isfinite(flex).all()
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_block_mask_equals_the_dense_mask_on_cpu():
    _flex_matches_dense("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_dim", [16, 8])
def test_packed_rows_on_cuda_match_each_document_alone(head_dim):
    """On CUDA the model's document mask is a FlexAttention BlockMask where the flex kernel
    takes the head size (>= 16), the dense mask below it (the kernel refuses 8: seen on an
    H200); either way each document's loss equals that document run alone."""
    if head_dim >= FLEX_MIN_HEAD_DIM:
        _flex_matches_dense("cuda")
    model = _llama(ModelArgs(dim=4 * head_dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                             vocab_size=VOCAB, max_seq_len=32))  # fmt: skip
    examples = _examples(0)
    batch = _pack(examples)
    alone_losses, _ = _alone(model, examples)
    model.cuda()
    mask = build_attention_mask(batch["doc_ids"].cuda(), head_dim=head_dim)
    assert isinstance(mask, BlockMask) == (head_dim >= FLEX_MIN_HEAD_DIM)
    with torch.no_grad():
        torch.backends.cuda.matmul.allow_tf32 = False
        cuda = {k: v.cuda() for k, v in batch.items()}
        logits = model(cuda["tokens"], positions=cuda["positions"], doc_ids=cuda["doc_ids"])
        per_token = _token_losses(logits, cuda["targets"]).cpu()[0]
    per_doc = torch.stack([per_token[batch["doc_ids"][0] == i].sum() for i in range(3)])
    torch.testing.assert_close(per_doc, alone_losses, atol=1e-4, rtol=1e-4)


def test_flex_only_where_its_kernel_runs():
    doc_ids = torch.tensor([[0, 0, 1, 1]])
    assert isinstance(build_attention_mask(doc_ids), torch.Tensor)  # CPU: dense, any head size
    assert isinstance(build_attention_mask(doc_ids, head_dim=64), torch.Tensor)
    assert use_flex("cuda", head_dim=None) and use_flex("cuda", head_dim=FLEX_MIN_HEAD_DIM)
    assert not use_flex("cuda", head_dim=FLEX_MIN_HEAD_DIM - 8)
    assert not use_flex("cpu", head_dim=128) and not use_flex("npu", head_dim=128)


# FSDP2 at world 2 (gloo): one forward/backward of packed rows equals one process.


def _fsdp_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    """One forward/backward of this rank's packed row under FSDP2, in the session's gloo pool
    (tests/gloo_pool.py): the ranks' losses and the full gradients."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = _llama()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    batch = _two_rows()
    mine = {k: v[rank : rank + 1] for k, v in batch.items()}
    head = functools.partial(chunked_cross_entropy, targets=mine["targets"], chunk_size=8,
                             reduction="sum")  # fmt: skip
    loss = model(mine["tokens"], head=head, positions=mine["positions"], doc_ids=mine["doc_ids"])
    loss.backward()  # FSDP averages the gradients over the 2 ranks
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    del model  # its device mesh before the pool's next task (tests/gloo_pool.py collects)
    return {"losses": torch.stack(losses), "grads": grads}


def _two_rows() -> dict[str, torch.Tensor]:
    rows = [_pack(_examples(10)), _pack(_examples(11)[:2])]
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def test_fsdp2_at_world_2_gives_the_single_process_gradients(gloo_pool):
    got, _ = gloo_pool.submit(_fsdp_rank)
    model = _llama()
    batch = _two_rows()
    losses = []
    for r in range(2):
        row = {k: v[r : r + 1] for k, v in batch.items()}
        logits = model(row["tokens"], positions=row["positions"], doc_ids=row["doc_ids"])
        losses.append(cross_entropy(logits, row["targets"], reduction="sum"))
    (torch.stack(losses).sum() / 2).backward()
    torch.testing.assert_close(got["losses"], torch.stack(losses).detach(), atol=TOL, rtol=TOL)
    _assert_grads_close(got["grads"], _grads(model))
