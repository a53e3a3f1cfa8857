"""The output of `fsdprun tune`: the space and pruning printed before the trials, the report (its
JSON document: every candidate's figures beside its plan, the verdict, the confirmation's
measured ratio), tuned.yaml (the winning knobs as a layer over the user's recipe) and the table
`render` prints.

Never imports the nodes' protocol nor runs a trial: it reads the trial log's records (of
trials.py only the wording and the loss check's length it prints).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fsdprun.errors import write_error
from fsdprun.fmt import fmt_bytes
from fsdprun.report.metrics import percentile
from fsdprun.tools.tune.search import (
    Confirmation,
    Selection,
    confirm_round,
    confirm_skipped,
    confirmation_of,
    pairs_text,
    pareto_front,
    select,
)
from fsdprun.tools.tune.space import space_sources
from fsdprun.tools.tune.trials import CONTINUES, LOSS_STEPS

if TYPE_CHECKING:
    from rich.console import Console

    from fsdprun.config import RecipeConfig
    from fsdprun.tools.tune.args import TuneArgs
    from fsdprun.tools.tune.space import Candidate


MODEL_STATE_RTOL = 0.05  # plan's stated agreement with measured model state (test_memory_contract)
TUNED_FILE = "tuned.yaml"


# ---------------------------------------------------------------------------------------------
# The tuned layer


def tuned_layer(
    recipe_ref: str, overrides: list[str], winner: Candidate, *, config: RecipeConfig,
    verdict: str, hardware: str, command: str, measured: str | None = None,
) -> str:  # fmt: skip
    """tuned.yaml: extends the user's recipe and sets only the winning knobs (plus the user's own
    command-line overrides, which are part of the recipe that was tuned; `config` is that
    recipe resolved, whose paths the layer writes). Its header: the command that trains it, the
    hardware, the verdict and `measured` (the confirmation's line)."""
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
        *([f"# {measured[0].upper()}{measured[1:]}."] if measured else []),
        "# This layer sets only the winning knobs"
        + (" (and the command line's overrides of the tuned recipe)." if overrides else "."),
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(tree, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# The space printed, the report


def print_space(
    say, space, candidates, order, memory, memory_source, args, warmup, rtol, cfg, left_out
):  # fmt: skip
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
    confirm = (f"then {pairs_text(args.confirm)} of the winner and the starting recipe measure "
               "its gain (--confirm)")  # fmt: skip
    say(confirm if args.confirm else "then no confirmation (--confirm 0)")


def tune_report(args, resolved, cfg, candidates, records, memory, memory_source, stop, started,
                rtol, *, confirmations=(), confirm_stop=None) -> dict[str, Any]:  # fmt: skip
    sel = select(records)
    skipped = confirm_skipped(sel, args.confirm)
    conf = None if skipped else confirmation_of(
        list(confirmations), sel, pairs=args.confirm, stopped=confirm_stop,
        measured_steps=confirm_round(sel, args.steps, args.confirm).measured_steps,
    )  # fmt: skip
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
    labels = {c.id: c.label for c in candidates}
    holds = conf is None or conf.holds
    winner = by_id[sel.winner if holds else candidates[0].id]
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
        "num_trials": len(records), "num_confirm_trials": len(confirmations),
        "winner": winner.id, "winner_label": winner.label, "winner_overrides": winner.overrides,
        "gain": sel.gain if sel.beats_noise and holds else 0.0, "best_gain": sel.gain,
        "noise": sel.noise, "beats_noise": sel.beats_noise,
        "verdict": sel.verdict if holds else _not_kept(sel, conf, labels),
        "passed_over": sel.passed_over,
        "measured_ratio": conf.ratio if conf else None,
        "confirmation": _confirmation_doc(conf, skipped, labels),
        "tuned_yaml": str(tuned), "command": command,
        "pareto": pareto_front(points),
        "candidates": rows,
    }  # fmt: skip


def _not_kept(sel: Selection, conf: Confirmation, labels: dict[str, str]) -> str:
    """The verdict where the confirmation overturns the search's winner."""
    said = (f"{sel.winner} ({labels[sel.winner]}) beat the starting recipe by {sel.gain:+.1%} in "
            "the search, but ")  # fmt: skip
    if conf.failed:
        return said + (f"its confirmation trial {conf.failed} did not end well: the starting "
                       "recipe stays")  # fmt: skip
    return said + (f"measured {conf.ratio:.2f}x it after the search ({_of_pairs(conf)}): the "
                   "starting recipe stays")  # fmt: skip


def _of_pairs(conf: Confirmation, *, spread: bool = False) -> str:
    """Which pairs a measured ratio is of: "median of 3 interleaved pairs" (with their range)."""
    if len(conf.pairs) == 1:
        return "one interleaved pair"
    return f"median of {pairs_text(len(conf.pairs))}" + (
        f", {conf.low:.2f}x to {conf.high:.2f}x" if spread else "")  # fmt: skip


def _confirmation_doc(
    conf: Confirmation | None, skipped: str | None, labels: dict[str, str]
) -> dict[str, Any]:
    """The report's `confirmation`: its figures and the line printed and written into
    tuned.yaml's header."""
    if conf is None:
        return {"skipped": skipped, "line": f"no confirmation: {skipped}"}
    who = f"{conf.winner} ({labels[conf.winner]})"
    if conf.ratio is None:
        why = conf.failed or conf.stopped or "no pair of trials completed"
        line = f"not confirmed: {who} measured against the starting recipe in no pair ({why})"
    else:
        verb = "confirmed" if conf.holds else "not confirmed"
        line = (f"{verb}: {who} measured {conf.ratio:.2f}x the starting recipe's tokens/s after "
                f"the search ({_of_pairs(conf, spread=True)}); the search's figure "
                f"{conf.predicted:.2f}x")  # fmt: skip
        if len(conf.pairs) < conf.pairs_asked:
            why = conf.failed or conf.stopped or "the other pairs' trials failed"
            line += f"; {len(conf.pairs)} of {conf.pairs_asked} pairs ({why})"
    return {"skipped": None, **dataclasses.asdict(conf), "line": line}


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


def write_tuned(
    args: TuneArgs, report: dict[str, Any], candidates: list[Candidate], cfg: RecipeConfig
) -> None:
    winner = next(c for c in candidates if c.id == report["winner"])
    verdict = report["verdict"]
    if report["stopped_early"]:
        verdict += f" ({report['stopped_early']})"
    text = tuned_layer(report["recipe_ref"], args.overrides, winner, config=cfg, verdict=verdict,
                       hardware=report["hardware"], command=report["command"],
                       measured=report["confirmation"]["line"])  # fmt: skip
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

    def pair(measured: int | None, planned: int | None) -> str:
        return (fmt_bytes(measured) if measured else "-") + "\n/ " + (
            fmt_bytes(planned) if planned else "-"
        )  # fmt: skip

    kind = next((r["memory_kind"] for r in report["candidates"] if r.get("memory_kind")), "")
    confirmed = report.get("num_confirm_trials")
    table = Table(title=f"fsdprun tune {report['recipe']}: {report['hardware']}, "
                  f"{report['num_trials']} trials"
                  + (f" and {confirmed} confirming" if confirmed else "")
                  + f" in {report['elapsed_s']:.0f} s")  # fmt: skip
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
    console.print(report["confirmation"]["line"])
    node = report.get("node_rank", 0)
    who = "wrote" if node == 0 else f"node 0 wrote (on its machine; --out holds node-{node}/ here)"
    console.print(f"{who} {report['tuned_yaml']}; train it with:\n  {report['command']}")
    if report.get("nnodes", 1) > 1:
        console.print(f"  (on every node, each with its own --node-rank; {TUNED_FILE} and the "
                      "recipe at the same path there)")  # fmt: skip
