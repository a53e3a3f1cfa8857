"""Running as one worker of a job someone else launched (torchrun, srun, a cluster scheduler).

`fsdprun train` lands here when RANK, LOCAL_RANK and WORLD_SIZE are already set: every rank
resolves the same command line itself (there is no launcher process to do it once), rank 0
writes RUN_DIR/recipe.yaml for the record and renders the report.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fsdprun.config import load_recipe
from fsdprun.errors import UserError
from fsdprun.launch import prepare_run_dir
from fsdprun.runlock import hold_run_dir
from fsdprun.worker import run


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


def run_as_worker(recipe: str, overrides: list[str]) -> None:
    world_size = int(os.environ["WORLD_SIZE"])
    resolved = load_recipe(recipe, overrides, world_size=world_size)
    run_dir = direct_run_dir(resolved.name, resolved.config.output.run_dir)
    resolved.config.output.run_dir = str(run_dir)
    rank0 = int(os.environ["RANK"]) == 0
    # No launcher process here: rank 0 holds the run directory's lock for the whole run.
    with hold_run_dir(run_dir) if rank0 else contextlib.nullcontext():
        if rank0:
            prepare_run_dir(run_dir, resolved)
        run(run_dir, render=True, recipe_name=resolved.name, cfg=resolved.config)
