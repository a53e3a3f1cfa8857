"""What a multi-node launch says while it waits: for node 0's name to resolve, then for its other
nodes in the c10d rendezvous.

On Kubernetes node 0's address is a headless service's name (a TrainJob's
`<job>-node-0-0.<job>`, a PyTorchJob's `<job>-master-0`) that resolves only once that pod is up,
and pods start minutes apart. `wait_for_host` waits for it, with a line saying so, up to
launch.rdzv_timeout_s, and gives torch the address it resolved to.

torch's elastic agent blocks in `next_rendezvous()` until every node has joined or
launch.rdzv_timeout_s has passed, and says nothing meanwhile. `RendezvousProgress` prints a line
at once and then every few seconds from a background thread: the endpoint, how many nodes have
joined of how many (read from the rendezvous state the agents keep in the c10d store at the
endpoint, as a second client of that store), how long it has waited and when it gives up.
`joined()` is what the launcher's one-line timeout message reports.

Never imports the engines nor the models.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from fsdprun.errors import UserError

# torch's c10d rendezvous backend keeps its state under this key plus the run id
# (torch.distributed.elastic.rendezvous.c10d_rendezvous_backend), base64 of a pickled
# _RendezvousState; before the first node writes it the value is this sentinel.
STATE_KEY = "torch.rendezvous."
_NULL_SENTINEL = b"Y2FuaW1hZGFt"
# Seconds between waiting lines: at most this, and at least three lines before the timeout.
MAX_INTERVAL_S = 10.0
# For tests only: a file of `ADDRESS NAME...` lines (as /etc/hosts) that `resolve` reads before
# asking the system's resolver. A test writes a name into it while a launcher waits: the one way
# to make a name start resolving, as a pod's service name does, without editing /etc/hosts.
TEST_HOSTS_ENV = "FSDPRUN_TEST_HOSTS"
POLL_S = 0.5  # how often a waiting launcher asks the resolver again


def interval_s(timeout_s: float) -> float:
    return min(MAX_INTERVAL_S, max(1.0, timeout_s / 3))


def resolve(host: str) -> str | None:
    """The IP address `host` resolves to (an IPv4 one first), or None while it does not."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host.strip("[]")))
    hosts = os.environ.get(TEST_HOSTS_ENV)
    if hosts:
        with contextlib.suppress(OSError):
            for line in Path(hosts).read_text().splitlines():
                addr, *names = line.split() or [""]
                if host in names:
                    return addr
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # socket.gaierror: not (yet) known
        return None
    addrs = [info[4][0] for info in infos]
    return next((a for a in addrs if ":" not in a), addrs[0] if addrs else None)


def wait_for_host(
    endpoint: str, *, timeout_s: float, write: Callable[[str], None], poll_s: float = POLL_S
) -> str:
    """`endpoint` (HOST:PORT) with HOST resolved to its address, once it resolves.

    Raises:
        UserError: HOST did not resolve within `timeout_s`.
    """
    host, _, port = endpoint.rpartition(":")
    addr = resolve(host)
    if addr is None:
        start = time.monotonic()
        deadline, next_line = start + timeout_s, start + interval_s(timeout_s)
        write(
            f"waiting for the rendezvous host {host} to resolve (node 0's name; a Kubernetes "
            f"service's name resolves once its pod is up); gives up after "
            f"launch.rdzv_timeout_s={timeout_s:g} s"
        )
        while (addr := resolve(host)) is None:
            now = time.monotonic()
            if now >= deadline:
                raise UserError(
                    f"the rendezvous host {host} did not resolve within launch.rdzv_timeout_s="
                    f"{timeout_s:g}: check the name (node 0's host, or its pod's service) and "
                    "that node 0 runs, or raise launch.rdzv_timeout_s"
                )
            if now >= next_line:
                write(f"waiting for {host} to resolve ({now - start:.0f} s of {timeout_s:g} s)")
                next_line += interval_s(timeout_s)
            time.sleep(min(poll_s, deadline - now))
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


class RendezvousProgress:
    """Prints waiting lines while the rendezvous at `endpoint` (HOST:PORT) is not complete.

    Args:
        endpoint: the c10d rendezvous endpoint (node 0's store).
        shown: the endpoint as the user gave it, for the lines (default `endpoint`).
        nnodes: nodes the rendezvous waits for.
        timeout_s: launch.rdzv_timeout_s, for the "gives up after" part of the lines.
        run_id: the rendezvous' run id (the agent's LaunchConfig.run_id).
        write: where each line goes.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        nnodes: int,
        timeout_s: float,
        run_id: str,
        write: Callable[[str], None],
        shown: str | None = None,
    ):
        self.endpoint, self.nnodes, self.timeout_s = endpoint, nnodes, timeout_s
        self.shown = shown or endpoint
        self.key = STATE_KEY + run_id
        self.write = write
        self.start = time.monotonic()
        self._joined: int | None = None
        self._store: TCPStore | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rendezvous-progress", daemon=True)

    def __enter__(self) -> RendezvousProgress:
        self.write(
            f"waiting for {self.nnodes} nodes at {self.shown} (gives up after "
            f"launch.rdzv_timeout_s={self.timeout_s:g} s)"
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # The thread may be blocked connecting to a store that never answers: it writes
        # nothing once done, and as a daemon it does not hold the command's exit.
        self._done.set()
        self._thread.join(timeout=0.2)

    def waited_s(self) -> float:
        return time.monotonic() - self.start

    def joined(self) -> int | None:
        """Nodes that joined, as last read from the store (None: never read)."""
        return self._joined

    def _run(self) -> None:
        while not self._done.wait(interval_s(self.timeout_s)):
            state = self._read_state()
            if self._done.is_set() or self.waited_s() >= self.timeout_s:
                # The rendezvous ended while the store was read, or is about to give up (on a
                # loaded machine its failure can take a moment to surface): its outcome says it.
                return
            if state is not None:
                if state.complete:
                    return  # the agents start their workers now: the run header follows
                self._joined = len(state.participants)
            joined = (
                f"{self._joined} of {self.nnodes} nodes joined"
                if self._joined is not None
                else f"the store at {self.shown} not reachable yet"
            )
            self.write(
                f"waiting at {self.shown}: {joined} ({self.waited_s():.0f} s of "
                f"{self.timeout_s:g} s)"
            )

    def _read_state(self):
        """The rendezvous state in the store, or None while it cannot be read."""
        host, _, port = self.endpoint.rpartition(":")
        try:
            if self._store is None:
                # Connecting blocks up to its timeout: never past the rendezvous's own.
                wait = min(2.0, self.timeout_s)
                self._store = TCPStore(
                    host, int(port), is_master=False, timeout=timedelta(seconds=wait),
                    wait_for_workers=False,
                )  # fmt: skip
            if not self._store.check([self.key]):
                return None
            raw = self._store.get(self.key)
            if raw == _NULL_SENTINEL:
                return None
            # The agents of this job wrote it (torch's own backend unpickles the same bytes).
            return pickle.loads(base64.b64decode(raw))  # noqa: S301
        except Exception:  # noqa: BLE001 - a store not up yet, going away, or another torch
            return None
