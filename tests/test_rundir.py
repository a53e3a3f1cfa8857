"""The run directory's names (fsdprun.rundir): pure path logic, no run needed.

Run with `pytest tests/test_rundir.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdprun import rundir


@pytest.mark.parametrize("step", [0, 8, 12345678, 123456789])
def test_a_step_folder_name_reads_back_as_its_step(step):
    path = rundir.step_dir(Path("run"), step)
    assert path.parent == rundir.checkpoint_root(Path("run"))
    assert rundir.step_of(path) == step


@pytest.mark.parametrize(
    "name", ["step-00000008.old1", "step-00000008.partial", "step-", "step-x", "step-²", "8"]
)
def test_other_folder_names_are_no_checkpoint_step(name):
    assert rundir.step_of(Path(name)) is None


def test_heartbeats_by_rank_and_the_metrics_file_the_recipe_names(tmp_path):
    rundir.heartbeat_dir(tmp_path).mkdir()
    for name in ("rank-10.json", "rank-2.json", "rank-x.json", "verdict.json"):
        (rundir.heartbeat_dir(tmp_path) / name).write_text("{}")
    assert [rank for rank, _ in rundir.heartbeat_paths(tmp_path)] == [2, 10]
    assert rundir.heartbeat_path(tmp_path, 2) == rundir.heartbeat_paths(tmp_path)[0][1]
    assert rundir.metrics_path(tmp_path) == tmp_path / "metrics.jsonl"  # no recipe.yaml yet
    rundir.recipe_path(tmp_path).write_text("output:\n  metrics_file: events.jsonl\n")
    assert rundir.metrics_path(tmp_path) == tmp_path / "events.jsonl"
    assert rundir.lock_path(tmp_path).name == ".lock"
    assert rundir.lock_path(tmp_path, 3).name == ".lock.node-3"
