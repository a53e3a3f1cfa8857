"""Multi-node `fsdprun tune`: node 0 searches, the other nodes run the same trials with it.

    # on every node, the same arguments and its own --node-rank (as for fsdprun train):
    fsdprun tune my.yaml --nnodes 2 --node-rank $NODE --nproc-per-node 8 \
        --rdzv-endpoint node0:29500 --budget 30m --device-memory 80GB --out tune-my

Node 0 (--node-rank 0) hosts a TCPStore at --rdzv-endpoint for the whole search. It alone plans,
prunes, decides each next trial (from its trial log and its clock: the budget) and writes
OUT/trials.jsonl and OUT/tuned.yaml. The others never decide: for trial N node 0 publishes the
trial (id, candidate overrides, steps, timeout and a fresh rendezvous endpoint on node 0's host,
so no trial's rendezvous meets a finished one's state), every node launches its part of that one
multi-node `fsdprun train`, and every node sends back what its part saw. torch's c10d rendezvous
orders the nodes by host name and pid, so global rank 0 (the one that writes metrics.jsonl) may
run on any node: the measurements are taken from whichever node found them. At the end node 0
publishes the stop with the report, which every node prints. The trials are therefore the same
on every node and in the same order by construction, and a follower started with other arguments
is refused (the search keys differ).

A node that goes away stops the search on the others with one line (node 0's trial log stays
consistent: a trial is logged only once every node has reported it); rerunning every node's
command with the same --out continues where it stopped.

Store keys: `search` (node 0's key of the search), `joined` and `done` (followers counted with
add), `trial/N` (the Nth trial, or the stop), `result/N/K` (node K's record of trial N).

Never imports the launcher; torch (for TCPStore) only when a multi-node tune starts.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fsdprun.errors import UserError

POLL_S = 0.2  # how often a waiting node looks at the store (a cheap `check`)
REPORT_SLACK_S = 120.0  # beyond a trial's timeout, how long node 0 waits for a node's record
DONE_WAIT_S = 30.0  # how long node 0 keeps the store up for the others to read the stop


class NodeLost(Exception):
    """Another node of a multi-node tune went away or stopped answering (one line, exit 1)."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT → (host, port).

    Raises:
        UserError: not HOST:PORT.
    """
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(
            f"--rdzv-endpoint {endpoint!r}: give HOST:PORT of node 0 (e.g. node0:29500)"
        )
    return host, int(port)


def free_port() -> int:
    """A port free on this host now, for one trial's rendezvous (node 0 hosts it: its agent binds
    it a moment later, as torch itself picks MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _store(endpoint: str, *, master: bool, timeout_s: float):
    from torch.distributed import TCPStore

    host, port = split_endpoint(endpoint)
    try:
        return TCPStore(host, port, is_master=master, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout_s))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError subclasses by cause
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if master:
            raise UserError(
                f"node 0 cannot host the tune's store at --rdzv-endpoint {endpoint}: {first}; "
                "choose a free port on node 0"
            ) from e
        raise UserError(
            f"cannot reach node 0's tune at --rdzv-endpoint {endpoint} within "
            f"launch.rdzv_timeout_s={timeout_s:g}: {first}; start node 0 (--node-rank 0) with "
            "the same arguments, or raise launch.rdzv_timeout_s"
        ) from e


def _wait(store, key: str, *, timeout_s: float | None, who: str) -> bytes | None:
    """The value of `key` once set; None after `timeout_s`. A store that went away (its host
    process ended) raises NodeLost."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            if store.check([key]):
                return store.get(key)
        except Exception as e:  # noqa: BLE001 - a closed connection surfaces as RuntimeError
            raise NodeLost(f"{who} went away ({type(e).__name__})") from e
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)


class Leader:
    """Node 0's side: hosts the store, publishes each trial and gathers every node's record."""

    def __init__(self, endpoint: str, *, nnodes: int, search: str, timeout_s: float):
        self.endpoint, self.nnodes, self.timeout_s = endpoint, nnodes, timeout_s
        self.host = split_endpoint(endpoint)[0]
        self.store = _store(endpoint, master=True, timeout_s=timeout_s)
        self.store.set("search", search)
        self.count, self.joined = 0, False

    def wait_for_nodes(self, say: Callable[[str], None]) -> None:
        """Every other node has joined (before the first trial: a missing node would make every
        trial's rendezvous time out).

        Raises:
            UserError: not all joined within launch.rdzv_timeout_s.
        """
        if self.joined:
            return
        say(f"waiting for {self.nnodes - 1} other node(s) at {self.endpoint}")
        deadline = time.monotonic() + self.timeout_s
        while (n := self.store.add("joined", 0)) < self.nnodes - 1:
            if time.monotonic() > deadline:
                raise UserError(
                    f"tune at {self.endpoint}: {n + 1} of {self.nnodes} nodes joined within "
                    f"launch.rdzv_timeout_s={self.timeout_s:g}; start every node's fsdprun tune "
                    f"with the same arguments, --nnodes {self.nnodes}, --rdzv-endpoint "
                    f"{self.endpoint} and its own --node-rank"
                )
            time.sleep(POLL_S)
        self.joined = True

    def run(self, trial: dict[str, Any], run_here: Callable[[dict[str, Any]], dict]) -> dict:
        """Publish `trial` (the JSON the followers run), run node 0's part, and merge every
        node's record.

        Raises:
            NodeLost: a node sent no record within the trial's timeout and REPORT_SLACK_S.
        """
        n = self.count
        self.count += 1
        trial = dict(trial, endpoint=f"{self.host}:{free_port()}")
        self.store.set(f"trial/{n}", json.dumps(trial))
        records = [run_here(trial)]
        for k in range(1, self.nnodes):
            raw = _wait(self.store, f"result/{n}/{k}", timeout_s=REPORT_SLACK_S, who=f"node {k}")
            if raw is None:
                raise NodeLost(
                    f"node {k} sent no result of trial {trial['tid']} within {REPORT_SLACK_S:g} s "
                    "after node 0's part ended; rerun every node's command to continue"
                )
            records.append(json.loads(raw))
        return merge_records(records)

    def finish(self, doc: dict[str, Any], *, wait_s: float = DONE_WAIT_S) -> None:
        """Publish the stop (the report, or an error) and wait up to `wait_s` for the others to
        read it (after that, or at once, they find the store gone and say node 0 went away)."""
        self.store.set(f"trial/{self.count}", json.dumps(dict(doc, stop=True)))
        deadline = time.monotonic() + wait_s
        while self.store.add("done", 0) < self.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)


def follow(
    endpoint: str, *, node_rank: int, search: str, timeout_s: float,
    run_here: Callable[[dict[str, Any], Callable[[], bool]], dict], say: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """A follower's side: run node 0's trials until it stops; returns node 0's report.

    `run_here(trial, alive)` runs this node's part of one trial; `alive()` is False once node 0
    is gone (the part is then killed rather than left waiting for peers).

    Raises:
        UserError: this node's arguments differ from node 0's, or node 0 cannot be reached.
        NodeLost: node 0 went away (Ctrl-C, killed) or stopped with an error.
    """
    store = _store(endpoint, master=False, timeout_s=timeout_s)
    theirs = _wait(store, "search", timeout_s=timeout_s, who="node 0")
    if theirs is None or theirs.decode() != search:
        raise UserError(
            f"node {node_rank}: node 0's tune at {endpoint} searches with other arguments "
            "(recipe, overrides, space, launch or --steps/--repeats/--finalists differ); give "
            "every node the same arguments but --node-rank"
        )
    store.add("joined", 1)
    say(f"node {node_rank}: following node 0's search at {endpoint}")

    def alive() -> bool:
        try:
            store.check(["search"])
            return True
        except Exception:  # noqa: BLE001
            return False

    for n in range(1_000_000):
        trial = json.loads(_wait(store, f"trial/{n}", timeout_s=None, who="node 0's tune"))
        if trial.get("stop"):
            store.add("done", 1)
            if trial.get("error"):
                raise NodeLost(f"node 0 stopped: {trial['error']}")
            return trial["report"]
        record = run_here(trial, alive)
        if not alive():
            raise NodeLost(f"node 0's tune went away during trial {trial['tid']}; rerun every "
                           "node's command with the same --out to continue")  # fmt: skip
        store.set(f"result/{n}/{node_rank}", json.dumps(dict(record, node_rank=node_rank)))
    raise AssertionError("unreachable")


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One trial record from every node's (node 0's first): the measurements of the node that
    found the trial's metrics (global rank 0's); a node's failure, timeout or out-of-memory
    makes the trial's status, named with that node."""
    bad = [(k, r) for k, r in enumerate(records) if r["status"] != "ok"]
    measured = next((r for r in records if r["status"] == "ok" and r.get("step_times_s")), None)
    out = dict(measured or records[0])
    out["wall_s"] = max(r["wall_s"] for r in records)
    out.pop("node_rank", None)
    if bad:
        # A timeout first: the others' failures then are most often its consequence (lost peers).
        k, r = min(bad, key=lambda item: (item[1]["status"] != "timeout", item[0]))
        out.update(status=r["status"], reason=f"node {k}: {r['reason']}")
        for key in ("step_times_s", "tokens_per_step"):
            out.pop(key, None)
    elif measured is None:
        out.update(status="failed", reason="no node found the trial's metrics.jsonl")
    return out
