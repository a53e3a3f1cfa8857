"""The step loss of fine-tuning data is the global token mean, whatever the masks.

Instruction data whose responses train 1..40 tokens, one example per padded row: micro-batches
and ranks hold very different numbers of trained targets. Real gloo runs (fp32) show that world
1, 2 and 4 and micro-batches of 8, 2 and 1 give the same losses and parameters, that a resume at
another world size stays exact, and (the independent reference) that a logged loss equals the
token mean over the global batch computed by hand with the plain model from the checkpoint before
it. A packed run is checked against the same reference, with positions and document masks. The
shipped sft-demo recipe learns.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import Run, consolidate, run_fsdprun

from fsdprun.checkpoint import step_dir
from fsdprun.config import load_recipe
from fsdprun.data import BatchLayout, build_datasets, load_batch

STEPS = 4
RECIPE = """\
extends: debug
model: {vocab_size: 257, max_seq_len: 96}
data:
  source: instruct
  paths: [instruct.jsonl]
  template: "Q{prompt}|"
  pack: false
train: {steps: 4, seq_len: 96, global_batch_size: 8}
checkpoint: {every_steps: 2}
output: {log_every: 1}
"""
# name: (ranks, overrides)
LAYOUTS = {
    "w1-micro8": (1, ["train.micro_batch_size=8"]),
    "w2-micro2": (2, ["train.micro_batch_size=2"]),
    "w4-micro1": (4, ["train.micro_batch_size=1"]),
    "packed": (2, ["data.pack=true", "train.micro_batch_size=1", "train.global_batch_size=2"]),
}


def _write_data(folder: Path) -> Path:
    # Response lengths 1..40 (+ end-of-text) in a scrambled order, prompts of 1..30 bytes.
    records = [
        {"prompt": "p" * (1 + (7 * i) % 30), "response": chr(97 + i % 26) * (1 + (13 * i) % 40)}
        for i in range(80)
    ]
    path = folder / "instruct.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = folder / "sft-loss.yaml"
    recipe.write_text(RECIPE)
    return recipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("sft-loss")
    recipe = _write_data(root)

    def train(name: str) -> Run:
        nproc, overrides = LAYOUTS[name]
        run_dir = root / name
        proc = run_fsdprun(
            "train", str(recipe), *overrides, "--nproc-per-node", str(nproc),
            "--run-dir", str(run_dir), cwd=root,
        )  # fmt: skip
        return Run(proc, run_dir).check()

    def train_and_resume() -> tuple[Run, Run]:
        """The world-2 run, then a copy of it resumed from its step-2 checkpoint on 1 rank (a
        world of 4 is w4-micro1's)."""
        run = train("w2-micro2")
        resumed = root / "resumed"
        shutil.copytree(run.run_dir, resumed)
        shutil.rmtree(step_dir(resumed, 4))
        proc = run_fsdprun("resume", str(resumed), "--nproc-per-node", "1", cwd=root)
        return run, Run(proc, resumed).check()

    def sft_demo() -> Run:
        proc = run_fsdprun("train", "sft-demo", "output.log_every=1", "--run-dir",
                           str(root / "sft-demo"), cwd=root)  # fmt: skip
        return Run(proc, root / "sft-demo").check()

    with ThreadPoolExecutor(2) as pool:  # two launches at a time: the suite shares few cores
        chained = pool.submit(train_and_resume)
        others = {name: pool.submit(train, name) for name in LAYOUTS if name != "w2-micro2"}
        demo = pool.submit(sft_demo)
        done = {name: future.result() for name, future in others.items()}
        done["w2-micro2"], done["resumed"] = chained.result()
        done["sft-demo"] = demo.result()
    done["recipe"] = recipe
    return done


def _losses(run: Run) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in run.steps}  # a resume's records of a step win


def _model(run: Run, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    return consolidate(step_dir(run.run_dir, step), tmp / f"{run.run_dir.name}-{step}.pt")["model"]


@pytest.mark.parametrize("name", ["w2-micro2", "w4-micro1", "resumed"])
def test_every_layout_and_a_resume_give_the_same_losses_and_parameters(runs, name, tmp_path):
    ref, run = runs["w1-micro8"], runs[name]
    want, got = _losses(ref), _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (name, step)
    final, expected = _model(run, STEPS, tmp_path), _model(ref, STEPS, tmp_path)
    for key, tensor in expected.items():
        torch.testing.assert_close(final[key], tensor, rtol=1e-5, atol=1e-5, msg=key)


def _reference_loss(run: Run, recipe: Path, overrides: list[str], step: int, tmp: Path) -> float:
    """Step `step + 1`'s loss by hand: the plain model from the step-`step` checkpoint on the
    whole global batch, one token mean (no engine, no ranks)."""
    from fsdprun.models import build_model

    cfg = load_recipe(str(recipe), overrides).config
    data, _ = build_datasets(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len,
                             seed=cfg.train.seed)  # fmt: skip
    size = cfg.train.global_batch_size
    batch = load_batch(data, BatchLayout(size, size, 1).indices(step, 0, 0), torch.device("cpu"))
    model = build_model(cfg.model)
    model.load_state_dict(_model(run, step, tmp), strict=False)
    with torch.no_grad():
        kwargs = {}
        if batch.positions is not None:
            kwargs = {"positions": batch.positions, "doc_ids": batch.doc_ids}
        logits = model(batch.inputs, **kwargs)
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100).item()


@pytest.mark.parametrize("name", ["w2-micro2", "packed"])
def test_the_logged_loss_is_the_global_token_mean(runs, name, tmp_path):
    run = runs[name]
    counts = {e["trained_tokens"] for e in run.steps}
    assert len(counts) > 1  # the steps hold different numbers of trained targets
    got = _losses(run)[3]
    want = _reference_loss(run, runs["recipe"], LAYOUTS[name][1], 2, tmp_path)
    assert got == pytest.approx(want, rel=1e-5)


def test_trained_tokens_are_counted_apart_from_the_tokens_processed(runs):
    step = runs["w2-micro2"].steps[-1]
    assert step["trained_tokens"] < 8 * 96
    assert 0 < step["trained_tokens_per_s"] < step["tokens_per_s"]


def test_the_shipped_sft_demo_learns(runs):
    run = runs["sft-demo"]
    losses = run.losses
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 0.3, losses
    val = [e["val_loss"] for e in run.events if e["event"] == "eval"]
    assert len(val) == 2 and val[1] < val[0]
    # The header names the data and counts its examples and rows, train and validation.
    [data] = [ln for ln in run.proc.stdout.splitlines() if ln.startswith("  data: ")]
    train, val = data.removeprefix("  data: ").split("; validation: ")
    for words in (train, val):
        assert words.startswith("chat (all assistant turns): 1 file(s)"), data
        assert re.search(r": \d+ examples, \d+ kept, .*; \d+ rows of 257 tokens \(packed\)$", words)
    # The log line and the summary show trained tokens/s beside the tokens processed.
    assert "trained tok/s" in run.proc.stdout and "trained tokens/s" in run.proc.stdout
