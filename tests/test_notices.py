"""The libraries' known notices (fsdprun.report.notices) stay off the console of the `fsdprun`
process and nowhere else: a worker it forks, a rank under torchrun and FSDPRUN_DEBUG=1 let them
through, so the ranks' log files keep them; a torchao kernel library that fails to load on a
CUDA torch is shown. Each case runs in a fresh interpreter with the notices written as torch
and torchao write them, through a real logging handler; no torch is loaded. The whole command
is tested in tests/test_cli_startup.py. Run with `pytest tests/test_notices.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import fsdprun_env

# Writes each notice (and a line of the same loggers that is no known notice) in this process,
# in a forked child, and in this process again after `show_known_notices`; prints the lines that
# reached the handler as JSON. argv[1]: torch's CUDA version, or "" for a CPU build.
PROBE = """
import enum, json, logging, os, sys, types
from fsdprun.report.notices import hide_known_notices, show_known_notices

cuda = sys.argv[1] or None
sys.modules["torch"] = types.SimpleNamespace(version=types.SimpleNamespace(cuda=cuda))
read, write = os.pipe()
handler = logging.StreamHandler(os.fdopen(write, "w", buffering=1))
handler.setFormatter(logging.Formatter("{who}|%(name)s|%(message)s"))
for name in ("torch", "torchao"):
    logging.getLogger(name).addHandler(handler)

class ScaleCalculationMode(enum.Enum):
    x = 1

def say(who):
    handler.setFormatter(logging.Formatter(who + "|%(name)s|%(message)s"))
    pytree = logging.getLogger("torch.utils._pytree")
    pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an "
                   "opaque value type. Calling register_constant() on Enum subclasses is "
                   "deprecated and will be an error in a future release.", ScaleCalculationMode)
    pytree.warning("some other pytree warning")
    so = "/venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    logging.getLogger("torchao").warning(f"Failed to load {so}: Could not load this library: {so}")
    logging.getLogger("torchao").warning("Failed to load the config: no such file")

hide_known_notices()
hide_known_notices()  # twice: still one filter each
say("fsdprun")
pid = os.fork()
if pid == 0:
    say("forked")
    os._exit(0)
os.waitpid(pid, 0)
show_known_notices()
say("shown")
handler.stream.close()
lines = os.fdopen(read).read().splitlines()
print(json.dumps([line.split("|", 1) for line in lines]))
"""

ENUM = "torch.utils._pytree|<enum 'ScaleCalculationMode'> is an Enum subclass"
OTHER_PYTREE = "torch.utils._pytree|some other pytree warning"
KERNELS = "torchao|Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8"
OTHER_TORCHAO = "torchao|Failed to load the config: no such file"


def _seen(cuda: str) -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE, cuda], capture_output=True, text=True,
                          env=fsdprun_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen: dict[str, list[str]] = {}
    for who, line in json.loads(proc.stdout):
        kind = next(k for k in (ENUM, OTHER_PYTREE, KERNELS, OTHER_TORCHAO) if line.startswith(k))
        seen.setdefault(who, []).append(kind)
    return seen


def test_known_notices_leave_only_the_console_of_the_process_that_hid_them():
    everything = [ENUM, OTHER_PYTREE, KERNELS, OTHER_TORCHAO]
    cpu = _seen("")
    assert cpu["fsdprun"] == [OTHER_PYTREE, OTHER_TORCHAO]
    # A worker forked by the launcher inherits the filters; its log file keeps every notice.
    assert cpu["forked"] == everything
    assert cpu["shown"] == everything
    # On a CUDA torch a torchao kernel library that fails to load is a broken install: shown.
    assert _seen("12.6")["fsdprun"] == [OTHER_PYTREE, KERNELS, OTHER_TORCHAO]


# cli.main's set-up alone (no command), the filters it left; then `train` as a torchrun rank,
# stopped where it would load torch, with the filters it left by then.
RANK_PROBE = """
import json, logging, sys
from typer.testing import CliRunner
from fsdprun import cli

def filters():
    loggers = [logging.getLogger(n) for n in ("torch.utils._pytree", "torchao")]
    return [f.name for logger in loggers for f in logger.filters]

seen = []

def load(*modules):
    seen.append(filters())
    raise KeyboardInterrupt  # the rank would load torch and train from here

app, cli._load, cli.app = cli.app, load, lambda: None
sys.argv = ["fsdprun", "train", "debug"]
cli.main()
hidden = filters()
rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
code = CliRunner().invoke(app, ["train", "debug"], env=rank).exit_code
print(json.dumps([hidden, code, seen]))
"""


def test_a_rank_under_torchrun_and_debug_mode_hide_nothing():
    """`fsdprun train` as a torchrun rank shows the notices again before it loads torch (its
    stderr is its log file); FSDPRUN_DEBUG=1 hides nothing."""
    for debug, hidden in (("", ["pytree-enum-register-constant",
                                "torchao-cuda-kernels-without-cuda"]), ("1", [])):  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", RANK_PROBE], capture_output=True, text=True,
                              env=fsdprun_env(FSDPRUN_DEBUG=debug), timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout) == [hidden, 130, [[]]], (debug, proc.stdout)
