"""float8 (`precision.float8`): the device check, the Linear filters and the all-gather choice
are pure functions tested here (the small-Linear filter against torchao's own); the conversion
is checked on meta models; and float8 training runs on CPU gloo ranks through the test-only
switch (torch's CPU build has float8 matmuls, slowly): which all-gather path each world size
takes, and that the choice leaves the losses unchanged. Speed is measured on the GPU by
scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdprun.config import load_recipe
from fsdprun.engines.float8 import (
    check_float8,
    float8_eligible,
    float8_linears,
    float8_refusal,
    output_fqns,
)
from fsdprun.errors import UserError
from fsdprun.models import build_model


@pytest.mark.parametrize(
    ("mode", "kind", "capability", "refused"),
    [
        ("off", "cpu", None, False),
        ("tensorwise", "cpu", None, True),
        ("rowwise", "npu", None, True),
        ("tensorwise", "cuda", (8, 0), True),  # A100
        ("rowwise", "cuda", (8, 6), True),
        ("tensorwise", "cuda", (8, 9), False),  # Ada
        ("rowwise", "cuda", (9, 0), False),  # Hopper
        ("tensorwise", "cuda", (10, 0), False),  # Blackwell
    ],
)
def test_float8_needs_cuda_capability_8_9(mode, kind, capability, refused):
    reason = float8_refusal(mode, kind, capability)
    assert (reason is not None) == refused
    if refused:
        assert f"precision.float8={mode}" in reason and "precision.float8=off" in reason
        assert "\n" not in reason


def test_float8_refused_on_this_cpu_before_anything_runs():
    with pytest.raises(UserError, match="precision.float8=tensorwise needs a CUDA GPU"):
        check_float8("tensorwise", "cpu")
    check_float8("off", "cpu")


@pytest.mark.parametrize(
    ("fqn", "din", "dout", "eligible"),
    [
        ("layers.0.attention.wq", 256, 256, True),
        ("layers.0.feed_forward.w1", 256, 688, True),
        ("layers.0.feed_forward.w2", 680, 256, False),  # 680 = 16 * 42.5
        ("layers.0.attention.wk", 256, 24, False),
        ("output", 256, 32000, False),  # the output projection, whatever its dims
        ("hf.lm_head", 256, 32000, False),
    ],
)
def test_float8_filter(fqn, din, dout, eligible):
    assert float8_eligible(fqn, din, dout, {"output", "hf.lm_head"}) is eligible


def test_float8_filter_on_the_built_in_llama():
    cfg = load_recipe("debug", ["model.ffn_dim=200"]).config  # 200 is not a multiple of 16
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert output_fqns(model) == {"output"}
    converted, skipped = float8_linears(model)
    assert "output" in skipped
    assert all(".feed_forward." in p for p in skipped if p != "output")
    assert {p.rsplit(".", 1)[-1] for p in converted} == {"wq", "wk", "wv", "wo"}


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_float8_conversion_swaps_exactly_the_filtered_linears(mode):
    pytest.importorskip("torchao")
    from fsdprun.engines.float8 import apply_float8

    cfg = load_recipe("debug", ["model.ffn_dim=200"]).config
    with torch.device("meta"):
        model = build_model(cfg.model)
    converted, skipped = float8_linears(model)
    names_before = [n for n, _ in model.named_parameters()]
    assert apply_float8(model, mode=mode, all_gather=mode == "tensorwise") == len(converted)
    modules = dict(model.named_modules())
    assert all(type(modules[p]).__name__ == "Float8Linear" for p in converted)
    assert all(type(modules[p]) is nn.Linear for p in skipped)
    # Same parameter names, still high-precision tensors: checkpoints are those of a bf16 run.
    assert [n for n, _ in model.named_parameters()] == names_before
    assert all(p.dtype == torch.float32 for p in model.parameters())
    if mode == "tensorwise":
        assert modules[converted[0]].config.enable_fsdp_float8_all_gather


def test_plan_gathers_converted_weights_in_one_byte_with_tensorwise():
    from fsdprun.tools.plan import plan_recipe

    common = ["precision.param_dtype=bf16", "model.ffn_dim=200"]
    bf16 = plan_recipe("debug", common)
    rowwise = plan_recipe("debug", [*common, "precision.float8=rowwise"])
    tensorwise = plan_recipe("debug", [*common, "precision.float8=tensorwise"])
    with torch.device("meta"):
        model = build_model(load_recipe("debug", common).config.model)
    block = model.layers["0"]
    converted = sum(block.get_submodule(n).weight.numel() for n in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo"))  # fmt: skip
    unit = {u.path: u for u in tensorwise.units}["layers.0"]
    plain_unit = {u.path: u for u in bf16.units}["layers.0"]
    assert plain_unit.unsharded_bytes == 2 * sum(p.numel() for p in block.parameters())
    assert unit.unsharded_bytes == plain_unit.unsharded_bytes - converted  # 1 byte, not 2
    assert [u.unsharded_bytes for u in rowwise.units] == [u.unsharded_bytes for u in bf16.units]
    # the output projection stays bf16 in the root
    assert tensorwise.units[-1].unsharded_bytes == bf16.units[-1].unsharded_bytes
    s, b = tensorwise.strategies["full"], bf16.strategies["full"]
    assert s.gathered_buffers < b.gathered_buffers
    assert any("bf16-equivalent" in n for n in tensorwise.notes)
    assert any("8 converted" in n and "output" in n for n in tensorwise.notes)


def test_float8_train_on_cpu_is_refused_before_launch(tmp_path):
    from conftest import run_fsdprun

    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", "precision.float8=tensorwise", "--run-dir", str(run_dir), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = (proc.stdout + proc.stderr).strip()
    assert "precision.float8=tensorwise needs a CUDA GPU" in out and "Traceback" not in out
    assert not run_dir.exists()  # refused before the run directory is made


@pytest.mark.parametrize(
    "mode, setting, group, on",
    [
        ("tensorwise", None, 1, False),  # auto: one rank gathers nothing
        ("tensorwise", None, 2, True),
        ("tensorwise", None, 64, True),
        ("tensorwise", True, 1, True),  # forced
        ("tensorwise", False, 8, False),
        ("rowwise", None, 8, False),  # torchao gathers only tensorwise weights in float8
        ("off", None, 8, False),
    ],
)
def test_float8_all_gather_choice(mode, setting, group, on):
    from fsdprun.engines.float8 import all_gather_choice

    chosen, why = all_gather_choice(mode, setting, group)
    assert chosen is on
    assert why.startswith("on" if on else "off")
    if setting is None and mode == "tensorwise":
        assert "auto" in why and str(group) in why


@pytest.mark.parametrize(
    "world, sharding, on",
    [(1, [], False), (8, [], True), (8, ["fsdp.sharding=none"], False),  # replicated
     (8, ["fsdp.sharding=hybrid", "fsdp.shard_group_size=4"], True),
     (8, ["fsdp.sharding=hybrid", "fsdp.shard_group_size=1"], False)],  # 8 replicas of 1
)  # fmt: skip
def test_float8_all_gather_follows_the_shard_group_of_the_recipe(world, sharding, on):
    from fsdprun.engines.float8 import float8_plan

    batch = ["train.global_batch_size=16", "train.micro_batch_size=1"]
    overrides = ["precision.float8=tensorwise", f"launch.nproc_per_node={world}", *batch]
    plan = float8_plan(load_recipe("debug", [*overrides, *sharding]).config)
    assert plan.all_gather is on


def test_float8_all_gather_true_with_rowwise_is_refused():
    with pytest.raises(UserError, match="precision.float8_all_gather=true needs "):
        load_recipe("debug", ["precision.float8=rowwise", "precision.float8_all_gather=true"])


def test_skip_small_agrees_with_torchaos_own_filter():
    torchao_float8 = pytest.importorskip("torchao.float8")
    from fsdprun.engines.float8 import float8_eligible

    dims = [16, 512, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 14336]
    for mode in ("tensorwise", "rowwise"):
        theirs = torchao_float8._auto_filter_for_recipe(mode, filter_fqns=["output"])
        for k in dims:
            for n in dims:
                with torch.device("meta"):
                    linear = nn.Linear(k, n, bias=False)
                for fqn in ("layers.0.attention.wq", "output"):
                    ours = float8_eligible(fqn, k, n, {"output"}, mode=mode, skip_small=True)
                    assert ours == theirs(linear, fqn), (mode, fqn, k, n)


def test_skip_small_on_llama_1b_keeps_the_small_kv_projections():
    from fsdprun.tools.plan import plan_recipe

    plan = plan_recipe("llama-1b", ["precision.float8=tensorwise",
                                    "precision.float8_filter=skip_small"])  # fmt: skip
    note = next(n for n in plan.notes if n.startswith("float8:"))
    # dim 2048, 8 kv heads of 128: wk and wv are 2048 -> 1024, under tensorwise's K <= 4096 and
    # N <= 1024; the 16 blocks' other 5 Linears are converted.
    assert "80 converted, 33 kept" in note and "attention.wk" in note, note
    assert "float8 all-gather off (auto" in note


def test_float8_trains_on_cpu_ranks_with_and_without_float8_all_gather(tmp_path):
    """Through `fsdprun train` (the test-only switch lets CPU ranks run float8): on 2 ranks auto
    gathers the weights in float8 and precomputes their scales; on 1 rank it does neither. The
    losses are the same: float8 all-gather casts with the scale the forward would compute."""
    pytest.importorskip("torchao")
    from conftest import Run, fsdprun_env, run_fsdprun

    from fsdprun.engines.float8 import TEST_ON_CPU_ENV

    runs = {}
    for nproc in (2, 1):
        run_dir = tmp_path / f"w{nproc}"
        proc = run_fsdprun(
            "train", "debug", "precision.float8=tensorwise", "train.steps=4",
            "output.log_every=1", "checkpoint.save_final=false", "--nproc-per-node",
            str(nproc), "--run-dir", str(run_dir), cwd=tmp_path,
            env=fsdprun_env(**{TEST_ON_CPU_ENV: "1"}),
        )  # fmt: skip
        runs[nproc] = Run(proc, run_dir).check()
    assert (
        "float8 all-gather on (auto: weights are gathered over 2 ranks)" in runs[2].start["float8"]
    )
    assert "float8 all-gather off (auto: a shard group of 1 rank" in runs[1].start["float8"]
    assert len(runs[2].losses) == 4
    assert runs[2].losses == pytest.approx(runs[1].losses, rel=1e-5)
