"""Process-lifetime faults through the real commands (CPU, gloo, 2 ranks): a worker killed by
SIGKILL (what the OOM killer does), a killed `fsdprun compare` whose current run must die with
it, and a run directory deleted under a live run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path

from conftest import FSDPRUN, fsdprun_env

from fsdprun.launch.killed import mem_total_bytes
from fsdprun.report.console import fmt_bytes


def _popen(cwd: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [FSDPRUN, *args], cwd=cwd, env=fsdprun_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip


def _heartbeat(run_dir: Path, rank: int) -> dict | None:
    with suppress(OSError, ValueError):
        return json.loads((run_dir / "heartbeat" / f"rank-{rank}.json").read_text())
    return None


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, ranks=(0, 1)) -> list[dict]:
    """Every rank's heartbeat once each has reached `step`."""
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        beats = [_heartbeat(run_dir, r) for r in ranks]
        if all(b is not None and b["step"] >= step for b in beats):
            return beats
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()}")


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_worker_killed_by_sigkill_is_named_with_its_step_log_and_the_oom_hint(tmp_path):
    from fsdprun.tools.plan import plan_recipe

    run_dir = tmp_path / "run"
    proc = _popen(tmp_path, "train", "debug", "train.steps=100000", "--run-dir", str(run_dir))
    try:
        victim = _wait_for_step(run_dir, 2, proc)[1]
        os.kill(victim["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    line = _one_line(err)
    last = _heartbeat(run_dir, 1)  # rank 1's last record, written before it died
    log = Path(last["log"])
    assert log.is_file() and log.parts[-2:] == ("1", "stderr.log") and run_dir in log.parents
    assert line.startswith(
        f"error: rank 1 was killed by SIGKILL at step {last['step']} (pid {victim['pid']}); "
        f"log: {log}. SIGKILL is usually the kernel's out-of-memory killer: "
    ), line
    plan = plan_recipe("debug", [])
    peak = plan.strategies[plan.recipe_strategy].total
    assert f"`fsdprun plan` puts a rank's peak memory at {fmt_bytes(peak)}" in line
    assert f"this machine has {fmt_bytes(mem_total_bytes())} (MemTotal)" in line
    assert "dmesg" in line and "oom-kill" in line and "journalctl -k" in line
