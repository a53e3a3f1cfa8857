"""The trials of `fsdprun tune`: each an ordinary `fsdprun train` child in its own process group
(its command, environment and fault drills), killed at its timeout or with tune, read back into
one trial record (or a one-line reason); the loss check against the baseline; and the trial log
OUT/trials.jsonl that a rerun continues from.

Never imports the training loop, the launcher, the search or the report: a trial is a
subprocess, and what to run next is search.py's (its schedule is a list of `Round`s, defined
here because each trial is run for one).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdprun.children import start_child
from fsdprun.config import load_recipe
from fsdprun.errors import StorageError, UserError, write_error
from fsdprun.report.metrics import read_events
from fsdprun.rundir import metrics_path
from fsdprun.tools.compare import error_line

if TYPE_CHECKING:
    from fsdprun.tools.tune.space import Candidate


LOSS_STEPS = 3  # the loss check compares this many first steps with the baseline's
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # by param_dtype
FAULT_ENV = "FSDPRUN_TUNE_FAULT"  # drills: TRIAL_ID:NAME=VALUE[;...] into one trial's environment
FAULT_NAMES = ("FSDPRUN_FAIL_AT", "FSDPRUN_HANG_AT", "FSDPRUN_FREEZE_AT", "FSDPRUN_NONFINITE_AT")
# The fix once a write that failed mid-search can succeed again: the trial log keeps the work.
CONTINUES = "rerun the same command: it continues where it stopped"
# How a trial's `fsdprun train` words a write the machine refused (errors.describe_os_error and
# the OS's own strerror, lowercased): tune stops there, since every later trial would fail too.
STORAGE_PHRASES = ("no space left on device", "disk quota exceeded", "file too large",
                   "read-only file system")  # fmt: skip
# What every trial changes beside its knobs: no checkpoints, evaluations, trackers or profiler
# (not the training step), every step logged.
TRIAL_OVERRIDES = (
    "checkpoint.save_final=false", "checkpoint.every_steps=0", "eval.every_steps=0",
    "output.log_every=1", "output.tensorboard=false", "output.wandb=null",
    "profile.enabled=false", "launch.max_restarts=0",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Trials


@dataclass(frozen=True)
class Round:
    """One round of the search's successive halving: every trial of it measures `measured_steps`
    steps, `repeats` times per candidate."""

    index: int
    num_candidates: int  # the baseline included
    measured_steps: int
    repeats: int


def trial_id(round_index: int, cand: Candidate, rep: int) -> str:
    return f"r{round_index}-{cand.id}-{rep}"


def _fsdprun_command() -> list[str]:
    return [sys.executable, "-m", "fsdprun"]


def _fault_env(tid: str) -> dict[str, str]:
    """The fault-injection variables FSDPRUN_TUNE_FAULT gives trial `tid` (drills and tests)."""
    out = {}
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        target, _, assignment = item.partition(":")
        name, _, value = assignment.partition("=")
        if target == tid and name in FAULT_NAMES:
            out[name] = value
    return out


def trial_env(tid: str) -> dict[str, str]:
    """The environment of trial `tid`'s `fsdprun train`: this one, its fault drills, and never a
    SLURM step's marks, so that the trial is its node's launcher as tune is (inside an srun step
    of one task per node its `train` gets --nnodes as an override, not as the flag that tells
    srun_env so)."""
    env = dict(os.environ, **_fault_env(tid))
    env.pop(FAULT_ENV, None)
    env.pop("SLURM_STEP_ID", None)
    return env


def short_schedule(recipe: str, overrides: list[str], total_steps: int) -> list[str]:
    """A learning-rate warm-up longer than the trial, cut to the trial's length: `train` refuses
    schedule.warmup_steps > train.steps (llama-1b warms up over 10 steps; a first-round trial
    runs 3 + timing warm-up), and every candidate and the baseline get the same schedule, so the
    steps measured and the losses compared are alike. tuned.yaml never carries it
    (scripts/bench_tune.py cuts its timed runs the same way)."""
    try:
        schedule_warmup = load_recipe(recipe, overrides).config.schedule.warmup_steps
    except UserError:  # the trial's own `train` says what is wrong
        return []
    return [f"schedule.warmup_steps={total_steps}"] if schedule_warmup > total_steps else []


def run_trial(
    recipe: str, overrides: list[str], cand: Candidate, *, tid: str, round_: Round, warmup: int,
    out_dir: Path, timeout_s: float, multi_node: bool = False, alive=None,
) -> dict[str, Any]:  # fmt: skip
    """One `fsdprun train` of `cand` in its own process group; its trial record.

    `multi_node`: this is one node's part of a multi-node trial, whose metrics only the node of
    global rank 0 writes: a part that ends well without them is "ok" without measurements (see
    nodes.merge_records). `alive()` is polled while the trial runs; once it is False (node 0
    of a multi-node tune is gone) the trial is killed."""
    run_dir = out_dir / "trials" / tid
    log = out_dir / "logs" / f"{tid}.log"
    try:
        if run_dir.exists():  # left by a tune killed during this trial: its result never logged
            shutil.rmtree(run_dir)
        log.parent.mkdir(parents=True, exist_ok=True)
        log_file = log.open("w")
    except OSError as e:
        raise write_error(f"cannot write trial {tid}'s log {log}", e, option="--out",
                          then=CONTINUES) from None  # fmt: skip
    total_steps = warmup + round_.measured_steps
    cmd = [
        *_fsdprun_command(), "train", recipe, *overrides, *cand.overrides, *TRIAL_OVERRIDES,
        f"train.steps={total_steps}", f"output.timing_warmup_steps={warmup}",
        *short_schedule(recipe, [*overrides, *cand.overrides], total_steps),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = trial_env(tid)
    record: dict[str, Any] = {
        "event": "trial", "id": tid, "candidate": cand.id, "label": cand.label,
        "overrides": cand.overrides, "round": round_.index, "measured_steps": round_.measured_steps,
        "warmup_steps": warmup, "run_dir": str(run_dir),
    }  # fmt: skip
    start = time.perf_counter()
    with log_file as f:
        # A tune killed with SIGKILL must not leave its trial (and so its workers) running: the
        # trial launcher dies with tune (its workers with it, see train/guard.py). Its own
        # session: tune kills the whole group at a timeout, and a terminal's Ctrl-C reaches tune
        # alone, which then kills it.
        proc = start_child(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                           start_new_session=True)  # fmt: skip
        try:
            _wait_trial(proc, timeout_s, alive)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            record["status"] = "timeout"
        except _Abandoned:
            _kill_group(proc)
            record["status"], record["reason"] = "failed", "node 0 went away"
            record["wall_s"] = time.perf_counter() - start
            return record
        except BaseException:  # Ctrl-C: the trial goes with tune, and is never logged
            _kill_group(proc)
            raise
    record["wall_s"] = time.perf_counter() - start
    events = read_events(metrics_path(run_dir)) if metrics_path(run_dir).exists() else []
    steps = [e for e in events if e["event"] == "step"]
    summary = events[-1] if events and events[-1]["event"] == "summary" else None
    start_event = next((e for e in events if e["event"] == "start"), {})
    record["losses"] = [e["loss"] for e in steps]
    record["device_name"] = start_event.get("device_name")
    record["world_size"] = start_event.get("world_size")
    if record.get("status") == "timeout":
        last = steps[-1]["step"] if steps else 0
        record["reason"] = f"hung: no result within {timeout_s:.0f} s (killed after step {last})"
        return record
    if multi_node and proc.returncode == 0 and not events:
        record["status"] = "ok"  # global rank 0 ran on another node: its part has the figures
        return record
    if proc.returncode != 0 or summary is None:
        text = log.read_text(errors="replace")
        line = error_line(text)
        if any(p in line.lower() for p in STORAGE_PHRASES):
            # Not logged: the rerun, once there is room, runs this trial again.
            why = line.removeprefix("error: ")
            raise StorageError(f"trial {tid} could not write under {out_dir}: {why}; free some "
                               f"space there (or make it writable), then {CONTINUES}")  # fmt: skip
        record["status"] = "oom" if "out of memory" in text.lower() else "failed"
        record["reason"] = f"exit {proc.returncode}: {line}"
        return record
    if summary.get("stopped"):  # a STOP file in the trial's run dir: exit 0, but cut short
        stopped = summary["stopped"]
        record["status"] = "failed"
        record["reason"] = f"stopped at step {stopped['step']} ({stopped['reason']})"
        return record
    times = summary["step_times_s"]
    tokens = start_event.get("tokens_per_step") or 0
    ranks = summary["ranks"]
    gpu = "peak_allocated_bytes" in ranks[0]
    record.update(
        status="ok",
        step_times_s=times[warmup:],
        tokens_per_step=tokens,
        time_to_first_step_s=record["wall_s"] - sum(times[1:]),
        warmup_s=sum(times[:warmup]),
        mfu=summary["throughput"].get("mfu"),
        peak_bytes=max(r["peak_allocated_bytes" if gpu else "peak_rss_bytes"] for r in ranks),
        memory_kind="allocated" if gpu else "RSS",
        model_state_bytes=max(r["model_state_bytes"]["total"] for r in ranks),
    )
    return record


class _Abandoned(Exception):
    """The trial's `alive()` turned False."""


def _wait_trial(proc: subprocess.Popen, timeout_s: float, alive) -> None:
    if alive is None:
        proc.wait(timeout=timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        if not alive():
            raise _Abandoned
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def loss_problem(losses: list[float], reference: list[float], rtol: float) -> str | None:
    """Why a trial's first losses disagree with the baseline's of the same round, or None."""
    n = min(LOSS_STEPS, len(reference))
    if len(losses) < n:
        return f"loss check: only {len(losses)} steps logged"
    for step, (got, want) in enumerate(zip(losses[:n], reference[:n], strict=True), start=1):
        if not math.isfinite(got) or abs(got - want) > rtol * max(abs(want), 1e-12):
            return f"loss check: step {step} loss {got:.6g} vs baseline {want:.6g} (rtol {rtol:g})"
    return None


# ---------------------------------------------------------------------------------------------
# The trial log


class TrialLog:
    """OUT/trials.jsonl: a header naming the search, then one record per finished trial (event
    `trial`: the search's, in `records`; `confirm`: the confirmation's after it, in
    `confirmations`), and the notes `fsdprun status` reads (each run's `session`: its start and
    budget; `done`: the verdict). Each line is appended and fsynced, so a killed tune leaves
    whole records only; a torn last line (a kill inside the write) is cut off when the log is
    opened again."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.confirmations: list[dict[str, Any]] = []
        if path.exists():
            good, lines = 0, path.read_bytes().split(b"\n")
            docs = []
            for line in lines:
                try:
                    docs.append(json.loads(line))
                except ValueError:
                    break
                good += len(line) + 1
            if good < path.stat().st_size:
                try:
                    os.truncate(path, good)
                except OSError as e:
                    raise write_error(f"cannot cut the torn last line of {path}", e,
                                      option="--out", then=CONTINUES) from None  # fmt: skip
            if docs:
                if docs[0].get("search") != header["search"]:
                    raise UserError(
                        f"--out {path.parent}: holds a tune of another search (recipe, "
                        "overrides, space or launch differ); give a new --out, or the same "
                        "arguments to continue it"
                    )
                self.records = [d for d in docs[1:] if d.get("event") == "trial"]
                self.confirmations = [d for d in docs[1:] if d.get("event") == "confirm"]
                return
        self._append(header)

    def _append(self, doc: dict[str, Any]) -> None:
        size = self.path.stat().st_size if self.path.exists() else None
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(doc) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            # Whole records only: a part written is cut off again (the header's file removed).
            with contextlib.suppress(OSError):
                if size is None:
                    self.path.unlink()
                else:
                    os.truncate(self.path, size)
            raise write_error(f"cannot write {self.path}", e, option="--out",
                              then=CONTINUES) from None  # fmt: skip

    def add(self, record: dict[str, Any]) -> None:
        self._append(record)
        (self.confirmations if record.get("event") == "confirm" else self.records).append(record)

    def note(self, event: str, **fields: Any) -> None:
        """A line for `fsdprun status`, not a trial."""
        self._append({"event": event, **fields})

    def get(self, tid: str) -> dict[str, Any] | None:
        return next((r for r in (*self.records, *self.confirmations) if r["id"] == tid), None)
