"""Full disks, unwritable places and tampered checkpoints, through the real `fsdprun` command
(part of the fault corpus; CPU, gloo, 2 ranks).

Each case asserts the exit code, one line on stderr (no traceback) and what is on disk before
and after. A full disk is a small tmpfs where this machine lets us mount one (root); every case
also runs with a file-size limit (RLIMIT_FSIZE, writes fail with EFBIG), which needs no
privilege, so CI covers the same code paths without mounting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import Run, run_fsdprun, zygote_command

from fsdprun.checkpoint import check_checkpoint, checkpoint_root, step_dir
from fsdprun.runlock import hold_run_dir

# A debug-recipe checkpoint takes about 1.8 MiB in two ~0.9 MiB shard files: a 3 MiB disk holds
# one checkpoint and the run's small files, not two; a 512 KiB file-size limit fails any shard.
SMALL_DISK = "3m"
FILE_LIMIT = 512 * 1024
KINDS = ("tmpfs", "rlimit")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with complete checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    proc = run_fsdprun("train", "debug", "train.steps=4", "checkpoint.every_steps=2",
                       "output.log_every=1", "--run-dir", str(root / "run"), cwd=root)  # fmt: skip
    return Run(proc, root / "run").check().run_dir


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` at `path` (skips the test where mounting is not allowed)."""
    path.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except OSError as e:
        pytest.skip(f"no mount command here ({e}); the RLIMIT_FSIZE variant covers this case")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the RLIMIT_FSIZE "
                    "variant covers this case")  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fsdprun(*args: str, cwd: Path, fsize: int | None = None):
    """`fsdprun ARGS`, under a file-size limit of `fsize` bytes if given."""
    return run_fsdprun(*args, cwd=cwd, fsize_limit=fsize)


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The command's error: exit `code`, no traceback, one `error:` line last on stderr (after
    the run's `warning:` lines, if any; diagnostics all go there)."""
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    *before, line = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(w.startswith("warning: ") for w in before), proc.stderr[-3000:]
    assert line.startswith("error: "), line
    return line


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".fill")
    }  # fmt: skip


def fill(disk: Path, *, leave_pages: int = 0) -> None:
    """Fill the tmpfs at `disk` (into `.fill`, which `snapshot` leaves out) but `leave_pages`
    pages: a small file takes one page of a tmpfs."""
    page = resource.getpagesize()
    (disk / ".fill").unlink(missing_ok=True)
    spare = disk / ".fill-spare"
    spare.write_bytes(b"s" * page * leave_pages)
    with open(disk / ".fill", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"x" * page)
    spare.unlink()


@contextlib.contextmanager
def place(kind: str, tmp_path: Path) -> Iterator[tuple[Path, int | None]]:
    """A folder where big writes fail (a small tmpfs or a file-size limit) and the file-size
    limit to run under."""
    if kind == "tmpfs":
        with tmpfs(tmp_path / "disk", SMALL_DISK) as where:
            yield where, None
    else:
        yield tmp_path, FILE_LIMIT


def copy_run_at_step_2(trained: Path, where: Path) -> Path:
    run_dir = where / "run"
    shutil.copytree(trained, run_dir, ignore=shutil.ignore_patterns("step-00000004"))
    return run_dir


def events(run_dir: Path, kind: str) -> list[dict]:
    """This session's events of one kind (those after the last resume)."""
    every = Run(None, run_dir).events
    start = max(i for i, e in enumerate(every) if e["event"] in ("start", "resume"))
    return [e for e in every[start:] if e["event"] == kind]


def check_reason(line: str, kind: str) -> None:
    if kind == "tmpfs":
        assert "no space left on device" in line, line
    else:
        assert "file too large" in line and "file-size limit" in line, line


# --------------------------------------------------------------------------------------------
# A save that fails


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_that_runs_out_of_space_stops_in_one_line(kind, trained, tmp_path):
    with place(kind, tmp_path) as (where, fsize):
        run_dir = copy_run_at_step_2(trained, where)
        kept = step_dir(run_dir, 2)
        before = snapshot(kept)
        proc = fsdprun("resume", str(run_dir), "train.steps=4", "output.log_every=1", cwd=where,
                       fsize=fsize)  # fmt: skip
        line = one_line(proc, 1)
        assert "checkpoint step-00000004 was not saved" in line, line
        check_reason(line, kind)
        assert "needs about 1." in line and " MiB" in line and "free" in line, line
        assert "the earlier checkpoint step-00000002 is intact" in line, line
        # Nothing partial is left, and the earlier checkpoint is untouched and still complete.
        assert sorted(p.name for p in checkpoint_root(run_dir).iterdir()) == [kept.name]
        assert snapshot(kept) == before and check_checkpoint(kept).complete
        assert [e["step"] for e in events(run_dir, "step")] == [3]  # then step 4's save failed
        errors = events(run_dir, "save_error")
        assert [(e["step"], e["action"]) for e in errors] == [(4, "stop")]
        if kind == "tmpfs":
            # Warned before the save: the last checkpoint's size is more than what is free.
            warnings = [e["message"] for e in events(run_dir, "warning")]
            assert any("step-00000004 will probably not fit" in w for w in warnings), warnings
            assert "will probably not fit" in proc.stderr and "warning:" not in proc.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_on_save_error_continue_trains_on_and_retries_async(kind, trained, tmp_path):
    with place(kind, tmp_path) as (where, fsize):
        run_dir = copy_run_at_step_2(trained, where)
        before = snapshot(step_dir(run_dir, 2))
        proc = fsdprun(
            "resume", str(run_dir), "train.steps=6", "checkpoint.every_steps=2",
            "checkpoint.async_save=true", "checkpoint.on_save_error=continue",
            "output.log_every=1", cwd=where, fsize=fsize,
        )  # fmt: skip
        # Step 4's save fails and training goes on; the final save (step 6) fails too, and a run
        # whose last state is not saved fails.
        line = one_line(proc, 1)
        assert "checkpoint step-00000006 was not saved" in line, line
        check_reason(line, kind)
        errors = events(run_dir, "save_error")
        assert [(e["step"], e["action"]) for e in errors] == [(4, "continue"), (6, "stop")]
        # On stderr, where `> log` leaves it in view.
        [warning] = [w for w in proc.stderr.splitlines() if "step-00000004 was not saved" in w]
        assert warning.startswith("warning: ") and warning.endswith(
            "; training goes on (checkpoint.on_save_error=continue)"), warning  # fmt: skip
        assert "warning:" not in proc.stdout and "step-00000004 was not" not in proc.stdout
        assert [e["step"] for e in events(run_dir, "step")] == [3, 4, 5, 6]
        assert sorted(p.name for p in checkpoint_root(run_dir).iterdir()) == ["step-00000002"]
        assert snapshot(step_dir(run_dir, 2)) == before


# --------------------------------------------------------------------------------------------
# export and prepare-data


def export(ckpt: Path, out: Path, *, fsize=None):
    return fsdprun("export", str(ckpt), "--out", str(out), cwd=ckpt.parent, fsize=fsize)


def test_export_to_an_unwritable_or_full_place_leaves_nothing(trained, tmp_path):
    ckpt = step_dir(trained, 4)
    # Root ignores permissions: a regular file where a folder is expected gives a real OSError.
    (tmp_path / "file").write_text("x")
    line = one_line(export(ckpt, tmp_path / "file" / "out"), 1)
    assert "cannot write" in line and str(tmp_path / "file" / "out") in line, line
    assert (tmp_path / "file").read_text() == "x"
    # The ~0.5 MiB model file is over a 256 KiB file-size limit.
    out = tmp_path / "limited"
    line = one_line(export(ckpt, out, fsize=256 * 1024), 1)
    assert "file too large" in line and str(out) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no out, no temporary
    # An existing empty --out stays as it was.
    out.mkdir()
    one_line(export(ckpt, out, fsize=256 * 1024), 1)
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "file", "limited"]  # fmt: skip


def test_export_to_a_read_only_or_full_mount_leaves_nothing(trained, tmp_path):
    ckpt = step_dir(trained, 4)
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        line = one_line(export(ckpt, ro / "out"), 1)
        assert "read-only file system" in line and str(ro / "out") in line, line
    with tmpfs(tmp_path / "full", "256k") as full:
        line = one_line(export(ckpt, full / "out"), 1)
        assert "no space left on device" in line, line
        assert list(full.iterdir()) == []


def _corpus(path: Path, lines: int, *, bad_at: int | None = None) -> Path:
    with path.open("w") as f:
        for i in range(lines):
            f.write("not json\n" if i == bad_at else json.dumps({"text": f"doc {i} " * 40}) + "\n")
    return path


def test_prepare_data_that_fails_halfway_leaves_nothing_and_can_be_retried(tmp_path):
    out = tmp_path / "data"
    bad = _corpus(tmp_path / "bad.jsonl", 2000, bad_at=1500)
    line = one_line(fsdprun("prepare-data", str(bad), "--out", str(out), cwd=tmp_path), 2)
    assert f"{bad} line 1501: not JSON" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    # A file-size limit under the ~0.6 MB of tokens: EFBIG halfway through train.bin.
    good = _corpus(tmp_path / "good.jsonl", 2000)
    proc = fsdprun("prepare-data", str(good), "--out", str(out), cwd=tmp_path,
                   fsize=256 * 1024)  # fmt: skip
    line = one_line(proc, 1)
    assert "file too large" in line and str(out) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl"]
    # The retry is not refused: the same --out works once the input and the limit are fixed.
    proc = fsdprun("prepare-data", str(good), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["data.json", "train.bin"]


def test_prepare_data_on_a_full_disk_leaves_nothing(tmp_path):
    good = _corpus(tmp_path / "good.jsonl", 2000)
    with tmpfs(tmp_path / "disk", "256k") as disk:
        proc = fsdprun("prepare-data", str(good), "--out", str(disk / "data"), cwd=tmp_path)
        line = one_line(proc, 1)
        assert "no space left on device" in line and str(disk / "data") in line, line
        assert list(disk.iterdir()) == []


# --------------------------------------------------------------------------------------------
# tune's --out

TUNE_RECIPE = "extends: debug\ntrain:\n  global_batch_size: 16\n  micro_batch_size: 1\n"
CONTINUES = "then rerun the same command: it continues where it stopped"


def _tune(tmp_path: Path, out: Path, *more: str, fsize: int | None = None):
    recipe = tmp_path / "mb1.yaml"
    recipe.write_text(TUNE_RECIPE)
    return fsdprun("tune", str(recipe), "--out", str(out), "--nproc-per-node", "2",
                   "--device-memory", "1GB", "--space", "train.micro_batch_size=1,2",
                   "--repeats", "1", "--budget", "5m", *more, cwd=tmp_path,
                   fsize=fsize)  # fmt: skip


def last_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The error line that ends a command which printed its plan first."""
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), proc.stderr[-3000:]
    return line


def _trial_record(tid: str, cand: str, label: str) -> dict:
    """A finished trial as tune logs it (what a run's metrics gave)."""
    return {"event": "trial", "id": tid, "candidate": cand, "label": label, "round": 0,
            "measured_steps": 4, "warmup_steps": 2, "status": "ok", "wall_s": 5.0,
            "losses": [5.5, 5.4, 5.3], "step_times_s": [0.1, 0.1, 0.1, 0.1],
            "tokens_per_step": 512, "time_to_first_step_s": 3.0, "warmup_s": 0.3, "mfu": None,
            "peak_bytes": 2**28, "memory_kind": "RSS", "model_state_bytes": 2**20}  # fmt: skip


def test_tune_whose_trial_cannot_write_stops_in_one_line_and_a_second_tune_is_refused(tmp_path):
    """A file-size limit (inherited by the trials' `train`): no mount needed."""
    out = tmp_path / "out"
    # The lock and the trial log's header fit in 2 KiB; the first trial's recipe.yaml does not.
    line = last_line(_tune(tmp_path, out, fsize=2048), 1)
    assert line.startswith(f"error: trial r0-c0-0 could not write under {out}: "), line
    assert "file too large" in line.lower() and line.endswith(CONTINUES), line
    # Not logged (the rerun runs it again): the log holds its header and the session's note.
    assert [json.loads(x)["event"] for x in (out / "trials.jsonl").read_text().splitlines()] == [
        "tune", "session"]  # fmt: skip
    # A second tune into an --out in use: refused before it plans or prints anything.
    with hold_run_dir(out):
        line = one_line(_tune(tmp_path, out), 2)
    assert f"{out} is in use by another fsdprun run: pid {os.getpid()}" in line, line


def test_tune_on_a_read_only_or_full_disk_is_one_line_and_overwrites_nothing(tmp_path):
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        line = one_line(_tune(tmp_path, ro / "t"), 1)
        assert line == (f"error: cannot write --out {ro / 't'}: read-only file system; make that "
                        "filesystem writable, or give another --out")  # fmt: skip
    with tmpfs(tmp_path / "disk", "256k") as disk:
        out = disk / "t"
        fill(disk)
        line = one_line(_tune(tmp_path, out), 1)
        assert line == (f"error: cannot write --out {out} (its lock file .lock): no space left "
                        "on device; free some space there, or give another --out")  # fmt: skip
        assert snapshot(disk) == {} and not out.exists()
        # A search whose trials are all logged, a tuned.yaml and a picture from before: only the
        # lock fits, so tuned.yaml cannot be written.
        (disk / ".fill").unlink()
        last_line(_tune(tmp_path, out, fsize=2048), 1)  # as above: leaves the log's header
        with (out / "trials.jsonl").open("a") as f:
            for cand, label in (("c0", "baseline"), ("c1", "mb=2")):
                f.write(json.dumps(_trial_record(f"r0-{cand}-0", cand, label)) + "\n")
        (out / "tuned.yaml").write_text("# from before\nextends: debug\n")
        picture = disk / "tune.png"
        picture.write_bytes(b"before")
        log = (out / "trials.jsonl").read_bytes()
        before = snapshot(disk)
        fill(disk, leave_pages=1)
        proc = _tune(tmp_path, out, "--plot", str(picture))
        assert "continuing" in proc.stderr  # ran no trial
        assert last_line(proc, 1) == (f"error: cannot write {out / 'tuned.yaml'}: no space left "
                                      f"on device; free some space there, {CONTINUES}")  # fmt: skip
        # No lock, no temporary, nothing cut: the log only gained its session's note.
        now = snapshot(disk)
        assert now.pop("t/trials.jsonl") != before.pop("t/trials.jsonl") and now == before
        assert (out / "trials.jsonl").read_bytes().startswith(log)
        # Room for tuned.yaml, not for the picture: drawn beside the old one, which stays.
        fill(disk, leave_pages=2)
        line = last_line(_tune(tmp_path, out, "--plot", str(picture)), 1)
        assert line == (f"error: cannot write --plot {picture}: no space left on device; free "
                        "some space there, or give another --plot")  # fmt: skip
        assert yaml.safe_load((out / "tuned.yaml").read_text())["extends"] == str(
            tmp_path / "mb1.yaml")  # fmt: skip
        after = snapshot(disk)
        after.pop("t/trials.jsonl")
        assert after.pop("t/tuned.yaml") != before.pop("t/tuned.yaml") and after == before
        # The JSON document on stdout, into a file on the full disk.
        fill(disk)
        with (disk / "plan.json").open("w") as stdout:
            proc = subprocess.run(
                [zygote_command(tmp_path), "tune", "debug", "--out", str(out), "--device-memory",
                 "1GB", "--space", "train.micro_batch_size=1,2", "--dry-run", "--json"],
                cwd=tmp_path, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300,
            )  # fmt: skip
        assert one_line(proc, 1) == (
            "error: cannot write the JSON document to standard output: "
            "no space left on device; send it where there is room"
        )


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


def test_metrics_lines_that_do_not_fit_are_written_later_in_order(tmp_path):
    from fsdprun.report.metrics import MetricsLog, read_events

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write("start", n=0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        # Writes past 100 more bytes fail with EFBIG, as on a full disk: nothing is raised.
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 100, hard))
        for i in range(3):
            log.write("step", step=i, pad="x" * 60)
        assert len(read_events(path)) == 2  # whole lines only; the rest waits in memory
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    log.write("summary", n=1)
    log.close()
    assert [(e["event"], e.get("step")) for e in read_events(path)] == [
        ("start", None), ("step", 0), ("step", 1), ("step", 2), ("summary", None)]  # fmt: skip
