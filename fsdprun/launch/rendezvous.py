"""What a multi-node launch says while it waits for its other nodes in the c10d rendezvous.

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
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import TCPStore

# torch's c10d rendezvous backend keeps its state under this key plus the run id
# (torch.distributed.elastic.rendezvous.c10d_rendezvous_backend), base64 of a pickled
# _RendezvousState; before the first node writes it the value is this sentinel.
STATE_KEY = "torch.rendezvous."
_NULL_SENTINEL = b"Y2FuaW1hZGFt"
# Seconds between waiting lines: at most this, and at least three lines before the timeout.
MAX_INTERVAL_S = 10.0


def interval_s(timeout_s: float) -> float:
    return min(MAX_INTERVAL_S, max(1.0, timeout_s / 3))


class RendezvousProgress:
    """Prints waiting lines while the rendezvous at `endpoint` (HOST:PORT) is not complete.

    Args:
        endpoint: the c10d rendezvous endpoint (node 0's store).
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
    ):
        self.endpoint, self.nnodes, self.timeout_s = endpoint, nnodes, timeout_s
        self.key = STATE_KEY + run_id
        self.write = write
        self.start = time.monotonic()
        self._joined: int | None = None
        self._store: TCPStore | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rendezvous-progress", daemon=True)

    def __enter__(self) -> RendezvousProgress:
        self.write(
            f"waiting for {self.nnodes} nodes at {self.endpoint} (gives up after "
            f"launch.rdzv_timeout_s={self.timeout_s:g} s)"
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def waited_s(self) -> float:
        return time.monotonic() - self.start

    def joined(self) -> int | None:
        """Nodes that joined, as last read from the store (None: never read)."""
        return self._joined

    def _run(self) -> None:
        while not self._done.wait(interval_s(self.timeout_s)):
            state = self._read_state()
            if state is not None:
                if state.complete:
                    return  # the agents start their workers now: the run header follows
                self._joined = len(state.participants)
            joined = (
                f"{self._joined} of {self.nnodes} nodes joined"
                if self._joined is not None
                else f"the store at {self.endpoint} not reachable yet"
            )
            self.write(
                f"waiting at {self.endpoint}: {joined} ({self.waited_s():.0f} s of "
                f"{self.timeout_s:g} s)"
            )

    def _read_state(self):
        """The rendezvous state in the store, or None while it cannot be read."""
        host, _, port = self.endpoint.rpartition(":")
        try:
            if self._store is None:
                self._store = TCPStore(
                    host, int(port), is_master=False, timeout=timedelta(seconds=2),
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
