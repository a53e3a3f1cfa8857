"""One run per directory: an exclusive `flock` on RUN_DIR/.lock for the whole run.

The process that starts a run takes it before it writes anything in the directory: fsdprun's
launcher (held across elastic restarts; workers never take it), or rank 0 when fsdprun runs
under torchrun/srun. The kernel drops the lock when that process exits in any way, kill -9
included, so a lock is never stale. The file names its holder (host, pid, start time, command)
for the one-line error a second command prints and for `fsdprun status`; the holder removes it
when it lets go, so it stays only after a holder that was killed (naming that last holder).

Each node's launcher of a multi-node run locks its own file (`.lock` on node 0,
`.lock.node-N` on node N), so nodes that share RUN_DIR do not refuse one another, while a
second launch of the same node does. flock is advisory (it stops fsdprun, not other programs)
and only as good as the filesystem's locks across hosts (see docs/faults.md).

No torch here: `fsdprun status` imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fsdprun.errors import UserError, diagnostic, write_error
from fsdprun.rundir import lock_path

# Run directories this process holds, by resolved path: a command that locked early (resume
# plans under the lock) hands the launcher a directory it already holds.
_held: dict[Path, int] = {}


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory's lock."""

    host: str
    pid: int
    since: float  # seconds since the epoch
    command: str

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        command = self.command if len(self.command) <= 120 else self.command[:117] + "..."
        return f"pid {self.pid} on {self.host} since {since} ({command})"


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file records; None when it records none (released, or being taken)."""
    try:
        data = json.loads(path.read_text())
        holder = Holder(str(data["host"]), int(data["pid"]), float(data["since"]),
                        str(data["command"]))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None  # also a damaged file: int(inf) overflows, and so on
    # A time that is not one (NaN, inf, a string of digits far in the future) records no holder.
    return holder if math.isfinite(holder.since) and abs(holder.since) < 1e11 else None


def is_locked(path: Path) -> bool:
    """Whether some process holds the lock at `path` (a shared probe: it never blocks, and it
    cannot be mistaken for a holder, though an exclusive taker may see it for an instant)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no locks on this filesystem: nobody can hold one
    finally:
        os.close(fd)
    return False


@contextmanager
def hold_run_dir(run_dir: Path, *, node_rank: int = 0, option: str = "--run-dir") -> Iterator[None]:
    """Hold RUN_DIR's lock for the duration (creating RUN_DIR if needed).

    On the way out the lock file is removed, and RUN_DIR too if this call created it and it is
    still empty: a command refused after taking the lock leaves nothing behind.

    Args:
        option: the command-line option that names RUN_DIR, for the messages (`--out`).

    Raises:
        UserError: another process holds it (the message names the holder), or RUN_DIR is no
            folder.
        StorageError: RUN_DIR or its lock file cannot be written (a full disk, a read-only or
            unwritable place).
    """
    key = run_dir.resolve()
    if key in _held:
        yield
        return
    path = lock_path(run_dir, node_rank)
    name = "the run directory" if option == "--run-dir" else option
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        made = os.stat(run_dir)
        fd, locked = _open_locked(path)
    except OSError as e:
        raise write_error(f"cannot write {name} {run_dir}", e, option=option) from None
    try:
        if locked:
            holder = Holder(socket.gethostname(), os.getpid(), time.time(), _command())
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(holder.__dict__) + "\n").encode(), 0)
            except OSError as e:
                # Made here or left by a holder that was killed: it names no live holder.
                path.unlink(missing_ok=True)
                if created:
                    with contextlib.suppress(OSError):
                        run_dir.rmdir()
                raise write_error(f"cannot write {name} {run_dir} (its lock file {path.name})",
                                  e, option=option) from None  # fmt: skip
        _held[key] = fd
        try:
            yield
        finally:
            del _held[key]
            if locked:
                # Removed while still held: whoever opened it meanwhile finds, once it has the
                # lock, that the path no longer names its file, and opens the new one.
                if _names(path, fd):  # not a lock file in a folder recreated at RUN_DIR
                    path.unlink(missing_ok=True)
                # Explicit, so that copies of this fd in forked workers cannot keep it.
                fcntl.flock(fd, fcntl.LOCK_UN)
            if created:
                with contextlib.suppress(OSError):
                    now = os.stat(run_dir)
                    # Only when empty, and only the folder made here (not one recreated there).
                    if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
                        run_dir.rmdir()
    finally:
        os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _open_locked(path: Path) -> tuple[int, bool]:
    """Open and lock the lock file: (its fd, whether it is locked)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            locked = _try_lock(fd, path)
            mine = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if not locked or (now and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)):
            return fd, locked
        os.close(fd)  # its holder removed it as we locked it: take the new one


def _try_lock(fd: int, path: Path) -> bool:
    """Take the lock (True), or go on without one where the filesystem has no locks (False).

    Raises:
        UserError: another process holds it.
    """
    # A `fsdprun status` probe holds a shared lock for an instant: try a few times.
    for _ in range(20):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.05)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            diagnostic(
                "warning",
                f"cannot lock {path} ({e.strerror}): this filesystem has no file locks; nothing "
                "stops a second run from using this directory at the same time",
            )
            return False
    # The holder writes its name right after taking the lock: give it a moment.
    holder = None
    for _ in range(20):
        holder = read_holder(path)
        if holder is not None:
            break
        time.sleep(0.05)
    who = holder.describe() if holder else "another process (it has not written its name yet)"
    stop = f"; stop it with `kill -TERM {holder.pid}` on {holder.host}" if holder else ""
    raise UserError(
        f"{path.parent} is in use by another fsdprun run: {who}; wait for it to end{stop}, or "
        "use another run directory"
    )


def _command() -> str:
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["?"]
    return shlex.join(argv).replace("\n", " ")
