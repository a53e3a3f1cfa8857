"""`fsdprun plot RUN_DIR [RUN_DIR ...]`: a run's curves as one PNG, several runs overlaid.

    fsdprun plot runs/debug-20261130-120000                 # -> RUN_DIR/plot.png
    fsdprun plot runs/fsdp1 runs/fsdp2 --out engines.png    # one colour per run, with a legend

Six panels from each run's metrics file alone (no torch): loss against step (train, and val
where evaluated), loss against tokens seen, learning rate, grad norm, tokens/s, and the peak
memory of each rank (the last summary's ranks; from the step events, rank 0 only, while a run
has no summary); a seventh for a mixture of experts: the load balance at each logged step (the
busiest expert's tokens over the mean of its layer, in the least balanced layer; with expert
parallel the busiest rank's too). A step logged twice (a resume from an older checkpoint)
counts with its latest record; dotted lines mark where a session resumed or restarted. A run
whose last session failed (it ended without a summary, and nothing holds its lock) is named in a
red title line and its legend entries. matplotlib is an optional extra (`pip install
'fsdprun[plot]'`).

The pictures of `fsdprun compare --plot` (compare_figure) and `fsdprun plan --plot`
(plan_figure) are drawn here too, from those commands' JSON documents.

Never imports torch, the engines nor the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdprun.errors import UserError
from fsdprun.report.metrics import integer, number, read_metrics, run_state
from fsdprun.rundir import lock_paths, metrics_path
from fsdprun.runlock import is_locked

GIB = 2**30
FIGURE_SIZE_IN = (15.0, 8.0)
DPI = 100  # the PNG is FIGURE_SIZE_IN x DPI pixels: 1500 x 800
TITLES = (
    "loss by step", "loss by tokens seen", "learning rate", "grad norm", "tokens/s",
    "peak memory per rank",
)  # fmt: skip
EXPERT_TITLE = "expert load"  # the seventh panel, for a mixture of experts
EXPERT_LABEL = "busiest / mean tokens (least balanced layer)"
# Memory figures in order of preference: what an accelerator allocated, else the CPU's RSS.
MEMORY_KEYS = (
    ("peak_allocated_bytes", "peak allocated"), ("peak_reserved_bytes", "peak reserved"),
    ("peak_rss_bytes", "peak RSS"),
)  # fmt: skip


# The numbers a step record is drawn with; one missing, not a number, NaN or inf is a gap.
STEP_VALUES = ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen")


@dataclass
class RunCurves:
    """What the plot takes from one run's metrics file: each value a finite float or NaN (a gap
    in its curve)."""

    label: str
    steps: list[dict[str, Any]]  # {"step": int, **STEP_VALUES}, one per step, in step order
    evals: list[dict[str, Any]]  # {"step": int, "val_loss": float}
    # Where a later session began: (what, step), what = "resumed" or "restart N" (the elastic
    # agent's N-th restart of the workers), step = the checkpoint's step it continued from.
    sessions: list[tuple[str, int]] = field(default_factory=list)
    recipe: str | None = None  # the first session's start event
    run_dir: str = ""
    # "started 2026-12-02 04:00 UTC" (the start event's), else "metrics last written ..."
    started_at: str | None = None
    memory: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> memory figures
    skipped: str | None = None  # one line on what could not be read, when something could not
    state: str = "finished"  # fsdprun.report.metrics.run_state: "failed", "running", ...
    # A mixture of experts: {"step", "expert", "rank"} per logged step, the least balanced
    # layer's busiest expert (and, with ep, rank) over the mean (NaN: not logged).
    experts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.state == "failed"


class _Values:
    """Takes numbers out of records, counting those that are drawn as gaps."""

    def __init__(self):
        self.gaps = 0

    def __call__(self, record: dict[str, Any], key: str) -> float:
        value = number(record.get(key))
        if value is None or not math.isfinite(value):
            self.gaps += 1
            return math.nan
        return value


def _figures(figures: Any) -> dict[str, float]:
    """The finite numbers of a memory dict (a damaged one has none)."""
    if not isinstance(figures, dict):
        return {}
    found = {k: number(v) for k, v in figures.items()}
    return {k: v for k, v in found.items() if v is not None and math.isfinite(v)}


def read_run(run_dir: Path, label: str | None = None) -> RunCurves:
    """The curves of the run in `run_dir`. What cannot be drawn is left out and said in
    `RunCurves.skipped`: unreadable lines, step and eval records without an integer step, and
    values that are missing, not numbers, NaN or inf (drawn as gaps).

    Raises:
        UserError: not a run directory, or no step logged yet.
    """
    metrics = metrics_path(run_dir)
    if not metrics.is_file():
        raise UserError(f"{run_dir}: no metrics file ({metrics.name}); is it an fsdprun run dir?")
    read = read_metrics(metrics)
    value = _Values()
    steps, evals, bad_records = {}, {}, 0
    for e in read.events:
        if e["event"] not in ("step", "eval"):
            continue
        step = integer(e.get("step"))
        if step is None:
            bad_records += 1
        elif e["event"] == "step":
            steps[step] = e
        else:
            evals[step] = e
    if not steps:
        unusable = read.unreadable_lines + bad_records
        skipped = f" (skipped {unusable} unreadable line{'s' if unusable != 1 else ''})"
        raise UserError(
            f"{metrics}: no step logged yet; nothing to plot{skipped if unusable else ''}"
        )
    # Values are taken from the latest record of each step only: a replaced one is not drawn.
    curves = [{"step": k, **{key: value(steps[k], key) for key in STEP_VALUES}}
              for k in sorted(steps)]  # fmt: skip
    val = [{"step": k, "val_loss": value(evals[k], "val_loss")} for k in sorted(evals)]
    summaries = [e for e in read.events if e["event"] == "summary"]
    memory: dict[int, dict[str, float]] = {}
    if summaries and isinstance(summaries[-1].get("ranks"), list):
        for r in summaries[-1]["ranks"]:
            if isinstance(r, dict) and integer(r.get("rank")) is not None:
                memory[r["rank"]] = _figures(r)
    else:
        per_step = [_figures(s.get("memory")) for s in steps.values()]
        keys = {k for figures in per_step for k in figures}
        memory = {0: {k: max(f[k] for f in per_step if k in f) for k in keys}}
    skipped = []
    if read.unreadable_lines:
        n = read.unreadable_lines
        skipped.append(f"{n} unreadable line{'s' if n != 1 else ''}")
    if bad_records:
        skipped.append(f"{bad_records} record{'s' if bad_records != 1 else ''} without an "
                       "integer step")  # fmt: skip
    if value.gaps:
        skipped.append(f"{value.gaps} value{'s' if value.gaps != 1 else ''} missing, not a "
                       "number or not finite (drawn as gaps)")  # fmt: skip
    start = next((e for e in read.events if e["event"] == "start"), {})
    experts = [{"step": k, **_load(steps[k]["experts"])} for k in sorted(steps)
               if isinstance(steps[k].get("experts"), dict)]  # fmt: skip
    return RunCurves(
        label=label or run_dir.name,
        steps=curves,
        evals=val,
        sessions=[(_session_name(e), e["step"]) for e in read.events
                  if e["event"] in ("resume", "restart") and integer(e.get("step")) is not None],
        memory=memory,
        skipped=f"{metrics}: skipped " + ", ".join(skipped) if skipped else None,
        recipe=start.get("recipe") if isinstance(start.get("recipe"), str) else None,
        run_dir=str(run_dir),
        started_at=_started_at(start.get("started_at"), metrics),
        state=run_state(read.events, running=any(is_locked(p) for p in lock_paths(run_dir))),
        experts=experts,
    )  # fmt: skip


def _load(figures: dict[str, Any]) -> dict[str, float]:
    """A step's load balance (`RunCurves.experts`), NaN where a figure is not a finite number."""
    ranks = figures.get("ranks")
    found = {"expert": number(figures.get("worst_max_over_mean")),
             "rank": number(ranks.get("worst_max_over_mean")) if isinstance(ranks, dict)
             else None}  # fmt: skip
    return {k: v if v is not None and math.isfinite(v) else math.nan for k, v in found.items()}


def _session_name(event: dict[str, Any]) -> str:
    attempt = integer(event.get("attempt"))
    return f"restart {attempt}" if event["event"] == "restart" and attempt else "resumed"


def _started_at(value: Any, metrics: Path) -> str:
    """'started YYYY-MM-DD HH:MM UTC' from the start event; a run that did not record it (an
    older version) is dated by its metrics file's last write, said as such."""
    from datetime import datetime, timezone

    if isinstance(value, str):
        try:
            return (
                datetime.fromisoformat(value)
                .astimezone(timezone.utc)
                .strftime("started %Y-%m-%d %H:%M UTC")
            )
        except ValueError:
            pass
    written = datetime.fromtimestamp(metrics.stat().st_mtime, timezone.utc)
    return f"metrics last written {written:%Y-%m-%d %H:%M UTC}"


# Each panel's y label names its unit (the loss is the mean cross-entropy of the trained
# targets, in nats; the learning rate is a plain number; the grad norm is the global L2 norm of
# all gradients, which clip_grad_norm_ returns before it clips).
LOSS_LABEL = "loss (cross-entropy, nats/token)"
Y_LABELS = (
    LOSS_LABEL, LOSS_LABEL, "learning rate (no unit)", "grad norm (global L2, before clipping)",
    "tokens/s (all ranks)",
)  # fmt: skip


def figure_title(runs: list[RunCurves]) -> str:
    """What the figure shows: the recipe(s), the run folder(s) and when they started; then, on a
    line of its own, the runs whose last session failed and the last step each logged."""
    recipes = list(dict.fromkeys(r.recipe or "recipe unknown" for r in runs))
    if len(runs) == 1:
        run = runs[0]
        title = f"fsdprun {recipes[0]}: {run.run_dir} ({run.started_at})"
    else:
        days = (r.started_at.split()[-3] if r.started_at else "date unknown" for r in runs)
        dates = list(dict.fromkeys(days))
        title = (f"fsdprun {' vs '.join(recipes)}: {len(runs)} runs, "
                 f"{', '.join(r.run_dir for r in runs)} ({', '.join(dates)})")  # fmt: skip
    failed = [r for r in runs if r.failed]
    if not failed:
        return title
    # The last step logged, not the one that failed: output.log_every may leave steps out.
    what = ", ".join(f"{r.label} after logged step {r.steps[-1]['step']}" for r in failed)
    logs = f"{runs[0].run_dir}/logs" if len(runs) == 1 else "RUN_DIR/logs"
    return (f"{title}\nFAILED: {what} (the last session ended without a summary: an error or a "
            f"kill; see {logs})")  # fmt: skip


def build_figure(runs: list[RunCurves]):
    """One matplotlib Figure with the six panels of TITLES, the runs overlaid: a title naming
    the recipe, run folder(s) and date, a y label with its unit on every panel, integer step
    ticks, resumes and restarts as named dotted lines, and a legend on each panel that holds
    more than one line (or more than one run's bars)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise UserError("fsdprun plot needs matplotlib: pip install 'fsdprun[plot]'") from e

    # A Figure made without pyplot: no GUI backend, no global state; savefig renders with Agg.
    fig = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
    fig.suptitle(figure_title(runs), color="red" if any(r.failed for r in runs) else None)
    moe = any(run.experts for run in runs)
    grid = fig.subplots(2, 4 if moe else 3)
    # Row by row: the six panels, then the expert load under the first row's end.
    axes = [*grid[0][:3], *grid[1][:3]]
    by_step, by_tokens, lr, norm, speed, mem = axes
    if moe:
        load = grid[0][3]
        grid[1][3].set_axis_off()
        _expert_load(load, runs)
    for ax, title in zip(axes, TITLES, strict=True):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    for ax, ylabel in zip(axes, Y_LABELS, strict=False):
        ax.set_ylabel(ylabel)
    step_axes = (by_step, lr, norm, speed)
    for ax in step_axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # no 2.5
    by_tokens.set_xlabel("tokens seen")
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors, strict=True):
        # Several runs are told apart by their label; a single run needs none on its curves.
        name = f"{_legend_label(run)} " if len(runs) > 1 else ""
        x = [s["step"] for s in run.steps]
        by_step.plot(x, [s["loss"] for s in run.steps], color=color, label=f"{name}train")
        if run.evals:
            val_x = [e["step"] for e in run.evals]
            by_step.plot(val_x, [e["val_loss"] for e in run.evals], color=color, ls="--",
                         marker="o", ms=3, label=f"{name}val")  # fmt: skip
        tokens = [s["tokens_seen"] for s in run.steps]
        by_tokens.plot(tokens, [s["loss"] for s in run.steps], color=color,
                       label=f"{name}train")  # fmt: skip
        for ax, key, what in ((lr, "lr", "learning rate"), (norm, "grad_norm", "grad norm"),
                              (speed, "tokens_per_s", "tokens/s")):  # fmt: skip
            ax.plot(x, [s[key] for s in run.steps], color=color, label=name.strip() or what)
        for what, step in run.sessions:
            for ax in step_axes:
                ax.axvline(step, color=color, ls=":" if what == "resumed" else "-.", lw=1.2,
                           label=f"{name}{what} at step {step}")  # fmt: skip
            # Named on the loss panel itself too, beside its line.
            by_step.annotate(f" {name}{what}", (step, 1.0), xycoords=("data", "axes fraction"),
                             rotation=90, va="top", ha="left", fontsize="small",
                             color=color)  # fmt: skip
    _memory_bars(mem, runs, colors)
    for ax in axes:
        drawn = [h for h in ax.get_legend_handles_labels()[1] if not h.startswith("_")]
        if len(drawn) > 1 and ax is mem:
            # Beside the panel: its bars fill it from side to side, so a legend inside covers
            # some rank's bars wherever it goes. Constrained layout makes room for it.
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      borderaxespad=0)  # fmt: skip
        elif len(drawn) > 1:
            ax.legend(fontsize="small")
    return fig


def _expert_load(ax, runs: list[RunCurves]) -> None:
    """The load balance of each run with experts: busiest expert over the mean (solid), with
    expert parallel the busiest rank's (dashed); 1 is perfectly balanced."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(EXPERT_TITLE)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    ax.set_ylabel(EXPERT_LABEL)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.axhline(1.0, color="grey", lw=0.8)
    for i, run in enumerate(runs):
        if not run.experts:
            continue
        name = f"{_legend_label(run)} " if len(runs) > 1 else ""
        x = [s["step"] for s in run.experts]
        ax.plot(x, [s["expert"] for s in run.experts], color=f"C{i % 10}",
                label=f"{name}experts")  # fmt: skip
        if any(not math.isnan(s["rank"]) for s in run.experts):
            ax.plot(x, [s["rank"] for s in run.experts], color=f"C{i % 10}", ls="--",
                    label=f"{name}ep ranks")  # fmt: skip
    if len(ax.get_legend_handles_labels()[1]) > 1:
        ax.legend(fontsize="small")


def _legend_label(run: RunCurves) -> str:
    return f"{run.label} (failed)" if run.failed else run.label


def _memory_bars(ax, runs: list[RunCurves], colors: list[str]) -> None:
    """Grouped bars: one group per rank, one bar per run."""
    present = {k for run in runs for figures in run.memory.values() for k in figures}
    key, what = next(((k, w) for k, w in MEMORY_KEYS if k in present), MEMORY_KEYS[-1])
    width = 0.8 / len(runs)
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        ranks = sorted(r for r, figures in run.memory.items() if figures.get(key) is not None)
        ax.bar([r + (i - (len(runs) - 1) / 2) * width for r in ranks],
               [run.memory[r][key] / GIB for r in ranks], width=width, color=color,
               label=_legend_label(run))  # fmt: skip
    ax.set_xlabel("rank")
    ax.set_ylabel(f"{what} (GiB)")
    ax.xaxis.get_major_locator().set_params(integer=True)


def plot_runs(run_dirs: list[Path], out: Path, *, note: Callable[[str], None] | None = None):
    """Draw the runs in `run_dirs` into the PNG `out`; returns the Figure. `note` is given one
    line per run whose metrics file had something that could not be drawn.

    Raises:
        UserError: a run directory without metrics, `out` not a .png in an existing folder, or
            matplotlib not installed.
    """
    names = [d.name for d in run_dirs]
    # Runs of the same name (runs/a/run and runs/b/run) are told apart by their whole path.
    labels = [d.name if names.count(d.name) == 1 else str(d) for d in run_dirs]
    runs = [read_run(d, label) for d, label in zip(run_dirs, labels, strict=True)]
    check_png_target(out, "--out")
    for run in runs:
        if run.skipped and note is not None:
            note(run.skipped)
    fig = build_figure(runs)
    fig.savefig(out, dpi=DPI)
    return fig


def check_png_target(out: Path, flag: str) -> None:
    """Refuse a picture path that cannot be written, before any work is done for it.

    Raises:
        UserError: `out` not a .png, a folder, or in a folder that does not exist; or
            matplotlib not installed.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(f"{flag} needs matplotlib: pip install 'fsdprun[plot]'")
    if out.suffix.lower() != ".png":
        raise UserError(f"{flag} {out}: the picture is a PNG; give a file name ending in .png")
    if not out.parent.is_dir():
        raise UserError(f"{flag} {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise UserError(f"{flag} {out}: is a folder; give a file name ending in .png")


def _figure(size_in: tuple[float, float], what: str):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise UserError(f"{what} needs matplotlib: pip install 'fsdprun[plot]'") from e
    return Figure(figsize=size_in, dpi=DPI, layout="constrained")


# `fsdprun compare --plot`: the side-by-side table's rows as bars, one bar per configuration.
COMPARE_SIZE_IN = (15.0, 9.0)  # 1500 x 900 pixels
# (title, result key, y label, how a bar is compared with the first configuration's). Speed on
# the first row (and the final loss: a configuration must learn the same), memory on the second.
COMPARE_PANELS = (
    ("tokens/s", "tokens_per_s", "tokens/s (all ranks)", "ratio"),
    ("step time", "step_time_p50_s", "ms per step (median)", "ratio"),
    ("final loss", "final_loss", "loss (cross-entropy, nats/token)", "difference"),
    ("peak memory per rank", "peak_memory_bytes", "max over ranks", "ratio"),
    ("model state per rank", "model_state_bytes", "max over ranks", "ratio"),
)
BYTE_UNITS = (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit whose numbers for values up to `largest` read best (a 70B model in GiB, the
    debug model in MiB or KiB): the largest unit that `largest` holds at least once."""
    return next(((name, size) for name, size in BYTE_UNITS if largest >= size), BYTE_UNITS[-1])


def _bar_text(value: float, base: float | None, *, key: str, scaled: float, how: str) -> str:
    if key == "final_loss":
        text = f"{value:.4f}"
    elif key == "step_time_p50_s":
        text = f"{scaled:,.1f} ms"
    else:
        text = f"{scaled:,.0f}" if key == "tokens_per_s" else f"{scaled:,.4g}"
    if base is None:
        return text
    if how == "difference":
        return f"{text}\n{round(value - base, 4) or 0.0:+.4f}"  # never "-0.0000"
    return f"{text}\n{value / base:.2f}x" if base else text


def compare_figure(report: dict[str, Any]):
    """The bars of a `compare` report (its JSON document): one panel per row of COMPARE_PANELS
    (tokens/s, step time and final loss above, memory below), each bar labelled with its value
    and, as in the table, its ratio to the first configuration that ran (the final loss: its
    difference); a configuration that failed keeps its place, marked "failed"."""
    fig = _figure(COMPARE_SIZE_IN, "fsdprun compare --plot")
    results = report["results"]
    base = next((r for r in results if r["ok"]), None)
    kind = base["memory_kind"] if base else None
    fig.suptitle(f"fsdprun compare {report['recipe']} (world size {report['world_size']}, "
                 f"{report['steps']} steps)")  # fmt: skip
    labels = [r["label"] for r in results]
    grid = fig.add_gridspec(2, 6)
    slots = [grid[0, 0:2], grid[0, 2:4], grid[0, 4:6], grid[1, 0:3], grid[1, 3:6]]
    for slot, (title, key, ylabel, how) in zip(slots, COMPARE_PANELS, strict=True):
        ax = fig.add_subplot(slot)
        unit = 1e-3 if key == "step_time_p50_s" else 1
        if key.endswith("_bytes"):
            name, unit = byte_unit(max((r[key] for r in results if r["ok"]), default=0))
            if key == "peak_memory_bytes" and kind:
                title, ylabel = f"peak {kind} per rank", f"peak {kind}, {ylabel}"
            ylabel = f"{name} ({ylabel})"
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ok = [r["ok"] and r.get(key) is not None for r in results]
        heights = [r[key] / unit if good else 0.0 for r, good in zip(results, ok, strict=True)]
        bars = ax.bar(labels, heights, color=[f"C{i % 10}" for i in range(len(results))])
        texts = [
            _bar_text(r[key], None if r is base else base[key], key=key, scaled=h, how=how)
            if good else "failed"
            for r, h, good in zip(results, heights, ok, strict=True)
        ]  # fmt: skip
        ax.bar_label(bars, texts, fontsize="small")
        ax.margins(y=0.2)  # room for the labels above the tallest bar
        ax.tick_params(axis="x", labelrotation=30 if len(results) > 3 else 0)
    return fig


# `fsdprun plan --plot`: per-rank memory of each strategy, stacked by component.
PLAN_SIZE_IN = (11.0, 6.0)  # 1100 x 600 pixels
PLAN_TITLE = "memory per rank by strategy"
PLAN_COMPONENTS = (
    ("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
    ("accumulation", "unsharded grads"), ("gathered_buffers", "gathered buffers"),
    ("activations", "activations"),
)  # fmt: skip


# Bars up to this many times the reference (the device memory, else the recipe strategy's total)
# set the height of the axes; a taller one (ddp's full replica of a large model) is cut at the top
# edge with its total written there, so it does not flatten the bars that matter.
PLAN_CLIP_FACTOR = 4.0


def device_memory_label(plan: dict[str, Any], unit_name: str, unit: int) -> str:
    """'device memory 80GB = 74.5 GiB': the size as the user gave it, and in the axis' unit."""
    device = plan["device_memory_bytes"]
    given = plan.get("device_memory_text") or f"{device / 1e9:g}GB"
    in_unit = f"{device / unit:,.1f} {unit_name}"
    same_unit = given.upper().rstrip().endswith(unit_name.upper())  # 24GiB on a GiB axis
    return f"device memory {given}" + ("" if same_unit else f" = {in_unit}")


def plan_figure(plan: dict[str, Any]):
    """Stacked bars of a `plan` document (MemoryPlan.to_dict()): one bar per strategy, one
    segment per component of PLAN_COMPONENTS (in the unit of byte_unit), each bar topped by its
    total, the recipe's own strategy outlined and named under its bar. The device memory, when
    known, is a horizontal line labelled as given (80GB) and in the axis' unit (74.5 GiB), with
    a right-hand axis in percent of it. A bar more than PLAN_CLIP_FACTOR times the device memory
    (or the recipe strategy's total) is cut at the top, its total written there."""
    fig = _figure(PLAN_SIZE_IN, "fsdprun plan --plot")
    ax = fig.subplots()
    ax.set_title(f"{PLAN_TITLE}: {plan['recipe']}, {plan['world_size']} ranks "
                 f"({plan['nnodes']} x {plan['nproc_per_node']})")  # fmt: skip
    names = list(plan["strategies"])
    strategies = [plan["strategies"][n] for n in names]
    totals = [s["total"] for s in strategies]
    device = plan.get("device_memory_bytes")
    reference = device or plan["strategies"][plan["recipe_strategy"]]["total"]
    shown = [t for t in totals if t <= PLAN_CLIP_FACTOR * reference]
    top_bytes = 1.12 * max([*shown, reference])
    unit_name, unit = byte_unit(top_bytes)
    top = top_bytes / unit
    ax.set_ylabel(f"{unit_name} per rank (rank 0)")
    ax.grid(True, axis="y", alpha=0.3)
    bottoms = [0.0] * len(names)
    for i, (key, label) in enumerate(PLAN_COMPONENTS):
        heights = [s.get(key, 0) / unit for s in strategies]
        if not any(heights):
            continue  # e.g. no unsharded grads kept: no empty legend entry
        ax.bar(names, heights, bottom=bottoms, label=label, color=f"C{i}")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    mine = names.index(plan["recipe_strategy"])
    ax.bar([names[mine]], [min(bottoms[mine], top)], fill=False, edgecolor="black", lw=2,
           label=f"the recipe's strategy ({plan['recipe_strategy']})")  # fmt: skip
    texts = [f"{t / unit:,.1f} {unit_name}" for t in totals]
    cut = [i for i, b in enumerate(bottoms) if b > top]
    # Zero-height bars: the labels of the totals that fit, on top of their stacks.
    marks = ax.bar(names, [0.0] * len(names), bottom=[min(b, top) for b in bottoms])
    ax.bar_label(marks, ["" if i in cut else t for i, t in enumerate(texts)], fontsize="small")
    for i in cut:
        times = f"{totals[i] / device:,.1f}x the device" if device else "off the scale"
        ax.annotate(f"\u2191 {texts[i]}\n({times})", (i, top), xytext=(0, -4),
                    textcoords="offset points", ha="center", va="top", fontsize="small",
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.5"})  # fmt: skip
    ax.set_xticks(range(len(names)), [f"{n}\n(recipe)" if i == mine else n
                                      for i, n in enumerate(names)])  # fmt: skip
    ax.get_xticklabels()[mine].set_fontweight("bold")
    if device:
        ax.axhline(device / unit, color="red", ls="--", lw=1.5,
                   label=device_memory_label(plan, unit_name, unit))  # fmt: skip
        percent = ax.secondary_yaxis(
            "right",
            functions=(lambda y: y * unit / device * 100, lambda p: p * device / unit / 100),
        )
        percent.set_ylabel("% of device memory")
    ax.set_ylim(0, top)
    # Outside the axes, top segment first as in the stack: no bar or total hidden under it.
    handles, labels = ax.get_legend_handles_labels()
    line = [i for i, h in enumerate(handles) if not hasattr(h, "patches")]
    order = line + [i for i in reversed(range(len(handles))) if i not in line]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
              bbox_to_anchor=(1.1 if device else 1.01, 1.0), fontsize="small")  # fmt: skip
    return fig


# `fsdprun tune --plot`: every measured candidate's tokens/s against its peak memory per rank.
TUNE_SIZE_IN = (9.0, 6.0)  # 900 x 600 pixels


def tune_figure(report: dict[str, Any]):
    """A `tune` report (its JSON document) as points of tokens/s against peak memory per rank,
    each labelled with its candidate; the Pareto front (report["pareto"]: no candidate has both
    less memory and more tokens/s) joined by a line, the winner circled."""
    fig = _figure(TUNE_SIZE_IN, "fsdprun tune --plot")
    ax = fig.subplots()
    rows = [r for r in report["candidates"] if r.get("peak_bytes") and r.get("tokens_per_s")]
    kind = rows[0]["memory_kind"] if rows else "memory"
    unit_name, unit = byte_unit(max((r["peak_bytes"] for r in rows), default=0))
    ax.set_title(f"fsdprun tune {report['recipe']}: {report['hardware']}")
    ax.set_xlabel(f"peak {kind} per rank ({unit_name}, max over ranks)")
    ax.set_ylabel("tokens/s (median, all ranks)")
    ax.grid(True, alpha=0.3)
    front = set(report["pareto"])
    for r in rows:
        x, y = r["peak_bytes"] / unit, r["tokens_per_s"]
        on_front = r["candidate"] in front
        ax.scatter([x], [y], color="C3" if on_front else "C0", zorder=3)
        if r["candidate"] == report["winner"]:
            ax.scatter([x], [y], s=300, facecolors="none", edgecolors="C2", zorder=4)
        ax.annotate(f"{r['candidate']} {r['label']}", (x, y), textcoords="offset points",
                    xytext=(5, 5), fontsize="small")  # fmt: skip
    pts = sorted((r["peak_bytes"] / unit, r["tokens_per_s"]) for r in rows
                 if r["candidate"] in front)  # fmt: skip
    if pts:
        ax.plot(*zip(*pts, strict=True), color="C3", label="Pareto front", zorder=2)
        ax.legend(loc="lower right")
    return fig
