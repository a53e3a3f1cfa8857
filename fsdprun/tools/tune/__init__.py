"""`fsdprun tune`: choose the FSDP knobs on the user's own hardware — `plan` prunes, short
measured trials decide, the winner comes out as a recipe layer.

    fsdprun tune my.yaml --nproc-per-node 8 --budget 20m --out tune-my
    fsdprun train tune-my/tuned.yaml --nproc-per-node 8

1. The space: knobs that leave the training math unchanged (MATH_KNOBS; the global batch, lr,
   schedule, seq_len, model, data and seed never change; micro_batch_size moves with the
   accumulation derived from the global batch). Knobs that change the numerics (NUMERICS_KNOBS)
   only with --allow-numerics, and marked. `--space KEY=V1,V2` replaces the default space by the
   knobs given (`--space defaults` keeps the defaults and changes only the knobs given); the
   recipe's `tune:` section does the same from the recipe, and --space wins (parse_space).
2. Pruning, before any launch, from `fsdprun plan`: a candidate the recipe's checks refuse, one
   whose planned peak per rank plus the margin exceeds the device memory, one that differs from
   another only in a knob the engine's knob table says does nothing (limit_all_gathers under
   fsdp2), and one that uses a memory knob (cpu_offload always; activation checkpointing and
   the chunked loss in the default space) where the same candidate without it fits.
3. Trials: each an ordinary `fsdprun train` run in its own processes (its own run directory
   under OUT/trials/), so one trial's memory never reaches the next. Throughput is end to end:
   the step times of the run's metrics.jsonl (each step the real forward, backward and optimizer
   step on the real data) after the warm-up steps, which are reported separately. Successive
   halving: every candidate for a few steps, the best third (the baseline always kept) for twice
   as many, ..., then the finalists repeated, every round interleaved (candidate A, B, C, A, B, C)
   so drift of the machine hits every candidate alike.
4. Selection (`select`, a pure function of the trial log): candidates are compared at the
   highest round both they and the baseline reached, on the per-step tokens/s of all their
   trials there; the best one wins only if its gain over the baseline's median exceeds the
   measured noise, two standard errors of the difference of the medians (from each side's
   interquartile range and number of steps). Otherwise the starting recipe stays.
5. Safety: a trial that fails, runs out of memory, hangs past its timeout (its whole process group
   is killed) or whose first losses disagree with the baseline's (LOSS_RTOL) is recorded with a
   one-line reason and the search goes on. OUT/trials.jsonl gets one record per finished trial,
   appended and fsynced; a rerun with the same --out replays it and runs only what is missing.
6. Several nodes (launch.nnodes > 1): every node runs tune with the same arguments; node 0 does
   all of the above and runs each trial on every node through fsdprun.tools.tune.nodes, the
   others run its trials with it and print its report.

Imports neither the training loop nor the launcher: trials are `fsdprun train` subprocesses.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as dt
import enum
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fsdprun.config import TUNE_KNOBS, TUNE_NUMERICS_KNOBS, launch_device_problem, load_recipe
from fsdprun.config.validate import tune_space_errors
from fsdprun.data.preflight import check_data
from fsdprun.errors import StorageError, UserError, write_error
from fsdprun.report.metrics import percentile, read_events
from fsdprun.rundir import TUNE_LOG_FILE, metrics_path
from fsdprun.runlock import hold_run_dir
from fsdprun.tools.compare import error_line

if TYPE_CHECKING:
    from rich.console import Console

    from fsdprun.config import RecipeConfig

# Knobs that leave the training math unchanged (up to floating-point summation order), and those
# that change the numerics (searched only with --allow-numerics, and marked): the recipe schema's
# list, which tune.space is checked against.
MATH_KNOBS = TUNE_KNOBS
NUMERICS_KNOBS = TUNE_NUMERICS_KNOBS
# Memory knobs and the value that costs nothing: a candidate that sets another value is tried
# only where the same candidate with this value does not fit.
MEMORY_KNOBS = {
    "fsdp.cpu_offload": "false",
    "activation_checkpointing.mode": "none",
    "train.loss": "plain",
}
# cpu_offload is only tried where nothing else fits, whatever the space says.
ALWAYS_DOMINATED = ("fsdp.cpu_offload",)
SHORT = {
    "train.micro_batch_size": "mb", "fsdp.engine": "engine", "fsdp.sharding": "shard",
    "fsdp.forward_prefetch": "fwd_prefetch", "fsdp.backward_prefetch": "bwd_prefetch",
    "fsdp.limit_all_gathers": "limit_ag", "fsdp.reshard_after_forward": "reshard",
    "activation_checkpointing.mode": "ac", "compile.enabled": "compile", "train.loss": "loss",
    "fsdp.cpu_offload": "offload", "fsdp.wrap": "wrap",
}  # fmt: skip

DEFAULT_MARGIN = 0.10  # planned peak x (1 + margin) must fit the device memory
MODEL_STATE_RTOL = 0.05  # plan's stated agreement with measured model state (test_memory_contract)
LOSS_STEPS = 3  # the loss check compares this many first steps with the baseline's
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # by param_dtype
ETA = 3  # successive halving keeps the best 1/ETA of each round; steps double
DEFAULT_STEPS = 4  # measured steps per trial in the first round
DEFAULT_REPEATS = 2  # trials per finalist in the last round
DEFAULT_FINALISTS = 2  # challengers that reach the last round beside the baseline
FIRST_TRIAL_TIMEOUT_S = 1200.0  # before any trial has finished, nothing to scale from
MIN_TIMEOUT_S = 300.0  # then 4x the expected trial time, at least this (x2 with compile)
FAULT_ENV = "FSDPRUN_TUNE_FAULT"  # drills: TRIAL_ID:NAME=VALUE[;...] into one trial's environment
FAULT_NAMES = ("FSDPRUN_FAIL_AT", "FSDPRUN_HANG_AT", "FSDPRUN_FREEZE_AT", "FSDPRUN_NONFINITE_AT")
# The fix once a write that failed mid-search can succeed again: the trial log keeps the work.
CONTINUES = "rerun the same command: it continues where it stopped"
# How a trial's `fsdprun train` words a write the machine refused (errors.describe_os_error and
# the OS's own strerror, lowercased): tune stops there, since every later trial would fail too.
STORAGE_PHRASES = ("no space left on device", "disk quota exceeded", "file too large",
                   "read-only file system")  # fmt: skip
TUNED_FILE = "tuned.yaml"
# What every trial changes beside its knobs: no checkpoints, evaluations, trackers or profiler
# (not the training step), every step logged.
TRIAL_OVERRIDES = (
    "checkpoint.save_final=false", "checkpoint.every_steps=0", "eval.every_steps=0",
    "output.log_every=1", "output.tensorboard=false", "output.wandb=null",
    "profile.enabled=false", "launch.max_restarts=0",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The space


@dataclass(frozen=True)
class SpaceKnob:
    key: str
    values: tuple[str, ...]
    numerics: bool = False


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value.value if hasattr(value, "value") else value)


def current_value(cfg: RecipeConfig, key: str) -> str:
    section, name = key.split(".", 1)
    return _text(getattr(getattr(cfg, section), name))


def micro_batch_choices(cfg: RecipeConfig) -> list[str]:
    """Every micro-batch size that divides one data-parallel rank's share of the global batch
    (the ranks of a tensor-parallel group share their micro-batch)."""
    tp = cfg.parallel.tp if cfg.parallel.tp >= 1 and cfg.world_size % cfg.parallel.tp == 0 else 1
    per_rank = cfg.train.global_batch_size // (cfg.world_size // tp)
    return [str(d) for d in range(1, per_rank + 1) if per_rank % d == 0]


# Whether the recipe's checks refuse KEY=VALUE whatever the space's other knobs (KEYS) are: its
# refusal, else None (see `refused_alone`).
Refusal = Callable[[str, str, set[str]], str | None]


def default_space(
    cfg: RecipeConfig, *, accelerator: bool, refused: Refusal | None = None,
    left_out: dict[str, str] | None = None,
) -> list[SpaceKnob]:  # fmt: skip
    """What an engineer tuning FSDP by hand tries first, from the recipe's own values.

    compile is searched on accelerators only (a CPU's inductor build costs more than short trials
    can win back); hybrid sharding only across several nodes. The space follows the recipe: a
    value that `refused` says the recipe refuses whatever the other knobs (under parallel.tp:
    fsdp1, the chunked loss, CPU offload) is left out, its refusal put in `left_out` by
    KEY=VALUE."""
    shardings = ["full", "grad_op"] + (["hybrid", "hybrid_zero2"] if cfg.launch.nnodes > 1 else [])
    nproc, nnodes = cfg.launch.nproc_per_node, cfg.launch.nnodes
    # Hybrid's shard groups: one node (null), or several nodes' ranks (fewer replicas).
    groups = ["null", *(str(nproc * k) for k in range(2, nnodes) if nnodes % k == 0)]
    space = [
        ("fsdp.engine", ["fsdp2", "fsdp1"] if cfg.lora.rank == 0 else ["fsdp2"]),
        ("fsdp.sharding", shardings),
        *([("fsdp.shard_group_size", groups)] if len(groups) > 1 else []),
        ("fsdp.forward_prefetch", ["0", "1"]),
        ("fsdp.limit_all_gathers", ["true", "false"]),
        ("activation_checkpointing.mode", ["none", "selective", "full"]),
        ("train.micro_batch_size", micro_batch_choices(cfg)),
        ("train.loss", ["plain", "chunked"]),
        ("fsdp.cpu_offload", ["false", "true"]),
    ]
    if accelerator:
        space.append(("compile.enabled", ["false", "true"]))
    if cfg.precision.float8.value == "tensorwise":
        # Where float8 runs: gathering the weights in float8 leaves the math as it is (auto
        # turns it on only with a shard group of more than one rank; forcing either way is
        # what a measured trial can overrule). The mode and the filter change the numerics:
        # --space with --allow-numerics.
        space.append(("precision.float8_all_gather", ["null", "true", "false"]))
    if cfg.fsdp.engine.value == "ddp":
        space = [(k, v) for k, v in space if not k.startswith("fsdp.")]
    keys = {key for key, _ in space}
    out = []
    for key, values in space:
        kept = []
        for value in values:
            why = None
            if refused is not None and value != current_value(cfg, key):
                why = refused(key, value, keys)
            if why is None:
                kept.append(value)
            elif left_out is not None:
                left_out[f"{key}={value}"] = why
        out.append(SpaceKnob(key, _with(kept, current_value(cfg, key))))
    return out


def refused_alone(recipe: str, overrides: list[str]) -> Refusal:
    """A `Refusal` by the recipe's own checks: KEY=VALUE set alone on the recipe is refused, for
    reasons that name no other knob of the space (a refusal that names one, compile beside
    activation checkpointing under TP, may lift with that knob's other value)."""

    def refused(key: str, value: str, keys: set[str]) -> str | None:
        try:
            load_recipe(recipe, [*overrides, f"{key}={value}"])
        except UserError as e:
            named = set(re.findall(r"[a-z_0-9]+\.[a-z_0-9]+", str(e)))
            return None if named & (keys - {key}) else str(e)
        return None

    return refused


def _with(values: list[str], baseline: str) -> tuple[str, ...]:
    # The recipe's own value is always a candidate value (the baseline must be in the space).
    return tuple(values if baseline in values else [baseline, *values])


def canonical(value: Any) -> str:
    """A knob value as tune compares it with the recipe's (`current_value`): YAML's spellings of
    true, false and null (True, FALSE, ~) as one. Not `none`: YAML reads it as the string, which
    is a value of several knobs (fsdp.wrap, activation_checkpointing.mode,
    fsdp.backward_prefetch), never their null."""
    text = str(value).strip()
    return {"true": "true", "false": "false", "null": "null", "~": "null"}.get(text.lower(), text)


def parse_space(
    items: list[str], cfg: RecipeConfig, *, accelerator: bool, allow_numerics: bool,
    refused: Refusal | None = None, left_out: dict[str, str] | None = None,
) -> tuple[list[SpaceKnob], bool]:  # fmt: skip
    """The space from the recipe's `tune:` section and the --space items; and whether it is the
    default one (then memory knobs are dominated: tried only where the same candidate without
    them does not fit).

    The command line wins: --space items without `defaults` are the whole space; with
    `defaults` they change only their knobs of the recipe's space, which is the default space
    (tune.defaults) with tune.space's knobs set. `refused` and `left_out`: see default_space.

    Raises:
        UserError: a key that is not a tuning knob, a numerics knob without --allow-numerics,
            an item without values or with a value its key refuses, or an empty space.
    """
    replace = bool(items) and "defaults" not in items
    defaults = not replace and cfg.tune.defaults
    knobs = {k.key: k for k in default_space(cfg, accelerator=accelerator, refused=refused,
                                             left_out=left_out)} if defaults else {}  # fmt: skip
    given: list[tuple[str, str, list[str]]] = []
    if not replace:
        given += [("tune.space", key, list(vals)) for key, vals in cfg.tune.space.items()]
    for item in items:
        if item == "defaults":
            continue
        key, sep, values = item.partition("=")
        if not sep or not values.strip():
            raise UserError(
                f"--space {item!r}: give KEY=V1,V2 (e.g. train.micro_batch_size=1,2,4), or "
                "`defaults`"
            )
        given.append(("--space", key.strip(), [v for v in values.split(",") if v.strip()]))
    for where, key, vals in given:
        numerics = key in NUMERICS_KNOBS
        if numerics and not allow_numerics:
            raise UserError(
                f"{where} {key}: changes the numerics of training; add --allow-numerics to "
                "search it (the report marks such candidates)"
            )
        if key not in MATH_KNOBS and not numerics:
            raise UserError(
                f"{where} {key}: not a tuning knob (tune never changes the model, data, batch, "
                f"lr, schedule or seed); knobs: {', '.join(MATH_KNOBS)}"
            )
        problems = tune_space_errors({key: vals}, where=where)
        if problems:
            raise UserError(problems[0])
        vals = [canonical(v) for v in vals]
        knobs[key] = SpaceKnob(key, _with(list(dict.fromkeys(vals)), current_value(cfg, key)),
                               numerics)  # fmt: skip
    if left_out is not None:  # what the default space leaves out of a knob named here stays
        for key in {key for _, key, _ in given}:
            for kv in [kv for kv in left_out if kv.partition("=")[0] == key]:
                del left_out[kv]
    if not knobs:
        raise UserError(
            "nothing to search: tune.defaults is false and tune.space is empty; list knobs in "
            "tune.space or give --space KEY=V1,V2"
        )
    return list(knobs.values()), defaults


def space_sources(items: list[str], cfg: RecipeConfig) -> str:
    """Where the space comes from, in words (printed above it)."""
    replace = bool(items) and "defaults" not in items
    parts = [] if replace or not cfg.tune.defaults else ["the default space"]
    if not replace and cfg.tune.space:
        parts.append(f"the recipe's tune.space ({', '.join(cfg.tune.space)})")
    named = [i.partition("=")[0] for i in items if i != "defaults"]
    if named:
        rest = ", which replaces the rest" if replace else ""
        parts.append(f"--space ({', '.join(named)}){rest}")
    return ", then ".join(parts)


@dataclass
class Candidate:
    index: int  # c0 is the baseline
    knobs: dict[str, str]  # key -> value, every knob of the space
    diff: dict[str, str]  # the knobs that differ from the baseline
    numerics: bool = False
    status: str = "kept"  # kept | pruned
    reason: str | None = None
    group: str | None = None  # the reason's kind, shared by candidates pruned alike (printed)
    planned_peak_bytes: int | None = None
    planned_model_state_bytes: int | None = None

    @property
    def id(self) -> str:
        return f"c{self.index}"

    @property
    def label(self) -> str:
        if not self.diff:
            return "baseline"
        return " ".join(f"{SHORT.get(k, k)}={v}" for k, v in self.diff.items())

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.diff.items()]


def enumerate_candidates(space: list[SpaceKnob], baseline: dict[str, str]) -> list[Candidate]:
    """Every combination of the space's values; the baseline (the recipe's own values) first."""
    numerics_keys = {k.key for k in space if k.numerics}
    out = [Candidate(0, dict(baseline), {})]
    for combo in itertools.product(*(k.values for k in space)):
        knobs = dict(zip((k.key for k in space), combo, strict=True))
        diff = {k: v for k, v in knobs.items() if v != baseline[k]}
        if not diff:
            continue
        out.append(Candidate(len(out), knobs, diff, numerics=bool(numerics_keys & set(diff))))
    return out


# ---------------------------------------------------------------------------------------------
# Pruning with the plan


def _planned(cfg: RecipeConfig) -> tuple[int, int, list[str]]:
    """Planned peak bytes per device, model state bytes, and the keys the knob table says do
    nothing, for one resolved candidate."""
    from fsdprun.engines import translate
    from fsdprun.tools.plan import plan_memory

    plan = plan_memory(cfg)
    s = plan.strategies[plan.recipe_strategy]
    state = s.params + s.grads + s.optimizer + s.accumulation
    # CPU offload keeps the shards, gradients and optimizer state in host memory: the plan counts
    # them on the device, the device holds only the gathered buffers and activations.
    peak = s.total - (s.params + s.grads + s.optimizer) if cfg.fsdp.cpu_offload else s.total
    inert = [k.key for k in translate(cfg) if k.applied.startswith("no effect")]
    return peak, state, inert


def prune(
    candidates: list[Candidate],
    recipe: str,
    overrides: list[str],
    *,
    device_memory_bytes: int,
    margin: float,
    dominate_memory_knobs: bool,
    planner=None,
) -> None:
    """Mark candidates pruned, each with one reason (in place); the baseline is never pruned
    (it is the reference: one that does not fit is reported, not dropped).

    Candidates are visited by their number of changed knobs, so a candidate's twin with one knob
    back at the baseline's (or free) value is decided first: a candidate that the twin's knob
    table makes a duplicate, or that a fitting twin makes unnecessary, is pruned without
    resolving its recipe (resolving costs a tenth of a second; the default space has hundreds)."""
    from fsdprun.report.console import fmt_bytes

    planner = planner or _planned
    by_knobs = {tuple(sorted(c.knobs.items())): c for c in candidates}
    inert_of: dict[str, list[str]] = {}
    engine_of: dict[str, str] = {}
    base = candidates[0]

    def twin_of(c: Candidate, key: str, value: str) -> Candidate | None:
        twin = by_knobs.get(tuple(sorted(dict(c.knobs, **{key: value}).items())))
        return twin if twin is not c else None

    def fits(c: Candidate | None) -> bool:
        return c is not None and c.planned_peak_bytes is not None and (
            c.planned_peak_bytes * (1 + margin) <= device_memory_bytes
        )  # fmt: skip

    def same_as(c: Candidate, twin: Candidate, keys: list[str]) -> None:
        c.status = "pruned"
        c.group = f"{', '.join(keys)} does nothing under {engine_of[twin.id]} (knob table)"
        c.reason = f"same as {twin.id}: {c.group}"
        c.planned_peak_bytes, c.planned_model_state_bytes = (
            twin.planned_peak_bytes, twin.planned_model_state_bytes
        )  # fmt: skip
        inert_of[c.id], engine_of[c.id] = inert_of[twin.id], engine_of[twin.id]

    for c in sorted(candidates, key=lambda c: (len(c.diff), c.index)):
        if c is not base and (inert := _inert_here(c)) is not None:
            twin = twin_of(c, inert, base.knobs[inert])
            if twin is not None:
                c.status = "pruned"
                c.group = f"{inert} does nothing under fsdp.sharding={c.knobs['fsdp.sharding']}"
                c.reason = f"same as {twin.id}: {c.group}"
                c.planned_peak_bytes = twin.planned_peak_bytes
                c.planned_model_state_bytes = twin.planned_model_state_bytes
                continue
        if c is not base:
            # The twin with every memory knob this candidate may drop back at its free value.
            heavy = {key: free for key, free in MEMORY_KNOBS.items()
                     if c.knobs.get(key, free) != free
                     and (dominate_memory_knobs or key in ALWAYS_DOMINATED)}  # fmt: skip
            twin = by_knobs.get(tuple(sorted(dict(c.knobs, **heavy).items()))) if heavy else None
            dominated = fits(twin) and twin is not c
            if dominated:
                c.status = "pruned"
                names = ", ".join(f"{key}={c.knobs[key]}" for key in heavy)
                c.reason = f"{names} not needed: {twin.id} (without) fits"
                c.group = "memory knobs not needed: the same candidate without them fits"
            if dominated:
                continue
            twins = [(k, twin_of(c, k, base.knobs[k])) for k in c.diff]
            hit = next(((k, t) for k, t in twins if t is not None and k in inert_of.get(t.id, [])),
                       None)  # fmt: skip
            if hit is not None:
                same_as(c, hit[1], [hit[0]])
                continue
        try:
            cfg = load_recipe(recipe, [*overrides, *c.overrides]).config
        except UserError as e:
            c.status, c.reason = "pruned", f"the recipe's checks refuse it: {e}"
            # By the first key the refusal names (train.global_batch_size, fsdp.cpu_offload).
            named = re.search(r"[a-z_]+\.[a-z_.]*[a-z_]", str(e))
            c.group = "the recipe's checks refuse it" + (f" ({named[0]})" if named else "")
            continue
        c.planned_peak_bytes, c.planned_model_state_bytes, inert_of[c.id] = planner(cfg)
        engine_of[c.id] = cfg.fsdp.engine.value
        if c is base:
            continue
        inert = [k for k in c.diff if k in inert_of[c.id]]
        twin = next((t for k in inert if (t := twin_of(c, k, base.knobs[k])) is not None), None)
        if twin is not None and twin.id in engine_of:
            same_as(c, twin, inert)
            continue
        if not fits(c):
            c.status = "pruned"
            c.reason = (
                f"planned peak {fmt_bytes(c.planned_peak_bytes)} + {margin:.0%} margin > "
                f"device memory {fmt_bytes(device_memory_bytes)}"
            )
            c.group = f"planned peak + {margin:.0%} margin > device memory"


# Knobs that matter only beside certain values of another knob (where the knob table still
# describes them): fsdp.shard_group_size sizes hybrid's shard groups only.
ONLY_WITH = {"fsdp.shard_group_size": ("fsdp.sharding", ("hybrid", "hybrid_zero2"))}


def _inert_here(c: Candidate) -> str | None:
    """A knob this candidate changes that its other knobs make do nothing (ONLY_WITH; judged
    only where the space holds the other knob too)."""
    for key, (other, values) in ONLY_WITH.items():
        if key in c.diff and other in c.knobs and c.knobs[other] not in values:
            return key
    return None


_AC_COST = {"none": 0, "selective": 1, "every_n": 2, "full": 3}


def prior_order(candidates: list[Candidate]) -> list[Candidate]:
    """The order of the first round (and of the cut when the budget cannot cover every
    candidate): the baseline, then less recomputation and offload first, larger micro-batches
    first, fewer changes first."""
    kept = [c for c in candidates[1:] if c.status == "kept"]

    def key(c: Candidate) -> tuple:
        return (
            c.knobs.get("fsdp.cpu_offload") == "true",
            _AC_COST.get(c.knobs.get("activation_checkpointing.mode", "none"), 0),
            -int(c.knobs.get("train.micro_batch_size", "1")),
            len(c.diff),
            c.index,
        )

    return [candidates[0], *sorted(kept, key=key)]


# ---------------------------------------------------------------------------------------------
# The schedule


@dataclass(frozen=True)
class Round:
    index: int
    num_candidates: int  # the baseline included
    measured_steps: int
    repeats: int


def halving_schedule(
    num_candidates: int, *, steps: int, finalists: int, repeats: int, eta: int = ETA
) -> list[Round]:
    """Successive halving: all candidates for `steps` measured steps, then the best 1/eta (at
    least the baseline and `finalists` challengers) for twice the steps, ..., the last round with
    `repeats` trials of each."""
    rounds, n, s = [], num_candidates, steps
    while True:
        final = n <= finalists + 1
        rounds.append(Round(len(rounds), n, s, repeats if final else 1))
        if final:
            return rounds
        n, s = max(finalists + 1, math.ceil(n / eta)), s * 2


def schedule_cost_s(rounds: list[Round], *, overhead_s: float, step_s: float) -> float:
    """Estimated seconds of a schedule: each trial its start-up and warm-up (`overhead_s`) plus
    its measured steps."""
    return sum(r.num_candidates * r.repeats * (overhead_s + r.measured_steps * step_s)
               for r in rounds)  # fmt: skip


def fit_to_budget(
    num_candidates: int, budget_s: float, *, overhead_s: float, step_s: float, steps: int,
    finalists: int, repeats: int,
) -> int:  # fmt: skip
    """The most candidates (the baseline included; at least 2 when there are 2) whose whole
    schedule the budget covers."""
    for n in range(num_candidates, 2, -1):
        rounds = halving_schedule(n, steps=steps, finalists=finalists, repeats=repeats)
        if schedule_cost_s(rounds, overhead_s=overhead_s, step_s=step_s) <= budget_s:
            return n
    return min(num_candidates, 2)


# ---------------------------------------------------------------------------------------------
# Trials


def trial_id(round_index: int, cand: Candidate, rep: int) -> str:
    return f"r{round_index}-{cand.id}-{rep}"


def _fsdprun_command() -> list[str]:
    return [sys.executable, "-m", "fsdprun"]


def _die_with_parent() -> None:
    # A tune killed with SIGKILL must not leave its trial (and so its workers) running: the trial
    # launcher gets SIGKILL when tune dies (its workers die with it, see train/guard.py).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _fault_env(tid: str) -> dict[str, str]:
    """The fault-injection variables FSDPRUN_TUNE_FAULT gives trial `tid` (drills and tests)."""
    out = {}
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        target, _, assignment = item.partition(":")
        name, _, value = assignment.partition("=")
        if target == tid and name in FAULT_NAMES:
            out[name] = value
    return out


def trial_env(tid: str) -> dict[str, str]:
    """The environment of trial `tid`'s `fsdprun train`: this one, its fault drills, and never a
    SLURM step's marks, so that the trial is its node's launcher as tune is (inside an srun step
    of one task per node its `train` gets --nnodes as an override, not as the flag that tells
    srun_env so)."""
    env = dict(os.environ, **_fault_env(tid))
    env.pop(FAULT_ENV, None)
    env.pop("SLURM_STEP_ID", None)
    return env


def short_schedule(recipe: str, overrides: list[str], total_steps: int) -> list[str]:
    """A learning-rate warm-up longer than the trial, cut to the trial's length: `train` refuses
    schedule.warmup_steps > train.steps (llama-1b warms up over 10 steps; a first-round trial
    runs 3 + timing warm-up), and every candidate and the baseline get the same schedule, so the
    steps measured and the losses compared are alike. tuned.yaml never carries it
    (scripts/bench_tune.py cuts its timed runs the same way)."""
    try:
        schedule_warmup = load_recipe(recipe, overrides).config.schedule.warmup_steps
    except UserError:  # the trial's own `train` says what is wrong
        return []
    return [f"schedule.warmup_steps={total_steps}"] if schedule_warmup > total_steps else []


def run_trial(
    recipe: str, overrides: list[str], cand: Candidate, *, tid: str, round_: Round, warmup: int,
    out_dir: Path, timeout_s: float, multi_node: bool = False, alive=None,
) -> dict[str, Any]:  # fmt: skip
    """One `fsdprun train` of `cand` in its own process group; its trial record.

    `multi_node`: this is one node's part of a multi-node trial, whose metrics only the node of
    global rank 0 writes: a part that ends well without them is "ok" without measurements (see
    nodes.merge_records). `alive()` is polled while the trial runs; once it is False (node 0
    of a multi-node tune is gone) the trial is killed."""
    run_dir = out_dir / "trials" / tid
    log = out_dir / "logs" / f"{tid}.log"
    try:
        if run_dir.exists():  # left by a tune killed during this trial: its result never logged
            shutil.rmtree(run_dir)
        log.parent.mkdir(parents=True, exist_ok=True)
        log_file = log.open("w")
    except OSError as e:
        raise write_error(f"cannot write trial {tid}'s log {log}", e, option="--out",
                          then=CONTINUES) from None  # fmt: skip
    total_steps = warmup + round_.measured_steps
    cmd = [
        *_fsdprun_command(), "train", recipe, *overrides, *cand.overrides, *TRIAL_OVERRIDES,
        f"train.steps={total_steps}", f"output.timing_warmup_steps={warmup}",
        *short_schedule(recipe, [*overrides, *cand.overrides], total_steps),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = trial_env(tid)
    record: dict[str, Any] = {
        "event": "trial", "id": tid, "candidate": cand.id, "label": cand.label,
        "overrides": cand.overrides, "round": round_.index, "measured_steps": round_.measured_steps,
        "warmup_steps": warmup, "run_dir": str(run_dir),
    }  # fmt: skip
    start = time.perf_counter()
    with log_file as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        try:
            _wait_trial(proc, timeout_s, alive)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            record["status"] = "timeout"
        except _Abandoned:
            _kill_group(proc)
            record["status"], record["reason"] = "failed", "node 0 went away"
            record["wall_s"] = time.perf_counter() - start
            return record
        except BaseException:  # Ctrl-C: the trial goes with tune, and is never logged
            _kill_group(proc)
            raise
    record["wall_s"] = time.perf_counter() - start
    events = read_events(metrics_path(run_dir)) if metrics_path(run_dir).exists() else []
    steps = [e for e in events if e["event"] == "step"]
    summary = events[-1] if events and events[-1]["event"] == "summary" else None
    start_event = next((e for e in events if e["event"] == "start"), {})
    record["losses"] = [e["loss"] for e in steps]
    record["device_name"] = start_event.get("device_name")
    record["world_size"] = start_event.get("world_size")
    if record.get("status") == "timeout":
        last = steps[-1]["step"] if steps else 0
        record["reason"] = f"hung: no result within {timeout_s:.0f} s (killed after step {last})"
        return record
    if multi_node and proc.returncode == 0 and not events:
        record["status"] = "ok"  # global rank 0 ran on another node: its part has the figures
        return record
    if proc.returncode != 0 or summary is None:
        text = log.read_text(errors="replace")
        line = error_line(text)
        if any(p in line.lower() for p in STORAGE_PHRASES):
            # Not logged: the rerun, once there is room, runs this trial again.
            why = line.removeprefix("error: ")
            raise StorageError(f"trial {tid} could not write under {out_dir}: {why}; free some "
                               f"space there (or make it writable), then {CONTINUES}")  # fmt: skip
        record["status"] = "oom" if "out of memory" in text.lower() else "failed"
        record["reason"] = f"exit {proc.returncode}: {line}"
        return record
    if summary.get("stopped"):  # a STOP file in the trial's run dir: exit 0, but cut short
        stopped = summary["stopped"]
        record["status"] = "failed"
        record["reason"] = f"stopped at step {stopped['step']} ({stopped['reason']})"
        return record
    times = summary["step_times_s"]
    tokens = start_event.get("tokens_per_step") or 0
    ranks = summary["ranks"]
    gpu = "peak_allocated_bytes" in ranks[0]
    record.update(
        status="ok",
        step_times_s=times[warmup:],
        tokens_per_step=tokens,
        time_to_first_step_s=record["wall_s"] - sum(times[1:]),
        warmup_s=sum(times[:warmup]),
        mfu=summary["throughput"].get("mfu"),
        peak_bytes=max(r["peak_allocated_bytes" if gpu else "peak_rss_bytes"] for r in ranks),
        memory_kind="allocated" if gpu else "RSS",
        model_state_bytes=max(r["model_state_bytes"]["total"] for r in ranks),
    )
    return record


class _Abandoned(Exception):
    """The trial's `alive()` turned False."""


def _wait_trial(proc: subprocess.Popen, timeout_s: float, alive) -> None:
    if alive is None:
        proc.wait(timeout=timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        if not alive():
            raise _Abandoned
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def loss_problem(losses: list[float], reference: list[float], rtol: float) -> str | None:
    """Why a trial's first losses disagree with the baseline's of the same round, or None."""
    n = min(LOSS_STEPS, len(reference))
    if len(losses) < n:
        return f"loss check: only {len(losses)} steps logged"
    for step, (got, want) in enumerate(zip(losses[:n], reference[:n], strict=True), start=1):
        if not math.isfinite(got) or abs(got - want) > rtol * max(abs(want), 1e-12):
            return f"loss check: step {step} loss {got:.6g} vs baseline {want:.6g} (rtol {rtol:g})"
    return None


# ---------------------------------------------------------------------------------------------
# The trial log


class TrialLog:
    """OUT/trials.jsonl: a header naming the search, then one record per finished trial, and
    the notes `fsdprun status` reads (each run's `session`: its start and budget; `done`: the
    verdict). Each line is appended and fsynced, so a killed tune leaves whole records only; a
    torn last line (a kill inside the write) is cut off when the log is opened again."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path, self.records = path, []
        if path.exists():
            good, lines = 0, path.read_bytes().split(b"\n")
            docs = []
            for line in lines:
                try:
                    docs.append(json.loads(line))
                except ValueError:
                    break
                good += len(line) + 1
            if good < path.stat().st_size:
                try:
                    os.truncate(path, good)
                except OSError as e:
                    raise write_error(f"cannot cut the torn last line of {path}", e,
                                      option="--out", then=CONTINUES) from None  # fmt: skip
            if docs:
                if docs[0].get("search") != header["search"]:
                    raise UserError(
                        f"--out {path.parent}: holds a tune of another search (recipe, "
                        "overrides, space or launch differ); give a new --out, or the same "
                        "arguments to continue it"
                    )
                self.records = [d for d in docs[1:] if d.get("event") == "trial"]
                return
        self._append(header)

    def _append(self, doc: dict[str, Any]) -> None:
        size = self.path.stat().st_size if self.path.exists() else None
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(doc) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            # Whole records only: a part written is cut off again (the header's file removed).
            with contextlib.suppress(OSError):
                if size is None:
                    self.path.unlink()
                else:
                    os.truncate(self.path, size)
            raise write_error(f"cannot write {self.path}", e, option="--out",
                              then=CONTINUES) from None  # fmt: skip

    def add(self, record: dict[str, Any]) -> None:
        self._append(record)
        self.records.append(record)

    def note(self, event: str, **fields: Any) -> None:
        """A line for `fsdprun status`, not a trial."""
        self._append({"event": event, **fields})

    def get(self, tid: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["id"] == tid), None)


# ---------------------------------------------------------------------------------------------
# Selection


@dataclass
class Stats:
    median: float
    q1: float
    q3: float
    num_trials: int
    num_steps: int

    @property
    def spread(self) -> float:
        """Half the interquartile range, relative to the median."""
        return (self.q3 - self.q1) / 2 / self.median if self.median else math.nan

    @property
    def median_error(self) -> float:
        """Standard error of the median, relative to it: 1.2533 sigma / sqrt(n), sigma estimated
        robustly as IQR / 1.349 (so one slow step does not inflate it). It shrinks as a trial
        measures more steps, as the step-to-step spread does not."""
        sigma = (self.q3 - self.q1) / 1.349
        return 1.2533 * sigma / math.sqrt(self.num_steps) / self.median if self.median else math.nan


def noise_of(candidate: Stats, baseline: Stats) -> float:
    """The measured noise of a gain: two standard errors of the difference of the two medians
    (about 95% confidence), relative to the baseline's median."""
    return 2 * math.hypot(candidate.median_error * candidate.median / baseline.median,
                          baseline.median_error)  # fmt: skip


def step_rates(record: dict[str, Any]) -> list[float]:
    return [record["tokens_per_step"] / t for t in record.get("step_times_s", []) if t > 0]


def round_stats(records: list[dict[str, Any]], cand_id: str, round_index: int) -> Stats | None:
    """Tokens/s of one candidate in one round: every measured step of its good trials."""
    mine = [r for r in records if r["candidate"] == cand_id and r["round"] == round_index
            and r["status"] == "ok"]  # fmt: skip
    samples = [x for r in mine for x in step_rates(r)]
    if not samples:
        return None
    return Stats(percentile(samples, 50), percentile(samples, 25), percentile(samples, 75),
                 len(mine), len(samples))  # fmt: skip


@dataclass
class Ranked:
    candidate: str
    round: int | None  # the round it is compared at (highest with the baseline)
    stats: Stats | None
    baseline: Stats | None
    gain: float | None  # median / baseline median - 1


@dataclass
class Selection:
    winner: str  # a candidate id; "c0" = the baseline stays
    ranking: list[Ranked]
    beats_noise: bool
    gain: float | None
    noise: float | None  # the baseline's relative spread at the compared round
    verdict: str


def select(records: list[dict[str, Any]], baseline: str = "c0") -> Selection:
    """The winner from the trial log alone (deterministic): each candidate is compared with the
    baseline at the highest round both have good trials in; ranked by that round, then median
    tokens/s, then id. The top challenger wins only if its gain exceeds the measured noise
    (`noise_of`: two standard errors of the difference of the medians)."""
    ids = sorted({r["candidate"] for r in records}, key=lambda c: int(c[1:]))
    ranking = []
    for cid in ids:
        rounds = sorted({r["round"] for r in records if r["candidate"] == cid}, reverse=True)
        best = None
        for ri in rounds:
            mine, base = round_stats(records, cid, ri), round_stats(records, baseline, ri)
            if mine is not None and base is not None:
                best = Ranked(cid, ri, mine, base, mine.median / base.median - 1)
                break
        if best is None:
            mine = next((s for ri in rounds if (s := round_stats(records, cid, ri))), None)
            best = Ranked(cid, None, mine, None, None)
        ranking.append(best)

    def key(r: Ranked) -> tuple:
        return (r.round is None, -(r.round or 0), -(r.stats.median if r.stats else -1),
                int(r.candidate[1:]))  # fmt: skip

    ranking.sort(key=key)
    labels = {r["candidate"]: r.get("label", r["candidate"]) for r in records}
    top = next((r for r in ranking if r.round is not None), None)
    if top is None:
        # The starting recipe never ran (out of memory, say): any candidate that ran is better.
        ran = next((r for r in ranking if r.stats is not None and r.candidate != baseline), None)
        if ran is None:
            return Selection(baseline, ranking, False, None, None,
                             "no trial succeeded: the starting recipe stays")  # fmt: skip
        return Selection(ran.candidate, ranking, True, None, None,
                         f"no trial of the starting recipe succeeded; {ran.candidate} "
                         f"({labels[ran.candidate]}) is the fastest that ran")  # fmt: skip
    noise = noise_of(top.stats, top.baseline)
    if top.candidate == baseline:
        return Selection(baseline, ranking, False, 0.0, noise,
                         "the starting recipe is the fastest: it stays")  # fmt: skip
    if not top.gain > noise:
        return Selection(
            baseline, ranking, False, top.gain, noise,
            f"{top.candidate} ({labels[top.candidate]}) is {top.gain:+.1%} but within the "
            f"measured noise (±{noise:.1%}): the starting recipe stays",
        )  # fmt: skip
    return Selection(top.candidate, ranking, True, top.gain, noise,
                     f"{top.candidate} ({labels[top.candidate]}) beats the starting recipe by "
                     f"{top.gain:+.1%}, more than the measured noise (±{noise:.1%})")  # fmt: skip


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Ids of the (id, peak bytes, tokens/s) points no other point beats on both (less memory
    and more tokens/s)."""
    front = []
    for pid, mem, tps in points:
        if not any((m <= mem and t >= tps) and (m < mem or t > tps) for _, m, t in points):
            front.append(pid)
    return front


# ---------------------------------------------------------------------------------------------
# The tuned layer


def tuned_layer(
    recipe_ref: str, overrides: list[str], winner: Candidate, *, config: RecipeConfig,
    verdict: str, hardware: str, command: str,
) -> str:  # fmt: skip
    """tuned.yaml: extends the user's recipe and sets only the winning knobs (plus the user's own
    command-line overrides, which are part of the recipe that was tuned; `config` is that
    recipe resolved, whose paths the layer writes)."""
    from fsdprun.config import parse_overrides, schema_fields
    from fsdprun.config.load import PATH_KEYS
    from fsdprun.config.validate import STRING_KEYS

    tree: dict[str, Any] = {"extends": recipe_ref}

    def put(key: str, value: Any) -> None:
        section, name = key.split(".", 1)
        value = value.value if isinstance(value, enum.Enum) else value
        tree.setdefault(section, {})[name] = value

    # Not the launch (the train command names it) nor the search's own tune.* (training
    # ignores them; a tune of the layer starts from the recipe's section again).
    user = [o for o in overrides if not o.lstrip("~").startswith(("launch.", "tune."))]
    values, drops = parse_overrides(user)
    fields = schema_fields()
    for key in drops:  # ~key: back to the schema's default, which a layer spells out
        f = fields[key]
        put(key, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for key, value in values.items():
        # A relative path on the command line is read from the working directory, one in a
        # layer from the layer's folder (and `models/tiny` found nowhere reads as a Hub id):
        # the layer holds absolute paths, as the recipe resolved them (a Hub id: its snapshot).
        if key in PATH_KEYS:
            section, name = key.split(".", 1)
            value = getattr(getattr(config, section), name)
        elif STRING_KEYS.get(key, ("",))[0] in ("file", "folder", "path") and isinstance(
            value, str
        ) and value and "${" not in value:  # fmt: skip
            value = str(Path(value).expanduser().absolute())
        put(key, value)
    for key, value in parse_overrides(winner.overrides)[0].items():
        put(key, value)
    today = dt.date.today().isoformat()
    header = [
        f"# {command}",
        f"# Tuned by fsdprun tune on {today}, {hardware}.",
        f"# {verdict}.",
        "# This layer sets only the winning knobs"
        + (" (and the command line's overrides of the tuned recipe)." if overrides else "."),
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(tree, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class TuneArgs:
    recipe: str
    overrides: list[str]  # the user's key=value overrides
    launch_overrides: list[str]  # from the launch flags
    launch_flags: list[str]  # the same flags as typed, for the printed train command
    out_dir: Path
    budget_s: float
    device_memory_bytes: int | None = None
    space: list[str] = field(default_factory=list)
    allow_numerics: bool = False
    steps: int = DEFAULT_STEPS
    repeats: int = DEFAULT_REPEATS
    finalists: int = DEFAULT_FINALISTS
    trial_timeout_s: float | None = None
    margin: float = DEFAULT_MARGIN
    dry_run: bool = False  # print the space, the pruning and the order; run nothing


def probe_device(cfg: RecipeConfig) -> dict[str, Any]:
    """The accelerator's kind, name and free memory, measured in a subprocess so that this
    process never holds a device context while trials run."""
    if cfg.launch.device.value == "cpu":
        return {"kind": "cpu"}
    code = (
        "import json, torch\n"
        "d = {'kind': 'cpu'}\n"
        "if torch.cuda.is_available():\n"
        "    free, total = torch.cuda.mem_get_info()\n"
        "    d = {'kind': 'cuda', 'name': torch.cuda.get_device_name(), 'free': free,"
        " 'total': total}\n"
        "print(json.dumps(d))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"kind": "cpu"}


# Launch values that name where a node runs, not what is measured: a search continues with
# another rendezvous endpoint (a requeued job's first host), and its nodes differ in node_rank.
PLACE_KEYS = ("launch.node_rank=", "launch.rdzv_endpoint=")


def _measured_launch(args: TuneArgs) -> list[str]:
    return [o for o in args.launch_overrides if not o.startswith(PLACE_KEYS)]


def _search_key(args: TuneArgs, space: list[SpaceKnob]) -> str:
    doc = json.dumps([args.recipe, args.overrides, _measured_launch(args),
                      [asdict(k) for k in space], args.steps, args.repeats,
                      args.finalists], sort_keys=True)  # fmt: skip
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def parse_duration(text: str, option: str) -> float:
    """'20m', '90s', '1h', '45' (seconds) → seconds.

    Raises:
        UserError: not a positive duration.
    """
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = -1
    if not value > 0:
        raise UserError(f"{option} {text!r}: give a duration such as 20m, 90s or 1h")
    return value


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the search: one line, exit 128 + the signal."""

    def __init__(self, message: str, *, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Signal(BaseException):  # not caught where `except Exception` turns errors into lines
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT and SIGTERM raise _Signal where the search is (a trial's process group is then
    killed on the way out, and nothing of it logged); later ones while it stops do nothing. A
    SIGINT that this process ignores (started in the background) stays ignored."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    caught: list[int] = []

    def handle(signum: int, frame: object) -> None:
        if not caught:
            caught.append(signum)
            raise _Signal(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, handle)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def tune(args: TuneArgs, *, say=None) -> dict[str, Any]:
    """The whole search; returns the report (its JSON document). With launch.nnodes > 1 every
    node calls this with the same arguments: node 0 searches, the others run its trials with it
    (fsdprun.tools.tune.nodes) and return its report.

    Raises:
        UserError: the recipe is invalid, --device-memory missing on CPU, a bad --space, --out
            holds another search, or a multi-node tune without --rdzv-endpoint or under
            torchrun/srun as a worker.
        NodeLost: another node of a multi-node tune went away.
        Interrupted: SIGINT (Ctrl-C) or SIGTERM; the message says what is kept.
    """
    try:
        with _stop_on_signals():
            return _tune(args, say=say)
    except _Signal as e:
        log = args.out_dir / TUNE_LOG_FILE
        kept = "nothing was written yet"
        if log.is_file():
            n = 0
            with contextlib.suppress(OSError):
                for line in log.read_bytes().splitlines():
                    with contextlib.suppress(ValueError):
                        n += json.loads(line).get("event") == "trial"
            kept = (f"{n} finished trial(s) are kept in {log} (a trial in progress is stopped "
                    "and not logged)")  # fmt: skip
        raise Interrupted(f"tune interrupted by {e}: {kept}; rerun the same command to continue",
                          exit_code=128 + e.signum) from None  # fmt: skip


def _tune(args: TuneArgs, *, say=None) -> dict[str, Any]:
    say = say or (lambda text: None)
    started = time.perf_counter()
    for option, value in (("--steps", args.steps), ("--repeats", args.repeats),
                          ("--finalists", args.finalists)):  # fmt: skip
        if value < 1:
            raise UserError(f"{option} must be >= 1 (got {value})")
    base_overrides = [*args.overrides, *args.launch_overrides]
    resolved = load_recipe(args.recipe, base_overrides)
    cfg = resolved.config
    problems = check_data(cfg)
    if problems:
        raise UserError("; ".join(problems))
    device_problem = None if args.dry_run else launch_device_problem(cfg.launch.device)
    if device_problem:  # every trial would be refused the same way: say it once, up front
        raise UserError(device_problem)
    if "RANK" in os.environ:
        # Each trial is a launch of its own: tune is a node's launcher, never one of its workers.
        raise UserError(
            "fsdprun tune runs as each node's launcher, not as a worker of torchrun or of a "
            "multi-task srun step: run one tune per node (srun --ntasks-per-node 1 ... with "
            "--nnodes, --node-rank and --rdzv-endpoint, as for fsdprun train)"
        )
    launch = cfg.launch
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise UserError(
            f"launch.nnodes is {launch.nnodes}: pass --rdzv-endpoint HOST:PORT (node 0's "
            "address) and --node-rank on every node"
        )
    if launch.nnodes > 1 and launch.node_rank > 0 and not args.dry_run:
        return _follow(args, cfg, say)
    leader = None
    if launch.nnodes > 1 and not args.dry_run:
        from fsdprun.tools.tune.nodes import Leader

        # Up before the plan prunes (seconds for a large space), so the other nodes join now.
        leader = Leader(launch.rdzv_endpoint, nnodes=launch.nnodes, search=_nodes_key(args),
                        timeout_s=launch.rdzv_timeout_s)  # fmt: skip
    try:
        report = _lead(args, resolved, cfg, started, say, leader)
    except BaseException as e:
        if leader is not None:
            why = (str(e).strip().splitlines() or [""])[0]
            if isinstance(e, UserError):
                leader.finish({"error": why})
            else:  # Ctrl-C (or a bug): no waiting for the others on the way out
                leader.finish({"error": f"{type(e).__name__}{': ' + why if why else ''}"},
                              wait_s=0)  # fmt: skip
        raise
    if leader is not None:
        leader.finish({"report": report})
    return report


def _nodes_key(args: TuneArgs) -> str:
    """What every node of a multi-node tune must agree on: the arguments but --node-rank."""
    doc = json.dumps([args.recipe, args.overrides, _measured_launch(args), args.space,
                      args.allow_numerics, args.steps, args.repeats, args.finalists],
                     sort_keys=True)  # fmt: skip
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _follow(args: TuneArgs, cfg: RecipeConfig, say) -> dict[str, Any]:
    """A node but node 0: run node 0's trials with it; its trial folders are OUT/node-N/ (OUT
    may be shared with node 0's)."""
    from fsdprun.tools.tune.nodes import REPORT_SLACK_S, follow

    node = cfg.launch.node_rank
    out = args.out_dir / f"node-{node}"
    overrides = [*args.overrides, *args.launch_overrides]

    def run_here(trial: dict[str, Any], alive) -> dict[str, Any]:
        diff = dict(o.split("=", 1) for o in trial["overrides"])
        cand = Candidate(int(trial["candidate"][1:]), diff, diff)
        # Node 0 kills its part at the timeout, and this part then loses its peers: the slack
        # keeps this node from cutting a trial that node 0 still counts.
        rec = run_trial(args.recipe, [*overrides, f"launch.rdzv_endpoint={trial['endpoint']}"],
                        cand, tid=trial["tid"], round_=Round(**trial["round"]),
                        warmup=trial["warmup"], out_dir=out,
                        timeout_s=trial["timeout_s"] + REPORT_SLACK_S / 2, multi_node=True,
                        alive=alive)  # fmt: skip
        say(f"  {trial['tid']} {cand.label}: this node's part {rec['status']} "
            f"({rec['wall_s']:.1f} s)")  # fmt: skip
        return rec

    with hold_run_dir(args.out_dir, node_rank=node, option="--out"):
        report = follow(cfg.launch.rdzv_endpoint, node_rank=node, search=_nodes_key(args),
                        timeout_s=cfg.launch.rdzv_timeout_s, run_here=run_here,
                        say=say)  # fmt: skip
    return dict(report, node_rank=node)


def _lead(args, resolved, cfg, started, say, leader) -> dict[str, Any]:
    """One node's search, or node 0's of several (each trial through `leader`)."""
    base_overrides = [*args.overrides, *args.launch_overrides]
    device = probe_device(cfg)
    accelerator = device["kind"] != "cpu"
    if args.device_memory_bytes is None and device["kind"] == "cpu":
        raise UserError(
            "--device-memory is required on CPU (no accelerator memory to measure); e.g. "
            "--device-memory 8GB"
        )
    memory = args.device_memory_bytes or int(device["free"])
    memory_source = "--device-memory" if args.device_memory_bytes else (
        f"free memory of {device.get('name', 'the device')} measured now"
    )  # fmt: skip
    left_out: dict[str, str] = {}
    space, defaults = parse_space(args.space, cfg, accelerator=accelerator,
                                  allow_numerics=args.allow_numerics,
                                  refused=refused_alone(args.recipe, base_overrides),
                                  left_out=left_out)  # fmt: skip
    warmup = max(cfg.output.timing_warmup_steps, 1)
    rtol = LOSS_RTOL[cfg.precision.param_dtype.value]

    def plan() -> tuple[list[Candidate], list[Candidate]]:
        baseline = {k.key: current_value(cfg, k.key) for k in space}
        candidates = enumerate_candidates(space, baseline)
        prune(candidates, args.recipe, base_overrides, device_memory_bytes=memory,
              margin=args.margin, dominate_memory_knobs=defaults)  # fmt: skip
        order = prior_order(candidates)
        _print_space(say, space, candidates, order, memory, memory_source, args, warmup, rtol,
                     cfg, left_out)  # fmt: skip
        base = candidates[0]
        if base.planned_peak_bytes * (1 + args.margin) > memory:
            from fsdprun.report.console import fmt_bytes

            # On stderr even with --json: the baseline runs anyway (it is the reference).
            peak = fmt_bytes(base.planned_peak_bytes)
            print(f"warning: the starting recipe plans a peak of {peak} per rank, over the "
                  f"device memory {fmt_bytes(memory)} ({memory_source}) with the "
                  f"{args.margin:.0%} margin; its trials (the baseline, run first) may run out "
                  "of memory", file=sys.stderr, flush=True)  # fmt: skip
        return candidates, order

    if args.dry_run:
        candidates, order = plan()
        rounds = halving_schedule(len(order), steps=args.steps, finalists=args.finalists,
                                  repeats=args.repeats)  # fmt: skip
        return {
            "recipe": resolved.name, "device_memory_bytes": memory, "margin": args.margin,
            "space": [asdict(k) for k in space], "left_out": left_out,
            "order": [c.id for c in order],
            "rounds": [asdict(r) for r in rounds],
            "candidates": [{"candidate": c.id, "label": c.label, "overrides": c.overrides,
                            "status": c.status, "reason": c.reason,
                            "planned_peak_bytes": c.planned_peak_bytes} for c in candidates],
        }  # fmt: skip

    report: dict[str, Any]
    # --out before the plan (seconds for a large space) and any trial: a second tune there is
    # refused, and a place that cannot be written fails now, not at the first write of an hour's
    # search (the lock's holder and the trial log's header are real writes).
    with hold_run_dir(args.out_dir, option="--out"):
        header = {"event": "tune", "search": _search_key(args, space), "recipe": resolved.name,
                  "overrides": base_overrides}  # fmt: skip
        log = TrialLog(args.out_dir / TUNE_LOG_FILE, header)
        # When the budget started (tune's start, before the checks): status counts from it.
        began = dt.datetime.fromtimestamp(time.time() - (time.perf_counter() - started), dt.UTC)
        log.note("session", started_at=began.isoformat(timespec="seconds"),
                 budget_s=args.budget_s, pid=os.getpid())  # fmt: skip
        candidates, order = plan()
        if log.records:
            say(f"continuing {args.out_dir}: {len(log.records)} finished trials in {TUNE_LOG_FILE}")
        if leader is not None:
            leader.wait_for_nodes(say)
        stop, left_out = _search(args, log, order, warmup=warmup, rtol=rtol, started=started,
                                 say=say, leader=leader)  # fmt: skip
        for c in candidates:
            if c.id in left_out:
                c.reason = left_out[c.id]
        report = _report(args, resolved, cfg, candidates, log.records, memory, memory_source,
                         stop, started, rtol)  # fmt: skip
        _write_tuned(args, report, candidates, cfg)
        log.note(
            "done",
            winner=report["winner"],
            winner_label=report["winner_label"],
            verdict=report["verdict"],
            stopped_early=stop,
            tuned_yaml=report["tuned_yaml"],
        )
    return report


def _print_space(
    say, space, candidates, order, memory, memory_source, args, warmup, rtol, cfg, left_out
):  # fmt: skip
    from fsdprun.report.console import fmt_bytes

    say(f"space ({len(candidates)} candidates) from {space_sources(args.space, cfg)}:")
    for k in space:
        mark = "  [numerics: changes the math]" if k.numerics else ""
        say(f"  {k.key}: {', '.join(k.values)}{mark}")
    for kv, why in left_out.items():
        say(f"  left out {kv}: the recipe refuses it ({why})")
    say(f"device memory {fmt_bytes(memory)} ({memory_source}); margin {args.margin:.0%} over "
        "the planned peak per rank")  # fmt: skip
    pruned = [c for c in candidates if c.status == "pruned"]
    groups: dict[str, list[Candidate]] = {}
    for c in pruned:
        groups.setdefault(c.group or c.reason or "", []).append(c)
    # Hundreds of candidates in the default space: one line per reason, the most common first.
    say(f"pruned {len(pruned)}" + (", by reason (--json lists each candidate):" if pruned else ""))
    for group, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        c = members[0]
        say(f"  {len(members)} x {group}; e.g. {c.id} {c.label}: {c.reason}")
    say(f"order ({len(order)}): " + ", ".join(f"{c.id} {c.label}" for c in order))
    say(f"each trial: {warmup} warm-up steps (time to first step), then {args.steps} measured "
        f"steps in round 0, doubling each round; loss check: first {LOSS_STEPS} losses within "
        f"rtol {rtol:g} of the baseline's")  # fmt: skip


def _search(
    args, log, order, *, warmup, rtol, started, say, leader=None
) -> tuple[str | None, dict]:
    """Run the rounds. Returns why the search stopped early (the budget) or None, and the
    candidates the budget left out of the first round (id -> reason)."""
    records = log.records
    base = order[0]

    def elapsed() -> float:
        return time.perf_counter() - started

    def costs() -> tuple[float, float] | None:
        """Median start-up + warm-up seconds of a trial, and median seconds of a measured step."""
        ok = [r for r in records if r["status"] == "ok"]
        if not ok:
            return None
        overhead = percentile([r["wall_s"] - sum(r["step_times_s"]) for r in ok], 50)
        return overhead, percentile([t for r in ok for t in r["step_times_s"]], 50)

    def estimate(steps: int) -> float | None:
        c = costs()
        return None if c is None else c[0] + steps * c[1]

    def timeout(steps: int, cand: Candidate) -> float:
        est = estimate(steps)
        # Generous: a slow candidate is not a hung one (compile's first steps take minutes).
        compiled = 2 if cand.knobs.get("compile.enabled") == "true" else 1
        limit = args.trial_timeout_s or (
            FIRST_TRIAL_TIMEOUT_S if est is None else compiled * max(MIN_TIMEOUT_S, 4 * est)
        )  # fmt: skip
        # Never past the budget by more than one trial's length.
        return min(limit, max(args.budget_s - elapsed(), 0) + (est or limit))

    alive, left_out, fitted = list(order), {}, False
    for round_index in itertools.count():
        final = len(alive) <= args.finalists + 1
        rnd = Round(round_index, len(alive), args.steps * 2**round_index,
                    args.repeats if final else 1)  # fmt: skip
        say(f"round {rnd.index}: {rnd.num_candidates} candidates x {rnd.repeats} trials of "
            f"{rnd.measured_steps} measured steps")  # fmt: skip
        rep = 0
        while rep < rnd.repeats:
            i = 0
            while i < len(alive):
                cand = alive[i]
                i += 1
                tid = trial_id(rnd.index, cand, rep)
                if log.get(tid) is None:
                    est = estimate(rnd.measured_steps)
                    if records and (
                        elapsed() >= args.budget_s
                        or (est is not None and elapsed() + est > args.budget_s)
                    ):
                        return (f"--budget {args.budget_s:.0f} s spent after {elapsed():.0f} s: "
                                f"{tid} and later trials not run"), left_out  # fmt: skip
                    _trial(args, log, cand, base, tid=tid, rnd=rnd, warmup=warmup, rtol=rtol,
                           timeout_s=timeout(rnd.measured_steps, cand), say=say,
                           leader=leader)  # fmt: skip
                if round_index == 0 and not final and not fitted and (c := costs()):
                    # Once one trial has run: as many candidates as the budget's schedule covers.
                    fitted = True
                    n = fit_to_budget(len(alive), args.budget_s - elapsed() + c[0] + c[1] * rnd.
                                      measured_steps, overhead_s=c[0], step_s=c[1],
                                      steps=args.steps, finalists=args.finalists,
                                      repeats=args.repeats)  # fmt: skip
                    if n < len(alive):
                        reason = f"not tried: --budget covers the schedule of {n} candidates"
                        left_out = {c.id: reason for c in alive[n:]}
                        alive = alive[:n]
                        say(f"  the budget covers {n} candidates: {len(left_out)} left out")
                        if len(alive) <= args.finalists + 1:
                            # Few enough for the last round: this one becomes it, with repeats.
                            final = True
                            rnd = Round(rnd.index, len(alive), rnd.measured_steps, args.repeats)
                            say(f"round {rnd.index} is the last: {rnd.num_candidates} candidates "
                                f"x {rnd.repeats} trials")  # fmt: skip
            rep += 1
        if final:
            return None, left_out
        scores = {c.id: round_stats(records, c.id, rnd.index) for c in alive}
        challengers = sorted((c for c in alive[1:] if scores[c.id] is not None),
                             key=lambda c: (-scores[c.id].median, c.index))  # fmt: skip
        keep = max(args.finalists, math.ceil(len(alive) / ETA) - 1)
        alive = [base, *challengers[:keep]]
        if len(alive) == 1:
            return None, left_out
    raise AssertionError("unreachable")


def _trial(args, log, cand, base, *, tid, rnd, warmup, rtol, timeout_s, say, leader) -> None:
    """Run one trial (on every node, through `leader`, when there are several), check its
    losses against the baseline's of the same round, log it."""
    records = log.records
    overrides = [*args.overrides, *args.launch_overrides]
    if leader is None:
        rec = run_trial(args.recipe, overrides, cand, tid=tid, round_=rnd, warmup=warmup,
                        out_dir=args.out_dir, timeout_s=timeout_s)  # fmt: skip
    else:
        doc = {"tid": tid, "candidate": cand.id, "overrides": cand.overrides,
               "round": asdict(rnd), "warmup": warmup, "timeout_s": timeout_s}  # fmt: skip
        rec = leader.run(doc, lambda t: run_trial(
            args.recipe, [*overrides, f"launch.rdzv_endpoint={t['endpoint']}"], cand, tid=tid,
            round_=rnd, warmup=warmup, out_dir=args.out_dir, timeout_s=timeout_s,
            multi_node=True,
        ))  # fmt: skip
    ref = next((r for r in records if r["candidate"] == base.id and r["round"] == rnd.index
                and r["status"] == "ok"), None)  # fmt: skip
    if rec["status"] == "ok" and ref is not None and cand is not base:
        rec["loss_checked"] = not cand.numerics
        problem = loss_problem(rec["losses"], ref["losses"], rtol)
        if problem and not cand.numerics:
            rec["status"], rec["reason"] = "loss", problem
    rec["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    log.add(rec)
    extra = f": {rec['reason']}" if rec.get("reason") else ""
    say(f"  {tid} {cand.label}: {rec['status']} ({rec['wall_s']:.1f} s){extra}")


def _report(args, resolved, cfg, candidates, records, memory, memory_source, stop, started,
            rtol) -> dict[str, Any]:  # fmt: skip
    sel = select(records)
    by_id = {c.id: c for c in candidates}
    hardware = _hardware(records, cfg)
    rows = []
    ranked_ids = set()
    last_round = max((x["round"] for x in records), default=0)
    for r in sel.ranking:
        c = by_id.get(r.candidate)
        if c is None:
            continue
        ranked_ids.add(c.id)
        mine = [x for x in records if x["candidate"] == c.id]
        ok = [x for x in mine if x["status"] == "ok"]
        bad = [x for x in mine if x["status"] != "ok"]
        peak = max((x["peak_bytes"] for x in ok), default=None)
        state = max((x["model_state_bytes"] for x in ok), default=None)
        kind = ok[0]["memory_kind"] if ok else None
        flags = plan_flags(c, ok, margin=args.margin)
        rows.append({
            "candidate": c.id, "label": c.label, "overrides": c.overrides,
            "numerics": c.numerics,
            "status": "ok" if ok and not bad else (bad[-1]["status"] if bad else "not run"),
            "reason": bad[-1]["reason"] if bad else (
                f"dropped after round {max(x['round'] for x in mine)} (successive halving)"
                if max(x["round"] for x in mine) < last_round else None
            ),
            "round": r.round, "num_trials": len(mine),
            "tokens_per_s": r.stats.median if r.stats else None,
            "spread": r.stats.spread if r.stats else None,
            "gain": r.gain,
            "mfu": percentile([x["mfu"] for x in ok if x.get("mfu") is not None], 50)
            if any(x.get("mfu") is not None for x in ok) else None,
            "peak_bytes": peak, "memory_kind": kind,
            "planned_peak_bytes": c.planned_peak_bytes,
            "model_state_bytes": state,
            "planned_model_state_bytes": c.planned_model_state_bytes,
            "time_to_first_step_s": percentile([x["time_to_first_step_s"] for x in ok], 50)
            if ok else None,
            "plan_flags": flags,
        })  # fmt: skip
    for c in candidates:
        if c.id in ranked_ids:
            continue
        rows.append({"candidate": c.id, "label": c.label, "overrides": c.overrides,
                     "numerics": c.numerics,
                     "status": "pruned" if c.status == "pruned" else "not run",
                     "reason": c.reason or (stop and "not reached within --budget")
                     or "dropped by successive halving",
                     "planned_peak_bytes": c.planned_peak_bytes})  # fmt: skip
    # A candidate dropped after round 0 keeps its round-0 figures; say why it stopped.
    winner = by_id[sel.winner]
    ref = _recipe_ref(args.recipe)
    tuned = args.out_dir / TUNED_FILE
    command = " ".join(["fsdprun", "train", str(tuned), *args.launch_flags])
    points = [(row["candidate"], row["peak_bytes"], row["tokens_per_s"]) for row in rows
              if row.get("peak_bytes") and row.get("tokens_per_s")]  # fmt: skip
    return {
        "recipe": resolved.name, "recipe_ref": ref, "overrides": args.overrides,
        "world_size": cfg.world_size, "nnodes": cfg.launch.nnodes, "hardware": hardware,
        "device_memory_bytes": memory, "device_memory_source": memory_source,
        "margin": args.margin, "loss_rtol": rtol, "budget_s": args.budget_s,
        "elapsed_s": time.perf_counter() - started, "stopped_early": stop,
        "num_trials": len(records),
        "winner": winner.id, "winner_label": winner.label, "winner_overrides": winner.overrides,
        "gain": sel.gain if sel.beats_noise else 0.0, "best_gain": sel.gain,
        "noise": sel.noise, "beats_noise": sel.beats_noise, "verdict": sel.verdict,
        "tuned_yaml": str(tuned), "command": command,
        "pareto": pareto_front(points),
        "candidates": rows,
    }  # fmt: skip


def plan_flags(c: Candidate, ok: list[dict[str, Any]], *, margin: float) -> list[str]:
    """Where a candidate's measured memory disagrees with its plan beyond what the plan states
    (each a bug in `plan`, either way): model state per rank beyond MODEL_STATE_RTOL, and the
    peak allocated on an accelerator beyond the pruning margin (a CPU's RSS also holds the
    torch runtime, which the plan does not count)."""
    flags = []
    state = max((x["model_state_bytes"] for x in ok), default=None)
    if state and c.planned_model_state_bytes:
        ratio = state / c.planned_model_state_bytes
        if abs(ratio - 1) > MODEL_STATE_RTOL:
            flags.append(f"model state measured {ratio:.2f}x the plan (beyond its "
                         f"{MODEL_STATE_RTOL:.0%}): a bug in plan")  # fmt: skip
    peak = max((x["peak_bytes"] for x in ok if x["memory_kind"] == "allocated"), default=None)
    if peak and c.planned_peak_bytes:
        ratio = peak / c.planned_peak_bytes
        if abs(ratio - 1) > margin:
            flags.append(f"peak allocated {ratio:.2f}x the plan (beyond the {margin:.0%} "
                         "margin): a bug in plan")  # fmt: skip
    return flags


def _hardware(records: list[dict[str, Any]], cfg: RecipeConfig) -> str:
    names = sorted({r["device_name"] for r in records if r.get("device_name")})
    device = names[0] if names else cfg.launch.device.value
    return f"{cfg.world_size} x {device} ({cfg.launch.nnodes} node(s))"


def _recipe_ref(recipe: str) -> str:
    """How tuned.yaml names the user's recipe: an absolute path for a file, else the built-in
    name."""
    path = Path(recipe)
    return str(path.resolve()) if path.is_file() else recipe


def _write_tuned(
    args: TuneArgs, report: dict[str, Any], candidates: list[Candidate], cfg: RecipeConfig
) -> None:
    winner = next(c for c in candidates if c.id == report["winner"])
    verdict = report["verdict"]
    if report["stopped_early"]:
        verdict += f" ({report['stopped_early']})"
    text = tuned_layer(report["recipe_ref"], args.overrides, winner, config=cfg, verdict=verdict,
                       hardware=report["hardware"], command=report["command"])  # fmt: skip
    path = Path(report["tuned_yaml"])
    tmp = path.with_suffix(".yaml.tmp")
    try:
        # Written whole beside it, then renamed: a tuned.yaml already there is never truncated.
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_error(f"cannot write {path}", e, option="--out", then=CONTINUES) from None


# ---------------------------------------------------------------------------------------------
# Output


def render(report: dict[str, Any], console: Console) -> None:
    """The ranked table, each candidate's reason or plan disagreement below it (one line each,
    so the table fits 80 columns), the verdict and the command that trains the tuned layer."""
    from rich.table import Table

    from fsdprun.report.console import fmt_bytes

    def pair(measured: int | None, planned: int | None) -> str:
        return (fmt_bytes(measured) if measured else "-") + "\n/ " + (
            fmt_bytes(planned) if planned else "-"
        )  # fmt: skip

    kind = next((r["memory_kind"] for r in report["candidates"] if r.get("memory_kind")), "")
    table = Table(title=f"fsdprun tune {report['recipe']}: {report['hardware']}, "
                  f"{report['num_trials']} trials in {report['elapsed_s']:.0f} s")  # fmt: skip
    # MFU only where a device's peak is known (never on CPU): a column of n/a costs the width.
    mfu = any(r.get("mfu") is not None for r in report["candidates"])
    columns = ("#", "knobs", "status", "tokens/s", "gain", *(["MFU"] if mfu else []),
               f"peak {kind}\n/ plan", "model state\n/ plan", "1st step")  # fmt: skip
    for col in columns:
        if col == "knobs":
            table.add_column(col, overflow="fold")
        else:
            table.add_column(col, justify="left" if col == "status" else "right")
    notes = []
    for row in report["candidates"]:
        tps = row.get("tokens_per_s")
        mark = " *" if row.get("numerics") else ""
        win = " ✓" if row["candidate"] == report["winner"] else ""
        for note in filter(None, [row.get("reason"), *row.get("plan_flags", [])]):
            notes.append(f"{row['candidate']} {row['label']}: {note}")
        status = row["status"] + (f" r{row['round']}" if row.get("round") is not None else "")
        status += win
        table.add_row(
            row["candidate"], row["label"] + mark, status,
            f"{tps:,.0f}\n±{row['spread']:.1%}" if tps else "-",
            f"{row['gain']:+.1%}" if row.get("gain") is not None else "-",
            *([f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"] if mfu else []),
            pair(row.get("peak_bytes"), row.get("planned_peak_bytes")),
            pair(row.get("model_state_bytes"), row.get("planned_model_state_bytes")),
            f"{row['time_to_first_step_s']:.1f} s" if row.get("time_to_first_step_s") else "-",
        )  # fmt: skip
    console.print(table)
    console.print(
        "tokens/s: median of every measured step in the last round the candidate shared with the "
        "baseline (rN), ± half the interquartile range; 1st step: launch to the end of step 1 "
        "(start-up, build, compile, warm-up); ✓ the winner; plan: `fsdprun plan` (peak per rank "
        "on the device; on CPU the RSS also holds the torch runtime); * changes the numerics"
        + ("" if mfu else "; MFU: no peak figure for this device (output.peak_tflops)")
    )
    for note in notes:
        console.print(f"  {note}")
    if report["stopped_early"]:
        console.print(f"stopped early: {report['stopped_early']}")
    console.print(report["verdict"])
    node = report.get("node_rank", 0)
    who = "wrote" if node == 0 else f"node 0 wrote (on its machine; --out holds node-{node}/ here)"
    console.print(f"{who} {report['tuned_yaml']}; train it with:\n  {report['command']}")
    if report.get("nnodes", 1) > 1:
        console.print(f"  (on every node, each with its own --node-rank; {TUNED_FILE} and the "
                      "recipe at the same path there)")  # fmt: skip
