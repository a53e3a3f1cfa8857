"""`fsdprun plot`: a PNG of the expected size whose panels hold the runs' metrics, drawn from
real runs (the debug runs other tests make, cached for the session); and a corpus of damaged
metrics files, drawn by the real command with one note each on what it skipped."""

from __future__ import annotations

import json
import math
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
    # The title names the recipe, the run folders and the day they started (their start event).
    day = runs[0].start["started_at"][:10]
    assert fig.get_suptitle() == (
        f"fsdprun debug: 2 runs, {runs[0].run_dir}, {runs[1].run_dir} ({day})"
    )
    # Two runs: every panel holds two lines (or two runs' bars) and names them.
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()][-1].startswith(
            runs[1].run_dir.name
        ), ax.get_title()


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


def test_every_panel_is_labelled_with_its_unit_and_resumes_and_restarts_are_named(tmp_path):
    # One run: resumed from step 2, then restarted by the elastic agent from step 3; evaluated.
    started = "2026-12-02T04:05:06+00:00"
    run_dir = _write_metrics(tmp_path / "run", [
        {"event": "start", "recipe": "llama-1b", "started_at": started}, _step(1, 5.0),
        _step(2, 4.0), {"event": "eval", "step": 2, "val_loss": 4.5}, {"event": "start"},
        {"event": "resume", "step": 2, "attempt": 0}, _step(3, 3.0),
        {"event": "restart", "step": 3, "attempt": 1}, _step(4, 2.0), {"event": "summary"},
    ])  # fmt: skip
    fig = plot_runs([run_dir], tmp_path / "p.png")
    assert fig.get_suptitle() == f"fsdprun llama-1b: {run_dir} (started 2026-12-02 04:05 UTC)"
    assert [ax.get_title() for ax in fig.axes] == PANELS
    ylabels = [ax.get_ylabel() for ax in fig.axes]
    assert ylabels == [
        "loss (cross-entropy, nats/token)", "loss (cross-entropy, nats/token)",
        "learning rate (no unit)", "grad norm (global L2, before clipping)",
        "tokens/s (all ranks)", "peak RSS (GiB)",
    ]  # fmt: skip
    by_step, by_tokens, lr, norm, speed, memory = fig.axes
    markers = ["resumed at step 2", "restart 1 at step 3"]
    legends = {
        ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()]
        for ax in fig.axes
        if ax.get_legend() is not None
    }
    assert legends == {
        "loss by step": ["train", "val", *markers],
        "learning rate": ["learning rate", *markers],
        "grad norm": ["grad norm", *markers],
        "tokens/s": ["tokens/s", *markers],
    }
    # A panel without a legend holds one line (or one run's bars) only.
    assert len(by_tokens.lines) == 1 and memory.get_legend() is None
    for ax in (by_step, lr, norm, speed):
        assert [line.get_xdata()[0] for line in ax.lines[-2:]] == [2, 3]  # the markers
        ax.figure.canvas.draw()  # tick positions as drawn
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    assert [t.get_text().strip() for t in by_step.texts] == ["resumed", "restart 1"]
    # A run of an older version has no start time: dated by its metrics file, said as such.
    old = _write_metrics(tmp_path / "old", [{"event": "start", "recipe": "debug"}, _step(1, 5.0)])
    assert f"{old} (metrics last written 20" in plot_runs([old], tmp_path / "o.png").get_suptitle()


def _summary(ranks: list[float]) -> dict:
    return {"event": "summary", "ranks": [{"rank": r, "peak_rss_bytes": gib * GIB}
                                          for r, gib in enumerate(ranks)]}  # fmt: skip


def test_the_memory_legend_covers_no_bar(tmp_path):
    from fsdprun.report.plot import build_figure, read_run

    # Runs of 4 ranks with about the same peak on each (FSDP shards alike): the bars fill the
    # panel, and a legend inside it covered rank 3's.
    runs = []
    for i in range(3):
        peaks = [p + 0.02 * i for p in (1.0, 1.03, 1.01, 1.04)]
        runs.append(_write_metrics(tmp_path / f"run-{i}", [
            {"event": "start", "recipe": "debug"}, _step(1, 5.0), _step(2, 4.0), _summary(peaks),
        ]))  # fmt: skip
    fig = build_figure([read_run(run_dir) for run_dir in runs])
    memory = fig.axes[5]
    fig.draw_without_rendering()  # laid out as savefig lays it out, without the PNG
    legend = memory.get_legend().get_window_extent()
    assert [t.get_text() for t in memory.get_legend().get_texts()] == ["run-0", "run-1", "run-2"]
    bars = [p.get_window_extent() for p in memory.patches]
    assert len(bars) == 12 and not any(legend.overlaps(bar) for bar in bars), (legend, bars)
    # The whole legend is in the picture.
    assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)


def test_a_failed_run_is_marked_in_the_title_and_the_legends(tmp_path):
    from fsdprun.report.plot import build_figure, figure_title, read_run
    from fsdprun.runlock import hold_run_dir

    # The last session ended without a summary and nothing holds the lock: it failed (as
    # `fsdprun status` says); a resumed run is judged by its last session.
    crashed = _write_metrics(tmp_path / "crashed", [
        {"event": "start", "recipe": "debug"}, _step(1, 5.0), _step(2, 4.0), _summary([1.0]),
        {"event": "start"}, {"event": "resume", "step": 2}, _step(3, 3.0),
    ])  # fmt: skip
    done = _write_metrics(tmp_path / "done", [
        {"event": "start", "recipe": "debug"}, {"event": "start"},
        {"event": "restart", "step": 0, "attempt": 1}, _step(1, 5.0), _summary([1.0]),
    ])  # fmt: skip
    stopped = _write_metrics(tmp_path / "stopped", [
        {"event": "start", "recipe": "debug"}, _step(1, 5.0), {"event": "stopped", "step": 1},
    ])  # fmt: skip
    running = _write_metrics(tmp_path / "running", [
        {"event": "start", "recipe": "debug"}, _step(1, 5.0),
    ])  # fmt: skip
    fig = plot_runs([crashed], tmp_path / "f.png")
    title, mark = fig.get_suptitle().splitlines()
    assert title.startswith(f"fsdprun debug: {crashed} (")
    assert mark == (
        "FAILED: crashed after logged step 3 (the last session ended without a summary: an error "
        f"or a kill; see {crashed}/logs)"
    )
    assert fig._suptitle.get_color() == "red"  # and in red
    with hold_run_dir(running):  # a run in progress has no summary yet either
        for run_dir in (done, stopped, running):
            assert "FAILED" not in figure_title([read_run(run_dir)]), run_dir
        fig = build_figure([read_run(d) for d in (done, crashed, running)])
    mark = "FAILED: crashed after logged step 3 (the last session ended without a summary"
    assert fig.get_suptitle().splitlines()[1].startswith(mark)
    for ax in fig.axes:  # every legend names it
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any(t.startswith("crashed (failed)") for t in texts), (ax.get_title(), texts)
        assert not any("done (failed)" in t or "running (failed)" in t for t in texts)


def test_plot_command_errors_are_one_line_and_it_needs_no_torch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = _write_metrics(tmp_path / "run", [_step(1, 5.0)])
    garbage = _write_metrics(tmp_path / "garbage", [])
    (garbage / "metrics.jsonl").write_text('[1]\n{"event": "step", "step": "1"}\n')
    none = "nothing to plot (skipped 2 unreadable lines)"
    for args, message in [
        (["plot", "missing"], "error: missing: no metrics file (metrics.jsonl); is it an fsdprun"),
        (["plot", str(run_dir), "--out", "p.jpg"], "error: --out p.jpg: the picture is a PNG"),
        (["plot", str(run_dir), "--out", "no/p.png"], "error: --out no/p.png: folder no does"),
        (["plot", str(garbage)], f"error: {garbage}/metrics.jsonl: no step logged yet; {none}"),
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
    # The recipe's own strategy is named under its bar, and outlined.
    assert doc["recipe_strategy"] == "full"
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "full\n(recipe)" if n == "full" else n for n in names
    ]
    [outline] = [c for c in ax.containers if c.get_label() == "the recipe's strategy (full)"]
    assert outline[0].get_height() == pytest.approx(doc["strategies"]["full"]["total"] / GIB)
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
    # The device line says the size as typed and in the axis' unit (80 GB is 74.5 GiB).
    assert list(line.get_ydata()) == [80e9 / GIB] * 2
    assert line.get_label() == "device memory 80GB = 74.5 GiB"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["device memory 80GB = 74.5 GiB", "the recipe's strategy (full)"]
    [percent] = ax.child_axes  # a right-hand axis in percent of the device memory
    assert percent.get_ylabel() == "% of device memory"
    # ddp's 1.2 TiB does not flatten the others: the axis ends a little above the tallest bar
    # within 4x the device memory (grad_op), ddp's bar is cut there with its total written on it.
    totals = {n: doc["strategies"][n]["total"] / GIB for n in names}
    top = ax.get_ylim()[1]
    assert totals["ddp"] > 1000 and top == pytest.approx(1.12 * totals["grad_op"])
    assert totals["full"] / top > 0.2
    [cut] = [t.get_text() for t in ax.texts if "\u2191" in t.get_text()]
    labels = [t.get_text() for t in ax.texts if t.get_text() and "\u2191" not in t.get_text()]
    assert labels == [f"{totals[n]:,.1f} GiB" for n in names if n != "ddp"]
    assert (
        cut == f"\u2191 {totals['ddp']:,.1f} GiB\n({totals['ddp'] * GIB / 80e9:,.1f}x the device)"
    )
    # The unit of the axis given as such: no second spelling.
    doc24 = {**doc, "device_memory_bytes": 24 * GIB, "device_memory_text": "24GiB"}
    assert plan_figure(doc24).axes[0].lines[0].get_label() == "device memory 24GiB"
    # Without a device memory there is no line; a bad --plot path is refused before planning.
    assert not plan_figure({**doc, "device_memory_bytes": None}).axes[0].lines
    bad = CliRunner().invoke(app, ["plan", "debug", "--plot", str(tmp_path / "plan.svg")])
    assert bad.exit_code == 2 and "--plot" in bad.output and "ending in .png" in bad.output


# Damaged metrics files (each case: the lines, then the note `fsdprun plot` gives about it; None:
# nothing to say). Every case has a step that can be drawn, so every one is drawn.
GOOD_STEP = json.dumps(_step(1, 5.0))
DAMAGED = {
    "a step given as a string": (
        [GOOD_STEP, json.dumps({**_step(2, 4.0), "step": "2"})],
        "skipped 1 record without an integer step"),
    "NaN, inf and strings": (
        [GOOD_STEP, '{"event": "step", "step": 2, "loss": NaN, "lr": Infinity, "grad_norm": '
         '"big", "tokens_per_s": -Infinity, "tokens_seen": 16, "memory": {"peak_rss_bytes": NaN}}'],
        "skipped 4 values missing, not a number or not finite (drawn as gaps)"),
    "a step without tokens_seen": (
        [GOOD_STEP, json.dumps({k: v for k, v in _step(2, 4.0).items() if k != "tokens_seen"})],
        "skipped 1 value missing, not a number or not finite (drawn as gaps)"),
    "lines that are not objects": (
        ["[1, 2]", "null", '"x"', '{"no": "event"}', GOOD_STEP, "garbage"],
        "skipped 5 unreadable lines"),
    "damaged evals, sessions and summary": (
        [GOOD_STEP, '{"event": "eval", "step": "1", "val_loss": 1}',
         '{"event": "eval", "step": 1, "val_loss": "low"}', '{"event": "resume", "step": null}',
         '{"event": "summary", "ranks": [3, {"rank": "1"}, {"rank": 0, "peak_rss_bytes": "x"}]}'],
        "skipped 1 record without an integer step, 1 value missing, not a number or not "
        "finite (drawn as gaps)"),
    "a truncated last line": ([GOOD_STEP, '{"event": "step", "step": 2, "lo'], None),
}  # fmt: skip


def test_plot_of_damaged_metrics_draws_what_it_can_and_says_what_it_skipped(tmp_path):
    run_dirs = []
    for i, (lines, _) in enumerate(DAMAGED.values()):
        run_dirs.append(tmp_path / f"case{i}")
        run_dirs[-1].mkdir()
        text = "".join(line + "\n" for line in lines)
        truncated = lines[-1].endswith('"lo')
        (run_dirs[-1] / "metrics.jsonl").write_text(text.removesuffix("\n") if truncated else text)
    # The real command: one PNG of every case, one note line per damaged file.
    fsdprun = str(Path(sys.executable).parent / "fsdprun")
    proc = subprocess.run([fsdprun, "plot", *map(str, run_dirs), "--out", str(tmp_path / "d.png")],
                          capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert png_size(tmp_path / "d.png") == (1500, 800)
    want = [f"note: {d / 'metrics.jsonl'}: {note}"
            for d, (_, note) in zip(run_dirs, DAMAGED.values(), strict=True) if note]  # fmt: skip
    assert proc.stderr.splitlines() == want
    # NaN and inf are gaps: the values are NaN in the drawn lines, the finite ones as written.
    fig = plot_runs([run_dirs[1]], tmp_path / "gaps.png")
    by_step, _, lr, norm, speed, memory = fig.axes
    for ax, first in ((by_step, 5.0), (lr, 1e-3), (norm, 1.0), (speed, 10.0)):
        y = ax.lines[0].get_ydata().tolist()
        assert y[0] == first and math.isnan(y[1]), (ax.get_title(), y)
    assert [p.get_height() for p in memory.patches] == [1.0]  # the NaN peak is not the max
