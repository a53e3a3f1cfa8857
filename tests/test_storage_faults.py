"""Tampered checkpoints, through the real `fsdprun` command (part of the fault corpus; CPU,
gloo, 2 ranks).

Each case asserts the exit code, one line on stderr (no traceback) and what is on disk before
and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Run, run_fsdprun

from fsdprun.checkpoint import check_checkpoint, step_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with complete checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    proc = run_fsdprun("train", "debug", "train.steps=4", "checkpoint.every_steps=2",
                       "output.log_every=1", "--run-dir", str(root / "run"), cwd=root)  # fmt: skip
    return Run(proc, root / "run").check().run_dir


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# Tampered checkpoints


def test_a_tampered_manifest_is_corrupt_and_resume_falls_back(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    ck2, ck4 = step_dir(run_dir, 2), step_dir(run_dir, 4)
    (ck4 / "manifest.json").write_text("[1, 2]\n")
    line = one_line(run_fsdprun("inspect-checkpoint", str(ck4), cwd=tmp_path), 1)
    assert "manifest.json is corrupt" in line and "the top level is a list" in line, line
    line = one_line(run_fsdprun("inspect-checkpoint", str(run_dir), cwd=tmp_path), 1)
    assert "1 of 2 checkpoints incomplete: step-00000004: manifest.json is corrupt" in line
    line = one_line(run_fsdprun("export", str(ck4), "--out", str(tmp_path / "out"),
                                cwd=tmp_path), 2)  # fmt: skip
    assert "manifest.json is corrupt" in line and not (tmp_path / "out").exists()
    before = snapshot(ck2)
    proc = run_fsdprun("resume", str(run_dir), "train.steps=5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping incomplete checkpoint" in proc.stderr and "manifest.json is corrupt" in (
        proc.stderr)  # fmt: skip
    assert "Traceback" not in proc.stderr and "from step-00000002" in proc.stdout
    assert snapshot(ck2) == before and check_checkpoint(step_dir(run_dir, 5)).complete
    # An empty object has none of the fields: corrupt, not complete.
    (ck4 / "manifest.json").write_text("{}\n")
    line = one_line(run_fsdprun("inspect-checkpoint", str(ck4), cwd=tmp_path), 1)
    assert "manifest.json is corrupt" in line and "'format_version' is missing" in line, line


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        (lambda m: m.pop("recipe"), "'recipe' is missing"),
        (lambda m: m.update(step="4"), "'step' is a string, not an integer"),
        (lambda m: m.update(files=[1]), "'files' is a list, not an object"),
        (lambda m: m["files"].update({"__0_0.distcp": "big"}), "'files' values must be"),
        (lambda m: m.update(recipe={"model": 1}), "'recipe.model' is an integer, not an object"),
        (lambda m: m.update(step=9), "says step 9 but the folder is step-00000004"),
        (lambda m: m.update(sha256=None), "'sha256' is null, not an object"),
    ],
)
def test_manifest_shape_is_validated_in_one_place(trained, tmp_path, change, phrase):
    ck4 = tmp_path / "step-00000004"
    shutil.copytree(step_dir(trained, 4), ck4)
    manifest = json.loads((ck4 / "manifest.json").read_text())
    change(manifest)
    (ck4 / "manifest.json").write_text(json.dumps(manifest))
    status = check_checkpoint(ck4)
    assert not status.complete and "manifest.json is corrupt" in status.reason, status.reason
    assert phrase in status.reason, status.reason
    assert os.path.exists(ck4 / "manifest.json")
