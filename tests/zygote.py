"""A warm parent for the suite's `fsdprun` commands: imported once, forked per command.

A real `fsdprun train` spends about 3 s of CPU importing torch, torch.distributed and fsdprun's
launcher and worker before it does anything (the workers are forked from the launcher, so they
pay nothing more). The suite runs a few hundred such commands. This process imports those
modules once, as `main()` would (TORCH_CPP_LOG_LEVEL set before torch loads), then listens on a
Unix socket; for each command it forks a child that takes the command's working directory,
environment, argv and output files and runs `fsdprun.cli.main()` exactly as the console script
does, in a session of its own. What the child does from there on is the real command: its own
process, its own launcher, workers, rendezvous, process groups and exit status.

The `fsdprun train` runs that `compare` and `tune` start for each configuration or trial (as
`python -m fsdprun`) come through the zygote too: in a forked command, the function that names
that child command (`_fsdprun_command` of fsdprun/tools/compare.py and tools/tune/trials.py)
names this file's client instead, so each run skips the same 3 s of imports. The client is still
compare's or tune's child process, with its own process group, signals forwarded, and its exit
status; and a command whose client dies (compare or tune killed, a trial killed at its timeout)
is killed with its process group, as the real child would die with its parent.

What a fork cannot show, the suite tests with real processes: startup and import behaviour
(tests/test_cli_startup.py probes fresh interpreters). A test that signals or watches an `fsdprun`
process starts it with conftest.start_fsdprun, forked here too: the test holds the command's own
pid (a signal reaches the command, not a client), and once the command has ended nothing more is
killed for it, so that its workers and its compare or tune children must go by its own means.
A command whose environment changes what torch, wandb or the HuggingFace libraries read when they
load (TORCH_*, PYTORCH_*, OMP_*, MKL_*, LD_*, PYTHON*, WANDB_*, HF_*, HUGGINGFACE_*,
TRANSFORMERS_*, TOKENIZERS_*) execs afresh (a real `fsdprun` process in the forked child's place),
but for what torchrun gives its workers (OMP_NUM_THREADS, PYTHONUNBUFFERED and the like,
RUN_TIME below), which the child sets at run time as a fresh interpreter would have it (tested
in tests/test_zygote.py); FSDPRUN_TEST_NO_ZYGOTE=1 runs every command exec'd. One difference
stays: the zygote holds transformers (with huggingface_hub) but not datasets, so the
HF_HUB_OFFLINE that fsdprun sets before it loads datasets (`data.source=hf_dataset`) reaches
datasets' own settings and not huggingface_hub's; with no network in the suite a hub request
there would fail, not pass.

Protocol, one connection per command: the client sends one JSON line {argv, cwd, env, stdout,
stderr}; the zygote answers {"pid": N, "fresh": B} once the child runs (B: it execs a new
interpreter), then {"code": C} when it ends (C as
subprocess reports it: negative for a signal).

    python tests/zygote.py SOCKET_PATH    # prints "ready" when it listens
    python tests/zygote.py --client SOCKET_PATH ARGS...   # `fsdprun ARGS` through it

The client form passes its own stdin, stdout and stderr (SCM_RIGHTS) instead of file names:
tests/test_docs.py puts it on PATH as `fsdprun`, so the docs' shell lines run through it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import pkgutil
import signal
import socket
import sys
import threading
import time


def _die_with_parent() -> None:
    """The zygote lives as long as the pytest process that started it, not longer. Not
    PR_SET_PDEATHSIG: that fires when the parent *thread* ends, and a test may start the zygote
    from a thread of its own."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


# Variables read when the interpreter or a library the zygote holds loads (loaded already here).
IMPORT_TIME_PREFIXES = (
    "TORCH_", "PYTORCH_", "OMP_", "MKL_", "LD_", "PYTHON", "_FSDPRUN_QUIET", "WANDB_", "HF_",
    "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_",
)  # fmt: skip
STARTED_WITH = dict(os.environ)


def _import_time_env_differs(env: dict[str, str]) -> bool:
    from fsdprun.cli import CPP_LOG_MARK

    if env.get(CPP_LOG_MARK) == "1" and env.get("TORCH_CPP_LOG_LEVEL") == "FATAL":
        # What fsdprun.cli.main sets before torch loads, as the zygote did (a compare's or
        # tune's `fsdprun train` child inherits it): the state the zygote is in.
        env = {k: v for k, v in env.items() if k not in (CPP_LOG_MARK, "TORCH_CPP_LOG_LEVEL")}
    keys = {k for k in (*env, *STARTED_WITH) if k.startswith(IMPORT_TIME_PREFIXES)}
    return any(env.get(k) != STARTED_WITH.get(k) and not _at_run_time(k, env) for k in keys)


def _unbuffered(value: str) -> None:
    """As `python -u`: stdout and stderr unbuffered (a raw file, the text written through)."""
    if value:
        for name in ("stdout", "stderr"):
            old = getattr(sys, name)
            raw = io.FileIO(old.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, old.encoding, old.errors, write_through=True))


def _threads(value: str) -> None:
    import torch

    torch.set_num_threads(int(value))  # what torch does with OMP_NUM_THREADS as it loads


# What torchrun gives its workers (OMP_NUM_THREADS=1 for several, PYTHONUNBUFFERED=1,
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1), set in a forked command as a fresh interpreter would have
# it: (whether the value can be, how).
RUN_TIME = {
    "OMP_NUM_THREADS": (lambda v: v.isdigit() and int(v) > 0, _threads),
    "PYTHONUNBUFFERED": (lambda v: True, _unbuffered),
    "PYTHONDONTWRITEBYTECODE": (
        lambda v: True,
        lambda v: setattr(sys, "dont_write_bytecode", bool(v)),
    ),
    # Read when an NCCL process group is made, not when torch loads.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (lambda v: True, lambda v: None),
}


def _at_run_time(key: str, env: dict[str, str]) -> bool:
    return key in env and key in RUN_TIME and RUN_TIME[key][0](env[key])


def _apply_run_time(env: dict[str, str]) -> None:
    for key, (_, apply) in RUN_TIME.items():
        if key in env and env[key] != STARTED_WITH.get(key):
            apply(env[key])


SOCKET: list[str] = []  # the path this zygote listens on


def _children_through_the_zygote() -> None:
    """compare's and tune's `fsdprun train` children as clients of this zygote (module doc)."""
    from fsdprun.tools import compare
    from fsdprun.tools.tune import trials

    client = [sys.executable, os.path.abspath(__file__), "--client", SOCKET[0]]
    compare._fsdprun_command = trials._fsdprun_command = lambda: list(client)


def _warm_up() -> None:
    if "TORCH_CPP_LOG_LEVEL" not in os.environ and not os.environ.get("FSDPRUN_DEBUG"):
        # As fsdprun.cli.main does before its first torch import.
        from fsdprun.cli import CPP_LOG_MARK

        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        os.environ[CPP_LOG_MARK] = "1"
    import fsdprun

    # Every fsdprun module (the CLI, launcher, worker, engines, models, tools), and what commands
    # import as they go, each time otherwise (about 0.9 s of CPU per `train`): torch._dynamo and
    # numpy.random under the engines, typer's parameter coercion (pydantic, from typer 0.2x on);
    # and the trackers' libraries (about 3 s in each run that writes to them; neither starts a
    # thread at import).
    for info in pkgutil.walk_packages(fsdprun.__path__, "fsdprun."):
        if info.name.split(".")[-1] != "__main__":
            importlib.import_module(info.name)
    for name in (
        "typer._adapters", "torch._dynamo", "numpy.random", "multiprocessing.popen_fork",
        "multiprocessing.queues", "statistics", "torch.utils.tensorboard", "wandb",
        "encodings.idna", "rich._emoji_codes",  # the rendezvous' host name, the report's console
    ):  # fmt: skip
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with contextlib.suppress(ImportError):  # the HF model path (3 s of CPU per process)
        transformers = importlib.import_module("transformers")
        for attr in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "LlamaForCausalLM"):
            getattr(transformers, attr)
    # A recipe resolved once: the schema's structured config is built once per process (0.05 CPU s
    # of every command that reads a recipe).
    from fsdprun.config import load_recipe

    load_recipe("debug")
    # What every command inherits: outside the commands' garbage collections (and the launcher
    # freezes its own heap before forking workers, fsdprun.launch.elastic).
    gc.freeze()


def file_size_limit(limit: int) -> None:
    """In a command's process: writes beyond `limit` bytes fail with EFBIG (SIGXFSZ, which would
    kill the process instead, is ignored; both settings are inherited by the workers)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _cuda_refused_in_fork() -> bool:
    import torch

    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)  # absent from CPU builds
    return bool(in_bad_fork and in_bad_fork())


def _child(request: dict) -> None:
    """Become the command: never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        fds = request.get("fds") or [os.open(os.devnull, os.O_RDONLY)] + [
            os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for k in ("stdout", "stderr")
        ]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if request.get("fsize_limit") is not None:
            file_size_limit(request["fsize_limit"])
        sys.argv = ["fsdprun", *request["argv"]]
        # A fresh interpreter: for an environment that changes imports, and where the zygote's
        # imports touched the CUDA driver (a library's import-time torch.cuda.is_available() on
        # a GPU machine), after which torch refuses CUDA in a fork ("Cannot re-initialize CUDA
        # in forked subprocess": every CUDA command of the suite on an H200).
        if _import_time_env_differs(request["env"]) or _cuda_refused_in_fork():
            script = os.path.join(os.path.dirname(sys.executable), "fsdprun")
            os.execve(script, [script, *request["argv"]], request["env"])
        _apply_run_time(request["env"])
        _children_through_the_zygote()
        from fsdprun.cli import main

        try:
            main()
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # sys.exit("message"), as the interpreter does it
                print(e.code, file=sys.stderr)
                code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _receive(conn: socket.socket) -> dict:
    """One JSON line, and the stdin/stdout/stderr a `--client` passed along with it."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    request = json.loads(data)
    request["fds"] = list(fds)
    return request


def client(path: str, argv: list[str]) -> int:
    """`fsdprun ARGV` through the zygote with this process's stdin, stdout and stderr, as a
    shell runs it: the exit status, 128 + N for signal N. SIGINT/SIGTERM reach the command."""
    import resource

    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:  # a real child inherits its parent's file-size limit
        request["fsize_limit"] = limit
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reader = conn.makefile("rb")
        pid = json.loads(reader.readline())["pid"]
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda n, f: os.kill(pid, n))
        code = json.loads(reader.readline())["code"]
    return code if code >= 0 else 128 - code


OPEN: set[socket.socket] = set()  # connections of commands still running


def _wait_and_answer(conn: socket.socket, pid: int) -> None:
    ended = threading.Lock()  # held by whoever settles the command's end first
    threading.Thread(
        target=_kill_when_the_client_goes, args=(conn, pid, ended), daemon=True
    ).start()
    with conn:
        # Not reaped yet (WNOWAIT): while the watcher may still kill it, its pid is not free.
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        ended.acquire()
        _, status = os.waitpid(pid, 0)
        answer = json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n"
        with contextlib.suppress(OSError):  # the client gave up (a timeout): nobody listens
            conn.sendall(answer)
            conn.shutdown(socket.SHUT_RDWR)  # wakes the watcher
        OPEN.discard(conn)


def _kill_when_the_client_goes(conn: socket.socket, pid: int, ended: threading.Lock) -> None:
    """A client never writes after its request: end of file while the command runs means the
    client died (SIGKILL of compare's child, tune's timeout), and the command goes with it."""
    with contextlib.suppress(OSError):
        while conn.recv(1 << 10):
            pass
    if ended.acquire(blocking=False):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the command, its launcher's workers with it
        ended.release()


def serve(path: str) -> None:
    SOCKET[:] = [os.path.abspath(path)]
    _die_with_parent()
    _warm_up()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        try:
            request = _receive(conn)
        except (OSError, ValueError) as e:  # a client that went away: the next one is served
            print(f"zygote: unreadable request ({e})", file=sys.stderr, flush=True)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for s in (server, conn, *OPEN):  # the command holds no other command's socket
                s.close()
            _child(request)
        for fd in request["fds"]:
            os.close(fd)
        OPEN.add(conn)
        # "fresh": the command execs a new interpreter (its environment changes imports): the
        # suite counts those, each a few CPU seconds of imports (tests/conftest.py).
        answer = {"pid": pid, "fresh": _import_time_env_differs(request["env"])}
        with contextlib.suppress(OSError):  # a client gone: the waiter still reaps the command
            conn.sendall(json.dumps(answer).encode() + b"\n")
        threading.Thread(target=_wait_and_answer, args=(conn, pid), daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    serve(sys.argv[1])
