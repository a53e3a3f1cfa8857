"""A launcher that dies and a rank that stops answering, through the real `fsdprun train`
(CPU, gloo, 2 ranks): no worker may outlive its launcher, and a frozen rank is named (rank, step,
phase) in one line within about launch.timeout_s."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import suppress
from pathlib import Path

import pytest
from conftest import fsdprun_env, run_fsdprun, start_fsdprun

from fsdprun.rundir import lock_path
from fsdprun.runlock import is_locked


def _gone(pid: int) -> bool:
    """Exited: every thread dead (a zombie not yet reaped by whoever inherited it counts as
    gone; its leader shows Z while its other threads still exit, holding its files)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            return False
    return True


def _heartbeats(run_dir: Path) -> dict[int, dict]:
    beats = {}
    for rank in (0, 1):
        with suppress(OSError, ValueError):
            beats[rank] = json.loads((run_dir / "heartbeat" / f"rank-{rank}.json").read_text())
    return beats


def _kill(pids) -> None:
    for pid in pids:
        with suppress(OSError):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_no_worker_outlives_a_killed_launcher(tmp_path):
    # Before the fix, a worker turned the parent-death signal into a graceful stop, saved, then
    # waited forever for the dead agent: most attempts left both workers behind.
    for attempt in range(5):
        run_dir = tmp_path / f"run{attempt}"
        proc = start_fsdprun("train", "debug", "train.steps=100000", "--run-dir", str(run_dir),
                             cwd=tmp_path)  # fmt: skip
        workers: list[int] = []
        try:
            deadline = time.time() + 120
            while time.time() < deadline and proc.poll() is None:
                beats = _heartbeats(run_dir)  # both ranks have joined the process group
                if len(beats) == 2:
                    workers = [b["pid"] for b in beats.values()]
                    break
                time.sleep(0.05)
            assert workers, f"attempt {attempt}: the workers did not start"
            proc.kill()
            proc.wait()
            deadline = time.time() + 5
            while time.time() < deadline and not all(map(_gone, workers)):
                time.sleep(0.05)
            survivors = [pid for pid in workers if not _gone(pid)]
            assert not survivors, f"attempt {attempt}: workers {survivors} outlived the launcher"
        finally:
            _kill(workers)
            if proc.poll() is None:
                proc.kill()
    # The kernel released the dead launcher's lock: no stale lock, and status says so.
    assert not is_locked(lock_path(run_dir))
    status = run_fsdprun("status", str(run_dir), "--json", cwd=tmp_path)
    doc = json.loads(status.stdout)
    assert status.returncode == 0 and not doc["running"]
    assert doc["state"] in ("not started", "failed")  # killed before or after the start event
    assert doc["locks"][0]["holder"]["pid"] == proc.pid  # the last holder, not released cleanly


TIMEOUT_S = 4


@pytest.mark.parametrize(
    ("phase", "where", "what"),
    [
        ("step", "at step 3", "(last step 3, no heartbeat for"),
        ("save", "in the checkpoint save at step 3", "(last step 3, in the checkpoint save, no"),
        ("eval", "in the evaluation at step 3", "(last step 3, in the evaluation, no heartbeat"),
    ],
    ids=["step", "save", "eval"],
)
def test_a_frozen_rank_is_named_within_the_timeout(tmp_path, phase, where, what):
    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", "train.steps=4", "checkpoint.every_steps=3", "eval.every_steps=3",
        f"launch.timeout_s={TIMEOUT_S}", "--run-dir", str(run_dir), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_FREEZE_AT=f"1:3:{phase}"), timeout=180,
    )  # fmt: skip
    ended = time.time()
    frozen = _heartbeats(run_dir)[1]  # written just before rank 1 stopped itself
    try:
        assert proc.returncode == 1, proc.stderr[-2000:]
        line = proc.stderr.strip()
        assert "\n" not in line and "Traceback" not in line, line
        assert line.startswith("error: rank 0 failed: ")
        assert f"a collective timed out {where} (launch.timeout_s={TIMEOUT_S})" in line
        assert f"stopped answering: rank 1 {what}" in line
        assert f"pid {frozen['pid']}" in line
        # Named, and the run over, within about the timeout (the agent alone would wait 30 s
        # more for the frozen rank to die).
        assert ended - frozen["time"] < TIMEOUT_S + 10, ended - frozen["time"]
        assert _gone(frozen["pid"])
    finally:
        _kill([frozen["pid"]])


def test_heartbeats_name_the_stale_and_the_behind_but_not_the_waiting(tmp_path):
    from fsdprun.train.guard import Heartbeat

    beat = Heartbeat(tmp_path, 0, world_size=4, timeout_s=10)
    beat.beat(7, "save")
    now = time.time()
    others = {
        1: {"step": 7, "phase": "save", "seq": 1, "time": now - 0.5},  # waiting with rank 0
        2: {"step": 7, "phase": "save", "seq": 1, "time": now - 6},  # frozen: silent > 10/2 s
        3: {"step": 6, "phase": "step", "seq": 0, "time": now},  # alive, one step behind
    }
    for rank, rec in others.items():
        rec.update(pid=1000 + rank, host="elsewhere")  # another node: nothing is killed
        (tmp_path / "heartbeat" / f"rank-{rank}.json").write_text(json.dumps(rec))
    silent = beat.silent()
    assert sorted(silent) == [2, 3]
    text = beat.describe(silent)
    assert text.startswith("stopped answering: rank 2 (last step 7, in the checkpoint save, no ")
    assert "rank 3 (last step 6) on elsewhere, pid 1003; the others reached step 7" in text
