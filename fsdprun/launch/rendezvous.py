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

The rendezvous itself is torch's c10d, under fsdprun's name (`NODES_BACKEND`, registered with
torch's public handler registry) with two things added, because torch's c10d handler orders
nodes by arrival order's tie-break (their host name, then process id) and takes each node's own
count of nodes on trust:

- Each node's launcher publishes its node rank and node count in the rendezvous store before it
  joins. A node that finds another that disagrees (another node count, or the same node rank)
  writes one line naming every node's value, closes the rendezvous, and every node fails with
  that line (exit 2): the store's host (node 0) waits for the others to have read it before it
  exits. Without it, node 0 said "2 of 2 nodes joined" and the other "2 of 3" or torch's raw
  "Failed to recv".
- Once the rendezvous is complete, each node takes its node rank as its rank in the group, so
  global rank 0 (the rank that writes metrics.jsonl, whose launcher prints the step lines) runs
  on node 0, as torchrun's static rendezvous promises; torch's c10d put it on whichever node
  sorted first, node 1 when both ran on hosts of one name. The workers' store stays where torch
  put it (the node torch ranked first hosts it; every worker connects to it as a client).

Never imports the engines nor the models.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from fsdprun.errors import UserError
from fsdprun.launch.flags import named

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


# ------------------------------------------------------------------------------------------------
# fsdprun's multi-node rendezvous: torch's c10d, node ranks as given, nodes that agree.

NODES_BACKEND = "fsdprun-c10d"
# What the launcher adds to the rendezvous configuration (torch's c10d reads none of them).
NODE_RANK_CONF, NNODES_FROM_CONF = "fsdprun_node_rank", "fsdprun_nnodes_from"
# How long node 0, which hosts the store, waits for the other nodes to read why the rendezvous
# closed before it exits (its store goes with it). Each node polls the state about every second.
VERDICT_WAIT_S = 10.0


class NodesDisagree(RendezvousError):
    """The nodes of one job were started with different node counts, or two with one node rank:
    one line naming each node's value, which every node says."""


@dataclass(frozen=True)
class NodeFacts:
    """What one node's launcher was started with, as it publishes it before joining."""

    token: str  # this launcher process, across its rendezvous rounds
    host: str
    node_rank: int
    nnodes: int
    nnodes_from: str  # how a message names the count's source: PET_NNODES, --nnodes, ...


def disagreement(facts: list[NodeFacts]) -> str | None:
    """One line naming what the nodes disagree on, or None when they agree (so far)."""
    by_rank = sorted(facts, key=lambda f: (f.node_rank, f.host))
    if len({f.nnodes for f in facts}) > 1:
        said = ", ".join(
            f"node {f.node_rank} has {named(f.nnodes_from, f.nnodes)}" for f in by_rank
        )
        return (
            f"the nodes disagree on the node count: {said}; start every node of the job with "
            "the same number of nodes"
        )
    ranks = [f.node_rank for f in by_rank]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        hosts = ", ".join(f.host for f in by_rank if f.node_rank == twice[0])
        return (
            f"two nodes have node rank {twice[0]} ({hosts}): give each node of the job its own "
            f"node rank, 0 to {by_rank[0].nnodes - 1}"
        )
    return None


class NodeRankRendezvous(RendezvousHandler):
    """torch's c10d rendezvous handler (`inner`), with the nodes' agreement checked and node ranks
    as group ranks (see the module's docstring).

    Args:
        inner: torch's c10d handler.
        store: the rendezvous store (node 0 hosts it), where the nodes publish their facts.
        facts: this node's.
        is_host: this node hosts the store.
    """

    def __init__(self, inner: RendezvousHandler, store: Store, *, facts: NodeFacts, is_host: bool):
        self._inner, self._store, self._facts, self._is_host = inner, store, facts, is_host
        self._key = f"fsdprun/{inner.get_run_id()}/"

    def get_backend(self) -> str:
        return NODES_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        with _store_errors():
            self._publish()
            problem = disagreement(self._published())
            if problem is not None:
                # This node found it: every other node learns it from the store (the rendezvous
                # closed: each one's join fails, and it reads why).
                self._store.set(self._key + "verdict", problem)
                self._inner.set_closed()
                self._leave(problem)
        try:
            info = self._inner.next_rendezvous()
        except RendezvousClosedError:
            verdict = self._verdict()
            if verdict is None:
                raise
            self._leave(verdict)
        with _store_errors():
            facts = self._published()
        ranks = sorted(f.node_rank for f in facts)
        problem = disagreement(facts)
        if problem is None and ranks != list(range(info.world_size)):
            problem = (
                f"the {info.world_size} nodes that joined have node ranks {ranks}: give each "
                f"node its own node rank, 0 to {info.world_size - 1}"
            )
        if problem is not None:
            raise NodesDisagree(problem)
        if not self.use_agent_store:
            # Worker rank 0 then hosts the workers' store on the address torch published for
            # the node it ranked first (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): keep its order.
            return info
        return RendezvousInfo(
            info.store, self._facts.node_rank, info.world_size, info.bootstrap_store_info
        )

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()

    def _publish(self) -> None:
        # A slot of its own (`add` hands out each number once), read by every node.
        slot = self._store.add(self._key + "count", 1)
        self._store.set(f"{self._key}node/{slot}", json.dumps(asdict(self._facts)))

    def _published(self) -> list[NodeFacts]:
        """Every node's facts, the latest of each launcher (a restart publishes again)."""
        count = self._store.add(self._key + "count", 0)
        keys = [f"{self._key}node/{slot}" for slot in range(1, count + 1)]
        found = {}
        for raw in self._store.multi_get(keys) if keys else []:
            facts = NodeFacts(**json.loads(raw))
            found[facts.token] = facts
        return list(found.values())

    def _verdict(self) -> str | None:
        """Why another node closed the rendezvous, if it wrote why (None: it did not, or the
        store is gone)."""
        key = self._key + "verdict"
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store went away: torch's own error says so
            return None

    def _leave(self, problem: str) -> None:
        """Raise the disagreement, once the other nodes have read it if this node hosts the
        store (it goes away with this process)."""
        with contextlib.suppress(Exception):  # a store gone takes nothing from the message
            if not self._is_host:
                self._store.add(self._key + "read", 1)
            else:
                others = len(self._published()) - 1
                deadline = time.monotonic() + VERDICT_WAIT_S
                read = self._key + "read"
                while self._store.add(read, 0) < others and time.monotonic() < deadline:
                    time.sleep(0.1)
        raise NodesDisagree(problem)


@contextlib.contextmanager
def _store_errors():
    """A failure of the rendezvous store (its host gone) as torch's handler reports one."""
    try:
        yield
    except RendezvousError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's errors are RuntimeError subclasses
        raise RendezvousConnectionError(f"the rendezvous store failed: {e}") from e


def _create_nodes_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler (as torch's registry creates it for "c10d"), wrapped."""
    backend, store = create_backend(params)
    inner = create_handler(store, backend, params)
    node_rank = params.get_as_int(NODE_RANK_CONF, 0) or 0
    facts = NodeFacts(
        token=uuid.uuid4().hex, host=socket.gethostname(), node_rank=node_rank,
        nnodes=params.max_nodes, nnodes_from=params.get(NNODES_FROM_CONF, "launch.nnodes"),
    )  # fmt: skip
    is_host = bool(params.get_as_bool("is_host", node_rank == 0))
    return NodeRankRendezvous(inner, store, facts=facts, is_host=is_host)


rendezvous_handler_registry.register(NODES_BACKEND, _create_nodes_handler)
