"""The tasks of an srun step as torch.distributed workers: SLURM's variables mapped to RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which srun does not set.

    srun --ntasks-per-node 8 --nodes 2 fsdprun train llama-8b --run-dir runs/8b

A process is a task of an srun step only when the step has several tasks: SLURM_STEP_ID is set
(srun sets it for its tasks) and SLURM_STEP_NUM_TASKS > 1. An sbatch script or an salloc shell
also has SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS (the job's task count) but runs one copy
of `fsdprun train`, which must start fsdprun's own launcher; so does a one-task step
(`srun --ntasks 1 fsdprun train ...`).

One task per node with `--nnodes` on the command line is the other multi-node pattern, not a
worker: each task is a node's launcher, which starts that node's workers itself
(examples/slurm/train.sbatch):

    srun --ntasks-per-node 1 bash -c 'fsdprun train llama-8b --nnodes "$SLURM_NNODES" \
        --node-rank "$SLURM_NODEID" --rdzv-endpoint "$HEAD:29500" --run-dir runs/8b'

Never imports torch, nor an fsdprun module but `errors`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping

from fsdprun.errors import UserError

# MASTER_PORT when the user exports none: derived from the job and step ids, the same in every
# task, and below Linux's ephemeral range (32768-60999) so no outgoing connection holds it.
PORT_BASE, PORT_SPAN = 20000, 10000


def srun_env(env: Mapping[str, str], *, nnodes: int | None = None) -> dict[str, str]:
    """torch.distributed's variables for a task of a multi-task srun step; {} for any other
    process (including one that already has RANK: torchrun inside srun, and a node's launcher:
    one task per node with `nnodes`, the command's --nnodes, given).

    Raises:
        UserError: a variable cannot be derived (uneven tasks per node, an unknown first host).
    """
    if "RANK" in env or "SLURM_STEP_ID" not in env:
        return {}
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)
    if tasks <= 1:
        return {}
    layout = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    per_node = tasks_per_node(layout)
    if nnodes is not None and per_node and set(per_node) == {1}:
        return {}  # this task is its node's launcher (fsdprun starts the workers)
    if not per_node or len(set(per_node)) > 1 or sum(per_node) != tasks:
        raise UserError(
            f"srun placed SLURM_STEP_TASKS_PER_NODE={layout!r} tasks on the step's nodes; "
            f"fsdprun needs the same number on every node (srun --ntasks-per-node N)"
        )
    out = {
        "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_WORLD_SIZE": str(per_node[0]),
    }
    out["MASTER_ADDR"] = env.get("MASTER_ADDR") or _master_addr(env, num_nodes=len(per_node))
    out["MASTER_PORT"] = env.get("MASTER_PORT") or _master_port(env)
    return out


def tasks_per_node(layout: str) -> list[int] | None:
    """SLURM's compressed task counts ("2(x3),1") as one count per node ([2, 2, 2, 1])."""
    counts: list[int] = []
    for item in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM host list ("gpu[07-09,12],cpu3" -> "gpu07"), without
    `scontrol`; None when the list is not in a form this understands."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first item ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    # Each bracket group contributes its first value (padding kept: "[007-009]" -> "007").
    host = re.sub(r"\[(\d+)[^\]]*\]", lambda m: m[1], item)
    return host if host and re.fullmatch(r"[A-Za-z0-9._-]+", host) else None


def _master_addr(env: Mapping[str, str], *, num_nodes: int) -> str:
    if num_nodes == 1:
        return "127.0.0.1"  # every task on this node: nothing listens outside it
    # Task 0 runs on the step's first node under srun's block and cyclic distributions.
    # (SLURM_LAUNCH_NODE_IPADDR is where srun ran, e.g. a login node: not task 0's host.)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    host = _scontrol_first_host(nodelist) or first_host(nodelist)
    if host is None:
        raise UserError(
            f"cannot tell task 0's host from SLURM_STEP_NODELIST={nodelist!r}; export "
            "MASTER_ADDR (task 0's host) before srun"
        )
    node = env.get("SLURMD_NODENAME")
    if env.get("SLURM_PROCID") == "0" and node and node != host:
        raise UserError(
            f"task 0 runs on {node}, not on the step's first node {host}; export "
            f"MASTER_ADDR={node} before srun (or use srun's block distribution)"
        )
    return host


def _scontrol_first_host(nodelist: str) -> str | None:
    if not nodelist or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
            timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()[0] if out.split() else None


def _master_port(env: Mapping[str, str]) -> str:
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    if not (job.isdigit() and step.isdigit()):
        raise UserError(
            f"cannot derive a port from SLURM_JOB_ID={job!r} and SLURM_STEP_ID={step!r}; export "
            "MASTER_PORT (a free port on task 0's host) before srun"
        )
    return str(PORT_BASE + (int(job) * 64 + int(step)) % PORT_SPAN)
