"""Golden runs: the package may be reorganized, the training may not change.

Per-step losses, final parameter checksums and checkpoint key sets of the debug recipe under
fsdp2, fsdp1 and ddp were recorded in tests/golden/layout.json by the code before the layout
change (issue 12) and must match after it. tests/golden/old-run/ is a run directory written by
that code (a tiny model, 4 steps): it must still resume, inspect and export.

Re-record (only when a change is *meant* to change the numbers, and say why in the commit):
    FSDPRUN_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import Run, consolidate, flatten, run_fsdprun

GOLDEN = Path(__file__).parent / "golden"
RECORD = os.environ.get("FSDPRUN_RECORD_GOLDEN") == "1"
ENGINES = ("fsdp2", "fsdp1", "ddp")
COMMON = (
    "train.steps=4", "output.log_every=1", "precision.param_dtype=fp32",
    "precision.reduce_dtype=fp32",
)  # fmt: skip
# The old run: small enough to commit (about 220 KB with its checkpoint).
TINY = (
    "train.steps=4", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=32",
    "model.vocab_size=64", "model.n_layers=1", "train.seq_len=16", "output.log_every=1",
)  # fmt: skip


def _summarize(run: Run, tmp: Path) -> dict:
    ckpt = run.run_dir / "checkpoints" / "step-00000004"
    state = flatten(consolidate(ckpt, tmp / "full.pt"))
    model = {k: v for k, v in state.items() if k.startswith("model.")}
    return {
        "losses": run.losses,
        "checksums": {
            k: [float(v.double().sum()), float(v.double().pow(2).sum())]
            for k, v in sorted(model.items())
        },
        "keys": sorted(state),
    }


@pytest.fixture(scope="module")
def golden_runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("golden")

    def one(engine: str) -> dict:
        run_dir = tmp / engine
        proc = run_fsdprun(
            "train", "debug", *COMMON, f"fsdp.engine={engine}", "--run-dir", str(run_dir),
            cwd=tmp,
        )  # fmt: skip
        run = Run(proc, run_dir).check()
        (tmp / engine / "sum").mkdir()
        return _summarize(run, tmp / engine / "sum")

    # Two at a time: this machine has two cores and each run has two ranks.
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(ENGINES, pool.map(one, ENGINES), strict=True))
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        (GOLDEN / "layout.json").write_text(json.dumps(results, indent=1) + "\n")
        old = GOLDEN / "old-run"
        shutil.rmtree(old, ignore_errors=True)
        proc = run_fsdprun("train", "debug", *TINY, "--run-dir", str(old), cwd=tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for transient in ("heartbeat", "logs", ".lock", "agent.json"):
            path = old / transient
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return results


@pytest.mark.parametrize("engine", ENGINES)
def test_losses_parameters_and_checkpoint_keys_match_the_recorded_run(golden_runs, engine):
    recorded = json.loads((GOLDEN / "layout.json").read_text())[engine]
    now = golden_runs[engine]
    assert len(now["losses"]) == 4
    assert now["losses"] == pytest.approx(recorded["losses"], rel=1e-6, abs=1e-7)
    assert now["keys"] == recorded["keys"]
    assert now["checksums"].keys() == recorded["checksums"].keys()
    for name, sums in now["checksums"].items():
        assert sums == pytest.approx(recorded["checksums"][name], rel=1e-5, abs=1e-6), name


def test_a_run_written_before_the_layout_change_resumes_inspects_and_exports(tmp_path):
    run_dir = tmp_path / "old-run"
    shutil.copytree(GOLDEN / "old-run", run_dir)
    recorded = Run(None, run_dir).losses  # type: ignore[arg-type]
    assert len(recorded) == 4

    proc = run_fsdprun("resume", str(run_dir), "train.steps=6", cwd=tmp_path)
    run = Run(proc, run_dir).check()
    steps = [e["step"] for e in run.steps]
    assert steps[-2:] == [5, 6] and run.losses[:4] == recorded

    proc = run_fsdprun("inspect-checkpoint", str(run_dir / "checkpoints" / "step-00000004"),
                       cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "step 4" in proc.stdout or "4" in proc.stdout

    out = tmp_path / "exported"
    proc = run_fsdprun("export", str(run_dir / "checkpoints" / "step-00000004"), "--format",
                       "hf", "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
