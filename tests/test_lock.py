"""One run per directory, through the real commands (CPU, gloo, 2 ranks): of two `fsdprun train`
or two `fsdprun resume` started together on one run directory, one runs and the other exits 2
naming the holder, touching nothing; `fsdprun status` tells which, without torch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import Run, Started, fsdprun_env, run_fsdprun, start_fsdprun

from fsdprun.rundir import heartbeat_path, lock_path
from fsdprun.runlock import hold_run_dir


def _race(tmp_path: Path, *args: str, **env: str) -> tuple[Started, Started, str]:
    """Start the same command twice at once; returns (the one holding the run directory, the
    refused one, the refused one's stderr)."""
    procs = [start_fsdprun(*args, cwd=tmp_path, env=fsdprun_env(**env)) for _ in range(2)]
    deadline = time.time() + 180
    while time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    refused = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not refused)
    err = refused.communicate(timeout=10)[1]
    assert refused.returncode == 2, err[-3000:]
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return winner, refused, err


def _resume_frozen(run_dir: Path, proc: Started) -> None:
    """SIGCONT rank 0 once FSDPRUN_FREEZE_AT has stopped it."""
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = json.loads(heartbeat_path(run_dir, 0).read_text())["pid"]
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T":
                os.kill(pid, signal.SIGCONT)
                return
        time.sleep(0.05)
    raise AssertionError(f"rank 0 never stopped at its step: {proc.poll()}")


def test_one_run_per_directory_for_train_and_resume_and_status_tells(tmp_path):
    run_dir = tmp_path / "run"
    host = socket.gethostname()

    # Two trains at once: one runs to the end, the other is refused before writing anything.
    # The one that runs stops itself at step 2 (SIGSTOP) until the other is refused: on a loaded
    # machine the other may otherwise reach the lock after the 8 steps, to a finished run.
    train = ("train", "debug", "train.steps=8", "checkpoint.every_steps=4", "--run-dir", "run")
    winner, _, err = _race(tmp_path, *train, FSDPRUN_FREEZE_AT="0:2")
    assert f"error: run is in use by another fsdprun run: pid {winner.pid} on {host} since " in err
    assert "fsdprun train debug train.steps=8" in err and f"kill -TERM {winner.pid}" in err
    _resume_frozen(run_dir, winner)
    out, err = winner.communicate(timeout=300)
    assert winner.returncode == 0, err[-3000:]
    run = Run(None, run_dir)
    assert [e["event"] for e in run.events].count("start") == 1
    steps = [e["step"] for e in run.steps]
    assert steps == sorted(set(steps)) and steps[-1] == 8 and run.summary["steps"] == 8
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000004", "step-00000008"
    ]  # fmt: skip
    assert not list(run_dir.glob("recipe.*.yaml"))
    assert not lock_path(run_dir).exists()  # removed by its holder on the way out
    status = run_fsdprun("status", "run", cwd=tmp_path)
    speed = run.steps[-1]["tokens_per_s"]
    assert status.returncode == 0 and status.stdout.splitlines() == [
        "run: not running; the last session finished",
        f"last logged step 8 of 8 (loss {run.losses[-1]:.4f}), {speed:,.0f} tokens/s; last "
        "checkpoint step-00000008",
    ]

    # Two resumes at once: one runs (stopped here with SIGTERM once status has seen it), the
    # other is refused before choosing a checkpoint.
    winner, _, err = _race(tmp_path, "resume", "run", "train.steps=100000", "output.log_every=1")
    assert f"error: run is in use by another fsdprun run: pid {winner.pid} on {host}" in err
    assert "fsdprun resume run train.steps=100000" in err
    status = run_fsdprun("status", "run", "--json", cwd=tmp_path)
    doc = json.loads(status.stdout)
    assert doc["running"] and doc["state"] == "running"
    assert doc["locks"][0]["holder"]["pid"] == winner.pid
    assert doc["locks"][0]["holder"]["host"] == host
    text = run_fsdprun("status", "run", cwd=tmp_path).stdout
    assert text.startswith(f"run: running, pid {winner.pid} on {host} since ")
    deadline = time.time() + 120
    while time.time() < deadline and Run(None, run_dir).steps[-1]["step"] < 9:
        time.sleep(0.05)
    winner.send_signal(signal.SIGTERM)  # stops at a checkpoint
    out, err = winner.communicate(timeout=120)
    assert winner.returncode == 128 + signal.SIGTERM, err[-3000:]
    run = Run(None, run_dir)
    events = [e["event"] for e in run.events]
    assert events.count("resume") == 1 and events.count("start") == 2
    steps = [e["step"] for e in run.steps]
    assert steps == sorted(set(steps))  # each step once
    assert not list((run_dir / "checkpoints").glob("*.old*"))
    assert sorted(p.name for p in run_dir.glob("recipe*.yaml")) == ["recipe.1.yaml", "recipe.yaml"]
    stopped = next(e for e in run.events if e["event"] == "stopped")
    status = run_fsdprun("status", "run", cwd=tmp_path)
    assert status.stdout.startswith(f"run: not running; stopped at step {stopped['step']} (")


def test_status_never_imports_torch_and_refuses_a_non_run(tmp_path):
    code = (
        "import sys; from fsdprun.cli import app; "
        "import fsdprun.tools.status, fsdprun.runlock; "
        "from typer.testing import CliRunner; "
        f"r = CliRunner().invoke(app, ['status', {str(tmp_path)!r}]); "
        "print(r.exit_code, 'torch' in sys.modules, r.output.strip())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == (
        f"2 False error: {tmp_path}: not an fsdprun run directory (no recipe.yaml, no lock) nor a "
        "tune's --out (no trials.jsonl)"
    )


def test_compare_holds_its_directory(tmp_path):
    # This process holds it, as a running compare would: a second compare is refused in one line
    # and leaves it as it was.
    with hold_run_dir(tmp_path / "cmp"):
        proc = run_fsdprun("compare", "debug", "--configs", "ddp", "--run-dir", "cmp", cwd=tmp_path)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr  # after its progress line
        assert f"cmp is in use by another fsdprun run: pid {os.getpid()} on " in proc.stderr
        assert [p.name for p in (tmp_path / "cmp").iterdir()] == [".lock"]


def test_each_node_locks_its_own_file(tmp_path):
    # Nodes of one multi-node run may share RUN_DIR: node 1 must not be refused by node 0's lock,
    # while a second launch of node 0 is. (Another process: locks are per process.)
    def take(node_rank: int) -> subprocess.CompletedProcess:
        code = (
            "from pathlib import Path; from fsdprun.runlock import hold_run_dir\n"
            f"with hold_run_dir(Path({str(tmp_path)!r}), node_rank={node_rank}): print('held')"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    with hold_run_dir(tmp_path, node_rank=0):
        assert take(1).stdout == "held\n"
        refused = take(0)
        assert refused.returncode == 1 and "UserError" in refused.stderr
        assert f"is in use by another fsdprun run: pid {os.getpid()} on " in refused.stderr
    assert take(0).stdout == "held\n"  # released on exit
    assert not list(tmp_path.iterdir())  # each holder removed its file
