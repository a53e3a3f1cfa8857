"""`fsdprun resume RUN_DIR`: continue a run from its newest complete checkpoint.

The run's saved recipe plus the overrides decide the new session; what may change is limited to
what cannot change the run's trajectory beyond its length (train.steps) or how it is executed
(world size, checkpointing, logging, FSDP knobs, tensor-parallel degree, compile). The global
batch is kept: on a new world size the micro batch shrinks if it must, so the same samples come
next. A saved parallel.tp or parallel.cp that the new world cannot hold is lowered as the micro
batch is, unless the command names it. A LoRA checkpoint's
base must be the one it was trained on (its fingerprint, `fsdprun.checkpoint.fingerprint`):
a changed base is refused unless --accept-base-change, a missing one names --base PATH (a copy
elsewhere, checked the same way).

Never imports the engines nor the models: it reads the run's folder and launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fsdprun.checkpoint import CheckpointStatus, find_resume_checkpoint
from fsdprun.checkpoint.fingerprint import ACCEPT_FLAG, compare_base, refusal
from fsdprun.checkpoint.manifest import lora_base
from fsdprun.config import RecipeConfig, ResolvedRecipe, config_to_dict, load_recipe, validate
from fsdprun.config.layout import Layout
from fsdprun.data.preflight import check_data
from fsdprun.errors import UserError
from fsdprun.rundir import RECIPE_FILE, recipe_name, recipe_path
from fsdprun.train.optim import lr_factor

# Keys (or prefixes) a resumed run may change. `parallel.`: DCP saved every tensor-parallel
# shard with its placements and reshards it onto any other mesh (docs/tensor-parallel.md,
# "Checkpoints"); tp changes how a step is split over ranks, not what it computes.
RESUMABLE = (
    "train.steps", "train.micro_batch_size", "checkpoint.", "launch.", "output.", "compile.",
    "activation_checkpointing.", "fsdp.", "parallel.", "profile.",
)  # fmt: skip


@dataclass
class ResolvedResume:
    resolved: ResolvedRecipe
    checkpoint: CheckpointStatus
    skipped: list[CheckpointStatus]
    notes: list[str]


def _flat(d: dict) -> dict[str, object]:
    return {f"{s}.{k}": v for s, body in d.items() for k, v in body.items()}


def _base_override(checkpoint: CheckpointStatus, base: Path) -> str:
    """The override that has the resumed run read its LoRA base from `base` (`--base`).

    Raises:
        UserError: the checkpoint has no base that lives in a folder.
    """
    recorded = checkpoint.manifest.get("lora_base")
    if recorded is None or recorded["source"] == "seed":
        what = "is no LoRA checkpoint" if recorded is None else "has the seeded init as its base"
        raise UserError(f"--base {base}: {checkpoint.path} {what}; there is no base to point at")
    key = "checkpoint.load_from" if recorded["source"] == "load_from" else "model.hf_path"
    return f"{key}={base.resolve()}"


def _names(overrides: list[str], key: str) -> bool:
    """Whether an override sets or drops `key` (`key=V`, `~key`)."""
    return any(o.removeprefix("~").split("=", 1)[0] == key for o in overrides)


# The degrees a resume re-fits, in order (cp's fit depends on the tp it then has), and what
# its note calls each.
_REFIT = {"tp": "tensor-parallel", "cp": "context-parallel"}


def _fit(cfg: RecipeConfig, dim: str) -> str | None:
    """Lower a saved parallel.<dim> (tp, cp) that the new world cannot hold to the largest of
    its divisors that it can (`Layout.refit`), in place; returns the note, or None when the
    saved degree fits.

    `fsdprun resume RUN --nproc-per-node 1` of a tp 2 run is a resume "at any world size", which
    the command promises (as it shrinks the micro batch to keep the global batch): a user who
    only changed the world has not asked for TP, and refusing would make them learn a key to
    undo a degree the checkpoint does not depend on. A divisor of the saved degree divides what
    the saved one did (heads, ffn, vocab, train.seq_len). A degree the command names is the
    user's choice: it is kept, and refused by validate if it does not fit.
    """
    layout = Layout.of(cfg)
    old, new = getattr(layout, dim), layout.refit(dim)
    if new is None:
        return None
    setattr(cfg.parallel, dim, new)
    world = layout.world_size
    ranks = f"{world} rank" + ("s" if world > 1 else "")
    return (
        f"parallel.{dim} {old} -> {new}: {ranks} cannot hold the saved {_REFIT[dim]} degree "
        f"(the checkpoint reshards onto {dim} {new}; name parallel.{dim}=N to choose another)"
    )


def _check_base(
    checkpoint: CheckpointStatus, cfg_dict: dict, *, accept_change: bool, verify: bool
) -> str | None:
    """Refuse a LoRA base that is missing or not the one the checkpoint was trained on (before
    anything launches); returns a note for an accepted change or an unverifiable base.

    Raises:
        UserError: the base is missing, or changed without `accept_change`.
    """
    recorded = checkpoint.manifest.get("lora_base")
    if recorded is None:
        return None
    check = compare_base(recorded, cfg_dict, verify=verify)
    if check.state == "unverified":
        return (
            f"the LoRA base cannot be verified: {checkpoint.path.name} was saved by an older "
            "fsdprun without its fingerprint"
        )
    if check.state == "missing" or (check.state == "changed" and not accept_change):
        raise UserError(refusal(checkpoint.path, lora_base(cfg_dict), check, command="resume"))
    if check.state == "changed":
        return f"the LoRA base changed ({check.detail}); training on it as {ACCEPT_FLAG} asks"
    return None


def resolve_resume(
    run_dir: Path,
    overrides: list[str],
    *,
    step: int | None = None,
    verify: bool = False,
    accept_base_change: bool = False,
    base: Path | None = None,
) -> ResolvedResume:
    """Resolve the resumed run's recipe and checkpoint.

    Args:
        verify: also re-read and hash the files of a LoRA base (not only the checkpoint's).
        accept_base_change: resume on a LoRA base other than the checkpoint's (a note, not a
            refusal).
        base: read the LoRA base from this folder instead (checked against the fingerprint).

    Raises:
        UserError: not a run directory, no usable checkpoint, a change that cannot continue,
            or a LoRA base that is missing or changed.
    """
    recipe = recipe_path(run_dir)
    if not recipe.is_file():
        raise UserError(f"{run_dir}: not an fsdprun run directory (no {RECIPE_FILE})")
    checkpoint, skipped = find_resume_checkpoint(run_dir, step, verify=verify)
    if base is not None:
        overrides = [*overrides, _base_override(checkpoint, base)]
    if not _names(overrides, "launch.node_rank"):
        # Which node this launcher is belongs to the command, not to the run: the saved recipe
        # holds that of whichever node wrote it (node 1's, after a two-node job, which then
        # refused `resume RUN --nnodes 1` on one machine). As `train`: node 0 unless --node-rank.
        overrides = [*overrides, "launch.node_rank=0"]
    resolved = load_recipe(str(recipe), overrides, check=False)
    # The header names the recipe the run was started from; a hand-written recipe.yaml, the folder.
    resolved.name = recipe_name(run_dir) or run_dir.name
    cfg = resolved.config
    cfg.output.run_dir = str(run_dir)
    notes = []
    # Before validate: a missing base folder is named with the way out (--base), not as a bad
    # model.hf_path.
    note = _check_base(
        checkpoint, config_to_dict(cfg), accept_change=accept_base_change, verify=verify
    )
    notes += [note] if note else []
    for dim in _REFIT:
        if not _names(overrides, f"parallel.{dim}") and (note := _fit(cfg, dim)):
            notes.append(note)
    # The batch is split over data-parallel ranks (the ranks of a TP x CP group read the same
    # rows). A named tp or cp that does not divide the world leaves none to count: validate
    # refuses it below.
    gbs, micro = cfg.train.global_batch_size, cfg.train.micro_batch_size
    layout = Layout.of(cfg)
    dp = layout.dp if layout.fits_world else None
    ranks = "ranks" if layout.row_group == 1 else "data-parallel ranks"
    if dp is not None and gbs % (micro * dp) and not _names(overrides, "train.micro_batch_size"):
        if gbs % dp:
            world = "a world size" if layout.row_group == 1 else (
                "a world size / parallel.tp" if layout.cp == 1
                else "a world size / (parallel.tp x parallel.cp)")  # fmt: skip
            raise UserError(
                f"the global batch ({gbs} sequences) cannot be split over {dp} {ranks}; resume "
                f"on {world} that divides {gbs}"
            )
        per_rank = gbs // dp
        new_micro = max(m for m in range(1, micro + 1) if per_rank % m == 0)
        notes.append(
            f"train.micro_batch_size {micro} -> {new_micro} to keep the global batch {gbs} on "
            f"{dp} {ranks} ({per_rank // new_micro} accumulation steps)"
        )
        cfg.train.micro_batch_size = new_micro
    errors = validate(cfg) or check_data(cfg)
    if errors:
        raise UserError("; ".join(errors))

    saved = _flat(checkpoint.manifest["recipe"])
    for key, value in _flat(config_to_dict(cfg)).items():
        if key.startswith(RESUMABLE) or key not in saved or saved[key] == value:
            continue
        if base is not None and key == "model.hf_path":  # --base: checked above
            continue
        raise UserError(
            f"resume cannot change {key} ({saved[key]!r} -> {value!r}): the checkpoint holds a "
            "different run; start a new run with checkpoint.load_from="
            f"{checkpoint.path} to start from its weights"
        )
    if checkpoint.step >= cfg.train.steps:
        raise UserError(
            f"{checkpoint.path.name} is already at step {checkpoint.step} of train.steps="
            f"{cfg.train.steps}; pass train.steps=N (N > {checkpoint.step}) to train further"
        )
    saved_steps = saved.get("train.steps", cfg.train.steps)
    before, after = (
        cfg.optim.lr * lr_factor(checkpoint.step, cfg=cfg.schedule, total_steps=total)
        for total in (saved_steps, cfg.train.steps)
    )
    if before != after:
        # The decay spans train.steps: another length is another schedule from here on.
        how = "stretches" if cfg.train.steps > saved_steps else "shortens"
        notes.append(
            f"train.steps {saved_steps} -> {cfg.train.steps} {how} the "
            f"{cfg.schedule.decay.value} schedule: the learning rate of step "
            f"{checkpoint.step + 1} is {after:.3g} (it was {before:.3g})"
        )
    return ResolvedResume(resolved, checkpoint, skipped, notes)
