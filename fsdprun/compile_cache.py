"""torch's compile caches: where they live (`compile.cache_dir`) and what compiling cost a run.

Inductor keeps its FX graph cache, AOTAutograd's cache and (unless TRITON_CACHE_DIR is set)
Triton's kernels under one folder, TORCHINDUCTOR_CACHE_DIR. torch reads that variable each time
it needs the folder (torch/_inductor/runtime/cache_dir_utils.py, torch 2.11 to 2.14), not when
it loads, and the compile subprocesses it starts are handed it: a worker that sets it before its
first compile puts every cache there. torch's default, /tmp/torchinductor_USER, belongs to one
node or container, so a restart on fresh nodes compiles everything again; a folder the nodes
share does not.

The compile time and the cache counts come from torch._dynamo.utils: `calculate_time_spent`
(the seconds of every frame's compile and of the lazily compiled backwards) and `counters`
(`fxgraph_cache_hit`, `autograd_cache_miss`, ...). They are internals, stable in name from torch
2.5 to 2.14 but not a public API: a name that goes missing makes its figure None ("n/a"), never
an error.

No torch at module load: the launcher checks the folder before any worker starts.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdprun.errors import UserError, describe_os_error

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"

# torch._dynamo.utils.counters' group and key prefix of each cache the summary reports.
CACHES = {
    "fx_graph": ("inductor", "fxgraph_cache_"),
    "aot_autograd": ("aot_autograd", "autograd_cache_"),
}
OUTCOMES = ("hit", "miss", "bypass")


def check_cache_dir(cache_dir: str | None) -> None:
    """Before launch: create `compile.cache_dir` (and its parents) and write a file in it, so a
    folder the workers could not write is refused here in one line, not in a traceback of every
    worker at its first compile (torch creates the folder then).

    Raises:
        UserError: the folder cannot be created or written (it names why and the fix).
    """
    if cache_dir is None:
        return
    path = Path(cache_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".fsdprun-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"compile.cache_dir: cannot write {path} ({describe_os_error(e)}); give a folder "
            "this user can write, on storage every node reaches, or drop the key "
            "(~compile.cache_dir) for torch's default"
        ) from e


def use_cache_dir(cache_dir: str | None) -> None:
    """In a worker, before anything compiles: torch's compile caches go to `cache_dir` (None:
    wherever the environment or torch's default puts them)."""
    if cache_dir is not None:
        os.environ[CACHE_DIR_ENV] = os.path.abspath(cache_dir)


def describe_cache_dir(cache_dir: str | None) -> str:
    """The run header's words for where the compile caches go."""
    if cache_dir is not None:
        return f"{os.path.abspath(cache_dir)} (compile.cache_dir)"
    if os.environ.get(CACHE_DIR_ENV):
        return f"{os.environ[CACHE_DIR_ENV]} ({CACHE_DIR_ENV})"
    return "torch's default, /tmp/torchinductor_USER on each node (compile.cache_dir shares one)"


def compile_stats() -> dict[str, Any] | None:
    """What compiling has cost this process so far: {"time_s", "fx_graph": {"hit", "miss",
    "bypass"}, "aot_autograd": {...}, "cache_dir"}, a figure None where this torch does not
    report it; None when nothing was compiled (torch.compile imports torch._dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    try:
        time_s = float(utils.calculate_time_spent()["total_wall_time"])
    except (AttributeError, KeyError, TypeError, ValueError):
        time_s = None
    counters = getattr(utils, "counters", None)
    stats: dict[str, Any] = {"time_s": time_s}
    for cache, (group, prefix) in CACHES.items():
        if not isinstance(counters, Mapping):
            stats[cache] = None
            continue
        counts = counters.get(group, {})  # not counters[group]: that would add the group
        stats[cache] = {o: int(counts.get(prefix + o, 0)) for o in OUTCOMES}
    # torch writes the folder it settled on back into the environment when it first uses it.
    stats["cache_dir"] = os.environ.get(CACHE_DIR_ENV)
    return stats


def combine_ranks(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The summary's compile figures from every rank's `compile_stats`: the slowest rank's time
    (the ranks wait for one another at the first collective after a compile) and the cache counts
    summed over ranks; None when no rank compiled."""
    ranks = [r for r in per_rank if r is not None]
    if not ranks:
        return None
    times = [r["time_s"] for r in ranks]
    out: dict[str, Any] = {"time_s": None if None in times else max(times)}
    for cache in CACHES:
        counts = [r[cache] for r in ranks]
        out[cache] = None if None in counts else {o: sum(c[o] for c in counts) for o in OUTCOMES}
    out["cache_dir"] = ranks[0]["cache_dir"]
    return out
