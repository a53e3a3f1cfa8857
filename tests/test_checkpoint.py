"""Checkpoints through the real commands (CPU, gloo, fp32): exact continuation after a crash, at
the same and at a different world size; async equals sync; incomplete folders are skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import Run, consolidate, flatten, fsdprun_env, run_fsdprun

from fsdprun.checkpoint import find_resume_checkpoint, list_checkpoints, step_dir
from fsdprun.config import load_recipe
from fsdprun.rundir import recipe_name
from fsdprun.train.optim import lr_factor

# 8 steps, a checkpoint every 4, global batch 8 with micro batch 1.
BASE = ("train.steps=8", "checkpoint.every_steps=4", "output.log_every=1",
        "train.micro_batch_size=1")  # fmt: skip


def model_tensors(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    return consolidate(ckpt, tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt")["model"]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    # A resumed run appends to metrics.jsonl: later records of a step win.
    return {e["step"]: e["loss"] for e in Run(None, run_dir).steps}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("straight")
    proc = run_fsdprun("train", "debug", *BASE, "--run-dir", str(root / "run"), cwd=root)
    return Run(proc, root / "run").check()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A run killed at the start of step 5 (rank 0 raises), with the step-4 checkpoint."""
    root = tmp_path_factory.mktemp("crashed")
    proc = run_fsdprun(
        "train", "debug", *BASE, "--run-dir", str(root / "run"), cwd=root,
        env=fsdprun_env(FSDPRUN_FAIL_AT="0:5"),
    )  # fmt: skip
    assert proc.returncode == 1 and "injected failure at step 5" in proc.stderr
    assert [s.step for s in list_checkpoints(root / "run")] == [4]
    return root / "run"


def resume_copy(crashed: Path, tmp_path: Path, *args: str) -> tuple:
    run_dir = tmp_path / "run"
    shutil.copytree(crashed, run_dir)
    proc = run_fsdprun("resume", str(run_dir), *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, run_dir


def test_resume_continues_exactly(straight: Run, crashed: Path, tmp_path):
    proc, run_dir = resume_copy(crashed, tmp_path)
    assert "resuming" in proc.stdout and "from step-00000004" in proc.stdout
    # The header names the recipe (debug), not the run folder ("run"), and so does the recipe
    # the resume wrote, for the next resume.
    assert "fsdprun debug: " in proc.stdout and "fsdprun run:" not in proc.stdout
    starts = [e for e in Run(proc, run_dir).events if e["event"] == "start"]
    assert [e["recipe"] for e in starts] == ["debug", "debug"]
    assert recipe_name(run_dir) == "debug"
    want, got = losses_by_step(straight.run_dir), losses_by_step(run_dir)
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step
    final = model_tensors(step_dir(run_dir, 8), tmp_path)
    ref = model_tensors(step_dir(straight.run_dir, 8), tmp_path)
    assert final.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(final[key], ref[key], rtol=0, atol=1e-6, msg=key)
    # The old recipe is kept beside the new one, and the resume is in the metrics.
    assert (run_dir / "recipe.1.yaml").exists()
    assert any(e["event"] == "resume" and e["step"] == 4 for e in Run(None, run_dir).events)


@pytest.mark.parametrize(("engine", "nproc"), [("fsdp1", 4), ("ddp", 1), ("fsdp1-flat", 2)])
def test_a_fsdp2_checkpoint_resumes_under_another_engine_and_world_size(
    straight: Run, crashed: Path, tmp_path, engine, nproc
):
    # The checkpoint keys are the unwrapped model's (DCP state_dict), whatever the engine. FSDP1's
    # flat parameters make one optimizer param group where fsdp2 saved two. Each resume also
    # changes the world size (1 and 4 ranks; the flat one keeps 2), as DCP reshards on load.
    flat = ["fsdp.use_orig_params=false"] if engine == "fsdp1-flat" else []
    engine = engine.removesuffix("-flat")
    proc, run_dir = resume_copy(
        crashed, tmp_path, f"fsdp.engine={engine}", *flat, "--nproc-per-node", str(nproc)
    )
    assert f"fsdp.engine={engine} ->" in proc.stdout and f"on {nproc} ranks" in proc.stdout
    want, got = losses_by_step(straight.run_dir), losses_by_step(run_dir)
    # Another world size sums in another order: equal up to fp32 rounding (measured <= 5e-7).
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-6), (engine, nproc, step)
    final = model_tensors(step_dir(run_dir, 8), tmp_path)
    ref = model_tensors(step_dir(straight.run_dir, 8), tmp_path)
    for key in ref:
        torch.testing.assert_close(final[key], ref[key], rtol=1e-4, atol=1e-5, msg=key)
    manifest = list_checkpoints(run_dir)[-1].manifest
    assert manifest["world_size"] == nproc and manifest["train_state"]["data_position"] == 64


def test_async_save_writes_what_sync_save_writes(straight: Run, tmp_path):
    proc = run_fsdprun("train", "debug", *BASE, "checkpoint.async=true", "--run-dir",
                       str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    saves = [e for e in run.events if e["event"] == "checkpoint"]
    assert [s["step"] for s in saves] == [4, 8] and all(s["async_save"] for s in saves)
    assert all(s["blocked_s"] <= s["total_s"] for s in saves)
    assert "Checkpoints" in proc.stdout and "async" in proc.stdout
    for step in (4, 8):
        # Training went on while step 4 was written: equal contents prove it was staged first.
        got = consolidate(step_dir(run.run_dir, step), tmp_path / "a.pt")
        want = consolidate(step_dir(straight.run_dir, step), tmp_path / "s.pt")  # fmt: skip
        assert flatten(got).keys() == flatten(want).keys()
        for key, value in flatten(want).items():
            if isinstance(value, torch.Tensor) and not key.startswith(("train_state", "rng")):
                assert torch.equal(flatten(got)[key], value), key


def test_incomplete_checkpoints_are_skipped_and_more_steps_stretch_the_schedule(
    straight: Run, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(straight.run_dir, run_dir)
    assert [s.step for s in list_checkpoints(run_dir) if s.complete] == [4, 8]
    ck8 = step_dir(run_dir, 8)
    shard = next(ck8.glob("__1_*.distcp"))
    cases = {
        "no .metadata": lambda: (ck8 / ".metadata").unlink(),
        "is missing": lambda: shard.unlink(),
        "is truncated": lambda: shard.write_bytes(shard.read_bytes()[:100]),
        "no manifest.json": lambda: (ck8 / "manifest.json").unlink(),
    }
    for reason, damage in cases.items():
        shutil.rmtree(ck8)
        shutil.copytree(step_dir(straight.run_dir, 8), ck8)
        damage()
        chosen, skipped = find_resume_checkpoint(run_dir)
        assert chosen.step == 4, reason
        assert [s.step for s in skipped] == [8] and reason in skipped[0].reason
    # Resume through the command: it reports the skipped folder and continues from step 4, here
    # to step 16 (one resume for both promises).
    proc = run_fsdprun("resume", str(run_dir), "train.steps=16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipping incomplete checkpoint" in proc.stderr and "step-00000008" in proc.stderr
    # The damaged folder was moved aside, not overwritten; keep_last=1 would delete only complete.
    assert list(ck8.parent.glob("step-00000008.old*"))
    assert {s.step for s in list_checkpoints(run_dir) if s.complete} >= {8, 16}
    # The cosine decay spans train.steps: continuing an 8-step run to 16 stretches it, and the
    # learning rate changes at the resumed step. Every resumed step takes the lr of the 16-step
    # schedule (the first one too, not the saved 8-step lr), and resume says so beforehand.
    cfg = load_recipe(str(run_dir / "recipe.yaml")).config
    assert cfg.train.steps == 16
    lr = {e["step"]: e["lr"] for e in Run(None, run_dir).steps}
    for step in range(1, 17):
        total = 8 if step <= 4 else 16
        want = cfg.optim.lr * lr_factor(step - 1, cfg=cfg.schedule, total_steps=total)
        assert lr[step] == pytest.approx(want, rel=1e-9), step
    old, new = (
        lr_factor(4, cfg=cfg.schedule, total_steps=8),
        lr_factor(4, cfg=cfg.schedule, total_steps=16),
    )
    note = (
        f"note: train.steps 8 -> 16 stretches the cosine schedule: the learning rate of step 5 "
        f"is {cfg.optim.lr * new:.3g} (it was {cfg.optim.lr * old:.3g})"
    )
    assert note in " ".join(proc.stderr.split()), proc.stderr


def test_step_tokens_per_s_leaves_out_synchronous_saves(tmp_path):
    # A save every step: the step log's window (tokens_per_step / tokens_per_s) is the step itself
    # plus the logging, not the save (as eval is left out too).
    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", "train.steps=4", "checkpoint.every_steps=1", "output.log_every=1",
        "checkpoint.async_save=false", "--run-dir", str(run_dir), cwd=tmp_path,
    )  # fmt: skip
    run = Run(proc, run_dir).check()
    blocked = {e["step"]: e["blocked_s"] for e in run.events if e["event"] == "checkpoint"}
    assert sorted(blocked) == list(range(1, 5))
    tokens = run.start["tokens_per_step"]
    outside_step = sum(tokens / e["tokens_per_s"] - e["step_time_s"] for e in run.steps)
    # Measured: saves 0.05-1.4 s each, logging 15-50 ms per step.
    assert outside_step < 0.5 * sum(blocked.values()), (outside_step, blocked)


def test_train_into_a_run_with_checkpoints_points_to_resume(straight: Run, tmp_path):
    proc = run_fsdprun("train", "debug", "--run-dir", str(straight.run_dir), cwd=tmp_path)
    assert proc.returncode == 2 and f"fsdprun resume {straight.run_dir}" in proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["model.dim=128"], "resume cannot change model.dim (64 -> 128)"),
        (["optim.lr=1.0"], "resume cannot change optim.lr"),
        (["--step", "3"], "no checkpoint of step 3 (complete ones: 4, 8)"),
        ([], "already at step 8 of train.steps=8; pass train.steps=N"),
        (["--nproc-per-node", "3"], "global batch (8 sequences) cannot be split over 3 ranks"),
    ],
)
def test_resume_refusals(straight: Run, tmp_path, args, message):
    before = sorted(p.name for p in straight.run_dir.rglob("*"))
    proc = run_fsdprun("resume", str(straight.run_dir), *args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in straight.run_dir.rglob("*")) == before


def test_resume_without_checkpoints(straight: Run, tmp_path):
    proc = run_fsdprun("resume", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "not an fsdprun run directory (no recipe.yaml)" in proc.stderr
    (tmp_path / "run").mkdir()
    shutil.copy(straight.run_dir / "recipe.yaml", tmp_path / "run")
    proc = run_fsdprun("resume", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2 and "no checkpoints to resume from" in proc.stderr
    shutil.copytree(step_dir(straight.run_dir, 4), step_dir(tmp_path / "run", 4))
    (step_dir(tmp_path / "run", 4) / ".metadata").unlink()
    proc = run_fsdprun("resume", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "no complete checkpoint (1 incomplete: step-00000004: no .metadata" in proc.stderr


def test_load_from_initializes_the_model_only(straight: Run, tmp_path):
    source = step_dir(straight.run_dir, 4)
    # A negligible learning rate leaves the loaded weights as they are (to fp32 rounding).
    proc = run_fsdprun(
        "train", "debug", "train.steps=1", "optim.lr=1e-30", "schedule.warmup_steps=0",
        f"checkpoint.load_from={source}", "--run-dir", str(tmp_path / "ft"), cwd=tmp_path,
    )  # fmt: skip
    run = Run(proc, tmp_path / "ft").check()
    assert any(e["event"] == "load_weights" for e in run.events)
    assert run.steps[-1]["step"] == 1  # a fresh schedule and data position
    got = model_tensors(step_dir(run.run_dir, 1), tmp_path)
    want = model_tensors(source, tmp_path)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)


def test_fsdp1_flat_parameters_resume_exactly(tmp_path):
    # Issue 10 item 5: with use_orig_params=false every flat parameter is 1-D, the decay group was
    # empty, and DCP's load dropped its settings (KeyError: 'betas' at the first step).
    flat = ("fsdp.engine=fsdp1", "fsdp.use_orig_params=false")
    run_dir = tmp_path / "run"
    straight = run_fsdprun("train", "debug", *BASE, *flat, "--run-dir", str(run_dir), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    want = losses_by_step(run_dir)
    proc = run_fsdprun("resume", str(run_dir), "--step", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = losses_by_step(run_dir)  # the resumed steps 5-8 replace the first session's
    assert len(want) == 8 and len(Run(None, run_dir).steps) == 8 + 4
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-6), step
