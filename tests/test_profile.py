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
        assert "Traceback" not in proc.stderr and not proc.stderr.strip(), proc.stderr[-3000:]
        assert list((run_dir / "profile").iterdir()) == []  # no partial .tmp, no partial trace
    why = "no space left on device" if kind == "tmpfs" else "file too large: over the file-size"
    warning = f"profile: {run_dir}/profile/rank-0.pt.trace.json did not fit ({why}"
    [message] = [e["message"] for e in run.events if e["event"] == "warning"]
    assert message.startswith(warning) and message.endswith(
        "; the partial file was removed, training goes on"), message  # fmt: skip
    assert proc.stdout.count("warning:") == 1 and f"warning: {message}" in " ".join(
        proc.stdout.split())  # fmt: skip
    # Rank 1 says it in its own log; the report lists both ranks as without a trace.
    [log] = (run_dir / "logs").glob("*/attempt_0/1/stderr.log")
    assert f"warning: profile: {run_dir}/profile/rank-1.pt.trace.json did not fit ({why}" in (
        log.read_text())  # fmt: skip
    record = next(e for e in run.events if e["event"] == "profile")
    assert record["traces"] == [] and record["missing"] == [0, 1]
    assert check_checkpoint(step_dir(run_dir, 4)).complete
