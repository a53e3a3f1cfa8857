"""Shared test helpers: run the real `fsdprun` command as a subprocess and read its metrics.

Distributed tests are real: gloo process groups on CPU, real FSDP2, several ranks per test
machine. `fsdprun_runs` caches training runs for the session so several tests can check one run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdprun.report.metrics import read_events

FSDPRUN = str(Path(sys.executable).parent / "fsdprun")

# FSDPRUN_TEST_LAUNCH_LOG=FILE: one tab-separated line per subprocess a test starts (test id,
# wall seconds, command), appended when it is reaped, to see where the suite's time goes. Off
# unless set; it wraps subprocess.Popen for the session, nothing else changes.
_LAUNCH_LOG = os.environ.get("FSDPRUN_TEST_LAUNCH_LOG")
# (once: this file is imported both as `conftest` and as `tests.conftest`)
if _LAUNCH_LOG and not hasattr(subprocess.Popen, "_launch_logged"):
    _popen_init, _popen_wait = subprocess.Popen.__init__, subprocess.Popen.wait

    def _logged_init(self, args, *a, **kw):
        self._launch_log = (os.environ.get("PYTEST_CURRENT_TEST", "?"), time.monotonic())
        _popen_init(self, args, *a, **kw)

    def _logged_wait(self, timeout=None):
        code = _popen_wait(self, timeout)
        entry = self.__dict__.pop("_launch_log", None)
        if entry is not None:
            test, started = entry
            cmd = self.args if isinstance(self.args, str) else " ".join(map(str, self.args))
            with open(_LAUNCH_LOG, "a") as f:
                f.write(f"{test.rsplit(' ', 1)[0]}\t{time.monotonic() - started:.2f}\t{cmd}\n")
        return code

    subprocess.Popen.__init__, subprocess.Popen.wait = _logged_init, _logged_wait
    subprocess.Popen._launch_logged = True


def save_tiny_hf_llama(path: Path) -> Path:
    """A tiny random HuggingFace Llama saved at `path` (hidden 64, 2 layers, 4 heads, 2 kv heads,
    vocab 256), seeded, for the tests that need a folder of their own."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def save_tiny_hf(path: Path, model_type: str, **extra) -> Path:
    """A tiny random HuggingFace model of any family transformers knows (`model_type`: qwen2,
    qwen3, mistral, phi3, ...) saved at `path`, with the dims of `save_tiny_hf_llama` (head_dim
    16) and untied embeddings; `extra` sets more config fields. Seeded."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
        tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The environment the suite started with: a command's, whatever a test has set in this process
# since (a monkeypatched variable belongs to that test, not to every command after it).
_SESSION_ENV = dict(os.environ)


def fsdprun_env(**extra: str) -> dict[str, str]:
    """The environment of the suite's commands: the session's, one thread per process, wide
    tables, and HF_HUB_OFFLINE=1 (nothing in the suite may reach a network; tests/test_hub.py
    takes it out where it tests what a command does online). `extra` adds or replaces. Never a
    worker's variables, nor a platform's node count and rank (a suite run in a pod).

    Every command gets the same variables that libraries read when they load, so that the zygote
    (started with them) forks each one instead of exec'ing a new interpreter: a test that set
    HF_HUB_OFFLINE in this process made every later command of its worker exec afresh (about
    4.5 CPU s of imports each, ~2x the whole suite's CPU in 2026-12-04's full run)."""
    env = {
        k: v
        for k, v in _SESSION_ENV.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith(("PET_", "SKYPILOT_"))
    }
    env.update({"OMP_NUM_THREADS": "1", "COLUMNS": "200", "HF_HUB_OFFLINE": "1", **extra})
    return env


def run_fsdprun(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300,
    fsize_limit: int | None = None,
):  # fmt: skip
    """`fsdprun ARGS` to its end, as subprocess.run reports it. The command is forked from the
    suite's warm zygote (tests/zygote.py: torch and the launcher already imported, about 3 s of
    CPU less per command), which execs it afresh when its environment changes what torch reads
    when it loads; FSDPRUN_TEST_NO_ZYGOTE=1 execs every command. Either way it is the real
    command in a process of its own. `fsize_limit`: the command (and its workers) starts under
    that file-size limit, writes beyond it failing with EFBIG (zygote.file_size_limit)."""
    from zygote import file_size_limit as _file_size_limit

    env = env or fsdprun_env()
    if not os.environ.get("FSDPRUN_TEST_NO_ZYGOTE"):  # it execs what needs a fresh interpreter
        for _ in range(2):
            try:
                return _zygote().run(
                    list(args), cwd=cwd, env=env, timeout=timeout, fsize_limit=fsize_limit
                )
            except ZygoteGone:  # once more with a new zygote: the command had not started
                _ZYGOTE[0].close()
                _ZYGOTE.clear()
    return subprocess.run(
        [FSDPRUN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        preexec_fn=None if fsize_limit is None else lambda: _file_size_limit(fsize_limit),
    )  # fmt: skip


class ZygoteGone(Exception):
    """The zygote could not take a command (it is not there any more)."""


class Zygote:
    """The client side of tests/zygote.py: one server for the session, started on first use."""

    def __init__(self, root: Path):
        self.root = root
        self.path = str(root / "zygote.sock")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py")), self.path],
            env=fsdprun_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"the test zygote did not start: {line!r}"
        self.count = 0

    def run(
        self, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float,
        fsize_limit: int | None = None,
    ):  # fmt: skip
        import json
        import signal

        self.count += 1
        out, err = (self.root / f"cmd{self.count}.{k}" for k in ("out", "err"))
        request = {"argv": args, "cwd": str(cwd), "env": env, "stdout": str(out),
                   "stderr": str(err), "fsize_limit": fsize_limit}  # fmt: skip
        started = time.monotonic()
        deadline = started + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            try:
                conn.connect(self.path)
                conn.sendall(json.dumps(request).encode() + b"\n")
                reader = conn.makefile("rb")
                started_as = json.loads(reader.readline())
                pid = started_as["pid"]
            except (OSError, ValueError) as e:  # the command never started
                raise ZygoteGone(str(e)) from e
            ZYGOTE_COMMANDS["fresh" if started_as.get("fresh") else "forked"] += 1
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                code = json.loads(reader.readline())["code"]
            except (TimeoutError, OSError) as e:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # the command and its workers
                raise subprocess.TimeoutExpired([FSDPRUN, *args], timeout) from e
        if _LAUNCH_LOG:  # as the Popen wrapper above logs an exec'd command
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            with open(_LAUNCH_LOG, "a") as f:
                f.write(
                    f"{test}\t{time.monotonic() - started:.2f}\tzygote: fsdprun {' '.join(args)}\n"
                )
        stdout, stderr = (p.read_text(errors="replace") for p in (out, err))
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess([FSDPRUN, *args], code, stdout, stderr)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Started:
    """`fsdprun ARGS` left running, for a test that signals or watches it, with what it uses of
    subprocess.Popen(text=True): pid, poll, wait, send_signal, kill, communicate, returncode
    (`start_fsdprun`). Forked from the zygote: `pid` is the command's own process (a session of
    its own; its launcher, whose workers are its children), so a signal reaches the command
    itself, not a client. Its stdout and stderr go to files, read by `communicate`. Once it has
    ended nothing more is killed (its workers and children must go by the command's own means);
    dropped while it runs (the test failed), its process group is killed."""

    def __init__(self, zygote: Zygote, args: list[str], *, cwd: Path, env: dict[str, str]):
        import json

        zygote.count += 1
        self.args = [FSDPRUN, *args]
        self._files = [zygote.root / f"cmd{zygote.count}.{k}" for k in ("out", "err")]
        self._buffer, self._output, self.returncode = b"", None, None
        request = {"argv": args, "cwd": str(cwd), "env": env, "stdout": str(self._files[0]),
                   "stderr": str(self._files[1])}  # fmt: skip
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(zygote.path)
            self._conn.sendall(json.dumps(request).encode() + b"\n")
            started = json.loads(self._line(None))
        except (OSError, ValueError) as e:  # the command never started
            self._conn.close()
            raise ZygoteGone(str(e)) from e
        self.pid = started["pid"]
        ZYGOTE_COMMANDS["fresh" if started.get("fresh") else "forked"] += 1

    def _line(self, timeout: float | None) -> bytes | None:
        """The zygote's next line, or None if none came within `timeout`."""
        import select

        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self._conn], [], [], left)[0]:
                return None
            data = self._conn.recv(1 << 16)
            if not data:
                raise OSError("the zygote closed the connection")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        import json

        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = json.loads(line)["code"]
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._output is None:
            self._output = tuple(p.read_text(errors="replace") for p in self._files)
            for p in self._files:
                p.unlink()
        return self._output


def processes_naming(text: str) -> list[int]:
    """Live processes (not zombies) whose command line or an open file names `text`: a
    command's launcher and workers, exec'd (their command line) or forked from the zygote (the
    lock, logs and metrics they hold open in their run directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                continue
            named = text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            fds = [] if named else list((proc / "fd").iterdir())
        except (OSError, IndexError):  # gone, or not ours to read
            continue
        for fd in fds:
            with contextlib.suppress(OSError):  # closed since the listing
                named = named or text in os.readlink(fd)
        if named:
            found.append(int(proc.name))
    return found


def start_fsdprun(*args: str, cwd: Path, env: dict[str, str] | None = None):
    """`fsdprun ARGS` started, not waited for: a `Started` command forked from the zygote, or
    with FSDPRUN_TEST_NO_ZYGOTE=1 a subprocess.Popen of the console script (stdout and stderr
    piped, text)."""
    env = env or fsdprun_env()
    if not os.environ.get("FSDPRUN_TEST_NO_ZYGOTE"):
        for _ in range(2):
            try:
                return Started(_zygote(), list(args), cwd=cwd, env=env)
            except ZygoteGone:  # once more with a new zygote: the command had not started
                _ZYGOTE[0].close()
                _ZYGOTE.clear()
    return subprocess.Popen(
        [FSDPRUN, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


_ZYGOTE: list[Zygote] = []
# This process's zygote commands: forked from it, or exec'd afresh (their environment changes what
# libraries read at import); the summary prints both (pytest_terminal_summary).
ZYGOTE_COMMANDS = {"forked": 0, "fresh": 0}


def zygote_fsdprun(root: Path) -> Path | None:
    """An `fsdprun` for shell lines (tests/test_docs.py): a script in `root` that runs each
    command through the zygote with the shell's stdin, stdout and stderr; None when
    FSDPRUN_TEST_NO_ZYGOTE=1."""
    if os.environ.get("FSDPRUN_TEST_NO_ZYGOTE"):
        return None
    script = root / "fsdprun"
    server = Path(__file__).with_name("zygote.py")
    # Python, as the console script is: torchrun runs its script with `python SCRIPT`.
    script.write_text(
        f"#!{sys.executable}\nimport runpy, sys\n"
        f"sys.argv = [{str(server)!r}, '--client', {_zygote().path!r}, *sys.argv[1:]]\n"
        f"runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    script.chmod(0o755)
    return script


def zygote_command(root: Path) -> str:
    """The `fsdprun` to put in a command line that the test starts itself (torchrun's workers,
    a script's `$FSDPRUN`, two nodes side by side): `zygote_fsdprun` in `root/.bin`, else the
    console script."""
    (root / ".bin").mkdir(exist_ok=True)
    return str(zygote_fsdprun(root / ".bin") or FSDPRUN)


def _zygote() -> Zygote:
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        import tempfile

        _ZYGOTE[:] = [Zygote(Path(tempfile.mkdtemp(prefix="fsdprun-zygote-")))]
    return _ZYGOTE[0]


# The files that take longest (CI's --durations and a JUnit report, 2026-12-02), longest first:
# under `-n 3 --dist loadfile` (pyproject.toml) files are handed to the workers in collection
# order, and a long one started last would leave one worker alone at the end. The others keep
# their order.
LONGEST_FIRST = (
    "test_docs.py", "test_tp.py", "test_cp.py", "test_faults.py", "test_tune.py", "test_perf.py",
    "test_matrix.py", "test_checkpoint.py", "test_engines.py", "test_hf_families.py",
    "test_memory_contract.py", "test_cluster.py", "test_bad_input.py", "test_hf.py",
    "test_launch.py", "test_train.py", "test_data.py", "test_unresponsive.py",
    "test_slurm_example.py", "test_process_faults.py", "test_profile.py",
)  # fmt: skip


def pytest_configure(config):
    """Collection imports torch, transformers and every test module with the cyclic garbage
    collector paused (not in xdist's controller, which collects nothing): each full collection
    on the way walked the growing heap again, 10.3 -> 6.2 CPU s per worker (2-core VM,
    2026-12)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        gc.disable()


def pytest_collection_finish(session):
    # What collection made lives for the session: frozen, the collections during the tests
    # (and the full one after each gloo pool task: tests/gloo_pool.py) skip it.
    gc.freeze()
    gc.enable()
    # torch in this process (the in-process references, models and checks) on one thread, as
    # the commands' and pools' processes run (OMP_NUM_THREADS=1): its idle intra-op threads
    # spin, and on a busy 2-core machine a plain reference loop cost 3.8 CPU s instead of 0.5.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_sessionfinish(session, exitstatus):
    for z in _ZYGOTE:
        z.close()


# --------------------------------------------------------------------------------------------
# CPU seconds per test, beside --durations' wall seconds: on a shared 2-core CI machine wall
# time mostly says how busy the machine was; CPU seconds say what the test itself costs.


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process, its reaped children, and its live children
    with what they reaped in turn (the zygote's commands and their workers, the gloo pool's
    ranks, a Popen'd `fsdprun` and its workers once they are reaped)."""
    total = sum(os.times()[:4])
    me = os.getpid()
    try:
        children = {
            int(pid)
            for task in os.listdir(f"/proc/{me}/task")
            for pid in Path(f"/proc/{me}/task/{task}/children").read_text().split()
        }
    except OSError:  # not Linux, or no /proc children lists
        return total
    tick = os.sysconf("SC_CLK_TCK")
    for pid in children:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended (and reaped) since the listing: in os.times() now
            continue
        total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


_CPU_AT = pytest.StashKey[float]()  # where the test's current phase started
_CPU_BY_TEST: dict[str, list[float]] = {}  # nodeid -> [cpu s, wall s], on the controller


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries its CPU seconds (a user property: xdist sends those to the
    controller, which prints the costliest tests, `pytest_terminal_summary`)."""
    started = item.stash.get(_CPU_AT, None)
    outcome = yield
    now = tree_cpu_s()
    report = outcome.get_result()
    if started is not None:
        report.user_properties.append(("cpu_s", now - started))
    item.stash[_CPU_AT] = now  # the next phase starts here
    # The zygote commands exec'd afresh in this phase (counted once: the counter is reset).
    if ZYGOTE_COMMANDS["fresh"]:
        report.user_properties.append(("zygote_fresh", ZYGOTE_COMMANDS["fresh"]))
        ZYGOTE_COMMANDS["fresh"] = 0
    if ZYGOTE_COMMANDS["forked"]:
        report.user_properties.append(("zygote_forked", ZYGOTE_COMMANDS["forked"]))
        ZYGOTE_COMMANDS["forked"] = 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT] = tree_cpu_s()


_ZYGOTE_BY_TEST: dict[str, list[int]] = {}  # nodeid -> [forked, fresh], on the controller


def pytest_runtest_logreport(report):
    entry = _CPU_BY_TEST.setdefault(report.nodeid, [0.0, 0.0])
    entry[0] += sum(v for k, v in report.user_properties if k == "cpu_s")
    entry[1] += report.duration
    counts = _ZYGOTE_BY_TEST.setdefault(report.nodeid, [0, 0])
    counts[0] += sum(v for k, v in report.user_properties if k == "zygote_forked")
    counts[1] += sum(v for k, v in report.user_properties if k == "zygote_fresh")


def pytest_terminal_summary(terminalreporter):
    if not _CPU_BY_TEST:
        return
    if os.environ.get("FSDPRUN_TEST_CPU_LOG"):  # FILE: every test's CPU and wall seconds, TSV
        with open(os.environ["FSDPRUN_TEST_CPU_LOG"], "w") as f:
            for nodeid, (cpu, wall) in sorted(_CPU_BY_TEST.items(), key=lambda i: -i[1][0]):
                f.write(f"{cpu:.1f}\t{wall:.1f}\t{nodeid}\n")
    costliest = sorted(_CPU_BY_TEST.items(), key=lambda item: -item[1][0])[:25]
    terminalreporter.write_sep("=", "costliest tests in CPU seconds (their processes included)")
    for nodeid, (cpu, wall) in costliest:
        terminalreporter.write_line(f"{cpu:7.1f} CPU s {wall:7.1f} s  {nodeid}")
    by_file: dict[str, float] = {}
    for nodeid, (cpu, _) in _CPU_BY_TEST.items():
        name = nodeid.split("::")[0]
        by_file[name] = by_file.get(name, 0.0) + cpu
    files = sorted(by_file.items(), key=lambda item: -item[1])[:15]
    terminalreporter.write_line(
        f"tests' CPU: {sum(by_file.values()):.0f} s in all; by file: "
        + ", ".join(f"{Path(n).name} {s:.0f}" for n, s in files)
    )
    # Commands that exec'd a new interpreter instead of forking from the warm zygote: each
    # pays the imports again. Those whose environment must differ (tests/test_zygote.py, a few
    # that set what torch or the HF libraries read at import) belong here; a growing count is a
    # test leaking a variable into the commands after it.
    forked = sum(c[0] for c in _ZYGOTE_BY_TEST.values())
    fresh = {n: c[1] for n, c in _ZYGOTE_BY_TEST.items() if c[1]}
    terminalreporter.write_line(
        f"zygote commands: {forked} forked, {sum(fresh.values())} exec'd afresh"
        + (" (" + ", ".join(f"{n.split('/')[-1]} {k}" for n, k in sorted(
            fresh.items(), key=lambda i: -i[1])[:8]) + ")" if fresh else "")
    )  # fmt: skip


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path):
        self.proc, self.run_dir = proc, run_dir
        metrics = run_dir / "metrics.jsonl"
        self.events = read_events(metrics) if metrics.exists() else []

    @property
    def steps(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "step"]

    @property
    def losses(self) -> list[float]:
        return [e["loss"] for e in self.steps]

    @property
    def start(self) -> dict:
        return next(e for e in self.events if e["event"] == "start")

    @property
    def summary(self) -> dict:
        return next(e for e in self.events if e["event"] == "summary")

    def check(self) -> Run:
        assert self.proc.returncode == 0, self.proc.stdout[-3000:] + self.proc.stderr[-3000:]
        return self


class Runs:
    """Training runs of the debug recipe, cached by their arguments for the whole session."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[tuple, Run] = {}

    def train(self, *overrides: str, nproc: int = 2, recipe: str = "debug") -> Run:
        key = (recipe, nproc, *overrides)
        if key not in self.cache:
            run_dir = self.root / f"run{len(self.cache)}"
            proc = run_fsdprun(
                "train", recipe, *overrides, "--nproc-per-node", str(nproc),
                "--run-dir", str(run_dir), cwd=self.root,
            )  # fmt: skip
            self.cache[key] = Run(proc, run_dir)
        return self.cache[key]


def consolidate(ckpt: Path, out: Path) -> dict:
    """A DCP checkpoint as one nested dict of full tensors (DCP's own consolidation)."""
    from torch import load
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(out))
    return load(out, weights_only=True)


def model_at(run: Run, step: int, tmp: Path) -> dict:
    """The model tensors of `run`'s step-`step` checkpoint, whole, by flattened name
    ("model.layers.0...")."""
    from fsdprun.checkpoint import step_dir

    full = flatten(consolidate(step_dir(run.run_dir, step), tmp / f"{run.run_dir.name}-{step}.pt"))
    return {k: v for k, v in full.items() if k.startswith("model.")}


def assert_same_state(a: Path, b: Path, tmp: Path) -> None:
    """Two DCP checkpoints hold bitwise the same model and optimizer state."""
    import torch

    state_a, state_b = consolidate(a, tmp / "a.pt"), consolidate(b, tmp / "b.pt")
    for part in ("model", "optim"):
        flat_a, flat_b = flatten(state_a[part]), flatten(state_b[part])
        assert flat_a.keys() == flat_b.keys()
        for key in flat_a:
            assert torch.equal(flat_a[key], flat_b[key]), key


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts → {"a.b.c": leaf}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.fixture(scope="session")
def fsdprun_runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


def read_tables(text: str, key: int = 0) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The rich tables (default box) in rendered `text`, by title: header and rows, each cell's
    wrapped lines joined back (directly after a `.` or `:`, else with one space), so a cell
    broken mid-word reads back wrong. A body line starts a new row when its column `key` is not
    empty (pick a column that never wraps)."""
    lines = text.splitlines()
    tables = {}
    for i, line in enumerate(lines):
        if not line.startswith("┏"):
            continue
        title = lines[i - 1].strip()
        end_head = next(j for j in range(i, len(lines)) if lines[j].startswith("┡"))
        end = next(j for j in range(end_head, len(lines)) if lines[j].startswith("└"))
        head = [[c.strip() for c in ln.split("┃")[1:-1]] for ln in lines[i + 1 : end_head]]
        body = [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines[end_head + 1 : end]]
        header = _join_rows(head, new_row=lambda cells: False)[0]
        tables[title] = (header, _join_rows(body, new_row=lambda cells: bool(cells[key])))
    return tables


def _join_rows(lines: list[list[str]], new_row) -> list[list[str]]:
    rows: list[list[str]] = []
    for cells in lines:
        if not rows or new_row(cells):
            rows.append(cells)
            continue
        for c, part in enumerate(cells):
            if part:
                prev = rows[-1][c]
                rows[-1][c] = prev + part if not prev or prev[-1] in ".:" else f"{prev} {part}"
    return rows


@pytest.fixture(scope="session")
def hf_family_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny random HuggingFace folder of each family in tests/hf_families.py, by model_type,
    made once per session."""
    from hf_families import FAMILIES, save_tiny_hf

    root = tmp_path_factory.mktemp("hf-families")
    return {name: save_tiny_hf(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="session")
def gloo_pool_1(tmp_path_factory):
    """One rank in a gloo process group of its own, for the session (as `gloo_pool`)."""
    from gloo_pool import GlooPool

    pool = GlooPool(1, tmp_path_factory.mktemp("gloo-pool-1"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def gloo_pool_4(tmp_path_factory):
    """Four ranks in one gloo process group for the session (as `gloo_pool`): the tp x dp and
    cp x dp meshes of tests/test_tp.py and tests/test_cp.py, which share it and their dp 4
    references (starting 4 ranks costs about 15 CPU s on the shared 2-core machine)."""
    from gloo_pool import GlooPool

    pool = GlooPool(4, tmp_path_factory.mktemp("gloo-pool-4"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def gloo_pool(tmp_path_factory):
    """Two ranks in one persistent gloo process group for the session (tests/gloo_pool.py):
    engine-level tests train in it instead of launching `fsdprun train` each."""
    from gloo_pool import GlooPool

    pool = GlooPool(2, tmp_path_factory.mktemp("gloo-pool"))
    yield pool
    pool.close()
