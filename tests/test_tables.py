"""Tables stay readable in an 80-column terminal: every header and every cell reads back whole
(tensor names fold after a dot, numbers keep their units, no header cut to `gather…`).

Each check renders to a fixed-width recording console and reads the table back from the text
(`conftest.read_tables`). Run with `pytest tests/test_tables.py`.
"""

from __future__ import annotations

import io

import yaml
from conftest import Run, fsdprun_env, read_tables, run_fsdprun
from rich.console import Console
from test_launch import _events

from fsdprun.checkpoint.inspect import inspect_path, render
from fsdprun.fmt import fmt_bytes, fmt_count
from fsdprun.report.console import Reporter, render_plan
from fsdprun.tools.plan import plan_recipe


def render80(draw) -> str:
    console = Console(width=80, record=True, highlight=False)
    draw(console)
    text = console.export_text()
    assert "…" not in text
    # Tables fit; a few soft-wrapped lines (the knob table) run on by design.
    assert all(len(line) <= 80 for line in text.splitlines() if line[:1] in "┏┃┡│└")
    return text


def test_run_report_tables_at_80_columns():
    gib = 2**30
    summary = _events()[2]
    summary["checkpoints"] = [
        {"step": 100, "async_save": True, "bytes": 123 * gib, "blocked_s": 1.5, "total_s": 40.25}
    ]
    for r in summary["ranks"]:  # a large model on GPUs: the widest memory table
        del r["peak_rss_bytes"]
        r.update(peak_allocated_bytes=131.5 * gib, peak_reserved_bytes=138.25 * gib,
                 model_state_bytes={"params": 18.5 * gib, "grads": 18.5 * gib,
                                    "optimizer": 37 * gib, "total": 74 * gib})  # fmt: skip
    tables = read_tables(render80(lambda c: Reporter(c, live=False).handle(summary)))
    header, rows = tables["Memory per rank"]
    assert header == ["rank", "peak allocated", "peak reserved", "params", "grads", "optimizer",
                      "model state"]  # fmt: skip
    assert rows == [[str(r), "131.50 GiB", "138.25 GiB", "18.50 GiB", "18.50 GiB", "37.00 GiB",
                     "74.00 GiB"] for r in (0, 1)]  # fmt: skip
    header, rows = tables["Checkpoints"]
    assert header == ["step", "mode", "size", "blocked", "total", "write rate"]
    assert rows == [["100", "async", "123.00 GiB", "1.500 s", "40.250 s", "3.28 GB/s"]]
    header, rows = tables["Throughput"]
    assert header == ["metric", "value"] and rows[5] == ["MFU", "n/a (no peak figure for CPUs)"]


def test_plan_tables_at_80_columns():
    plan = plan_recipe("llama-8b", [], world_size=16).to_dict()
    text = render80(lambda c: render_plan(plan, c, full=True))
    tables = read_tables(text, key=1)
    header, rows = next(t for title, t in tables.items() if title.startswith("FSDP units"))
    assert header == ["unit", "params", "gathered", "shard", "reshard", "fwd pf", "bwd pf"]
    first = plan["units"][0]
    assert rows[0][:4] == [
        "layers.0..30 (x31)", fmt_count(first["num_params"]), fmt_bytes(first["unsharded_bytes"]),
        fmt_bytes(first["shard_bytes"]),
    ]  # fmt: skip
    assert [row[0] for row in rows] == ["layers.0..30 (x31)", "layers.31", "(root)"]
    header, rows = tables["Memory per rank (rank 0)"]
    assert header == ["component", "ddp", "full (recipe)", "grad_op", "hybrid"]
    total = plan["strategies"]["ddp"]["total"]
    assert rows[-1][:2] == ["total", fmt_bytes(total)] and total > 100 * 2**30


def test_torchrun_spellings_in_a_real_run_and_its_tables_at_80_columns(tmp_path):
    proc = run_fsdprun(
        "train", "debug", "--nproc_per_node", "2", "--max_restarts", "1", "--standalone",
        "launch.nnodes=2", "train.steps=3", "output.log_every=1", "--run-dir", "run", cwd=tmp_path,
        env={**fsdprun_env(), "COLUMNS": "80"},
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    launch = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["launch"]
    assert (launch["nproc_per_node"], launch["max_restarts"], launch["nnodes"]) == (2, 1, 1)
    assert run.start["world_size"] == 2 and len(run.steps) == 3
    assert "…" not in proc.stdout
    header, rows = read_tables(proc.stdout)["Memory per rank"]
    assert header == ["rank", "peak RSS", "params", "grads", "optimizer", "model state"]
    assert [row[0] for row in rows] == ["0", "1"]

    # inspect-checkpoint of that run: its checkpoints, and every tensor name reads back whole.
    doc = inspect_path(tmp_path / "run")
    [(header, rows)] = read_tables(render80(lambda c: render(doc, c))).values()
    assert header == ["step", "folder", "status", "saved at", "ranks", "on disk"]
    ckpt = doc["checkpoints"][-1]
    assert rows[-1] == [
        "3", "step-00000003", "complete", ckpt["saved_at"].replace("T", " "), "2",
        fmt_bytes(ckpt["bytes_on_disk"]),
    ]  # fmt: skip
    doc = inspect_path(tmp_path / "run" / "checkpoints" / "step-00000003")
    tables = read_tables(render80(lambda c: render(doc, c, full=True)), key=1)
    header, rows = next(t for title, t in tables.items() if title.startswith("Tensors"))
    assert header == ["name", "shape", "dtype", "bytes", "shards"]
    assert [row[0] for row in rows] == [t["name"] for t in doc["tensors"]]
    assert max(map(len, (t["name"] for t in doc["tensors"]))) > 45  # some did have to fold


def test_output_off_a_terminal_never_wraps_lines_and_lays_tables_out_for_columns(monkeypatch):
    from fsdprun.report.output import LOG_TABLE_WIDTH, output_console

    path = "/scratch/" + "a-long-folder-name/" * 12 + "metrics.jsonl"  # 240 columns
    for columns, width in ((None, LOG_TABLE_WIDTH), ("90", 90)):
        if columns is None:
            monkeypatch.delenv("COLUMNS", raising=False)
        else:
            monkeypatch.setenv("COLUMNS", columns)
        console = output_console(record=True, highlight=False, file=io.StringIO())  # a log
        assert not console.is_terminal and console.width == width
        console.print(f"final loss 4.2977; metrics in {path}; wall time 3.6 s")
        console.print(_wide_table())
        lines = console.export_text().splitlines()
        assert lines[0] == f"final loss 4.2977; metrics in {path}; wall time 3.6 s"
        assert max(len(line) for line in lines[1:]) <= width


def _wide_table():
    from rich.table import Table

    table = Table(title="wider than any width")
    table.add_column("name")
    table.add_column("value")
    table.add_row("x " * 100, "1")
    return table
