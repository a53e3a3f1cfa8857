"""A corpus of bad input: each case must end with one line that names the key or path and the
fix, exit code 2, no traceback, and nothing already on disk changed.

Most cases run the CLI in-process (typer's CliRunner: the same code path as the console script,
without starting Python again); those that need a launch run the real command."""

from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FSDPRUN, Run, free_port, fsdprun_env, run_fsdprun, zygote_command
from typer.testing import CliRunner

import fsdprun.device
import fsdprun.launch.elastic
from fsdprun.checkpoint import step_dir
from fsdprun.cli import app
from fsdprun.config import STRING_KEYS, schema_fields
from fsdprun.limits import NOFILE_NEEDED


def _nofile(soft: int, hard: int | None = None):
    """A preexec_fn: the child starts under `ulimit -Sn soft` (and -Hn hard)."""

    def set_limit() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (soft, hard if hard is not None else resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
        )

    return set_limit


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with complete checkpoints at steps 2 and 4.

    Launched under a soft open-file limit of 16 (hard limit as it is): fsdprun raises it first
    thing (test_a_low_soft_open_file_limit_is_raised)."""
    root = tmp_path_factory.mktemp("trained")
    proc = subprocess.run(
        [FSDPRUN, "train", "debug", "train.steps=4", "checkpoint.every_steps=2",
         "--run-dir", str(root / "run")],
        cwd=root, env=fsdprun_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_nofile(16),
    )  # fmt: skip
    return Run(proc, root / "run").check().run_dir


def snapshot(*roots: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for root in roots for p in sorted(root.rglob("*")) if p.is_file()
    }  # fmt: skip


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def damaged_run(trained: Path, tmp: Path, damage) -> str:
    """A copy of the run whose only checkpoint (step 2) is damaged by `damage(folder)`."""
    run = tmp / "damaged"
    shutil.copytree(trained, run)
    shutil.rmtree(step_dir(run, 4))
    damage(step_dir(run, 2))
    return str(run)


def _truncate(folder: Path) -> None:
    shard = next(folder.glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:64])


def _newer_manifest(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(format_version=99, fsdprun_version="9.0.0")
    (folder / "manifest.json").write_text(json.dumps(manifest))


# (id, arguments (a function of tmp_path and the trained run), the message's key phrase)
CASES = [
    ("yaml-syntax", lambda t, r: ["config", write(t / "a.yaml", "model: [1, 2\n")],
     "YAML syntax error"),
    ("extends-cycle", lambda t, r: [
        "config", write(t / "a.yaml", "extends: b.yaml\n"), write(t / "b.yaml", "extends: a.yaml\n")
    ][:2], "'extends' cycle"),
    ("extends-missing", lambda t, r: ["config", write(t / "a.yaml", "extends: nope.yaml\n")],
     "extends recipe 'nope.yaml' is neither a file nor a built-in"),
    ("unknown-key", lambda t, r: ["config", "debug", "optim.lrr=1"], "did you mean 'optim.lr'"),
    ("wrong-type", lambda t, r: ["config", "debug", "train.steps=abc"], "train.steps"),
    ("bad-enum", lambda t, r: ["config", "debug", "precision.param_dtype=bf32"],
     "expected one of [bf16, fp16, fp32]"),
    ("negative-lr", lambda t, r: ["config", "debug", "optim.lr=-1"], "optim.lr must be > 0"),
    ("nan-lr", lambda t, r: ["config", "debug", "optim.lr=.nan"], "optim.lr must be > 0"),
    ("zero-steps", lambda t, r: ["train", "debug", "train.steps=0"], "train.steps must be > 0"),
    ("zero-batch", lambda t, r: ["config", "debug", "train.global_batch_size=0"],
     "train.global_batch_size must be > 0"),
    ("batch-not-divisible", lambda t, r: ["train", "debug", "--nproc-per-node", "3"],
     "train.global_batch_size (8) must be divisible"),
    ("seq-too-long", lambda t, r: ["config", "debug", "train.seq_len=65"],
     "exceeds model.max_seq_len"),
    ("heads-not-divisible", lambda t, r: ["config", "debug", "model.n_heads=5"],
     "model.dim (64) must be divisible by model.n_heads (5)"),
    ("unknown-device", lambda t, r: ["train", "debug", "launch.device=tpu"],
     "launch.device: Invalid value 'tpu'"),
    ("npu-without-torch-npu", lambda t, r: ["train", "debug", "launch.device=npu"],
     "torch_npu is not importable"),
    ("override-without-equals", lambda t, r: ["config", "debug", "optim.lr"],
     "has no '='; write KEY=VALUE"),
    ("drop-unknown-key", lambda t, r: ["config", "debug", "~optim.lrr"], "unknown key 'optim.lrr'"),
    ("recipe-is-a-list", lambda t, r: ["config", write(t / "a.yaml", "- model\n- train\n")],
     "must be a mapping of sections"),
    ("recipe-empty", lambda t, r: ["config", write(t / "a.yaml", "")], "the recipe is empty"),
    ("unknown-recipe", lambda t, r: ["train", "nosuchrecipe"],
     "neither a file nor a built-in recipe (built-ins: debug"),
    ("env-resolver", lambda t, r: ["config", "debug", "output.run_dir=${oc.env:HOME}"],
     "is not allowed; only references to other recipe keys"),
    ("python-object-tag", lambda t, r: [
        "config", write(t / "a.yaml", "train: !!python/object/apply:os.system ['echo hi']\n")
    ], "YAML tag not allowed"),
    ("run-dir-has-checkpoints", lambda t, r: ["train", "debug", "--run-dir", str(r)],
     "already holds checkpoints; continue it with `fsdprun resume"),
    ("unwritable-run-dir", lambda t, r: [
        "train", "debug", "--run-dir", str(Path(write(t / "file", "x")) / "run")
    ], "cannot write the run directory"),
    ("resume-not-a-run", lambda t, r: ["resume", str(t)], "not an fsdprun run directory"),
    ("resume-no-checkpoints", lambda t, r: [
        "resume", str(_no_checkpoints(r, t))
    ], "no checkpoints to resume from"),
    ("resume-only-incomplete", lambda t, r: [
        "resume", damaged_run(r, t, lambda f: (f / "manifest.json").unlink())
    ], "no complete checkpoint (1 incomplete: step-00000002: no manifest.json"),
    ("resume-truncated-shard", lambda t, r: ["resume", damaged_run(r, t, _truncate)],
     "is truncated"),
    ("resume-corrupted-metadata", lambda t, r: [
        "resume", damaged_run(r, t, lambda f: (f / ".metadata").write_bytes(b"garbage"))
    ], ".metadata unreadable"),
    ("resume-newer-manifest", lambda t, r: ["resume", damaged_run(r, t, _newer_manifest)],
     "written by a newer fsdprun (9.0.0"),
    ("resume-changed-shape", lambda t, r: ["resume", str(r), "model.n_layers=3"],
     "resume cannot change model.n_layers (2 -> 3)"),
    ("resume-missing-step", lambda t, r: ["resume", str(r), "--step", "3"],
     "no checkpoint of step 3 (complete ones: 2, 4)"),
    ("export-incomplete", lambda t, r: [
        "export", str(step_dir(Path(damaged_run(r, t, lambda f: (f / ".metadata").unlink())), 2)),
        "--out", str(t / "out"),
    ], "is not a complete checkpoint"),
    ("inspect-random-file", lambda t, r: ["inspect-checkpoint", write(t / "x.bin", "hello")],
     "not a checkpoint"),
]  # fmt: skip


def _no_checkpoints(trained: Path, tmp: Path) -> Path:
    run = tmp / "fresh"
    run.mkdir()
    shutil.copy(trained / "recipe.yaml", run)
    return run


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_in_process(case, trained: Path, tmp_path: Path, monkeypatch):
    _, make_args, phrase = case
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch", _must_not_launch)
    args = make_args(tmp_path, trained)
    before = snapshot(tmp_path, trained)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # no other exception escaped
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert phrase in lines[0], lines[0]
    assert "Traceback" not in result.output
    after = snapshot(tmp_path, trained)
    assert {k: v for k, v in after.items() if k in before} == before, "a file changed"
    new = set(after) - set(before)
    assert not new, f"files created: {sorted(new)}"


def _must_not_launch(*args, **kwargs):
    raise AssertionError("a bad input reached the launcher")


def test_more_ranks_than_devices(monkeypatch, tmp_path):
    # No GPU here: pretend the node has one cuda device (device presence only; nothing
    # distributed is faked) and ask for two ranks.
    monkeypatch.setattr(fsdprun.launch.elastic, "resolve_device_kind", lambda requested: "cuda")
    monkeypatch.setattr(fsdprun.device, "device_count", lambda kind: 1)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "debug", "--run-dir", "r"])
    assert result.exit_code == 2
    assert "launch.nproc_per_node is 2 but this node has 1 cuda device(s)" in result.stderr
    assert not (tmp_path / "r").exists()


def _one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("nnodes", [2, 1])  # 1: fsdprun's loopback rendezvous backend
def test_rendezvous_port_already_in_use(nnodes, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_fsdprun(
            "train", "debug", "--nnodes", str(nnodes), "--nproc-per-node", "1", "--node-rank", "0",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "launch.rdzv_timeout_s=5",
            "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=120,
        )  # fmt: skip
    line = _one_line_exit_2(proc)
    assert f"rendezvous at 127.0.0.1:{port} failed" in line and "address already in use" in line


def test_rendezvous_endpoint_that_never_answers(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_fsdprun(
        "train", "debug", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "launch.rdzv_timeout_s=1",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    line = _one_line_exit_2(proc)
    assert "failed within launch.rdzv_timeout_s=1" in line and "timed out" in line
    # The progress line's own connection attempt neither outlives the rendezvous nor reports
    # after it (it held the exit up to 4 s and then said "waiting ... (5 s of 1 s)").
    assert "s of 1 s)" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_node_waiting_for_the_others_says_so_and_gives_up_in_one_line(tmp_path):
    # Node 0 of 2 alone: it hosts the rendezvous store, joins, and waits for node 1. Its lines
    # as they come, through the zygote's client (the command gets the client's pipes).
    timeout_s = 5
    port = free_port()
    proc = subprocess.Popen(
        [zygote_command(tmp_path), "train", "debug", "--nnodes", "2", "--node-rank", "0",
         "--nproc-per-node", "1",
         "--rdzv-endpoint", f"127.0.0.1:{port}", f"launch.rdzv_timeout_s={timeout_s}",
         "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=fsdprun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines = []  # (seconds since the first line, line)
    first = None
    for line in proc.stdout:
        first = first or time.monotonic()
        lines.append((time.monotonic() - first, line.rstrip()))
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    assert lines, f"no waiting line; stderr: {stderr}"
    after_first_s = time.monotonic() - first
    assert lines[0][1] == (
        f"waiting for 2 nodes at 127.0.0.1:{port} (gives up after "
        f"launch.rdzv_timeout_s={timeout_s} s)"
    ), lines
    waits = [text for _, text in lines[1:]]
    assert len(waits) >= 2, lines  # every timeout / 3 s
    for text in waits:
        assert re.fullmatch(
            rf"waiting at 127\.0\.0\.1:{port}: 1 of 2 nodes joined \(\d+ s of {timeout_s} s\)", text
        ), text
    line = _one_line_exit_2(subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr))
    assert f"rendezvous at 127.0.0.1:{port} failed within launch.rdzv_timeout_s={timeout_s}" in line
    assert "1 of 2 nodes joined after" in line and "--node-rank" in line, line
    # Gives up at the timeout: not before, and not long after (interpreter exit included).
    assert timeout_s - 1 <= after_first_s <= timeout_s + 10, lines


def test_a_low_soft_open_file_limit_is_raised(trained):
    # `trained` ran 2 ranks and saved two checkpoints under `ulimit -Sn 16` (a 93-line
    # traceback in Python's importer before fsdprun raised the soft limit to the hard one).
    assert (step_dir(trained, 2) / "manifest.json").is_file()
    assert (step_dir(trained, 4) / "manifest.json").is_file()


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < NOFILE_NEEDED, reason="hard limit too low here"
)
@pytest.mark.parametrize("limit", [16, NOFILE_NEEDED - 1])
def test_a_hard_open_file_limit_below_the_need_is_refused_in_one_line(limit, tmp_path):
    proc = subprocess.run(
        [FSDPRUN, "train", "debug", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=fsdprun_env(), capture_output=True, text=True, timeout=60,
        preexec_fn=_nofile(limit, limit),
    )  # fmt: skip
    line = _one_line_exit_2(proc)
    assert f"the open-file limit is {limit} (hard limit {limit})" in line, line
    assert f"needs at least {NOFILE_NEEDED}" in line and f"ulimit -n {NOFILE_NEEDED}" in line
    assert not (tmp_path / "run").exists()


def test_unknown_wrap_class_is_a_user_error_from_the_workers(tmp_path):
    proc = run_fsdprun(
        "train", "debug", "fsdp.wrap=classes", "fsdp.wrap_classes=[DecoderLayer]",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
    )  # fmt: skip
    line = _one_line_exit_2(proc)
    assert "fsdp.wrap_classes: DecoderLayer not in this model" in line
    assert "TransformerBlock" in line


def test_the_corpus_is_large_enough():
    assert len(CASES) + 4 >= 30
    assert torch  # the module imports torch before any case runs: timing stays per case


# --------------------------------------------------------------------------------------------
# Hostile or broken recipe text: each refused in one line, exit 2, within a deadline (before the
# fix an alias bomb ran until killed), nothing written.


def _alias_bomb(levels: int) -> str:
    """YAML flow list of `levels` anchors, each a list of ten aliases of the previous: 10^levels
    strings once expanded, a few hundred bytes of text."""
    parts = ["&a0 [x,x,x,x,x,x,x,x,x,x]"]
    parts += [f"&a{i} [{','.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return f"[{','.join(parts)}]"


def _chained_references(levels: int) -> str:
    """String keys that each repeat the previous one's ${...} reference ten times."""
    keys = ["model.family", "data.text_field", "data.tokenizer", "launch.rdzv_endpoint",
            "output.metrics_file", "output.run_dir", "checkpoint.load_from"][:levels]  # fmt: skip
    lines, previous = {}, None
    for key in keys:
        section, leaf = key.split(".")
        value = "x" * 80 if previous is None else f"${{{previous}}}" * 10
        lines.setdefault(section, []).append(f"  {leaf}: '{value}'")
        previous = key
    return "".join(f"{s}:\n" + "\n".join(body) + "\n" for s, body in lines.items())


HOSTILE = [
    ("alias-bomb-file",
     lambda t: ["config", write(t / "a.yaml", f"fsdp:\n  wrap_classes: {_alias_bomb(9)}\n")],
     "line 2: YAML anchors and aliases (&name, *name) are not allowed"),
    ("alias-bomb-override", lambda t: ["config", "debug", f"fsdp.wrap_classes={_alias_bomb(6)}"],
     "command line: fsdp.wrap_classes: YAML anchors and aliases"),
    ("anchor-alone", lambda t: ["config", write(t / "a.yaml", "train: &t\n  steps: 3\n")],
     "line 1: YAML anchors and aliases"),
    ("reference-bomb", lambda t: ["config", write(t / "a.yaml", _chained_references(7))],
     "references expand to more than 4096 characters"),
    ("nested-lists-override",
     lambda t: ["config", "debug", "fsdp.wrap_classes=" + "[" * 200 + "]" * 200],
     "command line: fsdp.wrap_classes: nested deeper than 8 levels"),
    ("nested-lists-file",
     lambda t: ["config", write(t / "a.yaml", "train:\n  steps: " + "[" * 5000 + "]" * 5000)],
     "line 2: nested deeper than 8 levels"),
    ("list-in-a-list", lambda t: ["config", "debug", "optim.betas=[[0.9], 0.95]"],
     "optim.betas: a list inside a list is not a recipe value"),
    ("huge-integer-override", lambda t: ["config", "debug", "train.steps=" + "1" * 5000],
     "command line: train.steps: unreadable value (Exceeds the limit (4300 digits)"),
    ("huge-integer-file",
     lambda t: ["config", write(t / "a.yaml", "train:\n  steps: " + "1" * 5000 + "\n")],
     "a.yaml: unreadable value (Exceeds the limit (4300 digits)"),
    ("latin-1-recipe", lambda t: [
        "config", _write_bytes(t / "a.yaml", "train:\n  steps: 3  # café\n".encode("latin-1"))
    ], "a.yaml: line 2: not UTF-8 text (byte 0xe9); save the recipe as UTF-8"),
    ("latin-1-parent", lambda t: [
        "config", write(t / "a.yaml", "extends: p.yaml\n"),
        _write_bytes(t / "p.yaml", "# é\n".encode("latin-1")),
    ][:2], "p.yaml: line 1: not UTF-8 text"),
    ("newline-in-a-key", lambda t: ["config", "debug", "optim.l\nr=1"], "unknown key 'optim.l"),
    # Before the fix: IsADirectoryError from rank 0 after the launch.
    ("empty-metrics-file", lambda t: ["train", "debug", "output.metrics_file=", "--run-dir", "r"],
     "output.metrics_file: '' is empty; expected a .jsonl file name in the run directory"),
]  # fmt: skip


def _write_bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


class _Deadline:
    """Raise TimeoutError in this (main) thread after `seconds`: a regression to an unbounded
    expansion fails the test instead of hanging the suite."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self) -> None:
        def expire(signum, frame):
            raise TimeoutError(f"still running after {self.seconds} s")

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def _invoke_one_line(args: list[str], root: Path, monkeypatch) -> str:
    """Run the CLI in-process under a deadline; the one error line, after checking that nothing
    under `root` changed."""
    monkeypatch.chdir(root)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch", _must_not_launch)
    before = snapshot(root)
    with _Deadline(10):
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # no other exception escaped
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert snapshot(root) == before
    return lines[0]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_recipe_text_is_refused_in_one_line(case, tmp_path: Path, monkeypatch):
    _, make_args, phrase = case
    line = _invoke_one_line(make_args(tmp_path), tmp_path, monkeypatch)
    assert phrase in line, line


def test_alias_bomb_through_the_real_command(tmp_path):
    recipe = write(tmp_path / "bomb.yaml", f"fsdp:\n  wrap_classes: {_alias_bomb(9)}\n")
    assert len(Path(recipe).read_bytes()) < 500
    proc = run_fsdprun("train", recipe, "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                       timeout=60)  # fmt: skip
    assert "YAML anchors and aliases" in _one_line_exit_2(proc)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# Every string and path key of the schema against the bad values of its kind.


# label -> a bad value, a function of tmp_path (which holds folder/, file.txt, run/taken.jsonl/)
BAD_VALUES = {
    "control-char": lambda t: "a\x07b",
    "empty": lambda t: "",
    "port-too-large": lambda t: "localhost:70000",
    "not-a-name": lambda t: "a b",
    "folder": lambda t: str(t / "folder"),
    "file": lambda t: str(t / "file.txt"),
    "absolute": lambda t: str(t / "m.jsonl"),
    "escapes": lambda t: "../m.jsonl",
    "in-a-folder": lambda t: "sub/m.jsonl",
    "dot": lambda t: ".",
    "not-jsonl": lambda t: "recipe.yaml",
    "a-folder-in-the-run-dir": lambda t: "taken.jsonl",
}
# kind (of STRING_KEYS) -> the labels above it must refuse
BAD_BY_KIND = {
    "name": ["control-char", "empty"],
    "job_id": ["control-char", "empty", "in-a-folder", "dot"],
    "class": ["control-char", "empty", "not-a-name"],
    "file": ["control-char", "empty", "folder"],
    "folder": ["control-char", "empty", "file"],
    "path": ["control-char", "empty"],
    "text": ["empty"],
    "endpoint": ["control-char", "port-too-large"],
    "run_file": ["control-char", "empty", "absolute", "escapes", "in-a-folder", "dot",
                 "not-jsonl", "a-folder-in-the-run-dir"],
}  # fmt: skip
STRING_TABLE = [(k, label) for k, (kind, _) in STRING_KEYS.items() for label in BAD_BY_KIND[kind]]


def test_every_string_key_of_the_schema_has_a_rule():
    text_types = ("str", "str | None", "list[str]")
    keys = {k for k, f in schema_fields().items() if f.type in text_types}
    assert keys == set(STRING_KEYS)


@pytest.mark.parametrize(("key", "label"), STRING_TABLE, ids=[f"{k}-{b}" for k, b in STRING_TABLE])
def test_bad_string_values_are_refused_naming_the_key(key, label, tmp_path, monkeypatch):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "run" / "taken.jsonl").mkdir(parents=True)
    value = BAD_VALUES[label](tmp_path)
    is_list = schema_fields()[key].type.startswith("list")
    override = f"{key}=[{json.dumps(value)}]" if is_list else f"{key}={value}"
    args = ["config", "debug", override, "output.run_dir=" + str(tmp_path / "run")]
    if key == "output.run_dir":
        args.pop()
    line = _invoke_one_line(args, tmp_path, monkeypatch)
    # The value is quoted as given (relative paths as resolved), then what the key expects.
    assert line.startswith(f"error: {key}: '"), line
    assert line.endswith(f"; expected {STRING_KEYS[key][1]}"), line


def test_nul_byte_in_a_recipe_path(tmp_path, monkeypatch):
    recipe = write(tmp_path / "a.yaml", 'output:\n  run_dir: "runs/a\\0b"\n')
    line = _invoke_one_line(["train", recipe], tmp_path, monkeypatch)
    assert line == (
        "error: output.run_dir: 'runs/a\\x00b' contains a control character; expected a folder, "
        "or null for runs/<recipe>-<time>"
    )


def test_metrics_file_outside_the_run_directory_through_train(tmp_path):
    proc = run_fsdprun("train", "debug", "output.metrics_file=../outside.jsonl", "train.steps=2",
                       "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    line = _one_line_exit_2(proc)
    assert line.startswith("error: output.metrics_file: '../outside.jsonl' leaves the run direc")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("module", "override"),
    [("tensorboard", "output.tensorboard=true"), ("wandb", "output.wandb={}")],
)
def test_a_tracker_without_its_extra_names_the_pip_command(module, override, tmp_path, monkeypatch):
    # None in sys.modules is how Python marks a module as not importable: find_spec sees it too.
    monkeypatch.setitem(sys.modules, module, None)
    line = _invoke_one_line(["train", "debug", override, "--run-dir", "run"], tmp_path, monkeypatch)
    assert line == f"error: output.{module} needs {module}: pip install 'fsdprun[{module}]'"
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# Fine-tuning examples that are too big or have a role no template knows: refused before
# launch, naming the file and line (issue 24).

TINY_HF = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
GOOD_CHAT = (
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
)


def _chat_recipe(tmp: Path, lines: list[str], extra: str = "") -> str:
    write(tmp / "c.jsonl", "".join(line + "\n" for line in lines))
    return write(tmp / "r.yaml", (
        f"extends: sft-demo\nmodel:\n  hf_path: {TINY_HF}\n"
        f"data:\n  paths: [c.jsonl]\n  tokenizer: {TINY_HF}\n  val_fraction: 0\n{extra}"
        "eval:\n  every_steps: 0\n"
    ))  # fmt: skip


def test_a_huge_chat_line_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    # Before: the whole line was read, rendered and tokenized (a 20 MB line took 76 s and
    # 4.9 GB, or aborted the interpreter under a memory limit). 3 MB over the 1 MiB default.
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (3 << 20)},
                                    {"role": "assistant", "content": "ok"}]})  # fmt: skip
    recipe = _chat_recipe(tmp_path, [GOOD_CHAT] * 4 + [huge])
    message = f"c.jsonl line 5: longer than data.max_line_bytes = {1 << 20:,} bytes"
    line = _one_line_exit_2(run_fsdprun("config", recipe, cwd=tmp_path, timeout=60))
    assert message in line and "raise data.max_line_bytes" in line
    prepare = ["prepare-data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "out"),
               "--source", "chat", "--tokenizer", str(TINY_HF)]  # fmt: skip
    line = _invoke_one_line(prepare, tmp_path, monkeypatch)
    assert message in line and "--max-line-bytes" in line
    # The bound is the key's (and the flag's): a smaller one refuses a line the default takes.
    line = _invoke_one_line(["config", recipe, "data.max_line_bytes=50"], tmp_path, monkeypatch)
    assert "c.jsonl line 1: longer than data.max_line_bytes = 50 bytes" in line
    line = _invoke_one_line([*prepare, "--max-line-bytes", "50"], tmp_path, monkeypatch)
    assert "c.jsonl line 1: longer than data.max_line_bytes = 50 bytes" in line


def test_an_oversized_dataset_row_is_refused_before_tokenizing(tmp_path, monkeypatch):
    # Rows that are not .jsonl lines (hf_dataset, parquet) are held to the same bound by the
    # size of their text.
    pytest.importorskip("datasets")
    recipe = _chat_recipe(tmp_path, [GOOD_CHAT] * 3, "  source: hf_dataset\n  max_line_bytes: 3\n")
    line = _invoke_one_line(["config", recipe], tmp_path, monkeypatch)
    assert "c.jsonl row 0: 4 bytes of text, more than data.max_line_bytes = 3" in line


def test_an_unknown_chat_role_is_refused_or_mapped(tmp_path, monkeypatch):
    # Before: a `robot` turn was rendered by the template as <|robot|> and trained silently as
    # context (never as the response it was).
    robot = GOOD_CHAT.replace("]}", ', {"role": "robot", "content": "yo"}]}')
    recipe = _chat_recipe(tmp_path, [GOOD_CHAT, GOOD_CHAT, robot])
    line = _one_line_exit_2(run_fsdprun("config", recipe, cwd=tmp_path, timeout=60))
    assert "c.jsonl line 3: message 2 has role 'robot', not one of system, user, assistant" in line
    assert "data.roles={robot: assistant}" in line
    prepare = ["prepare-data", str(tmp_path / "c.jsonl"), "--source", "chat", "--tokenizer",
               str(TINY_HF)]  # fmt: skip
    line = _invoke_one_line([*prepare, "--out", "o"], tmp_path, monkeypatch)
    assert "message 2 has role 'robot'" in line and "prepare-data --role" in line
    # Mapped onto assistant, the robot's turn trains exactly like an assistant turn.
    result = CliRunner().invoke(app, ["config", recipe, "data.roles={robot: assistant}"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, [*prepare, "--out", "o", "--role", "robot=assistant"])
    assert result.exit_code == 0, result.output
    mask = (tmp_path / "o" / "train.mask.bin").read_bytes()
    assert sum(mask) == 4 * 3  # four "yo" turns (one the robot's), each 2 bytes + end-of-text
    # A mapping onto a role that is not known is refused too.
    line = _invoke_one_line(["config", recipe, "data.roles={robot: bot}"], tmp_path, monkeypatch)
    assert "data.roles.robot: 'bot' is not one of system, user, assistant" in line
    line = _invoke_one_line([*prepare, "--out", "o2", "--role", "robot"], tmp_path, monkeypatch)
    assert "--role 'robot' is not NAME=ROLE" in line
