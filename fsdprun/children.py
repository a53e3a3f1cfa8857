"""Child processes: start one that dies with this process, make this process die with another,
and take SIGINT/SIGTERM for the time a child runs, forwarding them to it and putting the
handlers that were there back afterwards.

The launcher (its workers die with it; its first Ctrl-C asks them for a checkpoint), `compare`
(each configuration an `fsdprun train` child, signals forwarded to it) and `tune` (each trial a
child in its own session, killed when tune stops) use it.

"Dies with" means SIGKILL, kill -9 of the parent included: a child nobody is left to collect or
stop must not hold its memory, ports or GPUs. A parent stopped by SIGINT/SIGTERM stops its
children by its own means first (a checkpoint, a forwarded signal, a killed process group).

Never imports torch nor any fsdprun room above the ground floor.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How this node's fsdprun was started (`launch.modes`' decision, described): the CLI sets it, the
# launcher's children, its workers, inherit it and put it in the run's `start` event, which the
# header prints.
MODE_ENV = "FSDPRUN_LAUNCH_MODE"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.5  # how often die_with's watching thread looks at a process that is not the parent


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library where prctl(PR_SET_PDEATHSIG) exists (Linux), else None. Loaded in the
    parent: between fork and exec a child only calls it (dlopen there may take a lock that
    another thread of the parent held at the fork)."""
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent_preexec(parent: int, libc: ctypes.CDLL) -> Callable[[], None]:
    def preexec() -> None:
        # SIGKILL when the parent dies (the setting survives exec); a parent that died before
        # it was set would never fire it.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def start_child(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen)` whose child gets SIGKILL when this process dies
    (PR_SET_PDEATHSIG, Linux; elsewhere the child is started as Popen starts it).

    The kernel fires it when the *thread* that started the child ends: start children from a
    thread that lives as long as they should (fsdprun starts them from the main thread).
    """
    libc = _libc()
    preexec = _die_with_parent_preexec(os.getpid(), libc) if libc is not None else None
    return subprocess.Popen(cmd, preexec_fn=preexec, **popen)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def die_with(pid: int) -> None:
    """Make this process die when process `pid` dies (kill -9 included): SIGKILL from the
    kernel where `pid` is the parent on Linux (PR_SET_PDEATHSIG), else a daemon thread that
    looks at `pid` every POLL_S and exits (1) once it is gone. Exits (1) at once if `pid` is
    gone already."""
    libc = _libc()
    armed = False
    if libc is not None and os.getppid() == pid:
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    # A parent that died before the prctl would never fire it.
    if (armed and os.getppid() != pid) or not alive(pid):
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch, args=(pid,), name="fsdprun-die-with", daemon=True).start()


def _watch(pid: int) -> None:
    while alive(pid):
        time.sleep(POLL_S)
    os._exit(1)


Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def handled_signals(handler: Handler, *, keep_ignored: bool = False) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` inside the block; the handlers that were there before
    are put back after it, however it ends.

    Only the main thread may set handlers, and only it runs them: elsewhere (a test's thread)
    nothing is set and the block runs as it is.

    Args:
        keep_ignored: leave a signal this process ignores ignored. `tune` keeps an ignored
            SIGINT (a shell starts a background job so, out of the terminal's Ctrl-C): there
            a signal aborts the search. The launcher and `compare` take every SIGINT: theirs
            asks the run to stop at a checkpoint, which a script's `kill -INT` of a background
            run means too.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        for s, before in previous.items():
            if not (keep_ignored and before is signal.SIG_IGN):
                signal.signal(s, handler)
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


class ForwardSignals:
    """While entered, SIGINT and SIGTERM to this process go to the child that `run` runs (each
    one: a first stops an `fsdprun train` at a checkpoint, a second aborts it), and `signum`
    keeps the first one's number, so that the caller starts no further child.

    The child should have its own process group (`process_group=0`), so that a terminal's
    Ctrl-C reaches it once, through this process."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.signum: int | None = None

    def __enter__(self) -> ForwardSignals:
        self._handled = handled_signals(self._forward)
        self._handled.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handled.__exit__(*exc)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self, cmd: list[str], **popen: Any) -> subprocess.CompletedProcess:
        """`cmd` as a child that dies with this process (`start_child`), to its end; its
        output where `popen` pipes it (stdout=subprocess.PIPE, ...)."""
        self.child = start_child(cmd, **popen)
        try:
            out, err = self.child.communicate()
        finally:
            code, self.child = self.child.wait(), None
        return subprocess.CompletedProcess(cmd, code, out, err)
