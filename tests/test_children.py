"""fsdprun.children with real processes: a child started by `start_child` dies when its parent is
SIGKILLed (a plain child beside it lives on), `die_with` ends a process with its parent or with
any other process, SIGINT and SIGTERM reach the child that `ForwardSignals` runs, and every
handler is put back afterwards. Small Python and `sleep` processes, about a second in all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fsdprun.children import POLL_S, ForwardSignals, alive, handled_signals

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"
)


def _python(code: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], text=True, **popen)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def _kill(*pids: int) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@linux_only
def test_start_child_dies_with_its_parent_killed_and_a_plain_child_does_not():
    parent = _python(
        """
        import subprocess
        from fsdprun.children import start_child
        ours = start_child(["sleep", "60"])
        plain = subprocess.Popen(["sleep", "60"])
        print(ours.pid, plain.pid, flush=True)
        ours.wait()
        """,
        stdout=subprocess.PIPE,
    )
    ours, plain = map(int, parent.stdout.readline().split())
    try:
        parent.kill()
        parent.wait()
        assert _gone(ours, 5), "the child outlived its SIGKILLed parent"
        assert alive(plain), "the control child died too: the test shows nothing"
    finally:
        _kill(ours, plain)


@linux_only
def test_die_with_the_parent_or_another_process():
    # The parent (prctl): the kernel kills this process with SIGKILL as the parent dies, even
    # stopped (a frozen worker, whose watching thread could never run).
    parent = _python(
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c",
            "import os, time; from fsdprun.children import die_with\\n"
            "die_with(os.getppid()); print('armed', flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "armed\\n"
        print(child.pid, flush=True)
        child.wait()
        """,
        stdout=subprocess.PIPE,
    )
    child = int(parent.stdout.readline())
    try:
        os.kill(child, signal.SIGSTOP)
        parent.kill()
        parent.wait()
        assert _gone(child, 5), "the child outlived its SIGKILLed parent"
    finally:
        _kill(child)

    # Another process (a thread watches it): this one exits 1 once it is gone.
    other = subprocess.Popen(["sleep", "60"])
    watcher = _python(
        f"""
        import time
        from fsdprun.children import die_with
        die_with({other.pid})
        print("armed", flush=True)
        time.sleep(60)
        """,
        stdout=subprocess.PIPE,
    )
    try:
        assert watcher.stdout.readline() == "armed\n"
        other.kill()
        other.wait()
        assert watcher.wait(timeout=POLL_S + 5) == 1
        # A process that is gone already: exit at once.
        late = _python(f"from fsdprun.children import die_with; die_with({other.pid}); print(1)")
        assert late.wait(timeout=5) == 1
    finally:
        _kill(other.pid, watcher.pid)


# Asks its parent for a SIGINT and then a SIGTERM, each once the one before came back to it.
ASKS_FOR_SIGNALS = """
import os, signal, time
got = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, frame: got.append(signal.Signals(signum).name))
for n, s in enumerate((signal.SIGINT, signal.SIGTERM), start=1):
    os.kill(os.getppid(), s)
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        time.sleep(0.01)
print(" ".join(got))
"""


def test_signals_are_forwarded_to_the_child_and_the_handlers_put_back():
    # Only the main thread gets handlers; a SIGINT sent to this process without one would
    # interrupt pytest itself.
    assert threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with ForwardSignals() as forward:
        proc = forward.run([sys.executable, "-c", ASKS_FOR_SIGNALS], stdout=subprocess.PIPE,
                           text=True, process_group=0)  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.split() == ["SIGINT", "SIGTERM"], proc
        assert forward.signum == signal.SIGINT  # the first one is kept
        os.kill(os.getpid(), signal.SIGTERM)  # no child now: kept out of harm, not forwarded
        assert forward.child is None and forward.signum == signal.SIGINT
    assert {s: signal.getsignal(s) for s in before} == before


class _Caught(Exception):
    pass


def _raise(signum: int, frame: object) -> None:
    raise _Caught(signal.Signals(signum).name)


def test_handled_signals_puts_back_keeps_ignored_and_leaves_other_threads_alone():
    assert threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    # Put back however the block ends: here by the handler's own exception.
    with pytest.raises(_Caught, match="SIGTERM"), handled_signals(_raise):
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is _raise
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here at once
    assert {s: signal.getsignal(s) for s in before} == before

    # keep_ignored: a SIGINT this process ignores stays ignored; without it, it is taken.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with handled_signals(_raise, keep_ignored=True):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is _raise
        with handled_signals(_raise):
            assert signal.getsignal(signal.SIGINT) is _raise
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[signal.SIGINT])

    # Off the main thread nothing is set (signal.signal would raise there) and the block runs.
    seen = []

    def in_thread() -> None:
        with handled_signals(_raise):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == [before[signal.SIGTERM]]
