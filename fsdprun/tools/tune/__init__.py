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
   interquartile range and number of steps). Otherwise the starting recipe stays. Of the
   candidates that beat it so and are within the noise of the fastest, the one that changes the
   fewest knobs wins, and the verdict says so. Then the confirmation: the winner and the
   starting recipe run again, --confirm interleaved pairs of trials as long as the last round's,
   and the report gives the measured ratio (median of the pairs, with their min and max) beside
   the search's. A winner whose confirmation trial fails, or that measures no faster than the
   starting recipe, is not kept.
5. Safety: a trial that fails, runs out of memory, hangs past its timeout (its whole process group
   is killed) or whose first losses disagree with the baseline's (LOSS_RTOL) is recorded with a
   one-line reason and the search goes on. OUT/trials.jsonl gets one record per finished trial,
   appended and fsynced; a rerun with the same --out replays it and runs only what is missing.
6. Several nodes (launch.nnodes > 1): every node runs tune with the same arguments; node 0 does
   all of the above and runs each trial on every node through fsdprun.tools.tune.nodes, the
   others run its trials with it and print its report.

The parts, each a module of this package: space.py (1, 2), trials.py (3, 5), search.py (3, 4),
report.py (the report and tuned.yaml), nodes.py (6). This one is `tune()`: the checks, then the
space, the rounds and the report, in that order.

Imports neither the training loop nor the launcher: trials are `fsdprun train` subprocesses.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdprun.children import handled_signals
from fsdprun.config import launch_device_problem, load_recipe
from fsdprun.data.preflight import check_data
from fsdprun.data.spec import forget_data
from fsdprun.errors import UserError
from fsdprun.rundir import TUNE_LOG_FILE
from fsdprun.runlock import hold_run_dir
from fsdprun.tools.tune.args import TuneArgs
from fsdprun.tools.tune.report import print_space, render, tune_report, write_tuned
from fsdprun.tools.tune.search import (
    confirm_skipped,
    confirm_winner,
    halving_schedule,
    run_search,
    select,
)
from fsdprun.tools.tune.space import (
    Candidate,
    SpaceKnob,
    current_value,
    enumerate_candidates,
    measured_peaks,
    needs_context_parallel,
    needs_pipeline_parallel,
    parse_space,
    prior_order,
    probe_device,
    prune,
    refused_alone,
)
from fsdprun.tools.tune.trials import LOSS_RTOL, Round, TrialLog, run_trial

if TYPE_CHECKING:
    from fsdprun.config import RecipeConfig, ResolvedRecipe

# What `fsdprun tune` (cli.py) imports; the parts are imported from their modules.
__all__ = ["Interrupted", "TuneArgs", "parse_duration", "render", "tune"]


# ---------------------------------------------------------------------------------------------
# tune() itself


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
    say = say or (lambda text: None)
    started = time.perf_counter()  # the budget counts from here, the checks included
    with _interrupted(args.out_dir), _stop_on_signals():
        # Every trial would be refused the same way: the checks are made once, up front.
        resolved = _checked_recipe(args)
        cfg, launch = resolved.config, resolved.config.launch
        if launch.nnodes > 1 and launch.node_rank > 0 and not args.dry_run:
            return _follow(args, cfg, say)  # (6) another node: run node 0's trials with it
        leader = None
        if launch.nnodes > 1 and not args.dry_run:
            from fsdprun.tools.tune.nodes import Leader

            # Up before the plan prunes (seconds for a large space), so the other nodes join now.
            leader = Leader(launch.rdzv_endpoint, nnodes=launch.nnodes, search=_nodes_key(args),
                            timeout_s=launch.rdzv_timeout_s)  # fmt: skip
        with _failure_told_to(leader):
            # (1) The space, and the memory its candidates must fit.
            memory, memory_source, accelerator = _device_memory(args, cfg)
            left_out: dict[str, str] = {}  # knob values the recipe refuses on their own
            cp = needs_context_parallel(cfg, memory, args.margin)
            pp = needs_pipeline_parallel(cfg, memory, args.margin)
            space, defaults = parse_space(args.space, cfg, accelerator=accelerator,
                                          allow_numerics=args.allow_numerics,
                                          refused=refused_alone(args.recipe, _overrides(args)),
                                          left_out=left_out, cp=cp, pp=pp)  # fmt: skip
            warmup = max(cfg.output.timing_warmup_steps, 1)
            rtol = LOSS_RTOL[cfg.precision.param_dtype.value]
            setting = _Setting(args, cfg, space, defaults, memory, memory_source, warmup, rtol,
                               left_out)  # fmt: skip
            if args.dry_run:
                return _dry_run_report(setting, resolved, *_plan(setting, say))
            # --out before the plan (seconds for a large space) and any trial: a second tune
            # there is refused, and a place that cannot be written fails now, not at the first
            # write of an hour's search (the lock's holder and the log's header are real writes).
            with hold_run_dir(args.out_dir, option="--out"):
                log = _open_log(args, resolved, space, started)
                # (2) Pruning by the plan, and the order the candidates are tried in.
                candidates, order = _plan(setting, say, log.records)
                if log.records:
                    say(f"continuing {args.out_dir}: {len(log.records)} finished trials in "
                        f"{TUNE_LOG_FILE}")  # fmt: skip
                if leader is not None:
                    leader.wait_for_nodes(say)
                # (3, 5) The rounds of trials, each logged as it finishes.
                stop, not_tried = run_search(args, log, order, warmup=warmup, rtol=rtol,
                                             started=started, say=say, leader=leader)  # fmt: skip
                for c in candidates:
                    if c.id in not_tried:
                        c.reason = not_tried[c.id]
                # (4) The selection, its confirmation, the report and tuned.yaml.
                sel, confirm_stop = select(log.records), None
                if confirm_skipped(sel, args.confirm) is None:
                    winner = next(c for c in candidates if c.id == sel.winner)
                    confirm_stop = confirm_winner(args, log, sel, winner, order[0],
                                                  warmup=warmup, rtol=rtol, started=started,
                                                  say=say, leader=leader)  # fmt: skip
                report = tune_report(args, resolved, cfg, candidates, log.records, memory,
                                     memory_source, stop, started, rtol,
                                     confirmations=log.confirmations,
                                     confirm_stop=confirm_stop)  # fmt: skip
                write_tuned(args, report, candidates, cfg)
                log.note("done", winner=report["winner"], winner_label=report["winner_label"],
                         verdict=report["verdict"], stopped_early=stop,
                         measured_ratio=report["measured_ratio"],
                         tuned_yaml=report["tuned_yaml"])  # fmt: skip
        if leader is not None:
            leader.finish({"report": report})
        return report


# ---------------------------------------------------------------------------------------------
# tune()'s steps


def _overrides(args: TuneArgs) -> list[str]:
    """The starting recipe's overrides: the user's, then the launch flags'."""
    return [*args.overrides, *args.launch_overrides]


def _checked_recipe(args: TuneArgs) -> ResolvedRecipe:
    """The recipe with the search's arguments, checked as `train` checks it before a launch.

    Raises:
        UserError: what is wrong, one line.
    """
    for option, value in (("--steps", args.steps), ("--repeats", args.repeats),
                          ("--finalists", args.finalists)):  # fmt: skip
        if value < 1:
            raise UserError(f"{option} must be >= 1 (got {value})")
    if args.confirm < 0:
        raise UserError(f"--confirm must be >= 0 (0: no confirmation; got {args.confirm})")
    resolved = load_recipe(args.recipe, _overrides(args))
    cfg = resolved.config
    problems = check_data(cfg)
    # Each trial is a `fsdprun train` of its own that reads the data itself: this process
    # keeps none of what the checks tokenized for the whole search.
    forget_data()
    if problems:
        raise UserError("; ".join(problems))
    device_problem = None if args.dry_run else launch_device_problem(cfg.launch.device)
    if device_problem:
        raise UserError(device_problem)
    if "LOCAL_RANK" in os.environ:
        # Each trial is a launch of its own: tune is a node's launcher, never one of its workers
        # (torchrun's and srun tasks' have LOCAL_RANK; a PyTorchJob's pod-level RANK comes
        # without it, on a node's launcher).
        raise UserError(
            "fsdprun tune runs as each node's launcher, not as a worker of torchrun or of a "
            "multi-task srun step: run one tune per node (srun --ntasks-per-node 1 ... with "
            "--nnodes, --node-rank and --rdzv-endpoint, as for fsdprun train)"
        )
    if cfg.launch.nnodes > 1 and not cfg.launch.rdzv_endpoint:
        raise UserError(
            f"launch.nnodes is {cfg.launch.nnodes}: pass --rdzv-endpoint HOST:PORT (node 0's "
            "address) and --node-rank on every node"
        )
    return resolved


@contextlib.contextmanager
def _failure_told_to(leader):
    """Node 0's search failing: the other nodes are told why (`leader`, None on one node)."""
    try:
        yield
    except BaseException as e:
        if leader is not None:
            why = (str(e).strip().splitlines() or [""])[0]
            if isinstance(e, UserError):
                leader.finish({"error": why})
            else:  # Ctrl-C (or a bug): no waiting for the others on the way out
                leader.finish({"error": f"{type(e).__name__}{': ' + why if why else ''}"},
                              wait_s=0)  # fmt: skip
        raise


def _device_memory(args: TuneArgs, cfg: RecipeConfig) -> tuple[int, str, bool]:
    """The memory per rank candidates must fit, what says so, and whether it is an
    accelerator's.

    Raises:
        UserError: on CPU without --device-memory.
    """
    device = probe_device(cfg)
    if args.device_memory_bytes is None and device["kind"] == "cpu":
        raise UserError(
            "--device-memory is required on CPU (no accelerator memory to measure); e.g. "
            "--device-memory 8GB"
        )
    memory = args.device_memory_bytes or int(device["free"])
    source = "--device-memory" if args.device_memory_bytes else (
        f"free memory of {device.get('name', 'the device')} measured now"
    )  # fmt: skip
    return memory, source, device["kind"] != "cpu"


@dataclass(frozen=True)
class _Setting:
    """What the plan of the candidates depends on."""

    args: TuneArgs
    cfg: RecipeConfig
    space: list[SpaceKnob]
    defaults: bool  # the default space: memory knobs are dominated where not needed
    memory: int
    memory_source: str
    warmup: int
    rtol: float
    left_out: dict[str, str]


def _plan(s: _Setting, say, records=()) -> tuple[list[Candidate], list[Candidate]]:
    """The candidates, pruned by `fsdprun plan` and the knob tables (printed), and the order
    they are tried in (the baseline first). `records`: a continued search's finished trials,
    whose measured peaks overrule the plan's (`measured_peaks`)."""
    args = s.args
    baseline = {k.key: current_value(s.cfg, k.key) for k in s.space}
    candidates = enumerate_candidates(s.space, baseline)
    prune(candidates, args.recipe, _overrides(args), device_memory_bytes=s.memory,
          margin=args.margin, dominate_memory_knobs=s.defaults,
          measured=measured_peaks(list(records)))  # fmt: skip
    order = prior_order(candidates)
    print_space(say, s.space, candidates, order, s.memory, s.memory_source, args, s.warmup,
                s.rtol, s.cfg, s.left_out)  # fmt: skip
    base = candidates[0]
    if base.planned_peak_bytes * (1 + args.margin) > s.memory:
        from fsdprun.fmt import fmt_bytes

        # On stderr even with --json: the baseline runs anyway (it is the reference).
        peak = fmt_bytes(base.planned_peak_bytes)
        print(f"warning: the starting recipe plans a peak of {peak} per rank, over the "
              f"device memory {fmt_bytes(s.memory)} ({s.memory_source}) with the "
              f"{args.margin:.0%} margin; its trials (the baseline, run first) may run out "
              "of memory", file=sys.stderr, flush=True)  # fmt: skip
    return candidates, order


def _dry_run_report(
    s: _Setting, resolved: ResolvedRecipe, candidates: list[Candidate], order: list[Candidate]
) -> dict[str, Any]:
    """--dry-run's report: the space, the pruning, the order and the rounds it would run."""
    args = s.args
    rounds = halving_schedule(len(order), steps=args.steps, finalists=args.finalists,
                              repeats=args.repeats)  # fmt: skip
    return {
        "recipe": resolved.name, "device_memory_bytes": s.memory, "margin": args.margin,
        "space": [asdict(k) for k in s.space], "left_out": s.left_out,
        "order": [c.id for c in order],
        "rounds": [asdict(r) for r in rounds],
        "confirm": {"pairs": args.confirm, "measured_steps": rounds[-1].measured_steps},
        "candidates": [{"candidate": c.id, "label": c.label, "overrides": c.overrides,
                        "status": c.status, "reason": c.reason,
                        "planned_peak_bytes": c.planned_peak_bytes} for c in candidates],
    }  # fmt: skip


def _open_log(
    args: TuneArgs, resolved: ResolvedRecipe, space: list[SpaceKnob], started: float
) -> TrialLog:
    """OUT/trials.jsonl, with this session noted: a rerun of the same search replays it."""
    header = {"event": "tune", "search": _search_key(args, space), "recipe": resolved.name,
              "overrides": _overrides(args)}  # fmt: skip
    log = TrialLog(args.out_dir / TUNE_LOG_FILE, header)
    # When the budget started (tune's start, before the checks): status counts from it.
    began = dt.datetime.fromtimestamp(time.time() - (time.perf_counter() - started), dt.UTC)
    log.note("session", started_at=began.isoformat(timespec="seconds"), budget_s=args.budget_s,
             pid=os.getpid())  # fmt: skip
    return log


# ---------------------------------------------------------------------------------------------
# The search's keys, the budget's spelling, and signals


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
    caught: list[int] = []

    def handle(signum: int, frame: object) -> None:
        if not caught:
            caught.append(signum)
            raise _Signal(signum)

    with handled_signals(handle, keep_ignored=True):
        yield


@contextlib.contextmanager
def _interrupted(out_dir: Path):
    """A signal that stopped the search (_stop_on_signals) as `Interrupted`: one line saying
    what the trial log keeps."""
    try:
        yield
    except _Signal as e:
        log = out_dir / TUNE_LOG_FILE
        kept = "nothing was written yet"
        if log.is_file():
            n = 0
            with contextlib.suppress(OSError):
                for line in log.read_bytes().splitlines():
                    with contextlib.suppress(ValueError):
                        n += json.loads(line).get("event") in ("trial", "confirm")
            kept = (f"{n} finished trial(s) are kept in {log} (a trial in progress is stopped "
                    "and not logged)")  # fmt: skip
        raise Interrupted(f"tune interrupted by {e}: {kept}; rerun the same command to continue",
                          exit_code=128 + e.signum) from None  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Several nodes: the nodes but node 0


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
    overrides = _overrides(args)

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
