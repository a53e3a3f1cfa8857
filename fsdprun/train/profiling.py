"""torch.profiler over chosen steps of a run (the recipe's `profile` section).

    fsdprun train debug profile.enabled=true profile.ranks=[0,1]

Each profiled rank skips `wait` steps of this launch, warms the profiler up for `warmup` steps,
records `active` steps and writes RUN_DIR/profile/rank-N.pt.trace.json (Chrome/Perfetto JSON,
which TensorBoard's profiler plugin reads too). With `memory_snapshot` (CUDA only) the caching
allocator's history from the profiler's start is dumped beside it, memory-rank-N.pickle, for
pytorch.org/memory_viz. With profiling off `step` is an empty call: nothing is imported.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdprun.config import ProfileConfig
from fsdprun.rundir import profile_dir, snapshot_path, trace_path


def profiled_ranks(cfg: ProfileConfig, world_size: int) -> list[int]:
    return list(range(world_size)) if not cfg.ranks else sorted(set(cfg.ranks))


class StepProfiler:
    """The profiler of one rank: call `step()` after every training step and `stop()` at the end
    (a run that ends inside the active steps writes what it recorded)."""

    def __init__(self, cfg: ProfileConfig, *, run_dir: Path, rank: int, world_size: int,
                 device_kind: str):  # fmt: skip
        self.prof = None
        if not (cfg.enabled and rank in profiled_ranks(cfg, world_size)):
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        self.trace = trace_path(run_dir, rank)
        self.snapshot = snapshot_path(run_dir, rank) if cfg.memory_snapshot else None
        self.trace.parent.mkdir(exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device_kind == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if self.snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._save,
            record_shapes=True,
            profile_memory=True,
        )
        self.prof.start()

    def _save(self, prof) -> None:
        prof.export_chrome_trace(str(self.trace))
        if self.snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = None

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


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
