"""The chunked cross-entropy (`train.loss=chunked`) against the plain loss: same loss and same
gradients (fp32, 1e-6), for the built-in Llama with and without tied embeddings, and for a
HuggingFace model through its wrapper; and it never holds the whole logits."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from fsdprun.loss import chunked_cross_entropy, cross_entropy
from fsdprun.models.llama import ModelArgs, Transformer


def _llama(tie: bool, vocab: int = 300) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=vocab,
                     max_seq_len=32, tie_embeddings=tie)  # fmt: skip
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # large enough that the softmax is far from uniform
    return model


def _loss_and_grads(model, tokens, targets, head):
    model.zero_grad(set_to_none=True)
    hidden = []

    def keep(module, inputs, out):
        out.retain_grad()
        hidden.append(out)

    handle = model.norm.register_forward_hook(keep) if hasattr(model, "norm") else None
    loss = cross_entropy(model(tokens), targets) if head is None else model(tokens, head=head)
    (loss * 3.0).backward()  # a non-unit incoming gradient, as accumulation and loss scaling give
    if handle is not None:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, hidden[0].grad if hidden else None


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [7, 64, 1000])  # uneven, even, one chunk
def test_chunked_loss_equals_plain_loss_and_gradients(tie: bool, chunk: int):
    model = _llama(tie)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (3, 21), generator=gen)
    targets = torch.randint(0, 300, (3, 21), generator=gen)
    loss, grads, hidden_grad = _loss_and_grads(model, tokens, targets, None)
    head = functools.partial(chunked_cross_entropy, targets=targets, chunk_size=chunk)
    c_loss, c_grads, c_hidden_grad = _loss_and_grads(model, tokens, targets, head)
    assert loss.item() > 1.0
    torch.testing.assert_close(c_loss, loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(c_hidden_grad, hidden_grad, atol=1e-6, rtol=1e-6)
    assert grads.keys() == c_grads.keys()
    for name in grads:  # the output weight (or the tied embedding) and every block
        torch.testing.assert_close(c_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(model(tokens, head=head), loss, atol=1e-6, rtol=1e-6)


def test_chunked_loss_under_bf16_matches_the_plain_bf16_loss():
    hidden = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(100, 16, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 100, (40,))
    plain = F.cross_entropy((hidden @ weight.t()).float(), targets)
    plain.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_size=16)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, atol=1e-4, rtol=1e-4)
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad, expected[0], atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(weight.grad, expected[1], atol=2e-3, rtol=2e-2)


def _saved_bytes(fn) -> tuple[int, int]:
    """(sum, largest) bytes of the tensors autograd saves for backward while `fn` runs."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes), max(sizes)


def test_chunked_loss_never_keeps_the_logits():
    tokens, dim, vocab = 2048, 64, 32_000
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    logits_bytes = tokens * vocab * 4
    plain_sum, plain_max = _saved_bytes(
        lambda: F.cross_entropy((hidden @ weight.t()).float(), targets)
    )
    chunk_sum, chunk_max = _saved_bytes(
        lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=256)
    )
    assert plain_max >= logits_bytes  # log-softmax's output: the whole fp32 logits
    # Kept: the gradients of hidden states and weight, nothing of size tokens x vocab.
    assert chunk_sum == (tokens + vocab) * dim * 4
    assert chunk_sum < plain_sum / 10


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_loss_through_the_hf_wrapper(tie: bool):
    transformers = pytest.importorskip("transformers")
    from fsdprun.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=200, max_position_embeddings=32,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HFCausalLM(transformers.LlamaForCausalLM(config))
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 200, (2, 16), generator=gen)
    targets = torch.randint(0, 200, (2, 16), generator=gen)
    loss, grads, _ = _loss_and_grads(model, tokens, targets, None)
    head = functools.partial(chunked_cross_entropy, targets=targets, chunk_size=10)
    c_loss, c_grads, _ = _loss_and_grads(model, tokens, targets, head)
    torch.testing.assert_close(c_loss, loss, atol=1e-6, rtol=1e-6)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_chunked_loss_refuses_an_hf_model_with_logit_soft_capping():
    transformers = pytest.importorskip("transformers")
    from fsdprun.errors import UserError
    from fsdprun.models.hf import HFCausalLM

    config = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, final_logit_softcapping=30.0,
    )  # fmt: skip
    model = HFCausalLM(transformers.Gemma2ForCausalLM(config))
    with pytest.raises(UserError, match="final_logit_softcapping.*train.loss=plain"):
        model.output_weight()


def test_plan_counts_the_chunked_loss_instead_of_the_logits():
    from fsdprun.config import load_recipe
    from fsdprun.engines.activations import loss_bytes
    from fsdprun.tools.plan import plan_recipe

    big = ["model.vocab_size=32000", "precision.param_dtype=fp32", "train.micro_batch_size=8",
           "launch.nproc_per_node=1"]  # fmt: skip
    chunk = ["train.loss=chunked", "train.loss_chunk_size=32"]
    plain = plan_recipe("debug", big)
    chunked = plan_recipe("debug", [*big, *chunk])
    cfg = load_recipe("debug", [*big, *chunk]).config
    tokens = cfg.train.seq_len * cfg.train.micro_batch_size
    logits = tokens * 32000 * 4
    saved = (tokens + 32000) * cfg.model.dim * 4  # measured above (fp32)
    assert saved <= loss_bytes(cfg) < logits
    drop = plain.strategies["full"].activations - chunked.strategies["full"].activations
    assert drop > logits / 2
    assert any(n.startswith("loss: chunked (32 tokens") for n in chunked.notes)


def test_compiled_chunk_kernels_give_the_eager_loss_and_gradients():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(80, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 80, (50,), generator=gen)
    results = []
    for compiled in (False, True):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=20, compiled=compiled)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
