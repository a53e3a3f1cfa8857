"""The suite's zygote (tests/zygote.py) runs a command forked only when a fresh interpreter would
be in the same state: an environment that changes what loads at import execs afresh, and what
torchrun gives its workers is set at run time as a fresh interpreter would have it."""

from __future__ import annotations

import json
import os
import sys

import zygote


def test_what_only_a_fresh_interpreter_gets_execs_and_torchruns_variables_do_not():
    base = dict(zygote.STARTED_WITH)
    torchrun = {
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip
    assert not zygote._import_time_env_differs({**base, **torchrun})
    for changed in ({"OMP_NUM_THREADS": "one"}, {"TORCH_LOGS": "dynamo"}, {"MKL_NUM_THREADS": "1"},
                    {"PYTHONHASHSEED": "3"}, {"HF_HOME": "/x"}):  # fmt: skip
        assert zygote._import_time_env_differs({**base, **torchrun, **changed}), changed


def test_torchruns_variables_take_effect_in_the_forked_command():
    import torch

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the command, as zygote._child makes it
        try:
            zygote._apply_run_time({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
            through = sys.stdout.write_through and sys.stderr.write_through
            state = {"threads": torch.get_num_threads(), "through": through}
            os.write(write, json.dumps(state).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    state = json.loads(os.read(read, 1 << 16))
    assert state == {"threads": 1, "through": True}


def test_a_variable_a_test_sets_in_this_process_does_not_make_later_commands_exec(
    tmp_path, monkeypatch
):
    """The suite's commands get the session's environment (conftest.fsdprun_env), not what a
    test monkeypatched here since: with HF_HUB_OFFLINE set in this process, a command forks from
    the zygote as before; one whose own environment changes imports execs afresh. Before, the
    zygote and every command copied this process's environment as it was at that moment: a test
    that set HF_HUB_OFFLINE made each later command of its worker exec (4.5 CPU s of imports)."""
    import conftest

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    counts = conftest.ZYGOTE_COMMANDS
    before = dict(counts)
    assert conftest.run_fsdprun("recipes", cwd=tmp_path).returncode == 0
    assert (counts["forked"] - before["forked"], counts["fresh"] - before["fresh"]) == (1, 0)
    env = conftest.fsdprun_env(TORCH_SHOW_CPP_STACKTRACES="1")
    assert conftest.run_fsdprun("recipes", cwd=tmp_path, env=env).returncode == 0
    assert (counts["forked"] - before["forked"], counts["fresh"] - before["fresh"]) == (1, 1)
