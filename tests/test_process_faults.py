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

import pytest
from conftest import processes_naming, start_fsdprun

from fsdprun.fmt import fmt_bytes
from fsdprun.launch.killed import mem_total_bytes


def _heartbeat(run_dir: Path, rank: int) -> dict | None:
    with suppress(OSError, ValueError):
        return json.loads((run_dir / "heartbeat" / f"rank-{rank}.json").read_text())
    return None


def _wait_for_step(run_dir: Path, step: int, proc, ranks=(0, 1)) -> list[dict]:
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

    # The agent checks its workers once a second here, so rank 0, which loses its connection at
    # once, has exited too by the agent's next check: the rank killed must still be the one named.
    run_dir = tmp_path / "run"
    proc = start_fsdprun("train", "debug", "train.steps=100000", "launch.monitor_interval_s=1",
                         "--run-dir", str(run_dir), cwd=tmp_path)  # fmt: skip
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


def _survivors(text: str, within_s: float) -> list[int]:
    deadline = time.time() + within_s
    while (alive := processes_naming(text)) and time.time() < deadline:
        time.sleep(0.05)
    return alive


def test_a_killed_compare_takes_its_current_run_with_it(tmp_path):
    # Before: compare died of SIGTERM at once and its `fsdprun train` child ran on with parent
    # pid 1 (and its workers with it). Now SIGTERM is forwarded (the run stops at a checkpoint,
    # compare exits 143) and a SIGKILL of compare kills the run too.
    from fsdprun.checkpoint import list_checkpoints

    for attempt in range(3):
        out_dir = tmp_path / f"cmp{attempt}"
        proc = start_fsdprun("compare", "debug", "--configs", "ddp,fsdp2", "--steps", "100000",
                             "--run-dir", str(out_dir), cwd=tmp_path)  # fmt: skip
        try:
            _wait_for_step(out_dir / "ddp", 0, proc)  # both workers of the first run are up
            proc.send_signal(signal.SIGTERM)
            if attempt:
                time.sleep(0.05 * attempt)
                proc.kill()
            _, err = proc.communicate(timeout=120)
            survivors = _survivors(str(out_dir), within_s=10)
            assert not survivors, f"attempt {attempt}: {survivors} outlived compare"
            if attempt:
                assert proc.returncode == -signal.SIGKILL
                continue
            assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
            assert "Traceback" not in err, err[-3000:]
            lines = err.strip().splitlines()
            assert lines[0].startswith("comparing 2 configurations of debug"), err
            line = lines[-1]
            assert len(lines) == 2, err
            assert line.startswith("compare stopped by SIGTERM during ddp (stopped at step "), line
            assert line.endswith(f"; not run: fsdp2; runs in {out_dir}"), line
            step = int(line.split("stopped at step ")[1].split()[0])
            saved = list_checkpoints(out_dir / "ddp")[-1]
            assert saved.complete and saved.step == step  # the run stopped at a checkpoint
            assert not (out_dir / "fsdp2").exists()
        finally:
            for pid in processes_naming(str(out_dir)):
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()


def _wait_for_checkpoint(run_dir: Path, step: int, proc) -> None:
    manifest = run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and not manifest.exists():
        time.sleep(0.02)
    assert manifest.exists(), f"no checkpoint at step {step}: {proc.poll()}"


def _stopped_step(line: str) -> int:
    return int(line.split(" it stopped at step ")[1].split()[0])


def test_a_run_whose_directory_vanishes_stops_in_one_line_and_writes_nothing_there(tmp_path):
    # Before: SIGTERM after an `rm -rf` of RUN_DIR ended in a FileNotFoundError traceback for
    # RUN_DIR/STOP, and saves recreated RUN_DIR/checkpoints/step-N; without a signal the run
    # went on into a folder recreated at the same path.
    from fsdprun.checkpoint import list_checkpoints

    args = ("train", "debug", "checkpoint.every_steps=2", "output.log_every=1")
    # Deleted, then SIGTERM.
    run_dir = tmp_path / "run"
    proc = start_fsdprun(*args, "train.steps=100000", "--run-dir", str(run_dir), cwd=tmp_path)
    try:
        _wait_for_checkpoint(run_dir, 2, proc)
        run_dir.rename(tmp_path / "doomed")  # then removed: as `rm -rf` with nothing left behind
        while (tmp_path / "doomed").exists():
            subprocess.run(["rm", "-rf", str(tmp_path / "doomed")], stderr=subprocess.DEVNULL)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    line = _one_line("\n".join(ln for ln in err.splitlines() if not ln.startswith("SIGTERM:")))
    step = _stopped_step(line)
    assert step > 2
    assert line.startswith(f"error: the run directory {run_dir} was deleted while the run ran; "
                           f"it stopped at step {step} without saving")  # fmt: skip
    assert line.endswith("), was in it and is gone too") and "the last checkpoint, step-" in line
    assert not run_dir.exists()  # nothing recreated it
    assert not processes_naming(str(run_dir))

    # Moved away and recreated, no signal: the run notices by itself and writes nothing into
    # the new folder.
    run_dir, moved = tmp_path / "run2", tmp_path / "run2.moved"
    proc = start_fsdprun(*args, "train.steps=40", "--run-dir", str(run_dir), cwd=tmp_path)
    try:
        _wait_for_checkpoint(run_dir, 2, proc)
        run_dir.rename(moved)
        run_dir.mkdir()
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    line = _one_line(err)
    step = _stopped_step(line)
    saved = [c for c in list_checkpoints(moved) if c.complete]
    assert saved and saved[-1].step < step <= 40
    assert line == (
        f"error: the run directory {run_dir} was moved to {moved} while the run ran; it stopped "
        f"at step {step} without saving, and wrote nothing under {run_dir} since; the last "
        f"checkpoint, {saved[-1].path.name}, is now in {moved / 'checkpoints'} (`fsdprun resume "
        f"{moved}` continues from it)"
    )
    assert list(run_dir.iterdir()) == []  # the recreated folder holds nothing of the run


def test_run_dir_watch_tells_deleted_moved_and_recreated(tmp_path):
    from fsdprun.rundir import RunDirWatch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    watch = RunDirWatch(run_dir)
    assert not watch.vanished()
    run_dir.rename(tmp_path / "elsewhere")
    assert watch.vanished() and watch.moved_to() == tmp_path / "elsewhere"
    run_dir.mkdir()  # a new folder at the old path is not the run's
    assert watch.vanished()
    (tmp_path / "elsewhere").rmdir()
    assert watch.vanished() and watch.moved_to() is None
    assert watch.message(step=3, checkpoint=None).endswith("; no checkpoint had been saved")


def _save_while_run_dir_vanishes(rank: int, world: int, run_dir: str, when: str) -> dict:
    """One save of a small state on every rank of the pool, with RUN_DIR moved away by rank 0
    at `when`: before it moves an old step folder aside, before the manifest is written, or
    after it is written (as an operator's `mv` or `rm -rf` lands between the save's first look
    and its last write). What each rank's save ended in."""
    import torch

    from fsdprun.checkpoint import save as save_module
    from fsdprun.config import config_to_dict, load_recipe
    from fsdprun.rundir import RunDirVanished, RunDirWatch

    path = Path(run_dir)
    cfg = load_recipe("debug", []).config
    checkpointer = save_module.Checkpointer(
        run_dir=path, cfg=cfg.checkpoint, rank=rank, world_size=world,
        recipe=config_to_dict(cfg), watch=RunDirWatch(path), warn=lambda line: None,
    )  # fmt: skip
    earlier = save_module.SaveRecord(2, str(path / "x"), 0.0)
    earlier.bytes = 1 << 20  # the free-space checks look at RUN_DIR's filesystem
    checkpointer.records.append(earlier)
    torch.distributed.barrier()  # every rank watches RUN_DIR before rank 0 moves it
    real_move, real_manifest = save_module.move_aside, save_module.write_manifest

    def away() -> None:
        if rank == 0:
            path.rename(path.with_name(path.name + ".moved"))

    def move_aside(folder):
        away()
        return real_move(folder)

    def write_manifest(folder, **kwargs):
        if when == "before-manifest":
            away()
        written = real_manifest(folder, **kwargs)
        if when == "after-manifest":
            away()
        return written

    if when == "before-move-aside":
        save_module.move_aside = move_aside
    save_module.write_manifest = write_manifest
    state = {"model": {"w": torch.full((8,), float(rank))}}
    try:
        checkpointer.save(4, state, {"step": 4})
        return {"outcome": "saved"}
    except RunDirVanished as e:
        return {"outcome": "vanished", "step": e.step,
                "records": [r.step for r in checkpointer.records]}  # fmt: skip
    finally:
        save_module.move_aside, save_module.write_manifest = real_move, real_manifest


@pytest.mark.parametrize("when", ["before-move-aside", "before-manifest", "after-manifest"])
def test_a_run_directory_moved_during_a_save_kills_no_rank_and_is_not_recreated(
    gloo_pool, tmp_path, when
):
    # Before: moved while rank 0 wrote the manifest, the save's clean-up asked for the free
    # space of the vanished RUN_DIR, and rank 0 died of its FileNotFoundError ("rank 0 failed:
    # exit code 1" instead of the one line saying where the run and its checkpoints went).
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-00000004").mkdir(parents=True)  # an old one to move aside
    results = gloo_pool.submit(_save_while_run_dir_vanishes, str(run_dir), when)
    if when == "after-manifest":
        # The checkpoint is complete where RUN_DIR went: the save stands (its clean-up under
        # RUN_DIR is skipped), and the loop stops the run at its next step.
        assert results == [{"outcome": "saved"}] * 2, results
    else:
        assert results == [{"outcome": "vanished", "step": 4, "records": [2]}] * 2, results
    moved = tmp_path / "run.moved"
    assert not run_dir.exists() and moved.is_dir()  # nothing recreated RUN_DIR
    manifest = moved / "checkpoints" / "step-00000004" / "manifest.json"
    assert manifest.is_file() == (when == "after-manifest")
