"""torchrun's launch flags as fsdprun's launching commands take them (train, resume, compare, tune).

Each flag becomes a `launch.*` override applied after the recipe's own, so the recipe, `fsdprun
config --explain` and RUN_DIR/recipe.yaml say how a run was launched, and compare's and tune's
`fsdprun train` subprocesses get the same launch. What torchrun does that fsdprun does another
way is refused in one line naming fsdprun's way (`--rdzv-backend static`, a `--nnodes MIN:MAX`
range). The checks follow torch/distributed/run.py's `config_from_args`.

Never imports torch, except `--nproc-per-node gpu|xpu|auto` on a machine with accelerator device
nodes, which counts the devices as torchrun does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from fsdprun.errors import UserError

NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "127.0.0.1", 29500  # torchrun's (static rendezvous)


def named(source: str, value: object) -> str:
    """How a message names a launch value: `--flag VALUE` as typed, `VARIABLE=VALUE` when the
    environment gave it (torchrun's PET_* variables, a platform's)."""
    return f"{source} {value}" if source.startswith("--") else f"{source}={value}"


@dataclass(frozen=True)
class LaunchFlags:
    """The launch flags (None: not given). Field names are the flags' (`--rdzv-id`). A value the
    environment gave instead of the command line (fsdprun.launch.modes) names its variable in
    `sources`, so that a message about it names what the user set."""

    nproc_per_node: str | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    max_restarts: int | None = None
    monitor_interval: float | None = None
    role: str | None = None
    log_dir: Path | None = None
    redirects: str | None = None
    tee: str | None = None
    local_ranks_filter: str | None = None
    standalone: bool = False
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def source(self, name: str) -> str:
        """Where the value of field `name` came from: its flag (`--nnodes`), or its variable."""
        return self.sources.get(name) or "--" + name.replace("_", "-")

    def typed(self) -> list[str]:
        """The flags typed on the command line, spelled as fsdprun's help spells them, one
        `--flag value` string each (tune prints them back in the train command it suggests)."""
        out = []
        for f in fields(self):
            if f.name == "sources" or f.name in self.sources:
                continue
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is not None and value is not False:
                out.append(f"{flag} {value}")
        return out

    @property
    def num_nodes(self) -> int | None:
        return parse_nnodes(self.nnodes, self.source("nnodes")) if self.nnodes is not None else None


def cpu_count() -> int:
    """CPUs this process may run on (torch._utils.cpu_count: the affinity mask first)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def nproc_count(value: str, source: str = "--nproc-per-node") -> int:
    """`--nproc-per-node` as torchrun reads it: a number, or `cpu` (CPUs), `gpu` (CUDA devices),
    `xpu` (XPU devices), `auto` (the accelerator's devices, else CPUs). `source`: the flag or
    variable that gave it, for the messages.

    Raises:
        UserError: another word, or a device kind this machine does not have.
    """
    if value.strip().isdigit():
        return int(value)
    word = value.strip().lower()
    if word not in NPROC_WORDS:
        raise UserError(
            f"{named(source, repr(value))}: expected a number of workers, or "
            f"{', '.join(NPROC_WORDS)}"
        )
    if word == "cpu":
        return cpu_count()
    from fsdprun.config import accelerator_device_nodes

    if word == "auto" and not accelerator_device_nodes():
        return cpu_count()  # no device node: no accelerator, as torch would find (no import)
    import torch  # counting devices, as torchrun does

    if word == "auto":
        if torch.accelerator.is_available():
            return torch.accelerator.device_count()
        return cpu_count()
    module = torch.cuda if word == "gpu" else torch.xpu
    if not module.is_available():
        kind = "CUDA" if word == "gpu" else "XPU"
        raise UserError(
            f"{named(source, word)}: torch sees no {kind} device on this machine; give a number "
            "of workers (--nproc-per-node N), or cpu"
        )
    return module.device_count()


def parse_nnodes(value: str, source: str = "--nnodes") -> int:
    """`--nnodes N`, or torchrun's `MIN:MAX` with MIN = MAX. `source`: the flag or variable that
    gave it, for the messages.

    Raises:
        UserError: not a number, or an elastic range (fsdprun runs a fixed number of nodes).
    """
    parts = value.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"{named(source, repr(value))}: expected a number of nodes, or MIN:MAX")
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise UserError(f"{named(source, value)}: MIN must not exceed MAX")
    if low != high:
        # Every rank's share of the batch and the FSDP shards follow the world size, fixed for a
        # run; a resume reshards to any world size instead.
        raise UserError(
            f"{named(source, value)}: fsdprun runs a fixed number of nodes, not an elastic range; "
            "give "
            f"--nnodes {high} (with --max-restarts for failures), and to go on with fewer nodes, "
            "`fsdprun resume RUN_DIR --nnodes N` (checkpoints reshard to any world size)"
        )
    return high


def parse_rdzv_conf(text: str, source: str = "--rdzv-conf") -> dict[str, str]:
    """`KEY=VALUE,...` (torch's `_parse_rendezvous_config` grammar).

    Raises:
        UserError: an entry without a key or a value.
    """
    conf: dict[str, str] = {}
    for item in filter(None, (kv.strip() for kv in text.split(","))):
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            raise UserError(
                f"{named(source, repr(text))}: expected KEY=VALUE,... (e.g. read_timeout=60,"
                "last_call_timeout=30), every key with a value"
            )
        conf[key.strip()] = value.strip()
    return conf


def _ranks(text: str, source: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks:
        raise UserError(
            f"{named(source, repr(text))}: expected local ranks separated by commas, e.g. 0,1"
        )
    return ranks


def _endpoint(flags: LaunchFlags) -> str | None:
    """--rdzv-endpoint, or torchrun's --master-addr/--master-port naming the same store."""
    if flags.master_addr is None and flags.master_port is None:
        return flags.rdzv_endpoint
    if flags.rdzv_endpoint is not None:
        raise UserError(
            "--master-addr/--master-port and --rdzv-endpoint name the same store (node 0's "
            "HOST:PORT): give one of them"
        )
    addr = flags.master_addr or DEFAULT_MASTER_ADDR
    return f"{addr}:{flags.master_port if flags.master_port is not None else DEFAULT_MASTER_PORT}"


def launch_overrides(flags: LaunchFlags, run_dir: Path | None = None) -> list[str]:
    """The flags as overrides applied after the recipe's own (flags win).

    Raises:
        UserError: a value torchrun would refuse, or one fsdprun does another way.
    """
    if flags.rdzv_backend is not None and flags.rdzv_backend != "c10d":
        raise UserError(
            f"{named(flags.source('rdzv_backend'), flags.rdzv_backend)}: fsdprun's rendezvous is "
            "always c10d, hosted by node 0 at --rdzv-endpoint HOST:PORT (or --master-addr/"
            f"--master-port); drop {flags.source('rdzv_backend')}"
        )
    nnodes = flags.num_nodes
    node_rank, endpoint = flags.node_rank, _endpoint(flags)
    if flags.standalone:
        clash = [
            name for name, given in (
                ("nnodes", nnodes not in (None, 1)),
                ("node_rank", node_rank not in (None, 0)),
                ("rdzv_endpoint", flags.rdzv_endpoint is not None),
                ("master_addr", flags.master_addr is not None),
                ("master_port", flags.master_port is not None),
            ) if given
        ]  # fmt: skip
        if clash:
            standalone = flags.source("standalone")
            values = [named(flags.source(n), getattr(flags, n)) for n in clash]
            raise UserError(
                f"{standalone if standalone.startswith('--') else standalone + '=1'} is one node "
                f"with a local rendezvous and cannot go with {', '.join(values)}: drop "
                f"{standalone} for a multi-node run, or drop "
                f"{' and '.join(flags.source(n) for n in clash)}"
            )
        nnodes, node_rank, endpoint = 1, 0, ""
    conf = (
        parse_rdzv_conf(flags.rdzv_conf, flags.source("rdzv_conf"))
        if flags.rdzv_conf is not None
        else {}
    )
    join_timeout = conf.pop("join_timeout", None)  # torchrun's name for launch.rdzv_timeout_s
    pairs = {
        "launch.nproc_per_node": (
            nproc_count(flags.nproc_per_node, flags.source("nproc_per_node"))
            if flags.nproc_per_node is not None
            else None
        ),
        "launch.nnodes": nnodes,
        "launch.node_rank": node_rank,
        "launch.rdzv_endpoint": endpoint,
        "launch.rdzv_id": flags.rdzv_id,
        "launch.rdzv_timeout_s": join_timeout,
        "launch.rdzv_conf": json.dumps(conf) if conf else None,
        "launch.max_restarts": flags.max_restarts,
        "launch.monitor_interval_s": flags.monitor_interval,
        "launch.role": flags.role,
        "launch.log_dir": flags.log_dir,
        "launch.redirects": flags.redirects,
        "launch.tee": flags.tee,
        "launch.local_ranks_filter": (
            json.dumps(_ranks(flags.local_ranks_filter, flags.source("local_ranks_filter")))
            if flags.local_ranks_filter is not None
            else None
        ),
        "output.run_dir": run_dir,
    }
    return [f"{k}={v}" for k, v in pairs.items() if v is not None]
