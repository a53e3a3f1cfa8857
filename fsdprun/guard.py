"""Keeping a run safe: stop requests (signals, a stop file), per-step agreement across ranks,
heartbeats that name a rank that stopped answering, and fault injection for tests and drills.

Any decision that changes control flow (stop, skip a step, finish an async save) is taken from
one all-reduce per step, so every rank takes it at the same step and no rank waits for a
collective the others skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

STOP_FILE = "STOP"
HEARTBEAT_DIR = "heartbeat"


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask the workers of a run to save a checkpoint at the next step and stop (launcher side)."""
    (run_dir / STOP_FILE).write_text(reason + "\n")


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
        stop = self.run_dir / STOP_FILE
        return stop.read_text().strip() or "stop file" if stop.exists() else None


@dataclass(frozen=True)
class Agreement:
    stop: bool
    nonfinite: bool
    saves_done: bool


class StepAgreement:
    """The per-step decisions every rank must take together.

    Stop requests and "my async save is done" travel in one small all-reduce (MAX) started at
    the beginning of a step and awaited at its end, so it overlaps the step's compute. Whether
    the step's loss or gradients are non-finite needs no extra collective: the clipped global
    gradient norm is already reduced over all ranks, and a non-finite loss on any rank makes it
    non-finite everywhere. With fp16 the grad scaler handles non-finite gradients itself, so only
    the loss counts, and that takes one more (blocking) all-reduce.
    """

    def __init__(self, *, stop: bool, save_done: bool, device: torch.device):
        self.flags = torch.tensor([float(stop), 0.0 if save_done else 1.0], device=device)
        self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, async_op=True)

    def finish(
        self, *, grad_norm: torch.Tensor, loss_sum: torch.Tensor, loss_only: bool
    ) -> Agreement:
        self.work.wait()
        if loss_only:
            bad = (~loss_sum.isfinite()).float().reshape(1)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        else:
            norm = grad_norm.to_local() if hasattr(grad_norm, "to_local") else grad_norm
            bad = (~norm.isfinite()).float().reshape(1)
        # The step's one read of device values on a non-logging step (a CPU-GPU sync): whether to
        # apply the optimizer step (non-finite) and whether to stop must be known on the host
        # now, the same on every rank. Three flags, one small copy.
        stop, not_done, nonfinite = torch.cat([self.flags, bad.to(self.flags.device)]).tolist()
        return Agreement(stop > 0, nonfinite > 0, not_done == 0)


class Heartbeat:
    """Each rank records the step it is at, so a timeout can name the rank that fell behind."""

    def __init__(self, run_dir: Path, rank: int):
        self.dir = run_dir / HEARTBEAT_DIR
        self.dir.mkdir(exist_ok=True)
        self.path = self.dir / f"rank-{rank}.json"

    def beat(self, step: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        # A full disk (an async save can fill it while training goes on) must not kill the rank:
        # a heartbeat only helps name a rank after a timeout, and the next one may fit.
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({"step": step, "time": time.time()}))
            tmp.replace(self.path)

    def laggards(self, world_size: int) -> str:
        """Which ranks are behind the others, from their last heartbeat."""
        steps = {}
        for rank in range(world_size):
            try:
                steps[rank] = json.loads((self.dir / f"rank-{rank}.json").read_text())["step"]
            except (OSError, ValueError):
                steps[rank] = None
        known = [s for s in steps.values() if s is not None]
        if not known:
            return "no heartbeats"
        top = max(known)
        behind = [f"rank {r} (last step {s})" for r, s in steps.items() if s is None or s < top]
        if not behind:
            return f"every rank reported step {top}"
        return f"stopped answering: {', '.join(behind)}; the others reached step {top}"


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


def injected_step(variable: str, rank: int) -> set[int]:
    """Fault injection for tests and drills, on the first attempt only (not after a restart):
    VARIABLE=RANK:STEP[,RANK:STEP...] → the 1-based steps at which this rank misbehaves.

    FSDPRUN_FAIL_AT raises (at train.steps + 1: after the last step and its checkpoint),
    FSDPRUN_HANG_AT stops answering, FSDPRUN_NONFINITE_AT makes the loss infinite.
    """
    spec = os.environ.get(variable)
    if not spec or restart_count() > 0:
        return set()
    steps = set()
    for item in spec.split(","):
        r, s = item.split(":")
        if int(r) == rank:
            steps.add(int(s))
    return steps
