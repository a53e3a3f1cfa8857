"""What the user sees: the run header, a progress bar, log lines and the final tables.

Rendering only — every number arrives computed in a metrics event (`fsdprun.report.metrics`).
The launcher feeds events to a `Reporter` by following RUN_DIR/metrics.jsonl; a worker started by
torchrun/srun feeds its own events on rank 0.

Never imports torch, the engines nor the training loop.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from fsdprun.errors import diagnostic
from fsdprun.fmt import fmt_bytes, fmt_count
from fsdprun.report.metrics import read_events
from fsdprun.report.output import output_console


def _differs(trained: float | None, tokens: float) -> bool:
    # Fine-tuning data trains fewer targets than it processes; windows train every one.
    return trained is not None and abs(trained - tokens) > 1e-9 * max(tokens, 1.0)


def _trained(e: dict[str, Any]) -> str:
    """The log line's trained tok/s, when the data masks targets (absent from older runs)."""
    trained = e.get("trained_tokens_per_s")
    return f"{trained:,.0f} trained tok/s | " if _differs(trained, e["tokens_per_s"]) else ""


def _trained_row(t: dict[str, Any]) -> list[tuple[str, str]]:
    trained = t.get("trained_tokens_per_s")
    if not _differs(trained, t["tokens_per_s"]):
        return []
    return [("trained tokens/s (total)", f"{trained:,.0f}")]


class Cell:
    """Table text that wraps only between its pieces, never inside one.

    Tables must stay readable in an 80-column terminal. Plain strings in a rich table wrap at
    spaces and, when a column gets narrow, cut words anywhere (`feed_forward.w1.weigh` / `t`)
    and headers to `gather…`. A `Cell` tells the table how narrow it may get: a dotted name
    folds after its dots, a number keeps its unit, so the names take the squeeze whole.
    """

    def __init__(self, pieces: list[str | Text]):
        self.pieces = [Text(p) if isinstance(p, str) else p for p in pieces if p]

    @classmethod
    def whole(cls, text: str) -> Cell:
        """Never broken (a number with its unit, a shape)."""
        return cls([text])

    @classmethod
    def parts(cls, text: str, after: str = ".") -> Cell:
        """Broken after any character of `after` (a tensor key, a module path) or at a space."""
        return cls(re.split(rf"(?<=[{re.escape(after)}])|(?= )", text))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((cell_len(p.plain.strip()) for p in self.pieces), default=0)
        return Measurement(widest, sum(p.cell_len for p in self.pieces))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = [Text()]
        for piece in self.pieces:
            if lines[-1] and lines[-1].cell_len + piece.cell_len > options.max_width:
                piece = piece.copy()
                piece.plain = piece.plain.lstrip()
                lines.append(piece)
            else:
                lines[-1].append_text(piece)
        # A piece wider than the whole column (none is, unless the table cannot fit) folds.
        text = Text("\n").join(lines)
        text.overflow = "fold"
        yield text


def compile_rows(compiled: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The summary's compile rows: the seconds spent compiling (the slowest rank's) and each
    compile cache's hits and misses over all ranks; none when nothing compiled."""
    if compiled is None:
        return []
    time_s = compiled["time_s"]
    rows = [("compile time", f"{time_s:.1f} s" if time_s is not None else "n/a")]
    for label, key in (("FX graph cache", "fx_graph"), ("AOTAutograd cache", "aot_autograd")):
        counts = compiled[key]
        if counts is None:
            rows.append((label, "n/a"))
            continue
        text = f"{counts['hit']} of {counts['hit'] + counts['miss']} hit"
        if counts["bypass"]:  # graphs the cache cannot hold (torch says why in its debug log)
            text += f", {counts['bypass']} bypassed"
        rows.append((label, text))
    return rows


def _expert_load(figures: dict[str, Any] | None) -> str:
    """The step line's load balance: the busiest expert over the mean of its layer, in the
    least balanced layer (and with ep the busiest rank's over the mean); '' for a dense model."""
    if not figures:
        return ""
    text = f" | experts max/mean {figures['worst_max_over_mean']:.2f}"
    if figures.get("ranks"):
        text += f", ranks {figures['ranks']['worst_max_over_mean']:.2f}"
    return text


# The run summary's expert table shows at most this many layers (the least balanced).
EXPERT_LAYERS_SHOWN = 12


def expert_load_table(figures: dict[str, Any]) -> Table:
    """The run's load balance per MoE layer, over its logged steps: the busiest expert, its
    tokens (token x top-k pairs), the mean over the experts and their ratio; with ep, the busiest
    rank's. The least balanced `EXPERT_LAYERS_SHOWN` layers, in layer order, where there are
    more."""
    layers = figures.get("layers") or list(range(len(figures["max"])))
    ratio = figures["max_over_mean"]
    rows = sorted(range(len(layers)), key=lambda i: -ratio[i])[:EXPERT_LAYERS_SHOWN]
    shown = "" if len(rows) == len(layers) else (
        f" (the {len(rows)} least balanced of {len(layers)} layers)")  # fmt: skip
    table = Table(title=f"Expert load over the logged steps{shown}", title_justify="left")
    ranks = figures.get("ranks")
    cols = ["layer", "busiest expert", "its tokens", "mean", "max/mean"]
    cols += ["busiest rank", "rank max/mean"] if ranks else []
    for col in cols:
        table.add_column(col, justify="right")
    for i in sorted(rows):
        row = [str(layers[i]), str(figures["busiest_expert"][i]), f"{figures['max'][i]:,}",
               f"{figures['mean'][i]:,.0f}", f"{ratio[i]:.2f}"]  # fmt: skip
        if ranks:
            row += [str(ranks["busiest_rank"][i]), f"{ranks['max_over_mean'][i]:.2f}"]
        table.add_row(*row)
    return table


def _lora_line(lora: dict[str, Any], num_base_params: int, num_trainable: int) -> str:
    """The header's LoRA line: its settings and how many parameters train (the adapters) of all
    (the frozen base and the adapters)."""
    total = num_base_params + num_trainable
    return (
        f"LoRA: rank {lora['rank']}, alpha {lora['alpha']:g} (scale "
        f"{lora['alpha'] / lora['rank']:g}), dropout {lora['dropout']:g}, on "
        f"{lora['num_modules']} Linears ({', '.join(lora['targets'])}); trainable "
        f"{fmt_count(num_trainable)} of {fmt_count(total)} params "
        f"({100 * num_trainable / total:.2f}%)"
    )


def pipeline_line(pp: int, p: dict) -> str:
    """The run header's pipeline line, from the start event's `pipeline` record."""
    stages = len(p["blocks"])
    virtual = f", {p['stages_per_rank']} a rank" if p["stages_per_rank"] > 1 else ""
    return (
        f"pipeline parallel: pp {pp}, {p['schedule']} schedule, {stages} stages{virtual} "
        f"(blocks {' | '.join(map(str, p['blocks']))}); {p['micro_batches']} micro-batches a "
        f"step, up to {p['in_flight']:g} in flight on stage 0; bubble {p['bubble']:.0%} of "
        "each step"
    )


def mesh_text(mesh: list[list]) -> str:
    """'2 dp_shard x 2 tp' from the start event's [[name, size], ...], outermost first."""
    return " x ".join(f"{size} {name}" for name, size in mesh)


def tp_plan_lines(rows: list[list[str]]) -> list[tuple[str, str]]:
    """The TP plan's (module path, style) rows with the blocks' numbers folded into `*`
    (`layers.*.attention.wq`: each block is split alike), in the plan's order."""

    folded: dict[str, str] = {}
    for path, style in rows:
        folded.setdefault(re.sub(r"\.\d+\.", ".*.", path), style)
    return list(folded.items())


class Reporter:
    """Turns metrics events into console output (call from one thread)."""

    def __init__(self, console: Console | None = None, *, live: bool = True):
        self.console = console or output_console()
        self.live = live and self.console.is_terminal
        self.progress: Progress | None = None
        self.task = None

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            self.start(event)
        elif kind == "step":
            self.step(event)
        elif kind == "summary":
            self.summary(event)
        elif kind == "checkpoint":
            self.console.print(
                f"checkpoint step {event['step']}: {fmt_bytes(event['bytes'])} in "
                f"{event['total_s']:.2f} s (training blocked {event['blocked_s']:.2f} s) -> "
                f"{event['path']}"
            )
        elif kind == "resume":
            self.console.print(
                f"resumed from {event['checkpoint']} at step {event['step']} (saved on "
                f"{event['saved_world_size']} ranks, now {event['world_size']}; loaded in "
                f"{event['load_s']:.2f} s)"
            )
        elif kind == "restart":
            where = event["checkpoint"] or "the beginning (no checkpoint yet)"
            self.console.print(f"workers restarted (attempt {event['attempt']}): from {where}")
        elif kind == "skip":
            self.console.print(
                f"step {event['step']}: non-finite loss or gradients, step skipped "
                f"({event['skipped_in_row']} in a row)"
            )
        elif kind == "stopped":
            self.console.print(
                f"stopping at step {event['step']} ({event['reason']}): checkpoint "
                f"{event['checkpoint']}"
            )
        elif kind == "eval":
            self.console.print(
                f"eval step {event['step']} | val loss {event['val_loss']:.4f} | "
                f"{event['num_samples']} samples in {event['eval_time_s']:.2f} s"
            )
        elif kind == "profile":
            where = ", ".join(event["traces"]) or f"none in {event['dir']}"
            self.console.print(
                f"profiler traces of steps {event['steps'][0]}-{event['steps'][1]}: {where} "
                "(open in https://ui.perfetto.dev or TensorBoard's profiler plugin)"
            )
            if event["missing"]:
                self.console.print(
                    f"  no trace here from rank(s) {event['missing']}: on another node's disk, "
                    "the run ended before the profiled steps, or it did not fit (a warning on "
                    "stderr says)"
                )
            for path in event["memory_snapshots"]:
                self.console.print(f"  memory snapshot: {path} (open in pytorch.org/memory_viz)")
        elif kind == "load_weights":
            self.console.print(f"model weights loaded from {event['checkpoint']}")
        elif kind == "warning":
            diagnostic("warning", event["message"])
        elif kind == "save_error" and event["action"] == "continue":
            # A save that stops the run is the command's error line instead.
            diagnostic(
                "warning",
                f"{event['message']}; training goes on (checkpoint.on_save_error=continue)",
            )

    def start(self, e: dict[str, Any]) -> None:
        c = self.console
        c.print(
            f"[bold]fsdprun[/bold] {e['recipe']}: {fmt_count(e['num_params'])} params, "
            f"world size {e['world_size']} ({e['nnodes']} node(s)), {e['device_name']}, "
            f"backend {e['backend']}"
        )
        if e.get("launch"):
            c.print(f"  launch: {e['launch']}", soft_wrap=True)
        if e.get("weights"):
            c.print(f"  weights: {e['weights']}", soft_wrap=True)
        if e.get("lora"):
            c.print(f"  {_lora_line(e['lora'], e['num_params'], e['num_trainable_params'])}")
        units = f"{len(e['fsdp_units'])} FSDP units" if e["fsdp_units"] else "no FSDP units"
        c.print(
            f"  engine {e['engine']}, {units}, "
            f"param {e['param_dtype']} / reduce {e['reduce_dtype']}, "
            f"activation checkpointing: {e['activation_checkpointing']}, "
            f"compile: {e['compile']}"
        )
        if e.get("loss"):
            c.print(f"  loss: {e['loss']}; float8: {e.get('float8', 'off')}", soft_wrap=True)
        if e.get("compile_cache"):
            c.print(f"  compile cache: {e['compile_cache']}", soft_wrap=True)  # a path stays whole
        cp, dp = e.get("cp") or 1, e.get("dp", e["world_size"])  # the layout's (worker)
        ranks = f"{dp} dp ranks" if dp != e["world_size"] else f"{dp} ranks"
        c.print(
            f"  batch {e['global_batch_size']} seqs x {e['seq_len']} tokens = "
            f"{fmt_count(e['tokens_per_step'])} tokens/step (micro {e['micro_batch_size']} x "
            f"{ranks} x {e['grad_accum_steps']} accumulation), "
            f"{e['steps']} steps"
        )
        if e.get("mesh"):
            c.print(f"  mesh: {mesh_text(e['mesh'])}")
        if cp > 1:
            c.print(
                f"  context parallel: cp {cp}, {e['cp_impl']} attention (each rank holds "
                f"{e['seq_len'] // cp} of the {e['seq_len']} tokens of every row)"
            )
        if e.get("pipeline"):
            c.print(f"  {pipeline_line(e['pp'], e['pipeline'])}", soft_wrap=True)
        if (e.get("ep") or 1) > 1:
            c.print(
                f"  expert parallel: ep {e['ep']} (each MoE layer's experts split over "
                f"{e['ep']} ranks; tokens go to their experts' ranks by all-to-all and back)"
            )
        if e.get("tp_plan"):
            c.print(f"  tensor parallel plan (tp {e['tp']}):")
            for path, style in tp_plan_lines(e["tp_plan"]):
                c.print(f"    {path}: {style}")
        c.print(
            f"  parameter shard per rank: {fmt_bytes(e['param_shard_bytes'])} of "
            f"{fmt_bytes(e['param_bytes'])}; run dir {e['run_dir']}"
        )
        knobs = e.get("engine_knobs") or []
        if knobs:
            c.print(f"  {e['engine']} knobs:")
            for k in knobs:
                c.print(f"    {k['key']}={k['value']} [dim]->[/dim] {k['applied']}", soft_wrap=True)
        if e.get("data"):
            val = f"; validation: {e['val_data']}" if e.get("val_data") else ""
            c.print(f"  data: {e['data']}{val}", soft_wrap=True)  # paths stay whole
        if e.get("trackers"):
            c.print(f"  trackers: {'; '.join(e['trackers'])}", soft_wrap=True)
        if self.live:
            self.progress = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeRemainingColumn(),
                console=c,
                transient=True,
            )
            self.task = self.progress.add_task("train", total=e["steps"], loss="-", tps="-")
            self.progress.start()

    def step(self, e: dict[str, Any]) -> None:
        line = (
            f"step {e['step']} | loss {e['loss']:.4f} | lr {e['lr']:.2e} | "
            f"gnorm {e['grad_norm']:.3f} | {e['tokens_per_s']:,.0f} tok/s | "
            f"{_trained(e)}{e['step_time_s'] * 1e3:.0f} ms{_expert_load(e.get('experts'))}"
        )
        self.console.print(line)
        if self.progress is not None:
            self.progress.update(
                self.task, completed=e["step"], loss=f"{e['loss']:.4f}",
                tps=f"{e['tokens_per_s']:,.0f}",
            )  # fmt: skip

    def summary(self, e: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        t = e["throughput"]
        if t["steps_measured"] == 0:
            self.console.print(
                f"no steps ran in this launch (it started at step {e['start_step']} of "
                f"{e['steps']}); metrics in {e['metrics_file']}"
            )
            return
        table = Table(title="Throughput", title_justify="left")
        for col in ("metric", "value"):
            table.add_column(col, justify="right" if col == "value" else "left")
        mfu = f"{t['mfu'] * 100:.1f}%" if t["mfu"] is not None else f"n/a ({e['mfu_note']})"
        rows = [
            ("tokens/s (total)", f"{t['tokens_per_s']:,.0f}"),
            ("tokens/s per device", f"{t['tokens_per_s_per_device']:,.0f}"),
            *_trained_row(t),
            ("step time p50", f"{t['step_time_p50_s'] * 1e3:.1f} ms"),
            ("step time p90", f"{t['step_time_p90_s'] * 1e3:.1f} ms"),
            ("TFLOP/s per device", f"{t['tflops_per_device']:.3f}"),
            ("MFU", mfu),
            (
                "steps measured",
                f"{t['steps_measured']} (first {e['timing_warmup_steps']} left out)",
            ),
            ("FLOPs/token (estimate)", fmt_count(e["flops_per_token"])),
            *compile_rows(e.get("compile")),  # absent from older runs' metrics
        ]
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

        mem = Table(title="Memory per rank", title_justify="left")
        ranks = e["ranks"]
        gpu = "peak_allocated_bytes" in ranks[0]
        cols = ["peak allocated", "peak reserved"] if gpu else ["peak RSS"]
        # Pipeline parallel: each rank's stages, whose layers its memory holds.
        staged = "stages" in ranks[0]
        cols = ["rank", *(["stages"] if staged else []), *cols]
        cols += ["params", "grads", "optimizer", "model state"]
        for col in cols:
            mem.add_column(col, justify="right")
        for r in ranks:
            # None when every step of this launch was skipped (no optimizer step was taken).
            ms = r["model_state_bytes"] or dict.fromkeys(("params", "grads", "optimizer", "total"))
            peaks = (
                [fmt_bytes(r["peak_allocated_bytes"]), fmt_bytes(r["peak_reserved_bytes"])]
                if gpu
                else [fmt_bytes(r["peak_rss_bytes"])]
            )
            values = [*peaks, *(fmt_bytes(ms[k]) for k in ("params", "grads", "optimizer"))]
            values.append(fmt_bytes(ms["total"]))
            stages = [", ".join(map(str, r["stages"]))] if staged else []
            mem.add_row(str(r["rank"]), *stages, *map(Cell.whole, values))
        self.console.print(mem)
        if e.get("experts"):
            self.console.print(expert_load_table(e["experts"]))
        if e.get("checkpoints"):
            ck = Table(title="Checkpoints", title_justify="left")
            for col in ("step", "mode", "size", "blocked", "total", "write rate"):
                ck.add_column(col, justify="right")
            for c in e["checkpoints"]:
                rate = c["bytes"] / c["total_s"] / 1e9 if c["total_s"] > 0 else 0.0
                ck.add_row(
                    str(c["step"]), "async" if c["async_save"] else "sync",
                    *map(Cell.whole, (fmt_bytes(c["bytes"]), f"{c['blocked_s']:.3f} s",
                                      f"{c['total_s']:.3f} s", f"{rate:.2f} GB/s")),
                )  # fmt: skip
            self.console.print(ck)
        if not gpu:
            self.console.print(
                "  peak RSS is the whole worker process (torch runtime included); model state is "
                "what the rank holds after an optimizer step."
            )
        val = e.get("final_val_loss")
        stopped = e.get("stopped")
        if stopped:  # an agreed stop: not the end of the run, which goes on with resume
            loss = f"loss {e['final_loss']:.4f}" if e["final_loss"] is not None else "no step"
            val_text = f"; val loss {val:.4f}" if val is not None else ""
            self.console.print(
                f"stopped at step {stopped['step']} of {e['steps']} ({stopped['reason']}; "
                f"checkpoint {stopped['checkpoint']}); {loss}{val_text}; "
                f"continue with: fsdprun resume {stopped['run_dir']}; "
                f"metrics in {e['metrics_file']}; wall time {e['wall_time_s']:.1f} s"
            )
            return
        val_text = f"; final val loss {val:.4f}" if val is not None else ""
        self.console.print(
            f"final loss {e['final_loss']:.4f}{val_text}; metrics in {e['metrics_file']}; "
            f"wall time {e['wall_time_s']:.1f} s"
        )


class MetricsFollower:
    """Follows a metrics file from another thread and hands new events to a Reporter."""

    def __init__(self, path: Path, reporter: Reporter, *, poll_s: float = 0.1):
        self.path, self.reporter, self.poll_s = path, reporter, poll_s
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MetricsFollower:
        # A resumed run appends to its metrics file: show only what this session adds.
        self.seen = len(read_events(self.path)) if self.path.exists() else 0
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # whatever arrived after the last poll

    def poll(self) -> None:
        if not self.path.exists():
            return
        events = read_events(self.path)
        if len(events) < self.seen:  # rewritten after an elastic restart (steps replayed)
            self.seen = len(events)
        for event in events[self.seen :]:
            self.reporter.handle(event)
        self.seen = len(events)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(self.poll_s)


def _prefetch_text(value: list[str] | str) -> str:
    if isinstance(value, str):
        return value
    return str(len(value)) if value else "-"


def render_plan(plan: dict[str, Any], console: Console, *, full: bool = False) -> None:
    """Print a memory plan (`fsdprun.tools.plan.MemoryPlan.to_dict()`): a line on its units
    (`full`: their table and the engine's knobs), then memory per rank and the verdict."""
    c = console
    c.print(
        f"[bold]fsdprun plan[/bold] {plan['recipe']}: {fmt_count(plan['num_params'])} params, "
        f"world size {plan['world_size']} ({plan['nnodes']} node(s) x "
        f"{plan['nproc_per_node']}), mesh {escape(_mesh_text(plan['mesh']))}, param dtype "
        f"{plan['param_dtype']}"
    )
    if full:
        c.print(_plan_units_table(plan))
        c.print(f"{plan['engine']} knobs:")
        for k in plan.get("knobs", []):
            c.print(f"  {k['key']}={k['value']} [dim]->[/dim] {k['applied']}", soft_wrap=True)
    else:
        c.print(_plan_units_line(plan))

    c.print(_plan_memory_table(plan))
    if full:
        c.print(f"  * estimates. gathered buffers: {plan['buffer_formula']}.")
        c.print(f"  activations, one micro-batch: {plan['activation_formula']}.")
        for note in plan["notes"]:
            c.print(f"  {note}.")
    else:
        c.print("  * estimates; --full says how each row is counted and what is left out.")
    for dim in ("tp", "cp", "pp", "ep"):
        if dim == "pp" and plan.get("pipeline"):
            c.print(_plan_stages_line(plan), soft_wrap=True)
        if not plan.get(f"{dim}_degrees"):
            continue
        if dim == "tp" and full:
            c.print(_plan_tp_table(plan))
        else:
            c.print(_plan_degrees_line(plan, dim), soft_wrap=True)
        for o in plan[f"{dim}_degrees"]:
            if o["missing"]:
                c.print(f"  {dim} {o[dim]}: not possible, {escape(o['missing'])}.")
    c.print(_plan_verdict(plan))


def _plan_stages_line(plan: dict[str, Any]) -> str:
    """The recipe's pipeline: each pipeline rank's stages, micro-batches in flight and total."""
    p = plan["pipeline"]
    fits = plan["device_memory_bytes"] is not None

    def rank(r: dict) -> str:
        blocks = f"{r['blocks']} block{'s' if r['blocks'] != 1 else ''}"
        what = [*(["embedding"] if r["first"] else []), blocks,
                *(["head and loss"] if r["last"] else [])]  # fmt: skip
        stages = ", ".join(map(str, r["stages"]))
        verdict = (" fits" if r["memory"]["fits"] else " does not fit") if fits else ""
        return (
            f"pp rank {r['rank']} (stage {stages}: {' + '.join(what)}; {r['in_flight']:g} "
            f"micro-batches in flight) {fmt_bytes(r['memory']['total'])}{verdict}"
        )

    return escape(
        f"Pipeline stages (pp {plan['pp']}, {p['schedule']}, {p['micro_batches']} micro-batches a "
        f"step: bubble {p['bubble']:.0%} of each step; each rank's total): "
        + ", ".join(rank(r) for r in p["ranks"])
    )


def _note(o: dict[str, Any]) -> str:
    return f" ({o['note']})" if o.get("note") else ""


# Each parallel dimension's line of degrees: its name, what each total is, and what a degree's
# entry adds after its total.
_DEGREE_LINES = {
    "tp": ("Tensor", "rank 0 total", _note),
    "cp": ("Context", "rank 0 total, activations / cp", _note),
    "pp": ("Pipeline", "the largest pipeline rank's total",
           lambda o: f" (pp rank {o['largest_rank']}; bubble {o['bubble']:.0%})"
           if o["pp"] > 1 else ""),
    "ep": ("Expert", "rank 0 total, the all-to-all each rank sends",
           lambda o: (f" + {fmt_bytes(o['alltoall_bytes'])} all-to-all a step"
                      if o["alltoall_bytes"] else "") + _note(o)),
}  # fmt: skip


def _plan_degrees_line(plan: dict[str, Any], dim: str) -> str:
    """One parallel dimension's degrees (`plan[dim + "_degrees"]`) in one line: each one's mesh
    and total per rank, and whether it fits the device memory where that is known; tp's table
    (--full) splits each total."""
    name, what, extra = _DEGREE_LINES[dim]
    strategy = "full" if plan["recipe_strategy"] == "ddp" else plan["recipe_strategy"]
    fits = plan["device_memory_bytes"] is not None and dim != "tp"
    parts = [
        f"{dim} {o[dim]}{' (recipe)' if o[dim] == plan.get(dim, 1) else ''} {o['mesh']} "
        f"{fmt_bytes(o['memory']['total'])}" + extra(o)
        + ((" fits" if o["memory"]["fits"] else " does not fit") if fits else "")
        for o in plan[f"{dim}_degrees"] if o["memory"] is not None
    ]  # fmt: skip
    return escape(
        f"{name} parallel at world size {plan['world_size']} (fsdp2, {strategy}; {what}): "
        + ", ".join(parts)
        + ("; --full splits each total" if dim == "tp" else "")
    )


def _mesh_text(mesh: list[list]) -> str:
    return "[" + " x ".join(f"{name} {n}" for name, n in mesh) + "]"


def _plan_tp_table(plan: dict[str, Any]) -> Table:
    """The recipe's sharding at each possible TP degree, same world size, side by side."""
    options = [o for o in plan["tp_degrees"] if o["memory"] is not None]
    strategy = "full" if plan["recipe_strategy"] == "ddp" else plan["recipe_strategy"]
    table = Table(
        title=f"Tensor parallel at world size {plan['world_size']} (fsdp2, {strategy}; rank 0)",
        title_justify="left",
    )
    table.add_column("component")
    for o in options:
        mark = " (recipe)" if o["tp"] == plan["tp"] else ""
        mark += f" ({o['note']})" if o.get("note") else ""
        table.add_column(f"tp {o['tp']}{mark}", justify="right")
    table.add_row("mesh", *(Cell.whole(o["mesh"]) for o in options))
    for label, key in (
        ("parameters", "params"), ("gradients", "grads"), ("unsharded grads", "accumulation"),
        ("optimizer state", "optimizer"), ("gathered buffers *", "gathered_buffers"),
        ("activations *", "activations"), ("total", "total"),
    ):  # fmt: skip
        table.add_row(label, *(Cell.whole(fmt_bytes(o["memory"][key])) for o in options))
    if plan["device_memory_bytes"] is not None:
        table.add_row("fits", *("yes" if o["memory"]["fits"] else "no" for o in options))
    return table


SUMMARY_UNIT_ROWS = 4  # unit rows named in the summary line; --full lists them all


def _plan_units_line(plan: dict[str, Any]) -> str:
    """The units in one line: their rows' names, the largest gathered, where the rest is."""
    rows = _plan_unit_rows(plan)
    names = [name for name, _ in rows[:SUMMARY_UNIT_ROWS]]
    if len(rows) > SUMMARY_UNIT_ROWS:
        names.append(f"{len(rows) - SUMMARY_UNIT_ROWS} more")
    gathered = max((u["unsharded_bytes"] for u in plan["units"]), default=0)
    return (
        f"{len(plan['units'])} FSDP units ({', '.join(names)}); the largest gathers "
        f"{fmt_bytes(gathered)} in {plan['param_dtype']}; --full lists each unit's shard and "
        f"prefetch, and what the {plan['engine']} engine does with each knob"
    )


def _plan_unit_rows(plan: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row name, its first unit): identical consecutive units (the blocks) share one row, named
    by their span (`layers.0..78 (x79)`), so a 70B plan stays readable."""
    rows: list[tuple[list[str], tuple]] = []
    for u in plan["units"]:
        key = (
            u["num_params"], u["reshard_after_forward"], _prefetch_text(u["forward_prefetch"]),
            _prefetch_text(u["backward_prefetch"]), u["path"] == "",
        )  # fmt: skip
        if rows and rows[-1][1] == key:
            rows[-1][0].append(u["path"])
        else:
            rows.append(([u["path"]], key))
    by_path = {u["path"]: u for u in plan["units"]}
    named = []
    for paths, _ in rows:
        name = paths[0] or "(root)"
        if len(paths) > 1:
            (head, _, first), (last_head, _, last) = (
                paths[0].rpartition("."),
                paths[-1].rpartition("."),
            )
            span = f"{head}.{first}..{last}" if head == last_head else f"{paths[0]} .. {paths[-1]}"
            name = f"{span} (x{len(paths)})"
        named.append((name, by_path[paths[0]]))
    return named


def _plan_units_table(plan: dict[str, Any]) -> Table:
    units = Table(
        title=f"FSDP units (root last; gathered in {plan['param_dtype']}, shard fp32 on rank 0)",
        title_justify="left",
    )
    for col in ("unit", "params", "gathered", "shard", "reshard", "fwd pf", "bwd pf"):
        units.add_column(col, justify="left" if col == "unit" else "right")
    for name, u in _plan_unit_rows(plan):
        # Unit paths fold after their dots; the numbers stay whole.
        units.add_row(
            Cell.parts(name), *map(Cell.whole, (
                fmt_count(u["num_params"]), fmt_bytes(u["unsharded_bytes"]),
                fmt_bytes(u["shard_bytes"]), "yes" if u["reshard_after_forward"] else "no",
                _prefetch_text(u["forward_prefetch"]), _prefetch_text(u["backward_prefetch"]),
            )),
        )  # fmt: skip
    return units


def _plan_memory_table(plan: dict[str, Any]) -> Table:
    strategies = plan["strategies"]
    stage = " (pp rank 0's stages)" if plan.get("pipeline") else ""
    mem = Table(title=f"Memory per rank (rank 0{stage})", title_justify="left")
    mem.add_column("component")
    for name in strategies:
        mark = " (recipe)" if name == plan["recipe_strategy"] else ""
        mem.add_column(f"{name}{mark}", justify="right")
    components = (
        ("shard group", "shard_group"), ("parameters", "params"), ("gradients", "grads"),
        ("unsharded grads", "accumulation"),
        ("optimizer state", "optimizer"), ("gathered buffers *", "gathered_buffers"),
        ("activations *", "activations"),
        *([("pipeline buffers", "pipeline_buffers")] if plan.get("pipeline") else []),
        ("dispatch buffers *", "dispatch"), ("total", "total"),
    )  # fmt: skip
    for label, key in components:
        if key == "dispatch" and not any(s.get(key) for s in strategies.values()):
            continue  # expert parallel's row only
        fmt = str if key == "shard_group" else fmt_bytes
        mem.add_row(label, *(Cell.whole(fmt(s[key])) for s in strategies.values()))
    if plan["device_memory_bytes"] is not None:
        mem.add_row("fits", *("yes" if s["fits"] else "no" for s in strategies.values()))
    return mem


def _plan_verdict(plan: dict[str, Any]) -> str:
    strategy, has = plan["recipe_strategy"], plan["device_memory_bytes"]
    total = plan["strategies"][strategy]["total"]
    needs = f"{fmt_bytes(total)} ({total / 1e9:.1f} GB)"
    if has is None:
        return (
            f"needs {needs} per rank ({strategy}); device memory unknown: give --device-memory "
            "(e.g. 80GB) or launch.device_memory_gb"
        )
    verdict = (
        "[green]fits[/green]" if plan["strategies"][strategy]["fits"] else "[red]does not fit[/red]"
    )
    return (
        f"{verdict}: {strategy} needs {needs} per rank, has {fmt_bytes(has)} ({has / 1e9:.1f} GB)"
    )
