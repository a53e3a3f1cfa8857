"""Launch arguments, device selection errors, the report rendering, and running under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Run, fsdprun_env, run_fsdprun
from rich.console import Console

from fsdprun.config import load_recipe
from fsdprun.device import BACKENDS, check_nproc, process_group_backend, resolve_device_kind
from fsdprun.errors import UserError
from fsdprun.launch import build_launch_plan
from fsdprun.report import Reporter


def test_single_node_binds_loopback_and_multi_node_uses_the_given_endpoint(tmp_path):
    cfg = load_recipe("debug").config
    plan = build_launch_plan(cfg, tmp_path, device_kind="cpu")
    assert plan.config.rdzv_endpoint == "127.0.0.1:0"
    assert plan.config.rdzv_backend == "c10d" and plan.config.nproc_per_node == 2
    assert (plan.config.min_nodes, plan.config.max_nodes) == (1, 1)
    assert "is_host" not in plan.config.rdzv_configs
    over = ["launch.nnodes=2", "launch.node_rank=1", "launch.rdzv_endpoint=10.1.2.3:29400"]
    cfg = load_recipe("debug", over).config
    plan = build_launch_plan(cfg, tmp_path, device_kind="cpu")
    assert plan.config.rdzv_endpoint == "10.1.2.3:29400"
    assert plan.config.rdzv_configs["is_host"] is False
    assert (plan.config.min_nodes, plan.config.max_nodes) == (2, 2)


def test_missing_devices_are_user_errors():
    with pytest.raises(UserError, match="torch_npu is not importable.*launch.device=cpu"):
        resolve_device_kind("npu")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(UserError, match="no cuda device is available"):
            resolve_device_kind("cuda")
        assert resolve_device_kind("auto") == "cpu"
    check_nproc("cpu", 64)  # CPU ranks are processes: any number


def test_npu_without_torch_npu_exits_2_before_launch(tmp_path):
    proc = run_fsdprun("train", "debug", "launch.device=npu", "--run-dir", "r", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "torch_npu" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_multi_node_without_endpoint_is_refused(tmp_path):
    proc = run_fsdprun("train", "debug", "--nnodes", "2", "--nproc-per-node", "1", cwd=tmp_path)
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr


def _events() -> list[dict]:
    ranks = [
        {"rank": r, "peak_rss_bytes": 300 * 2**20,
         "model_state_bytes": {"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                               "total": 2**22}}
        for r in (0, 1)
    ]  # fmt: skip
    return [
        {"event": "start", "recipe": "debug", "num_params": 131_000, "world_size": 2, "nnodes": 1,
         "device_name": "CPU (x86_64)", "backend": "gloo", "engine": "fsdp2",
         "fsdp_units": ["layers.0", "layers.1", "<root>"], "param_dtype": "fp32",
         "reduce_dtype": "fp32", "activation_checkpointing": "none (0 blocks)", "compile": "off",
         "global_batch_size": 8, "seq_len": 64, "tokens_per_step": 512, "micro_batch_size": 2,
         "grad_accum_steps": 2, "steps": 2, "param_shard_bytes": 2**20, "param_bytes": 2**21,
         "run_dir": "runs/x"},
        {"event": "step", "step": 2, "loss": 4.5, "lr": 1e-3, "grad_norm": 0.5,
         "tokens_per_s": 1234.0, "step_time_s": 0.05},
        {"event": "summary", "final_loss": 4.5, "timing_warmup_steps": 1,
         "flops_per_token": 786_432, "mfu_note": "no peak figure for CPUs",
         "metrics_file": "runs/x/metrics.jsonl", "wall_time_s": 3.0, "ranks": ranks,
         "throughput": {"tokens_per_s": 7500.0, "tokens_per_s_per_device": 3750.0,
                        "step_time_p50_s": 0.068, "step_time_p90_s": 0.0825,
                        "tflops_per_device": 0.003, "mfu": None, "steps_measured": 28}},
    ]  # fmt: skip


def test_report_renders_the_numbers_it_is_given():
    console = Console(record=True, width=160)
    reporter = Reporter(console)
    for event in _events():
        reporter.handle(event)
    text = console.export_text()
    assert "world size 2 (1 node(s))" in text and "parameter shard per rank: 1.00 MiB" in text
    assert "step 2 | loss 4.5000 | lr 1.00e-03" in text
    assert "7,500" in text and "3,750" in text and "68.0 ms" in text and "82.5 ms" in text
    assert "n/a (no peak figure for CPUs)" in text
    assert "300.00 MiB" in text and "4.00 MiB" in text
    gpu = _events()
    gpu[2]["throughput"]["mfu"] = 0.523
    for r in gpu[2]["ranks"]:
        del r["peak_rss_bytes"]
        r.update(peak_allocated_bytes=40 * 2**30, peak_reserved_bytes=42 * 2**30)
    console = Console(record=True, width=160)
    Reporter(console).handle(gpu[2])
    text = console.export_text()
    assert "52.3%" in text and "40.00 GiB" in text and "42.00 GiB" in text


def test_runs_as_a_worker_under_torchrun(tmp_path):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    fsdprun = str(Path(sys.executable).parent / "fsdprun")
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:0", fsdprun, "train", "debug", "train.steps=3",
         "output.log_every=1", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=fsdprun_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Run(proc, tmp_path / "run")
    assert run.start["world_size"] == 2 and len(run.losses) == 3
    assert "Throughput" in proc.stdout and (tmp_path / "run" / "recipe.yaml").exists()


def test_workers_fork_on_cpu_and_spawn_on_accelerators(monkeypatch):
    from fsdprun.errors import UserError
    from fsdprun.launch import start_method

    monkeypatch.delenv("FSDPRUN_START_METHOD", raising=False)
    assert start_method("cpu") == "fork"
    assert start_method("cuda") == start_method("npu") == "spawn"
    monkeypatch.setenv("FSDPRUN_START_METHOD", "spawn")
    assert start_method("cpu") == "spawn"
    monkeypatch.setenv("FSDPRUN_START_METHOD", "threads")
    with pytest.raises(UserError, match="FSDPRUN_START_METHOD='threads'"):
        start_method("cpu")


def test_a_bad_start_method_is_refused_before_the_run_dir_exists(tmp_path):
    proc = run_fsdprun("train", "debug", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                       env=fsdprun_env(FSDPRUN_START_METHOD="threads"))  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "FSDPRUN_START_METHOD='threads'" in proc.stderr and not (tmp_path / "run").exists()


def test_cpu_offload_on_an_accelerator_adds_gloo_for_cpu_tensors():
    # Clipping all-reduces the norm of CPU gradients under fsdp.cpu_offload: an accelerator's
    # backend alone (NCCL) has no CPU collectives.
    for kind, backend in BACKENDS.items():
        assert process_group_backend(kind, cpu_offload=False) == backend
        offload = process_group_backend(kind, cpu_offload=True)
        if kind == "cpu":
            assert offload == "gloo"
        else:
            by_device = dict(part.split(":") for part in offload.split(","))
            assert by_device == {"cpu": "gloo", kind: backend}
    assert process_group_backend("cuda", cpu_offload=True) == "cpu:gloo,cuda:nccl"
