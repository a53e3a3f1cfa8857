"""float8 (`precision.float8`): the device check and the Linear filter are pure functions tested
here; the conversion itself is checked on CPU (module types only: CPU has no float8 matmul, so
no float8 step runs here; the numerics are measured on the GPU by scripts/gpu_check.sh)."""

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
    assert apply_float8(model, mode=mode) == len(converted)
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
