"""TensorBoard and W&B trackers through the real commands (CPU, gloo, 2 ranks): what they hold is
read back with their own readers (TensorBoard's EventAccumulator; W&B's offline .wandb files
parsed into W&B's protobuf records) and compared with metrics.jsonl, across an elastic restart
and a resume from an older checkpoint. Trackers on bad disks: a folder that cannot be written is
refused before launch in one line; a write that fails during the run (a full disk) is one
warning and the run goes on without that tracker."""

from __future__ import annotations

import errno
import json
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Run, fsdprun_env, run_fsdprun
from test_storage_faults import tmpfs

from fsdprun.checkpoint import check_checkpoint, step_dir
from fsdprun.report.trackers import Trackers, open_trackers

pytest.importorskip(
    "tensorboard", reason="the tensorboard extra: pip install 'fsdprun[tensorboard]'"
)
pytest.importorskip("wandb", reason="the wandb extra: pip install 'fsdprun[wandb]'")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

GIB = 2**30


def tensorboard_run(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log blocks of
    32 KiB holding chunks (crc32c, length, type: full/first/middle/last) of protobuf records."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, records, partial = 7, [], b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is zero padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        partial += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial)
            records.append(record)
            partial = b""
    return records


def wandb_sessions(run_dir: Path) -> list[dict]:
    """Each offline W&B session of the run, in the order it ran: its run id and history rows."""
    sessions = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        records = wandb_records(path)
        rows = [
            {item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"
        ]  # fmt: skip
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        sessions.append({"id": run.run_id, "project": run.project, "rows": rows})
    return sorted(sessions, key=lambda s: s["rows"][0]["_timestamp"])


def latest_by_step(events: list[dict], kind: str) -> dict[int, dict]:
    """metrics.jsonl's records of one kind by step; a step logged again (a resume from an older
    checkpoint) counts with its latest record."""
    return {e["step"]: e for e in events if e["event"] == kind}


def test_trackers_follow_an_elastic_restart_and_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    # A constant learning rate: the resume's longer train.steps leaves the replayed steps' lr
    # as it was (W&B keeps the values first logged for a step).
    common = ["output.log_every=1", "launch.max_restarts=1", "schedule.decay=constant"]
    # Rank 1 fails at step 5 after steps 1-4 are logged: the restart continues from step 3 and
    # logs step 4 again.
    proc = run_fsdprun(
        "train", "debug", "train.steps=8", "checkpoint.every_steps=3", "eval.every_steps=4",
        "data.val_fraction=0.1", "output.tensorboard=true", "output.peak_tflops=0.001",
        "output.wandb={project: trackers-test, mode: offline}", *common,
        "--run-dir", str(run_dir), cwd=tmp_path, env=fsdprun_env(FSDPRUN_FAIL_AT="1:5"),
    )  # fmt: skip
    Run(proc, run_dir).check()
    # The header says where both write.
    assert (f"  trackers: TensorBoard -> {run_dir}/tensorboard/; W&B offline run run -> "
            f"{run_dir}/wandb/\n") in proc.stdout  # fmt: skip
    # Then a resume from step 6 (7 and 8 are logged again) to step 10.
    proc = run_fsdprun(
        "resume", str(run_dir), "--step", "6", "train.steps=10", *common, cwd=tmp_path
    )
    run = Run(proc, run_dir).check()
    steps, evals = latest_by_step(run.events, "step"), latest_by_step(run.events, "eval")
    assert sorted(steps) == list(range(1, 11)) and sorted(evals) == [4, 8, 10]

    tb = tensorboard_run(run_dir)
    fields = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
              "perf/tokens_per_s": "tokens_per_s", "train/tokens_seen": "tokens_seen"}  # fmt: skip
    for tag, key in fields.items():
        logged = tb.Scalars(tag)
        assert [s.step for s in logged] == list(range(1, 11)), tag  # once each, in order
        for s in logged:
            assert s.value == pytest.approx(steps[s.step][key], rel=1e-6), (tag, s.step)
    # MFU of each step: its tokens/s at the FLOPs per token and peak of the summary's MFU.
    summary = run.summary["throughput"]
    for s in tb.Scalars("perf/mfu"):
        want = steps[s.step]["tokens_per_s"] * summary["mfu"] / summary["tokens_per_s"]
        assert s.value == pytest.approx(want, rel=1e-6), s.step
    assert len(tb.Scalars("perf/mfu")) == 10
    for s in tb.Scalars("memory/peak_rss_gib"):
        assert s.value == pytest.approx(steps[s.step]["memory"]["peak_rss_bytes"] / GIB, rel=1e-6)
    assert [(s.step, pytest.approx(s.value, rel=1e-6)) for s in tb.Scalars("val/loss")] == [
        (step, e["val_loss"]) for step, e in sorted(evals.items())
    ]

    def texts(kind: str) -> list[tuple[int, dict]]:
        return [(t.step, json.loads(t.tensor_proto.string_val[0]))
                for t in tb.Tensors(f"events/{kind}/text_summary")]  # fmt: skip

    def fields_of(kind: str) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "event"}
                for e in run.events if e["event"] == kind]  # fmt: skip

    assert texts("restart") == [(3, e) for e in fields_of("restart")]
    assert texts("resume") == [(6, e) for e in fields_of("resume")]
    assert [step for step, _ in texts("checkpoint")] == [3, 6, 8, 9, 10]

    # W&B: one run id over the three sessions; each step once, in order; values of metrics.jsonl.
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    sessions = wandb_sessions(run_dir)
    assert len(sessions) == 3
    assert {(s["id"], s["project"]) for s in sessions} == {(run_id, "trackers-test")}
    rows = [row for s in sessions for row in s["rows"]]
    logged = [row["_step"] for row in rows]
    assert logged == sorted(set(logged)), logged  # never backwards, never twice
    losses = {row["_step"]: row for row in rows if "train/loss" in row}
    assert sorted(losses) == list(range(1, 11))
    for step, row in losses.items():
        # Replayed steps are deterministic: the first session's loss is the latest one's too.
        assert row["train/loss"] == pytest.approx(steps[step]["loss"], abs=1e-6), step
        assert row["train/lr"] == pytest.approx(steps[step]["lr"], rel=1e-9), step
        assert row["train/grad_norm"] == pytest.approx(steps[step]["grad_norm"], rel=1e-5), step
        if step > 8:  # logged by the resume's session alone
            assert row["perf/tokens_per_s"] == steps[step]["tokens_per_s"], step
    assert {row["_step"]: row["val/loss"] for row in rows if "val/loss" in row} == pytest.approx(
        {step: e["val_loss"] for step, e in evals.items()}, abs=1e-6
    )
    restarts = [json.loads(row["events/restart"]) for row in rows if "events/restart" in row]
    assert restarts == fields_of("restart")


def test_wandb_online_without_a_login_is_one_line(tmp_path):
    # No API key anywhere W&B looks (the environment, ~/.netrc, its settings under HOME).
    env = {k: v for k, v in fsdprun_env(HOME=str(tmp_path)).items() if not k.startswith("WANDB_")}
    proc = run_fsdprun(
        "train", "debug", "train.steps=2", "output.wandb={mode: online}",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: output.wandb: W&B could not start")
    assert "use mode: offline" in lines[0]


# --------------------------------------------------------------------------------------------
# Trackers on bad disks: a folder that cannot be written is refused before launch; a write that
# fails during the run is one warning and the run goes on (metrics.jsonl is the record).


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_tracker_folder_that_cannot_be_written_is_refused_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("not a folder")
    (run_dir / "wandb").write_text("not a folder")
    args = ["train", "debug", "train.steps=2", "output.tensorboard=true",
            "output.wandb={mode: offline}", "--run-dir", str(run_dir)]  # fmt: skip
    proc = run_fsdprun(*args, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert line == (
        f"error: output.tensorboard: cannot write its folder {run_dir}/tensorboard (it is not "
        "a folder); make it a writable folder, or turn the tracker off with "
        f"output.tensorboard=false; output.wandb: cannot write its folder {run_dir}/wandb (it "
        "is not a folder); make it a writable folder, or turn the tracker off with ~output.wandb"
    )
    assert _tree(run_dir) == ["tensorboard", "wandb"]  # refused before anything was written
    # A read-only mount (root writes anywhere else): the same refusal, naming why.
    (run_dir / "tensorboard").unlink()
    (run_dir / "wandb").unlink()
    with tmpfs(run_dir / "tensorboard", "64k", read_only=True):
        proc = run_fsdprun(*args[:-2], "output.wandb={mode: disabled}", *args[-2:], cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: output.tensorboard: cannot write its folder {run_dir}/"
                               "tensorboard (read-only file system)"), line  # fmt: skip
        assert _tree(run_dir) == ["tensorboard"]


FULL_DISK_END = (
    "(no space left on device); training goes on without this tracker (metrics.jsonl keeps "
    "every record)"
)


def test_full_disks_under_the_trackers_are_one_warning_each_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # TensorBoard: one page of tmpfs, the event file's first rows fit and a later one does not
    # (ENOSPC in TensorBoard's writer thread, raised again at the next flush). W&B: one page
    # free, full once its session files are written.
    with tmpfs(run_dir / "tensorboard", "4k"), tmpfs(run_dir / "wandb", "16k") as wandb:
        (wandb / "fill").write_bytes(b"x" * 12288)
        proc = run_fsdprun(
            "train", "debug", "train.steps=6", "checkpoint.every_steps=3", "output.log_every=1",
            "output.tensorboard=true", "output.wandb={mode: offline}", "--run-dir", str(run_dir),
            cwd=tmp_path,
        )  # fmt: skip
        run = Run(proc, run_dir).check()
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        # One warning per tracker, as logged: stderr's lines, whole, and nothing on stdout.
        messages = sorted(e["message"] for e in run.events if e["event"] == "warning")
        assert sorted(proc.stderr.splitlines()) == [f"warning: {m}" for m in messages]
        assert "warning:" not in proc.stdout, proc.stdout[-3000:]
        for message, key, folder in zip(messages, ["output.tensorboard", "output.wandb"],
                                        ["tensorboard", "wandb"], strict=True):  # fmt: skip
            assert message.startswith(f"{key}: could not write {run_dir}/{folder} at "), message
            assert message.endswith(FULL_DISK_END), message
        assert " at step " in messages[0]  # TensorBoard started, then its disk filled
        assert [e["step"] for e in run.steps] == [1, 2, 3, 4, 5, 6]
        assert all(check_checkpoint(step_dir(run_dir, s)).complete for s in (3, 6))
        # Neither TensorBoard's thread nor W&B's own log printed anything, even to rank 0's log.
        [log] = (run_dir / "logs").glob("*/attempt_0/0/stderr.log")
        text = log.read_text()
        assert "Traceback" not in text and "Logging error" not in text, text[-3000:]


class _Failing:
    """A tracker whose write number `fail_at` (and every later one) raises `error`."""

    key, folder = "output.fake", Path("/runs/x/fake")

    def __init__(self, error: BaseException, fail_at: int, *, close_error=None):
        self.error, self.fail_at, self.close_error = error, fail_at, close_error
        self.rows, self.closed = [], 0

    def log(self, row) -> None:
        if len(self.rows) + 1 >= self.fail_at:
            raise self.error
        self.rows.append(row.step)

    def close(self, *, failed: bool) -> None:
        self.closed += 1
        if self.close_error is not None:
            raise self.close_error


def test_trackers_drop_a_tracker_that_fails_and_warn_once():
    full = OSError(errno.ENOSPC, "No space left on device")
    bad, good = _Failing(full, 3), _Failing(full, 99)
    flaky = _Failing(full, 99, close_error=OSError(errno.EIO, "Input/output error"))
    trackers = Trackers([bad, good, flaky], resume_step=0)
    warnings = []
    for step in range(1, 6):
        trackers.handle({"event": "eval", "step": step, "val_loss": 1.0})
        warnings += trackers.take_warnings()
    assert bad.rows == [1, 2] and good.rows == flaky.rows == [1, 2, 3, 4, 5]
    assert warnings == [
        "output.fake: could not write /runs/x/fake at step 3 (no space left on device); training "
        "goes on without this tracker (metrics.jsonl keeps every record)"
    ]
    assert bad.closed == 1  # closed when dropped, never again
    trackers.close()
    assert [bad.closed, good.closed, flaky.closed] == [1, 1, 1]
    [at_close] = trackers.take_warnings()
    assert at_close.startswith("output.fake: could not write /runs/x/fake at close (input/output")
    # A tracker that raises something other than an OSError is named with its message.
    service = RuntimeError("wandb.Error: the service died\nmore")
    other = Trackers([_Failing(service, 1)], resume_step=0)
    other.handle({"event": "eval", "step": 7, "val_loss": 1.0})
    [line] = other.take_warnings()
    assert "at step 7 (wandb.Error: the service died)" in line, line


# The thread's exception must not reach threading.excepthook (pytest's hook reports it).
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_writer_thread_failure_prints_nothing_and_drops_the_tracker(tmp_path, capfd):
    # A file-size limit just over the event file as it is: the writer thread's next write fails
    # with EFBIG, as a full disk would (no privilege needed).
    trackers = open_trackers(tmp_path, tensorboard=True, wandb=None, resume_step=0, recipe={})
    trackers.handle({"event": "eval", "step": 1, "val_loss": 1.0})
    assert trackers.trackers and not trackers.take_warnings()
    [events_file] = (tmp_path / "tensorboard").iterdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (events_file.stat().st_size + 16, hard))
        for step in range(2, 6):
            trackers.handle({"event": "warning", "step": step, "message": "x" * 200})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    [warning] = trackers.take_warnings()
    assert "could not write" in warning and "file too large" in warning, warning
    assert not trackers.trackers
    trackers.close()
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_worker_output_after_the_agents_redirect_ends_stays_in_its_log(tmp_path):
    # torch's redirect gives fd 2 back to the terminal when the worker's entry point returns;
    # a daemon thread that prints later (a tracker thread's traceback) must still go to the log.
    log = tmp_path / "stderr.log"
    code = (
        "import sys, threading, time\n"
        "from torch.distributed.elastic.multiprocessing.redirects import redirect_stderr\n"
        "from fsdprun.train.worker import _keep_output_in_log\n"
        "def late():\n"
        "    time.sleep(0.5)\n"
        "    print('late line from a daemon thread', file=sys.stderr)\n"
        f"with redirect_stderr({str(log)!r}):\n"
        "    _keep_output_in_log()\n"
        "    print('early line', file=sys.stderr)\n"
        "    threading.Thread(target=late, daemon=True).start()\n"
        "time.sleep(2.0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=fsdprun_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert log.read_text().splitlines() == ["early line", "late line from a daemon thread"]
