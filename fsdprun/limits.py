"""The process limits a run needs, checked first thing by the command line (`fsdprun.cli.main`),
before torch or anything else heavy is imported: today the open-file limit (`ulimit -n`).

A soft limit below what a run needs is raised to the hard limit, as a user expects; a hard limit
that is still too low is a `UserError` naming the limit needed. Workers inherit the raised limit
(the elastic agent forks or spawns them from this process).

Never imports an fsdprun module but `errors`: it runs before everything else.
"""

from __future__ import annotations

import resource

from fsdprun.errors import UserError

# Measured on `fsdprun train debug` (2 CPU ranks, a checkpoint at its last step, 2026-12): the
# busiest process, a worker during its checkpoint, holds 44-46 files at once (/proc/PID/fd
# sampled: launcher 25, workers 39-44); the run fails under `ulimit -n 44` (the save, or gloo's
# sockets, get EMFILE) and runs under 46. 4 ranks: launcher 33, workers 44-55 (gloo keeps a
# socket to every peer). NOFILE_NEEDED is that 2-rank figure with room for the trackers and the
# profiler.
NOFILE_MEASURED_2_RANKS = 46
NOFILE_NEEDED = 64
# Below this soft limit the soft limit is raised to the hard one: larger runs (more ranks, more
# data files, async saves) need more than the minimum, and the raise costs nothing.
NOFILE_WANTED = 4096


def ensure_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit when it is below NOFILE_WANTED.

    Returns:
        The soft limit now in force.

    Raises:
        UserError: the hard limit is below NOFILE_NEEDED.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft != infinite and soft < NOFILE_WANTED:
        # An unlimited hard limit still has the kernel's own cap (nr_open): ask for a finite one.
        target = max(NOFILE_WANTED, soft) if hard == infinite else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # kept as it is: judged below
    if soft != infinite and soft < NOFILE_NEEDED:
        raise UserError(
            f"the open-file limit is {soft} (hard limit {hard}) but fsdprun needs at least "
            f"{NOFILE_NEEDED} (a 2-rank run holds up to {NOFILE_MEASURED_2_RANKS} files at once): "
            f"raise it with `ulimit -n {NOFILE_NEEDED}` (a hard limit needs root: "
            "/etc/security/limits.conf, or `docker run --ulimit nofile=65536`)"
        )
    return soft
