"""Starting the workers of a run with torch's own elastic launcher, in this process.

`launch_training` writes the resolved recipe to RUN_DIR/recipe.yaml once (workers read that
file, never the command line), starts `nproc_per_node` workers through
`torch.distributed.launcher.api.elastic_launch` over a c10d rendezvous (loopback for one node,
the user's endpoint for several), follows RUN_DIR/metrics.jsonl to render the report, and turns
a worker failure into one line naming the rank, the error and the log file.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdprun.checkpoint import read_manifest, set_aside_after
from fsdprun.children import handled_signals
from fsdprun.compile_cache import check_cache_dir
from fsdprun.config import RecipeConfig, ResolvedRecipe, accelerator_device_nodes
from fsdprun.data import save_tokenized
from fsdprun.data.preflight import check_data
from fsdprun.device import check_nproc, memory_per_rank, resolve_device_kind
from fsdprun.engines.float8 import check_float8
from fsdprun.engines.preflight import check_model
from fsdprun.errors import StorageError, UserError, diagnostic, write_error
from fsdprun.launch.killed import describe_sigkill, is_sigkill
from fsdprun.launch.rendezvous import (
    NNODES_FROM_CONF,
    NODE_RANK_CONF,
    NODES_BACKEND,
    NodesDisagree,
    RendezvousProgress,
    wait_for_host,
)
from fsdprun.launch.resume import resolve_auto
from fsdprun.loopback import LOOPBACK_ADDR, RDZV_BACKEND, endpoint_is_local, single_node_env
from fsdprun.report.console import MetricsFollower, Reporter
from fsdprun.report.metrics import MetricsLog, drop_all_steps
from fsdprun.report.trackers import tracker_folder_errors
from fsdprun.rundir import (
    RunDirWatch,
    checkpoint_root,
    earlier_recipe_path,
    logs_dir,
    recipe_header,
    recipe_path,
    stop_path,
    tokenized_dir,
)
from fsdprun.runlock import hold_run_dir
from fsdprun.tools.plan import hardware_warnings
from fsdprun.train.guard import (
    LAUNCHER_PID_ENV,
    PEER_LOST,
    clear_verdict,
    read_verdict,
    request_stop,
)
from fsdprun.train.worker import elastic_entry


class Stopped(Exception):
    """The run stopped early on request (SIGTERM/SIGINT) after saving a checkpoint."""

    def __init__(self, message: str, *, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _StopOnSignal:
    """SIGINT/SIGTERM to the launcher: the first asks the workers to save a checkpoint at the
    next step and stop (they agree on the step); the second aborts at once."""

    def __init__(self, run_dir: Path, watch: RunDirWatch):
        self.run_dir, self.watch = run_dir, watch
        self.signum: int | None = None

    def handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            # The agent then kills the workers with SIGKILL: no grace period.
            raise SignalException(f"second {name}: aborting", sigval=signal.SIGKILL)
        self.signum = signum
        if self.watch.vanished():
            # No STOP file under a vanished (or recreated) RUN_DIR: the workers find it gone
            # themselves at their next step and stop there.
            print(
                f"{name}: the run directory {self.run_dir} is gone; the workers stop at the next "
                f"step ({name} again aborts at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        request_stop(self.run_dir, name)
        print(
            f"{name}: saving a checkpoint at the end of this step, then stopping "
            f"({name} again aborts at once)",
            file=sys.stderr,
            flush=True,
        )


class WorkerFailed(Exception):
    """A worker exited with an error; the message is one line (rank, error, log file)."""

    def __init__(self, message: str, *, user_error: bool):
        super().__init__(message)
        self.user_error = user_error


def prepare_run_dir(run_dir: Path, resolved: ResolvedRecipe) -> None:
    """Create the run directory and write the resolved recipe; never overwrite an earlier run.

    Raises:
        UserError: the directory already holds a run, or cannot be written.
    """
    cfg = resolved.config
    if checkpoint_root(run_dir).exists():
        raise UserError(
            f"{run_dir} already holds checkpoints; continue it with `fsdprun resume {run_dir}` "
            "or choose another --run-dir"
        )
    if (run_dir / cfg.output.metrics_file).exists():
        raise UserError(
            f"{run_dir} already holds a run; choose another --run-dir (fsdprun never "
            "overwrites a run)"
        )
    write_recipe(run_dir, resolved)


def write_recipe(run_dir: Path, resolved: ResolvedRecipe) -> None:
    """Write RUN_DIR/recipe.yaml; the one there before, where it differs (a resume that changed
    keys), is kept as recipe.N.yaml.

    Every node of a multi-node run calls this, and nodes may share RUN_DIR (one volume): so
    recipe.yaml is replaced atomically (a node reading it meanwhile, `fsdprun resume` resolving
    the run, sees the old or the new one, never none), a node that finds the new one there
    already writes nothing, and an earlier recipe is kept once by its content (the second node
    finds its copy there and keeps none).
    """
    target = recipe_path(run_dir)
    text = f"{recipe_header(resolved.name)}\n{resolved.to_yaml()}"
    try:
        logs_dir(run_dir).mkdir(parents=True, exist_ok=True)
        try:
            current = target.read_text()
        except FileNotFoundError:
            current = None
        if current != text:
            if current is not None:
                _keep_earlier_recipe(run_dir, current)
            with _written(run_dir, text) as tmp:
                os.replace(tmp, target)
    except OSError as e:
        raise UserError(f"cannot write the run directory {run_dir}: {e.strerror}") from e


@contextlib.contextmanager
def _written(run_dir: Path, text: str):
    """A new file of RUN_DIR holding `text`, named for this writer alone; removed after unless
    the caller moved it."""
    import tempfile

    fd, name = tempfile.mkstemp(dir=run_dir, prefix=".recipe.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o644)  # as a recipe.yaml written in place (mkstemp's is 0600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def _keep_earlier_recipe(run_dir: Path, text: str) -> None:
    """`text` (an earlier recipe.yaml) as the first free recipe.N.yaml, unless some
    recipe.N.yaml holds it already. Put into place whole, so a node that finds the name taken
    reads the other's complete copy."""
    with _written(run_dir, text) as tmp:
        n = 1
        while True:
            kept = earlier_recipe_path(run_dir, n)
            try:
                _place(tmp, kept)
                return
            except FileExistsError:
                if kept.read_text() == text:
                    return
            n += 1


def _place(tmp: Path, kept: Path) -> None:
    """`tmp` also at `kept`, which must not exist (FileExistsError): a hard link, or on a volume
    without them an exclusively created copy."""
    try:
        os.link(tmp, kept)
    except FileExistsError:
        raise
    except OSError:
        with kept.open("x") as f:
            f.write(tmp.read_text())


def _set_aside_abandoned(run_dir: Path, resume_from: Path) -> None:
    step = read_manifest(resume_from)["step"]
    moved = set_aside_after(run_dir, step)
    if moved:
        diagnostic(
            "note",
            f"set aside {len(moved)} checkpoint(s) after step {step}, which this resume "
            f"abandons: {', '.join(p.name for p in moved)}",
        )


def _set_aside_earlier_session(run_dir: Path, cfg: RecipeConfig) -> None:
    """Before a run trains again from step 0 (`--resume auto` with no complete checkpoint):
    its incomplete checkpoints moved aside (a save of the same step would move them anyway),
    and its metrics' step records dropped, the file as it was kept (as an elastic restart
    without a checkpoint does). TensorBoard drops the earlier steps itself (purge_step)."""
    moved = set_aside_after(run_dir, 0)
    kept = drop_all_steps(run_dir / cfg.output.metrics_file)
    said = [f"{len(moved)} incomplete checkpoint(s) set aside"] if moved else []
    said += [f"the earlier sessions' metrics kept as {kept.name}"] if kept is not None else []
    if said:
        diagnostic("note", "; ".join(said))


@dataclass(frozen=True)
class LaunchPlan:
    """What `elastic_launch` is given, derived from the recipe (testable without launching)."""

    config: LaunchConfig
    omp_threads: int
    env: dict[str, str]  # set in this process before the launch (the workers inherit it)


def build_launch_plan(
    cfg: RecipeConfig, run_dir: Path, *, device_kind: str, method: str | None = None,
    endpoint: str | None = None, nnodes_from: str = "launch.nnodes",
) -> LaunchPlan:  # fmt: skip
    """The elastic agent's configuration; `method` = how workers start (default:
    `start_method(device_kind)`), `endpoint` = launch.rdzv_endpoint with its host resolved
    (`wait_for_host`; default launch.rdzv_endpoint as it is), `nnodes_from` = where
    launch.nnodes came from (`--nnodes`, a platform's variable), for a message naming it."""
    launch = cfg.launch
    # read_timeout bounds the wait for the rendezvous store itself (an endpoint that never
    # answers), join_timeout the wait for the other nodes.
    rdzv_configs: dict = {
        "join_timeout": launch.rdzv_timeout_s,
        "read_timeout": launch.rdzv_timeout_s,
    }
    if launch.nnodes > 1:
        # Node 0 hosts the rendezvous store; the others only connect to it. fsdprun's
        # rendezvous checks that the nodes agree and gives node N group rank N
        # (fsdprun.launch.rendezvous).
        rdzv_configs.update({"is_host": launch.node_rank == 0, NODE_RANK_CONF: launch.node_rank,
                             NNODES_FROM_CONF: nnodes_from})  # fmt: skip
    rdzv_configs.update(launch.rdzv_conf)  # the user's --rdzv-conf settles what it names
    # A single node binds the rendezvous to loopback with a free port, and everything else of the
    # run to loopback too (fsdprun.launch.loopback): nothing listens outside.
    endpoint = endpoint or launch.rdzv_endpoint or f"{LOOPBACK_ADDR}:0"
    local = launch.nnodes == 1 and endpoint_is_local(launch.rdzv_endpoint)
    cpus = os.cpu_count() or 1
    omp = max(1, cpus // launch.nproc_per_node) if device_kind == "cpu" else 1
    config = LaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=launch.nproc_per_node,
        run_id=launch.rdzv_id,
        role=launch.role,
        rdzv_backend=RDZV_BACKEND if local else NODES_BACKEND,
        rdzv_endpoint=endpoint,
        local_addr=endpoint.rpartition(":")[0] if local else None,
        rdzv_configs=rdzv_configs,
        max_restarts=launch.max_restarts,
        start_method=method or start_method(device_kind),
        monitor_interval=launch.monitor_interval_s,
        # As torchrun --log-dir/--redirects/--tee/--local-ranks-filter: by default every rank's
        # streams go to its files only, and the console shows the launcher's report alone.
        logs_specs=DefaultLogsSpecs(
            log_dir=str(logs_dir(run_dir, launch.log_dir)),
            redirects=Std.from_str(launch.redirects),
            tee=Std.from_str(launch.tee),
            local_ranks_filter=set(launch.local_ranks_filter) or None,
        ),
        # fsdprun handles SIGINT/SIGTERM itself (stop at a checkpoint); the agent keeps the others.
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    return LaunchPlan(config=config, omp_threads=omp, env=single_node_env() if local else {})


START_METHODS = ("spawn", "fork", "forkserver")


def start_method(device_kind: str) -> str:
    """How the agent starts workers: `fork` for CPU ranks on a machine without accelerators (the
    workers inherit the imported torch: about 5 s less per launch on a 2-core machine), `spawn`
    otherwise: on accelerators, and for CPU ranks on a GPU machine too, where this process may
    have touched the CUDA driver (torch's device count, a library's import-time check) and a
    forked child then fails at its first CUDA call ("CUDA error: initialization error": a CPU
    fine-tuning run on an H200 machine). FSDPRUN_START_METHOD overrides it.

    Raises:
        UserError: FSDPRUN_START_METHOD is not spawn, fork or forkserver.
    """
    chosen = os.environ.get("FSDPRUN_START_METHOD")
    if chosen is None:
        return "fork" if device_kind == "cpu" and not accelerator_device_nodes() else "spawn"
    if chosen not in START_METHODS:
        raise UserError(f"FSDPRUN_START_METHOD={chosen!r}: use one of {', '.join(START_METHODS)}")
    return chosen


def describe_failure(
    err: ChildFailedError, run_dir: Path, *, cfg: RecipeConfig | None = None, device_kind="cpu"
) -> WorkerFailed:
    verdict = read_verdict(run_dir)
    if verdict is not None:
        # A rank found others unresponsive: that is the cause, whichever rank the agent saw
        # fail first (the frozen one it killed, or one that lost its connection).
        log = verdict.get("log")
        where = f"; log: {log}" if log and Path(log).exists() else ""
        return WorkerFailed(f"rank {verdict['rank']} failed: {verdict['message']}{where}",
                            user_error=False)  # fmt: skip
    killed = [(r, f) for r, f in err.failures.items() if is_sigkill(f.exitcode)]
    if killed:
        # A rank killed by SIGKILL (the OOM killer, most often) left no error file; the others
        # only lost their connection to it, and may have been seen to fail first.
        rank, failure = min(killed, key=lambda item: item[1].timestamp)
        return WorkerFailed(describe_sigkill(
            run_dir, rank=rank, pid=failure.pid, local_rank=failure.local_rank, cfg=cfg,
            device_kind=device_kind,
        ), user_error=False)  # fmt: skip
    # The first failure, but never a rank that only lost its connection to one that failed on
    # its own. The agent reports one failed worker of a node, the first it finds exited (which
    # may be the one that lost its peer, when both exited between two of its polls); the other
    # workers of the attempt left their error files beside it.
    attempt = _attempt_dir(err.failures)
    failures = {**_siblings(attempt, err.failures), **err.failures}
    messages = {rank: _first_line(f) for rank, f in failures.items()}
    rank = min(failures, key=lambda r: (PEER_LOST in messages[r], failures[r].timestamp, r))
    failure, message = failures[rank], messages[rank]
    # Its log is in its own folder of the attempt, error file or not.
    log = attempt / str(failure.local_rank) / "stderr.log" if attempt is not None else None
    where = f"; log: {log}" if log is not None and log.is_file() else ""
    user_error = message.startswith("UserError: ")
    if user_error:
        return WorkerFailed(message.removeprefix("UserError: ") + where, user_error=True)
    if message.startswith("SaveFailed: "):  # every rank failed the save together: no culprit
        return WorkerFailed(message.removeprefix("SaveFailed: ") + where, user_error=False)
    return WorkerFailed(f"rank {rank} failed: {message}{where}", user_error=False)


def _log_failure(metrics: Path, error: str) -> None:
    """The line this launcher prints for a failed run, as a `failed` event of its metrics file,
    for `fsdprun status` once the terminal is gone. Best effort: a full disk (the cause, maybe)
    must not hide the error it is about."""
    with contextlib.suppress(OSError):
        log = MetricsLog(metrics)
        log.write("failed", error=error, time=time.time())
        log.close()


def _attempt_dir(failures: dict[int, ProcessFailure]) -> Path | None:
    """This node's folder of the attempt (`.../attempt_N`, a folder per local rank), from the
    error file of a reported worker; None when none wrote one."""
    files = (Path(f.error_file) for f in failures.values())
    return next((file.parent.parent for file in files if file.is_file()), None)


def _siblings(
    attempt: Path | None, failures: dict[int, ProcessFailure]
) -> dict[int, ProcessFailure]:
    """Every worker of the attempt that left an error file (@record's), by global rank."""
    if attempt is None:
        return {}
    rank, reported = next(iter(failures.items()))
    base = rank - reported.local_rank  # a node's ranks are consecutive
    found: dict[int, ProcessFailure] = {}
    for error_file in attempt.glob("*/error.json"):  # torch's DefaultLogsSpecs names it so
        if error_file.parent.name.isdigit():
            local_rank = int(error_file.parent.name)
            with contextlib.suppress(Exception):  # a file being written, or not @record's
                found[base + local_rank] = ProcessFailure(
                    local_rank=local_rank, pid=-1, exitcode=1, error_file=str(error_file)
                )
    return found


def _first_line(failure: ProcessFailure) -> str:
    """A failed worker's error, first line: what @record wrote, else its exit code or signal."""
    if not Path(failure.error_file).is_file() and failure.exitcode >= 0:
        return f"exit code {failure.exitcode}"  # not torch's "To enable traceback see: ..."
    message = failure.message
    if isinstance(message, dict):  # what @record wrote: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    return (message or f"exit code {failure.exitcode}").strip().splitlines()[0]


def _waiting(cfg: RecipeConfig, plan: LaunchPlan) -> RendezvousProgress | None:
    """Waiting lines for a multi-node rendezvous (one node's completes at once)."""
    if cfg.launch.nnodes == 1:
        return None
    return RendezvousProgress(
        plan.config.rdzv_endpoint, nnodes=cfg.launch.nnodes, timeout_s=cfg.launch.rdzv_timeout_s,
        run_id=plan.config.run_id, write=lambda line: print(line, flush=True),
        shown=cfg.launch.rdzv_endpoint,
    )  # fmt: skip


def _attempt_dirs(plan: LaunchPlan) -> set[Path]:
    """The attempts' log folders (LOG_DIR/<run id>_<random>/attempt_N): the agent makes one as it
    starts an attempt's workers, so its rendezvous had completed (a new launch, a new folder)."""
    return set(Path(plan.config.logs_specs.root_log_dir).glob("*/attempt_*"))


def _rendezvous_failed(
    err: RendezvousError, cfg: RecipeConfig, plan: LaunchPlan, waiting: RendezvousProgress | None,
    *, attempts_before: set[Path],
) -> UserError | WorkerFailed:  # fmt: skip
    """One line for a rendezvous that failed: the nodes that came when it timed out, else the
    cause (a port in use, an endpoint that does not answer); or, once the run had started, the
    store on node 0 that went away with it (exit 1, as the job's other nodes)."""
    endpoint, timeout = cfg.launch.rdzv_endpoint, cfg.launch.rdzv_timeout_s
    if isinstance(err, NodesDisagree):
        return UserError(str(err))
    if _attempt_dirs(plan) - attempts_before:
        # The agent keeps talking to the store on node 0 while its workers run: a node 0 that
        # exited or died (its own log says why) ends the run here as well.
        return WorkerFailed(
            f"lost node 0 (the rendezvous store at {endpoint}) while training: it exited or its "
            "host went away; its own log says why. This node stops too",
            user_error=False,
        )
    joined = waiting.joined() if waiting is not None else None
    if isinstance(err, RendezvousTimeoutError) and joined is not None:
        return UserError(
            f"rendezvous at {endpoint} failed within launch.rdzv_timeout_s={timeout}: "
            f"{joined} of {cfg.launch.nnodes} nodes joined after {waiting.waited_s():.0f} s; "
            f"start the other nodes with --nnodes {cfg.launch.nnodes} --rdzv-endpoint "
            f"{endpoint} and their own --node-rank, or raise launch.rdzv_timeout_s"
        )
    cause = next((str(e) for e in (err.__cause__, err) if e is not None and str(e).strip()), "")
    reason = cause.strip().splitlines()[0] if cause else f"timed out ({type(err).__name__})"
    return UserError(
        f"rendezvous at {endpoint} failed within launch.rdzv_timeout_s={timeout}: {reason}; "
        "check that node 0 runs with --node-rank 0, that its port is free there and reachable "
        "from every node"
    )


def _hardware_warnings(cfg: RecipeConfig, kind: str) -> list[str]:
    memory, source = memory_per_rank(kind, cfg.launch.nproc_per_node)
    try:
        return hardware_warnings(
            cfg, device_kind=kind, memory_per_rank_bytes=memory, memory_source=source,
            cpus_per_node=os.cpu_count() or 1,
        )  # fmt: skip
    except Exception:
        # Advisory: a plan that cannot be made (a model family plan does not know) never stops
        # a run that the recipe checks accepted.
        if os.environ.get("FSDPRUN_DEBUG"):
            raise
        return []


def launch_training(
    resolved: ResolvedRecipe, run_dir: Path, *, resume_from: Path | None = None,
    auto_resume: bool = False, nnodes_from: str = "launch.nnodes",
) -> dict | None:  # fmt: skip
    """Run the whole job on this node; returns rank 0's summary when it ran here.

    A new run gets a fresh run directory; a resumed one (`resume_from`, a complete checkpoint)
    appends to its run directory. `auto_resume` (`train --resume auto`): whatever the run
    directory holds of this recipe decides, under its lock (`resolve_auto`): a new run, a
    resume from its newest complete checkpoint, the run again from step 0, or nothing for a
    finished run. `nnodes_from` names where launch.nnodes came from, for the rendezvous'
    messages.

    Raises:
        UserError: a problem with the recipe or the machine (checked before any worker starts).
        WorkerFailed: a worker failed.
    """
    cfg = resolved.config
    if cfg.launch.nnodes > 1 and not cfg.launch.rdzv_endpoint:
        # Checked here rather than in the recipe: multi-node recipes ship without an endpoint.
        raise UserError(
            f"launch.nnodes is {cfg.launch.nnodes}: pass --rdzv-endpoint HOST:PORT (node 0's "
            "address) and --node-rank on every node"
        )
    # Data files: headers and sizes only (recipe validation ran it too; files may have changed).
    data_problems = check_data(cfg)
    if data_problems:
        raise UserError("; ".join(data_problems))
    check_tracker_folders(cfg, run_dir)
    check_cache_dir(cfg.compile.cache_dir)
    check_model(cfg)  # what the workers' build would refuse (meta device; seconds for HF)
    kind = resolve_device_kind(cfg.launch.device.value)
    check_nproc(kind, cfg.launch.nproc_per_node)
    check_float8(cfg.precision.float8.value, kind)  # float8 matmuls need CUDA capability >= 8.9
    for line in _hardware_warnings(cfg, kind):
        diagnostic("warning", line)
    method = start_method(kind)  # a bad FSDPRUN_START_METHOD is refused before RUN_DIR exists
    endpoint = None
    if cfg.launch.nnodes > 1:
        # Node 0's name may not resolve yet (a pod not up): wait for it before writing anything.
        endpoint = wait_for_host(cfg.launch.rdzv_endpoint, timeout_s=cfg.launch.rdzv_timeout_s,
                                 write=lambda line: print(line, flush=True))  # fmt: skip
    # One run per directory: locked before anything is written in it, for the whole run (and
    # before --resume auto reads it: a run still writing would make its choice stale).
    with hold_run_dir(run_dir, node_rank=cfg.launch.node_rank):
        restart = False
        if auto_resume:
            start = resolve_auto(run_dir, resolved)
            for line in start.notes:
                diagnostic("note", line)
            if start.action == "finished":
                print(start.message, flush=True)
                return None
            if start.action == "resume":
                start.resume.announce(run_dir)
                resume_from = start.resume.checkpoint.path
            restart = start.action == "restart"
        return _launch(resolved, run_dir, kind=kind, method=method, resume_from=resume_from,
                       endpoint=endpoint, restart=restart, nnodes_from=nnodes_from)  # fmt: skip


@contextlib.contextmanager
def _removed_at_the_end(folder: Path, watch: RunDirWatch):
    """`folder` of RUN_DIR deleted once the workers are gone (the launcher's saved tokens: a
    copy of the data per run, and per `tune` trial, is no use after it), unless RUN_DIR names
    another directory by then."""
    try:
        yield
    finally:
        if not watch.vanished():
            shutil.rmtree(folder, ignore_errors=True)


def check_tracker_folders(cfg: RecipeConfig, run_dir: Path) -> None:
    """Refuse, before anything is written, a tracker whose folder cannot be written (a tracker
    that fails later only warns: see fsdprun.report.trackers).

    Raises:
        UserError: one line naming each tracker's key, its folder and why.
    """
    problems = tracker_folder_errors(run_dir, tensorboard=cfg.output.tensorboard,
                                     wandb=cfg.output.wandb)  # fmt: skip
    if problems:
        raise UserError("; ".join(problems))


def _launch(
    resolved: ResolvedRecipe, run_dir: Path, *, kind: str, method: str, resume_from: Path | None,
    endpoint: str | None, restart: bool, nnodes_from: str,
) -> dict | None:  # fmt: skip
    cfg = resolved.config
    if resume_from is None and not restart:
        prepare_run_dir(run_dir, resolved)
    else:
        write_recipe(run_dir, resolved)
        if cfg.launch.node_rank == 0:  # one node does it (the run directory is shared)
            if restart:
                _set_aside_earlier_session(run_dir, cfg)
            else:
                _set_aside_abandoned(run_dir, resume_from)
    watch = RunDirWatch(run_dir)  # the directory this run writes to, and only that one
    plan = build_launch_plan(cfg, run_dir, device_kind=kind, method=method, endpoint=endpoint,
                             nnodes_from=nnodes_from)  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", str(plan.omp_threads))
    os.environ.update(plan.env)
    if not os.environ.get("FSDPRUN_DEBUG"):
        # The agent logs every phase at INFO and failures as multi-line reports; fsdprun prints
        # its own one-line summary and points at the per-rank logs instead.
        for name in ("torch.distributed.elastic", "torch.multiprocessing"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    stop_path(run_dir).unlink(missing_ok=True)  # a stop asked of an earlier session
    clear_verdict(run_dir)  # an earlier session's
    if os.environ.pop("_FSDPRUN_QUIET_CPP_LOG", None):
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # workers log as torch does by default
    # Workers die with this process (see guard.die_with_launcher).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if plan.config.start_method == "fork":
        # The workers inherit this heap (torch and all, and the data the preflight tokenized,
        # which they reuse: data.spec). Frozen, their collections skip it: the full one that
        # frees FSDP's state at the end (worker.run) took 0.28 CPU s per worker on the debug
        # recipe, and 0.004 after; their pages of it also stay shared.
        gc.freeze()
    else:
        # Spawned workers inherit nothing: they read what the checks tokenized from RUN_DIR
        # rather than tokenize it again, and this process holds no copy for the whole run.
        try:
            save_tokenized(cfg.data, tokenized_dir(run_dir))
        except OSError as e:
            raise write_error(f"cannot write {tokenized_dir(run_dir)}", e,
                              option="--run-dir") from None  # fmt: skip
    reporter = Reporter()
    waiting = _waiting(cfg, plan)
    attempts_before = _attempt_dirs(plan)
    stop = _StopOnSignal(run_dir, watch)
    try:
        with (
            handled_signals(stop.handle),
            MetricsFollower(run_dir / cfg.output.metrics_file, reporter),
            waiting or contextlib.nullcontext(),
            _removed_at_the_end(tokenized_dir(run_dir), watch),
        ):
            results = elastic_launch(plan.config, elastic_entry)(
                str(run_dir), resolved.name, str(resume_from) if resume_from else None
            )
    except ChildFailedError as err:
        failure = describe_failure(err, run_dir, cfg=cfg, device_kind=kind)
        _log_failure(run_dir / cfg.output.metrics_file, str(failure))
        raise failure from err
    except RendezvousError as err:
        failed = _rendezvous_failed(err, cfg, plan, waiting, attempts_before=attempts_before)
        if isinstance(failed, WorkerFailed):
            _log_failure(run_dir / cfg.output.metrics_file, str(failed))
        raise failed from err
    vanished = next((r["vanished"] for r in results.values() if r and r.get("vanished")), None)
    if vanished is not None:
        raise StorageError(watch.message(**vanished))
    summary = results.get(0)
    # Rank 0 may run on another node: any local rank's result tells that the run stopped.
    stops = [r["stopped"] for r in results.values() if r and r.get("stopped")]
    if stops:
        # The signal this launcher got, a rank got itself, or (another node's launcher wrote
        # its name in the STOP file) that node's launcher got: every node exits alike.
        names = [s.get("signal") or s["reason"] for s in stops]
        signum = stop.signum or next(
            (signal.Signals[n] for n in names if n in signal.Signals.__members__), None
        )
        message = (
            f"stopped at step {stops[0]['step']} ({stops[0]['reason']}); checkpoint "
            f"{stops[0]['checkpoint']}; continue with: fsdprun resume {run_dir}"
        )
        # A signal ends the command as a signal does (128 + signal: what a shell and SLURM
        # expect of a job they terminated); a STOP file is a stop the user asked for, with
        # everything saved: a success (exit 0), and the report says where it stopped.
        if signum is not None:
            raise Stopped(message, exit_code=128 + signum)
    return summary
