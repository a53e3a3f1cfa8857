"""Expert parallelism (`parallel.ep`, docs/expert-parallel.md): the refusals before launch and the
mesh rules; the built-in mixture of experts against transformers' own; and, in real gloo ranks,
the promise that ep trains exactly as one rank does.

ep 2 on 2 ranks and ep 2 x dp 2 on 4 ranks (each with gradient accumulation) give one rank's
losses (the router's auxiliary loss in them) and gradient norms within 1e-5, on the built-in
`debug-moe` and on a tiny Qwen3-MoE folder with and without `norm_topk_prob`; so do packed chat
rows under activation checkpointing, and compiled blocks. The runs share the session's 4-, 2-
and 1-rank gloo groups (tests/conftest.py); the resumes across ep degrees are `fsdprun resume`
commands on copies of those runs (the command's own checks are what is tested). The tokens each
expert receives, as metrics.jsonl logs them, are counted again here from transformers' router on
the same batch. An ep run's checkpoint exports to a folder transformers loads with fsdprun's
logits, and inspects with its mesh.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import Run, consolidate, model_at, run_fsdprun

from fsdprun.config import load_recipe
from fsdprun.config.layout import Layout
from fsdprun.errors import UserError

transformers = pytest.importorskip("transformers")

TOL = 1e-5
LAST = 3
# Three steps of 16 rows in micro-batches of 2: 8 accumulated on one rank, 4 a rank on 2, 2 on
# 4; a checkpoint after step 2 for the resumes.
COMMON = ("train.steps=3", "output.log_every=1", "train.global_batch_size=16",
          "checkpoint.every_steps=2")  # fmt: skip
DATA = Path(__file__).parent.parent / "recipes" / "data"
CHAT = ("data.source=chat", f"data.tokenizer={DATA / 'tiny-llama-hf'}", "train.seq_len=160",
        f"data.paths=[{DATA / 'chat.jsonl'}]", "data.pack=true", "train.global_batch_size=4",
        "train.micro_batch_size=1", "train.steps=3", "output.log_every=1",
        "checkpoint.save_final=false")  # fmt: skip


def errors_of(*overrides: str, recipe: str = "debug-moe") -> list[str]:
    with pytest.raises(UserError) as info:
        load_recipe(recipe, list(overrides))
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        (["model.moe_experts=0"], "parallel.ep=2 with a dense model (the built-in Llama with "
                                  "model.moe_experts=0: no experts to shard)"),
        (["model.moe_experts=6", "parallel.ep=4", "launch.nproc_per_node=4"],
         "parallel.ep (4) does not divide the model's experts (6, model.moe_experts)"),
        (["parallel.ep=4"], "parallel.ep (4) must divide the data-parallel ranks (2)"),
        (["parallel.ep=0"], "parallel.ep must be >= 1 (got 0)"),
        (["fsdp.engine=fsdp1"], "parallel.ep=2 with fsdp.engine=fsdp1: the experts are DTensors"),
        (["fsdp.engine=ddp"], "parallel.ep=2 with fsdp.engine=ddp"),
        (["fsdp.sharding=hybrid", "fsdp.shard_group_size=1"],
         "parallel.ep (2) must divide the shard group (fsdp.shard_group_size, or one node's "
         "ranks) (1)"),
        (["parallel.tp=2", "launch.nproc_per_node=4"], "parallel.ep=2 with parallel.tp=2"),
        (["parallel.cp=2", "launch.nproc_per_node=4"], "parallel.ep=2 with parallel.cp=2"),
    ],
)  # fmt: skip
def test_refusals_name_the_key_and_the_reason(overrides, phrase):
    """Each layout expert parallel cannot take is one line naming the key and why, before
    launch (`config.layout.layout_errors`, which the composition table reads too)."""
    errors = [e for e in errors_of(*overrides) if "parallel.ep" in e]
    assert len(errors) == 1 and phrase in errors[0], errors


def test_ep_on_a_dense_or_undeclared_folder_is_refused(hf_family_dirs, tmp_path):
    """An HF folder without experts, and one whose family does not say where they live."""
    (line,) = [e for e in errors_of("parallel.ep=2", f"model.hf_path={hf_family_dirs['qwen3']}",
                                    recipe="debug") if "parallel.ep" in e]  # fmt: skip
    assert "with a dense model (model.hf_path's model_type 'qwen3': no experts" in line
    undeclared = shutil.copytree(hf_family_dirs["qwen3_moe"], tmp_path / "moe")
    config = json.loads((undeclared / "config.json").read_text())
    (undeclared / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    (line,) = [e for e in errors_of("parallel.ep=2", f"model.hf_path={undeclared}",
                                    recipe="debug") if "parallel.ep" in e]  # fmt: skip
    assert "'mixtral': its family does not declare where its experts live" in line


def test_the_mesh_splits_dp_shard_into_dp_shard_mod_ep_and_ep():
    """ep is carved out of dp_shard (innermost: an ep group is consecutive ranks); each expert
    is sharded over what is left; a resume on fewer ranks lowers ep to a divisor that fits."""
    cfg = load_recipe("debug-moe", ["launch.nproc_per_node=8", "train.global_batch_size=16"],
                      check=False).config  # fmt: skip
    layout = Layout.of(cfg)
    assert layout.mesh_dims == [("dp_shard_mod_ep", 4), ("ep", 2)]
    assert layout.describe() == "4 dp_shard_mod_ep x 2 ep"
    assert (layout.fsdp_shards, layout.expert_shards, layout.dp) == (8, 4, 8)
    assert layout.at(ep=8).mesh_dims == [("dp_shard_mod_ep", 1), ("ep", 8)]
    assert layout.at(ep=8, world_size=4).refit("ep") == 4
    assert layout.at(ep=2, world_size=1).refit("ep") == 1
    assert layout.at(ep=1).mesh_dims == [("dp", 8)]


# ---- the built-in mixture of experts is transformers' ----


@pytest.mark.parametrize("norm", [True, False])
def test_builtin_moe_computes_as_transformers_qwen3_moe_block(norm):
    """The built-in MoE feed-forward (`models.moe.MoE`) given a Qwen3-MoE block's weights gives
    its outputs; its load-balancing loss is transformers' `load_balancing_loss_func`, with and
    without a padding mask."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen

    from fsdprun.models.moe import MoE, load_balancing_loss

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=norm)  # fmt: skip
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    theirs = qwen.Qwen3MoeSparseMoeBlock(config)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    mine = MoE(32, num_experts=4, top_k=2, ffn_dim=16, shared_ffn_dim=0, norm_topk_prob=norm)
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 10, 32)
    torch.testing.assert_close(mine(x), theirs(x), rtol=0, atol=1e-6)
    logits = (mine.router_logits, torch.randn(30, 4))
    real = (torch.rand(3, 10) > 0.3).long()
    for mask in (None, real):
        want = qwen.load_balancing_loss_func(logits, 4, 2, mask)
        torch.testing.assert_close(load_balancing_loss(logits, 4, 2, mask), want)


def test_builtin_moe_counts_its_parameters_and_flops():
    """The card's count (config.sizes, no torch) is the built model's; FLOPs count the router,
    the active experts and the shared expert."""
    from fsdprun.config.sizes import model_num_params
    from fsdprun.models import build_model, model_spec

    cfg = load_recipe("debug-moe", ["model.moe_shared_ffn_dim=32"]).config.model
    with torch.device("meta"):
        model = build_model(cfg)
    assert model_num_params(cfg) == sum(p.numel() for p in model.parameters())
    dense = load_recipe("debug", []).config.model
    per_block = (64 * 8 + 2 * 3 * 64 * 64 + 3 * 64 * 32) - 3 * 64 * 192
    assert (
        model_spec(cfg).flops_per_token(cfg, 64) - model_spec(dense).flops_per_token(dense, 64)
        == 6 * 2 * per_block
    )


# ---- real runs ----


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen3-MoE folders (4 experts, 2 active) with the byte tokenizer's 257 embeddings:
    with norm_topk_prob and the router's auxiliary loss (coef 0.1), and without either."""
    from hf_families import save_tiny_hf

    root = tmp_path_factory.mktemp("moe")
    return {
        "norm": save_tiny_hf("qwen3_moe", root / "norm", vocab_size=257, norm_topk_prob=True,
                             output_router_logits=True, router_aux_loss_coef=0.1),
        "no-norm": save_tiny_hf("qwen3_moe", root / "no-norm", vocab_size=257,
                                norm_topk_prob=False),
    }  # fmt: skip


@pytest.fixture(scope="module")
def pools(gloo_pool_4, gloo_pool, gloo_pool_1):
    return {4: gloo_pool_4, 2: gloo_pool, 1: gloo_pool_1}


CASES = {
    "debug-moe": ("debug-moe", ()),
    "qwen3_moe": ("debug", ("model.hf_path=NORM",)),
    "qwen3_moe-no-norm": ("debug", ("model.hf_path=NO-NORM",)),
}


# The built-in MoE's ep runs also train the composition table's ep 2 cells (docs/parallelism.md,
# fsdprun/config/composition.py) against one rank: full activation checkpointing on 2 ranks,
# selective checkpointing with the chunked loss on 4. The Qwen3-MoE folder's 4 ranks shard
# hybrid: 2 replicas of a shard group of 2, which is one ep group.
HYBRID = ("fsdp.sharding=hybrid", "fsdp.shard_group_size=2")
KNOBS = {("debug-moe", 2): ("activation_checkpointing.mode=full",),
         ("debug-moe", 4): ("activation_checkpointing.mode=selective", "train.loss=chunked"),
         ("qwen3_moe", 4): HYBRID}  # fmt: skip
MESHES = {2: [["dp_shard_mod_ep", 1], ["ep", 2]], 4: [["dp_shard_mod_ep", 2], ["ep", 2]],
          (4, HYBRID): [["dp_replicate", 2], ["dp_shard_mod_ep", 1], ["ep", 2]]}  # fmt: skip


def _train(pools, moe_folders, case: str, world: int, *extra: str) -> Run:
    recipe, model = CASES[case]
    model = [o.replace("NO-NORM", str(moe_folders["no-norm"]))
             .replace("NORM", str(moe_folders["norm"])) for o in model]  # fmt: skip
    ep = min(world, 2)
    knobs = KNOBS.get((case, world), ())
    return pools[world].train(*COMMON, *model, f"parallel.ep={ep}", *knobs, *extra,
                              recipe=recipe)  # fmt: skip


def _assert_same(run: Run, ref: Run, *, steps=(1, 2, 3)) -> None:
    got = {e["step"]: e for e in run.steps}
    want = {e["step"]: e for e in ref.steps}
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=TOL), step
        # An expert gradient ep times too large or small (FSDP's divisor over dp_shard_mod_ep)
        # shows here: Adam's update hides it from the next losses.
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=TOL), step


@pytest.mark.parametrize("case", list(CASES))
def test_ep_trains_as_one_rank(case, pools, moe_folders, tmp_path):
    """ep 2 on 2 ranks (1 dp_shard_mod_ep x 2 ep) and ep 2 x dp 2 on 4 ranks (2 x 2, or 2
    replicas of one ep group under hybrid sharding), with 4 and 2 accumulated micro-batches a
    rank: one rank's losses and gradient norms (1e-5), and its trained weights after the last
    step. The built-in's runs checkpoint their activations (`KNOBS`), whose recomputation in
    backward runs the all-to-alls again."""
    one = _train(pools, moe_folders, case, 1)
    for world in (2, 4):
        run = _train(pools, moe_folders, case, world)
        mesh = MESHES[(world, HYBRID) if KNOBS.get((case, world)) == HYBRID else world]
        assert run.start["mesh"] == mesh and run.start["ep"] == 2
        _assert_same(run, one)
    if case == "debug-moe":
        mine, theirs = model_at(run, LAST, tmp_path), model_at(one, LAST, tmp_path)
        assert mine.keys() == theirs.keys()
        assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) <= TOL
        # The router's auxiliary loss is in the losses: without it they differ.
        without = _train(pools, moe_folders, case, 1, "model.moe_aux_loss_coef=0")
        assert abs(without.losses[0] - one.losses[0]) > 1e-3, (without.losses, one.losses)


@pytest.mark.parametrize("case", ["debug-moe", "qwen3_moe-no-norm"])
def test_pp2_ep2_trains_as_one_rank(case, pools, moe_folders):
    """Expert parallel inside pipeline stages: pp 2 x ep 2 on 4 ranks (each stage's experts
    split over its 2 data-parallel ranks, the global norm over both stages' meshes) gives one
    rank's losses and gradient norms. The router's auxiliary loss is off (pipeline parallel
    refuses it: one function of every stage's router logits)."""
    off = ("model.moe_aux_loss_coef=0",) if case == "debug-moe" else ()
    run = _train(pools, moe_folders, case, 4, "parallel.pp=2", *off)
    assert run.start["mesh"] == [["pp", 2], ["dp_shard_mod_ep", 1], ["ep", 2]]
    _assert_same(run, _train(pools, moe_folders, case, 1, *off))


def test_packed_rows_under_activation_checkpointing_train_as_one_rank(pools, moe_folders):
    """Packed chat rows (several conversations a row, positions restarting; the auxiliary loss
    over the real tokens only) with full activation checkpointing, whose recomputation in
    backward runs the all-to-alls again: ep 2 equals one rank, and no expert's tokens are
    counted twice."""
    folder = moe_folders["norm"]
    rows = (*CHAT, f"model.hf_path={folder}", "activation_checkpointing.mode=full")
    ep = pools[2].train(*rows, "parallel.ep=2")
    one = pools[1].train(*rows)
    _assert_same(ep, one)
    for step in ep.steps:  # every token a step: 4 rows x 160, each to 2 experts, per layer
        assert sum(step["experts"]["mean"]) * 4 == 2 * 2 * 4 * 160


def test_compiled_blocks_train_as_one_rank(pools, moe_folders):
    """compile.enabled=true (per block, with full activation checkpointing; the dispatch runs
    eagerly inside, one graph break) under ep 2: one eager rank's losses and gradient norms."""
    compiled = _train(pools, moe_folders, "debug-moe", 2, "compile.enabled=true")
    assert compiled.start["compile"] == "per block"
    _assert_same(compiled, _train(pools, moe_folders, "debug-moe", 1))


@pytest.mark.parametrize("name", ["lora-offload", "float8"])
def test_lora_offload_and_float8_under_ep_train_as_one_rank(name, pools, moe_folders):
    """LoRA on the attention (the experts frozen, sharded over the ep mesh) with FSDP2's CPU
    offload of every parameter, the experts' 2-D ones included; and tensorwise float8 of the
    attention's Linears (the experts' stacked weights are no Linears), gathered in float8 over
    the dense mesh: ep 2 on 2 ranks gives the one-rank run's losses and gradient norms of the
    same knobs (and float8's are not fp32's)."""
    from fsdprun.engines.float8 import TEST_ON_CPU_ENV

    if name == "float8":
        pytest.importorskip("torchao")
    knobs = {"lora-offload": ("lora.rank=8",), "float8": ("precision.float8=tensorwise",)}[name]
    env = {TEST_ON_CPU_ENV: "1"} if name == "float8" else {}
    offload = ("fsdp.cpu_offload=true",) if name == "lora-offload" else ()
    one = pools[1].train(*COMMON, "parallel.ep=1", *knobs, recipe="debug-moe", env=env)
    ep = pools[2].train(*COMMON, *knobs, *offload, recipe="debug-moe", env=env)
    _assert_same(ep, one)
    if name == "float8":
        assert "converted" in ep.start["float8"], ep.start["float8"]
        plain = _train(pools, moe_folders, "debug-moe", 1)
        assert abs(plain.losses[0] - one.losses[0]) > 5e-5, (plain.losses, one.losses)


def test_tokens_per_expert_are_the_routers_count(pools, moe_folders):
    """metrics.jsonl's step-1 figures (ep 2, 2 ranks) are a count of the (token, k) pairs
    transformers' own router sends each expert on the step's 16 rows with the folder's weights
    (the first step's forwards): per layer the busiest expert, its count and the mean; per ep
    rank, the pairs its two experts computed."""
    from fsdprun.data import build_datasets, load_batch

    run = _train(pools, moe_folders, "qwen3_moe", 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_folders["norm"],
                                                              dtype=torch.float32)  # fmt: skip
    cfg = load_recipe(str(run.run_dir / "recipe.yaml")).config
    data, _ = build_datasets(cfg.data, vocab_size=257, seq_len=64, seed=0)
    batch = load_batch(data, range(16), "cpu")
    with torch.no_grad():
        logits = model(input_ids=batch.inputs, output_router_logits=True).router_logits
    counts = [torch.bincount(torch.topk(layer.softmax(-1), 2).indices.flatten(), minlength=4)
              for layer in logits]  # fmt: skip
    figures = run.steps[0]["experts"]
    assert figures["max"] == [int(c.max()) for c in counts]
    assert figures["busiest_expert"] == [int(c.argmax()) for c in counts]
    assert figures["mean"] == [16 * 64 * 2 / 4] * 2
    per_rank = [[int(c[:2].sum()), int(c[2:].sum())] for c in counts]
    assert figures["ranks"]["max"] == [max(r) for r in per_rank]
    assert figures["ranks"]["busiest_rank"] == [r.index(max(r)) for r in per_rank]
    # The run's summary adds up the logged steps.
    total = run.summary["experts"]
    assert total["mean"] == [3 * 16 * 64 * 2 / 4] * 2


@pytest.mark.parametrize(("case", "saved", "resumed"),
                         [("debug-moe", 2, 1), ("qwen3_moe", 1, 2)],
                         ids=["ep2-to-ep1", "ep1-to-ep2"])  # fmt: skip
def test_resume_is_exact_across_ep_degrees(pools, moe_folders, tmp_path, case, saved, resumed):
    """`fsdprun resume RUN parallel.ep=N` of a run stopped after its step-2 checkpoint on 2
    ranks: DCP saved each expert tensor whole-shaped with its placements, so step 3 at the
    other ep degree (or none) equals step 3 of the uninterrupted run."""
    whole = _train(pools, moe_folders, case, 2, f"parallel.ep={saved}")
    copy_dir = tmp_path / "run"
    shutil.copytree(whole.run_dir, copy_dir)
    shutil.rmtree(copy_dir / "checkpoints" / f"step-{LAST:08d}")
    proc = run_fsdprun("resume", str(copy_dir), f"parallel.ep={resumed}", "--nproc-per-node", "2",
                       cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = Run(proc, copy_dir)
    last = max(i for i, e in enumerate(again.events) if e["event"] == "start")
    again.events = again.events[last:]
    assert again.start["ep"] == resumed and [e["step"] for e in again.steps] == [LAST]
    _assert_same(again, whole, steps=(LAST,))


def test_ep_checkpoint_exports_to_transformers_and_inspects_with_its_mesh(
    pools, moe_folders, tmp_path
):
    """The ep 2 x dp 2 checkpoints keep every expert tensor whole-shaped under its own name: the
    Qwen3-MoE run's HF export loads in transformers with fsdprun's logits of the trained
    weights (1e-5), and so does the built-in MoE's, as a Mixtral folder; inspect-checkpoint
    shows the mesh the run had."""
    from fsdprun.checkpoint.export import export_checkpoint
    from fsdprun.checkpoint.inspect import describe_checkpoint
    from fsdprun.models import build_model
    from fsdprun.models.hf import HFCausalLM

    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    for case, mesh in (("qwen3_moe", MESHES[(4, HYBRID)]), ("debug-moe", MESHES[4])):
        run = _train(pools, moe_folders, case, 4)
        ckpt = run.run_dir / "checkpoints" / f"step-{LAST:08d}"
        doc = describe_checkpoint(ckpt)
        assert doc["mesh"] == {"shape": [n for _, n in mesh], "dim_names": [d for d, _ in mesh]}
        export_checkpoint(ckpt, tmp_path / case, fmt="hf")
        exported = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / case, dtype=torch.float32
        ).eval()
        trained = consolidate(ckpt, tmp_path / f"{case}.pt")["model"]
        cfg = load_recipe(str(run.run_dir / "recipe.yaml")).config
        if case == "qwen3_moe":
            model = HFCausalLM.from_folder(moe_folders["norm"])
        else:
            assert type(exported).__name__ == "MixtralForCausalLM"
            model = build_model(cfg.model)
        model.load_state_dict(trained)
        model.init_buffers(torch.device("cpu"))
        with torch.no_grad():
            diff = (model.eval()(tokens) - exported(input_ids=tokens).logits).abs().max().item()
        assert diff < TOL, (case, diff)


def test_shared_expert_and_unnormalized_builtin_refuse_hf_export():
    """A built-in MoE Mixtral cannot express is refused in one line by the HF export."""
    from fsdprun.models.llama import hf_llama_config

    cfg = load_recipe("debug-moe", ["model.moe_shared_ffn_dim=32"]).config.model
    with pytest.raises(UserError, match="no shared expert"):
        hf_llama_config(cfg, torch.float32)


def test_the_run_report_and_plot_show_the_load_balance(pools, moe_folders, tmp_path):
    """What the worker logged is what the console and `fsdprun plot` show: each step line ends
    with the least balanced layer's busiest-expert and busiest-rank ratios, the summary has a
    table of each layer's busiest expert over the run, and the plot a seventh panel with both
    ratios at every logged step."""
    from rich.console import Console

    from fsdprun.report.console import Reporter
    from fsdprun.report.plot import EXPERT_TITLE, build_figure, read_run

    run = _train(pools, moe_folders, "debug-moe", 2)
    console = Console(record=True, width=200, highlight=False)
    reporter = Reporter(console, live=False)
    for event in (run.start, *run.steps, run.summary):
        reporter.handle(event)
    text = console.export_text()
    for step in run.steps:
        figures = step["experts"]
        assert (f"experts max/mean {figures['worst_max_over_mean']:.2f}, ranks "
                f"{figures['ranks']['worst_max_over_mean']:.2f}") in text  # fmt: skip
    assert "expert parallel: ep 2" in text
    total = run.summary["experts"]
    assert total["layers"] == [0, 1]
    table = text.split("Expert load over the logged steps")[1]
    for layer in (0, 1):
        cells = [str(layer), str(total["busiest_expert"][layer]), f"{total['max'][layer]:,}",
                 f"{total['max_over_mean'][layer]:.2f}"]  # fmt: skip
        assert any(all(c in line.split() for c in cells) for line in table.splitlines()), cells
    curves = read_run(run.run_dir)
    assert [c["expert"] for c in curves.experts] == [
        s["experts"]["worst_max_over_mean"] for s in run.steps
    ]
    assert [c["rank"] for c in curves.experts] == [
        s["experts"]["ranks"]["worst_max_over_mean"] for s in run.steps
    ]
    pytest.importorskip("matplotlib")
    figure = build_figure([curves])
    (panel,) = [ax for ax in figure.axes if ax.get_title() == EXPERT_TITLE]
    assert [line.get_label() for line in panel.get_lines()][-2:] == ["experts", "ep ranks"]


def test_plan_counts_what_ep_ranks_hold(pools, moe_folders):
    """`fsdprun plan` of the ep runs' own recipes: rank 0's parameters, gradients and AdamW
    state, the experts split over ep and their shards over dp_shard_mod_ep (at 2 ranks: 1, at
    4: 2), are what rank 0 held after its first step (2%)."""
    from fsdprun.tools.plan import plan_memory

    for world in (2, 4):
        run = _train(pools, moe_folders, "debug-moe", world)
        cfg = load_recipe(str(run.run_dir / "recipe.yaml"), world_size=world).config
        plan = plan_memory(cfg)
        planned = plan.strategies[plan.recipe_strategy]
        held = run.summary["ranks"][0]["model_state_bytes"]
        for part in ("params", "grads", "optimizer"):
            assert held[part] == pytest.approx(getattr(planned, part), rel=0.02), (world, part)
        (experts,) = [u for u in plan.units if u.path == "layers.0.moe.experts"]
        # 8 experts of 3 x 64 x 64 in fp32: 4 on each ep rank, over the dp_shard_mod_ep ranks.
        assert experts.shard_bytes == 4 * 3 * 64 * 64 * 4 // (world // 2)


def test_plan_offers_ep_beside_tp_and_cp_for_qwen3_30b_a3b(capsys):
    """The shipped qwen3-30b-a3b recipe (the model's published config.json) on 8 x 80 GB:
    plan's ep column keeps the expert state per rank (experts x size / 8 ranks at every ep)
    while the gathered experts shrink to ep's share, and counts the dispatch buffers and the
    all-to-all bytes each rank sends in a step, which grow with ep; the line is printed."""
    from rich.console import Console

    from fsdprun.report.console import render_plan
    from fsdprun.tools.plan import plan_recipe

    plan = plan_recipe("qwen3-30b-a3b", [])
    by_ep = {o["ep"]: o for o in plan.to_dict()["ep_degrees"]}
    assert sorted(by_ep) == [1, 2, 4, 8] and plan.ep == 8
    memory = {ep: o["memory"] for ep, o in by_ep.items()}
    assert len({m["params"] for m in memory.values()}) == 1  # 128 experts divide 8 ranks
    assert memory[8]["gathered_buffers"] < memory[1]["gathered_buffers"]
    # tokens 4096 x top-8 x hidden 2048 x 2 bytes (bf16), x 4: both ways, sent and received.
    assert memory[8]["dispatch"] == 4 * 4096 * 8 * 2048 * 2 and memory[1]["dispatch"] == 0
    # 48 layers x 2 micro-batches x 4 (out and back, forward and backward) x 7/8 of the pairs.
    assert by_ep[8]["alltoall_bytes"] == 4 * 48 * 2 * (4096 * 8 * 2048 * 2 * 7 // 8)
    assert (
        by_ep[2]["alltoall_bytes"] < by_ep[8]["alltoall_bytes"] and by_ep[1]["alltoall_bytes"] == 0
    )
    assert plan.strategies["full"].fits
    console = Console(record=True, width=300, highlight=False)
    render_plan(plan.to_dict(), console)
    text = console.export_text()
    assert (
        "Expert parallel at world size 8" in text
        and "ep 8 (recipe) [dp_shard_mod_ep 1 x ep 8]" in text
    )
    assert "dispatch buffers" in text


def test_tune_searches_ep_for_experts_and_compare_takes_ep():
    """tune's default space has parallel.ep's degrees (dividing the experts and a node's
    data-parallel ranks) for a mixture of experts and none for a dense model; compare's
    `:epN` sets parallel.ep, fsdp2 only."""
    from fsdprun.tools.compare import parse_configs
    from fsdprun.tools.tune.space import default_space

    moe = load_recipe("debug-moe", ["launch.nproc_per_node=4"]).config
    space = {k.key: k.values for k in default_space(moe, accelerator=False)}
    assert space["parallel.ep"] == ("1", "2", "4")
    dense = load_recipe("debug", []).config
    assert "parallel.ep" not in {k.key for k in default_space(dense, accelerator=False)}
    (config,) = parse_configs("fsdp2:full:ep2")
    assert config.overrides == ("fsdp.engine=fsdp2", "fsdp.sharding=full", "parallel.ep=2")
    with pytest.raises(UserError, match="expert parallel \\(parallel.ep\\) needs fsdp2"):
        parse_configs("fsdp1:ep2")
