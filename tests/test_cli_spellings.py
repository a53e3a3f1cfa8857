"""The command line as its users spell it: torchrun's flags in both spellings, flags read as
`--x/--no-x`, shell completion, recipe names.

Launch flags are checked where they end up (the resolved recipe and the elastic agent's
LaunchConfig, built without launching); the flags with an effect at run time share one real
launch. Run with `pytest tests/test_cli_spellings.py`.
"""

from __future__ import annotations

import subprocess

import pytest
import typer
from conftest import FSDPRUN, fsdprun_env
from typer.testing import CliRunner

from fsdprun.cli import app

runner = CliRunner()


def _commands() -> dict:
    group = typer.main.get_command(app)
    return group.commands


def _flags(command) -> list:
    return [
        p for p in command.params
        if p.param_type_name == "option" and p.is_flag and not p.count and p.name != "help"
    ]  # fmt: skip


def test_help_shows_no_value_for_a_flag():
    # Every command's help, rendered by rich as users see it: a flag is `--x`, not `--x <bool>`.
    for name in ["", *_commands()]:
        result = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (name, result.output)
        assert "<bool>" not in result.output, (name, result.output)


def test_every_flag_has_its_negative():
    # A flag of a command (not the eager --version) reads as --x/--no-x, and --no-x parses.
    seen = 0
    for name, command in _commands().items():
        for flag in _flags(command):
            if flag.name == "version":
                continue
            [long] = [o for o in flag.opts if o.startswith("--")]
            assert flag.secondary_opts == [f"--no-{long[2:]}"], (name, flag.opts)
            seen += 1
    assert seen >= 10
    # The negative wins when it comes last, as in click (a script's `--explain` turned off).
    explained = runner.invoke(app, ["config", "debug", "--explain"])
    plain = runner.invoke(app, ["config", "debug", "--explain", "--no-explain"])
    assert explained.exit_code == plain.exit_code == 0, (explained.output, plain.output)
    assert plain.output != explained.output
    assert plain.output == runner.invoke(app, ["config", "debug"]).output


def _bash_complete(words: str, env: dict[str, str]) -> list[str]:
    parts = words.split(" ")
    proc = subprocess.run(
        [FSDPRUN], env={**env, "COMP_WORDS": words, "COMP_CWORD": str(len(parts) - 1),
                        "_FSDPRUN_COMPLETE": "complete_bash"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_shell_completion(tmp_path):
    # A home of its own: --install-completion writes there, never in the real one.
    env = fsdprun_env(HOME=str(tmp_path), SHELL="/bin/bash")
    shown = subprocess.run(
        [FSDPRUN, "--show-completion", "bash"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "complete -o default -F _fsdprun_completion fsdprun" in shown.stdout
    assert "_FSDPRUN_COMPLETE=complete_bash" in shown.stdout
    # What that script asks the command for: commands, recipe names, options.
    assert _bash_complete("fsdprun tr", env) == ["train"]
    assert _bash_complete("fsdprun train deb", env) == ["debug"]
    assert _bash_complete("fsdprun train llama-", env) == ["llama-1b", "llama-70b", "llama-8b"]
    assert "--nproc-per-node" in _bash_complete("fsdprun train debug --nproc", env)
    installed = subprocess.run(
        [FSDPRUN, "--install-completion", "bash"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    script = tmp_path / ".bash_completions" / "fsdprun.sh"
    assert script.read_text().strip() == shown.stdout.strip()
    assert str(script) in (tmp_path / ".bashrc").read_text()


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_completion_scripts_for_other_shells(tmp_path, shell):
    env = fsdprun_env(HOME=str(tmp_path), SHELL=f"/bin/{shell}")
    shown = subprocess.run(
        [FSDPRUN, "--show-completion", shell], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "_FSDPRUN_COMPLETE" in shown.stdout


def test_recipes_lists_where_each_runs_its_computed_size_and_whole_sentences():
    from fsdprun.config import builtin_recipes, load_recipe
    from fsdprun.report.console import fmt_count
    from fsdprun.tools.plan import plan_recipe

    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert set(lines) == set(builtin_recipes())
    for name, description in builtin_recipes().items():
        # A whole sentence, however many comment lines it takes in the recipe.
        assert description.endswith("."), (name, description)
        assert lines[name].endswith(f"  {description}")
    assert builtin_recipes()["lora-demo"].endswith("have optimizer state and are checkpointed.")
    # Counted as the model is built (plan builds it on the meta device), not as written.
    for name in ("debug", "llama-1b", "sft-demo"):
        assert f"  {fmt_count(plan_recipe(name, []).num_params)}  " in lines[name], lines[name]
    assert " 886.11M " in lines["llama-1b"] and "1.1B" not in lines["llama-1b"]
    # Where it runs, from its launch.* section.
    assert lines["debug"].split()[1:4] == ["2", "CPU", "ranks"]
    assert " 1 GPU " in lines["llama-1b"]
    assert " 8 GPUs " in lines["llama-8b"]
    assert " 4 nodes x 8 GPUs " in lines["llama-70b"]
    cfg = load_recipe("llama-70b", []).config
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (4, 8)
