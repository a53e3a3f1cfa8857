"""`fsdprun plot`: a PNG of the expected size whose panels hold the runs' metrics, drawn from
real runs (the debug runs other tests make, cached for the session)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fsdprun.cli import app

pytest.importorskip("matplotlib", reason="the plot extra: pip install 'fsdprun[plot]'")

from fsdprun.report.plot import plot_runs  # noqa: E402

GIB = 2**30
PANELS = [
    "loss by step", "loss by tokens seen", "learning rate", "grad norm", "tokens/s",
    "peak memory per rank",
]  # fmt: skip


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_plot_overlays_runs_with_their_values(fsdprun_runs, tmp_path):
    # The runs test_plan.py and test_launch.py make too: 2 ranks, and 1 rank.
    two = fsdprun_runs.train("train.steps=6", "output.log_every=1", "train.micro_batch_size=1")
    one = fsdprun_runs.train(
        "train.steps=6", "output.log_every=1", "train.micro_batch_size=4", nproc=1
    )
    runs = [two.check(), one.check()]
    out = tmp_path / "runs.png"
    fig = plot_runs([r.run_dir for r in runs], out)
    assert png_size(out) == (1500, 800)
    assert [ax.get_title() for ax in fig.axes] == PANELS
    by_step, by_tokens, lr, norm, speed, memory = fig.axes
    assert [t.get_text() for t in by_step.get_legend().get_texts()] == [
        f"{r.run_dir.name} train" for r in runs
    ]
    for i, run in enumerate(runs):
        steps = [s["step"] for s in run.steps]
        tokens = [s["tokens_seen"] for s in run.steps]
        panels = [(by_step, steps, "loss"), (lr, steps, "lr"), (norm, steps, "grad_norm"),
                  (speed, steps, "tokens_per_s"), (by_tokens, tokens, "loss")]  # fmt: skip
        for ax, x, key in panels:
            want = [[a, s[key]] for a, s in zip(x, run.steps, strict=True)]
            assert ax.lines[i].get_xydata().tolist() == want, (ax.get_title(), run.run_dir)
    # One bar per rank of each run, as high as the summary's peak memory of that rank.
    heights = [round(p.get_height() * GIB) for p in memory.patches]
    want = [r["peak_rss_bytes"] for run in runs for r in run.summary["ranks"]]
    assert heights == want and memory.get_ylabel() == "peak RSS (GiB)"


def _write_metrics(run_dir: Path, events: list[dict]) -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def _step(step: int, loss: float) -> dict:
    return {
        "event": "step", "step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0,
        "tokens_per_s": 10.0, "tokens_seen": 8 * step, "memory": {"peak_rss_bytes": GIB},
    }  # fmt: skip


def test_a_step_logged_again_after_a_resume_is_drawn_once_with_its_latest_value(tmp_path):
    # A resume from an older checkpoint logs step 3 again; the run has no summary yet.
    run_dir = _write_metrics(tmp_path / "run", [
        {"event": "start"}, _step(1, 5.0), _step(2, 4.0), _step(3, 3.9),
        {"event": "start"}, {"event": "resume", "step": 2}, _step(3, 3.0), _step(4, 2.0),
    ])  # fmt: skip
    fig = plot_runs([run_dir], tmp_path / "p.png")
    by_step, memory = fig.axes[0], fig.axes[5]
    assert by_step.lines[0].get_xydata().tolist() == [[1, 5.0], [2, 4.0], [3, 3.0], [4, 2.0]]
    assert [line.get_xdata()[0] for line in by_step.lines[1:]] == [2]  # where it resumed
    assert [p.get_height() for p in memory.patches] == [1.0]  # rank 0, from the step events


def test_plot_command_errors_are_one_line_and_it_needs_no_torch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = _write_metrics(tmp_path / "run", [_step(1, 5.0)])
    for args, message in [
        (["plot", "missing"], "error: missing: no metrics file (metrics.jsonl); is it an fsdprun"),
        (["plot", str(run_dir), "--out", "p.jpg"], "error: --out p.jpg: the picture is a PNG"),
        (["plot", str(run_dir), "--out", "no/p.png"], "error: --out no/p.png: folder no does"),
    ]:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and result.stderr.startswith(message), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    code = (
        "import sys; from fsdprun.cli import app\n"
        f"try: app(['plot', {str(run_dir)!r}])\n"
        "except SystemExit as e: assert not e.code, e\n"
        "print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.splitlines() == [f"wrote {run_dir / 'plot.png'}", "False"], proc.stderr
    assert png_size(run_dir / "plot.png") == (1500, 800)


def test_plan_plot_stacks_each_strategys_memory_under_the_device_line(tmp_path):
    from fsdprun.report.plot import PLAN_COMPONENTS, PLAN_TITLE, plan_figure

    out = tmp_path / "plan.png"
    args = ["plan", "llama-70b", "--world-size", "64", "--device-memory", "80GB", "--json"]
    result = CliRunner().invoke(app, [*args, "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert png_size(out) == (1100, 600)
    doc = json.loads(result.stdout)
    fig = plan_figure(doc)
    [ax] = fig.axes
    assert ax.get_ylabel() == "GiB per rank (rank 0)"
    assert ax.get_title().startswith(f"{PLAN_TITLE}: llama-70b, 64 ranks (8 x 8)")
    names = list(doc["strategies"])
    assert {"ddp", "full", "grad_op", "hybrid"} <= set(names)
    assert [t.get_text() for t in ax.get_xticklabels()] == names
    # One stacked segment per component (none drawn for one that is zero everywhere), each
    # starting where the one below ended, the stack adding up to the plan's total.
    drawn = {
        c.get_label(): c for c in ax.containers if c.get_label() in dict(PLAN_COMPONENTS).values()
    }
    tops = [0.0] * len(names)
    for key, label in PLAN_COMPONENTS:
        want = [doc["strategies"][n][key] / GIB for n in names]  # 70B: in GiB
        if not any(want):
            assert label not in drawn
            continue
        bars = drawn[label]
        assert [b.get_height() for b in bars] == pytest.approx(want, rel=1e-12)
        assert [b.get_y() for b in bars] == pytest.approx(tops, rel=1e-12)
        tops = [t + w for t, w in zip(tops, want, strict=True)]
    assert tops == pytest.approx([doc["strategies"][n]["total"] / GIB for n in names])
    [line] = ax.lines
    assert list(line.get_ydata()) == [80e9 / GIB] * 2 and "74.5 GiB" in line.get_label()
    # Without a device memory there is no line; a bad --plot path is refused before planning.
    assert not plan_figure({**doc, "device_memory_bytes": None}).axes[0].lines
    bad = CliRunner().invoke(app, ["plan", "debug", "--plot", str(tmp_path / "plan.svg")])
    assert bad.exit_code == 2 and "--plot" in bad.output and "ending in .png" in bad.output
