"""The run directory: every path fsdprun reads or writes under RUN_DIR, spelled in one place.

    RUN_DIR/
      recipe.yaml                 the resolved recipe the workers read (earlier: recipe.N.yaml)
      metrics.jsonl               the event log (the recipe's output.metrics_file names it)
      logs/                       each worker's output (the elastic agent's log folder)
      checkpoints/step-00000008/  one checkpoint; its manifest.json is written last
      heartbeat/rank-R.json       where each rank is; verdict.json names a rank that went silent
      STOP                        asks the workers to save a checkpoint and stop
      .lock, .lock.node-N         held by the launcher of node 0 (node N) while the run runs
      agent.json                  the torchrun agent that created the directory
      profile/                    torch.profiler traces and CUDA memory snapshots
      tokenized/                  the launcher's tokens of its data, for spawned workers (while
                                  the run runs)
      tensorboard/, wandb/        the trackers' folders
      compare.log                 the terminal output of one `fsdprun compare` run

A run holds its directory open (`RunDirWatch`) and checks before it writes that RUN_DIR still
names the directory it started in: a directory deleted or moved under a live run (an operator's
`rm -rf`, a cleaned scratch disk) ends the run in one line, and nothing is written into a folder
recreated at the same path.

Plain path arithmetic (and reading recipe.yaml's metrics file name): never imports torch, since
`status` and the launcher read run directories without it, and nothing else of fsdprun, so that
every package may import it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import yaml

RECIPE_FILE = "recipe.yaml"
DEFAULT_METRICS_FILE = "metrics.jsonl"  # output.metrics_file's default
LOCK_FILE = ".lock"
MANIFEST_FILE = "manifest.json"
TUNE_LOG_FILE = "trials.jsonl"  # a `fsdprun tune` --out's trial log (fsdprun.tools.tune)
_STEP_DIR = re.compile(r"step-([0-9]+)")


def default_run_dir(recipe_name: str, *, job: str | None = None) -> Path:
    """runs/<recipe>-<YYYYmmdd-HHMMSS> under the working directory: output.run_dir's default.

    A name already taken (a run started in the same second, say by a script launching short
    runs back to back) gets -2, -3, ...: a new run never lands in an earlier run's folder. Two
    launchers racing for one name in the same instant are told apart by the run lock, which
    refuses the second in one line.

    Args:
        job: for a multi-node run, launch.rdzv_id: runs/<recipe>-<job>, the name every node's
            launcher computes alike without talking to the others (their clocks and start
            times differ), as an external launcher's ranks use its job id. Taken as it is: a
            folder that already holds a run is refused by the launch, naming `fsdprun resume`.
    """
    if job is not None:
        return Path("runs") / f"{recipe_name}-{job}"
    base = Path("runs") / f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime())}"
    path, n = base, 1
    while path.exists() or path.is_symlink():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def recipe_path(run_dir: Path) -> Path:
    return run_dir / RECIPE_FILE


def recipe_header(name: str) -> str:
    """recipe.yaml's first line: the recipe it was resolved from (a name or a file's stem)."""
    return f"# resolved by fsdprun from '{name}'"


_RECIPE_HEADER = re.compile(r"# resolved by fsdprun from '(.+)'")


def recipe_name(run_dir: Path) -> str | None:
    """The recipe a run was started from, as its recipe.yaml's first line records it (a resume
    writes the same name again), or None for a file without that line."""
    try:
        with recipe_path(run_dir).open() as f:
            match = _RECIPE_HEADER.fullmatch(f.readline().rstrip("\n"))
    except OSError:
        return None
    return match.group(1) if match else None


def earlier_recipe_path(run_dir: Path, n: int) -> Path:
    """Where the n-th earlier session's recipe.yaml is kept (a resumed run writes a new one)."""
    return run_dir / f"recipe.{n}.yaml"


def metrics_path(run_dir: Path) -> Path:
    """The run's metrics file: output.metrics_file of its recipe.yaml (metrics.jsonl when that
    cannot be read)."""
    try:
        recipe = yaml.safe_load(recipe_path(run_dir).read_text())
        name = str(recipe["output"]["metrics_file"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        name = DEFAULT_METRICS_FILE
    return run_dir / name


def logs_dir(run_dir: Path, log_dir: str | None = None) -> Path:
    """Where the elastic agent writes each rank's stdout.log and stderr.log: launch.log_dir when
    set (torchrun --log-dir), else RUN_DIR/logs."""
    return Path(log_dir) if log_dir else run_dir / "logs"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a checkpoint folder named like `step_dir`'s, or None for any other name."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def manifest_path(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / MANIFEST_FILE


def heartbeat_dir(run_dir: Path) -> Path:
    return run_dir / "heartbeat"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return heartbeat_dir(run_dir) / f"rank-{rank}.json"


def heartbeat_paths(run_dir: Path) -> list[tuple[int, Path]]:
    """(rank, file) of every heartbeat file there is, by rank."""
    found = []
    for path in heartbeat_dir(run_dir).glob("rank-*.json"):
        rank = path.stem.removeprefix("rank-")
        if rank.isascii() and rank.isdigit():
            found.append((int(rank), path))
    return sorted(found)


def verdict_path(run_dir: Path) -> Path:
    return heartbeat_dir(run_dir) / "verdict.json"


def stop_path(run_dir: Path) -> Path:
    return run_dir / "STOP"


def lock_path(run_dir: Path, node_rank: int = 0) -> Path:
    return run_dir / (LOCK_FILE if node_rank == 0 else f"{LOCK_FILE}.node-{node_rank}")


def lock_paths(run_dir: Path) -> list[Path]:
    """Every node's lock file there is."""
    return sorted(run_dir.glob(f"{LOCK_FILE}*")) if run_dir.is_dir() else []


def agent_path(run_dir: Path) -> Path:
    return run_dir / "agent.json"


def profile_dir(run_dir: Path) -> Path:
    return run_dir / "profile"


def trace_path(run_dir: Path, rank: int) -> Path:
    return profile_dir(run_dir) / f"rank-{rank}.pt.trace.json"


def snapshot_path(run_dir: Path, rank: int) -> Path:
    return profile_dir(run_dir) / f"memory-rank-{rank}.pickle"


def tokenized_dir(run_dir: Path) -> Path:
    """What the launcher tokenized of text or fine-tuning data, for workers that do not inherit
    it (fsdprun.data.spec.save_tokenized); the launcher deletes it when the run ends."""
    return run_dir / "tokenized"


def tensorboard_dir(run_dir: Path) -> Path:
    return run_dir / "tensorboard"


def wandb_dir(run_dir: Path) -> Path:
    return run_dir / "wandb"


def compare_log_path(run_dir: Path) -> Path:
    return run_dir / "compare.log"


class RunDirVanished(Exception):
    """RUN_DIR no longer names the directory the run started in (raised at `step`, agreed by
    every rank, before anything is written)."""

    def __init__(self, step: int):
        super().__init__(f"the run directory vanished at step {step}")
        self.step = step


class RunDirWatch:
    """RUN_DIR as this process found it: an open descriptor of the directory and its identity
    (device and inode). Holding it open keeps the inode from being reused by a folder recreated
    at the same path, so `vanished` cannot be fooled by one."""

    def __init__(self, run_dir: Path):
        self.path = run_dir
        self._fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        st = os.fstat(self._fd)
        self.identity = (st.st_dev, st.st_ino)

    def vanished(self) -> bool:
        """Whether RUN_DIR is gone, or names another directory now (one stat)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def moved_to(self) -> Path | None:
        """Where the directory is now if it was moved (Linux), None if it was deleted or the
        system cannot tell."""
        try:
            if os.fstat(self._fd).st_nlink == 0:
                return None
            where = os.readlink(f"/proc/self/fd/{self._fd}")
        except OSError:
            return None
        return None if where.endswith(" (deleted)") else Path(where)

    def message(self, *, step: int, checkpoint: str | None) -> str:
        """One line: the directory vanished, where the run stopped, what was last saved where."""
        moved = self.moved_to()
        fate = f"was moved to {moved}" if moved is not None else "was deleted"
        text = (
            f"the run directory {self.path} {fate} while the run ran; it stopped at step {step} "
            f"without saving, and wrote nothing under {self.path} since"
        )
        if checkpoint is None:
            return f"{text}; no checkpoint had been saved"
        name = Path(checkpoint).name
        if moved is not None:
            return (
                f"{text}; the last checkpoint, {name}, is now in {checkpoint_root(moved)} "
                f"(`fsdprun resume {moved}` continues from it)"
            )
        return f"{text}; the last checkpoint, {name} ({checkpoint}), was in it and is gone too"
