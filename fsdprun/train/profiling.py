"""torch.profiler over chosen steps of a run (the recipe's `profile` section).

    fsdprun train debug profile.enabled=true profile.ranks=[0,1]

Each profiled rank skips `wait` steps of this launch, warms the profiler up for `warmup` steps,
records `active` steps and writes RUN_DIR/profile/rank-N.pt.trace.json (Chrome/Perfetto JSON,
which TensorBoard's profiler plugin reads too). With `memory_snapshot` (CUDA only) the caching
allocator's history from the profiler's start is dumped beside it, memory-rank-N.pickle, for
pytorch.org/memory_viz. With profiling off `step` is an empty call: nothing is imported.

A trace that cannot be written (a full disk: torch's exporter then leaves a partial
`rank-N.pt.trace.json.tmp` and says nothing) costs no training: the partial files are removed and
the rank warns in one line (rank 0 through the run's events, the others in their logs).
"""

from __future__ import annotations

import contextlib
import errno
import resource
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fsdprun.config import ProfileConfig
from fsdprun.errors import describe_os_error, diagnostic, find_os_error
from fsdprun.fmt import fmt_bytes
from fsdprun.rundir import profile_dir, snapshot_path, trace_path

NEARLY_FULL_BYTES = 1 << 20  # less free than this after a failed export: the disk was full


def profiled_ranks(cfg: ProfileConfig, world_size: int) -> list[int]:
    return list(range(world_size)) if not cfg.ranks else sorted(set(cfg.ranks))


class StepProfiler:
    """The profiler of one rank: call `step()` after every training step and `stop()` at the end
    (a run that ends inside the active steps writes what it recorded)."""

    def __init__(self, cfg: ProfileConfig, *, run_dir: Path, rank: int, world_size: int,
                 device_kind: str, start_step: int,
                 warn: Callable[[str], None] | None = None):  # fmt: skip
        self.prof = None
        if not (cfg.enabled and rank in profiled_ranks(cfg, world_size)):
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, self._warn = rank, warn
        self.trace = trace_path(run_dir, rank)
        self.snapshot = snapshot_path(run_dir, rank) if cfg.memory_snapshot else None
        try:
            self.trace.parent.mkdir(exist_ok=True)
        except OSError as e:
            self.warn(f"profile: rank {rank} does not profile: cannot create {self.trace.parent} "
                      f"({describe_os_error(e)}); training goes on")  # fmt: skip
            return
        activities = [ProfilerActivity.CPU]
        if device_kind == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if self.snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # The trace names each step `ProfilerStep#N` after the profiler's own count, which starts
        # at 0. Starting that count at the run's next step (numbered from 1, as the log and the
        # `profile` event number them) makes ProfilerStep#3 the log's step 3; the schedule skips
        # the steps before it so that `wait` still counts steps of this launch.
        first = start_step + 1
        self.prof = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1, skip_first=first
            ),
            on_trace_ready=self._save,
            record_shapes=True,
            profile_memory=True,
        )
        self.prof.step_num = first
        self.prof.current_action = self.prof.schedule(first)
        self.prof.start()

    def warn(self, message: str) -> None:
        if self._warn is not None:
            self._warn(message)  # rank 0: a warning event, shown on the terminal
        else:
            diagnostic("warning", message)  # this rank's log

    def _save(self, prof) -> None:
        error = None
        try:
            prof.export_chrome_trace(str(self.trace))
        except Exception as e:  # the Python exporter raises; kineto's leaves a .tmp instead
            error = e
        if error is not None or not _written_whole(self.trace):
            self._discard(self.trace, error)
        if self.snapshot is not None:
            try:
                torch.cuda.memory._dump_snapshot(str(self.snapshot))
            except Exception as e:
                self._discard(self.snapshot, e)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = None

    def _discard(self, path: Path, error: BaseException | None) -> None:
        """Remove what was written of `path` and say why in one line. torch's C++ exporter names
        no error: a partial file at the file-size limit is EFBIG, a disk with (almost) nothing
        free is ENOSPC, else the free space is given."""
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        largest = 0
        for partial in (path, path.with_name(path.name + ".tmp")):
            with contextlib.suppress(OSError):
                largest = max(largest, partial.stat().st_size)
                partial.unlink()
        os_error = find_os_error(error) if error is not None else None
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if os_error is None and limit != resource.RLIM_INFINITY and largest >= limit:
            os_error = OSError(errno.EFBIG, "File too large")
        elif os_error is None and free is not None and free < NEARLY_FULL_BYTES:
            os_error = OSError(errno.ENOSPC, "No space left on device")
        why = describe_os_error(os_error) if os_error is not None else f"{fmt_bytes(free)} free"
        self.warn(f"profile: {path} did not fit ({why}); the partial file was removed, "
                  "training goes on")  # fmt: skip

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


def _written_whole(trace: Path) -> bool:
    """Whether the exporter wrote the whole trace: kineto writes TRACE.tmp and renames it when
    done, and a whole Chrome trace is one JSON object (it ends with its closing brace)."""
    if trace.with_name(trace.name + ".tmp").exists() or not trace.is_file():
        return False
    try:
        with trace.open("rb") as f:
            f.seek(max(trace.stat().st_size - 64, 0))
            return f.read().rstrip().endswith(b"}")
    except OSError:
        return False


def profile_record(cfg: ProfileConfig, *, run_dir: Path, world_size: int, start_step: int) -> dict:
    """The `profile` event (rank 0, at the end): the steps recorded and each profiled rank's
    trace, or why there is none."""
    first = start_step + cfg.wait + cfg.warmup + 1
    ranks = profiled_ranks(cfg, world_size)
    return {
        "steps": [first, first + cfg.active - 1],
        "dir": str(profile_dir(run_dir)),
        "traces": [str(trace_path(run_dir, r)) for r in ranks if trace_path(run_dir, r).is_file()],
        # Another node's traces are on its own disk; a run shorter than wait + warmup has none.
        "missing": [r for r in ranks if not trace_path(run_dir, r).is_file()],
        "memory_snapshots": [
            str(snapshot_path(run_dir, r)) for r in ranks if snapshot_path(run_dir, r).is_file()
        ],  # fmt: skip
    }
