"""A corpus of bad input: each case must end with one line that names the key or path and the
fix, exit code 2, no traceback, and nothing already on disk changed.

Most cases run the CLI in-process (typer's CliRunner: the same code path as the console script,
without starting Python again); those that need a launch run the real command."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from conftest import Run, run_fsdprun
from typer.testing import CliRunner

import fsdprun.device
import fsdprun.launch
from fsdprun.checkpoint import step_dir
from fsdprun.cli import app


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with complete checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    proc = run_fsdprun("train", "debug", "train.steps=4", "checkpoint.every_steps=2",
                       "--run-dir", str(root / "run"), cwd=root)  # fmt: skip
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
    monkeypatch.setattr(fsdprun.launch, "elastic_launch", _must_not_launch)
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
    monkeypatch.setattr(fsdprun.launch, "resolve_device_kind", lambda requested: "cuda")
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


def test_rendezvous_port_already_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_fsdprun(
            "train", "debug", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0",
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
        "--rdzv-endpoint", f"127.0.0.1:{port}", "launch.rdzv_timeout_s=2",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    line = _one_line_exit_2(proc)
    assert "failed within launch.rdzv_timeout_s=2" in line and "timed out" in line


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
