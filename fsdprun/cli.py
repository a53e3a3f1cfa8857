"""The `fsdprun` command line: thin commands that hand off to one implementation each.

    fsdprun train debug                      # the built-in demo recipe on 2 CPU ranks
    fsdprun train my.yaml optim.lr=1e-3 --nproc-per-node 8
    fsdprun config debug --explain           # resolved recipe and where each value came from
    fsdprun plan llama-70b --world-size 64   # FSDP units and memory per rank, no GPU needed
    fsdprun recipes                          # the built-in recipes

Mistakes a user can fix print one line and exit 2 (FSDPRUN_DEBUG=1 shows the traceback); a
failing worker exits 1 with the rank, the error and its log file.

Never imports torch at module load: each command imports its implementation (and so torch, for the
commands that train) when it runs; tests/test_cli_startup.py checks the read-only ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fsdprun import __version__
from fsdprun.errors import StorageError, UserError, describe_os_error, diagnostic, write_error
from fsdprun.launch.flags import LaunchFlags, launch_overrides
from fsdprun.report.output import output_console
from fsdprun.rundir import (
    RECIPE_FILE,
    checkpoint_root,
    default_run_dir,
    recipe_path,
    step_of,
)

CPP_LOG_MARK = "_FSDPRUN_QUIET_CPP_LOG"


def _dashes(token: str) -> str:
    return token.replace("_", "-")


def _flag_type(self, ctx):
    # typer 0.29's rich help prints a type beside every option, `<bool>` beside a flag too, as if
    # `--verify` took a value; a flag (`--x/--no-x`) takes none, so its type column stays empty.
    return None if self.is_flag and not self.count else _option_type(self, ctx)


# Only where typer has that method: older typers (an H200 image's) print no type column, and
# patching a method they lack made every command fail at import.
_option_type = getattr(typer.core.TyperOption, "display_type_rich", None)
if _option_type is not None:
    typer.core.TyperOption.display_type_rich = _flag_type


def _text_as_typed() -> None:
    """Typer (0.28 on) converts every parameter's value through a pydantic TypeAdapter, built
    when the parameter is first processed, even for text that stays text: the first build
    imports pydantic, about 60 ms of each `fsdprun recipes` or `fsdprun config` (2026-12).
    Here a `str` parameter's text and a `list[str]` parameter's texts are handed on as typer's
    adapter hands them on (the same text; a list); every other value (a number, a path) goes
    through typer's own adapter, built when first needed. Left alone by a typer that lacks
    these internals or lays them out otherwise (0.27, the H200 image's, has no adapters)."""
    build = getattr(typer.core, "build_runtime_param", None)
    coercion = sys.modules.get("typer._coercion")
    base = getattr(coercion, "RuntimeParam", None)
    if build is None or base is None or not dataclasses.is_dataclass(base):
        return
    if [f.name for f in dataclasses.fields(base)] != ["parameter_info", "annotation"]:
        return
    adapted = functools.cache(build)

    @dataclasses.dataclass(frozen=True)
    class TextAsTyped(base):
        descriptor: Any  # typer's TypeDescriptor

        def _coerce_value(self, value, param, ctx):
            # (typer's `coerce` has returned None, or () for a list, for a value not given.)
            if self.descriptor.file_annotation is None and self.parameter_info.parser is None:
                if self.annotation is str and type(value) is str:
                    return value
                if self.annotation == list[str] and all(type(v) is str for v in value):
                    return list(value)
            return adapted(self.descriptor)._coerce_value(value, param=param, ctx=ctx)

    typer.core.build_runtime_param = lambda d: TextAsTyped(d.parameter_info, d.annotation, d)


_text_as_typed()


app = typer.Typer(
    help="Train LLMs with PyTorch FSDP from layered YAML recipes.\n\nOptions also take "
    "torchrun's spellings (--nproc_per_node, --node_rank, --rdzv_endpoint, --max_restarts).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # torchrun's spellings work too (--nproc_per_node for --nproc-per-node, ...), as in torchrun
    # itself: a torchrun user's fingers should just work. Normalizing the option names keeps one
    # name per option in the help, which stays readable at 80 columns.
    context_settings={"token_normalize_func": _dashes},
)
err_console = output_console(stderr=True, highlight=False, soft_wrap=True)


def _complete_recipe(incomplete: str) -> list[str]:
    # Built-in names here; the shell's own file completion (`complete -o default`) adds paths.
    from fsdprun.config import builtin_recipes

    return [name for name in builtin_recipes() if name.startswith(incomplete)]


Recipe = Annotated[
    str,
    typer.Argument(
        help="A recipe YAML path or a built-in recipe name.", autocompletion=_complete_recipe
    ),
]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="KEY=VALUE overrides (dotted keys, e.g. optim.lr=3e-4); ~KEY drops a key "
                   "back to its default.", show_default=False),
]  # fmt: skip
# `--json`: of the commands that print tables otherwise, and of those whose output is a report.
JsonOpt = Annotated[
    bool,
    typer.Option("--json/--no-json", show_default=False, help="Print one JSON document."),
]
JsonTablesOpt = Annotated[
    bool,
    typer.Option("--json/--no-json", show_default=False,
                 help="Print one JSON document instead of tables."),
]  # fmt: skip
PlotOpt = Annotated[
    Path | None,
    typer.Option("--plot", help="Also draw the result as bars into this PNG (pip install "
                 "'fsdprun[plot]')."),
]  # fmt: skip
NprocOpt = Annotated[
    str | None,
    typer.Option(
        "--nproc-per-node",
        help="Workers on this node: a number, or auto, cpu, gpu, xpu (counted as torchrun "
        "counts them).",
    ),
]
NnodesOpt = Annotated[
    str | None,
    typer.Option("--nnodes", help="Number of nodes (torchrun's MIN:MAX only with MIN = MAX)."),
]
_PANEL = "Launch (torchrun's flags, also as --nproc_per_node, ...)"


def _opt(*names: str, help: str) -> typer.models.OptionInfo:
    return typer.Option(*names, help=help, rich_help_panel=_PANEL)


# The launching commands' torchrun flags (fsdprun.launch.flags turns them into launch.* keys):
# parameter name -> (its annotation, its default).
_LAUNCH_PARAMS = {
    "nproc_per_node": (str | None, _opt("--nproc-per-node", help="Workers on this node: a "
                       "number, or auto, cpu, gpu, xpu (counted as torchrun counts them).")),
    "nnodes": (str | None, _opt("--nnodes", help="Number of nodes (torchrun's MIN:MAX only with "
               "MIN = MAX: a run's world size is fixed; resume reshards).")),
    "node_rank": (int | None, _opt("--node-rank", help="This node's rank.")),
    "rdzv_endpoint": (str | None, _opt("--rdzv-endpoint", help="HOST:PORT of the c10d "
                      "rendezvous (node 0).")),
    "master_addr": (str | None, _opt("--master-addr", help="torchrun's name for node 0's host: "
                    "the rendezvous is at MASTER_ADDR:MASTER_PORT.")),
    "master_port": (int | None, _opt("--master-port", help="With --master-addr (default 29500).")),
    "rdzv_backend": (str | None, _opt("--rdzv-backend", help="c10d, the only one fsdprun uses; "
                     "others are refused.")),
    "rdzv_id": (str | None, _opt("--rdzv-id", help="The job's id, the same on every node "
                "(launch.rdzv_id).")),
    "rdzv_conf": (str | None, _opt("--rdzv-conf", help="KEY=VALUE,... rendezvous settings "
                  "(launch.rdzv_conf; join_timeout sets launch.rdzv_timeout_s).")),
    "max_restarts": (int | None, _opt("--max-restarts", help="Restart the workers this many "
                     "times after a failure, resuming from the newest complete checkpoint "
                     "(launch.max_restarts).")),
    "monitor_interval": (float | None, _opt("--monitor-interval", help="Seconds between the "
                         "agent's checks of its workers (launch.monitor_interval_s).")),
    "role": (str | None, _opt("--role", help="The workers' role name (launch.role).")),
    "log_dir": (Path | None, _opt("--log-dir", help="Folder for the ranks' stdout.log and "
                "stderr.log (default RUN_DIR/logs).")),
    "redirects": (str | None, _opt("--redirects", "-r", help="Ranks' streams to their log "
                  "files only: 0-3 or LOCAL_RANK:0-3,... (default 3, both).")),
    "tee": (str | None, _opt("--tee", "-t", help="Ranks' streams to their log files and this "
            "console: 0-3 or LOCAL_RANK:0-3,...")),
    "local_ranks_filter": (str | None, _opt("--local-ranks-filter", help="Local ranks whose "
                           "lines reach the console, e.g. 0 (with --tee or --redirects 0).")),
    "standalone": (bool, typer.Option("--standalone/--no-standalone", show_default=False,
                   rich_help_panel=_PANEL, help="One node with a local rendezvous on a free "
                   "port, whatever the recipe says (launch.nnodes=1, no rdzv_endpoint), as "
                   "torchrun --standalone.")),
}  # fmt: skip


def launch_options(fn):
    """Give a command torchrun's launch flags; they reach it as `launch: LaunchFlags`."""
    signature = inspect.signature(fn, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "launch"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, info],
                          default=False if kind is bool else None)
        for name, (kind, info) in _LAUNCH_PARAMS.items()
    ]  # fmt: skip

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        flags = LaunchFlags(**{name: kwargs.pop(name) for name in _LAUNCH_PARAMS})
        return fn(*args, launch=flags, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*own, *added])
    wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *added]}
    return wrapper


# A LoRA checkpoint's base (resume and export): see fsdprun.checkpoint.fingerprint.
AcceptBaseOpt = Annotated[
    bool,
    typer.Option(
        "--accept-base-change/--no-accept-base-change",
        show_default=False,
        help="Use a LoRA checkpoint's base although it is not the one it was trained on (its "
        "recorded fingerprint differs); without it that is refused.",
    ),
]
BaseOpt = Annotated[
    Path | None,
    typer.Option(
        "--base",
        help="Read a LoRA checkpoint's base (its HF folder or load_from checkpoint) from this "
        "path instead of the recorded one, e.g. a copy; checked against its fingerprint.",
    ),
]


def _fail(message: str, code: int) -> typer.Exit:
    # One line whatever the message quotes (a key or path given with a newline in it).
    message = "\\n".join(message.splitlines())
    err_console.print(f"[red]error:[/red] {escape(message)}", markup=True)
    return typer.Exit(code)


_ELASTIC_API = "torch.distributed.elastic.multiprocessing.api"


def _loaded(module: str, name: str) -> tuple[type, ...]:
    """`module.name` if `module` is already imported, else nothing to catch: only a command that
    imported the launcher (and torch) can raise its exceptions, and importing them just to catch
    them would cost `fsdprun config` a second and a half of torch. (An except clause evaluates
    its expression only when an exception reaches it.)"""
    mod = sys.modules.get(module)
    return (getattr(mod, name),) if mod is not None else ()


def guarded(fn):
    """Turn UserError into one line + exit 2, a StorageError (a write the machine refused) or a
    failed worker into one line + exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            if os.environ.get("FSDPRUN_DEBUG"):
                raise
            raise _fail(str(e), 2) from None
        except StorageError as e:
            if os.environ.get("FSDPRUN_DEBUG"):
                raise
            raise _fail(str(e), 1) from None
        except _loaded("fsdprun.launch.elastic", "WorkerFailed") as e:
            if os.environ.get("FSDPRUN_DEBUG"):
                raise
            raise _fail(str(e), 2 if e.user_error else 1) from None
        except _loaded("fsdprun.launch.elastic", "Stopped") as e:
            err_console.print(str(e))
            raise typer.Exit(e.exit_code) from None
        except (*_loaded(_ELASTIC_API, "SignalException"), KeyboardInterrupt) as e:
            raise _fail(f"aborted ({e})", 130) from None

    return wrapper


def _load(*modules: str) -> None:
    """Import `modules` (torch, the launcher) with Python's cyclic garbage collector paused, then
    freeze what they made. Importing torch makes hundreds of thousands of long-lived objects and
    no garbage, and every full collection on the way walks all of them again: about 0.5 of the
    ~3 CPU s a fresh `fsdprun train` spends importing, on a 2-core CPU VM (2026-12). Frozen,
    later collections (the launcher's, the forked workers') skip them too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


# torch loads it on first use, and every command that builds a model (on the meta device for the
# plan, or FSDP2's hooks in a worker) uses it: loaded with the rest.
DYNAMO = "torch._dynamo"


def _version(value: bool) -> None:
    if value:
        # From the package metadata: importing torch for its version string takes seconds.
        import importlib.metadata  # here: its email parser costs every other command ~20 ms

        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = "not installed"
        print(f"fsdprun {__version__} (torch {torch_version})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print versions.")
    ] = False,
) -> None:
    """Train LLMs with PyTorch FSDP from layered YAML recipes."""


@app.command()
@guarded
@launch_options
def train(
    recipe: Recipe,
    overrides: Overrides = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            help="Run directory (default runs/<recipe>-<time>; multi-node: "
            "runs/<recipe>-<rdzv id>).",
        ),
    ] = None,
    resume: Annotated[
        str,
        typer.Option(
            "--resume",
            help="never: refuse a run directory that holds a run. auto: the command to run "
            "every time a job starts: start the run, continue it from its newest complete "
            "checkpoint, train it again from step 0 when none is complete (earlier logs kept), "
            "or do nothing when it is finished; refuses a run directory of another recipe.",
        ),
    ] = "never",
    *,
    launch: LaunchFlags,
) -> None:
    """Train a recipe: launch the workers, print throughput and memory tables."""
    from fsdprun.children import MODE_ENV
    from fsdprun.config import load_recipe
    from fsdprun.launch.modes import decide

    if resume not in RESUME_CHOICES:
        raise UserError(f"--resume {resume!r}: use one of {', '.join(RESUME_CHOICES)}")
    # torchrun's worker, an srun task, or a node's launcher under a platform (PET_*, SKYPILOT_*)
    # or by hand: decided once, here; the header says which.
    mode = decide(os.environ, launch)
    if mode.is_worker and resume == "auto":
        # Every rank would decide on its own; fsdprun's launcher decides once per node.
        raise UserError(
            "--resume auto is fsdprun's launcher's: run `fsdprun train RECIPE --resume auto` "
            "once per node (docs/cluster.md), not under torchrun or a multi-task srun step "
            "(under torchrun --max-restarts, restarts resume by themselves)"
        )
    all_overrides = [*(overrides or []), *launch_overrides(mode.flags, run_dir)]
    os.environ.update(mode.worker_env)
    os.environ[MODE_ENV] = mode.describe()
    if mode.is_worker:
        from fsdprun.report.notices import show_known_notices

        show_known_notices()  # a rank's log file keeps everything its libraries say
        _load("fsdprun.launch.direct", DYNAMO)
        from fsdprun.launch.direct import run_as_worker

        run_as_worker(recipe, all_overrides)
        return
    # The recipe and its data files are checked before the launcher loads torch (~2 s): a typo
    # or a missing file is refused as fast as `fsdprun config` refuses it. A Hub model not yet
    # cached is downloaded here, once per node, before any worker starts.
    resolved = load_recipe(recipe, all_overrides, hub="download")
    _check_before_launch(resolved.config)
    _load("fsdprun.launch.elastic", DYNAMO)
    from fsdprun.launch.elastic import launch_training

    nodes = resolved.config.launch
    job = nodes.rdzv_id if nodes.nnodes > 1 else None  # every node must name the same folder
    target = Path(resolved.config.output.run_dir or default_run_dir(resolved.name, job=job))
    resolved.config.output.run_dir = str(target)
    launch_training(resolved, target, auto_resume=resume == "auto",
                    nnodes_from=_nnodes_from(mode.flags))  # fmt: skip


# `train --resume`: see fsdprun.launch.resume.resolve_auto.
RESUME_CHOICES = ("never", "auto")


def _nnodes_from(flags: LaunchFlags) -> str:
    """Where launch.nnodes came from: a flag, a platform's variable, else the recipe."""
    return flags.source("nnodes") if flags.nnodes is not None else "launch.nnodes"


def _check_data(cfg) -> None:
    from fsdprun.data.preflight import check_data  # headers and sizes only: no torch, no numpy

    data_problems = check_data(cfg)
    if data_problems:
        raise UserError("; ".join(data_problems))


def _check_before_launch(cfg) -> None:
    """The data files, and a recipe for accelerators on a machine without one."""
    from fsdprun.config import launch_device_problem

    _check_data(cfg)
    problem = launch_device_problem(cfg.launch.device)
    if problem:
        raise UserError(problem)


@app.command()
@guarded
@launch_options
def resume(
    run_dir: Annotated[Path, typer.Argument(help="The run directory to continue.")],
    overrides: Overrides = None,
    step: Annotated[
        int | None, typer.Option("--step", help="Resume from this step's checkpoint.")
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            show_default=False,
            help="Check every file's sha256 against the manifest before loading (reads the "
            "whole checkpoint); a mismatch falls back to the previous complete checkpoint. A "
            "LoRA base's files are read and hashed again too.",
        ),
    ] = False,
    accept_base_change: AcceptBaseOpt = False,
    base: BaseOpt = None,
    *,
    launch: LaunchFlags,
) -> None:
    """Continue a run from its newest complete checkpoint (any world size)."""
    from fsdprun.children import MODE_ENV
    from fsdprun.launch.modes import decide
    from fsdprun.rundir import recipe_path
    from fsdprun.runlock import hold_run_dir

    mode = decide(os.environ, launch)
    if mode.is_worker:
        # Every rank would start a launcher of its own on the same run directory.
        raise UserError(
            "fsdprun resume starts its own launcher: run it once per node, not under torchrun "
            "or a multi-task srun step (under torchrun --max-restarts, restarts resume by "
            "themselves)"
        )
    os.environ[MODE_ENV] = mode.describe()
    launch = mode.flags
    extra = launch_overrides(launch)
    _precheck_resume(run_dir, [*(overrides or []), *extra])
    # Locked before choosing the checkpoint: a run still writing would make the choice stale.
    # Only a run directory gets a lock file (resolve_resume refuses anything else).
    with (
        hold_run_dir(run_dir, node_rank=launch.node_rank or 0)
        if recipe_path(run_dir).is_file()
        else contextlib.nullcontext()
    ):
        _resume(run_dir, overrides, extra, step=step, verify=verify,
                accept_base_change=accept_base_change, base=base,
                nnodes_from=_nnodes_from(launch))  # fmt: skip


def _precheck_resume(run_dir: Path, overrides: list[str]) -> None:
    """What can be told from the run directory's files before torch loads (~2 s): that it is a
    run directory, that the overrides name real keys, that it holds a checkpoint at all.
    `resolve_resume` then checks the rest (completeness, what a resume may change)."""
    from fsdprun.config import launch_device_problem, load_recipe

    if not recipe_path(run_dir).is_file():
        raise UserError(f"{run_dir}: not an fsdprun run directory (no {RECIPE_FILE})")
    cfg = load_recipe(str(recipe_path(run_dir)), overrides, check=False).config
    problem = launch_device_problem(cfg.launch.device)
    if problem:
        raise UserError(problem)
    root = checkpoint_root(run_dir)
    if not root.is_dir() or not any(p.is_dir() and step_of(p) is not None for p in root.iterdir()):
        raise UserError(f"{run_dir}: no checkpoints to resume from (looked in {root})")


def _resume(
    run_dir: Path, overrides: list[str] | None, extra: list[str], *, step: int | None,
    verify: bool, accept_base_change: bool, base: Path | None, nnodes_from: str,
) -> None:  # fmt: skip
    _load("fsdprun.launch.elastic", "fsdprun.launch.resume", DYNAMO)
    from fsdprun.launch.elastic import launch_training
    from fsdprun.launch.resume import resolve_resume

    resume = resolve_resume(
        run_dir, [*(overrides or []), *extra], step=step, verify=verify,
        accept_base_change=accept_base_change, base=base,
    )  # fmt: skip
    resume.announce(run_dir)
    launch_training(resume.resolved, run_dir, resume_from=resume.checkpoint.path,
                    nnodes_from=nnodes_from)  # fmt: skip


@app.command("config")
@guarded
def config_cmd(
    recipe: Recipe,
    overrides: Overrides = None,
    explain_: Annotated[
        bool,
        typer.Option(
            "--explain/--no-explain", show_default=False, help="Show which layer set each key."
        ),
    ] = False,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = None,
) -> None:
    """Print the fully resolved recipe as YAML (exit 2 with the error if it is invalid)."""
    from fsdprun.config import explain, load_recipe

    extra = launch_overrides(LaunchFlags(nproc_per_node=nproc_per_node, nnodes=nnodes))
    resolved = load_recipe(recipe, [*(overrides or []), *extra])
    _check_data(resolved.config)
    sys.stdout.write(explain(resolved) if explain_ else resolved.to_yaml())


@app.command()
def recipes() -> None:
    """List the built-in recipes: where each runs (launch.device, nproc_per_node, nnodes), its
    model's parameter count and what it is for."""
    from fsdprun.config.reference import builtin_recipe_cards
    from fsdprun.fmt import fmt_count

    rows = [(c.name, c.runs_on, fmt_count(c.num_params) if c.num_params else "?", c.description)
            for c in builtin_recipe_cards()]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for name, where, params, desc in rows:
        print(f"{name:<{widths[0]}}  {where:<{widths[1]}}  {params:>{widths[2]}}  {desc}")


@app.command()
@guarded
def status(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.", show_default=False)],
    json_: Annotated[
        bool,
        typer.Option(
            "--json/--no-json", show_default=False, help="Print one JSON document instead of lines."
        ),
    ] = False,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch/--no-watch",
            show_default=False,
            help="Redraw every --interval seconds until the run ends.",
        ),
    ] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between redraws.")] = 5.0,
) -> None:
    """Whether a run is running (who holds its lock: host, pid, since when), its last logged
    step, loss, tokens/s and ETA, restarts, each rank's last heartbeat and the newest complete
    checkpoint, from the run directory's files alone."""
    from fsdprun.tools.status import render_status, run_status, status_json, watch_status

    if watch:

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()  # a batch log or a pipe sees each redraw as it comes

        watch_status(run_dir, interval_s=max(interval, 0.1), write=write)
        return
    doc = run_status(run_dir)
    sys.stdout.write(status_json(doc) + "\n" if json_ else render_status(doc))


@app.command()
def plot(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="One or more run directories.", metavar="RUN_DIR", show_default=False
        ),  # fmt: skip
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="The PNG to write (default RUN_DIR/plot.png for one run, plot.png here for "
            "several).",
        ),
    ] = None,
) -> None:
    """Draw runs' loss (by step and by tokens), learning rate, grad norm, tokens/s and peak
    memory per rank into one PNG; several runs are overlaid with a legend."""
    # Not `guarded`: that imports torch, and plot reads files alone.
    from fsdprun.report.plot import plot_runs

    target = out or (run_dirs[0] / "plot.png" if len(run_dirs) == 1 else Path("plot.png"))
    try:
        # A damaged metrics file is drawn without what could not be read, said in one line.
        plot_runs(run_dirs, target, note=lambda line: diagnostic("note", line))
    except UserError as e:
        if os.environ.get("FSDPRUN_DEBUG"):
            raise
        raise _fail(str(e), 2) from None
    print(f"wrote {target}")


@app.command("inspect-checkpoint")
@guarded
def inspect_checkpoint(
    path: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint folder (RUN_DIR/checkpoints/step-N), a run directory "
            "or its checkpoints/ folder.",
            show_default=False,
        ),
    ],
    json_: JsonTablesOpt = False,
    tensors: Annotated[
        str | None,
        typer.Option(
            "--tensors",
            help="List only tensors whose key matches this glob, e.g. 'model.layers.0.*'.",
        ),
    ] = None,
    diff: Annotated[
        Path | None,
        typer.Option(
            "--diff",
            help="Another checkpoint: show tensors added, removed, or changed in shape or dtype.",
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            show_default=False,
            help="Also read every file and compare it with the manifest's sha256 (exit 1 on a "
            "mismatch).",
        ),
    ] = False,
    full: Annotated[
        bool,
        typer.Option(
            "--full/--no-full",
            show_default=False,
            help="List every tensor (by default: a summary, and the tensors --tensors matches).",
        ),  # fmt: skip
    ] = False,
) -> None:
    """Show what a checkpoint holds and whether it is complete, from its metadata alone.

    Exit 0: complete (every checkpoint of a run directory); 1: incomplete or corrupt; 2: not a
    checkpoint, or a LoRA checkpoint whose base is not the one it was trained on.
    """
    from fsdprun.checkpoint.inspect import base_problem, inspect_path, problem, render

    doc = inspect_path(path, tensors=tensors, diff=diff, verify=verify)
    reason = problem(doc)
    if json_:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    elif doc["kind"] == "run" or doc["complete"]:
        render(doc, output_console(highlight=False), full=full or tensors is not None)
    if reason:
        raise _fail(reason, 1)
    if changed := base_problem(doc):
        raise _fail(changed, 2)


@app.command()
@guarded
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A complete checkpoint folder (RUN_DIR/checkpoints/step-N).")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Output folder; must be new or empty (never overwritten).")
    ],
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="safetensors (streamed, low memory), torch "
            "(pytorch_model.bin via torch.save; one output shard in memory), hf (a "
            "HuggingFace model folder: config.json plus HF-named safetensors, streamed; for a "
            "LoRA checkpoint the base rebuilt on the CPU with the adapters merged) or peft (a "
            "LoRA checkpoint's adapters as peft's adapter folder).",
        ),
    ] = "safetensors",
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", help="Convert floating tensors to bf16 or fp32 (default: keep as saved)."
        ),
    ] = None,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size",
            help="Split into files of at most this size (5GB, "
            "500MB, 2GiB) with a HuggingFace-style index.",
        ),
    ] = "5GB",
    base: BaseOpt = None,
    accept_base_change: AcceptBaseOpt = False,
) -> None:
    """Write a checkpoint's model weights as full tensors: no model, GPU or process group."""
    _load("fsdprun.checkpoint.export")
    from fsdprun.checkpoint.export import export_checkpoint
    from fsdprun.fmt import fmt_bytes, fmt_count

    result = export_checkpoint(
        checkpoint, out, fmt=format_, dtype=dtype, max_shard_size=max_shard_size, base=base,
        accept_base_change=accept_base_change,
    )  # fmt: skip
    for key in result.skipped:
        diagnostic("warning", f"{key} is not a tensor; not exported")
    for note in result.notes:
        diagnostic("note", note)
    print(
        f"exported {result.num_tensors} tensors ({fmt_count(result.num_params)} params, "
        f"{fmt_bytes(result.total_bytes)}) from {checkpoint} to {out}: {', '.join(result.files)}"
    )


@app.command("prepare-data")
@guarded
def prepare_data_cmd(
    inputs: Annotated[
        list[Path], typer.Argument(help=".txt or .jsonl files to tokenize.", show_default=False)
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Output folder; must be new or empty (never overwritten).")
    ],
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer",
            help="`byte` (built in, 257 tokens), the path of a HuggingFace tokenizer.json "
            "(needs the tokenizers package) or a Hub model id (ORG/NAME; its tokenizer).",
        ),
    ] = "byte",
    val_fraction: Annotated[
        float,
        typer.Option("--val-fraction", help="Write the last fraction of the tokens to val.bin."),
    ] = 0.0,
    text_field: Annotated[
        str, typer.Option("--text-field", help=".jsonl: the field holding the text.")
    ] = "text",
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="`text`, or fine-tuning examples: `chat`, `instruct`, `hf_dataset` (tokens plus "
            "loss mask and example boundaries; --tokenizer is then `byte`, a tokenizer.json or "
            "a HuggingFace folder, which chat needs for its chat template).",
        ),
    ] = "text",
    chat_turns: Annotated[
        str, typer.Option("--chat-turns", help="chat: which assistant turns train (all, last).")
    ] = "all",
    prompt_field: Annotated[
        str, typer.Option("--prompt-field", help="instruct: the prompt field.")
    ] = "prompt",
    response_field: Annotated[
        str, typer.Option("--response-field", help="instruct: the response field.")
    ] = "response",
    template: Annotated[
        str | None,
        typer.Option("--template", help="instruct: the text before the response, with {prompt}."),
    ] = None,
    eos_token: Annotated[
        str | None,
        typer.Option(
            "--eos-token",
            help="The end-of-text token after each document (data.eos_token): default found in "
            "the tokenizer's folder or vocabulary; `none`: no separator.",
        ),
    ] = None,
    role: Annotated[
        list[str] | None,
        typer.Option("--role", help="chat: NAME=ROLE maps a role onto system/user/assistant."),
    ] = None,
    max_line_bytes: Annotated[
        int,
        typer.Option("--max-line-bytes", help="Fine-tuning examples: the largest line, bytes."),
    ] = 1 << 20,
) -> None:
    """Tokenize text into token files (train.bin, val.bin) and data.json for data.source=tokens;
    with --source chat|instruct|hf_dataset, fine-tuning examples with their loss masks."""
    from fsdprun.config.hub import hub_folder, is_hub_id

    if tokenizer != "byte" and is_hub_id(tokenizer):  # a Hub id: its cached tokenizer files
        folder = hub_folder(tokenizer, key="--tokenizer", mode="download")
        tokenizer = str(folder / "tokenizer.json" if source == "text" else folder)
    if source != "text":
        from fsdprun.data.prepared import prepare_sft_examples

        desc = prepare_sft_examples(
            inputs, out, source=source, tokenizer=tokenizer, val_fraction=val_fraction,
            chat_turns=chat_turns, prompt_field=prompt_field, response_field=response_field,
            template=template, roles=role, max_line_bytes=max_line_bytes, eos_token=eos_token,
        )  # fmt: skip
        files = ", ".join(
            f"{name} ({f['num_examples']:,} examples, {f['num_tokens']:,} tokens, "
            f"{f['num_trained_tokens']:,} trained)"
            for name, f in desc["files"].items()
        )
        print(f"wrote {desc['source']} examples (tokenizer {desc['tokenizer']}) to {out}: {files}")
        return
    from fsdprun.data.text import prepare_data

    desc = prepare_data(
        inputs, out, tokenizer=tokenizer, val_fraction=val_fraction, text_field=text_field,
        eos_token=eos_token,
    )  # fmt: skip
    files = ", ".join(f"{name} ({f['num_tokens']:,} tokens)" for name, f in desc["files"].items())
    print(
        f"wrote {desc['num_tokens']:,} {desc['dtype']} tokens (tokenizer {desc['tokenizer']}, "
        f"vocabulary {desc['vocab_size']:,}) to {out}: {files}, data.json"
    )


@app.command()
@guarded
def download(
    hub_ids: Annotated[
        list[str],
        typer.Argument(
            help="Hugging Face Hub model ids (ORG/NAME), as model.hf_path or data.tokenizer "
            "name them.",
            metavar="HUB_ID",
            show_default=False,
        ),
    ],
    tokenizer_only: Annotated[
        bool,
        typer.Option(
            "--tokenizer-only/--no-tokenizer-only",
            show_default=False,
            help="Only the tokenizer files and chat template (what data.tokenizer reads).",
        ),
    ] = False,
) -> None:
    """Download models from the Hugging Face Hub into its local cache (HF_HOME, HF_HUB_CACHE)
    before a run: for a cluster whose nodes train offline (HF_HUB_OFFLINE=1) from one cache."""
    from fsdprun.config.hub import hub_folder, is_hub_id

    key = "data.tokenizer" if tokenizer_only else "model.hf_path"
    for hub_id in hub_ids:
        if not is_hub_id(hub_id):
            raise UserError(f"{hub_id!r}: not a Hub model id (ORG/NAME), or a local path already")
        print(f"{hub_id}: {hub_folder(hub_id, key=key, mode='download', downloading=True)}")


@app.command()
@guarded
def plan(
    recipe: Recipe,
    overrides: Overrides = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="Ranks in all (default: the recipe's launch.nproc_per_node x launch.nnodes); the "
            "recipe's nproc_per_node is kept when it divides, else one node.",
        ),
    ] = None,
    nnodes: Annotated[int | None, typer.Option("--nnodes", help="Number of nodes.")] = None,
    device_memory: Annotated[
        str | None,
        typer.Option(
            "--device-memory",
            help="Memory of one device (80GB, 141GB, 24GiB) for fits / does not fit "
            "(default: launch.device_memory_gb).",
        ),
    ] = None,
    json_: JsonTablesOpt = False,
    plot_: PlotOpt = None,
    full: Annotated[
        bool,
        typer.Option(
            "--full/--no-full",
            show_default=False,
            help="Also print the table of FSDP units and the engine's knobs (by "
            "default: a one-line summary of the units).",
        ),  # fmt: skip
    ] = False,
) -> None:
    """Plan FSDP units and per-rank memory (full, grad_op, hybrid, ddp); allocates no model."""
    from fsdprun.config import parse_size
    from fsdprun.report.console import render_plan

    _load("fsdprun.tools.plan", DYNAMO)
    from fsdprun.tools.plan import plan_recipe

    if plot_ is not None:
        from fsdprun.report.plot import check_png_target

        check_png_target(plot_, "--plot")
    memory = None
    if device_memory:
        expected = "a size such as 80GB, 141GB or 24GiB"
        memory = parse_size(
            device_memory, option="--device-memory", expected=expected, bare_unit="GB"
        )
    result = plan_recipe(
        recipe, overrides or [], world_size=world_size, nnodes=nnodes, device_memory_bytes=memory,
        device_memory_text=device_memory.strip() if device_memory else None,
    ).to_dict()  # fmt: skip
    _show(result, json_=json_, render=lambda c: render_plan(result, c, full=full), plot=plot_,
          figure="plan_figure")  # fmt: skip


@app.command("compare")
@guarded
@launch_options
def compare_cmd(
    recipe: Recipe,
    overrides: Overrides = None,
    configs: Annotated[
        str,
        typer.Option(
            "--configs",
            help="Comma-separated engine[:sharding][:tpN][:cpN][:ppN][:epN] list, e.g. "
            "ddp,fsdp1,fsdp2:grad_op,fsdp2:cp2 (engines ddp, fsdp1, fsdp2; shardings full, "
            "grad_op, hybrid, hybrid_zero2, none; tpN / cpN / ppN / epN: parallel.tp / "
            "parallel.cp / parallel.pp / parallel.ep, fsdp2 only). Ratios are relative to the "
            "first.",
        ),
    ] = "ddp,fsdp1,fsdp2",
    steps: Annotated[int | None, typer.Option("--steps", help="train.steps for every run.")] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            help="Holds one run directory per configuration "
            "(default runs/compare-<recipe>-<time>).",
        ),
    ] = None,
    json_: JsonOpt = False,
    markdown_: Annotated[
        bool,
        typer.Option(
            "--markdown/--no-markdown", show_default=False, help="Print the table as Markdown."
        ),
    ] = False,
    plot_: PlotOpt = None,
    *,
    launch: LaunchFlags,
) -> None:
    """Run a recipe under several engines/shardings (same seed and data) and compare them side
    by side: tokens/s, step time, peak memory, model state per rank, final loss."""
    from fsdprun.config import load_recipe
    from fsdprun.launch.modes import forget_platform
    from fsdprun.tools.compare import Interrupted, compare, markdown, parse_configs, render

    # Its runs are this node's alone, launched as the typed flags and the recipe say: their
    # `fsdprun train` must not take a platform's node count and rank from the environment.
    forget_platform(os.environ)
    if launch.num_nodes not in (None, 1) or launch.node_rank not in (None, 0):
        # Each configuration is a run of its own, under a run directory named here.
        raise UserError(
            "compare runs its configurations on this node only: drop --nnodes/--node-rank, or "
            "compare across nodes with `fsdprun train` of each configuration on every node"
        )

    chosen = parse_configs(configs)
    if plot_ is not None:
        from fsdprun.report.plot import check_png_target

        check_png_target(plot_, "--plot")  # before the runs, not after them
    extra = [f"train.steps={steps}"] if steps is not None else []
    extra += launch_overrides(launch)
    all_overrides = [*(overrides or []), *extra]
    # A Hub model is downloaded here, once: each configuration's run then finds it cached.
    resolved = load_recipe(recipe, all_overrides, hub="download")
    _check_before_launch(resolved.config)  # before "comparing ...": a refusal is one line
    name = resolved.name
    target = run_dir or Path(str(default_run_dir(f"compare-{name}")))
    quiet = json_ or markdown_

    def progress(result) -> None:
        if not quiet:
            state = "ok" if result.ok else f"failed: {result.error}"
            err_console.print(f"  {result.label}: {state} ({result.wall_s:.1f} s)")

    if not quiet:
        err_console.print(f"comparing {len(chosen)} configurations of {name}; runs in {target}")
    try:
        report = compare(recipe, all_overrides, chosen, target, on_result=progress)
    except Interrupted as e:  # SIGTERM/SIGINT, forwarded to the run in progress
        err_console.print(str(e))
        raise typer.Exit(e.exit_code) from None
    if markdown_ and not json_:
        sys.stdout.write(markdown(report))
    _show(report, json_=json_, render=None if markdown_ else lambda c: render(report, name, c),
          plot=plot_, figure="compare_figure")  # fmt: skip
    if any(not r["ok"] for r in report["results"]):
        raise typer.Exit(1)


@app.command("tune")
@guarded
@launch_options
def tune_cmd(
    recipe: Recipe,
    overrides: Overrides = None,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Folder for trials.jsonl, the trials and tuned.yaml; the same "
            "--out again continues a search without repeating finished trials.",
        ),
    ] = ...,  # fmt: skip
    budget: Annotated[
        str, typer.Option("--budget", help="Time for the whole search (20m, 90s, 1h).")
    ] = "20m",
    device_memory: Annotated[
        str | None,
        typer.Option(
            "--device-memory",
            help="Memory of one device for pruning (80GB, 24GiB); "
            "default: the accelerator's free memory, measured; required on CPU.",
        ),
    ] = None,  # fmt: skip
    space: Annotated[
        list[str] | None,
        typer.Option(
            "--space",
            help="KEY=V1,V2 (repeatable): search these knobs only; add "
            "`--space defaults` to change only these knobs of the default space.",
        ),
    ] = None,  # fmt: skip
    allow_numerics: Annotated[
        bool,
        typer.Option(
            "--allow-numerics/--no-allow-numerics",
            show_default=False,
            help="Also search knobs that change the numerics "
            "(precision.*); their candidates are marked.",
        ),
    ] = False,  # fmt: skip
    steps: Annotated[
        int, typer.Option("--steps", help="Measured steps per trial in the first round.")
    ] = 4,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Trials of each finalist in the last round.")
    ] = 2,
    finalists: Annotated[
        int, typer.Option("--finalists", help="Challengers that reach the last round.")
    ] = 2,
    confirm: Annotated[
        int,
        typer.Option(
            "--confirm",
            help="Interleaved pairs of the winner and the starting recipe run after the "
            "search, each trial as long as the last round's, to measure the gain (0: none).",
        ),
    ] = 3,
    trial_timeout: Annotated[
        float | None,
        typer.Option(
            "--trial-timeout",
            help="Seconds before a trial counts as hung and is "
            "killed (default: 4x the expected trial time, at least 300; x2 with compile).",
        ),
    ] = None,  # fmt: skip
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run/--no-dry-run",
            show_default=False,
            help="Print the space, the pruning and the order; run nothing.",
        ),
    ] = False,
    json_: JsonOpt = False,
    plot_: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Also draw tokens/s against peak memory, the Pareto front marked, into this PNG.",
        ),
    ] = None,  # fmt: skip
    *,
    launch: LaunchFlags,
) -> None:
    """Choose the FSDP knobs on this hardware: plan prunes, short measured trials decide, the
    winner is written as a recipe layer (OUT/tuned.yaml)."""
    from fsdprun.config import load_recipe, parse_size
    from fsdprun.tools.tune import Interrupted, TuneArgs, parse_duration, render, tune
    from fsdprun.tools.tune.nodes import NodeLost

    if plot_ is not None:
        from fsdprun.report.plot import check_png_target

        check_png_target(plot_, "--plot")
    from fsdprun.launch.modes import decide, forget_platform

    # As for train: a task of a multi-task srun step is a worker (which tune refuses to be),
    # one task per node with --nnodes is that node's launcher, and so is each node of a
    # platform that sets PET_* or SKYPILOT_* variables.
    mode = decide(os.environ, launch)
    os.environ.update(mode.worker_env)
    forget_platform(os.environ)
    launch = mode.flags
    memory = None
    if device_memory:
        memory = parse_size(device_memory, option="--device-memory",
                            expected="a size such as 80GB or 24GiB", bare_unit="GB")  # fmt: skip
    # A Hub model is downloaded before the search, once: every trial then finds it cached.
    load_recipe(
        recipe, [*(overrides or []), *launch_overrides(launch)], check=False, hub="download"
    )
    args = TuneArgs(
        recipe=recipe, overrides=list(overrides or []), launch_overrides=launch_overrides(launch),
        launch_flags=launch.typed(), out_dir=out, budget_s=parse_duration(budget, "--budget"),
        device_memory_bytes=memory, space=list(space or []), allow_numerics=allow_numerics,
        steps=steps, repeats=repeats, finalists=finalists, confirm=confirm,
        trial_timeout_s=trial_timeout, dry_run=dry_run,
    )  # fmt: skip

    def say(text: str) -> None:
        err_console.print(text, markup=False)

    try:
        report = tune(args, say=None if json_ else say)
    except Interrupted as e:  # SIGINT/SIGTERM: the trial in progress went with tune
        err_console.print(str(e), markup=False)
        raise typer.Exit(e.exit_code) from None
    except NodeLost as e:  # another node of a multi-node tune went away: nothing of ours lost
        if os.environ.get("FSDPRUN_DEBUG"):
            raise
        raise _fail(str(e), 1) from None
    if dry_run:
        if json_:
            _write_json(report)
        return
    _show(report, json_=json_, render=lambda c: render(report, c), plot=plot_,
          figure="tune_figure")  # fmt: skip


def _show(document: dict, *, json_: bool, render, plot: Path | None, figure: str) -> None:
    """A command's document on stdout, as JSON or through `render(console)` (None: printed
    already), and its figure (`fsdprun.report.plot.<figure>`) drawn into `plot`."""
    if json_:
        _write_json(document)
    elif render is not None:
        render(output_console(highlight=False))
    if plot is not None:
        from fsdprun.report import plot as plots

        tmp = plot.with_name(f".{plot.name}.tmp-{os.getpid()}")
        try:
            # Drawn beside it, then renamed: a picture already there is never left half written.
            getattr(plots, figure)(document).savefig(tmp, dpi=plots.DPI, format="png")
            os.replace(tmp, plot)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise write_error(f"cannot write --plot {plot}", e, option="--plot") from None
        err_console.print(f"wrote {plot}")


def _write_json(document: dict) -> None:
    """One JSON document on stdout, flushed now, so that a full disk behind `> file` is one line
    here (exit 1), not a traceback at exit."""
    try:
        sys.stdout.write(json.dumps(document, indent=1) + "\n")
        sys.stdout.flush()
    except OSError as e:
        # What stays buffered would fail again as Python exits: let it drain into /dev/null.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        raise StorageError(
            f"cannot write the JSON document to standard output: "
            f"{describe_os_error(e)}; send it where there is room"
        ) from None


def _one_line_paragraphs(text: str) -> str:
    """`text` with each paragraph (blank lines separate them) on one line."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n"))


# rich rewraps a help paragraph to the terminal's width only when it is one line: typer keeps a
# docstring's line breaks (in the command list, and in a command's later paragraphs; which, differs
# between typer versions), so a description wrapped for the source broke mid-sentence at any width.
for _command in app.registered_commands:
    _command.help = _one_line_paragraphs(_command.help or inspect.getdoc(_command.callback) or "")


def main() -> None:
    from fsdprun.limits import ensure_open_file_limit

    # First: with too few file descriptors the imports below fail inside Python's importer.
    try:
        ensure_open_file_limit()
    except UserError as e:
        if os.environ.get("FSDPRUN_DEBUG"):
            raise
        _fail(str(e), 2)
        sys.exit(2)
    if "TORCH_CPP_LOG_LEVEL" not in os.environ and not os.environ.get("FSDPRUN_DEBUG"):
        # Keep torch's C++ logging (e.g. every failed rendezvous connect, with a stack) out of
        # this console: fsdprun reports failures in one line. torch reads this when it loads, so
        # it is set before the first import; workers get the user's setting back (launch.py).
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        os.environ[CPP_LOG_MARK] = "1"
    if not os.environ.get("FSDPRUN_DEBUG"):
        from fsdprun.report.notices import hide_known_notices

        # The libraries' known deprecation notices, likewise: the first line of a run is its
        # header. Named, each with its reason, in fsdprun.report.notices.
        hide_known_notices()
    app()
