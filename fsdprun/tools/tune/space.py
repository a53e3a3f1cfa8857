"""The space of `fsdprun tune`: the knobs, --space and the recipe's `tune:` section parsed into
the knobs' values, the default space, every candidate (a combination of values), the pruning by
`fsdprun plan` (over the device memory, refused by the recipe's checks, a knob the engine's knob
table says does nothing, a memory knob not needed) and the order of the first round; the device's
memory, measured in a subprocess (`probe_device`).

Never imports the trials, the search or the report: a space is decided before anything runs
(plan is imported only when it prunes).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdprun.config import TUNE_KNOBS, TUNE_NUMERICS_KNOBS, load_recipe
from fsdprun.config.layout import Layout
from fsdprun.config.model_facts import model_facts
from fsdprun.config.schema import AUTO, auto_keys, to_auto
from fsdprun.config.validate import tune_space_errors
from fsdprun.errors import UserError
from fsdprun.fmt import fmt_bytes

if TYPE_CHECKING:
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
    "parallel.cp": "1",
    "parallel.pp": "1",
}
# cpu_offload is only tried where nothing else fits, whatever the space says.
ALWAYS_DOMINATED = ("fsdp.cpu_offload",)
SHORT = {
    "train.micro_batch_size": "mb", "fsdp.engine": "engine", "fsdp.sharding": "shard",
    "fsdp.forward_prefetch": "fwd_prefetch", "fsdp.backward_prefetch": "bwd_prefetch",
    "fsdp.limit_all_gathers": "limit_ag", "fsdp.reshard_after_forward": "reshard",
    "activation_checkpointing.mode": "ac", "compile.enabled": "compile", "train.loss": "loss",
    "fsdp.cpu_offload": "offload", "fsdp.wrap": "wrap", "parallel.cp": "cp",
    "parallel.pp": "pp", "parallel.pp_schedule": "pp_schedule", "parallel.ep": "ep",
}  # fmt: skip

DEFAULT_MARGIN = 0.10  # planned peak x (1 + margin) must fit the device memory

# ---------------------------------------------------------------------------------------------
# The device


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
    return _text(to_auto(key, getattr(getattr(cfg, section), name)))


def _fitting(cfg: RecipeConfig) -> Layout:
    """The recipe's layout, with tp and cp 1 where they do not fit the world (refused)."""
    layout = Layout.of(cfg)
    if not layout.at(cp=1).fits_world:
        layout = layout.at(tp=1)
    return layout if layout.fits_world else layout.at(cp=1)


def micro_batch_choices(cfg: RecipeConfig) -> list[str]:
    """Every micro-batch size that divides one data-parallel rank's share of the global batch
    (the ranks of a TP x CP group share their micro-batch)."""
    per_rank = cfg.train.global_batch_size // _fitting(cfg).dp
    return [str(d) for d in range(1, per_rank + 1) if per_rank % d == 0]


def cp_choices(cfg: RecipeConfig) -> list[str]:
    """Context-parallel degrees to search: each that splits a row within a node (it divides
    the node's ranks per TP group) and divides train.seq_len with parallel.tp; the recipe's
    own included."""
    layout = _fitting(cfg).at(cp=1)
    per_node = max(layout.nproc_per_node // layout.row_group, 1)
    seq = cfg.train.seq_len
    fits = [d for d in range(1, per_node + 1)
            if per_node % d == 0 and seq % layout.at(cp=d).row_group == 0]  # fmt: skip
    return [str(d) for d in sorted({*fits, max(Layout.of(cfg).cp, 1)})]


def ep_choices(cfg: RecipeConfig) -> list[str]:
    """Expert-parallel degrees to search, for a model with experts: each that divides the
    experts and the data-parallel ranks of a node (the all-to-all stays on a node's links);
    the recipe's own included. [] for a dense model."""
    from fsdprun.config.model_facts import model_facts

    facts = model_facts(cfg.model)
    if facts is None or not facts.num_experts:
        return []
    layout = _fitting(cfg)
    per_node = max(layout.nproc_per_node // layout.row_group, 1)
    fits = [d for d in range(1, min(per_node, layout.dp) + 1)
            if per_node % d == 0 and layout.dp % d == 0 and facts.num_experts % d == 0]  # fmt: skip
    return [str(d) for d in sorted({*fits, max(Layout.of(cfg).ep, 1)})]


def needs_context_parallel(cfg: RecipeConfig, memory: int, margin: float) -> bool:
    """Whether tune's default space searches parallel.cp: the recipe does not split rows and
    its plan does not fit `memory` (with `margin`); cp divides the activations."""
    return not Layout.of(cfg).is_cp and _planned(cfg)[0] * (1 + margin) > memory


def pp_choices(cfg: RecipeConfig) -> list[str]:
    """Pipeline degrees to search: each that divides the data-parallel ranks of the recipe's
    layout at pp 1 and, across nodes, the node count (stages cut along nodes, TP and CP inside
    them), leaving each stage a block; the recipe's own included. At most 8."""
    layout = _fitting(cfg).at(pp=1)
    facts = model_facts(cfg.model)
    layers = (facts.n_layers if facts is not None else None) or cfg.model.n_layers
    nodes = cfg.launch.nnodes
    fits = [d for d in range(1, min(8, layout.dp, layers) + 1)
            if layout.dp % d == 0 and (nodes == 1 or nodes % d == 0)]  # fmt: skip
    return [str(d) for d in sorted({*fits, max(Layout.of(cfg).pp, 1)})]


def needs_pipeline_parallel(cfg: RecipeConfig, memory: int, margin: float) -> bool:
    """Whether tune's default space searches parallel.pp (and its schedule): the recipe has no
    pipeline and its plan does not fit `memory` (with `margin`); each stage holds its layers'
    state only."""
    return not Layout.of(cfg).is_pp and _planned(cfg)[0] * (1 + margin) > memory


# Whether the recipe's checks refuse KEY=VALUE whatever the space's other knobs (KEYS) are: its
# refusal, else None (see `refused_alone`).
Refusal = Callable[[str, str, set[str]], str | None]


def default_space(
    cfg: RecipeConfig, *, accelerator: bool, refused: Refusal | None = None,
    left_out: dict[str, str] | None = None, cp: bool = False, pp: bool = False,
) -> list[SpaceKnob]:  # fmt: skip
    """What an engineer tuning FSDP by hand tries first, from the recipe's own values.

    `pp`: also pipeline degrees (`pp_choices`) and the schedules 1f1b and gpipe (gpipe where
    the micro-batches are fewer than pp), for a recipe whose plan does not fit without
    (`needs_pipeline_parallel`); a degree is tried only where the same candidate at pp 1 does
    not fit.

    `cp`: also context parallel's degrees (`cp_choices`), for a recipe whose plan does not fit
    without (`needs_context_parallel`); like the other memory knobs, a degree is tried only
    where the same candidate at cp 1 does not fit.

    compile is searched on accelerators only (a CPU's inductor build costs more than short trials
    can win back); hybrid sharding only across several nodes; expert parallel's degrees
    (`ep_choices`) for a model with experts. The space follows the recipe: a
    value that `refused` says the recipe refuses whatever the other knobs (under parallel.tp:
    fsdp1, the chunked loss, CPU offload) is left out, its refusal put in `left_out` by
    KEY=VALUE."""
    shardings = ["full", "grad_op"] + (["hybrid", "hybrid_zero2"] if cfg.launch.nnodes > 1 else [])
    nnodes = cfg.launch.nnodes
    # Hybrid's shard groups: one node (null), or several nodes' (fewer replicas), counted as
    # fsdp.shard_group_size counts them: in data-parallel ranks (a node's over its cp x tp).
    per_node = max(cfg.launch.nproc_per_node // _fitting(cfg).row_group, 1)
    groups = ["null", *(str(per_node * k) for k in range(2, nnodes) if nnodes % k == 0)]
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
        space.append(("precision.float8_all_gather", ["auto", "true", "false"]))
    if cp and len(degrees := cp_choices(cfg)) > 1:
        space.append(("parallel.cp", degrees))
    if pp and len(degrees := pp_choices(cfg)) > 1:
        space += [("parallel.pp", degrees), ("parallel.pp_schedule", ["1f1b", "gpipe"])]
    if len(degrees := ep_choices(cfg)) > 1:  # a mixture of experts: the experts' placement
        space.append(("parallel.ep", degrees))
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


def canonical(value: Any, key: str | None = None) -> str:
    """A knob value as tune compares it with the recipe's (`current_value`) of `key`: YAML's
    spellings of true, false and null (True, FALSE, ~) as one, and null as `auto` for the keys
    whose null lets fsdprun decide. Not `none`: YAML reads it as the string, which is a value of
    several knobs (fsdp.wrap, activation_checkpointing.mode, fsdp.backward_prefetch), never
    their null."""
    text = str(value).strip()
    text = {"true": "true", "false": "false", "null": "null", "~": "null"}.get(text.lower(), text)
    return AUTO if text == "null" and key in auto_keys() else text


def parse_space(
    items: list[str], cfg: RecipeConfig, *, accelerator: bool, allow_numerics: bool,
    refused: Refusal | None = None, left_out: dict[str, str] | None = None, cp: bool = False,
    pp: bool = False,
) -> tuple[list[SpaceKnob], bool]:  # fmt: skip
    """The space from the recipe's `tune:` section and the --space items; and whether it is the
    default one (then memory knobs are dominated: tried only where the same candidate without
    them does not fit).

    The command line wins: --space items without `defaults` are the whole space; with
    `defaults` they change only their knobs of the recipe's space, which is the default space
    (tune.defaults) with tune.space's knobs set. `refused`, `left_out`, `cp` and `pp`: see
    default_space.

    Raises:
        UserError: a key that is not a tuning knob, a numerics knob without --allow-numerics,
            an item without values or with a value its key refuses, or an empty space.
    """
    replace = bool(items) and "defaults" not in items
    defaults = not replace and cfg.tune.defaults
    knobs: dict[str, SpaceKnob] = {}
    if defaults:
        space = default_space(cfg, accelerator=accelerator, refused=refused, left_out=left_out,
                              cp=cp, pp=pp)  # fmt: skip
        knobs = {k.key: k for k in space}
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
        vals = [canonical(v, key) for v in vals]
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
    # What a finished trial measured (`measured_peaks`), where `measured`: its peak per rank,
    # or None where it ran out of memory.
    measured_peak_bytes: int | None = None
    measured: bool = False

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
# Pruning with the plan, and with what trials measured


def measured_peaks(records: list[dict[str, Any]]) -> dict[str, int | None]:
    """Each candidate's peak per rank as its finished trials measured it, where it compares with
    the device memory: an accelerator's peak allocated (the largest of its trials), or None for
    a candidate that ran out of memory. Not a CPU's RSS, which also holds the torch runtime
    that the device memory given for a CPU does not count: there the plan stays the judge."""
    out: dict[str, int | None] = {}
    for r in records:
        cid = r["candidate"]
        if r.get("status") == "oom":
            out[cid] = None
        elif (
            r.get("status") == "ok"
            and r.get("memory_kind") == "allocated"
            and (cid not in out or out[cid] is not None)
        ):
            out[cid] = max(out.get(cid) or 0, r["peak_bytes"])
    return out


def _planned(cfg: RecipeConfig) -> tuple[int, int, list[str]]:
    """Planned peak bytes per device, model state bytes, and the keys the knob table says do
    nothing, for one resolved candidate."""
    from fsdprun.engines import translate
    from fsdprun.tools.plan import plan_memory

    plan = plan_memory(cfg)
    s = dataclasses.asdict(plan.strategies[plan.recipe_strategy])
    if plan.pipeline is not None:  # the largest pipeline rank's (the strategies are rank 0's)
        s = max((r["memory"] for r in plan.pipeline["ranks"]), key=lambda m: m["total"])
    sharded = s["params"] + s["grads"] + s["optimizer"]
    state = sharded + s["accumulation"]
    # CPU offload keeps the shards, gradients and optimizer state in host memory: the plan counts
    # them on the device, the device holds only the gathered buffers and activations.
    peak = s["total"] - sharded if cfg.fsdp.cpu_offload else s["total"]
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
    measured: dict[str, int | None] | None = None,
) -> None:
    """Mark candidates pruned, each with one reason (in place); the baseline is never pruned
    (it is the reference: one that does not fit is reported, not dropped).

    A candidate's peak is the plan's until a trial measured it (`measured`, from
    `measured_peaks` of a continued search's log): then the measurement decides whether it
    fits, and whether it spares its twins their memory knobs (a plan that undercounts, as the
    ring's once did, cannot keep them out after its trial said otherwise).

    Candidates are visited by their number of changed knobs, so a candidate's twin with one knob
    back at the baseline's (or free) value is decided first: a candidate that the twin's knob
    table makes a duplicate, or that a fitting twin makes unnecessary, is pruned without
    resolving its recipe (resolving costs a tenth of a second; the default space has hundreds)."""
    planner = planner or _planned
    by_knobs = {tuple(sorted(c.knobs.items())): c for c in candidates}
    inert_of: dict[str, list[str]] = {}
    engine_of: dict[str, str] = {}
    base = candidates[0]

    def twin_of(c: Candidate, key: str, value: str) -> Candidate | None:
        twin = by_knobs.get(tuple(sorted(dict(c.knobs, **{key: value}).items())))
        return twin if twin is not c else None

    measured = measured or {}
    for c in candidates:
        if c.id in measured:
            c.measured, c.measured_peak_bytes = True, measured[c.id]

    def fits(c: Candidate | None) -> bool:
        peak = None if c is None else c.measured_peak_bytes if c.measured else c.planned_peak_bytes
        return peak is not None and peak * (1 + margin) <= device_memory_bytes

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
                how = " (its trial measured it)" if twin.measured else ""
                c.reason = f"{names} not needed: {twin.id} (without) fits{how}"
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
            planned, memory = fmt_bytes(c.planned_peak_bytes), fmt_bytes(device_memory_bytes)
            if not c.measured:
                c.reason = f"planned peak {planned} + {margin:.0%} margin > device memory {memory}"
                c.group = f"planned peak + {margin:.0%} margin > device memory"
            elif c.measured_peak_bytes is None:
                c.reason = f"its trial ran out of memory (planned peak {planned}, device memory " \
                           f"{memory})"  # fmt: skip
                c.group = "its trial ran out of memory"
            else:
                c.reason = (f"measured peak {fmt_bytes(c.measured_peak_bytes)} (its trial; the "
                            f"plan said {planned}) + {margin:.0%} margin > device memory "
                            f"{memory}")  # fmt: skip
                c.group = f"measured peak + {margin:.0%} margin > device memory"


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
