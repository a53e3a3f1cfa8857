"""The `profile` section through the real command (CPU, gloo, 2 ranks): one Chrome/Perfetto
trace per profiled rank holding exactly the chosen steps of FSDP training, and the final report
says where the traces are."""

from __future__ import annotations

import json

import pytest
from conftest import Run, run_fsdprun

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
        # The profiler numbers the steps it saw from 0: wait=1 leaves #0 out, then 2 recorded.
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
            "ProfilerStep#1", "ProfilerStep#2"
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
