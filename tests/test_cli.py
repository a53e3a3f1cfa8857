"""The `fsdprun` command line: typer's CliRunner in-process, plus the real console script.

`train` never launches here: `fsdprun.launch.elastic.launch_training` is patched to record what the
command hands it. Run with `pytest tests/test_cli.py`.
"""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import FSDPRUN, fsdprun_env
from typer.testing import CliRunner

from fsdprun import __version__
from fsdprun.cli import app
from fsdprun.config import CLI_SOURCE, ResolvedRecipe, builtin_recipes, load_recipe

runner = CliRunner()

# What each command's help must show beyond "Usage:"; commands added later still get the check.
HELP_TEXT = {
    "train": ["Train a recipe", "--nproc-per-node", "--rdzv-endpoint", "--run-dir"],
    "config": ["Print the fully resolved recipe", "--explain", "--nproc-per-node"],
    "recipes": ["List the built-in recipes"],
}
COMMANDS = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    # Torchrun-style variables would make `train` run as a worker; FSDPRUN_DEBUG would turn the
    # one-line errors under test into tracebacks; a narrow COLUMNS would wrap help text.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FSDPRUN_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def launches(monkeypatch) -> list[tuple[ResolvedRecipe, Path]]:
    """Patch the launcher; each call to it is recorded as (resolved recipe, run dir)."""
    calls: list[tuple[ResolvedRecipe, Path]] = []

    def fake_launch_training(resolved: ResolvedRecipe, run_dir: Path, **how) -> None:
        calls.append((resolved, run_dir))

    monkeypatch.setattr("fsdprun.launch.elastic.launch_training", fake_launch_training)
    return calls


def assert_one_line_error(result, *fragments: str) -> str:
    """A user error: exit 2, nothing on stdout, one `error:` line on stderr, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith(f"fsdprun {__version__} (torch ")


def test_root_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "Train LLMs with PyTorch FSDP" in result.stdout
    for command in COMMANDS:
        assert command in result.stdout


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert result.exit_code == 2
    assert "Usage:" in result.output


def test_the_known_commands_are_registered():
    assert set(HELP_TEXT) <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout
    for text in HELP_TEXT.get(command, []):
        assert text in result.stdout


def _wrapped_paragraphs(page: str, columns: int) -> list[tuple[list[str], int]]:
    """A `--help` page's prose as rich wrapped it: (the lines of one paragraph, the width they
    wrap at) for each paragraph above the first panel (Usage aside) and each command's
    description in the Commands panel."""
    lines = page.splitlines()
    first_panel = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    found, paragraph = [], []
    for line in [*lines[:first_panel], ""]:
        if line.strip():
            paragraph.append(line.rstrip())
        elif paragraph:
            # One space of padding on either side of the page.
            if not paragraph[0].lstrip().startswith("Usage:"):
                found.append((paragraph, columns - 1))
            paragraph = []
    if any(line.startswith("╭─ Commands") for line in lines):
        start = next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands"))
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
        rows = [line[2:-2] for line in lines[start + 1 : end]]  # inside "│ " and " │"
        name = rows[0].split()[0]
        column = len(rows[0]) - len(rows[0][len(name) :].lstrip())
        for row in rows:
            if row[:column].strip():
                found.append(([], len(row) - column))
            found[-1][0].append(row[column:].rstrip())
    return found


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_help_descriptions_wrap_at_the_terminal_width_only(columns):
    # rich wraps greedily: a line followed by a word that would have fitted on it is a line
    # break of the help text itself, which breaks the description mid-sentence at every width.
    checked = 0
    for command in [None, *COMMANDS]:
        args = [command, "--help"] if command else ["--help"]
        result = runner.invoke(app, args, env={"COLUMNS": str(columns)})
        assert result.exit_code == 0, result.output
        for paragraph, width in _wrapped_paragraphs(result.stdout, columns):
            checked += 1
            for line, after in itertools.pairwise(paragraph):
                fits = len(line) + 1 + len(after.split()[0]) <= width
                assert not fits, (command, columns, line, after)
    assert checked > 2 * len(COMMANDS)


def test_recipes_lists_debug_with_its_description():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert set(lines) == set(builtin_recipes())
    description = builtin_recipes()["debug"]
    assert description
    assert lines["debug"].startswith("debug ")
    assert lines["debug"].rstrip().endswith(description)


def test_config_prints_the_resolved_yaml():
    result = runner.invoke(app, ["config", "debug", "optim.lr=0.001"])
    assert result.exit_code == 0, result.output
    assert "  lr: 0.001\n" in result.stdout
    data = yaml.safe_load(result.stdout)
    assert data["optim"]["lr"] == 0.001
    assert data["model"]["dim"] == 64  # the rest of the debug recipe is there too
    assert data["precision"]["param_dtype"] == "fp32"


def test_config_explain_shows_the_command_line_layer():
    result = runner.invoke(app, ["config", "debug", "--explain", "optim.lr=0.001"])
    assert result.exit_code == 0, result.output
    lines = {line.split(":")[0].strip(): line for line in result.stdout.splitlines()}
    assert lines["lr"].startswith("  lr: 0.001 ")
    assert lines["lr"].endswith(f"# {CLI_SOURCE}")
    assert lines["dim"].endswith("# builtin:debug")
    assert lines["family"].endswith("# default")


def test_config_flags_are_overrides():
    result = runner.invoke(app, ["config", "debug", "--nproc-per-node", "4", "--nnodes", "1"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["launch"]["nproc_per_node"] == 4


def test_config_rejects_a_world_size_that_does_not_divide_the_batch():
    result = runner.invoke(app, ["config", "debug", "--nproc-per-node", "3"])
    assert_one_line_error(result, "train.global_batch_size (8)", "data-parallel ranks (3)")


def test_config_unknown_key_is_one_line():
    result = runner.invoke(app, ["config", "debug", "optim.lrr=0.1"])
    line = assert_one_line_error(result, "unknown key 'optim.lrr'")
    assert line.endswith("did you mean 'optim.lr'?")


def test_train_hands_the_resolved_recipe_to_the_launcher(launches, tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        ["train", "debug", "--nproc-per-node", "1", "--run-dir", str(run_dir), "optim.lr=0.01"],
    )
    assert result.exit_code == 0, result.output
    assert len(launches) == 1
    resolved, target = launches[0]
    cfg = resolved.config
    assert cfg.launch.nproc_per_node == 1
    assert cfg.optim.lr == 0.01
    assert target == run_dir
    assert cfg.output.run_dir == str(run_dir)
    assert resolved.name == "debug"
    assert resolved.provenance["launch.nproc_per_node"] == CLI_SOURCE
    assert resolved.provenance["model.dim"] == "builtin:debug"


def test_train_default_run_dir(launches):
    result = runner.invoke(app, ["train", "debug", "--nproc-per-node", "1"])
    assert result.exit_code == 0, result.output
    resolved, target = launches[0]
    assert target.parent == Path("runs")
    assert target.name.startswith("debug-")
    assert resolved.config.output.run_dir == str(target)


def test_runs_started_in_the_same_second_get_folders_of_their_own(launches, tmp_path, monkeypatch):
    # A script launching short runs back to back: the clock shows one second for all three.
    # The second once found the first's checkpoints in "its" folder and was refused.
    monkeypatch.chdir(tmp_path)
    frozen = time.localtime(1_800_000_000)
    monkeypatch.setattr("fsdprun.rundir.time.localtime", lambda _=None: frozen)
    for _ in range(3):
        result = runner.invoke(app, ["train", "debug", "--nproc-per-node", "1"])
        assert result.exit_code == 0, result.output
        (launches[-1][1] / "checkpoints").mkdir(parents=True)  # as the run would leave it
    stamp = time.strftime("%Y%m%d-%H%M%S", frozen)
    names = [target.name for _, target in launches]
    assert names == [f"debug-{stamp}", f"debug-{stamp}-2", f"debug-{stamp}-3"]
    assert [r.config.output.run_dir for r, _ in launches] == [str(t) for _, t in launches]


def test_every_node_of_a_multi_node_run_names_the_same_default_run_dir(
    launches, tmp_path, monkeypatch
):
    # Each node's launcher once named its own runs/<recipe>-<its clock>: on a shared filesystem
    # a checkpoint's shards went to as many folders as nodes. launch.rdzv_id is the same on all.
    monkeypatch.chdir(tmp_path)
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29500"]
    for node_rank, extra in ((0, []), (1, []), (1, ["launch.rdzv_id=job-7"])):
        result = runner.invoke(
            app, ["train", "debug", *extra, *nodes, "--node-rank", str(node_rank)]
        )
        assert result.exit_code == 0, result.output
        Path(launches[-1][1]).mkdir(parents=True, exist_ok=True)  # a shared folder: node 0's
    assert [target for _, target in launches] == [
        Path("runs/debug-fsdprun"),
        Path("runs/debug-fsdprun"),
        Path("runs/debug-job-7"),
    ]
    # One node: the time, as before.
    result = runner.invoke(app, ["train", "debug", "--nproc-per-node", "1"])
    assert result.exit_code == 0, result.output
    assert launches[-1][1].name.startswith("debug-20")
    # A job id that would name a folder elsewhere is refused before launch.
    for job in ("a/b", ".."):
        result = runner.invoke(
            app, ["train", "debug", *nodes, "--node-rank", "0", "--rdzv-id", job]
        )
        assert_one_line_error(result, f"launch.rdzv_id: '{job}' is no folder name")
    assert len(launches) == 4


@pytest.mark.parametrize("name", ["run #1", "2024-01-01"])
def test_train_run_dir_is_taken_verbatim(launches, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "debug", "--run-dir", name])
    assert result.exit_code == 0, result.output
    resolved, target = launches[0]
    assert target == Path(name)
    assert resolved.config.output.run_dir == name


# torchrun's spellings of the flags fsdprun shares with it, and the launch.* key each sets.
TORCHRUN_FLAGS = [
    ("--nproc_per_node", "--nproc-per-node", "1", "nproc_per_node", 1),
    ("--nnodes", "--nnodes", "2", "nnodes", 2),
    ("--node_rank", "--node-rank", "1", "node_rank", 1),
    ("--rdzv_endpoint", "--rdzv-endpoint", "node0:29400", "rdzv_endpoint", "node0:29400"),
    ("--max_restarts", "--max-restarts", "3", "max_restarts", 3),
]


def test_train_takes_torchrun_spellings_of_the_launch_flags(launches):
    for spelling in (0, 1):
        args = [arg for flag in TORCHRUN_FLAGS for arg in (flag[spelling], flag[2])]
        result = runner.invoke(app, ["train", "debug", *args])
        assert result.exit_code == 0, result.output
    assert len(launches) == 2
    underscored, dashed = (resolved.config.launch for resolved, _ in launches)
    for *_, key, value in TORCHRUN_FLAGS:
        assert getattr(underscored, key) == getattr(dashed, key) == value, key
        assert launches[0][0].provenance[f"launch.{key}"] == CLI_SOURCE
    # --opt=value, and the commands that take fewer launch flags
    result = runner.invoke(app, ["config", "debug", "--nproc_per_node=1", "--explain"])
    assert result.exit_code == 0, result.output
    assert "nproc_per_node: 1" in result.stdout


def test_resume_takes_max_restarts_and_standalone(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("fsdprun.cli._resume", lambda *args, **kw: calls.append(args[2]))
    # A run directory as resume checks it before anything loads: its recipe and a checkpoint.
    (tmp_path / "recipe.yaml").write_text(load_recipe("debug").to_yaml())
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    args = ["resume", str(tmp_path), "--max_restarts", "2", "--standalone", "--nproc_per_node", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(calls[0]) == [
        "launch.max_restarts=2", "launch.nnodes=1", "launch.node_rank=0",
        "launch.nproc_per_node=1", "launch.rdzv_endpoint=",
    ]  # fmt: skip


def test_standalone_is_one_node_whatever_the_recipe_says(launches):
    multi_node = ["launch.nnodes=2", "launch.node_rank=1", "launch.rdzv_endpoint=node0:29400"]
    result = runner.invoke(app, ["train", "debug", *multi_node, "--standalone"])
    assert result.exit_code == 0, result.output
    launch = launches[0][0].config.launch
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint) == (1, 0, "")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--nnodes", "2"], "--nnodes 2"),
        (["--rdzv_endpoint", "node0:29400"], "--rdzv-endpoint node0:29400"),
        (["--node-rank", "1", "--nnodes", "2"], "--nnodes 2, --node-rank 1"),
    ],
)
def test_standalone_refuses_flags_for_several_nodes(launches, flags, named):
    result = runner.invoke(app, ["train", "debug", "--standalone", *flags])
    assert_one_line_error(result, "--standalone", f"cannot go with {named}:")
    assert launches == []


def test_train_invalid_recipe_does_not_launch(launches):
    result = runner.invoke(app, ["train", "debug", "train.steps=0"])
    assert_one_line_error(result, "train.steps must be > 0 (got 0)")
    assert launches == []


def test_train_failed_worker_is_one_line_exit_1(monkeypatch):
    from fsdprun.launch.elastic import WorkerFailed

    def failing_launch(resolved: ResolvedRecipe, run_dir: Path, **how) -> None:
        raise WorkerFailed("rank 1 failed: boom (log: x/logs/rank1.log)", user_error=False)

    monkeypatch.setattr("fsdprun.launch.elastic.launch_training", failing_launch)
    result = runner.invoke(app, ["train", "debug"])
    assert result.exit_code == 1
    assert result.stderr == "error: rank 1 failed: boom (log: x/logs/rank1.log)\n"


def test_debug_env_shows_the_traceback_in_process(monkeypatch):
    monkeypatch.setenv("FSDPRUN_DEBUG", "1")
    result = runner.invoke(app, ["config", "debug", "optim.lrr=0.1"])
    assert result.exit_code == 1
    assert type(result.exception).__name__ == "UserError"


def test_console_script_errors(tmp_path):
    """The installed `fsdprun` script: one line and exit 2, or the traceback when debugging."""
    args = [FSDPRUN, "config", "nonexistent.yaml"]
    # Both start torch (the CLI imports the launcher), so run them side by side.
    plain = subprocess.Popen(
        args, cwd=tmp_path, env=fsdprun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    debug = subprocess.Popen(
        args, cwd=tmp_path, env=fsdprun_env(FSDPRUN_DEBUG="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = plain.communicate(timeout=120)
    debug_out, debug_err = debug.communicate(timeout=120)

    assert plain.returncode == 2, err
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: recipe 'nonexistent.yaml' is neither a file nor a built-in")
    assert "Traceback" not in err

    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug_err
    assert "fsdprun.errors.UserError: recipe 'nonexistent.yaml'" in debug_err
