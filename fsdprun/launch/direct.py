"""Running as one worker of a job someone else launched (torchrun, srun, a cluster scheduler).

`fsdprun train` lands here when RANK, LOCAL_RANK and WORLD_SIZE are already set (torchrun), or
mapped from SLURM's variables in a multi-task srun step (`fsdprun.launch.slurm`): every rank
resolves the same command line itself (there is no launcher process to do it once), rank 0
writes RUN_DIR/recipe.yaml for the record and renders the report.

Under torchrun with --max-restarts, a restarted group continues the run from its newest complete
checkpoint, as workers of fsdprun's own launcher do: rank 0 recognizes the run directory its
first attempt created by the elastic agent that started it (RUN_DIR/agent.json), and refuses
any other.

Never imports the engines nor the models: the worker it starts builds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from fsdprun.compile_cache import check_cache_dir
from fsdprun.config import ResolvedRecipe, load_recipe
from fsdprun.config.hub import hub_mode_of_worker
from fsdprun.data.preflight import check_data
from fsdprun.errors import StorageError, UserError
from fsdprun.launch.elastic import check_tracker_folders, prepare_run_dir
from fsdprun.rundir import RunDirWatch, agent_path
from fsdprun.runlock import hold_run_dir
from fsdprun.train.guard import restart_count
from fsdprun.train.worker import run


def direct_run_dir(recipe_name: str, configured: str | None) -> Path:
    """All ranks must agree on the run directory without talking: use the configured one, or
    one named after the job id the launcher exported."""
    if configured:
        return Path(configured)
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
    if not job or job == "none":
        raise UserError(
            "running under an external launcher without a job id; pass --run-dir DIR so every "
            "rank writes to the same run directory"
        )
    return Path("runs") / f"{recipe_name}-{job}"


def _agent() -> str:
    # The elastic agent (torchrun) outlives the attempts it starts: it is each worker's parent.
    # (Its node keeps global rank 0 across restarts: the rendezvous orders nodes stably.)
    return f"{socket.gethostname()}:{os.getppid()}"


def _started_by_this_agent(run_dir: Path) -> bool:
    try:
        return json.loads(agent_path(run_dir).read_text())["agent"] == _agent()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def claim_run_dir(run_dir: Path, resolved: ResolvedRecipe) -> None:
    """Rank 0: create the run directory, or, in a restarted attempt, keep the one this job's
    first attempt created (its workers resume from the newest complete checkpoint).

    Raises:
        UserError: the directory holds another run.
    """
    if restart_count() > 0 and _started_by_this_agent(run_dir):
        return
    prepare_run_dir(run_dir, resolved)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # started by an elastic agent
        record = {"agent": _agent(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        agent_path(run_dir).write_text(json.dumps(record) + "\n")


def launch_overrides(env: Mapping[str, str]) -> list[str]:
    """launch.nproc_per_node and launch.nnodes as the external launcher started the job.

    The recipe's values describe fsdprun's own launcher; the job's real shape decides what
    depends on it (hybrid sharding's default shard group is one node) and is what the run
    directory's recipe.yaml records.

    Raises:
        UserError: the nodes run different numbers of ranks.
    """
    if "LOCAL_WORLD_SIZE" not in env:
        return []  # a launcher that does not say: the recipe's launch.* is all there is
    world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    if local < 1 or world % local:
        raise UserError(
            f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={world}: fsdprun needs the "
            "same number of ranks on every node"
        )
    # Ranks fill nodes in order (torchrun; srun's default block distribution).
    node = int(env["RANK"]) // local
    return [
        f"launch.nproc_per_node={local}", f"launch.nnodes={world // local}",
        f"launch.node_rank={node}",
    ]  # fmt: skip


def run_as_worker(recipe: str, overrides: list[str]) -> None:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise UserError(
            f"RANK, LOCAL_RANK and WORLD_SIZE are set (a worker of an external launcher) but "
            f"{' and '.join(missing)} not: export the host and a free port of rank 0"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    overrides = [*overrides, *launch_overrides(os.environ)]
    # A Hub model: each node's local rank 0 downloads it, its other ranks wait for the cache.
    resolved = load_recipe(recipe, overrides, world_size=world_size,
                           hub=hub_mode_of_worker(os.environ))  # fmt: skip
    data_problems = check_data(resolved.config)
    if data_problems:
        raise UserError("; ".join(data_problems))
    check_cache_dir(resolved.config.compile.cache_dir)  # every rank: nodes may see it or not
    run_dir = direct_run_dir(resolved.name, resolved.config.output.run_dir)
    resolved.config.output.run_dir = str(run_dir)
    rank0 = int(os.environ["RANK"]) == 0
    # No launcher process here: rank 0 holds the run directory's lock for the whole run.
    if rank0:
        check_tracker_folders(resolved.config, run_dir)
    with hold_run_dir(run_dir) if rank0 else contextlib.nullcontext():
        if rank0:
            claim_run_dir(run_dir, resolved)
            watch = RunDirWatch(run_dir)
        result = run(run_dir, render=True, recipe_name=resolved.name, cfg=resolved.config)
    if rank0 and result and result.get("vanished"):  # rank 0 speaks for the run, as it renders
        raise StorageError(watch.message(**result["vanished"]))
