"""Keeping a run safe: stop requests (signals, a stop file), per-step agreement across ranks,
heartbeats that name a rank that stopped answering, and fault injection for tests and drills.

Any decision that changes control flow (stop, skip a step, finish an async save) is taken from
one all-reduce per step, so every rank takes it at the same step and no rank waits for a
collective the others skipped.

Never imports the engines, the models nor the data.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdprun.children import die_with
from fsdprun.rundir import (
    RunDirWatch,
    heartbeat_dir,
    heartbeat_path,
    stop_path,
    verdict_path,
)


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask the workers of a run to save a checkpoint at the next step and stop (launcher side)."""
    stop_path(run_dir).write_text(reason + "\n")


class StopSignals:
    """SIGINT/SIGTERM in a worker: the first asks for a stop at the next step (all ranks agree
    on it, save, exit); the second aborts at once."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.signal_name: str | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting")
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> str | None:
        """Why a stop was asked for on this rank, if it was."""
        if self.signal_name:
            return self.signal_name
        stop = stop_path(self.run_dir)
        return stop.read_text().strip() or "stop file" if stop.exists() else None


@dataclass(frozen=True)
class Agreement:
    stop: bool
    nonfinite: bool
    saves_done: bool
    vanished: bool = False  # RUN_DIR is gone on some rank: nothing more may be written


class StepAgreement:
    """The per-step decisions every rank must take together.

    Stop requests, "my async save is done" and "RUN_DIR vanished" travel in one small all-reduce
    (MAX) started at
    the beginning of a step and awaited at its end, so it overlaps the step's compute. Whether
    the step's loss or gradients are non-finite needs no extra collective: the clipped global
    gradient norm is already reduced over all ranks, and a non-finite loss on any rank makes it
    non-finite everywhere. With fp16 the grad scaler handles non-finite gradients itself, so only
    the loss counts, and that takes one more (blocking) all-reduce.
    """

    def __init__(
        self, *, stop: bool, save_done: bool, device: torch.device, vanished: bool = False
    ):
        flags = [float(stop), 0.0 if save_done else 1.0, float(vanished)]
        if device.type == "cpu":
            self.flags = torch.tensor(flags)
        else:
            # From pinned memory, queued on the stream: `torch.tensor(flags, device=cuda)` would
            # copy from pageable memory, a sync that waits for the previous step's work.
            self._host = torch.tensor(flags, pin_memory=True)  # kept alive until copied
            self.flags = self._host.to(device, non_blocking=True)
        self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, async_op=True)

    def start_read(
        self, *, grad_norm: torch.Tensor, loss_sum: torch.Tensor, loss_only: bool
    ) -> PendingAgreement:
        """Start the copy of the step's flags to the host without waiting for it: the caller
        may queue more work (the optimizer step, skipped on the device by `nonfinite`) before
        `PendingAgreement.read` waits, and then waits only for the flags, not for that work."""
        self.work.wait()
        if loss_only:
            bad = (~loss_sum.isfinite()).float()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        else:
            norm = grad_norm.to_local() if hasattr(grad_norm, "to_local") else grad_norm
            bad = (~norm.isfinite()).float()
        if bad.device != self.flags.device:
            bad = bad.to(self.flags.device)
        # Every op here is host work between backward and the optimizer: as few as it takes.
        return PendingAgreement(torch.cat([self.flags, bad.reshape(1)]), nonfinite=bad)


class PendingAgreement:
    """A step's four flags on their way to the host: stop, save not done, vanished, non-finite.

    On an accelerator they are copied into pinned host memory by the device's stream (no host
    wait) and an event marks the copy; `read` waits for that event alone. On CPU they are read
    as they are (no device to wait for).
    """

    def __init__(self, flags: torch.Tensor, *, nonfinite: torch.Tensor):
        self.nonfinite = nonfinite  # on the device, shape [], 1.0 if any rank's is non-finite
        self._event = None
        if flags.device.type == "cpu":
            self._host = flags
            return
        self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        self._host.copy_(flags, non_blocking=True)
        module = torch.get_device_module(flags.device.type)
        self._event = module.Event()
        self._event.record()

    def read(self) -> Agreement:
        # The step's one read of device values on a non-logging step: whether the step's
        # update stands (non-finite) and whether to stop must be known on the host, the same on
        # every rank. Where the copy was queued, this waits for the flags' copy alone (a sync
        # with the device up to that point, not with what was queued after it).
        if self._event is not None:
            self._event.synchronize()
        stop, not_done, vanished, nonfinite = self._host.tolist()
        return Agreement(stop > 0, nonfinite > 0, not_done == 0, vanished > 0)


class Heartbeat:
    """Where each rank is, so a collective that times out can name the rank that stopped answering.

    Each rank keeps RUN_DIR/heartbeat/rank-R.json up to date: the step and phase it is in (a
    step's compute and collectives, a checkpoint save, an evaluation), its host and pid, and a time
    that a background thread refreshes every `interval_s`. Every rank makes the same sequence of
    phase changes (control flow is agreed), so a rank whose count of changes is lower than the
    others' has fallen behind; a rank whose time is stale is frozen (SIGSTOP, a debugger) or gone,
    since a process blocked in a collective still refreshes it from its thread. Times are compared
    across hosts: clocks must agree to within `stale_after_s` (NTP keeps them far closer).
    """

    def __init__(
        self, run_dir: Path, rank: int, *, world_size: int, timeout_s: float,
        watch: RunDirWatch | None = None,
    ):  # fmt: skip
        self.run_dir, self.dir = run_dir, heartbeat_dir(run_dir)
        self.run_dir_watch = watch
        self.dir.mkdir(exist_ok=True)
        self.path = heartbeat_path(run_dir, rank)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        # A live rank refreshes at least every interval_s; one silent for stale_after_s (half the
        # collective timeout) has not run at all while the others waited for it.
        self.interval_s = min(max(timeout_s / 10, 0.2), 10.0)
        self.stale_after_s = max(2.5 * self.interval_s, timeout_s / 2)
        self.state = {"step": 0, "phase": "start", "seq": 0, "pid": os.getpid(),
                      "host": socket.gethostname(), "log": _stderr_file()}  # fmt: skip
        self._lock = threading.Lock()
        if rank == 0:
            clear_verdict(run_dir)  # an earlier attempt's
        self._write()
        threading.Thread(target=self._pulse, name="fsdprun-heartbeat", daemon=True).start()

    def _write(self, **change: Any) -> None:
        with self._lock:  # the main thread and the pulse thread share the file
            self.state.update(change)
            if self.run_dir_watch is not None and self.run_dir_watch.vanished():
                return  # never into a folder recreated at RUN_DIR; the loop stops the run
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({**self.state, "time": time.time()}))
            tmp.replace(self.path)

    def _pulse(self) -> None:
        while True:
            time.sleep(self.interval_s)
            # A full or vanished disk: the step's own writes will say so.
            with contextlib.suppress(OSError):
                self._write()

    def beat(self, step: int, phase: str = "step") -> None:
        """This rank is now at `phase` of `step` (1-based; 0 before the first step)."""
        if (self.state["step"], self.state["phase"]) != (step, phase):
            # A full disk (an async save can fill it while training goes on) must not kill the
            # rank: the state is kept in memory and the pulse writes it once there is room.
            with contextlib.suppress(OSError):
                self._write(step=step, phase=phase, seq=self.state["seq"] + 1)

    @contextmanager
    def watch(self, step: int, phase: str) -> Iterator[None]:
        """Run collectives as `phase` of `step`; a collective that times out or loses its peer
        becomes one line naming where, and which rank stopped answering."""
        before = self.state["step"], self.state["phase"]
        self.beat(step, phase)
        try:
            yield
        except BaseException as e:
            kind = None if isinstance(e, KeyboardInterrupt | SystemExit) else collective_failure(e)
            where = _where(step, phase)
            if kind == "timeout":
                silent = self.silent()
                message = (
                    f"a collective timed out {where} (launch.timeout_s={self.timeout_s}); "
                    f"{self.describe(silent)}"
                )
                self._report(message, silent)
                raise RuntimeError(message) from e
            if kind == "peer":
                self._await_dead_siblings_seen()
                raise RuntimeError(f"{PEER_LOST} {where} (it exited; its own log says why)") from e
            raise
        self.beat(*before)

    def _await_dead_siblings_seen(self, appear_s: float = 2.0, limit_s: float = 10.0) -> None:
        """Exit only after this node's agent has seen the sibling that went away: the agent names
        the first worker it finds exited, and this rank, which lost its connection at once, would
        otherwise often exit within the same check interval (a SIGKILL'd rank left no error of
        its own to name it). The lost peer's sockets close before its process is a zombie, and
        it is a zombie until the agent reaps it at its check: wait up to `appear_s` for a sibling
        to die (none does when the peer was on another node), then until it is reaped."""
        start = time.monotonic()
        siblings = [rec["pid"] for rank, rec in self.read().items()
                    if rec and rank != self.rank and rec["host"] == self.state["host"]]  # fmt: skip
        while siblings and (elapsed := time.monotonic() - start) < limit_s:
            states = {_sibling_state(pid) for pid in siblings}
            if "dead" not in states and ("reaped" in states or elapsed > appear_s):
                return
            time.sleep(0.02)

    def read(self) -> dict[int, dict | None]:
        """Every rank's last record (None where a rank has none)."""
        records: dict[int, dict | None] = {}
        for rank in range(self.world_size):
            try:
                records[rank] = json.loads(heartbeat_path(self.run_dir, rank).read_text())
            except (OSError, ValueError):
                records[rank] = None
        return records

    def silent(self) -> dict[int, dict | None]:
        """The ranks that stopped answering, with their records (stale_s added): those behind
        the others and those whose heartbeat went stale."""
        records = self.read()
        known = [rec for rec in records.values() if rec is not None]
        top = max((rec["seq"] for rec in known), default=0)
        now = time.time()
        silent: dict[int, dict | None] = {}
        for rank, rec in records.items():
            if rec is None:
                silent[rank] = None
                continue
            stale_s = now - rec["time"] if rank != self.rank else 0.0
            if stale_s > self.stale_after_s or rec["seq"] < top:
                silent[rank] = {**rec, "stale_s": stale_s if stale_s > self.stale_after_s else 0}
        return silent

    def describe(self, silent: dict[int, dict | None]) -> str:
        """`silent` in words: each rank's last step and phase, how long it has been silent,
        its pid and host."""
        steps = [rec["step"] for rec in self.read().values() if rec is not None]
        if not steps:
            return "no heartbeats"
        if not silent:
            return f"every rank reported step {max(steps)}; none is silent"
        parts = []
        for rank, rec in silent.items():
            if rec is None:
                parts.append(f"rank {rank} (no heartbeat)")
                continue
            what = [f"last step {rec['step']}"]
            if rec["phase"] in _PHASES:
                what.append(_PHASES[rec["phase"]])
            if rec["stale_s"]:
                what.append(f"no heartbeat for {rec['stale_s']:.1f} s")
            parts.append(f"rank {rank} ({', '.join(what)}) on {rec['host']}, pid {rec['pid']}")
        behind = any(rec is None or rec["step"] < max(steps) for rec in silent.values())
        others = f"; the others reached step {max(steps)}" if behind else ""
        return f"stopped answering: {'; '.join(parts)}{others}"

    def _report(self, message: str, silent: dict[int, dict | None]) -> None:
        """Leave `message` for the launcher, then SIGKILL the frozen ranks of this node.

        The run is failing. The agent would SIGTERM a frozen rank, and a frozen process dies only
        of SIGKILL, 30 s later: killing it now ends the run that much sooner. The launcher then
        sees that rank die of a signal, perhaps before this one exits, so it takes the line from
        RUN_DIR/heartbeat/verdict.json rather than from whichever failure it saw first.
        """
        verdict = {"rank": self.rank, "message": message, "log": self.state["log"]}
        tmp = self.dir / f"verdict.{self.rank}.tmp"
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(verdict))
            tmp.replace(verdict_path(self.run_dir))
        for rec in silent.values():
            if rec and rec["stale_s"] and rec["host"] == self.state["host"]:
                _kill_sibling(rec["pid"])


def _stderr_file() -> str | None:
    """The file this rank's stderr goes to (its stderr.log under the elastic agent), if a file:
    a rank killed by SIGKILL cannot say where its log is, so its heartbeat does."""
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return target if os.path.isfile(target) else None


def read_verdict(run_dir: Path) -> dict | None:
    """What the rank that found others unresponsive reported (see `Heartbeat._report`)."""
    try:
        return json.loads(verdict_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def clear_verdict(run_dir: Path) -> None:
    verdict_path(run_dir).unlink(missing_ok=True)


def _sibling_state(pid: int) -> str:
    """`pid` as another worker of this rank's agent (same parent; Linux /proc only: a host name
    can repeat across containers, a parent pid in the same namespace cannot): "alive", "dead"
    (exited, not yet reaped) or "reaped" (no such process, this one, or another's: its pid was
    reused)."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        if int(ppid) != os.getppid() or pid == os.getpid():
            return "reaped"
    except (OSError, ValueError):
        return "reaped"
    return "dead" if state in ("Z", "X") else "alive"


def _kill_sibling(pid: int) -> None:
    """SIGKILL `pid` if it is another live worker of this rank's agent."""
    if _sibling_state(pid) == "alive":
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# How a rank that only lost its peer says so: the launcher names another rank's own error
# before it (fsdprun.launch.elastic.describe_failure).
PEER_LOST = "lost the connection to another rank"

# The phases a message names besides a step's own compute and collectives.
_PHASES = {"start": "while starting", "save": "in the checkpoint save", "eval": "in the evaluation"}


def _where(step: int, phase: str) -> str:
    if phase == "start":
        return "while starting" + (f" from step {step}" if step else "")
    return f"{_PHASES[phase]} at step {step}" if phase in _PHASES else f"at step {step}"


def collective_failure(error: BaseException) -> str | None:
    """'timeout' or 'peer' when a collective failed because another rank did not answer or went
    away; None for any other error."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if "connection closed" in text or "connection reset" in text or "broken pipe" in text:
        return "peer"
    return None


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def injected_step(variable: str, rank: int, phase: str = "step") -> set[int]:
    """Fault injection for tests and drills, on the first attempt only (not after a restart):
    VARIABLE=RANK:STEP[:PHASE][,...] → the 1-based steps at which this rank misbehaves in
    `phase` (step, save or eval; step when not given).

    FSDPRUN_FAIL_AT raises (at train.steps + 1: after the last step and its checkpoint),
    FSDPRUN_HANG_AT stops answering (its heartbeat thread runs on), FSDPRUN_FREEZE_AT freezes the
    whole process with SIGSTOP, FSDPRUN_NONFINITE_AT makes the loss infinite.
    """
    spec = os.environ.get(variable)
    if not spec or restart_count() > 0:
        return set()
    steps = set()
    for item in spec.split(","):
        r, s, *p = item.split(":")
        if int(r) == rank and (p[0] if p else "step") == phase:
            steps.add(int(s))
    return steps


def freeze() -> None:
    """Stop this whole process, as `kill -STOP` would (FSDPRUN_FREEZE_AT)."""
    os.kill(os.getpid(), signal.SIGSTOP)


def die_with_launcher() -> None:
    """Make this worker die when the launcher that started it dies (kill -9 included).

    torch's worker wrapper asks for SIGINT on parent death, which fsdprun would turn into a
    graceful stop whose end waits, forever, for the dead agent to collect the result. A worker
    nobody can collect or restart must not hold its memory and ports: SIGKILL instead (Linux
    prctl, when the launcher is the parent), else a thread that polls the launcher's pid
    (fsdprun.children.die_with). A launcher stopped with SIGTERM/SIGINT still stops the run at a
    checkpoint; only a launcher that dies without a word takes its workers with it, unsaved, as
    a kill -9 of the workers themselves would.
    """
    # Under fork and spawn the parent is the launcher (its elastic agent runs in-process); under
    # forkserver it is the forkserver, which may outlive a killed launcher: die_with polls then.
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if launcher:
        die_with(launcher)


LAUNCHER_PID_ENV = "FSDPRUN_LAUNCHER_PID"
