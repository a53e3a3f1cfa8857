"""The `profile` section through the real command (CPU, gloo, 2 ranks): one Chrome/Perfetto
trace per profiled rank holding exactly the chosen steps of FSDP training, and the final report
says where the traces are; a trace that does not fit on the disk is removed with one warning and
training goes on."""

from __future__ import annotations

import contextlib
import json

import pytest
from conftest import Run, run_fsdprun
from test_storage_faults import KINDS, fsdprun, tmpfs

from fsdprun.checkpoint import check_checkpoint, step_dir
from fsdprun.config import load_recipe
from fsdprun.errors import UserError


def test_profiled_steps_are_traced_on_each_chosen_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", "train.steps=5", "profile.enabled=true", "profile.ranks=[0,1]",
        "profile.wait=1", "profile.warmup=0", "profile.active=2", "--run-dir", str(run_dir),
        cwd=tmp_path,
    )  # fmt: skip
    run = Run(proc, run_dir).check()
    traces = [run_dir / "profile" / f"rank-{r}.pt.trace.json" for r in (0, 1)]
    for rank, path in enumerate(traces):
        trace = json.loads(path.read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        # The trace numbers steps as the log does (from 1): wait=1 leaves step 1 out, then 2
        # recorded, the steps the final report names.
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
            "ProfilerStep#2", "ProfilerStep#3"
        ]  # fmt: skip
        assert "FSDP::all_gather" in names  # the trace is of FSDP training
        assert trace["distributedInfo"]["rank"] == rank
    record = next(e for e in run.events if e["event"] == "profile")
    assert record["steps"] == [2, 3] and record["traces"] == [str(p) for p in traces]
    assert f"profiler traces of steps 2-3: {traces[0]}, {traces[1]}" in " ".join(
        proc.stdout.split()
    )
    # scripts/trace_summary.py reads the real trace: the 2 steps, and no device on a CPU run.
    summary = subprocess_run_summary(traces[0])
    assert summary.startswith("2 profiled step(s): ") and "no device activity" in summary


def test_profiling_is_off_by_default_and_the_memory_snapshot_is_cuda_only(fsdprun_runs):
    # A run of test_plan.py and test_launch.py (free when they ran first).
    run = fsdprun_runs.train("train.steps=6", "output.log_every=1", "train.micro_batch_size=1")
    assert not (run.check().run_dir / "profile").exists()
    assert not any(e["event"] == "profile" for e in run.events)
    with pytest.raises(UserError) as info:
        load_recipe("debug", ["profile.enabled=true", "profile.memory_snapshot=true"])
    assert str(info.value) == (
        "profile.memory_snapshot records the CUDA caching allocator: it is CUDA-only and this run "
        "is on cpu (launch.device=cpu); set profile.memory_snapshot=false"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_trace_that_does_not_fit_is_removed_with_one_warning(kind, tmp_path):
    # A ~5.7 MB trace per rank: a one-page tmpfs under RUN_DIR/profile, or a 2 MiB file-size
    # limit (over the ~0.9 MiB checkpoint shards, which still save).
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    full = tmpfs(run_dir / "profile", "4k") if kind == "tmpfs" else contextlib.nullcontext()
    with full:
        proc = fsdprun(
            "train", "debug", "train.steps=4", "checkpoint.every_steps=4", "profile.enabled=true",
            "profile.ranks=[0,1]", "profile.wait=1", "profile.warmup=0", "profile.active=1",
            "--run-dir", str(run_dir), cwd=tmp_path,
            fsize=(2 << 20) if kind == "rlimit" else None,
        )  # fmt: skip
        run = Run(proc, run_dir).check()
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert list((run_dir / "profile").iterdir()) == []  # no partial .tmp, no partial trace
    why = "no space left on device" if kind == "tmpfs" else "file too large: over the file-size"
    warning = f"profile: {run_dir}/profile/rank-0.pt.trace.json did not fit ({why}"
    [message] = [e["message"] for e in run.events if e["event"] == "warning"]
    assert message.startswith(warning) and message.endswith(
        "; the partial file was removed, training goes on"), message  # fmt: skip
    # The warning is stderr's one line, whole (`> log` leaves it in view), and not on stdout.
    assert proc.stderr.splitlines() == [f"warning: {message}"], proc.stderr[-3000:]
    assert "warning:" not in proc.stdout and ".pt.trace.json did not fit" not in proc.stdout
    # Rank 1 says it in its own log; the report lists both ranks as without a trace.
    [log] = (run_dir / "logs").glob("*/attempt_0/1/stderr.log")
    assert f"warning: profile: {run_dir}/profile/rank-1.pt.trace.json did not fit ({why}" in (
        log.read_text())  # fmt: skip
    record = next(e for e in run.events if e["event"] == "profile")
    assert record["traces"] == [] and record["missing"] == [0, 1]
    assert check_checkpoint(step_dir(run_dir, 4)).complete


def _trace_summary():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "trace_summary.py"
    spec = importlib.util.spec_from_file_location("trace_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_trace_summary_says_where_a_gpu_step_goes(tmp_path):
    """A hand-made CUDA trace whose answer is known: one 1000 us step; kernels over 0-300
    (a GEMM and, overlapping it on another stream, a Triton kernel at 200-300), 400-600 (flash
    attention), 650-700 (an NCCL all-gather) and a 900-1000 copy, plus a kernel outside the
    step that does not count; a blocking synchronize during the 300-400 gap."""
    ts = _trace_summary()
    events = [
        _x("ProfilerStep#3", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 0, 50),
        _x("aten::item", "cpu_op", 290, 120),
        _x("aten::_local_scalar_dense", "cpu_op", 295, 100),
        _x("cudaStreamSynchronize", "cuda_runtime", 300, 95),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 5),
        _x("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 0, 250),
        _x("triton_per_fused_add_mul_rsqrt_0", "kernel", 200, 100),
        _x("flash_fwd_kernel", "kernel", 400, 200),
        _x("ncclDevKernel_AllGather_RING_LL", "kernel", 650, 50),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 900, 100),
        _x("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 2000, 500),
    ]
    doc = ts.summarize(events)
    assert doc["steps"] == 1 and doc["wall_us"] == 1000
    assert doc["busy_us"] == 300 + 200 + 50 + 100 and doc["busy_fraction"] == 0.65
    assert doc["idle_us"] == 350
    assert {k: v["us"] for k, v in doc["by_kind"].items()} == {
        "matmul": 250, "attention": 200, "triton fused": 100, "copy": 100, "collective": 50,
    }  # fmt: skip
    assert doc["top_kernels"][0] == {"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "us": 250,
                                     "count": 1}  # fmt: skip
    assert doc["host_syncs"] == {"count": 1, "us": 95, "calls": ["cudaStreamSynchronize"]}
    # Gaps, longest first: 700-900, 300-400 (the sync; the innermost CPU op then), 600-650.
    assert [g["us"] for g in doc["gaps"]] == [200, 100, 50]
    assert doc["gaps"][0] == {"start_us": 700, "us": 200, "cpu_op": None}
    assert doc["gaps"][1] == {"start_us": 300, "us": 100, "cpu_op": "aten::_local_scalar_dense"}
    assert doc["gaps"][2]["start_us"] == 600
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = subprocess_run_summary(path)
    assert "GPU busy 65.0% (0.65 ms); idle 0.35 ms" in text
    assert "host syncs: 1 call(s), 0.10 ms (cudaStreamSynchronize)" in text


def subprocess_run_summary(path) -> str:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "trace_summary.py"
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_host_ops_count_top_level_aten_ops_outside_compiled_regions():
    """A hand-made trace of two steps: nested ops count once, ops inside a compiled region not
    at all, ops on another thread (autograd's) apart, ops outside the steps not at all."""
    ts = _trace_summary()

    def op(name, t, dur, tid=1):
        return {**_x(name, "cpu_op", t, dur), "pid": 1, "tid": tid}

    events = [
        {**_x("ProfilerStep#5", "user_annotation", 0, 100), "pid": 1, "tid": 1},
        {**_x("ProfilerStep#6", "user_annotation", 100, 100), "pid": 1, "tid": 1},
        op("aten::add", 1, 10),
        op("aten::empty", 2, 1),  # nested in add
        op("Torch-Compiled Region: 0/0", 20, 30),
        op("aten::mm", 25, 5),  # compiled
        op("aten::_foreach_mul_", 60, 5),
        op("CompiledFunctionBackward", 10, 50, tid=2),
        op("aten::mm", 12, 3, tid=2),
        op("aten::copy_", 70, 5, tid=2),  # autograd's thread, outside the compiled backward
        op("aten::add", 110, 10),
        op("aten::mul", 130, 5),
        op("aten::add", 300, 5),  # after the steps
    ]
    doc = ts.host_ops(events)
    assert doc["steps"] == 2
    assert doc["by_name"] == {"aten::add": 2, "aten::_foreach_mul_": 1, "aten::copy_": 1,
                              "aten::mul": 1}  # fmt: skip
    assert doc["per_step"] == 2.5
