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

`fsdprun train RECIPE --resume auto` (`resolve_auto`) is the command a job runs every time it
starts, whatever it left behind: a new run in an empty run directory; the run continued from its
newest complete checkpoint, by the rules above, with the command's recipe as the resumed one; or,
where no checkpoint is complete, the run started again from step 0 (the earlier session's
metrics kept); nothing at all for a finished run. It refuses a run directory that holds another
recipe: a key that a resume could not change differs from RUN_DIR/recipe.yaml's.

Never imports the engines nor the models: it reads the run's folder and launches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fsdprun.checkpoint import CheckpointStatus, find_resume_checkpoint, list_checkpoints
from fsdprun.checkpoint.fingerprint import ACCEPT_FLAG, compare_base, refusal
from fsdprun.checkpoint.manifest import lora_base
from fsdprun.config import RecipeConfig, ResolvedRecipe, config_to_dict, load_recipe, validate
from fsdprun.config.layout import Layout
from fsdprun.data.preflight import check_data
from fsdprun.errors import UserError, diagnostic
from fsdprun.report.metrics import integer, read_events, run_state
from fsdprun.rundir import RECIPE_FILE, checkpoint_root, metrics_path, recipe_name, recipe_path
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

    def announce(self, run_dir: Path) -> None:
        """What a resume says before it launches: the checkpoints it skipped, its notes, and
        the checkpoint it continues from."""
        for bad in self.skipped:
            diagnostic("warning", f"skipping incomplete checkpoint {bad.path}: {bad.reason}")
        for note in self.notes:
            diagnostic("note", note)
        print(
            f"resuming {run_dir} from {self.checkpoint.path.name} (step {self.checkpoint.step}, "
            f"saved on {self.checkpoint.manifest['world_size']} ranks) on "
            f"{self.resolved.config.world_size} ranks",
            flush=True,
        )


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


# The degrees a resume re-fits, in order (cp's fit depends on the tp it then has, pp's and ep's
# on both), and what its note calls each.
_REFIT = {"tp": "tensor-parallel", "cp": "context-parallel", "pp": "pipeline-parallel",
          "ep": "expert-parallel"}  # fmt: skip


def _fit(cfg: RecipeConfig, dim: str) -> str | None:
    """Lower a saved parallel.<dim> (tp, cp, pp, ep) that the new world cannot hold to the
    largest of its divisors that it can (`Layout.refit`), in place; returns the note, or None
    when the saved degree fits.

    `fsdprun resume RUN --nproc-per-node 1` of a tp 2 run is a resume "at any world size", which
    the command promises (as it shrinks the micro batch to keep the global batch): a user who
    only changed the world has not asked for TP, and refusing would make them learn a key to
    undo a degree the checkpoint does not depend on. A divisor of the saved degree divides what
    the saved one did (heads, ffn, vocab, train.seq_len, experts). A degree the command names is the
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

    # --base: model.hf_path was checked above.
    changed = _changed_key(checkpoint.manifest["recipe"], cfg,
                           allowed=("model.hf_path",) if base is not None else ())  # fmt: skip
    if changed is not None:
        key, old, new = changed
        raise UserError(
            f"resume cannot change {key} ({old!r} -> {new!r}): the checkpoint holds a "
            "different run; start a new run with checkpoint.load_from="
            f"{checkpoint.path} to start from its weights"
        )
    if checkpoint.step >= cfg.train.steps:
        raise UserError(
            f"{checkpoint.path.name} is already at step {checkpoint.step} of train.steps="
            f"{cfg.train.steps}; pass train.steps=N (N > {checkpoint.step}) to train further"
        )
    note = _schedule_note(checkpoint, cfg)
    notes += [note] if note else []
    return ResolvedResume(resolved, checkpoint, skipped, notes)


def _changed_key(
    saved: dict, cfg: RecipeConfig, *, allowed: tuple[str, ...] = ()
) -> tuple[str, object, object] | None:
    """The first key a resume may not change (not RESUMABLE) whose value differs between the
    `saved` recipe (as config_to_dict gives it) and `cfg`: (key, saved value, new value)."""
    before = _flat(saved)
    for key, value in _flat(config_to_dict(cfg)).items():
        if key.startswith(RESUMABLE) or key in allowed or key not in before:
            continue
        if before[key] != value:
            return key, before[key], value
    return None


def _schedule_note(checkpoint: CheckpointStatus, cfg: RecipeConfig) -> str | None:
    """A note when the resumed run's train.steps is not the checkpoint's: the decay spans
    train.steps, so another length is another schedule from here on."""
    saved_steps = _flat(checkpoint.manifest["recipe"]).get("train.steps", cfg.train.steps)
    before, after = (
        cfg.optim.lr * lr_factor(checkpoint.step, cfg=cfg.schedule, total_steps=total)
        for total in (saved_steps, cfg.train.steps)
    )
    if before == after:
        return None
    how = "stretches" if cfg.train.steps > saved_steps else "shortens"
    return (
        f"train.steps {saved_steps} -> {cfg.train.steps} {how} the "
        f"{cfg.schedule.decay.value} schedule: the learning rate of step "
        f"{checkpoint.step + 1} is {after:.3g} (it was {before:.3g})"
    )


@dataclass
class AutoStart:
    """What `fsdprun train --resume auto` does with its run directory.

    Attributes:
        action: "start" (a new run), "resume" (from `resume.checkpoint`), "restart" (from step
            0: the run directory holds a run of this recipe without a complete checkpoint) or
            "finished" (nothing left to train: `message` says why).
        resume: the resumed run, for "resume".
        notes: what the launcher says before it launches.
    """

    action: str
    resume: ResolvedResume | None = None
    notes: list[str] = field(default_factory=list)
    message: str = ""


def resolve_auto(run_dir: Path, resolved: ResolvedRecipe) -> AutoStart:
    """How `fsdprun train RECIPE --resume auto` goes on in `run_dir` (see the module's docstring).

    `resolved` is the command's recipe, checked for its world: a resume takes it as it is (the
    rules of `resolve_resume` against the checkpoint), and nothing is re-fitted. Every node of a
    multi-node job decides alike from the same folder: nothing here writes.

    Raises:
        UserError: `run_dir` holds a run of another recipe, a run without its recipe.yaml, or a
            checkpoint whose LoRA base is missing or changed.
    """
    cfg = resolved.config
    if not recipe_path(run_dir).is_file():
        if checkpoint_root(run_dir).exists() or metrics_path(run_dir).exists():
            raise UserError(
                f"{run_dir} holds a run without its {RECIPE_FILE}, which --resume auto compares "
                "with the recipe; choose another --run-dir"
            )
        return AutoStart("start")
    saved = load_recipe(str(recipe_path(run_dir)), check=False).config
    changed = _changed_key(config_to_dict(saved), cfg)
    if changed is not None:
        key, old, new = changed
        raise UserError(
            f"{run_dir} holds a run of another recipe ({key}: {old!r} there, {new!r} here); "
            "choose another --run-dir, or continue that run with `fsdprun resume "
            f"{run_dir}`"
        )
    statuses = list_checkpoints(run_dir)
    if not statuses and not metrics_path(run_dir).exists():
        return AutoStart("start")  # nothing trained yet (another node may have just begun it)
    finished = _finished_steps(run_dir)
    if finished is not None and finished >= cfg.train.steps:
        return AutoStart("finished", message=(
            f"{run_dir} finished its {finished} steps; nothing to train (train.steps=N, N > "
            f"{finished}, trains further)"
        ))  # fmt: skip
    complete = [s for s in statuses if s.complete]
    if not complete:
        incomplete = f" ({len(statuses)} incomplete)" if statuses else ""
        return AutoStart("restart", notes=[
            f"{run_dir} holds no complete checkpoint{incomplete}: training again from step 0"
        ])  # fmt: skip
    checkpoint = complete[-1]
    if checkpoint.step >= cfg.train.steps:
        return AutoStart("finished", message=(
            f"{run_dir} is at step {checkpoint.step} ({checkpoint.path.name}) of train.steps="
            f"{cfg.train.steps}; nothing to train (train.steps=N, N > {checkpoint.step}, trains "
            "further)"
        ))  # fmt: skip
    skipped = [s for s in statuses if not s.complete and s.step > checkpoint.step]
    notes = []
    note = _check_base(checkpoint, config_to_dict(cfg), accept_change=False, verify=False)
    notes += [note] if note else []
    changed = _changed_key(checkpoint.manifest["recipe"], cfg)
    if changed is not None:
        key, old, new = changed
        raise UserError(
            f"{checkpoint.path} holds a run of another recipe ({key}: {old!r} there, {new!r} "
            "here); choose another --run-dir"
        )
    note = _schedule_note(checkpoint, cfg)
    notes += [note] if note else []
    return AutoStart("resume", resume=ResolvedResume(resolved, checkpoint, skipped, notes))


def _finished_steps(run_dir: Path) -> int | None:
    """train.steps of the run's last session when that session finished (its summary written),
    else None: a run that saves no final checkpoint is finished all the same."""
    events = read_events(metrics_path(run_dir))
    if run_state(events, running=False) != "finished":
        return None
    start = next(e for e in reversed(events) if e["event"] == "start")
    return integer(start.get("steps"))
