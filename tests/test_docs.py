"""Every shell command in README.md and docs/*.md, run as written.

The fenced `bash`/`sh` blocks of README.md, then of docs/*.md in name order, run one command
(a line, with its `\\` continuations) at a time with `bash`, in one working directory shared by
all of them and in document order, as a reader who follows the docs from the top would run
them: a walkthrough (train, resume, inspect the run's checkpoints, export them) runs in
sequence, and a later section may use what an earlier one made. A command that appears again
(the docs repeat the README's examples), with the same exit status and whatever its comment
says, runs once. `fsdprun` and `python` are this
environment's. Each command must exit 0, or with the status its comment names, `(exit N)`.

Markers, in a command's trailing comment: `needs: gpu`, `needs: nodes` (several machines),
`needs: cluster` (a Kubernetes cluster, a container engine and registry, a cloud account:
`kubectl`, `helm`, `docker`, `sky`), `needs: network` (downloads, uploads, a server to browse)
and `needs: idle machine` (a benchmark, whose figures mean nothing on a shared CI machine). Such
a command is not run; its syntax is checked (`bash -n`), its `fsdprun train|compare|plan|config`
invocation is checked for recipe and keys with `fsdprun config` (same recipe, overrides and node
shape), the scripts, examples and docker files it names exist, and the `fsdprun[extra]` it
installs is a declared extra. The two commands CI
itself runs, `bash scripts/setup.sh` and `python -m pytest`, are skipped.

The docs' placeholders are given small real files in the working directory: `my.yaml` and
`my-sft.yaml` (recipes extending `debug` and `sft-demo`, 4 steps: a reader's own recipe, whose
length the docs do not say), `corpus/*.txt` and `chat.jsonl` (the shipped text and chat data),
`path/to/llama-folder` and `path/to/hf-folder` (the shipped tiny HuggingFace folder);
`recipes/` is the repository's, so `recipes/data/...` paths resolve.

Run with `pytest tests/test_docs.py -s -n 0` to see the costliest commands: about 118 CPU s
(137 before the docs' key examples named `train.steps=4`) and 4 min 45 s on a shared 2-core
machine (2026-12-05, `fsdprun` through the suite's zygote), most of it in the training
launches the docs show; the costliest, `torchrun ... -m fsdprun` (11 CPU s), execs torchrun and
its workers afresh, as `python -m fsdprun` is run nowhere else in the suite.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import fsdprun_env, tree_cpu_s, zygote_fsdprun
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell"}
NEEDS = {"gpu", "nodes", "cluster", "network", "idle"}  # the word after `needs:`
# Run by CI itself (.ci/run): the setup script and the test suite.
SKIPPED = (re.compile(r"\bscripts/setup\.sh\b"), re.compile(r"-m pytest\b"))
TIMEOUT_S = 600


@dataclass
class Command:
    doc: str  # README.md, docs/commands.md, ...
    line: int
    text: str  # continuation lines joined
    needs: str | None = None
    exit_code: int = 0

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence
    commands: list[Command] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _comment(text: str) -> str:
    """The trailing comment of a command line (shell quoting respected)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[i + 1 :]
    return ""


def parse_blocks(path: Path) -> list[Block]:
    """The shell blocks of one Markdown file, each command with its marker and exit status."""
    doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    blocks: list[Block] = []
    block: Block | None = None
    pending: list[str] = []
    start = 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if block is None and line[3:].strip() in SHELL_FENCES:
                block = Block(doc, number)
                blocks.append(block)
            elif block is not None:
                assert not pending, f"{doc}:{start}: a `\\` continuation runs into the fence"
                block = None
            continue
        if block is None:
            continue
        if not pending:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        text = " ".join(part.strip() for part in [*pending, line])
        pending = []
        comment = _comment(text)
        needs = re.search(r"needs: (\w+)", comment)
        code = re.search(r"\(exit (\d+)\)", comment)
        if needs:
            assert needs[1] in NEEDS, f"{doc}:{start}: unknown marker needs: {needs[1]}"
        block.commands.append(
            Command(doc, start, text, needs[1] if needs else None, int(code[1]) if code else 0)
        )
    return blocks


BLOCKS = [block for path in DOCS for block in parse_blocks(path)]


def _same_key(command: Command) -> tuple[str, int]:
    """What makes two commands the same run: the words before the comment, and the exit
    status."""
    comment = _comment(command.text)
    bare = command.text[: len(command.text) - len(comment)] if comment else command.text
    return bare.rstrip().removesuffix("#").rstrip(), command.exit_code


def _skipped(command: Command) -> bool:
    words = shlex.join(shlex.split(command.text, comments=True))
    return any(pattern.search(words) for pattern in SKIPPED)


# --------------------------------------------------------------------------------------------
# The working directory and the run of every command


def make_workspace(root: Path) -> Path:
    """A reader's working directory: the repository's recipes and the docs' placeholders."""
    data = ROOT / "recipes" / "data"
    (root / "recipes").symlink_to(ROOT / "recipes", target_is_directory=True)
    (root / "my.yaml").write_text(
        "# fsdprun train my.yaml: the debug recipe, one sequence per micro-batch, 4 steps\n"
        "extends: debug\ntrain:\n  micro_batch_size: 1\n  steps: 4\n"
    )
    (root / "my-sft.yaml").write_text("extends: sft-demo\ntrain:\n  steps: 4\n")
    (root / "corpus").mkdir()
    shutil.copy(data / "tiny.txt", root / "corpus" / "tiny.txt")
    shutil.copy(data / "chat.jsonl", root / "chat.jsonl")
    (root / "path" / "to").mkdir(parents=True)
    for name in ("llama-folder", "hf-folder"):
        (root / "path" / "to" / name).symlink_to(data / "tiny-llama-hf", target_is_directory=True)
    return root


def _env(root: Path) -> dict[str, str]:
    """This environment's `fsdprun` and `python` first on PATH (`fsdprun` through the suite's
    warm zygote, see tests/zygote.py), and torch's `torchrun` (which a venv that finds torch
    through a .pth file lacks: then the same entry point by hand)."""
    env = fsdprun_env()
    bin_dir = Path(sys.executable).parent
    shims = root / ".bin"
    shims.mkdir(exist_ok=True)
    zygote_fsdprun(shims)
    if not (bin_dir / "torchrun").exists():
        shim = shims / "torchrun"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
        shim.chmod(0o755)
    env["PATH"] = os.pathsep.join([str(shims), str(bin_dir), env.get("PATH", "")])
    env.pop("FSDPRUN_DEBUG", None)
    return env


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float
    cpu_s: float = 0.0  # of the command and every process it started (the zygote's included)
    same_as: str | None = None  # the earlier, identical command whose result this is


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory) -> dict[str, Result]:
    """Every command that is not marked nor skipped, run once in document order in one shared
    working directory; results by `Command.where`."""
    cwd = make_workspace(tmp_path_factory.mktemp("docs"))
    env = _env(cwd)
    results: dict[str, Result] = {}
    first: dict[tuple[str, int], str] = {}
    for block in BLOCKS:
        for command in block.commands:
            if command.needs or _skipped(command):
                continue
            key = _same_key(command)
            if key in first:
                earlier = results[first[key]]
                results[command.where] = Result(
                    earlier.returncode, earlier.output, 0.0, same_as=first[key]
                )
                continue
            first[key] = command.where
            began, cpu = time.perf_counter(), tree_cpu_s()
            proc = subprocess.run(
                ["bash", "-c", command.text], cwd=cwd, env=env, capture_output=True, text=True,
                timeout=TIMEOUT_S,
            )  # fmt: skip
            results[command.where] = Result(
                proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - began,
                tree_cpu_s() - cpu,
            )  # fmt: skip
    costliest = sorted(results.items(), key=lambda item: -item[1].cpu_s)[:12]
    print(
        "\ndoc commands, costliest:",
        *(f"{r.seconds:6.1f} s ({r.cpu_s:5.1f} CPU s)  {w}" for w, r in costliest), sep="\n",
    )  # fmt: skip
    # CPU seconds vary less with the machine's load than wall time (a command through the
    # zygote is counted as the zygote reaps it).
    print(
        f"doc commands: {sum(r.seconds for r in results.values()):.1f} s in all, "
        f"{sum(r.cpu_s for r in results.values()):.1f} CPU s"
    )
    expected = {c.where: c.exit_code for b in BLOCKS for c in b.commands}
    wrong = [w for w, r in results.items() if r.returncode != expected[w]]
    print("doc commands with another exit status than expected:", wrong or "none")
    return results


# --------------------------------------------------------------------------------------------
# Marked commands: syntax and keys


def _fsdprun_args(text: str) -> list[str] | None:
    """The arguments after `fsdprun` (or `-m fsdprun`) in a command line, comments dropped."""
    words = shlex.split(text, comments=True)
    for i, word in enumerate(words):
        if word == "fsdprun" or word.endswith("/fsdprun"):
            return words[i + 1 :]
    return None


def config_args(args: list[str]) -> list[str] | None:
    """`fsdprun config` arguments checking the recipe, overrides and node shape of a `train`,
    `compare`, `plan` or `config` invocation; None for other commands."""
    if not args or args[0] not in ("train", "compare", "plan", "config"):
        return None
    recipe, overrides, shape = None, [], []
    rest = iter(args[1:])
    for word in rest:
        flag = word.replace("_", "-")
        if flag in ("--nproc-per-node", "--nnodes"):
            shape += [flag, next(rest)]
        elif word.startswith("--"):
            # Options of the command itself; the ones with a value take the next word.
            if flag not in ("--standalone", "--json", "--markdown", "--explain"):
                next(rest)
        elif recipe is None:
            recipe = word
        elif "=" in word or word.startswith("~"):
            overrides.append(word)
    assert recipe, f"no recipe in {args}"
    return ["config", recipe, *overrides, *shape]


def check_marked(command: Command, cwd: Path) -> None:
    """What can be checked of a command that is not run here."""
    syntax = subprocess.run(["bash", "-n", "-c", command.text], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{command.where}: {syntax.stderr}"
    words = shlex.split(command.text, comments=True)
    for word in words:
        if re.match(r"(\S*/)?scripts/\S+\.(py|sh)$", word):
            script = word.split("scripts/", 1)[1]
            assert (ROOT / "scripts" / script).is_file(), f"{command.where}: no scripts/{script}"
        # A file of the repository a walkthrough applies or builds from (globs: one at least).
        if re.match(r"(examples|docker)/\S+\.(yaml|sh|sbatch)$", word):
            assert list(ROOT.glob(word)), f"{command.where}: no {word}"
        for extra in re.findall(r"^fsdprun\[(\w+)\]$", word):
            extras = importlib.metadata.metadata("fsdprun").get_all("Provides-Extra")
            assert extra in extras, f"{command.where}: fsdprun[{extra}] is no extra"
    args = _fsdprun_args(command.text)
    check = config_args(args) if args else None
    if check:
        from fsdprun.cli import app

        old = Path.cwd()
        os.chdir(cwd)
        try:
            result = CliRunner().invoke(app, check)
        finally:
            os.chdir(old)
        assert result.exit_code == 0, (
            f"{command.where}: fsdprun {shlex.join(check)}:\n{result.output}"
        )


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("marked"))


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_doc_block(block: Block, request, placeholders):
    for command in block.commands:
        if _skipped(command):
            continue
        if command.needs:
            check_marked(command, placeholders)
            continue
        # Only a block with commands to run waits for the run of every block.
        result = request.getfixturevalue("doc_run")[command.where]
        again = f" (the same command as {result.same_as})" if result.same_as else ""
        assert result.returncode == command.exit_code, (
            f"{command.where}{again}: `{command.text}` exited {result.returncode}, "
            f"expected {command.exit_code}:\n{result.output[-3000:]}"
        )


def test_parser_reads_markers_exits_and_continuations(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "```bash\n# a comment line\nfsdprun train llama-1b   # one GPU; needs: gpu\n"
        "FSDPRUN_FAIL_AT=0:7 fsdprun train debug \\\n    train.steps=8   # fails (exit 1)\n"
        "echo '# not a comment'\n```\n```text\n$ fsdprun status\n```\n"
    )
    (block,) = parse_blocks(doc)
    assert [(c.line, c.needs, c.exit_code) for c in block.commands] == [
        (3, "gpu", 0), (4, None, 1), (6, None, 0)
    ]  # fmt: skip
    joined = "FSDPRUN_FAIL_AT=0:7 fsdprun train debug train.steps=8   # fails (exit 1)"
    assert block.commands[1].text == joined
    assert config_args(_fsdprun_args(block.commands[0].text)) == ["config", "llama-1b"]
    # The same command with another comment is the same run; another exit status is not.
    again = Command(
        "y.md", 1, "FSDPRUN_FAIL_AT=0:7 fsdprun train debug train.steps=8  # (exit 1)", exit_code=1
    )
    assert _same_key(again) == _same_key(block.commands[1])
    assert _same_key(Command("y.md", 1, "echo '# not a comment'  # x")) == _same_key(
        block.commands[2]
    )
    assert _same_key(Command("y.md", 1, again.text, exit_code=0)) != _same_key(again)
    assert config_args(
        ["train", "llama-70b", "--nnodes", "4", "--node_rank", "1", "--rdzv-endpoint", "h:1",
         "optim.lr=1", "~x.y"]
    ) == ["config", "llama-70b", "optim.lr=1", "~x.y", "--nnodes", "4"]  # fmt: skip


@pytest.mark.parametrize(
    "text, found",
    [
        ("fsdprun train llama-1b optim.lrr=1   # needs: gpu", "optim.lrr"),
        ("fsdprun compare llama-8b --nproc-per-node 3 --configs fsdp2   # needs: gpu", "config"),
        ("pip install 'fsdprun[nope]'   # needs: network", "fsdprun[nope] is no extra"),
        ("python scripts/missing.py   # needs: gpu", "no scripts/missing.py"),
        (
            "kubectl apply -f examples/kubernetes/nope.yaml   # needs: cluster",
            "no examples/kubernetes/nope.yaml",
        ),
        ("fsdprun train debug 'optim.lr=1   # needs: gpu", "unexpected EOF"),
    ],
)
def test_a_marked_command_is_still_checked(text, found, placeholders):
    with pytest.raises((AssertionError, ValueError), match=re.escape(found)):
        check_marked(Command("x.md", 1, text, "gpu"), placeholders)
