"""Single-node runs listen on loopback only.

A run on one node needs no port reachable from elsewhere, yet torch's TCPStore server listens on
every interface whatever host name it is given, and gloo picks the address the host name resolves
to. So for a single-node launch (no endpoint, or one on a loopback address):

- the launcher hosts the c10d rendezvous store through its own rendezvous backend
  (`RDZV_BACKEND`, registered with torch's public handler registry): torch's c10d handler, but
  the store listens on a socket fsdprun bound to the loopback address (`master_listen_fd`);
- the agent passes that address to the workers (`LaunchConfig.local_addr` becomes MASTER_ADDR)
  and does not share its store with them (a shared store is created inside torch, on every
  interface); rank 0 then hosts the workers' store, again on a socket bound to MASTER_ADDR
  (`worker_store_args`);
- gloo and NCCL (the bootstrap) are pinned to the loopback interface (`single_node_env`).

Multi-node runs listen where torch does (see docs/faults.md, "What fsdprun trusts").

Never imports another fsdprun module.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

LOOPBACK_ADDR = "127.0.0.1"
RDZV_BACKEND = "fsdprun-loopback"


def is_loopback(host: str) -> bool:
    """`host` is a loopback IP address (names are not resolved)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_is_local(endpoint: str) -> bool:
    """A launch with this launch.rdzv_endpoint listens on loopback only (empty = 127.0.0.1:0)."""
    return not endpoint or is_loopback(endpoint.rpartition(":")[0])


def _listening_fd(host: str, port: int) -> tuple[int, int]:
    """A socket listening on host:port only (port 0 = a free one): (its fd, its port). The fd is
    handed to TCPStore, which then owns it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def loopback_store(
    host: str, port: int, *, timeout: timedelta, world_size: int | None = None
) -> TCPStore:
    """A TCPStore server listening on host:port (a loopback address) and nowhere else."""
    fd, port = _listening_fd(host, port)
    return TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, multi_tenant=True,
        master_listen_fd=fd,
    )  # fmt: skip


class _LoopbackBackend(C10dRendezvousBackend):
    """The c10d rendezvous state backend under fsdprun's name (the registry checks that the
    handler's backend is the one asked for)."""

    @property
    def name(self) -> str:
        return RDZV_BACKEND


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler, with its store on the endpoint's loopback address."""
    host, _, port = (params.endpoint or f"{LOOPBACK_ADDR}:0").rpartition(":")
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    try:
        store = loopback_store(host, int(port or 0), timeout=timeout)
    except OSError as e:
        # As torch's c10d backend reports a store it cannot create (the launcher says it in
        # one line).
        raise RendezvousConnectionError(
            f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()}"
        ) from None
    return create_handler(store, _LoopbackBackend(store, params.run_id), params)


rendezvous_handler_registry.register(RDZV_BACKEND, _create_handler)


def loopback_interface() -> str:
    """The name of the loopback network interface (`lo` on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def single_node_env() -> dict[str, str]:
    """Environment of a single-node launch (set in the launcher, inherited by the workers)."""
    lo = loopback_interface()
    return {
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_SOCKET_IFNAME": lo,
        # The agent's store shared with the workers would listen on every interface.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def worker_store_args(timeout: timedelta) -> dict:
    """Extra `init_process_group` arguments for a worker: when rank 0 is to host the store on a
    loopback MASTER_ADDR (no agent store), the store, bound there only; else none (env://)."""
    addr = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not is_loopback(addr):
        return {}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = loopback_store(addr, port, timeout=timeout, world_size=world_size)
    else:
        store = TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    return {"store": store, "rank": rank, "world_size": world_size}
