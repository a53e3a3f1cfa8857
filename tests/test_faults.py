"""Faults through the real commands (CPU, gloo, 2 ranks, fp32): a crashed worker restarted by
the elastic agent, SIGTERM/SIGINT to the launcher, non-finite losses, a rank that hangs, and a
corrupted checkpoint caught by its checksums."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import Run, assert_same_state, fsdprun_env, run_fsdprun, start_fsdprun

from fsdprun.checkpoint import list_checkpoints, step_dir, verify_checkpoint
from fsdprun.tools.compare import CompareConfig, run_config

# Long enough for the signal tests to interrupt it mid-way.
BASE = ("train.steps=40", "checkpoint.every_steps=3", "output.log_every=1")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("straight")
    proc = run_fsdprun("train", "debug", *BASE, "--run-dir", str(root / "run"), cwd=root)
    return Run(proc, root / "run").check()


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in Run(None, run_dir).steps}


def test_crashed_worker_is_restarted_and_resumes(straight: Run, tmp_path):
    proc = run_fsdprun(
        "train", "debug", *BASE, "launch.max_restarts=1", "--run-dir", str(tmp_path / "run"),
        cwd=tmp_path, env=fsdprun_env(FSDPRUN_FAIL_AT="1:7"),
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    assert [e["step"] for e in run.steps] == list(range(1, 41))  # each step once
    restarts = [e for e in run.events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["step"] == 6 and restarts[0]["attempt"] == 1
    want = losses(straight.run_dir)
    for step, loss in losses(run.run_dir).items():
        assert loss == pytest.approx(want[step], abs=1e-6), step
    assert "workers restarted (attempt 1)" in proc.stdout


def _copy(run: Run, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run.run_dir, tmp_path / "run"))


def test_a_restart_after_resume_step_continues_this_resume(straight: Run, tmp_path):
    # straight kept 36, 39 and 40; the resume from 36 abandons the old 39 and 40.
    run_dir = _copy(straight, tmp_path)
    proc = run_fsdprun(
        "resume", str(run_dir), "--step", "36", "launch.max_restarts=1", cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_FAIL_AT="1:40"),
    )  # fmt: skip
    run = Run(proc, run_dir).check()
    events = run.events[[e["event"] for e in run.events].index("resume") :]
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["step"] == 39 and restart["checkpoint"] == str(step_dir(run_dir, 39))
    want = losses(straight.run_dir)
    got = {e["step"]: e["loss"] for e in events if e["event"] == "step"}
    assert sorted(got) == [37, 38, 39, 40]
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], abs=1e-6), step
    # The abandoned continuation's checkpoints are set aside, not lost.
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "step-00000039.old1").is_dir() and (ckpts / "step-00000040.old1").is_dir()
    assert "set aside 2 checkpoint(s) after step 36" in proc.stderr


def test_a_restart_with_no_steps_left_reports_cleanly(straight: Run, tmp_path):
    # The worker fails after the last step's checkpoint: the restart has nothing left to run.
    run_dir = _copy(straight, tmp_path)
    proc = run_fsdprun(
        "resume", str(run_dir), "--step", "39", "launch.max_restarts=1", cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_FAIL_AT="0:41"),
    )  # fmt: skip
    run = Run(proc, run_dir).check()
    assert "Traceback" not in proc.stderr
    restart = next(e for e in run.events if e["event"] == "restart")
    assert restart["step"] == 40
    summary = run.events[-1]
    assert summary["event"] == "summary" and summary["start_step"] == 40
    assert summary["final_loss"] is None and summary["throughput"]["steps_measured"] == 0
    assert all(r["model_state_bytes"] is None for r in summary["ranks"])
    assert "no steps ran in this launch (it started at step 40 of 40)" in proc.stdout


def _start(tmp_path: Path, *args: str):
    return start_fsdprun("train", "debug", *args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)


def _wait_for_step(run_dir: Path, step: int, proc) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError("the run did not reach the step")


def test_sigterm_saves_an_agreed_checkpoint_and_resume_continues(straight: Run, tmp_path):
    proc = _start(tmp_path, *BASE)
    _wait_for_step(tmp_path / "run", 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("SIGTERM:")]
    assert (
        len(lines) == 1 and lines[0].startswith("stopped at step") and "fsdprun resume" in lines[0]
    )
    stop_step = int(lines[0].split()[3])
    assert 2 <= stop_step < 40
    status = list_checkpoints(tmp_path / "run")[-1]
    assert status.complete and status.step == stop_step and status.manifest["step"] == stop_step
    proc = run_fsdprun("resume", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want, got = losses(straight.run_dir), losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 41))
    for step in range(1, 41):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step


def test_a_stop_file_stops_at_a_checkpoint_exits_0_and_piped_lines_stay_whole(
    straight: Run, tmp_path
):
    # stdout is a pipe and COLUMNS unset, as in a CI log, `| tee` or a SLURM output file: rich
    # would break every line at 80 columns, the run directory's path among them.
    run_dir = tmp_path / ("a-folder-whose-name-alone-is-longer-than-forty-columns" * 2) / "run"
    env = {k: v for k, v in fsdprun_env().items() if k != "COLUMNS"}
    proc = start_fsdprun("train", "debug", *BASE, "--run-dir", str(run_dir), cwd=tmp_path, env=env)
    _wait_for_step(run_dir, 2, proc)
    (run_dir / "STOP").write_text("")
    out, err = proc.communicate(timeout=120)
    # Before: exit 143 (as if killed by SIGTERM), then "final loss" as if the run had finished.
    assert proc.returncode == 0, err
    assert "final loss" not in out
    [line] = [line for line in out.splitlines() if line.startswith("stopped at step")]
    stop_step = int(line.split()[3])
    assert 2 <= stop_step < 40 and f"stopped at step {stop_step} of 40 (stop file; " in line
    assert f"checkpoint {step_dir(run_dir, stop_step)})" in line
    assert f"continue with: fsdprun resume {run_dir};" in line
    assert f"metrics in {run_dir / 'metrics.jsonl'};" in line
    assert any(f"run dir {run_dir}" in line for line in out.splitlines())  # the header's
    # Tables keep a readable width; the lines (longer than 200 columns) are whole.
    tables = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert tables and all(len(line) <= 120 for line in tables)
    assert (
        list_checkpoints(run_dir)[-1].complete and list_checkpoints(run_dir)[-1].step == stop_step
    )
    status = run_fsdprun("status", str(run_dir), cwd=tmp_path, env=env)
    assert f"stopped at step {stop_step} (stop file)" in status.stdout, status.stdout
    # compare takes such a run (exit 0, a summary) for what it is: not a measured configuration.
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    done = subprocess.CompletedProcess([], 0, out, err)
    result = run_config(
        "debug", [], CompareConfig("fsdp2", ()), copy, SimpleNamespace(run=lambda cmd, **kw: done)
    )
    assert not result.ok and result.error == f"stopped at step {stop_step} of 40 (stop file)"
    # Resume continues exactly; its closing line, also whole, says the run finished.
    proc = run_fsdprun("resume", str(run_dir), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"metrics in {run_dir / 'metrics.jsonl'}; wall time" in proc.stdout
    assert "final loss" in proc.stdout and "stopped at step" not in proc.stdout
    want, got = losses(straight.run_dir), losses(run_dir)
    assert sorted(got) == list(range(1, 41))
    for step in range(1, 41):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step


def test_second_sigint_aborts_at_once(tmp_path):
    proc = _start(tmp_path, "train.steps=100000", "output.log_every=1")
    _wait_for_step(tmp_path / "run", 1, proc)
    proc.send_signal(signal.SIGINT)
    # The second once came 50 ms after the first: on a loaded machine both arrived before the
    # launcher's handler ran, and a signal pending twice is delivered once (a save, no abort).
    # The STOP file is the launcher's answer to the first.
    deadline = time.time() + 30
    while not (tmp_path / "run" / "STOP").exists() and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "aborted" in err
    assert time.time() - start < 30


def test_nonfinite_abort_saves_nothing_poisoned(tmp_path):
    proc = run_fsdprun(
        "train", "debug", "train.steps=6", "checkpoint.every_steps=1", "--run-dir",
        str(tmp_path / "run"), cwd=tmp_path, env=fsdprun_env(FSDPRUN_NONFINITE_AT="0:3"),
    )  # fmt: skip
    assert proc.returncode == 1
    assert "non-finite loss or gradients at step 3 (train.nonfinite is abort)" in proc.stderr
    assert "rank 0" in proc.stderr or "rank 1" in proc.stderr  # every rank agreed and stopped
    assert [s.step for s in list_checkpoints(tmp_path / "run")] == [1, 2]


def test_nonfinite_skip_leaves_the_state_untouched(tmp_path):
    proc = run_fsdprun(
        "train", "debug", "train.steps=5", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
        "output.log_every=1",
        "train.nonfinite=skip", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_NONFINITE_AT="1:3"),
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    skips = [e for e in run.events if e["event"] == "skip"]
    assert [s["step"] for s in skips] == [3] and run.summary["skipped_steps"] == 1
    assert [e["skipped"] for e in run.steps] == [False, False, True, False, False]
    assert_same_state(step_dir(run.run_dir, 2), step_dir(run.run_dir, 3), tmp_path)
    sched = [list_checkpoints(run.run_dir)[i].manifest["train_state"]["scheduler"] for i in (1, 2)]
    assert sched[0]["last_epoch"] == sched[1]["last_epoch"] == 2
    assert run.steps[3]["loss"] < run.steps[0]["loss"]  # training went on
    # Too many in a row aborts.
    proc = run_fsdprun(
        "train", "debug", "train.steps=6", "train.nonfinite=skip", "train.max_skipped=1",
        "--run-dir", str(tmp_path / "run2"), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_NONFINITE_AT="0:2,0:3"),
    )  # fmt: skip
    assert proc.returncode == 1 and "at step 3 (more than train.max_skipped=1" in proc.stderr


# `fsdprun` with a grad scaler whose first step overflows, as fp16 steps often do at the default
# scale on GPUs, and that then backs off far enough for the next steps. The launcher forks its
# CPU workers: they inherit it.
OVERFLOWING_SCALER = """
import sys, torch
import fsdprun.engines
fsdprun.engines.Engine.grad_scaler = lambda self: torch.amp.GradScaler(
    "cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
from fsdprun.cli import main
main()
"""


def test_model_state_is_measured_after_a_step_the_optimizer_took(tmp_path):
    # The grad scaler skips an overflowing step inside scaler.step: the loss was finite, so the
    # run went on, but the optimizer held no state yet. The memory table showed optimizer 0 B.
    proc = subprocess.run(
        [sys.executable, "-c", OVERFLOWING_SCALER, "train", "debug", "fsdp.engine=ddp",
         "precision.param_dtype=fp16", "train.steps=3", "output.log_every=1",
         "checkpoint.save_final=false", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=fsdprun_env(FSDPRUN_START_METHOD="fork"), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    assert math.isnan(run.steps[0]["grad_norm"]) and math.isfinite(run.steps[1]["grad_norm"])
    for rank in run.summary["ranks"]:
        state = rank["model_state_bytes"]
        # ddp: the whole model; AdamW's two fp32 moments plus a step counter per tensor (21).
        assert state["params"] == 4 * run.start["num_params"]
        assert state["optimizer"] == 2 * state["params"] + 4 * 21


def test_fp16_skip_backs_off_the_loss_scale_and_trains_on(tmp_path):
    # Issue 10 items 3 and 9: the sharded grad scaler disabled itself off CUDA (no scaling at
    # all), and a skipped step never called scaler.update(), so the next unscale_() crashed.
    proc = run_fsdprun(
        "train", "debug", "train.steps=5", "precision.param_dtype=fp16", "train.nonfinite=skip",
        "checkpoint.every_steps=1", "checkpoint.keep_last=0", "output.log_every=1",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_NONFINITE_AT="1:3"),
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    assert [e["skipped"] for e in run.steps] == [False, False, True, False, False]
    assert all(math.isfinite(loss) for loss in run.losses[3:])
    scalers = [c.manifest["train_state"]["grad_scaler"] for c in list_checkpoints(run.run_dir)]
    scales = [s["scale"] for s in scalers]
    assert scales[0] <= 2.0**16 and scales[2] == scales[1] * 0.5  # backed off at the skip
    assert scales[4] >= scales[2] / 4  # and no more than the natural fp16 overflows since


def test_a_rank_that_stops_answering_is_named(tmp_path):
    start = time.time()
    proc = run_fsdprun(
        "train", "debug", "train.steps=6", "launch.timeout_s=4", "--run-dir",
        str(tmp_path / "run"), cwd=tmp_path, env=fsdprun_env(FSDPRUN_HANG_AT="1:3"),
    )  # fmt: skip
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert "\n" not in line and "rank 0 failed" in line
    assert "a collective timed out at step 3 (launch.timeout_s=4)" in line
    assert "stopped answering: rank 1 (last step 2)" in line
    assert time.time() - start < 90


def test_checksums_catch_a_flipped_byte_and_resume_falls_back(straight: Run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(straight.run_dir, run_dir)
    ck40 = step_dir(run_dir, 40)
    assert verify_checkpoint(ck40) == []
    shard = next(ck40.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a checksum can tell
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(ck40) == [f"{shard.name} does not match its checksum"]
    proc = run_fsdprun("inspect-checkpoint", str(ck40), cwd=tmp_path)
    assert proc.returncode == 0  # sizes alone cannot tell
    proc = run_fsdprun("inspect-checkpoint", str(ck40), "--verify", cwd=tmp_path)
    assert proc.returncode == 1
    assert f"is corrupt: {shard.name} does not match its checksum" in proc.stderr
    proc = run_fsdprun("resume", str(run_dir), "train.steps=41", "--verify", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipping incomplete checkpoint" in proc.stderr and "step-00000040" in proc.stderr
    assert "checksum verification failed" in proc.stderr
    assert "from step-00000039" in proc.stdout
