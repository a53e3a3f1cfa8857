"""Context parallelism (`parallel.cp`, docs/context-parallel.md): the refusals before launch, the
mesh rules, the all-to-all and the ring against whole-row attention (the ring on zig-zag chunks,
with windows and soft-capping, the same work on every rank), and the promise that cp x dp trains
exactly as dp alone and as one rank, plain and packed rows, under TP with either attention, for
every HuggingFace family, and resumes across cp degrees and attentions.

The runs train in the session's persistent 4-rank and 1-rank gloo groups (tests/gloo_pool.py,
shared with tests/test_tp.py and its plain references); the resumes across degrees are
`fsdprun resume` commands on copies of the cp run's folder (through the suite's zygote).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import Run, model_at, run_fsdprun
from hf_families import FAMILIES as HF_TINY_FAMILIES
from typer.testing import CliRunner

import fsdprun.launch.elastic
from fsdprun.cli import app
from fsdprun.config import load_recipe
from fsdprun.config.layout import Layout, cp_impl
from fsdprun.config.model_facts import model_facts
from fsdprun.errors import UserError

FOUR = ["launch.nproc_per_node=4"]
DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"


def errors_of(*overrides: str) -> list[str]:
    with pytest.raises(UserError) as info:
        load_recipe("debug", [*FOUR, *overrides])
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        (["parallel.cp=3"], "parallel.cp (3) must divide the world size (4)"),
        (["parallel.cp=2", "train.seq_len=63"], "parallel.cp (2) does not divide train.seq_len"),
        (["parallel.cp=4", "parallel.cp_impl=alltoall"],
         "parallel.cp (4) does not divide the model's kv heads (2"),
        (["parallel.cp=2", "fsdp.engine=fsdp1"], "parallel.cp=2 with fsdp.engine=fsdp1"),
        (["parallel.cp=2", "precision.float8=rowwise"],
         "parallel.cp=2 with precision.float8=rowwise: its weight gradient's float8 operands"),
        (["parallel.cp=4", "compile.enabled=true", "compile.fullgraph=true"],
         "parallel.cp=4 with parallel.cp_impl=ring (what auto takes for these heads) and "
         "compile.fullgraph=true"),
        (["parallel.cp=2", "parallel.tp=2", "parallel.cp_impl=alltoall"],
         "n_kv_heads / parallel.tp (2) = 1 per TP rank): the all-to-all gives each rank"),
        (["parallel.cp=4", "train.seq_len=36"],
         "parallel.cp=4 with parallel.cp_impl=ring (what auto takes for these heads): 2 x "
         "parallel.cp (8) does not divide train.seq_len (36)"),
        (["parallel.cp=2", "parallel.tp=2", "model.n_kv_heads=4", "train.seq_len=62"],
         "parallel.cp x parallel.tp (2 x 2) does not divide train.seq_len (62)"),
        (["parallel.cp=2", "train.global_batch_size=6", "train.micro_batch_size=2"],
         "data-parallel ranks (2 = world size / (parallel.tp x parallel.cp))"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(overrides, phrase):
    found = [e for e in errors_of(*overrides) if phrase in e]
    assert len(found) == 1, errors_of(*overrides)


def test_hf_folders_are_taken_where_their_family_declares_its_attention(tmp_path):
    """Every family of fsdprun.families declares its attention for cp (tests below train each);
    a model type it does not list is refused naming the declaration, as is a mixture of experts
    whose router's auxiliary loss is on (its per-expert means cannot be taken over slices)."""

    def folder(model_type: str, **extra) -> Path:
        path = tmp_path / model_type  # what the recipe checks read of a folder: its config.json
        path.mkdir()
        config = {"model_type": model_type, "num_attention_heads": 4, "num_key_value_heads": 2}
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        return path

    for model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"):
        load_recipe("debug", [*FOUR, "parallel.cp=2", f"model.hf_path={folder(model_type)}"])
    (line,) = errors_of("parallel.cp=2", f"model.hf_path={folder('olmo2')}")
    assert line.startswith("parallel.cp=2 with model.hf_path's model_type 'olmo2': context "
                           "parallel replaces the attention call, which this family does not "
                           "declare (cp_attention in fsdprun/families.py"), line  # fmt: skip
    moe = folder("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.001)
    (line,) = errors_of("parallel.cp=2", f"model.hf_path={moe}")
    assert line.startswith("parallel.cp=2 with the router's auxiliary loss (config.json's "
                           "output_router_logits: true)"), line  # fmt: skip
    (moe / "config.json").write_text(json.dumps({**json.loads((moe / "config.json").read_text()),
                                                 "output_router_logits": False}))  # fmt: skip
    load_recipe("debug", [*FOUR, "parallel.cp=2", f"model.hf_path={moe}"])
    # HF folders under cp x tp, and the ring where cp does not divide the kv heads (per TP rank).
    llama = tmp_path / "llama"
    load_recipe("debug", [*FOUR, "parallel.cp=2", "parallel.tp=2", f"model.hf_path={llama}"])
    found = errors_of("parallel.cp=4", "parallel.cp_impl=alltoall", f"model.hf_path={llama}")
    assert any("parallel.cp (4) does not divide the model's kv heads (2" in e for e in found)
    load_recipe("debug", [*FOUR, "parallel.cp=4", f"model.hf_path={llama}"])


def test_cli_refuses_before_launch_in_one_line(tmp_path, monkeypatch):
    """One line, exit 2, nothing launched; worded by what the user typed: a ring the user named
    is not "what ring takes for these heads", and its way out names the all-to-all."""

    def must_not_launch(*args, **kwargs):
        raise AssertionError("a bad input reached the launcher")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch", must_not_launch)
    for impl in ("ring", "auto"):  # auto takes the ring for the debug model's 2 kv heads at cp 4
        result = CliRunner().invoke(
            app, ["train", "debug", "parallel.cp=4", "train.seq_len=36", f"parallel.cp_impl={impl}",
                  "--nproc-per-node", "4", "--run-dir", "r"],
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert "does not divide train.seq_len (36): the ring splits each row" in line, line
        assert "choose a train.seq_len that 2 x cp divides" in line, line
        assert ("(what auto takes for these heads)" in line) == (impl == "auto"), line
        assert "(what ring" not in line, line
        assert not Path("r").exists()
        result = CliRunner().invoke(
            app, ["train", "debug", "parallel.cp=4", "compile.enabled=true",
                  "compile.fullgraph=true", f"parallel.cp_impl={impl}", "--nproc-per-node", "4",
                  "--run-dir", "r"],
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert ("or parallel.cp_impl=alltoall with a cp that divides" in line) == (impl == "ring")
        assert ("or a cp that divides" in line) == (impl == "auto"), line
        assert not Path("r").exists()


def test_ring_refuses_an_hf_folder_with_attention_dropout_before_launch(tmp_path, monkeypatch):
    """The ring applies no dropout: a folder whose config.json asks for attention dropout is
    refused in one line before any rank starts (it once reached the ranks' first forward). The
    all-to-all, which keeps transformers' own attention, trains it."""
    launched = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch",
                        lambda *a, **k: launched.append(a) or (lambda *a, **k: {}))  # fmt: skip
    folder = tmp_path / "hf"
    shutil.copytree(Path(__file__).resolve().parents[1] / "recipes/data/tiny-llama-hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    assert config["num_key_value_heads"] == 2  # cp 4 does not divide them: auto takes the ring
    for impl in ("auto", "ring"):
        result = CliRunner().invoke(
            app, ["train", "debug", f"model.hf_path={folder}", "parallel.cp=4",
                  f"parallel.cp_impl={impl}", "--nproc-per-node", "4", "--run-dir", "r"],
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert "parallel.cp=4 with parallel.cp_impl=ring" in line, line
        assert "attention dropout 0.1 (its config.json's attention_dropout)" in line, line
        assert ("(what auto takes for these heads)" in line) == (impl == "auto"), line
        assert ("or parallel.cp_impl=alltoall with a cp" in line) == (impl == "ring"), line
        assert not Path("r").exists() and not launched
    # cp 2 divides the 2 kv heads: auto takes the all-to-all, which keeps the dropout.
    assert load_recipe("debug", [*FOUR, f"model.hf_path={folder}", "parallel.cp=2"])


def test_mesh_puts_cp_between_dp_shard_and_tp_and_fsdp_shards_over_both():
    from fsdprun.data import Batch, BatchLayout

    def cfg(*o):
        return load_recipe("debug", [*FOUR, *o]).config

    cp2 = cfg("parallel.cp=2")
    assert Layout.of(cp2).mesh_dims == [("dp_shard", 2), ("cp", 2)] and Layout.of(cp2).dp == 2
    assert Layout.of(cp2).fsdp_shards == 4  # no duplicate state on the cp ranks
    hybrid = cfg("parallel.cp=2", "fsdp.sharding=hybrid", "fsdp.shard_group_size=1")
    assert Layout.of(hybrid).mesh_dims == [("dp_replicate", 2), ("dp_shard", 1), ("cp", 2)]
    assert Layout.of(hybrid).fsdp_shards == 2
    batches = BatchLayout.of(Layout.of(cp2), cp2.train)
    assert [batches.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    # cp rank j of a data-parallel rank keeps slice j of the sequence, positions included, and
    # the whole row's doc_ids (attention sees whole rows).
    import torch

    layout = BatchLayout(8, 2, 2, cp=2)
    tokens = torch.arange(8).expand(2, -1)
    batch = Batch(tokens, tokens + 1, doc_ids=torch.zeros(2, 8, dtype=torch.long))
    second = layout.local(batch, 3)
    assert layout.data_rank(3) == 1 and second.inputs[0].tolist() == [4, 5, 6, 7]
    assert second.positions[0].tolist() == [4, 5, 6, 7] and second.doc_ids.shape == (2, 8)
    assert layout.reduce_ranks == 4 and layout.num_ranks == 4


# --- the all-to-all attention, in a real gloo group ----------------------------------------------


def _attention_rank(rank: int, world: int) -> dict:
    """Whole-row attention (8 query heads, 4 kv heads: grouped) against the all-to-all's on the
    rank's slice over a cp group of all 4 ranks, plain causal and with a packed row's document
    mask: the outputs and the gradients of q, k and v."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdprun.engines.cp import alltoall_attention
    from fsdprun.models.attention import attend, build_attention_mask

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen) for h in (8, 4, 4))
    grad = torch.randn(2, 8, 16, 8, generator=gen)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 4, [0] * 16])
    part = slice(rank * 16 // world, (rank + 1) * 16 // world)
    cp_attend = alltoall_attention(attend, mesh)
    errors = []
    for mask in (None, build_attention_mask(doc_ids, flex=False)):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        want = attend(*whole, mask, enable_gqa=True)
        (want * grad).sum().backward()
        mine = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
        got = cp_attend(*mine, mask, enable_gqa=True)
        (got * grad[:, :, part]).sum().backward()
        errors.append((got - want[:, :, part]).abs().max().item())
        errors += [(m.grad - w.grad[:, :, part]).abs().max().item()
                   for m, w in zip(mine, whole, strict=True)]  # fmt: skip
    return {"shape": list(got.shape), "errors": errors}


def test_alltoall_attention_equals_whole_row_attention(pools):
    for result in pools[4].submit(_attention_rank):
        assert result["shape"] == [2, 8, 4, 8], result
        assert max(result["errors"]) <= 1e-6, result


def _saved_activations_rank(rank: int, world: int) -> dict:
    """Bytes one forward (and the loss) saves for backward on this rank, without cp on the whole
    row and at cp 4 on its slice (eager fp32, seq 2048: activations dominate), beside what
    `fsdprun plan` counts for each."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdprun.data import Batch
    from fsdprun.engines.activations import activation_bytes
    from fsdprun.engines.cp import apply_cp
    from fsdprun.loss import cross_entropy
    from fsdprun.models import build_model

    seq = 2048
    tokens = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    out = {}
    for cp in (1, world):
        over = [*FOUR, f"parallel.cp={cp}", f"train.seq_len={seq}", f"model.max_seq_len={seq}",
                "model.n_kv_heads=4", "train.micro_batch_size=1"]  # fmt: skip
        cfg = load_recipe("debug", over).config
        model = build_model(cfg.model)
        batch = Batch(tokens[:, :-1], tokens[:, 1:])
        if cp > 1:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
            apply_cp(model, mesh=mesh)
            batch = batch.sequence_shard(rank, cp)
        kept = {p.untyped_storage().data_ptr() for p in [*model.parameters(), model.rope]}
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(batch.inputs, positions=batch.positions)
            loss = cross_entropy(logits, batch.targets, reduction="sum")
        loss.backward()  # every rank takes part in the all-to-all's backward
        out[cp] = (sum(n for ptr, n in saved.items() if ptr not in kept), activation_bytes(cfg))
    return out


def test_activations_fall_by_cp_as_plan_counts(pools):
    """At cp 4 a rank saves about a quarter of the activations one rank saves for the whole row
    (measured with saved_tensors_hooks), and each figure is within 10% of `fsdprun plan`'s."""
    for result in pools[4].submit(_saved_activations_rank):
        (whole, plan_whole), (mine, plan_mine) = result[1], result[4]
        assert mine == pytest.approx(whole / 4, rel=0.1), result
        assert whole == pytest.approx(plan_whole, rel=0.1), result
        assert mine == pytest.approx(plan_mine, rel=0.1), result


# --- training: cp x dp against dp and one rank ----------------------------------------------------
# As tests/test_tp.py: 4 kv heads (cp 4 divides them), 3 steps of one-sequence micro-batches,
# checkpoints at steps 2 and 3, optim.eps=1e-4 (so the parameters compare the gradients to 1e-5).
COMMON = ("model.n_kv_heads=4", "train.steps=3", "train.micro_batch_size=1", "output.log_every=1",
          "checkpoint.every_steps=2", "schedule.warmup_steps=1", "optim.eps=1e-4")  # fmt: skip
LAST = 3
TOL = 1e-5


@pytest.fixture(scope="module")
def pools(gloo_pool_4, gloo_pool_1):
    """The session's 4- and 1-rank groups (tests/conftest.py): tests/test_tp.py trains the same
    plain references (dp 4 and one rank, the same COMMON) in them, each once."""
    return {4: gloo_pool_4, 1: gloo_pool_1}


@pytest.fixture(scope="module")
def cp_run(pools) -> Run:
    """cp 2 x dp 2 with activation checkpointing (the all-to-all is recomputed in backward) and
    2 micro-steps, trained by the worker's own loop in the session's 4-rank group (the resumes
    below are `fsdprun resume` commands on copies of its folder)."""
    return pools[4].train(*COMMON, "parallel.cp=2", "activation_checkpointing.mode=full")


def _ckpt(run, step: int) -> Path:
    from fsdprun.checkpoint import step_dir

    return step_dir(run.run_dir, step)


def _assert_same(run, ref, tmp: Path, *, steps=(1, 2, 3)):
    got = {e["step"]: e for e in run.steps}
    want = {e["step"]: e for e in ref.steps}
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=TOL), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=TOL), step
        assert got[step]["trained_tokens"] == want[step]["trained_tokens"], step
    mine, theirs = model_at(run, LAST, tmp), model_at(ref, LAST, tmp)
    assert mine.keys() == theirs.keys()
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    assert worst <= TOL, worst


def test_cp2_dp2_trains_as_dp4_and_one_rank(cp_run, pools, tmp_path):
    """The losses, gradient norms, trained-token counts and trained parameters of cp 2 x dp 2
    equal plain FSDP2's on 4 ranks and one rank's; the header says the mesh and the attention;
    each rank holds a quarter of the parameters (FSDP2 shards over dp_shard x cp)."""
    start = cp_run.start
    assert start["mesh"] == [["dp_shard", 2], ["cp", 2]] and start["grad_accum_steps"] == 4
    assert start["cp"] == 2 and start["cp_impl"] == "alltoall"
    assert start["param_shard_bytes"] * 4 == pytest.approx(start["param_bytes"], rel=0.01)
    _assert_same(cp_run, pools[4].train(*COMMON), tmp_path)
    _assert_same(cp_run, pools[1].train(*COMMON), tmp_path)
    assert [e["trained_tokens"] for e in cp_run.steps] == [8 * 64] * LAST
    out = _header(start)
    assert "mesh: 2 dp_shard x 2 cp" in out, out
    assert "context parallel: cp 2, alltoall attention (each rank holds 32 of the 64" in out
    assert "parallel.cp_impl=auto -> alltoall: one all-to-all before each attention" in out


@pytest.mark.parametrize(
    ("overrides", "shards", "phrase"),
    [
        (["fsdp.sharding=none"], 2,
         "reshard_after_forward=False (no sharding across data-parallel ranks: each of the 2 "
         "holds a whole copy, split over its 2 cp ranks: 1/2 of the model state a rank)"),
        (["fsdp.sharding=hybrid", "fsdp.shard_group_size=2"], 4,
         "fsdp.shard_group_size=2 -> 2 data-parallel ranks per shard group, each with its 2 cp "
         "ranks: one copy of the model state split over 4 ranks"),
    ],
    ids=["none", "hybrid-group-2"],
)  # fmt: skip
def test_the_header_says_what_a_rank_holds_under_cp(pools, overrides, shards, phrase):
    """`fsdprun train debug parallel.cp=2 fsdp.sharding=none --nproc-per-node 4` said "no
    sharding: shard groups of 1" while each rank held half the parameters (issue 51): none
    replicates across data-parallel ranks only, FSDP2 still shards each copy over its cp ranks.
    fsdp.shard_group_size counts data-parallel ranks (2 of them x cp 2: groups of 4). The
    header's knob lines say the share its `parameter shard per rank` figures measure."""
    run = pools[4].train("train.steps=1", "schedule.warmup_steps=0", "parallel.cp=2", *overrides)
    start = run.start
    assert start["param_shard_bytes"] * shards == pytest.approx(start["param_bytes"], rel=0.01)
    out = _header(start)
    assert phrase in out, out
    assert "shard groups of 1" not in out, out


def _header(start: dict) -> str:
    """The run header and knob table as the console prints them from the start event."""
    from rich.console import Console

    from fsdprun.report.console import Reporter

    console = Console(record=True, width=200, highlight=False)
    Reporter(console, live=False).handle(start)
    return console.export_text()


def test_packed_chat_rows_with_clipping_and_chunked_loss_train_as_one_rank(pools, tmp_path):
    """Packed chat rows (document masks across the cp slices, restarted positions, prompt
    tokens not trained) under cp 2 x dp 2 with the chunked loss, a clip far below the norm and
    hybrid sharding (the 3-D mesh: FSDP2 shards over each cp pair, replicas all-reduce): the
    losses, trained-target counts, gradient norms, parameters and validation loss of one rank
    with torch's own clip (the ddp engine) and the plain loss. optim.eps=1 so that AdamW's step
    follows the clipped gradient's scale (tests/test_tp.py)."""
    data = Path(__file__).resolve().parents[1] / "recipes" / "data"
    chat = ("data.source=chat", f"data.paths=[{data / 'chat.jsonl'}]",
            f"data.tokenizer={data / 'tiny-llama-hf'}", "data.truncate=truncate",
            "model.vocab_size=258", "data.val_fraction=0.2", f"eval.every_steps={LAST}",
            "eval.batches=1", "train.grad_clip=0.05", "optim.eps=1", "optim.lr=0.5")  # fmt: skip
    cp = pools[4].train(*COMMON, *chat, "parallel.cp=2", "train.loss=chunked",
                        "fsdp.sharding=hybrid", "fsdp.shard_group_size=1")  # fmt: skip
    one = pools[1].train(*COMMON, *chat, "fsdp.engine=ddp")
    assert cp.start["mesh"] == [["dp_replicate", 2], ["dp_shard", 1], ["cp", 2]]
    assert all(e["grad_norm"] > 0.5 for e in cp.steps)
    assert cp.steps[0]["trained_tokens"] < 8 * 64  # prompts and padding are not trained
    _assert_same(cp, one, tmp_path)
    assert cp.summary["final_val_loss"] == pytest.approx(one.summary["final_val_loss"], abs=TOL)


def test_cp2_tp2_trains_as_one_rank(pools, tmp_path):
    """cp 2 x tp 2 (the mesh `1 dp_shard x 2 cp x 2 tp`): tensor parallel splits each cp rank's
    heads and its slice of the sequence (sequence parallel between blocks), the all-to-all then
    trades the local heads over the cp group; with activation checkpointing, the same losses,
    gradient norms, counts and parameters as one rank (which takes 8 micro-steps where this
    run takes 2 of 4 sequences: the sums are the same)."""
    both = pools[4].train(*COMMON, "parallel.cp=2", "parallel.tp=2", "train.micro_batch_size=4",
                          "activation_checkpointing.mode=full")  # fmt: skip
    assert both.start["mesh"] == [["dp_shard", 1], ["cp", 2], ["tp", 2]]
    _assert_same(both, pools[1].train(*COMMON), tmp_path)


def test_compiled_blocks_under_cp_and_tp_train_as_the_compiled_one_rank_run(pools, tmp_path):
    """compile.enabled=true (inductor, per block) with the all-to-all inside each compiled
    block (a functional collective, which the graph holds: no graph break): cp 2 x dp 2 trains
    as the compiled one-rank run, and so does plain dp 4 (one rank's graphs, which the compile
    cache then serves), and cp 2 x tp 2 (the all-to-all of each TP rank's heads inside the
    compiled blocks): losses, gradient norms, counts and parameters to 1e-5. Each run's summary
    has its compile time and cache counts. Before, cp refused compile."""
    compiled = ("compile.enabled=true",)
    one = pools[1].train(*COMMON, *compiled)
    cp = pools[4].train(*COMMON, "parallel.cp=2", *compiled)
    assert cp.start["compile"] == "per block" and cp.start["cp_impl"] == "alltoall"
    _assert_same(cp, one, tmp_path)
    _assert_same(pools[4].train(*COMMON, *compiled), one, tmp_path)
    both = pools[4].train(*COMMON, "parallel.cp=2", "parallel.tp=2", "train.micro_batch_size=4",
                          *compiled)  # fmt: skip
    assert both.start["cp_impl"] == "alltoall" and both.start["tp_plan"]
    _assert_same(both, one, tmp_path)
    for run in (one, cp, both):
        stats = run.summary["compile"]
        assert stats["time_s"] > 0 and stats["fx_graph"]["hit"] + stats["fx_graph"]["miss"] > 0


def _hf_logits_rank(rank: int, world: int, folder: str) -> dict:
    """The shipped HF Llama folder's logits on this rank's slice under cp 2 (its 2 kv heads)
    against the plain model's on whole rows: plain rows (no mask: SDPA's causal path on the
    gathered rows) and packed ones (positions restarting, the whole row's document mask); and
    how the plain rows' attention calls SDPA (whether with a mask, whether causal)."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fsdprun.data import Batch
    from fsdprun.engines.cp import apply_cp
    from fsdprun.models.hf import HFCausalLM

    torch.manual_seed(0)  # the same random weights on every rank
    model = HFCausalLM.from_folder(folder)
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    apply_cp(model, mesh=mesh["cp"])
    cp, me = 2, rank % 2
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    rows = Batch(tokens, tokens)
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, -1)
    doc_ids = torch.cat([torch.zeros(10), torch.ones(6)]).long().expand(2, -1)
    packed = Batch(tokens, tokens, positions, doc_ids)
    errors, calls = [], []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    for batch, whole in ((rows, {}), (packed, {"positions": positions, "doc_ids": doc_ids})):
        mine = batch.sequence_shard(me, cp)
        F.scaled_dot_product_attention = spy if not whole else sdpa
        try:
            got = model(mine.inputs, positions=mine.positions, doc_ids=mine.doc_ids)
        finally:
            F.scaled_dot_product_attention = sdpa
        want = plain(tokens, **whole)[:, me * 16 // cp : (me + 1) * 16 // cp]
        errors.append((got - want).abs().max().item())
    return {"errors": errors, "plain_calls": calls}


def test_hf_llama_folder_attention_equals_whole_rows(pools):
    """... and plain rows reach SDPA with no mask and is_causal on the gathered rows, once per
    layer: what the fused kernels take on CUDA (flash, cuDNN; tests/test_gpu.py runs them)."""
    folder = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
    for result in pools[4].submit(_hf_logits_rank, str(folder)):
        assert max(result["errors"]) <= 1e-5, result
        assert result["plain_calls"] == [(True, True)] * 2, result  # 2 layers


def test_hf_llama_folder_trains_as_one_rank(pools, tmp_path, monkeypatch):
    """The shipped HF Llama folder (pretrained weights) under cp 2 x dp 2, transformers' SDPA
    inside the all-to-all (fsdprun's attention implementation): the losses, gradient norms and
    parameters of one rank."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
    hf = (f"model.hf_path={folder}", "model.vocab_size=257")
    cp = pools[4].train(*COMMON, *hf, "parallel.cp=2")
    _assert_same(cp, pools[1].train(*COMMON, *hf), tmp_path)


@pytest.mark.parametrize(
    ("rope_type", "rows"),
    [("longrope", ()), ("dynamic", ()), ("yarn", ()),
     ("longrope", ("data.source=chat", f"data.paths=[{DATA / 'chat.jsonl'}]",
                   f"data.tokenizer={DATA / 'tiny-llama-hf'}", "data.truncate=truncate",
                   "train.seq_len=160"))],
    ids=["longrope", "dynamic", "yarn", "longrope-packed"],
)  # fmt: skip
def test_hf_rope_scaling_takes_the_whole_rows_factors(rope_type, rows, gloo_pool, pools, tmp_path):
    """An HF Llama folder whose rope factors change at 48 tokens (longrope's short and long
    factors, dynamic NTK's base; yarn's are fixed) under cp 2: every rank takes the factors one
    rank takes for the whole 64-token row, though cp rank 0 holds positions 0..31 only, and
    packed chat rows (160 tokens: 80 a rank) those of each conversation's whole length: the
    losses, gradient norms and parameters of one rank (1e-5). Before, each rank chose from the
    positions of its slice: rank 0 the short factors (the unscaled base; 2.3e-2 off at step 1
    for longrope). longrope's plain rows (the issue's case) through `fsdprun train`, the rest
    in the session's 2-rank group."""
    from hf_families import rope_scaling, save_tiny_hf

    threshold = 64 if rows else 48  # packed: among the conversations' lengths (52 to 88)
    folder = save_tiny_hf("llama", tmp_path / "hf", vocab_size=257,
                          **rope_scaling(rope_type, threshold))  # fmt: skip
    hf = (*COMMON, f"model.hf_path={folder}", *rows, "checkpoint.every_steps=3")
    if rope_type == "longrope" and not rows:
        proc = run_fsdprun("train", "debug", *hf, "parallel.cp=2", "--nproc-per-node", "2",
                           "--run-dir", str(tmp_path / "cp"), cwd=tmp_path)  # fmt: skip
        cp = Run(proc, tmp_path / "cp").check()
    else:
        cp = gloo_pool.train(*hf, "parallel.cp=2")
    assert cp.start["mesh"] == [["dp_shard", 1], ["cp", 2]], cp.start
    _assert_same(cp, pools[1].train(*hf), tmp_path)


def _stopped_at_2(run, tmp_path: Path) -> Path:
    """A copy of `run`'s folder as if it had stopped after its step-2 checkpoint."""
    copy = tmp_path / "run"
    shutil.copytree(run.run_dir, copy)
    shutil.rmtree(_ckpt(Run(None, copy), LAST))
    return copy


@pytest.mark.parametrize(
    ("resumed", "mesh"),
    [("parallel.cp=1", [["dp", 4]]), ("parallel.cp=4", [["dp_shard", 1], ["cp", 4]]),
     ("parallel.cp_impl=ring", [["dp_shard", 2], ["cp", 2]])],
    ids=["cp2-to-dp4", "cp2-to-cp4", "cp2-to-ring"],
)  # fmt: skip
def test_resume_is_exact_across_cp_degrees(cp_run, tmp_path, resumed, mesh):
    """`fsdprun resume RUN parallel.cp=N --nproc-per-node 4` of the cp 2 run stopped after its
    step-2 checkpoint: DCP reshards the dp_shard x cp shards, so step 3 on dp 4 or cp 4 equals
    step 3 of the uninterrupted run; so does the ring, whose ranks hold other tokens of each row
    (zig-zag chunks: nothing of the layout is stored). `inspect-checkpoint` shows the mesh it was
    saved on."""
    run_dir = _stopped_at_2(cp_run, tmp_path)
    proc = run_fsdprun("inspect-checkpoint", str(_ckpt(cp_run, 2)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"mesh\s+2 dp_shard × 2 cp", proc.stdout), proc.stdout
    proc = run_fsdprun("resume", str(run_dir), resumed, "--nproc-per-node", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = Run(proc, run_dir)
    last = max(i for i, e in enumerate(again.events) if e["event"] == "start")
    again.events = again.events[last:]
    assert again.start["mesh"] == mesh
    if "ring" in resumed:
        assert again.start["cp_impl"] == "ring"
    assert [e["step"] for e in again.steps] == [LAST]
    _assert_same(again, cp_run, tmp_path, steps=(LAST,))


def test_plan_divides_activations_by_cp_and_shows_each_cp_degree():
    """`fsdprun plan`: every rank keeps seq / cp tokens of activations, parameters are sharded
    over dp_shard x cp; the context-parallel line puts each degree beside the recipe's, with
    whether it fits or why it cannot run. llama-8b at seq 131,072 on 8 x 80 GB (full
    checkpointing) does not fit without cp, and fits at cp 2, 4 and 8 with the recipe's compile
    (before, cp refused compile and plan showed each cp degree eager, "compile off")."""
    from fsdprun.tools.plan import plan_memory

    one = plan_memory(load_recipe("debug", FOUR).config).strategies["full"]
    cp2 = plan_memory(load_recipe("debug", [*FOUR, "parallel.cp=2"]).config).strategies["full"]
    assert cp2.activations * 2 == one.activations and cp2.shard_group == 4
    result = CliRunner().invoke(
        app, ["plan", "llama-8b", "train.seq_len=131072", "model.max_seq_len=131072",
              "--world-size", "8", "--device-memory", "80GB"], env={"COLUMNS": "300"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("Context parallel")]
    assert re.search(r"cp 1 \(recipe\) \[dp 8\] [\d.]+ GiB does not fit", line), line
    for cp in (2, 4, 8):
        assert re.search(rf"cp {cp} \[dp_shard {8 // cp} x cp {cp}\] [\d.]+ GiB fits", line), line
    assert "compile off" not in line, line


def test_plan_counts_the_rings_working_memory():
    """`fsdprun plan` of a ring counts its working memory (issue 51: it promised cp 4 a third of
    what the ring used): with a small loss chunk, the ring's buffers outweigh the loss's and
    the activations are the all-to-all's plus their difference; `--full` prints the formula
    and the figure; the all-to-all's plan has neither."""
    from fsdprun.engines.activations import loss_bytes, ring_bytes
    from fsdprun.tools.plan import plan_memory

    long = [*FOUR, "train.seq_len=4096", "model.max_seq_len=4096", "model.n_kv_heads=4",
            "parallel.cp=4", "train.loss=chunked", "train.loss_chunk_size=256"]  # fmt: skip

    def activations(impl):
        cfg = load_recipe("debug", [*long, f"parallel.cp_impl={impl}"]).config
        return plan_memory(cfg).strategies["full"].activations, cfg

    ring, cfg = activations("ring")
    alltoall, _ = activations("alltoall")
    assert ring_bytes(cfg) > loss_bytes(cfg) > 0
    assert ring - alltoall == ring_bytes(cfg) - loss_bytes(cfg)
    for impl, shown in (("ring", True), ("alltoall", False)):
        result = CliRunner().invoke(app, ["plan", "debug", *long, f"parallel.cp_impl={impl}",
                                          "--full"], env={"COLUMNS": "300"})  # fmt: skip
        assert result.exit_code == 0, result.output
        note = f"({ring_bytes(cfg):,} bytes here; the activations count the larger of it"
        assert (note in result.stdout) == shown, result.stdout


def test_compare_accepts_cp_configurations():
    from fsdprun.tools.compare import parse_configs

    configs = {c.label: c.overrides for c in parse_configs("fsdp2,fsdp2:cp2,fsdp2:full:cp2:tp2")}
    assert configs["fsdp2:cp2"] == ("fsdp.engine=fsdp2", "parallel.cp=2")
    assert configs["fsdp2:full:cp2:tp2"] == (
        "fsdp.engine=fsdp2",
        "fsdp.sharding=full",
        "parallel.tp=2",
        "parallel.cp=2",
    )
    for bad, phrase in [("ddp:cp2", "context parallel (parallel.cp) needs fsdp2; use fsdp2:cp2"),
                        ("fsdp2:cp2:cp4", "use engine[:sharding][:tpN][:cpN]")]:  # fmt: skip
        with pytest.raises(UserError, match=re.escape(phrase)):
            parse_configs(bad)


# --- ring attention (parallel.cp_impl=ring, what auto takes where cp does not divide the heads) --


def _reference_attention(q, k, v, mask, *, scale, softcap=None, window=None):
    """Attention as one rank computes it, in plain torch (grouped kv heads repeated): scores
    scaled, soft-capped (cap x tanh(s / cap), as Gemma 2's eager attention), masked (boolean, or
    added), cut to a sliding window, softmax, times v."""
    import torch

    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n = q.shape[2]
    idx = torch.arange(n)
    allowed = (idx[:, None] >= idx[None, :])[None, None]
    if window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < window)
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        s = s + mask
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _ring_rank(rank: int, world: int) -> dict:
    """Whole-row attention (8 query heads, 2 kv heads: cp 4 cannot split them) against the
    ring's on the rank's zig-zag chunks (`config.layout.cp_chunks`) over a cp group of 4 ranks:
    plain causal, a packed row's dense document mask and its FlexAttention BlockMask, the dense
    mask again with the pairs' rows taken 3 at a time (`ring_chunk_rows`), and transformers'
    arguments: a sliding window of 5 with soft-capping and its own scaling, on plain rows and
    on the additive mask eager attention takes. Outputs and the gradients of q, k, v; and the
    score FLOPs each rank computes (FlopCounterMode), forward and backward of the causal row."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    from fsdprun.config.layout import cp_chunks
    from fsdprun.engines import cp
    from fsdprun.models.attention import attend, build_attention_mask

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen) for h in (8, 2, 2))
    grad = torch.randn(2, 8, 16, 8, generator=gen)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 4, [0] * 3 + [1] * 13])
    dense = build_attention_mask(doc_ids, flex=False)
    additive = torch.zeros(dense.shape).masked_fill(~dense, torch.finfo(torch.float32).min)
    parts = cp_chunks(16, rank, world, zigzag=True)
    assert [p.stop - p.start for p in parts] == [2, 2]

    def mine_of(t):
        return torch.cat([t[:, :, p] for p in parts], dim=2)

    ring = cp.ring_attention(mesh)
    errors, flops = [], None
    capped = {"sliding_window": 5, "softcap": 2.0, "scaling": 0.3}
    cases = [(None, None, {}), (dense, None, {}),
             (build_attention_mask(doc_ids, flex=True), None, {}),
             (dense, 3, {}), (None, None, capped), (additive, None, capped)]  # fmt: skip
    for mask, chunk, kwargs in cases:
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        # The reference takes the dense mask for the BlockMask too (flex has no CPU backward).
        if kwargs:
            want = _reference_attention(*whole, mask, scale=kwargs["scaling"],
                                        softcap=kwargs["softcap"],
                                        window=kwargs["sliding_window"])  # fmt: skip
        else:
            want = attend(*whole, None if mask is None else dense, enable_gqa=True)
        (want * grad).sum().backward()
        mine = [mine_of(t).clone().requires_grad_() for t in (q, k, v)]
        kept = cp.ring_chunk_rows
        if chunk is not None:
            cp.ring_chunk_rows = lambda head_dim, rows, chunk=chunk: chunk
        try:
            with FlopCounterMode(display=False) as counter:
                got = ring(*mine, mask, dropout=0.0, **kwargs)
                (got * mine_of(grad)).sum().backward()
        finally:
            cp.ring_chunk_rows = kept
        flops = counter.get_total_flops() if flops is None else flops
        errors.append((got - mine_of(want)).abs().max().item())
        errors += [(m.grad - mine_of(w.grad)).abs().max().item()
                   for m, w in zip(mine, whole, strict=True)]  # fmt: skip
    return {"shape": list(got.shape), "errors": errors, "flops": flops}


def test_ring_attention_equals_whole_row_attention_with_balanced_work(pools):
    results = pools[4].submit(_ring_rank)
    for result in results:
        assert result["shape"] == [2, 8, 4, 8], result
        # The ring's own float32 block arithmetic against SDPA's kernel: rounding only.
        assert max(result["errors"]) <= 5e-6, result
    # Zig-zag chunks: every rank computes the same causal work (2 cp + 1 chunk pairs), where
    # consecutive slices gave rank j j + 1 blocks (the last rank 4 x the first's).
    flops = [r["flops"] for r in results]
    assert min(flops) == max(flops) > 0, flops


def _compiled_ring_rank(rank: int, world: int) -> dict:
    """The ring inside a compiled function (AOTAutograd, no inductor: what is checked is where
    torch.compile cuts the graph) against the eager ring, forward and backward; and what
    fullgraph=True makes of it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdprun.engines import cp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, h, 4, 8, generator=gen) for h in (4, 2, 2))
    ring = cp.ring_attention(mesh)

    def block(q, k, v):  # a block's arithmetic around its attention
        return ring(q * 2, k + 1, v, None).square()

    outs, grads = [], []
    for fn in (block, torch.compile(block, backend="aot_eager")):
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*mine)
        out.sum().backward()
        outs.append(out)
        grads.append([t.grad for t in mine])
    torch._dynamo.reset()
    try:
        torch.compile(block, backend="aot_eager", fullgraph=True)(q, k, v)
        fullgraph = "compiled"
    except Exception as e:  # torch._dynamo.exc.Unsupported (not public)
        fullgraph = f"{type(e).__name__}: {e}"
    errors = [(outs[0] - outs[1]).abs().max().item()]
    errors += [(a - b).abs().max().item() for a, b in zip(*grads, strict=True)]
    return {"errors": errors, "fullgraph": fullgraph}


def test_the_ring_compiles_with_a_graph_break_and_refuses_fullgraph(pools):
    """Compiled blocks take the ring eager: torch.compile cannot trace its point-to-point
    sends and breaks the graph there (outputs and gradients equal the eager ring's); with
    compile.fullgraph=true it raises instead, torch's own limit, which the recipe checks refuse
    in one line (the all-to-all's functional collective compiles inside the graph)."""
    for result in pools[4].submit(_compiled_ring_rank):
        assert max(result["errors"]) <= 1e-6, result
        assert "P2P compilation disabled for P2POp construction" in result["fullgraph"], result
    (line,) = errors_of("parallel.cp=4", "compile.enabled=true", "compile.fullgraph=true")
    ring = "parallel.cp=4 with parallel.cp_impl=ring (what auto takes for these heads)"
    assert line.startswith(f"{ring} and compile.fullgraph=true: torch.compile cannot trace"), line
    # The all-to-all's functional collective compiles inside the graph: accepted.
    load_recipe("debug", [*FOUR, "parallel.cp=2", "compile.enabled=true", "compile.fullgraph=true"])


def _heap_peak():
    """A TorchDispatchMode whose `peak` is the most heap in use (glibc's mallinfo2: torch's CPU
    tensors are malloc'ed) after any op run under it, over what was in use when it was made:
    allocations counted as they happen, so the figure does not move with the machine's load
    (RSS would: freed memory is not always returned). None without glibc."""
    import ctypes

    from torch.utils._python_dispatch import TorchDispatchMode

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]  # fmt: skip

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # heap chunks in use + mmap'ed allocations

    class HeapPeak(TorchDispatchMode):
        def __enter__(self):
            self.base, self.peak = in_use(), 0
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use() - self.base)
            return out

    return HeapPeak


def _ring_memory_rank(rank: int, world: int) -> dict:
    """The debug model (2 kv heads) at seq 2048, one row: the heap's peak over a forward, the
    loss and backward on this rank at cp 2 (the all-to-all) and at cp 4 (the ring: 2 kv heads),
    beside `fsdprun plan`'s activations; then the ring's attention alone, at the model's shapes
    and layout, against `ring_working_bytes`. Each measured on a second pass (the first
    initializes what torch initializes once)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdprun.data import Batch
    from fsdprun.engines.activations import activation_bytes
    from fsdprun.engines.cp import apply_cp
    from fsdprun.loss import cross_entropy
    from fsdprun.models import build_model

    peak_mode = _heap_peak()
    if peak_mode is None:
        return {}
    seq, out = 2048, {}
    tokens = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    for cp in (2, 4):
        over = [*FOUR, f"parallel.cp={cp}", f"train.seq_len={seq}", f"model.max_seq_len={seq}",
                "train.micro_batch_size=1"]  # fmt: skip
        cfg = load_recipe("debug", over).config
        model = build_model(cfg.model)
        mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
        apply_cp(model, mesh=mesh["cp"], impl=cp_impl(cfg, model_facts(cfg.model)))
        batch = Batch(tokens[:, :-1], tokens[:, 1:]).sequence_shard(rank % cp, cp)
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with peak_mode() as heap:
                logits = model(batch.inputs, positions=batch.positions)
                loss = cross_entropy(logits, batch.targets, reduction="sum")
                del logits
                loss.backward()
        # The parameters' gradients are the model state's, not activations.
        out[cp] = (heap.peak - grads, activation_bytes(cfg))
    from fsdprun.engines import cp as cp_module  # imported late: a test that fails says why

    b, h, hk, n, d = 1, 4, 2, seq // 4, 16
    ring = cp_module.ring_attention(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    gen = torch.Generator().manual_seed(2)
    # As the model gives them: (batch, seq, heads, head_dim) transposed.
    q, k, v = (torch.randn(b, n, heads, d, generator=gen).transpose(1, 2).requires_grad_()
               for heads in (h, hk, hk))  # fmt: skip
    grad_out = torch.randn(b, n, h, d, generator=gen).transpose(1, 2)
    for _ in range(2):
        got = ring(q, k, v, None)
        with peak_mode() as heap:  # dq, dk and dv are the ring's own buffers: counted
            got.backward(grad_out)
        q.grad = k.grad = v.grad = None
    out["ring"] = (heap.peak, cp_module.ring_working_bytes(
        micro=b, heads=h, kv_heads=hk, head_dim=d, local_seq=n, dtype_bytes=4))  # fmt: skip
    return out


def test_the_rings_memory_falls_with_cp_as_plan_counts(pools):
    """`fsdprun plan` promised 57 and 29 MiB of activations at cp 2 and 4 (debug, seq 4,096, 4
    ranks), and the ring at cp 4 used more than cp 2 (issue 51): its float32 scores were a
    whole block's (up to 256 MiB) at a time. Its working memory is now a multiple of the slice
    (chunks of 2 x head_dim query rows, no k or v repeated per query head), so a rank's peak at
    cp 4 (the ring) is about half of cp 2's (the all-to-all), each within 10% of the plan's
    activations (measured 7% and 4% above: gradients of activations in flight); the ring's
    own peak is within 10% of what plan counts for it (`ring_working_bytes`, measured 1%).
    Heap in use, counted per allocation (`_heap_peak`): steady on a loaded machine."""
    results = pools[4].submit(_ring_memory_rank)
    if not results[0]:
        pytest.skip("no glibc mallinfo2 to count the heap with")
    for result in results:
        (cp2, plan2), (cp4, plan4) = result[2], result[4]
        assert cp4 < 0.6 * cp2, result
        assert cp2 == pytest.approx(plan2, rel=0.1), result
        assert cp4 == pytest.approx(plan4, rel=0.1), result
        ring, planned = result["ring"]
        assert ring == pytest.approx(planned, rel=0.1), result


def test_ring_is_what_auto_takes_where_cp_does_not_divide_the_heads():
    """auto: all-to-all where cp divides the kv heads (per TP rank), else the ring (with TP
    too); an explicit alltoall that cannot split them is refused naming the ring."""
    import dataclasses

    def impl(kv_heads, *overrides):
        cfg = load_recipe("debug", [*FOUR, "model.n_kv_heads=4", *overrides]).config
        return cp_impl(cfg, dataclasses.replace(model_facts(cfg.model), n_kv_heads=kv_heads))

    assert impl(2, "parallel.cp=2") == "alltoall" and impl(2, "parallel.cp=4") == "ring"
    assert impl(4, "parallel.cp=2", "parallel.tp=2") == "alltoall"
    assert impl(2, "parallel.cp=2", "parallel.tp=2") == "ring"
    assert impl(4, "parallel.cp=2", "parallel.cp_impl=ring") == "ring"
    (line,) = errors_of("parallel.cp=4", "model.n_kv_heads=2", "parallel.cp_impl=alltoall")
    assert "parallel.cp (4) does not divide the model's kv heads (2" in line
    assert "or parallel.cp_impl=ring (or auto)" in line
    load_recipe("debug", [*FOUR, "parallel.cp=4", "model.n_kv_heads=2"])  # auto: the ring
    load_recipe("debug", [*FOUR, "parallel.cp=2", "parallel.tp=2", "model.n_kv_heads=2"])


def test_ring_trains_packed_chat_rows_of_the_hf_folder_as_one_rank(pools, tmp_path, monkeypatch):
    """The shipped HF Llama folder (2 kv heads) at cp 4, which auto computes with the ring:
    packed chat rows (the whole row's document mask cut per block, positions restarting,
    prompts not trained), transformers' scaling passed through, activation checkpointing
    recomputing the ring: the losses, gradient norms, counts and parameters of one rank."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = Path(__file__).resolve().parents[1] / "recipes" / "data"
    hf = (f"model.hf_path={data / 'tiny-llama-hf'}", "model.vocab_size=257", "data.source=chat",
          f"data.paths=[{data / 'chat.jsonl'}]", f"data.tokenizer={data / 'tiny-llama-hf'}",
          "data.truncate=truncate", "data.val_fraction=0")  # fmt: skip
    ring = pools[4].train(*COMMON, *hf, "parallel.cp=4", "activation_checkpointing.mode=full")
    assert ring.start["cp_impl"] == "ring" and ring.start["mesh"] == [["dp_shard", 1], ["cp", 4]]
    assert ring.steps[0]["trained_tokens"] < 8 * 64  # prompts and padding are not trained
    _assert_same(ring, pools[1].train(*COMMON, *hf), tmp_path)


# --- ring attention under tensor parallel ---------------------------------------------------------


def test_ring_under_tp_trains_as_one_rank(pools, tmp_path, monkeypatch):
    """cp 2 x tp 2 with the ring (`1 dp_shard x 2 cp x 2 tp`): each TP rank holds heads / tp of
    the heads and its zig-zag chunks pass round the cp group of the same TP rank. The debug
    model forced onto the ring (it would take it with 2 kv heads: 1 per TP rank, which cp 2
    cannot split) with activation checkpointing recomputing it, and the shipped HF Llama
    folder, whose 2 kv heads auto sends there: the losses, gradient norms, counts and
    parameters of one rank."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
    hf = (f"model.hf_path={folder}", "model.vocab_size=257")
    both = ("parallel.cp=2", "parallel.tp=2", "train.micro_batch_size=4")
    debug = pools[4].train(*COMMON, *both, "parallel.cp_impl=ring",
                           "activation_checkpointing.mode=full")  # fmt: skip
    assert debug.start["cp_impl"] == "ring"
    assert debug.start["mesh"] == [["dp_shard", 1], ["cp", 2], ["tp", 2]]
    _assert_same(debug, pools[1].train(*COMMON), tmp_path)
    folder_run = pools[4].train(*COMMON, *hf, *both)
    assert folder_run.start["cp_impl"] == "ring" and folder_run.start["tp_plan"]
    _assert_same(folder_run, pools[1].train(*COMMON, *hf), tmp_path)
    # The debug recipe's own 2 kv heads take the ring at cp 2 x tp 2, no longer refused.
    assert load_recipe("debug", [*FOUR, "parallel.cp=2", "parallel.tp=2"])


# --- every HuggingFace family under cp ------------------------------------------------------------
# tests/hf_families.py's tiny folders: 4 heads and 2 kv heads (cp 2 divides them: the
# all-to-all), sliding windows of 16 where the family has them (Mistral's every layer, Gemma's
# every other), which cut attention inside the 64-token rows a cp 2 group splits (32 tokens a
# rank; the ring's 16-token chunks), Gemma 2's soft-capped scores and eager attention, Qwen 3's
# q/k norms, Phi-3's fused projections, Qwen3-MoE's experts. Every family trains on synthetic
# rows through the all-to-all; the ring trains Mistral's windows on them, and Gemma 2 (windows,
# soft-capping and the additive masks of eager attention) on packed chat rows, whose document
# masks the all-to-all also takes for Gemma 3.
DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
CHAT = ("data.source=chat", f"data.paths=[{DATA / 'chat.jsonl'}]",
        f"data.tokenizer={DATA / 'tiny-llama-hf'}", "data.truncate=truncate",
        "data.val_fraction=0")  # fmt: skip
FAMILY_CASES = [
    # The HF Llama folder's own tests are above.
    *[(family, "alltoall", "synthetic") for family in HF_TINY_FAMILIES if family != "llama"],
    ("mistral", "ring", "synthetic"),
    ("gemma2", "ring", "chat"),
    ("gemma3_text", "alltoall", "chat"),
]  # fmt: skip


@pytest.fixture(scope="module")
def chat_family_dirs(tmp_path_factory) -> dict[str, Path]:
    """The families' tiny folders with the byte tokenizer's 257 embeddings, for chat rows."""
    from hf_families import save_tiny_hf

    root = tmp_path_factory.mktemp("cp-chat")
    return {f: save_tiny_hf(f, root / f, vocab_size=257) for f in ("gemma2", "gemma3_text")}


@pytest.mark.parametrize(("family", "impl", "rows"), FAMILY_CASES,
                         ids=["-".join(case) for case in FAMILY_CASES])  # fmt: skip
def test_every_family_trains_under_cp_as_one_rank(
    family, impl, rows, hf_family_dirs, chat_family_dirs, pools, tmp_path, monkeypatch
):
    """The family's tiny folder at cp 2 x dp 2 (`impl` forced) against one rank: losses,
    gradient norms, trained-token counts and every parameter to 1e-5 (fp32)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if rows == "chat":
        data = (f"model.hf_path={chat_family_dirs[family]}", *CHAT)
    else:
        data = (f"model.hf_path={hf_family_dirs[family]}",)
    run = pools[4].train(*COMMON, *data, "parallel.cp=2", f"parallel.cp_impl={impl}")
    assert run.start["cp_impl"] == impl and run.start["mesh"] == [["dp_shard", 2], ["cp", 2]]
    if rows == "chat":
        assert run.steps[0]["trained_tokens"] < 8 * 64  # prompts and padding are not trained
    _assert_same(run, pools[1].train(*COMMON, *data), tmp_path)
