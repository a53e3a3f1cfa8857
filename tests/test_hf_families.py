"""HuggingFace families (tests/hf_families.py: Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3,
Phi-3, Qwen3-MoE) train and export exactly as transformers computes them.

For each family's tiny random folder, fsdprun trains the debug recipe (fp32, gradient
accumulation, warm-up then cosine, clipping at 1.0) for 3 steps: synthetic data on 2 ranks,
packed chat rows under hybrid sharding on 2 ranks, padded chat rows with full activation
checkpointing on 1 rank (all in the session's gloo pools, tests/gloo_pool.py).
Its losses must equal, within 1e-5, those of an independent plain loop: transformers' own model
loaded from the same folder, `torch.optim.AdamW`, torch's clipping, the same samples. The 2-rank
checkpoint's `export --format hf` must load in transformers and give fsdprun's logits.
Run with `pytest tests/test_hf_families.py`.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import Run, consolidate, run_fsdprun
from hf_families import FAMILIES
from typer.testing import CliRunner

from fsdprun.checkpoint.export import export_checkpoint
from fsdprun.cli import app
from fsdprun.config import ChatTurns, DataConfig, DataSource, load_recipe
from fsdprun.data import IGNORE_INDEX, build_datasets, load_batch
from fsdprun.data.sft_examples import tokenize_examples
from fsdprun.engines.adapters import build_lora_model_on_cpu
from fsdprun.errors import UserError
from fsdprun.models.hf import HFCausalLM
from fsdprun.models.lora import adapter_state_dict, apply_lora, peft_state_dict

transformers = pytest.importorskip("transformers")

TOL = 1e-5
STEPS = 3
TRAIN = (f"train.steps={STEPS}", "output.log_every=1")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process references on one thread, as each rank computes: the tiny models' ops
    gain nothing from more, whose waiting threads spin (the packed rows' reference, 2 busy
    cores: 3.8 -> 0.5 CPU s a run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    )


def _forward(model, batch) -> torch.Tensor:
    """transformers' logits of a batch; of fine-tuning rows, each document (and each row's
    padding) forwarded alone: rows of several documents, cut where doc_ids change."""
    if batch.doc_ids is None:
        return model(input_ids=batch.inputs).logits
    rows = []
    for tokens, docs in zip(batch.inputs, batch.doc_ids, strict=True):
        lengths = torch.unique_consecutive(docs, return_counts=True)[1].tolist()
        rows.append(torch.cat([_alone(model, doc) for doc in tokens.split(lengths)]))
    return torch.stack(rows)


def _alone(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits of one document, as a fresh model gives them: its `dynamic` rope
    keeps the longest input it has seen (a cache for generation) and would apply it to the
    shorter documents after."""
    rotary = model.get_decoder().rotary_emb
    if getattr(rotary, "rope_type", None) == "dynamic":
        rotary.max_seq_len_cached = rotary.original_max_seq_len
        rotary.inv_freq = rotary.original_inv_freq.clone()
    return model(input_ids=tokens[None]).logits[0]


def _reference_losses(
    folder, *overrides: str, model=None, micro_batches: bool = False
) -> list[float]:
    """The debug recipe's 3 steps as a plain loop over transformers' model (or `model`, such as
    peft's around it): the global batch in one forward, token-mean cross entropy (over the
    trained targets), clip_grad_norm_, AdamW with decay on matrices only, linear warm-up then
    cosine to min_lr_ratio (the schedule docs/recipes.md describes).
    `micro_batches`: a forward per micro-batch instead (rows 2k, 2k + 1: the debug recipe's
    micro-batches on 1 and 2 ranks alike), whose loss is the one transformers returns with the
    labels (its router's auxiliary loss included where the config enables it), weighted by the
    micro-batch's share of the step's trained targets."""
    cfg = load_recipe("debug", [f"model.hf_path={folder}", *TRAIN, *overrides]).config
    model = (model or _load_hf(folder)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
    )  # fmt: skip
    sched, total = cfg.schedule, cfg.train.steps

    def lr_factor(step: int) -> float:
        if step < sched.warmup_steps:
            return (step + 1) / sched.warmup_steps
        progress = min(1.0, (step - sched.warmup_steps) / max(1, total - sched.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * cosine

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    vocab = model.config.vocab_size
    data, _ = build_datasets(cfg.data, vocab_size=vocab, seq_len=cfg.train.seq_len, seed=0)
    batch_size = cfg.train.global_batch_size
    losses = []
    for step in range(total):
        batch = load_batch(data, range(step * batch_size, (step + 1) * batch_size), "cpu")
        if micro_batches:
            loss = _micro_batched_loss(model, batch, cfg.train.micro_batch_size)
        else:
            logits = _forward(model, batch)
            loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(),
                                   ignore_index=IGNORE_INDEX)  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# Chat rows of the shipped chat.jsonl's single-turn conversations (byte tokenizer: 257 tokens;
# 52 to 88 tokens each), 160 tokens a row: packed (two conversations in most rows, positions
# restarting) and padded (one a row). 4 rows a step, one a micro-batch: 2 accumulated on each
# of 2 ranks, 4 on 1.
DATA = Path(__file__).parent.parent / "recipes" / "data"
CHAT = ("data.source=chat", f"data.tokenizer={DATA / 'tiny-llama-hf'}", "train.seq_len=160",
        "train.global_batch_size=4", "train.micro_batch_size=1")  # fmt: skip


@pytest.fixture(scope="module")
def single_turn_chats(tmp_path_factory) -> Path:
    """The shipped chat.jsonl's conversations of one user and one assistant message."""
    path = tmp_path_factory.mktemp("chats") / "single-turn.jsonl"
    lines = (DATA / "chat.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if len(json.loads(line)["messages"]) == 2))
    return path


@pytest.fixture(scope="module")
def chat_folders(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny folder with the byte tokenizer's 257 embeddings, for the chat rows."""
    from hf_families import save_tiny_hf

    root = tmp_path_factory.mktemp("chat")
    return {family: save_tiny_hf(family, root / family, vocab_size=257) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_equals_transformers_on_1_and_2_ranks(
    family, hf_family_dirs, chat_folders, gloo_pool, gloo_pool_1, single_turn_chats
):
    """Three runs of the family, each against the plain loop over transformers' model (1e-5 at
    every step): the debug recipe's synthetic rows on 2 ranks (full sharding; its checkpoint is
    the export test's); chat rows packed, on 2 ranks under hybrid sharding (2 replicas of 1
    shard: their all-reduce, the HF weights read by each replica); chat rows padded, on 1 rank
    (4 micro-batches accumulated) with full activation checkpointing. The chat rows' reference
    forwards each conversation alone (the padding apart), trained on the assistant tokens only:
    the document boundaries and the 16-token windows (Gemma's on every other layer) cut
    attention inside the packed rows as the documents alone have it."""
    folder = hf_family_dirs[family]
    two = gloo_pool.train(*TRAIN, f"model.hf_path={folder}")
    assert two.start["weights"] == f"pretrained, read from {folder}"
    _assert_losses(two, _reference_losses(folder), family)

    chat = chat_folders[family]
    reference = _load_hf(chat)  # read once; each variant trains a copy
    rows = (*CHAT, f"data.paths=[{single_turn_chats}]")
    variants = {  # pool, the rows, the engine's knobs (no test reads these runs' checkpoints)
        "packed": (gloo_pool, "data.pack=true", "fsdp.sharding=hybrid", "fsdp.shard_group_size=1"),
        "padded": (gloo_pool_1, "data.pack=false", "activation_checkpointing.mode=full"),
    }
    runs = {}
    for name, (pool, pack, *knobs) in variants.items():
        cfg = load_recipe("debug", [f"model.hf_path={chat}", *rows, pack]).config
        data, _ = build_datasets(cfg.data, vocab_size=257, seq_len=160, seed=0)
        doc_ids = load_batch(data, range(cfg.train.global_batch_size), "cpu").doc_ids
        # What the rows hold: several conversations a row, or one and padding (doc id -1).
        assert (doc_ids.max() >= 1) if name == "packed" else (doc_ids.min() == -1), doc_ids
        runs[name] = pool.train(*TRAIN, f"model.hf_path={chat}", *rows, pack, *knobs,
                                "checkpoint.save_final=false")  # fmt: skip
        expected = _reference_losses(chat, *rows, pack, model=copy.deepcopy(reference))
        _assert_losses(runs[name], expected, (family, name))
    assert runs["packed"].start["mesh"] == [["replicate", 2], ["shard", 1]], runs["packed"].start
    assert runs["padded"].start["activation_checkpointing"] == "full (2 blocks)"
    assert runs["padded"].start["grad_accum_steps"] == 4


@pytest.mark.parametrize(("family", "rope_type"), [("phi3", "longrope"), ("llama", "dynamic")])
def test_packed_rows_take_each_documents_own_rope_factors(
    family, rope_type, gloo_pool, single_turn_chats, tmp_path
):
    """A folder whose rope factors transformers chooses from the input's length (Phi-3's
    longrope: the short or the long factors; dynamic NTK: the base), changing at 64 tokens,
    among the conversations' 52 to 88: packed rows of 160 tokens train on 2 ranks as
    transformers trains each conversation alone (1e-5 at every step), each with the factors of
    its own length. Before, the row's length chose for all of them: the long factors (the
    scaled base) for a short conversation packed beside another (1.2e-2 off). Phi-3 (the
    issue's case) through `fsdprun train`, dynamic in the session's 2-rank group."""
    from hf_families import rope_scaling, save_tiny_hf

    folder = save_tiny_hf(family, tmp_path / family, vocab_size=257,
                          **rope_scaling(rope_type, 64))  # fmt: skip
    rows = (*CHAT, f"data.paths=[{single_turn_chats}]", "data.pack=true")
    cfg = load_recipe("debug", [f"model.hf_path={folder}", *rows]).config
    data, _ = build_datasets(cfg.data, vocab_size=257, seq_len=160, seed=0)
    doc_ids = load_batch(data, range(cfg.train.global_batch_size), "cpu").doc_ids
    sizes = [torch.bincount(row[row >= 0]) for row in doc_ids]
    # A row packs a conversation within 64 tokens beside one past them.
    assert any(n.min() <= 64 < n.max() for n in sizes), sizes
    overrides = (*TRAIN, f"model.hf_path={folder}", *rows, "checkpoint.save_final=false")
    if rope_type == "longrope":
        proc = run_fsdprun("train", "debug", *overrides, "--nproc-per-node", "2", "--run-dir",
                           str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
        run = Run(proc, tmp_path / "run").check()
    else:
        run = gloo_pool.train(*overrides)
    _assert_losses(run, _reference_losses(folder, *rows), (family, rope_type))


def test_per_document_longrope_compiles_to_one_graph(tmp_path):
    """transformers' longrope compiles to one graph (`compile.per_block=false
    compile.fullgraph=true`), and so do fsdprun's per-document factors, which every forward of
    such a folder takes: plain and packed rows, the eager logits (dynamo's eager backend: the
    graph, not Inductor's code)."""
    from hf_families import rope_scaling, save_tiny_hf

    folder = save_tiny_hf("phi3", tmp_path / "phi3", **rope_scaling("longrope", 32))
    model = HFCausalLM.from_folder(folder).eval()
    lengths = (40, 24)
    tokens = torch.randint(3, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    for rows in ({}, {"positions": positions, "doc_ids": doc_ids}):
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
        with torch.no_grad():
            assert torch.equal(compiled(tokens, **rows), model(tokens, **rows))


def _assert_losses(run, expected: list[float], what) -> None:
    assert len(run.losses) == STEPS
    diff = max(abs(a - b) for a, b in zip(run.losses, expected, strict=True))
    assert diff < TOL, (what, run.losses, expected)


def _micro_batched_loss(model, batch, size: int) -> torch.Tensor:
    """The step's loss from transformers' own `.loss` of each micro-batch of `size` rows
    (`shift_labels`: the targets are already the next tokens; padded rows: the 2-D attention
    mask of their tokens), weighted by its trained targets."""
    total = (batch.targets != IGNORE_INDEX).sum()
    real = None if batch.doc_ids is None else (batch.doc_ids >= 0).long()
    loss = torch.zeros(())
    for k in range(0, len(batch.inputs), size):
        targets = batch.targets[k : k + size].contiguous()  # transformers .view()s it
        mask = None if real is None else real[k : k + size]
        out = model(input_ids=batch.inputs[k : k + size], attention_mask=mask, labels=targets,
                    shift_labels=targets)  # fmt: skip
        loss = loss + out.loss * (targets != IGNORE_INDEX).sum() / total
    return loss


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_export_loads_in_transformers_with_fsdprun_logits(
    family, hf_family_dirs, gloo_pool, tmp_path
):
    folder = hf_family_dirs[family]
    run = gloo_pool.train(*TRAIN, f"model.hf_path={folder}")  # the 2-rank run above
    ckpt = run.run_dir / "checkpoints" / f"step-{STEPS:08d}"
    # In-process (the command itself is covered by test_inspect_export): a subprocess costs ~3 s.
    export_checkpoint(ckpt, tmp_path / "hf", fmt="hf")
    exported = _load_hf(tmp_path / "hf").eval()
    # fsdprun's own model of the folder holding the checkpoint's weights (DCP's consolidation).
    trained = consolidate(ckpt, tmp_path / "full.pt")["model"]
    model = HFCausalLM.from_folder(folder).eval()
    model.load_state_dict(trained)
    original = _load_hf(folder)
    assert not torch.equal(original.lm_head.weight, exported.lm_head.weight)  # trained ones
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens) - exported(input_ids=tokens).logits).abs().max().item()
    assert diff < TOL, (family, diff)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_cut_attention_at_documents_and_windows_as_transformers(family, hf_family_dirs):
    # transformers takes fsdprun's 4-D mask of packed rows as it is: the sliding windows (16
    # tokens here, Gemma's on every other layer) must be in it, and eager attention (Gemma 2)
    # adds it to the scores. Reference: transformers' forward of each document alone.
    reference = _load_hf(hf_family_dirs[family]).eval()
    model = HFCausalLM(reference)  # the same weights, through fsdprun's inputs
    lengths = (40, 24)  # both longer than the window
    tokens = torch.randint(3, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions=positions, doc_ids=doc_ids)
        alone = torch.cat(
            [reference(input_ids=doc).logits for doc in tokens.split(lengths, dim=1)], dim=1
        )
    diff = (packed - alone).abs().max().item()
    assert diff < TOL, (family, diff)


def test_buffers_that_transformers_cannot_fill_are_refused_in_one_line(hf_family_dirs):
    # After `to_empty` the non-persistent buffers hold garbage: those transformers' own
    # _init_weights fills (Gemma's embedding scale) are filled, any other is refused.
    from fsdprun.errors import UserError

    with torch.device("meta"):
        model = HFCausalLM.from_folder(hf_family_dirs["gemma3_text"])
        model.hf.model.norm.register_buffer("extra", torch.ones(2), persistent=False)
    model.to_empty(device="cpu")
    with pytest.raises(UserError, match=r"^model.hf_path: cannot initialize the buffers of "
                       r"hf.model.norm \(Gemma3RMSNorm\): extra$"):  # fmt: skip
        model.init_buffers(torch.device("cpu"))
    del model.hf.model.norm.extra
    model.init_buffers(torch.device("cpu"))
    assert model.hf.model.embed_tokens.embed_scale.item() == pytest.approx(64**0.5)


# Per layer, by hand from tests/hf_families.py (hidden 64, 4 query and 2 kv heads, MLP 128):
# q and o are 64 x (4 x head_dim), k and v 64 x (2 x head_dim).
def _attention(head_dim: int) -> int:
    return 2 * 64 * 4 * head_dim + 2 * 64 * 2 * head_dim


@pytest.mark.parametrize(
    ("family", "extra", "matmul", "width"),
    [
        # head_dim 32: q·k and attention·v span 4 x 32 = 128, not the hidden size 64.
        ("qwen3", {"head_dim": 32}, 2 * (_attention(32) + 3 * 64 * 128) + 256 * 64, 128),
        # Tied: the output projection multiplies each token once; the table lookup does not.
        ("gemma3_text", {"head_dim": 32}, 2 * (_attention(32) + 3 * 64 * 128) + 256 * 64, 128),
        # The router (4 experts) and 2 active experts' gate, up and down (32 wide) of 4.
        ("qwen3_moe", {}, 2 * (_attention(16) + 4 * 64 + 2 * 3 * 32 * 64) + 256 * 64, 64),
    ],
)
def test_flops_per_token_follow_the_family(tmp_path, family, extra, matmul, width):
    """The MFU's FLOPs per token, 6 x the weights each token multiplies + 12 x layers x the
    attention's width x seq_len, counted by hand from the config (config.json alone: no weights
    are read). Before, the attention term read the hidden size (64 here, not 128)."""
    from hf_families import tiny_config

    from fsdprun.models.hf import SPEC

    tiny_config(family, **extra).save_pretrained(tmp_path)
    cfg = load_recipe("debug", [f"model.hf_path={tmp_path}"]).config.model
    assert SPEC.flops_per_token(cfg, 64) == 6 * matmul + 12 * 2 * width * 64


def test_the_router_auxiliary_loss_trains_as_transformers_adds_it(
    tmp_path_factory, gloo_pool, gloo_pool_1
):
    """A mixture of experts whose config.json enables the router's auxiliary loss
    (`output_router_logits: true`, coef 0.1 here): on the debug recipe's rows on 2 ranks (2
    micro-batches a rank) and on padded chat rows on 1 (4 micro-batches), fsdprun's losses are
    those of transformers' model forwarding the same micro-batches (padded rows: with their 2-D
    attention mask), each loss as transformers returns it (coef x its load-balancing loss
    added), weighted by the micro-batch's trained targets (1e-5 at every step). Before, such a
    folder was refused."""
    from hf_families import save_tiny_hf

    root = tmp_path_factory.mktemp("router")
    folder = save_tiny_hf("qwen3_moe", root / "moe", vocab_size=257, output_router_logits=True,
                          router_aux_loss_coef=0.1)  # fmt: skip
    reference = _load_hf(folder)
    expected = _reference_losses(folder, model=copy.deepcopy(reference), micro_batches=True)
    # The auxiliary loss is in them: the folder's losses without it differ.
    reference.config.output_router_logits = False
    without = _reference_losses(folder, model=copy.deepcopy(reference), micro_batches=True)
    reference.config.output_router_logits = True
    assert abs(without[0] - expected[0]) > 1e-2, (without, expected)
    padded = (*CHAT, f"data.paths=[{DATA / 'chat.jsonl'}]", "data.pack=false")
    cases = [(gloo_pool, (), expected),
             (gloo_pool_1, padded, _reference_losses(folder, *padded, model=reference,
                                                     micro_batches=True))]  # fmt: skip
    for pool, rows, losses in cases:
        run = pool.train(*TRAIN, f"model.hf_path={folder}", *rows, "checkpoint.save_final=false")
        diff = max(abs(a - b) for a, b in zip(run.losses, losses, strict=True))
        assert diff < TOL, (pool.world, rows, run.losses, losses)


# What each family's published template writes before and after an assistant message's content:
# the reference trains the tokens from the end of the one through the end of the other.
ASSISTANT_TURN = {
    "llama": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen2": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    "mistral": ("[/INST]", "</s>"),
    "gemma2": ("<start_of_turn>model\n", "<end_of_turn>\n"),
    "gemma3_text": ("<start_of_turn>model\n", "<end_of_turn>\n"),
    "phi3": ("<|assistant|>\n", "<|end|>\n"),
    "qwen3_moe": ("<|im_start|>assistant\n", "<|im_end|>\n"),
}
CONVERSATIONS = {
    "turns": [("user", "hi there"), ("assistant", "hello!"), ("user", "2+2?"),
              ("assistant", "<think>\nadd them\n</think>\n\n4")],
    "system": [("system", "be brief"), ("user", "hi"), ("assistant", " hello \n")],
    "opening": [("assistant", "How can I help?"), ("user", "say hi"), ("assistant", "hi")],
}  # fmt: skip
# The conversations a template cannot train on, and the one line that says so.
ALTERNATE = "the chat template of .* refused it: .*roles must alternate"
REFUSED = {
    ("gemma2", "system"): "the chat template of .* refused it: System role not supported",
    ("gemma2", "opening"): ALTERNATE,
    ("gemma3_text", "opening"): ALTERNATE,
    ("mistral", "opening"): ALTERNATE,
    # Mistral renders the system message into the last user message only: not into a
    # conversation that ends with the assistant, whose first messages do have it.
    ("mistral", "system"): "places the system message by what follows it: remove the system",
    # Qwen3 drops earlier turns' reasoning once a later user message follows (the last turn
    # renders an empty <think> block, earlier ones none): only the last turn can train.
    ("qwen3", "turns", "all"): r"train the last assistant turn only \(data.chat_turns=last\)",
    ("qwen3_moe", "turns", "all"): r"train the last assistant turn only \(data.chat_turns=last\)",
}


def _chat_reference(tokenizer, messages, turn_marks, turns: str):
    """Token ids and trained mask of the conversation as transformers renders it whole: the
    assistant turns found by the family's turn marks in the rendered text (the last one only
    for `last`), mapped to tokens by their character offsets."""
    header, closing = turn_marks
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, at = [], 0
    while (start := text.find(header, at)) >= 0:
        start += len(header)
        at = text.index(closing, start) + len(closing)
        spans.append((start, at))
    spans = spans if turns == "all" else spans[-1:]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids == encoded["input_ids"]
    mask = [any(s <= a and b <= e for s, e in spans) for a, b in encoded["offset_mapping"]]
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_rows_train_the_assistant_turns_as_the_family_template_renders_them(
    family, hf_family_dirs, tmp_path
):
    # The family's own template in its folder's tokenizer_config.json (tests/hf_families.py),
    # through the data path of `data.source: chat`: token by token, the whole conversation as
    # transformers' apply_chat_template renders it, trained exactly on the assistant turns.
    folder = hf_family_dirs[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for name, conv in CONVERSATIONS.items():
        messages = [{"role": r, "content": c} for r, c in conv]
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"messages": messages}) + "\n")
        for turns in ("all", "last"):
            cfg = DataConfig(source=DataSource.chat, paths=[str(path)], tokenizer=str(folder),
                             chat_turns=ChatTurns(turns))  # fmt: skip
            refusal = REFUSED.get((family, name)) or REFUSED.get((family, name, turns))
            if refusal:
                with pytest.raises(UserError, match=refusal):
                    tokenize_examples(cfg.paths, cfg, key="data.paths")
                continue
            examples, _ = tokenize_examples(cfg.paths, cfg, key="data.paths")
            ids, mask = _chat_reference(tokenizer, messages, ASSISTANT_TURN[family], turns)
            assert examples.tokens.tolist() == ids, (family, name)
            assert examples.mask.astype(bool).tolist() == mask, (family, name, turns)
            assert any(mask)


def test_a_system_message_gemma_2_refuses_is_one_line_before_anything_is_written(
    hf_family_dirs, tmp_path
):
    path = tmp_path / "c.jsonl"
    conv = [("system", "be brief"), ("user", "hi"), ("assistant", "hello")]
    record = {"messages": [{"role": r, "content": c} for r, c in conv]}
    path.write_text(json.dumps(record) + "\n")
    result = CliRunner().invoke(app, [
        "prepare-data", str(path), "--out", str(tmp_path / "p"), "--source", "chat",
        "--tokenizer", str(hf_family_dirs["gemma2"]),
    ])  # fmt: skip
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("refused it: System role not supported"), lines
    assert not (tmp_path / "p").exists()


LORA = ("lora.rank=4", "lora.alpha=8")
# fsdprun's LoRA groups (fsdprun/families.py) and peft's targets for the same layers: every Linear
# of the blocks, or a mixture of experts' attention (peft would adapt its experts and router too,
# which fsdprun refuses).
LORA_TARGETS = {"qwen3_moe": ("[attention]", ["q_proj", "k_proj", "v_proj", "o_proj"])}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_on_attention_and_mlp_equals_peft_and_its_exports_load(
    family, hf_family_dirs, gloo_pool, tmp_path
):
    # fsdprun's LoRA on the family's attention and MLP projections (Phi-3's fused qkv_proj and
    # gate_up_proj as they are), 3 steps on 2 gloo ranks, against peft's LoRA on every Linear of
    # the blocks ("all-linear"; the attention of a mixture of experts) of transformers' model,
    # started from fsdprun's initial adapters, in the plain loop above. Then both exports of the
    # run's checkpoint load: the merged one in transformers, the adapters in peft, with the
    # same logits.
    overrides = _lora_overrides(family, hf_family_dirs[family])
    run = gloo_pool.train(*overrides)
    expected = _peft_losses(family, hf_family_dirs[family], overrides)
    diff = max(abs(a - b) for a, b in zip(run.losses, expected, strict=True))
    assert len(run.losses) == STEPS and diff < TOL, (family, run.losses, expected)
    _assert_lora_exports_load(run, hf_family_dirs[family], tmp_path)


def _lora_overrides(family: str, folder: Path) -> tuple[str, ...]:
    targets, _ = LORA_TARGETS.get(family, ("[attention,mlp]", "all-linear"))
    return (*TRAIN, f"model.hf_path={folder}", *LORA, f"lora.targets={targets}")


def _peft_losses(family: str, folder: Path, overrides: tuple[str, ...]) -> list[float]:
    """The plain loop's losses over peft's LoRA of transformers' model (every Linear of the
    blocks, or a mixture of experts' attention), started from fsdprun's initial adapters."""
    peft = pytest.importorskip("peft")
    _, peft_targets = LORA_TARGETS.get(family, ("[attention,mlp]", "all-linear"))
    cfg = load_recipe("debug", list(overrides)).config
    start = adapter_state_dict(build_lora_model_on_cpu(cfg.model, cfg.lora, seed=cfg.train.seed))
    reference = peft.get_peft_model(_load_hf(folder), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=peft_targets))  # fmt: skip
    assert set(peft.get_peft_model_state_dict(reference)) == set(peft_state_dict(start))
    peft.set_peft_model_state_dict(reference, peft_state_dict(start))
    return _reference_losses(folder, model=reference)


def _assert_lora_exports_load(run, folder: Path, tmp_path: Path) -> None:
    """Both exports of the run's last checkpoint load: the merged weights in transformers, the
    adapters in peft over the base folder, with the same logits, which training moved."""
    peft = pytest.importorskip("peft")
    ckpt = run.run_dir / "checkpoints" / f"step-{STEPS:08d}"
    export_checkpoint(ckpt, tmp_path / "merged", fmt="hf")
    export_checkpoint(ckpt, tmp_path / "peft", fmt="peft")
    merged = _load_hf(tmp_path / "merged").eval()
    adapted = peft.PeftModel.from_pretrained(_load_hf(folder), tmp_path / "peft").eval()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = adapted(input_ids=tokens).logits
        diff = (merged(input_ids=tokens).logits - logits).abs().max().item()
        moved = (_load_hf(folder)(input_ids=tokens).logits - logits).abs().max().item()
    assert diff < TOL and moved > 1e-3, (diff, moved)


def test_lora_under_tp_and_cp_equals_peft_and_its_exports_load(hf_family_dirs, gloo_pool, tmp_path):
    """LoRA on the attention and MLP of the HF Llama folder at tp 2 and at cp 2 (the session's 2
    ranks: each run one TP group, or one cp group), against peft's one-rank loop (1e-5 at every
    step); the tp 2 checkpoint's merged export loads in transformers and its adapters in peft.
    Under TP the adapters are split as their Linear is (column-wise: A whole, B by rows;
    row-wise: A by columns, B whole, both partial sums reduced with the base's), and the frozen
    norms stay frozen (torch's SequenceParallel makes every weight it replicates trainable).
    Under CP the adapters, per-token Linears, need nothing. Before, both were refused."""
    overrides = _lora_overrides("llama", hf_family_dirs["llama"])
    expected = _peft_losses("llama", hf_family_dirs["llama"], overrides)
    runs = {p: gloo_pool.train(*overrides, f"parallel.{p}=2") for p in ("tp", "cp")}
    assert runs["tp"].start["mesh"] == [["dp_shard", 1], ["tp", 2]]
    assert runs["cp"].start["mesh"] == [["dp_shard", 1], ["cp", 2]]
    for name, run in runs.items():
        diff = max(abs(a - b) for a, b in zip(run.losses, expected, strict=True))
        assert len(run.losses) == STEPS and diff < TOL, (name, run.losses, expected)
    _assert_lora_exports_load(runs["tp"], hf_family_dirs["llama"], tmp_path)


def test_lora_on_the_mlp_of_a_mixture_of_experts_is_refused_in_one_line(hf_family_dirs):
    with torch.device("meta"):
        model = HFCausalLM.from_folder(hf_family_dirs["qwen3_moe"])
    cfg = load_recipe("debug", [f"model.hf_path={hf_family_dirs['qwen3_moe']}", *LORA,
                                "lora.targets=[attention,mlp]"]).config  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"^lora.targets: mlp: the blocks of model.hf_path's "
        r"qwen3_moe \(Qwen3MoeForCausalLM\) have no Linear layers in their mlp",
    ):
        apply_lora(model, cfg=cfg.lora)


def test_the_default_lora_targets_are_the_attention_fused_projections_included(hf_family_dirs):
    # lora.targets defaults to the group `attention`: Phi-3's fused qkv_proj (its q_proj, the
    # old default, is no layer of it) and o_proj.
    cfg = load_recipe("debug", [f"model.hf_path={hf_family_dirs['phi3']}", *LORA]).config
    with torch.device("meta"):
        model = HFCausalLM.from_folder(hf_family_dirs["phi3"])
    assert apply_lora(model, cfg=cfg.lora) == [
        f"hf.model.layers.{n}.self_attn.{leaf}" for n in (0, 1) for leaf in ("o_proj", "qkv_proj")
    ]
