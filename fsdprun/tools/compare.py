"""`fsdprun compare`: the same recipe (same seed, same data) under several engines and sharding
strategies, one after another, in one side-by-side table.

    fsdprun compare debug --configs ddp,fsdp1,fsdp2,fsdp2:grad_op --steps 10
    fsdprun compare debug --configs fsdp2,fsdp2:full:tp2,fsdp2:pp2 --nproc-per-node 4 --steps 10

Each configuration is an ordinary `fsdprun train` run in its own process and run directory
(COMPARE_DIR/<label>/), so one configuration's memory cannot leak into the next one's figures
and one that fails (out of memory, a bad knob) shows its error in its column while the others
still run. Figures come from each run's metrics.jsonl summary.

Each run dies with compare: a kill -9 of compare takes its current `fsdprun train` with it
(PR_SET_PDEATHSIG, Linux), and that run's workers die with their launcher in turn. SIGTERM or
SIGINT to compare is forwarded to the current run, which stops at a checkpoint as `fsdprun train`
does; compare then runs no further configuration and exits 128 + signal (a second signal aborts
the run at once). The runs have their own process group, so a terminal's Ctrl-C reaches them
once, through compare.

Never imports torch: each configuration runs as an `fsdprun train` subprocess.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdprun.children import ForwardSignals
from fsdprun.config import Engine, Sharding, load_recipe
from fsdprun.data import forget_data
from fsdprun.data.preflight import check_data
from fsdprun.errors import UserError
from fsdprun.report.metrics import read_events
from fsdprun.rundir import LOCK_FILE, compare_log_path, metrics_path
from fsdprun.runlock import hold_run_dir

if TYPE_CHECKING:
    from rich.console import Console


@dataclass(frozen=True)
class CompareConfig:
    label: str  # as given: "ddp", "fsdp2:grad_op", "fsdp2:full:tp2"
    overrides: tuple[str, ...]


def parse_configs(text: str) -> list[CompareConfig]:
    """'ddp,fsdp1,fsdp2:grad_op,fsdp2:full:tp2,fsdp2:cp2,fsdp2:pp2,fsdp2:ep2' -> configurations
    (engine[:sharding][:tpN][:cpN][:ppN][:epN], comma-separated; tpN sets parallel.tp=N, cpN
    parallel.cp=N, ppN parallel.pp=N, epN parallel.ep=N).

    Raises:
        UserError: an unknown engine, sharding or part, a sharding given to ddp, tensor,
            context or expert parallel with another engine than fsdp2, or a repeat.
    """
    engines = [e.value for e in Engine]
    shardings = [s.value for s in Sharding]
    configs: list[CompareConfig] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        engine, *parts = item.split(":")
        degrees = {kind: [p for p in parts if re.fullmatch(rf"{kind}[1-9]\d*", p)]
                   for kind in ("tp", "cp", "pp", "ep")}  # fmt: skip
        rest = [p for p in parts if not any(p in found for found in degrees.values())]
        if any(len(found) > 1 for found in degrees.values()) or len(rest) > 1:
            raise UserError(
                f"--configs: '{item}': use engine[:sharding][:tpN][:cpN][:ppN][:epN], e.g. "
                "fsdp2:full:tp2"
            )
        sharding = rest[0] if rest else ""
        if engine not in engines:
            raise UserError(
                f"--configs: '{item}': unknown engine '{engine}'; use {', '.join(engines)} "
                "(optionally engine:sharding)"
            )
        overrides = [f"fsdp.engine={engine}"]
        if sharding:
            if engine == Engine.ddp.value:
                raise UserError(f"--configs: '{item}': ddp has no sharding strategies")
            if sharding not in shardings:
                raise UserError(
                    f"--configs: '{item}': unknown sharding '{sharding}'; use "
                    f"{', '.join(shardings)}"
                )
            overrides.append(f"fsdp.sharding={sharding}")
        for kind, what in (("tp", "tensor"), ("cp", "context"), ("pp", "pipeline"),
                           ("ep", "expert")):  # fmt: skip
            if not degrees[kind]:
                continue
            if engine != Engine.fsdp2.value:
                raise UserError(
                    f"--configs: '{item}': {what} parallel (parallel.{kind}) needs fsdp2; use "
                    f"fsdp2:{':'.join(parts)}"
                )
            overrides.append(f"parallel.{kind}={degrees[kind][0][2:]}")
        if any(c.label == item for c in configs):
            raise UserError(f"--configs: '{item}' is listed twice")
        configs.append(CompareConfig(item, tuple(overrides)))
    if not configs:
        raise UserError("--configs is empty; e.g. --configs ddp,fsdp1,fsdp2")
    return configs


@dataclass
class CompareResult:
    label: str
    overrides: list[str]
    run_dir: str
    ok: bool
    error: str | None = None
    wall_s: float = 0.0
    tokens_per_s: float | None = None
    step_time_p50_s: float | None = None
    peak_memory_bytes: int | None = None  # max over ranks
    memory_kind: str | None = None  # "allocated" (GPU) or "RSS" (CPU)
    model_state_bytes: int | None = None  # max over ranks
    final_loss: float | None = None
    mfu: float | None = None
    losses: list[float] = field(default_factory=list)


def error_line(text: str) -> str:
    """The one line `fsdprun train` printed to say why it failed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.lower().startswith("error:"):
            return line[len("error:") :].strip()
    return lines[-1] if lines else "failed without output"


def _fsdprun_command() -> list[str]:
    return [sys.executable, "-m", "fsdprun"]


class Interrupted(Exception):
    """SIGTERM/SIGINT stopped compare (forwarded to the run in progress); one line, and the exit
    code 128 + signal."""

    def __init__(self, message: str, *, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def run_config(
    recipe: str,
    overrides: list[str],
    config: CompareConfig,
    run_dir: Path,
    runs: ForwardSignals | None = None,
) -> CompareResult:
    """One `fsdprun train` run of `config`; its figures, or its error."""
    all_overrides = [*overrides, *config.overrides]
    cmd = [*_fsdprun_command(), "train", recipe, *all_overrides, "--run-dir", str(run_dir)]
    start = time.perf_counter()
    proc = (runs or ForwardSignals()).run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
        # Its own process group: a terminal's Ctrl-C reaches it once, forwarded by compare.
        process_group=0,
    )  # fmt: skip
    wall = time.perf_counter() - start
    run_dir.mkdir(parents=True, exist_ok=True)
    compare_log_path(run_dir).write_text(proc.stdout + proc.stderr)
    result = CompareResult(config.label, all_overrides, str(run_dir), ok=False, wall_s=wall)
    metrics = metrics_path(run_dir)
    events = read_events(metrics) if metrics.exists() else []
    summary = events[-1] if events and events[-1]["event"] == "summary" else None
    if proc.returncode != 0 or summary is None:
        result.error = error_line(proc.stderr or proc.stdout)
        return result
    if summary.get("stopped"):  # a STOP file in its run dir: exit 0, but not its whole length
        stopped = summary["stopped"]
        result.error = (
            f"stopped at step {stopped['step']} of {summary['steps']} ({stopped['reason']})"
        )
        return result
    ranks = summary["ranks"]
    gpu = "peak_allocated_bytes" in ranks[0]
    key = "peak_allocated_bytes" if gpu else "peak_rss_bytes"
    t = summary["throughput"]
    result.ok = True
    result.tokens_per_s = t["tokens_per_s"]
    result.step_time_p50_s = t["step_time_p50_s"]
    result.mfu = t["mfu"]
    result.peak_memory_bytes = max(r[key] for r in ranks)
    result.memory_kind = "allocated" if gpu else "RSS"
    result.model_state_bytes = max(r["model_state_bytes"]["total"] for r in ranks)
    result.final_loss = summary["final_loss"]
    result.losses = [e["loss"] for e in events if e["event"] == "step"]
    return result


def compare(
    recipe: str,
    overrides: list[str],
    configs: list[CompareConfig],
    out_dir: Path,
    *,
    on_result=None,
) -> dict[str, Any]:
    """Run the configurations one after another; one that does not make a valid recipe is
    reported in its column without running.

    Raises:
        UserError: the recipe and shared overrides are invalid on their own (nothing ran), or
            `out_dir` already holds runs.
    """
    resolved = load_recipe(recipe, overrides)
    data_problems = check_data(resolved.config)
    forget_data()  # what the checks tokenized: each run is a process of its own that reads it
    if data_problems:
        raise UserError("; ".join(data_problems))
    if out_dir.exists() and any(not p.name.startswith(LOCK_FILE) for p in out_dir.iterdir()):
        raise UserError(f"--run-dir {out_dir} is not empty; give a new directory")
    results = []
    # Each configuration's run locks its own directory; this lock keeps a second compare out of
    # the whole set.
    with hold_run_dir(out_dir), ForwardSignals() as runs:
        for config in configs:
            if runs.signum is not None:
                break
            run_dir = out_dir / config.label.replace(":", "-")
            try:
                load_recipe(recipe, [*overrides, *config.overrides])
            except UserError as e:
                result = CompareResult(config.label, [*overrides, *config.overrides],
                                       str(run_dir), ok=False, error=str(e))  # fmt: skip
            else:
                result = run_config(recipe, overrides, config, run_dir, runs)
            results.append(result)
            if on_result is not None and runs.signum is None:  # else the last line says it
                on_result(result)
        if runs.signum is not None:
            raise Interrupted(_interrupted(runs.signum, results, configs, out_dir),
                              exit_code=128 + runs.signum)  # fmt: skip
    cfg = resolved.config
    return {
        "recipe": resolved.name,
        "overrides": overrides,
        "world_size": cfg.world_size,
        "steps": cfg.train.steps,
        "timing_warmup_steps": cfg.output.timing_warmup_steps,
        "run_dir": str(out_dir),
        "results": [asdict(r) for r in results],
    }


def _interrupted(
    signum: int, results: list[CompareResult], configs: list[CompareConfig], out_dir: Path
) -> str:
    """The line compare ends with after a forwarded SIGTERM/SIGINT."""
    name = signal.Signals(signum).name
    last = results[-1] if results else None
    during = f" during {last.label} ({last.error})" if last is not None and not last.ok else ""
    left = [c.label for c in configs[len(results) :]]
    not_run = f"; not run: {', '.join(left)}" if left else ""
    return f"compare stopped by {name}{during}{not_run}; runs in {out_dir}"


ROWS = (
    ("tokens/s", "tokens_per_s", "count"),
    ("step time p50", "step_time_p50_s", "seconds"),
    ("peak memory / rank", "peak_memory_bytes", "bytes"),
    ("model state / rank", "model_state_bytes", "bytes"),
    ("final loss", "final_loss", "loss"),
)


def cells(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table: each value with its ratio to the first
    configuration (the first one that ran)."""
    from fsdprun.fmt import fmt_bytes

    results = report["results"]
    base = next((r for r in results if r["ok"]), None)

    def fmt(kind: str, value: float) -> str:
        if kind == "count":
            return f"{value:,.0f}"
        if kind == "seconds":
            return f"{value * 1000:.1f} ms" if value < 10 else f"{value:.2f} s"
        if kind == "bytes":
            return fmt_bytes(int(value))
        return f"{value:.4f}"

    header = ["", *(r["label"] for r in results)]
    rows = []
    for name, key, kind in ROWS:
        if key == "peak_memory_bytes" and base is not None:
            name = f"peak {base['memory_kind']} / rank"
        row = [name]
        for r in results:
            if not r["ok"]:
                row.append("-")
                continue
            text = fmt(kind, r[key])
            if kind != "loss" and r is not base and base[key]:
                text += f" ({r[key] / base[key]:.2f}x)"
            row.append(text)
        rows.append(row)
    if any(not r["ok"] for r in results):
        rows.append(["error", *("" if r["ok"] else r["error"] for r in results)])
    return header, rows


def render(report: dict[str, Any], name: str, console: Console) -> None:
    """The side-by-side table. A configuration's label folds after its colon and a value keeps
    its number whole (its ratio may go to the next line), so three configurations fit 80
    columns."""
    from rich.table import Table

    from fsdprun.report.console import Cell

    header, rows = cells(report)
    table = Table(title=f"fsdprun compare {name} (world size {report['world_size']}, "
                  f"{report['steps']} steps)")  # fmt: skip
    for i, col in enumerate(header):
        table.add_column(Cell.parts(col, after=":"), justify="left" if i == 0 else "right")
    for row in rows:
        if row[0] == "error":
            table.add_row(*row)  # messages wrap at their spaces
        else:
            table.add_row(row[0], *(Cell(re.split(r"(?= \()", v)) for v in row[1:]))
    console.print(table)


def markdown(report: dict[str, Any]) -> str:
    header, rows = cells(report)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
