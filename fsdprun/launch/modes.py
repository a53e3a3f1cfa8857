"""How this `fsdprun` process was started, decided in one place (`decide`) from the launch flags
typed on the command line and the environment; the run header prints the decision.

- `torchrun`: a worker of torchrun (RANK, LOCAL_RANK and WORLD_SIZE set): it runs as that rank
  (fsdprun.launch.direct). torchrun's workers inherit the pod's PET_* variables too: the three
  variables decide.
- `srun`: a task of a multi-task srun step: SLURM's variables become torch's
  (fsdprun.launch.slurm), and it runs as that rank.
- `pet`: a node's launcher started with torchrun's PET_* variables: Kubeflow Trainer v2 (a
  TrainJob on the torch-distributed runtime), a legacy PyTorchJob, or anything else that sets
  them. Each launch flag not typed is read from PET_<FLAG>, as torchrun reads it; an empty
  variable counts as not set (an empty PET_STANDALONE, a PyTorchJob's elastic policy, is off).
  A PyTorchJob's pod-level RANK and WORLD_SIZE count pods: without LOCAL_RANK they never make
  this process a worker, and nothing reads them; its MASTER_ADDR/MASTER_PORT name the master pod,
  node 0, which hosts the rendezvous when no PET_* variable names one.
- `skypilot`: a node's launcher under SkyPilot: SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, the head
  (the first line of SKYPILOT_NODE_IPS) hosting the rendezvous, SKYPILOT_NUM_GPUS_PER_NODE
  workers per node (0 on CPU nodes: the recipe's launch.nproc_per_node). SkyPilot sets no port:
  MASTER_PORT when the task's `envs:` export it, else one derived from SKYPILOT_TASK_ID, the same
  on every node of the task.
- `launcher`: fsdprun's own launcher with the typed flags and the recipe's launch.* alone: one
  node, or a node of a job started by hand or by a script (examples/slurm/).

Flags typed on the command line win over the environment, one by one (a typed --standalone is
one node, whatever the platform says of nodes). A platform's rendezvous address is dropped when
the platform says one node: a one-node job listens on loopback only (fsdprun.launch.loopback).

Never imports torch, nor an fsdprun module but `errors` and the launch flags' and SLURM's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from fsdprun.errors import UserError
from fsdprun.launch.flags import LaunchFlags, parse_nnodes
from fsdprun.launch.slurm import PORT_BASE, PORT_SPAN, srun_env

KINDS = {
    "torchrun": "a worker of torchrun (RANK, LOCAL_RANK, WORLD_SIZE)",
    "srun": "a task of an srun step (SLURM_* mapped to RANK, LOCAL_RANK, WORLD_SIZE)",
    "pet": "each node's launcher, from torchrun's PET_* variables (Kubeflow Trainer, PyTorchJob)",
    "skypilot": "each node's launcher, from SkyPilot's SKYPILOT_* variables",
    "launcher": "fsdprun's launcher",
}
PLATFORM_PREFIXES = ("PET_", "SKYPILOT_")
# Fields that name the rendezvous store: one typed, the environment's are not used (torchrun
# too takes a typed --rdzv-endpoint over PET_MASTER_ADDR, which only its static backend reads).
ENDPOINT_FIELDS = ("rdzv_endpoint", "master_addr", "master_port")
# PET_<FLAG> values that are not strings, and what a message says they should be.
_CONVERT: dict[str, tuple[Callable[[str], object], str]] = {
    "node_rank": (int, "a whole number"),
    "master_port": (int, "a port number"),
    "max_restarts": (int, "a whole number"),
    "monitor_interval": (float, "a number of seconds"),
    "log_dir": (Path, "a folder"),
}


@dataclass(frozen=True)
class LaunchMode:
    """The decision: which kind of process this is and the launch flags it runs with.

    Attributes:
        kind: one of KINDS.
        flags: the typed flags, with what the environment gave filled in (`flags.sources` names
            each such field's variable).
        worker_env: torch's variables for an srun task (set before it runs as a worker).
        read: the variables the decision read, `NAME=value` each, for the header.
        ignored: variables present but deliberately not used (a PyTorchJob's pod-level ones).
    """

    kind: str
    flags: LaunchFlags
    worker_env: dict[str, str] = field(default_factory=dict)
    read: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    @property
    def is_worker(self) -> bool:
        """One rank of a job someone else launched (not a launcher of its own)."""
        return self.kind in ("torchrun", "srun")

    def describe(self) -> str:
        text = KINDS[self.kind]
        if self.read:
            text += ": " + ", ".join(self.read)
        if self.ignored:
            text += f"; pod-level {', '.join(self.ignored)} not used (they count pods)"
        return text


def decide(env: Mapping[str, str], flags: LaunchFlags) -> LaunchMode:
    """The mode of this process (see the module's docstring) and its effective launch flags.

    Raises:
        UserError: a variable fsdprun cannot use (named, with the flag that overrides it).
    """
    if all(name in env for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return LaunchMode("torchrun", flags)
    kind, values, read = "launcher", {}, ()
    if any(_pet_name(name) in env for name in _flag_names()):
        kind, (values, read) = "pet", _pet(env, flags)
    elif "SKYPILOT_NUM_NODES" in env:
        kind, (values, read) = "skypilot", _skypilot(env, flags)
    merged = _merge(flags, values)
    # A task of an srun step is a worker too, unless it is its node's launcher (--nnodes).
    worker_env = srun_env(env, nnodes=merged.num_nodes)
    if worker_env:
        return LaunchMode("srun", flags, worker_env=worker_env)
    ignored = tuple(f"{n}={env[n]}" for n in ("RANK", "WORLD_SIZE") if n in env)
    return LaunchMode(kind, merged, read=read, ignored=ignored if kind == "pet" else ())


def forget_platform(env: MutableMapping[str, str]) -> None:
    """Drop the platform's PET_* and SKYPILOT_* variables from `env`: compare and tune, once
    decided, start each run's `fsdprun train` with the launch as overrides, which those
    variables, read again by that child, would otherwise override."""
    for name in [k for k in env if k.startswith(PLATFORM_PREFIXES)]:
        del env[name]


def _flag_names() -> list[str]:
    return [f.name for f in fields(LaunchFlags) if f.name != "sources"]


def _pet_name(name: str) -> str:
    return f"PET_{name.upper()}"  # torch.distributed.argparse_util's rule


def _typed_endpoint(flags: LaunchFlags) -> bool:
    return any(getattr(flags, name) is not None for name in ENDPOINT_FIELDS)


def _merge(flags: LaunchFlags, values: dict[str, tuple[object, str]]) -> LaunchFlags:
    """`flags` with the environment's values filled in where nothing was typed."""
    if flags.standalone:  # typed: one node on loopback, whatever the platform says of nodes
        values = {
            k: v for k, v in values.items() if k not in ("nnodes", "node_rank", *ENDPOINT_FIELDS)
        }
    nnodes, source = values.get("nnodes", (flags.nnodes, flags.source("nnodes")))
    if flags.nnodes is not None:
        nnodes, source = flags.nnodes, flags.source("nnodes")
    if nnodes is not None and parse_nnodes(str(nnodes), source) == 1:
        # One node: no rendezvous address from the environment (a TrainJob names node 0's
        # service even then), so the job listens on loopback only.
        values = {k: v for k, v in values.items() if k not in ENDPOINT_FIELDS}
    given = {k: value for k, (value, _) in values.items()}
    return replace(flags, **given, sources={k: var for k, (_, var) in values.items()})


def _pet(
    env: Mapping[str, str], flags: LaunchFlags
) -> tuple[dict[str, tuple[object, str]], tuple[str, ...]]:
    """torchrun's PET_<FLAG> variables for the flags not typed: {field: (value, variable)}, and
    the variables read."""
    values: dict[str, tuple[object, str]] = {}
    typed_endpoint = _typed_endpoint(flags)
    for name in _flag_names():
        var = _pet_name(name)
        typed = getattr(flags, name)
        # `is`, not `in (None, False)`: a typed --node-rank 0 equals False, and wins all the same.
        if var not in env or (typed is not None and typed is not False):
            continue
        if name in ENDPOINT_FIELDS and typed_endpoint:
            continue
        raw = env[var]
        if name == "standalone":
            if _standalone(raw):
                values[name] = (True, var)
            continue
        if not raw.strip():
            continue  # an empty variable is not set
        convert, what = _CONVERT.get(name, (str, ""))
        try:
            values[name] = (convert(raw.strip()), var)
        except ValueError:
            raise UserError(
                f"{var}={raw!r}: expected {what} (torchrun's --{name.replace('_', '-')}); fix the "
                f"variable or give --{name.replace('_', '-')}"
            ) from None
    if "rdzv_endpoint" in values:  # the c10d store's address: torchrun ignores PET_MASTER_* then
        values.pop("master_addr", None)
        values.pop("master_port", None)
    if not typed_endpoint and not any(k in values for k in ENDPOINT_FIELDS):
        # A PyTorchJob names its master pod (node 0) in MASTER_ADDR/MASTER_PORT only.
        for name, var in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
            if env.get(var, "").strip():
                convert, what = _CONVERT.get(name, (str, ""))
                try:
                    values[name] = (convert(env[var].strip()), var)
                except ValueError:
                    raise UserError(f"{var}={env[var]!r}: expected {what}") from None
    read = tuple(f"{var}={env[var]}" for _, var in values.values())
    if "nnodes" in values and "node_rank" not in values and flags.node_rank is None:
        nnodes, var = values["nnodes"]
        if parse_nnodes(str(nnodes), var) > 1:
            # torch's c10d rendezvous would guess node 0 from the host name; fsdprun needs it
            # (node 0 hosts the store and sets aside abandoned checkpoints on resume).
            raise UserError(
                f"{var}={nnodes} but no node rank: fsdprun needs each node's rank "
                "(PET_NODE_RANK, which Kubeflow Trainer and a PyTorchJob with a Master replica "
                "set), or give --node-rank"
            )
    return values, read


def _standalone(raw: str) -> bool:
    """PET_STANDALONE as torchrun's check_env reads it (a number, 0 = off), except that empty is
    off: a PyTorchJob's elastic policy sets it empty, which torchrun itself fails to read."""
    if not raw.strip():
        return False
    try:
        return bool(int(raw))
    except ValueError:
        raise UserError(
            f"PET_STANDALONE={raw!r}: expected 1 (on) or 0 (off), as torchrun reads it"
        ) from None


def _skypilot(
    env: Mapping[str, str], flags: LaunchFlags
) -> tuple[dict[str, tuple[object, str]], tuple[str, ...]]:
    """SkyPilot's variables as launch flags: {field: (value, variable)}, and the variables read."""
    values: dict[str, tuple[object, str]] = {}
    read: list[str] = []

    def whole(var: str) -> int:
        raw = env.get(var, "").strip()
        if not raw.isdigit():
            raise UserError(f"{var}={env.get(var)!r}: expected a whole number, as SkyPilot sets it")
        read.append(f"{var}={raw}")
        return int(raw)

    nnodes = whole("SKYPILOT_NUM_NODES")
    if flags.nnodes is None:
        values["nnodes"] = (str(nnodes), "SKYPILOT_NUM_NODES")
    if "SKYPILOT_NODE_RANK" in env and flags.node_rank is None:
        values["node_rank"] = (whole("SKYPILOT_NODE_RANK"), "SKYPILOT_NODE_RANK")
    if "SKYPILOT_NUM_GPUS_PER_NODE" in env and flags.nproc_per_node is None:
        gpus = whole("SKYPILOT_NUM_GPUS_PER_NODE")
        if gpus > 0:  # 0 on CPU nodes: the recipe's launch.nproc_per_node
            values["nproc_per_node"] = (str(gpus), "SKYPILOT_NUM_GPUS_PER_NODE")
    if nnodes > 1 and not _typed_endpoint(flags):
        values["rdzv_endpoint"] = (_skypilot_endpoint(env, read), "SKYPILOT_NODE_IPS")
    return values, tuple(read)


def _skypilot_endpoint(env: Mapping[str, str], read: list[str]) -> str:
    """The head node's address (or an exported MASTER_ADDR) and a port from the environment."""
    addr = env.get("MASTER_ADDR", "").strip()
    if addr:
        read.append(f"MASTER_ADDR={addr}")
    else:
        ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines()]
        if not ips or not ips[0]:
            raise UserError(
                "SKYPILOT_NUM_NODES > 1 but SKYPILOT_NODE_IPS is not set: run fsdprun from the "
                "task's `run:` section, or give --rdzv-endpoint HEAD:PORT"
            )
        addr = ips[0]
        read.append(f"SKYPILOT_NODE_IPS[0]={addr}")
    port = env.get("MASTER_PORT", "").strip()
    if port:
        if not port.isdigit():
            raise UserError(f"MASTER_PORT={port!r}: expected a port number")
        read.append(f"MASTER_PORT={port}")
    else:
        task = env.get("SKYPILOT_TASK_ID", "").strip()
        if not task:
            raise UserError(
                "SkyPilot sets no port and SKYPILOT_TASK_ID is not set to derive one: export "
                "MASTER_PORT in the task's `envs:` (a free port on the head node)"
            )
        # The same on every node of the task, and below Linux's ephemeral range (as SLURM's).
        port = str(PORT_BASE + zlib.crc32(task.encode()) % PORT_SPAN)
        read.append(f"port {port} from SKYPILOT_TASK_ID")
    return f"{addr}:{port}"
