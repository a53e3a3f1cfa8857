"""The command line as its users spell it: torchrun's flags in both spellings, flags read as
`--x/--no-x`, shell completion, recipe names.

Launch flags are checked where they end up (the resolved recipe and the elastic agent's
LaunchConfig, built without launching); the flags with an effect at run time share one real
launch. Run with `pytest tests/test_cli_spellings.py`.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import typer
from conftest import FSDPRUN, fsdprun_env, run_fsdprun
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


def _in_bash(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # typer finds the shell to complete for among the command's parent processes (shellingham):
    # run it from bash, as a user types it. `; exit $?` keeps bash the parent: `bash -c CMD`
    # would exec a lone simple command, and the parent would be whatever started pytest.
    return subprocess.run(["bash", "-c", f"{command}; exit $?"], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_shell_completion(tmp_path):
    # A home of its own: --install-completion writes there, never in the real one.
    env = fsdprun_env(HOME=str(tmp_path), SHELL="/bin/bash")
    shown = _in_bash(f"{FSDPRUN} --show-completion", env)
    assert shown.returncode == 0, shown.stderr
    assert "complete -o default -F _fsdprun_completion fsdprun" in shown.stdout
    assert "_FSDPRUN_COMPLETE=complete_bash" in shown.stdout
    # What that script asks the command for: commands, recipe names, options.
    assert _bash_complete("fsdprun tr", env) == ["train"]
    assert sorted(_bash_complete("fsdprun train deb", env)) == ["debug", "debug-moe"]
    assert sorted(_bash_complete("fsdprun train llama-", env)) == [
        "llama-1b",
        "llama-70b",
        "llama-8b",
        "llama-8b-long",
    ]
    assert "--nproc-per-node" in _bash_complete("fsdprun train debug --nproc", env)
    installed = _in_bash(f"{FSDPRUN} --install-completion", env)
    assert installed.returncode == 0, installed.stderr
    script = tmp_path / ".bash_completions" / "fsdprun.sh"
    assert script.read_text().strip() == shown.stdout.strip()
    assert str(script) in (tmp_path / ".bashrc").read_text()


def test_recipes_lists_where_each_runs_its_computed_size_and_whole_sentences():
    from fsdprun.config import builtin_recipes, load_recipe
    from fsdprun.fmt import fmt_count
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
    for name in ("debug", "llama-1b"):
        assert f"  {fmt_count(plan_recipe(name, []).num_params)}  " in lines[name], lines[name]
    assert " 886.11M " in lines["llama-1b"] and "1.1B" not in lines["llama-1b"]
    # Where it runs, from its launch.* section.
    assert lines["debug"].split()[1:4] == ["2", "CPU", "ranks"]
    assert " 1 GPU " in lines["llama-1b"]
    assert " 8 GPUs " in lines["llama-8b"]
    assert " 4 nodes x 8 GPUs " in lines["llama-70b"]
    cfg = load_recipe("llama-70b", []).config
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (4, 8)


# --------------------------------------------------------------------------------------------
# torchrun's launch flags: (flags as typed with dashes, the launch.* values they set). Each row
# is tried in torchrun's three spellings (--nproc-per-node N, --nproc_per_node N,
# --nproc_per_node=N), through train, resume, compare and tune alike.
LAUNCH_TABLE = [
    (["--nproc-per-node", "1"], {"nproc_per_node": 1}),
    (["--nproc-per-node", "cpu"], {"nproc_per_node": len(os.sched_getaffinity(0))}),
    (["--nnodes", "2:2", "--node-rank", "1", "--rdzv-endpoint", "node0:29400"],
     {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0:29400"}),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", "--master-port", "29600"],
     {"nnodes": 2, "rdzv_endpoint": "node0:29600"}),
    (["--nnodes", "2", "--master-addr", "node0"], {"rdzv_endpoint": "node0:29500"}),
    (["--rdzv-id", "job7", "--rdzv-backend", "c10d"], {"rdzv_id": "job7"}),
    (["--rdzv-conf", "read_timeout=60,join_timeout=900,last_call_timeout=5"],
     {"rdzv_conf": {"read_timeout": "60", "last_call_timeout": "5"}, "rdzv_timeout_s": 900}),
    (["--log-dir", "LOGS", "--tee", "3", "--redirects", "0:3,1:0", "--local-ranks-filter", "1"],
     {"log_dir": "LOGS", "tee": "3", "redirects": "0:3,1:0", "local_ranks_filter": [1]}),
    (["--max-restarts", "2", "--monitor-interval", "0.5", "--role", "trainer"],
     {"max_restarts": 2, "monitor_interval_s": 0.5, "role": "trainer"}),
    (["-r", "1", "-t", "2"], {"redirects": "1", "tee": "2"}),
    (["--standalone"], {"nnodes": 1, "rdzv_endpoint": ""}),
    (["--standalone", "--no-standalone", "--nnodes", "2"], {"nnodes": 2}),
]  # fmt: skip


def _underscored(flags) -> list[str]:
    return ["--" + f[2:].replace("-", "_") if f.startswith("--") else f for f in flags]


SPELLINGS = {
    "dashes": lambda flags: flags,
    "underscores": _underscored,
    "equals": lambda flags: _joined(_underscored(flags)),
}


def _joined(flags) -> list[str]:
    out: list[str] = []
    for f in flags:
        if out and out[-1].startswith("--") and not f.startswith("-") and "=" not in out[-1]:
            out[-1] += f"={f}"
        else:
            out.append(f)
    return out


@pytest.fixture
def launched(monkeypatch):
    """Each launching command with its heavy call patched: COMMAND -> launch.* of what it would
    launch (the resolved recipe's launch section)."""
    from fsdprun.config import load_recipe

    seen: list = []
    monkeypatch.setattr(
        "fsdprun.launch.elastic.launch_training",
        lambda resolved, run_dir, **kw: seen.append(resolved.config.launch),
    )
    monkeypatch.setattr(
        "fsdprun.cli._resume",
        lambda run_dir, overrides, extra, **kw: seen.append(
            load_recipe("debug", [*(overrides or []), *extra]).config.launch
        ),
    )
    monkeypatch.setattr(
        "fsdprun.tools.compare.compare",
        lambda recipe, overrides, *a, **kw: (
            seen.append(load_recipe(recipe, overrides).config.launch) or {"results": []}
        ),
    )
    monkeypatch.setattr(
        "fsdprun.tools.tune.tune",
        lambda args, say=None: seen.append(
            (load_recipe(args.recipe, args.launch_overrides).config.launch, args.launch_flags)
        ),
    )
    return seen


def _invoke(command: str, flags: list[str], tmp_path) -> object:
    if command == "resume":
        from fsdprun.config import load_recipe

        run = tmp_path / "run"
        (run / "checkpoints" / "step-00000004").mkdir(parents=True, exist_ok=True)
        (run / "recipe.yaml").write_text(load_recipe("debug").to_yaml())
        args = ["resume", str(run)]
    elif command == "tune":
        args = ["tune", "debug", "--out", str(tmp_path / "tune"), "--dry-run"]
    elif command == "compare":
        args = ["compare", "debug", "--json"]
    else:
        args = ["train", "debug"]
    return runner.invoke(app, [*args, *flags], catch_exceptions=False)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize(("flags", "expected"), LAUNCH_TABLE,
                         ids=[" ".join(f) for f, _ in LAUNCH_TABLE])  # fmt: skip
def test_torchrun_flags_set_the_launch(launched, tmp_path, flags, expected, spelling):
    typed = SPELLINGS[spelling](flags)
    multi_node = "--nnodes" in flags and flags[flags.index("--nnodes") + 1] not in ("1", "1:1")
    commands = ["train"]
    if spelling == "dashes":  # the commands share one option set: one spelling tells for them
        commands += ["resume", "tune"] + ([] if multi_node else ["compare"])
    for command in commands:
        result = _invoke(command, typed, tmp_path)
        assert result.exit_code == 0, (command, typed, result.output)
    assert len(launched) == len(commands)
    for command, launch in zip(commands, launched, strict=True):
        if command == "tune":
            launch, printed = launch
            # tune's printed train command repeats the long flags given, in fsdprun's spelling.
            given = {f for f in flags if f.startswith("--")}
            if "--no-standalone" in given:
                given -= {"--standalone", "--no-standalone"}
            assert given <= set(" ".join(printed).split()), printed
        for key, value in expected.items():
            assert getattr(launch, key) == value, (command, typed, key)


def test_compare_refuses_flags_for_several_nodes(launched, tmp_path):
    result = _invoke("compare", ["--nnodes", "2", "--rdzv-endpoint", "node0:29400"], tmp_path)
    assert_one_line_error(result, "compare runs its configurations on this node only")
    assert launched == []


def assert_one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


REFUSED = [
    (["--nnodes", "1:2"], "fsdprun runs a fixed number of nodes, not an elastic range; give "
     "--nnodes 2"),
    (["--nnodes", "2:1"], "MIN must not exceed MAX"),
    (["--nnodes", "two"], "expected a number of nodes, or MIN:MAX"),
    (["--rdzv-backend", "static"], "fsdprun's rendezvous is always c10d"),
    (["--rdzv_backend", "etcd-v2"], "--rdzv-backend etcd-v2: fsdprun's rendezvous is always c10d"),
    (["--nproc-per-node", "lots"], "expected a number of workers, or auto, cpu, gpu, xpu"),
    (["--tee", "4"], "launch.tee: '4' is not a stream choice"),
    (["--redirects", "0:5"], "launch.redirects: '0:5' is not a stream choice"),
    (["--local-ranks-filter", "a,b"], "--local-ranks-filter 'a,b': expected local ranks"),
    (["--local-ranks-filter", "5"], "launch.local_ranks_filter [5] are not local ranks"),
    (["--rdzv-conf", "read_timeout"], "expected KEY=VALUE,..."),
    (["--rdzv-conf", "read_timeot=5"], "did you mean 'read_timeout'?"),
    (["--rdzv-conf", "read_timeout=soon"], "read_timeout='soon' must be a whole number"),
    (["--nnodes", "2", "--master-addr", "a", "--rdzv-endpoint", "b:1"],
     "--master-addr/--master-port and --rdzv-endpoint name the same store"),
    (["--standalone", "--master-port", "29600"], "cannot go with --master-port 29600"),
    (["--monitor-interval", "0"], "launch.monitor_interval_s must be > 0"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_torchrun_flags_fsdprun_does_not_take_are_refused_in_one_line(
    launched, tmp_path, flags, message
):
    result = _invoke("train", flags, tmp_path)
    assert_one_line_error(result, message)
    assert launched == []


@pytest.mark.skipif(
    __import__("fsdprun.config", fromlist=["x"]).accelerator_device_nodes() != [],
    reason="a machine with accelerators counts them",
)
def test_nproc_per_node_gpu_without_one(launched, tmp_path):
    result = _invoke("train", ["--nproc-per-node", "gpu"], tmp_path)
    assert_one_line_error(result, "--nproc-per-node gpu: torch sees no CUDA device")


def test_the_agent_is_configured_as_torchrun_configures_it(tmp_path, monkeypatch):
    # The independent reference: torchrun's own parser and config_from_args, same flags.
    from torch.distributed.run import config_from_args, parse_args

    from fsdprun.launch.elastic import build_launch_plan
    from fsdprun.launch.rendezvous import NODES_BACKEND

    configs = []
    monkeypatch.setattr(
        "fsdprun.launch.elastic.launch_training",
        lambda resolved, run_dir, **kw: configs.append(resolved.config),
    )
    flags = [
        "--nnodes", "2:2", "--nproc-per-node", "2", "--node-rank", "1",
        "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7",
        "--rdzv-conf", "read_timeout=60,last_call_timeout=5,join_timeout=900",
        "--max-restarts", "2", "--monitor-interval", "0.5", "--role", "trainer",
        "--log-dir", str(tmp_path / "logs"), "--tee", "1", "--redirects", "0:3,1:2",
        "--local-ranks-filter", "1",
    ]  # fmt: skip
    result = runner.invoke(app, ["train", "debug", *_underscored(flags)])
    assert result.exit_code == 0, result.output
    ours = build_launch_plan(configs[0], tmp_path / "run", device_kind="cpu").config
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it otherwise
    theirs, _, _ = config_from_args(parse_args([*flags, "--rdzv-backend", "c10d", "train.py"]))
    for name in ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "role", "rdzv_endpoint",
                 "max_restarts", "monitor_interval"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    # torch's c10d handler, under fsdprun's name: node N takes group rank N (launch/rendezvous).
    assert (ours.rdzv_backend, theirs.rdzv_backend) == (NODES_BACKEND, "c10d")
    for key, value in theirs.rdzv_configs.items():
        assert str(ours.rdzv_configs[key]) == str(value), key
    for name in ("_root_log_dir", "_redirects", "_tee", "_local_ranks_filter"):
        assert getattr(ours.logs_specs, name) == getattr(theirs.logs_specs, name), name


def test_log_dir_tee_and_local_ranks_filter_in_a_real_launch(tmp_path):
    # torch's C++ INFO lines (the c10d store connecting) are what every worker prints here.
    env = fsdprun_env(TORCH_CPP_LOG_LEVEL="INFO")
    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", "train.steps=2", "--run_dir", str(run_dir), "--log_dir", str(logs),
        "--tee", "3", "--local_ranks_filter", "1", "--rdzv_id", "job7", "--role", "trainer",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # As torchrun lays them out: LOG_DIR/<rdzv_id>_<random>/attempt_0/<local rank>/.
    [job] = logs.iterdir()
    assert job.name.startswith("job7_")
    for rank in (0, 1):
        assert "[c10d]" in (job / "attempt_0" / str(rank) / "stderr.log").read_text()
        assert (job / "attempt_0" / str(rank) / "stdout.log").is_file()
    assert not any((run_dir / "logs").iterdir())  # nothing left in the default place
    # Teed to the console with the role's prefix, rank 1's lines only.
    teed = [line for line in proc.stderr.splitlines() if line.startswith("[trainer")]
    assert teed and all(line.startswith("[trainer1]:") for line in teed), proc.stderr
    assert "final loss" in proc.stdout
