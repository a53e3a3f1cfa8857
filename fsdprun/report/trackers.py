"""Experiment trackers: TensorBoard (`output.tensorboard`) and Weights & Biases (`output.wandb`).

Rank 0 hands the trackers the same event dicts it writes to metrics.jsonl (`Trackers.handle`).
`Rows` turns each event into one row, the same for both trackers, so the charts hold the values
of metrics.jsonl: scalars for `step` and `eval` events (loss, val loss, lr, grad norm, tokens/s,
trained tokens/s on fine-tuning data, step time, MFU when a peak is known, peak memory in GiB),
and the other events (start, resume, restart, checkpoint, skip, stopped, warnings, summary) as
JSON text.

Both follow a resume into the same run, and no step goes backwards or repeats:

- TensorBoard appends event files to RUN_DIR/tensorboard/. A session that starts from the
  checkpoint of step S opens its writer with purge_step=S+1: TensorBoard then drops the earlier
  sessions' events from step S+1 on, which this session logs again (as metrics.jsonl keeps each
  step once after an elastic restart).
- W&B resumes the run whose id is kept in RUN_DIR/wandb/run_id (`resume="allow"`). W&B cannot
  drop logged steps, so the last step logged is kept in RUN_DIR/wandb/last_step and a later
  session logs only later steps. Offline (the default) the runs are written to
  RUN_DIR/wandb/offline-run-*; `wandb sync RUN_DIR/wandb/offline-run-*` uploads them.

tensorboard and wandb are optional extras, imported here only when their tracker is on (config
validation checks that they are installed, without importing them).

A tracker that cannot write never costs the user their training; metrics.jsonl is the record
and the trackers are views of it. Before launch, `tracker_folder_errors` refuses in one line a
tracker folder that obviously cannot be written (read-only, not a folder, no permission). During
the run, a tracker whose open, write or close fails (a full disk, EIO, W&B's own errors) is
dropped with one warning on rank 0 (a `warning` event) and the run goes on without it; its
background thread (TensorBoard writes from one) prints nothing of its own.

Never imports the engines nor the training loop; torch (TensorBoard's writer) and wandb only where
a tracker starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdprun.errors import UserError, describe_os_error, find_os_error
from fsdprun.rundir import tensorboard_dir, wandb_dir

GIB = 2**30
WANDB_MODES = ("offline", "online", "disabled")
WANDB_KEYS = ("project", "name", "mode")

# Events shown as text (JSON of the event's fields) on the step they belong to.
TEXT_EVENTS = (
    "start", "resume", "restart", "load_weights", "checkpoint", "skip", "save_error", "warning",
    "stopped", "profile", "summary",
)  # fmt: skip


@dataclass
class Row:
    """What one metrics event becomes in a tracker."""

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


class Rows:
    """Metrics events → tracker rows. Events without a step (a warning, the start and the summary)
    go on the latest step seen."""

    def __init__(self, step: int):
        self.step = step
        self._mfu_per_token = None  # MFU of one token/s on the whole world, once known

    def __call__(self, event: dict[str, Any]) -> Row | None:
        kind = event["event"]
        if isinstance(event.get("step"), int):
            self.step = event["step"]
        if kind == "start" and event.get("peak_flops_per_device"):
            self._mfu_per_token = event["flops_per_token"] / (
                event["world_size"] * event["peak_flops_per_device"]
            )
        if kind == "step":
            scalars = {
                "train/loss": event["loss"],
                "train/lr": event["lr"],
                "train/grad_norm": event["grad_norm"],
                "train/tokens_seen": event["tokens_seen"],
                "perf/tokens_per_s": event["tokens_per_s"],
                "perf/step_time_s": event["step_time_s"],
            }
            if self._mfu_per_token is not None:
                scalars["perf/mfu"] = event["tokens_per_s"] * self._mfu_per_token
            if "trained_tokens_per_s" in event:  # fine-tuning data: only unmasked targets
                scalars["perf/trained_tokens_per_s"] = event["trained_tokens_per_s"]
            for key, value in event.get("memory", {}).items():
                scalars[f"memory/{key.removesuffix('_bytes')}_gib"] = value / GIB
            return Row(self.step, scalars=scalars)
        if kind == "eval":
            return Row(self.step, scalars={"val/loss": event["val_loss"]})
        if kind in TEXT_EVENTS:
            fields = {k: v for k, v in event.items() if k not in ("event", "step_times_s")}
            return Row(self.step, texts={f"events/{kind}": json.dumps(fields)})
        return None


class TensorBoardTracker:
    key = "output.tensorboard"

    def __init__(self, run_dir: Path, *, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_threads()
        self.folder = tensorboard_dir(run_dir)
        # Events of steps after the checkpoint this session starts from are replayed: purge them.
        self.writer = SummaryWriter(str(self.folder), purge_step=resume_step + 1)

    def log(self, row: Row) -> None:
        for tag, value in row.scalars.items():
            self.writer.add_scalar(tag, value, row.step)
        for tag, text in row.texts.items():
            self.writer.add_text(tag, text, row.step)
        # Rows come every log_every steps: writing each one keeps a crashed session's rows.
        self.writer.flush()

    def close(self, *, failed: bool) -> None:
        self.writer.close()


def _quiet_tensorboard_threads() -> None:
    """TensorBoard writes event files from a thread that, when a write fails, prints its
    traceback (threading.excepthook) and keeps the error for the writer's next call, which
    raises it here. The printing is dropped: that traceback reached the terminal when it came
    after the worker's output had gone back from its log to the terminal (torch's redirect ends
    before the process does), glued to the launcher's `error:` line."""
    if getattr(threading.excepthook, "fsdprun_quiet", False):
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if type(args.thread).__module__.startswith("tensorboard."):
            return  # raised again in the thread that writes: Trackers drops the tracker
        previous(args)

    hook.fsdprun_quiet = True
    threading.excepthook = hook


class WandbTracker:
    key = "output.wandb"

    def __init__(self, run_dir: Path, settings: dict[str, str], *, recipe: dict[str, Any]):
        import wandb

        self.folder = folder = wandb_dir(run_dir)
        folder.mkdir(exist_ok=True)
        id_file, self.last_file = folder / "run_id", folder / "last_step"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B's own ids: 8 characters of [a-z0-9]
            id_file.write_text(run_id + "\n")
        # The last step an earlier session logged: W&B keeps it, so this session starts after it.
        self.floor = int(self.last_file.read_text()) if self.last_file.is_file() else -1
        self.last = self.floor
        try:
            self.run = wandb.init(
                **wandb_settings(run_dir, settings),
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=recipe,
                allow_val_change=True,  # a resume may change train.steps, launch.*, ...
                # console off: rank 0's terminal output is fsdprun's report, not W&B's.
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as e:  # W&B raises its own types (no login, no network in online mode)
            if find_os_error(e) is not None:
                raise  # a write that failed (a full disk): Trackers goes on without W&B
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise UserError(
                f"output.wandb: W&B could not start the run ({why}); run `wandb login` for "
                "mode: online, or use mode: offline"
            ) from e

    def log(self, row: Row) -> None:
        if row.scalars:
            if row.step <= self.floor or row.step < self.last:
                return  # logged by an earlier session (W&B would drop it anyway)
            self.run.log(row.scalars, step=row.step)
            self.last = row.step
            self.last_file.write_text(f"{row.step}\n")
        if row.texts:
            # Text of an earlier step (a restart names its checkpoint's step; an async save
            # finishes steps later) goes on the step being logged: W&B steps only go forward.
            self.run.log(row.texts, step=max(row.step, self.last, self.floor + 1))

    def close(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The trackers a recipe turns on (none: `handle` does nothing). A tracker whose write fails
    is dropped; `take_warnings` then returns the one line saying so, for the caller to log."""

    def __init__(self, trackers: list, *, resume_step: int, warnings: list[str] | None = None):
        self.trackers = trackers
        self.rows = Rows(resume_step)
        self._warnings = list(warnings or [])
        if trackers:
            _OPEN.append(self)

    def handle(self, event: dict[str, Any]) -> None:
        if not self.trackers:
            return
        row = self.rows(event)
        if row is None:
            return
        row.scalars = {k: v for k, v in row.scalars.items() if v is not None}
        for tracker in list(self.trackers):
            try:
                with quiet_logging_errors():
                    tracker.log(row)
            except Exception as e:  # a full disk, EIO, or W&B's own errors: never fatal
                self._drop(tracker, e, f"at step {row.step}")

    def take_warnings(self) -> list[str]:
        """The warnings of trackers dropped since the last call (each tracker warns once)."""
        taken, self._warnings = self._warnings, []
        return taken

    def _drop(self, tracker, error: BaseException, when: str) -> None:
        self.trackers.remove(tracker)
        self._warnings.append(stopped_writing(tracker.key, tracker.folder, error, when))
        with contextlib.suppress(Exception), quiet_logging_errors():
            tracker.close(failed=True)

    def close(self, *, failed: bool = False) -> None:
        if self in _OPEN:
            _OPEN.remove(self)
        for tracker in list(self.trackers):
            try:
                with quiet_logging_errors():
                    tracker.close(failed=failed)
            except Exception as e:  # its last rows did not fit: metrics.jsonl has them
                self.trackers.remove(tracker)
                self._warnings.append(stopped_writing(tracker.key, tracker.folder, e, "at close"))
        self.trackers = []


@contextlib.contextmanager
def quiet_logging_errors():
    """While a tracker runs: a log file of its own that cannot be written (W&B's debug.log, on
    the disk that filled) makes the logging module print a "--- Logging error ---" traceback per
    record; those are dropped (the failure itself is reported once, by Trackers)."""
    previous, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        yield
    finally:
        logging.raiseExceptions = previous


def stopped_writing(key: str, folder: Path, error: BaseException, when: str) -> str:
    """The one warning line of a tracker that could not write."""
    os_error = find_os_error(error)
    if os_error is not None:
        why = describe_os_error(os_error)
    else:
        why = (str(error).splitlines() or [""])[0] or type(error).__name__
    return (
        f"{key}: could not write {folder} {when} ({why}); training goes on without this "
        "tracker (metrics.jsonl keeps every record)"
    )


_OPEN: list[Trackers] = []  # this process's open trackers, for close_on_failure


def close_on_failure() -> None:
    """Close the trackers of a failing run. Needed because a worker started by the elastic agent
    ends with os._exit, which runs no atexit hook (W&B's included): its last rows would stay in
    W&B's buffer and the .wandb file of the session would be empty."""
    while _OPEN:
        _OPEN[-1].close(failed=True)


def open_trackers(
    run_dir: Path, *, tensorboard: bool, wandb: dict[str, str] | None, resume_step: int,
    recipe: dict[str, Any],
) -> Trackers:  # fmt: skip
    """Open the trackers of `output.tensorboard` and `output.wandb` (rank 0 only).

    Args:
        run_dir: the run directory; the trackers write below it.
        tensorboard: output.tensorboard.
        wandb: output.wandb (None: off).
        resume_step: the step of the checkpoint this session starts from (0: none).
        recipe: the resolved recipe, as W&B's run config.
    """
    trackers: list = []
    warnings: list[str] = []
    opening = []
    if tensorboard:
        opening.append((TensorBoardTracker.key, tensorboard_dir(run_dir),
                        lambda: TensorBoardTracker(run_dir, resume_step=resume_step)))  # fmt: skip
    if wandb is not None:
        opening.append((WandbTracker.key, wandb_dir(run_dir),
                        lambda: WandbTracker(run_dir, wandb, recipe=recipe)))  # fmt: skip
    for key, folder, start in opening:
        try:
            with quiet_logging_errors():
                trackers.append(start())
        except UserError:
            raise  # a setting to fix (W&B online without a login): the run does not start
        except Exception as e:  # the folder cannot be written after all (a full disk)
            warnings.append(stopped_writing(key, folder, e, "at its start"))
    return Trackers(trackers, resume_step=resume_step, warnings=warnings)


def wandb_settings(run_dir: Path, settings: dict[str, str]) -> dict[str, str]:
    """output.wandb with its defaults filled in: project, name and mode of the W&B run."""
    return {
        "project": settings.get("project", "fsdprun"),
        "name": settings.get("name", run_dir.name),
        "mode": settings.get("mode", "offline"),
    }


def describe_trackers(
    run_dir: Path, *, tensorboard: bool, wandb: dict[str, str] | None
) -> list[str]:
    """Where each tracker the recipe turns on writes, one phrase each (the run header's line)."""
    out = []
    if tensorboard:
        out.append(f"TensorBoard -> {tensorboard_dir(run_dir)}/")
    if wandb is not None:
        w = wandb_settings(run_dir, wandb)
        if w["mode"] == "disabled":
            out.append("W&B disabled (output.wandb.mode)")
        else:
            online = f" and project {w['project']}" if w["mode"] == "online" else ""
            out.append(f"W&B {w['mode']} run {w['name']} -> {wandb_dir(run_dir)}/{online}")
    return out


def tracker_errors(*, tensorboard: bool, wandb: dict[str, str] | None) -> list[str]:
    """Config checks of output.tensorboard and output.wandb: settings, and that the extra is
    installed (looked up with find_spec, not imported: validation stays fast)."""
    from importlib.util import find_spec

    errors = []
    if tensorboard and find_spec("tensorboard") is None:
        errors.append("output.tensorboard needs tensorboard: pip install 'fsdprun[tensorboard]'")
    if wandb is None:
        return errors
    for key, value in wandb.items():
        if key not in WANDB_KEYS:
            errors.append(f"output.wandb.{key} is not a W&B setting; use {', '.join(WANDB_KEYS)}")
        elif key == "mode" and value not in WANDB_MODES:
            errors.append(
                f"output.wandb.mode: {value!r} is not valid; use {', '.join(WANDB_MODES)}"
            )
        elif not value.strip() or not value.isprintable():
            errors.append(f"output.wandb.{key}: {value!r} must be printable text, not empty")
    if find_spec("wandb") is None:
        errors.append("output.wandb needs wandb: pip install 'fsdprun[wandb]'")
    return errors


def tracker_folder_errors(run_dir: Path, *, tensorboard: bool, wandb: dict[str, str] | None
                          ) -> list[str]:  # fmt: skip
    """Before launch: each tracker's folder under `run_dir` can be created and written, as far
    as can be told without writing (a folder on a read-only mount, a file in its place, no
    permission). A run directory that does not exist yet is the launcher's to create and check.
    What still fails at run time (a full disk) is a warning, not an error (see `Trackers`)."""
    if not run_dir.is_dir():
        return []
    folders = []
    if tensorboard:
        folders.append(("output.tensorboard", tensorboard_dir(run_dir), "output.tensorboard=false"))
    if wandb is not None and wandb.get("mode") != "disabled":
        folders.append(("output.wandb", wandb_dir(run_dir), "~output.wandb"))
    errors = []
    for key, folder, off in folders:
        problem = _folder_problem(folder)
        if problem:
            errors.append(f"{key}: cannot write its folder {folder} ({problem}); make it "
                          f"a writable folder, or turn the tracker off with {off}")  # fmt: skip
    return errors


def _folder_problem(folder: Path) -> str | None:
    # The folder, or where it would be created.
    where = folder if os.path.lexists(folder) else folder.parent
    if not where.is_dir():
        return "it is not a folder" if where == folder else f"{where} is not a folder"
    if os.access(where, os.W_OK | os.X_OK):
        return None
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        return "read-only file system"
    return "permission denied"
