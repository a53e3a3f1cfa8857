"""Engines (fsdp2, fsdp1, ddp) and sharding strategies: same losses, model state in the expected
order and as planned, the knob translation, and `fsdprun compare` (real runs, gloo, 2-4 ranks)."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fsdprun_env, read_tables, run_fsdprun
from rich.console import Console

from fsdprun.config import Engine as EngineKind
from fsdprun.config import load_recipe
from fsdprun.device import resolve_device_kind
from fsdprun.engines import Engine, translate
from fsdprun.errors import UserError
from fsdprun.tools.compare import cells, markdown, parse_configs, render
from fsdprun.tools.plan import plan_memory

FP32 = ["precision.param_dtype=fp32", "precision.reduce_dtype=fp32"]
# Every engine, and every sharding strategy under at least one of them (test_matrix.py covers the
# engine x sharding pairs, test_memory_contract.py what plan says of each at world 8 and 64);
# and tensor parallel as docs/tensor-parallel.md shows it compared (fsdp2:full:tp2: tp 2 x dp 2).
CONFIGS = "ddp,fsdp1,fsdp1:none,fsdp2:grad_op,fsdp2:hybrid,fsdp2:hybrid_zero2,fsdp2:full:tp2"


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The debug recipe at 4 ranks (hybrid: 2 x 2, tp2: tp 2 x dp 2) under seven configurations,
    3 steps each (enough for the losses to part if an engine learned otherwise)."""
    tmp = tmp_path_factory.mktemp("compare")
    proc = run_fsdprun(
        "compare", "debug", "--configs", CONFIGS, "--steps", "3", "--nproc-per-node", "4",
        *FP32, "fsdp.shard_group_size=2", "output.log_every=1", "checkpoint.save_final=false",
        "--run-dir", str(tmp / "cmp"), "--json", cwd=tmp, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    return report, {r["label"]: r for r in report["results"]}


def test_every_engine_and_strategy_gives_the_same_losses(compared):
    _, results = compared
    ref = results["ddp"]["losses"]
    assert len(ref) == 3
    for label, r in results.items():
        assert r["ok"], (label, r["error"])
        assert r["losses"] == pytest.approx(ref, abs=1e-5), label


def test_model_state_per_rank_orders_as_sharding_promises(compared):
    _, results = compared
    state = {label: r["model_state_bytes"] for label, r in results.items()}
    # ddp holds everything; hybrid shards over 2 of the 4 ranks; full over all 4.
    assert state["ddp"] > state["fsdp2:hybrid"] > state["fsdp1"]
    assert state["fsdp1"] == pytest.approx(state["ddp"] / 4, rel=0.02)
    assert state["fsdp2:hybrid"] == pytest.approx(state["ddp"] / 2, rel=0.02)
    # Between steps ZeRO-2 variants hold what their ZeRO-3 siblings hold; none holds it all.
    assert state["fsdp2:grad_op"] == pytest.approx(state["ddp"] / 4, rel=0.02)
    assert state["fsdp2:hybrid_zero2"] == state["fsdp2:hybrid"]
    assert state["fsdp1:none"] == pytest.approx(state["ddp"], rel=0.02)


def test_plan_matches_measured_model_state_for_every_engine(compared):
    report, results = compared
    for label, r in results.items():
        cfg = load_recipe(f"{r['run_dir']}/recipe.yaml").config
        plan = plan_memory(cfg)
        s = plan.strategies[plan.recipe_strategy]
        planned = s.params + s.grads + s.optimizer
        assert planned == pytest.approx(r["model_state_bytes"], rel=0.05), label


def test_run_header_prints_the_knob_translation(compared):
    report, results = compared
    log = "".join(
        (Path(results[label]["run_dir"]) / "compare.log").read_text()
        for label in ("fsdp1", "fsdp2:grad_op")
    )
    assert "fsdp.backward_prefetch=pre -> backward_prefetch=BackwardPrefetch.BACKWARD_PRE" in log
    assert "fsdp.limit_all_gathers=true -> no effect: FSDP2" in log
    table = markdown(report)
    assert table.splitlines()[0] == "|  | " + " | ".join(CONFIGS.split(",")) + " |"
    assert "(4.00x)" not in table.splitlines()[4]  # model state is relative to ddp: below 1x
    assert "(0.25x)" in table.splitlines()[5] or "(0.25x)" in table


def test_compare_table_reads_whole_at_80_columns(compared):
    report, _ = compared
    chosen = ("fsdp2:grad_op", "fsdp2:hybrid", "fsdp2:hybrid_zero2")  # the longest labels
    three = {**report, "results": [r for r in report["results"] if r["label"] in chosen]}
    console = Console(width=80, record=True)
    render(three, "debug", console)
    text = console.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    [(header, rows)] = read_tables(text, key=1).values()
    assert (header, rows) == cells(three)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_compare_plot_draws_the_table_as_bars(compared, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install 'fsdprun[plot]'")
    from fsdprun.report.plot import DPI, compare_figure

    report, results = compared
    fig = compare_figure(report)
    fig.savefig(tmp_path / "cmp.png", dpi=DPI)
    assert png_size(tmp_path / "cmp.png") == (1500, 900)
    tokens, step_time, loss, memory, state = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [
        "tokens/s", "step time", "final loss", "peak RSS per rank", "model state per rank"
    ]  # fmt: skip
    labels = CONFIGS.split(",")
    units = {"tokens/s": 1, "ms": 1e-3, "loss": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    assert step_time.get_ylabel() == "ms per step (median)"
    assert loss.get_ylabel() == "loss (cross-entropy, nats/token)"
    assert memory.get_ylabel() == "MiB (peak RSS, max over ranks)"  # the debug model: MiB
    assert state.get_ylabel().startswith(("KiB", "MiB"))
    for ax, key in ((tokens, "tokens_per_s"), (step_time, "step_time_p50_s"),
                    (loss, "final_loss"), (memory, "peak_memory_bytes"),
                    (state, "model_state_bytes")):  # fmt: skip
        unit = units[ax.get_ylabel().split()[0]]
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        heights = [bar.get_height() for bar in ax.patches]
        assert heights == pytest.approx([results[k][key] / unit for k in labels], rel=1e-9)
    # The table's ratios to the first configuration label the bars; the final loss its
    # difference (every engine learns the same: +0.0000).
    texts = [t.get_text() for t in state.texts]
    ratio = results["fsdp1"]["model_state_bytes"] / results["ddp"]["model_state_bytes"]
    assert texts[labels.index("fsdp1")].endswith(f"{ratio:.2f}x") and "x" not in texts[0]
    ms = results["fsdp1"]["step_time_p50_s"] * 1e3
    ratio = results["fsdp1"]["step_time_p50_s"] / results["ddp"]["step_time_p50_s"]
    assert step_time.texts[1].get_text() == f"{ms:,.1f} ms\n{ratio:.2f}x"
    assert [t.get_text() for t in loss.texts] == [
        f"{results[k]['final_loss']:.4f}" + ("" if k == "ddp" else "\n+0.0000") for k in labels
    ]


def test_a_configuration_that_fails_shows_its_error_and_the_others_still_run(tmp_path):
    # cpu_offload is valid for fsdp2 but not for ddp: ddp's column holds the reason.
    plot = ["--plot", str(tmp_path / "cmp.png")] if importlib.util.find_spec("matplotlib") else []
    proc = run_fsdprun(
        "compare", "debug", "--configs", "ddp,fsdp2", "--steps", "2", "fsdp.cpu_offload=true",
        "output.log_every=1", "--run-dir", str(tmp_path / "cmp"), "--json", *plot, cwd=tmp_path,
    )  # fmt: skip
    if plot:  # drawn although a configuration failed
        assert png_size(tmp_path / "cmp.png") == (1500, 900)
        assert f"wrote {tmp_path / 'cmp.png'}" in proc.stderr
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    by_label = {r["label"]: r for r in report["results"]}
    assert not by_label["ddp"]["ok"] and "cpu_offload" in by_label["ddp"]["error"]
    assert by_label["fsdp2"]["ok"] and len(by_label["fsdp2"]["losses"]) == 2
    # The table says it in the ddp column, under the figures of the run that worked.
    error_row = markdown(report).splitlines()[-1]
    assert error_row.startswith("| error | fsdp.cpu_offload needs a sharding engine") and (
        error_row.endswith("|  |")
    )


def test_compare_refuses_bad_configs_before_running_anything(tmp_path):
    proc = run_fsdprun("compare", "debug", "--configs", "fsdp3", cwd=tmp_path,
                       env=fsdprun_env())  # fmt: skip
    assert proc.returncode == 2 and "unknown engine 'fsdp3'" in proc.stderr
    assert not (tmp_path / "runs").exists()
    # A picture that could not be written is refused before the runs, not after them.
    proc = run_fsdprun("compare", "debug", "--plot", str(tmp_path / "no" / "c.png"),
                       cwd=tmp_path, env=fsdprun_env())  # fmt: skip
    assert proc.returncode == 2 and f"folder {tmp_path / 'no'} does not exist" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fsdp2:zero3", "unknown sharding 'zero3'"),
        ("ddp:full", "ddp has no sharding strategies"),
        ("fsdp2,fsdp2", "listed twice"),
        (",", "--configs is empty"),
    ],
)
def test_parse_configs_errors(text, message):
    with pytest.raises(UserError, match=message):
        parse_configs(text)


def test_parse_configs_overrides():
    configs = parse_configs("ddp, fsdp1:hybrid_zero2")
    assert [(c.label, c.overrides) for c in configs] == [
        ("ddp", ("fsdp.engine=ddp",)),
        ("fsdp1:hybrid_zero2", ("fsdp.engine=fsdp1", "fsdp.sharding=hybrid_zero2")),
    ]


def _knobs(*overrides: str, world: int = 2) -> dict[str, str]:
    cfg = load_recipe("debug", [*overrides, f"launch.nproc_per_node={world}"]).config
    return {k.key: k.applied for k in translate(cfg)}


def test_translation_fsdp1_spells_the_article_knobs():
    k = _knobs("fsdp.engine=fsdp1", "fsdp.sharding=hybrid", "fsdp.shard_group_size=2",
               "fsdp.backward_prefetch=post", "fsdp.forward_prefetch=1", "fsdp.wrap=size",
               "fsdp.min_num_params=5000", "precision.param_dtype=bf16", world=4)  # fmt: skip
    assert k["fsdp.sharding"] == (
        "sharding_strategy=ShardingStrategy.HYBRID_SHARD on a (2 x 2) replicate x shard mesh"
    )
    assert k["fsdp.backward_prefetch"] == "backward_prefetch=BackwardPrefetch.BACKWARD_POST"
    assert k["fsdp.forward_prefetch"] == "forward_prefetch=True (one unit ahead)"
    assert k["fsdp.wrap"] == "auto_wrap_policy=size_based_auto_wrap_policy(min_num_params=5000)"
    assert k["precision.param_dtype"].startswith("MixedPrecision(param_dtype=torch.bfloat16")
    assert k["precision.param_dtype"].endswith("buffer_dtype=None (the RoPE table stays fp32))")
    k = _knobs("fsdp.engine=fsdp1", "precision.param_dtype=fp32", "precision.buffer_dtype=bf16")
    assert k["precision.param_dtype"] == (
        "MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, "
        "buffer_dtype=torch.bfloat16)"
    )
    assert _knobs("precision.buffer_dtype=bf16")["precision.buffer_dtype"].startswith("no effect")


def test_translation_fsdp2_says_what_it_cannot_do():
    k = _knobs("fsdp.backward_prefetch=none", "fsdp.sharding=grad_op")
    assert "cannot turn backward prefetch off" in k["fsdp.backward_prefetch"]
    assert k["fsdp.sharding"] == "1-D mesh of 2 ranks, reshard_after_forward=False"
    assert k["fsdp.limit_all_gathers"].startswith("no effect")
    k = _knobs("fsdp.sharding=hybrid", "fsdp.shard_group_size=2", "fsdp.backward_prefetch=3",
               world=4)  # fmt: skip
    assert k["fsdp.sharding"] == "2-D mesh (2 replicate x 2 shard), reshard_after_forward=True"
    assert k["fsdp.backward_prefetch"] == "set_modules_to_backward_prefetch: 3 units ahead"
    # reshard_after_forward (issue 2's key) still works and overrides the sharding.
    k = _knobs("fsdp.reshard_after_forward=false")
    assert k["fsdp.sharding"].endswith("reshard_after_forward=False")


def test_translation_says_how_accumulation_reduces():
    key = "fsdp.accumulate_unsharded"
    assert _knobs()[key] == "reduce-scatter into the gradient shards on every micro-step"
    hybrid = _knobs("fsdp.sharding=hybrid", "fsdp.shard_group_size=2", world=4)[key]
    assert hybrid.endswith("the replica all-reduce on the last one only (set_requires_all_reduce)")
    assert _knobs("fsdp.sharding=none")[key] == hybrid
    assert _knobs("fsdp.accumulate_unsharded=true")[key].startswith(
        "set_requires_gradient_sync(False) on accumulation micro-steps: every rank keeps the "
        "whole model's unsharded gradients"
    )
    fsdp1 = _knobs("fsdp.engine=fsdp1", "fsdp.sharding=hybrid", "fsdp.shard_group_size=2", world=4)
    assert fsdp1[key].endswith("replica all-reduce too (FSDP1 cannot defer only the all-reduce)")
    assert _knobs("fsdp.engine=fsdp1", "fsdp.accumulate_unsharded=true")[key].startswith(
        "no_sync() on accumulation micro-steps: every rank keeps"
    )
    for whole in (["fsdp.engine=ddp"], ["fsdp.engine=fsdp1", "fsdp.sharding=none"]):
        assert _knobs(*whole)[key] == (
            "no_sync() on accumulation micro-steps (the gradients are whole anyway)"
        )


def test_translation_ddp():
    k = _knobs("fsdp.engine=ddp", "precision.param_dtype=bf16", "precision.reduce_dtype=bf16")
    assert k["precision.param_dtype"] == (
        "parameters stay fp32; compute under torch.autocast(torch.bfloat16)"
    )
    assert k["precision.reduce_dtype"].startswith("comm hook bf16_compress_hook")
    assert k["fsdp.wrap"].startswith("no effect")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fsdp.backward_prefetch=later"], "fsdp.backward_prefetch: 'later' is not valid"),
        (["fsdp.engine=fsdp1", "fsdp.reshard_after_forward=false"],
         "fsdp.reshard_after_forward is an fsdp2 knob"),
        (["fsdp.sharding=hybrid", "fsdp.shard_group_size=3"],
         "fsdp.shard_group_size (3) must divide the world size (2)"),
        (["fsdp.engine=ddp", "fsdp.cpu_offload=true"], "fsdp.cpu_offload needs a sharding engine"),
        (["fsdp.engine=fsdp1", "fsdp.use_orig_params=false", "optim.weight_decay=0.1"],
         "optim.weight_decay=0"),
    ],
)  # fmt: skip
def test_engine_key_errors(overrides, message):
    with pytest.raises(UserError) as e:
        load_recipe("debug", overrides)
    assert message in str(e.value)


def test_plan_units_follow_the_engine():
    def units(*overrides: str) -> list[tuple[bool, object, object]]:
        plan = plan_memory(load_recipe("debug", list(overrides)).config)
        return [(u.reshard_after_forward, u.forward_prefetch, u.backward_prefetch)
                for u in plan.units]  # fmt: skip

    # fsdp2 keeps the last block gathered for backward; FSDP1 reshards every unit but the root.
    assert units() == [(True, [], "implicit"), (False, [], "implicit"), (False, [], [])]
    assert units("fsdp.engine=fsdp1", "fsdp.forward_prefetch=2", "fsdp.backward_prefetch=post") == [
        (True, ["layers.1"], "BACKWARD_POST"), (True, [], "BACKWARD_POST"), (False, [], []),
    ]  # fmt: skip
    ddp = plan_memory(load_recipe("debug", ["fsdp.engine=ddp"]).config)
    assert ddp.units == [] and ddp.recipe_strategy == "ddp"
    assert ddp.knobs[0]["applied"].startswith("DistributedDataParallel")


def test_engine_rules_load_without_torch():
    # config, `plan` and the run header read the knob tables and unit plans (and the TP plan's
    # rows, `engines.tp.plan_rows`); config must be able to import the engines package without
    # paying for torch.
    code = (
        "import sys, fsdprun.engines, fsdprun.engines.fsdp2, fsdprun.engines.fsdp1, "
        "fsdprun.engines.ddp, fsdprun.engines.tp; "
        "assert 'torch' not in sys.modules, sorted(sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_fsdp1_refuses_a_tied_pretrained_folder_before_wrapping(tmp_path):
    from fsdprun.engines.fsdp1 import refuse_tied_pretrained

    class Weights:
        path = tmp_path

    refuse_tied_pretrained(None, {"hf.lm_head.weight": "hf.model.embed_tokens.weight"})
    refuse_tied_pretrained(Weights(), {})
    with pytest.raises(UserError) as e:
        refuse_tied_pretrained(Weights(), {"hf.lm_head.weight": "hf.model.embed_tokens.weight"})
    assert str(e.value) == (
        f"model.hf_path: {tmp_path} ties lm_head.weight to model.embed_tokens.weight, which "
        "fsdp.engine=fsdp1 would train untied; use fsdp.engine=fsdp2 or ddp"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["fsdp.engine=ddp", "precision.param_dtype=bf16", "precision.reduce_dtype=fp16"],
        ["fsdp.engine=fsdp1", "precision.param_dtype=fp16", "precision.buffer_dtype=fp16"],
        # Hybrid with the default group (one node = every rank): a (1 x 2) mesh.
        ["fsdp.engine=fsdp1", "fsdp.sharding=hybrid", "precision.param_dtype=bf16"],
    ],
    ids=["ddp-autocast-bf16-fp16-compress-hook", "fsdp1-fp16-grad-scaler", "fsdp1-hybrid-1-node"],
)
def test_low_precision_trains_under_each_engine(gloo_pool, overrides):
    # Engine-level: trained in the session's gloo process group (tests/gloo_pool.py).
    run = gloo_pool.train(
        *overrides, "train.steps=8", "output.log_every=1", "checkpoint.save_final=false"
    )
    losses = run.losses
    assert len(losses) == 8 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize("kind", list(EngineKind))
def test_fp16_loss_scaling_is_on_off_cuda(kind):
    # Issue 10 item 9: ShardedGradScaler() defaults to cuda and disables itself on cpu/xpu/npu.
    model = torch.nn.Linear(2, 2)
    engine = Engine(kind=kind, model=model, inner=model, units=[], knobs=[],
                    matrix_names=frozenset(), device_type="cpu")  # fmt: skip
    scaler = engine.grad_scaler()
    assert scaler.is_enabled()
    assert scaler.scale(torch.ones(())).item() == 2.0**16


def test_ddp_bf16_reduction_on_gloo_is_a_user_error(tmp_path):
    proc = run_fsdprun(
        "train", "debug", "fsdp.engine=ddp", "precision.reduce_dtype=bf16", "train.steps=2",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "precision.reduce_dtype=bf16 with fsdp.engine=ddp needs NCCL or XCCL" in proc.stderr


def test_tied_embeddings_train_the_same_model_under_every_engine(fsdprun_runs, gloo_pool):
    # Issue 10 item 4: ddp and fsdp1 materialize with to_empty, which unties the output projection
    # from the embedding unless it is tied again: more parameters, other losses. The fsdp2 run is
    # launched (test_inspect_export.py reads its checkpoint); ddp and fsdp1 train in the session's
    # gloo process group (tests/gloo_pool.py).
    args = ("model.tie_embeddings=true", "train.steps=5", "output.log_every=1")
    runs = {"fsdp2": fsdprun_runs.train("fsdp.engine=fsdp2", *args).check()}
    for engine in ("fsdp1", "ddp"):
        runs[engine] = gloo_pool.train(f"fsdp.engine={engine}", *args)
    num_params = runs["fsdp2"].start["num_params"]
    assert num_params == 115_008  # the debug model with one 256 x 64 matrix for both
    for engine, run in runs.items():
        assert run.start["num_params"] == num_params, engine
        held = [r["model_state_bytes"]["params"] for r in run.summary["ranks"]]
        # ddp holds the whole model on each rank; fsdp1 and fsdp2 shard it over the 2 ranks
        # (its shapes are even: no padding).
        trained = held[0] if engine == "ddp" else sum(held)
        assert trained == 4 * num_params, engine
        assert run.losses == pytest.approx(runs["fsdp2"].losses, abs=1e-5), engine


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_fsdp1_cpu_offload_is_refused_on_cpu_before_launch(tmp_path, device):
    # Issue 10 item 14: FSDP1's CPUOffload pins memory and crashed every rank on a CPU run.
    if resolve_device_kind(device) != "cpu":
        pytest.skip("launch.device=auto picks an accelerator on this machine")
    args = ("debug", "fsdp.engine=fsdp1", "fsdp.cpu_offload=true", f"launch.device={device}")
    for command in (["config"], ["train", "--run-dir", str(tmp_path / "run")]):
        proc = run_fsdprun(command[0], *args, *command[1:], cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "fsdp.cpu_offload=true with fsdp.engine=fsdp1 needs an accelerator" in lines[0]
        assert f"this run is on CPU (launch.device={device}); use fsdp.engine=fsdp2" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_materializes_offloaded_parameters_on_the_cpu(monkeypatch, offload):
    """With fsdp.cpu_offload the parameters are made on the CPU (FSDP2 refuses to offload
    parameters materialized on the GPU: seen on an H200) and the buffers on the compute device;
    without it both on the compute device. The sharding itself is stubbed: only where the
    engine asks for the values is checked ("meta" stands in for a GPU here)."""
    # What build imports as it runs, imported first: a module first imported under the patch
    # below would keep the stub for good (adapters imports init_weights by name).
    from fsdprun.engines import adapters, fsdp2, mesh, tp, units  # noqa: F401
    from fsdprun.engines import weights as W
    from fsdprun.models.llama import ModelArgs, Transformer

    seen = {}
    monkeypatch.setattr(mesh, "build_device_mesh", lambda *a, **k: None)
    monkeypatch.setattr(fsdp2, "apply_fsdp", lambda *a, **k: [])
    monkeypatch.setattr(W, "init_weights", lambda model, **kw: seen.update(kw))
    cfg = load_recipe("debug", [f"fsdp.cpu_offload={str(offload).lower()}"]).config
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64,
                                      vocab_size=64, max_seq_len=16))  # fmt: skip
    gpu = torch.device("meta")
    common = {"kind": EngineKind.fsdp2, "inner": model, "knobs": [], "matrix_names": frozenset()}
    fsdp2.build(model, cfg, device=gpu, device_kind="cuda", world_size=1, weights=None,
                common=common)  # fmt: skip
    assert seen["device"] == (torch.device("cpu") if offload else gpu)
    assert seen["buffer_device"] == gpu
