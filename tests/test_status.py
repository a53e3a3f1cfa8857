"""`fsdprun status` on run directories laid out by hand: the state, tokens/s and ETA, restarts,
heartbeat ages and the newest complete checkpoint, each read from the files a run leaves; and a
corpus of damaged files (the real command: it skips what it cannot read, says how much in one
line, and `--json` stays valid JSON)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import run_fsdprun

from fsdprun.tools.status import render_status, run_status, watch_status


def _run_dir(tmp_path: Path, events: list[dict]) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "heartbeat").mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text("output:\n  metrics_file: metrics.jsonl\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def _checkpoint(run_dir: Path, step: int, manifest: object | None) -> None:
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))


START = {"event": "start", "steps": 100, "tokens_per_step": 512, "attempt": 0}


def test_failed_run_with_restarts_and_the_newest_complete_checkpoint(tmp_path):
    events = [
        START,
        {"event": "step", "step": 10, "loss": 4.5, "tokens_per_s": 1000.0},
        {"event": "checkpoint", "step": 10, "path": "run/checkpoints/step-00000010"},
        {**START, "attempt": 1},
        {"event": "restart", "step": 10},
        {"event": "step", "step": 20, "loss": 4.25, "tokens_per_s": 2048.0},
        {**START, "attempt": 2},
    ]
    run_dir = _run_dir(tmp_path, events)
    _checkpoint(run_dir, 10, {"step": 10})
    _checkpoint(run_dir, 20, {"step": 20})
    _checkpoint(run_dir, 30, None)  # a save cut short: no manifest
    _checkpoint(run_dir, 40, [])  # a tampered manifest
    doc = run_status(run_dir)
    assert doc["state"] == "failed" and not doc["running"]
    assert doc["restarts"] == 2 and doc["tokens_per_s"] == 2048.0 and doc["eta_s"] is None
    assert doc["newest_complete_checkpoint"].endswith("step-00000020")
    text = render_status(doc).splitlines()
    assert text[0].startswith(f"{run_dir}: not running; the last session failed")
    assert text[1] == ("last logged step 20 of 100 (loss 4.2500), 2,048 tokens/s; last "
                       "checkpoint step-00000020")  # fmt: skip
    assert text[2] == "restarts: 2"


def test_running_run_gives_eta_and_heartbeat_ages(tmp_path, monkeypatch):
    run_dir = _run_dir(tmp_path, [START, {"event": "step", "step": 40, "loss": 3.0,
                                          "tokens_per_s": 1024.0}])  # fmt: skip
    now = time.time()
    for rank, (step, age) in enumerate([(41, 0.5), (40, 12.0)]):
        beat = {"step": step, "phase": "step", "time": now - age}
        (run_dir / "heartbeat" / f"rank-{rank}.json").write_text(json.dumps(beat))
    monkeypatch.setattr("fsdprun.tools.status.is_locked", lambda path: True)
    (run_dir / ".lock").write_text("")
    doc = run_status(run_dir)
    assert doc["state"] == "running"
    # 60 steps left x 512 tokens at 1,024 tokens/s.
    assert doc["eta_s"] == 30.0
    assert [(b["rank"], b["step"]) for b in doc["heartbeats"]] == [(0, 41), (1, 40)]
    assert 11.5 < doc["heartbeats"][1]["age_s"] < 13.0
    last = render_status(doc).splitlines()[-1]
    assert last.startswith("ETA 00m30s; heartbeats: rank 0 step 41 (step) 0.")
    assert "rank 1 step 40 (step) 12." in last


def test_watch_redraws_until_the_run_ends(tmp_path, monkeypatch):
    run_dir = _run_dir(tmp_path, [START, {"event": "step", "step": 1, "loss": 5.0}])
    (run_dir / ".lock").write_text("")
    held = iter([True, True, False])
    monkeypatch.setattr("fsdprun.tools.status.is_locked", lambda path: next(held))
    drawn, slept = [], []
    doc = watch_status(run_dir, interval_s=2.0, write=drawn.append, sleep=slept.append)
    assert not doc["running"] and slept == [2.0, 2.0] and len(drawn) == 3
    assert "running" in drawn[0] and "not running" in drawn[2]


# --------------------------------------------------------------------------------------------
# Damaged run directories, through the real command: each case is the files' contents, the
# skip line the text ends with (None: nothing skipped) and what the JSON document then holds.

STEP = {"event": "step", "step": 3, "loss": 2.5, "tokens_per_s": 100.0}
GOOD = [json.dumps(START), json.dumps(STEP)]
DAMAGED = {
    "heartbeat a list": (GOOD, {"heartbeat/rank-0.json": "[1, 2]"},
                         "skipped 1 unreadable heartbeat file in {run}/heartbeat",
                         {"last_step": 3, "heartbeats": [], "skipped.heartbeat_files": 1}),
    "heartbeat of the wrong types": (
        GOOD, {"heartbeat/rank-0.json": '{"time": "soon", "step": 1}',
               "heartbeat/rank-1.json": '{"time": NaN}',
               "heartbeat/rank-2.json": '{"time": 1.0, "step": "two", "phase": 7}'},
        "skipped 2 unreadable heartbeat files in {run}/heartbeat",
        {"heartbeats.0.rank": 2, "heartbeats.0.step": None, "heartbeats.0.phase": None}),
    "lines that are not objects": (
        [*GOOD, "[1, 2]", "3", '"text"', "null", "{}", '{"event": 5}', "not json"], {},
        "skipped 7 unreadable lines of {run}/metrics.jsonl",
        {"last_step": 3, "skipped.metrics_lines": 7}),
    "not UTF-8, nested too deep": (
        [*GOOD, b"\xff\xfe{}".decode("latin-1"), "[" * 100_000], {},
        "skipped 2 unreadable lines of {run}/metrics.jsonl", {"last_step": 3}),
    "a truncated last line": (
        [*GOOD, '{"event": "step", "step": 4, "lo'], {}, None,
        {"last_step": 3, "skipped.metrics_lines": 0}),
    "a step given as a string": (
        [*GOOD, '{"event": "step", "step": "4", "loss": 1.0}'], {},
        "skipped 1 step record without an integer step of {run}/metrics.jsonl",
        {"last_step": 3, "loss": 2.5, "skipped.step_records": 1}),
    "NaN and inf": (
        [json.dumps(START), '{"event": "step", "step": 5, "loss": NaN, "tokens_per_s": Infinity}'],
        {}, None, {"last_step": 5, "loss": None, "tokens_per_s": None}),
    "fields of the wrong type": (
        ['{"event": "start", "steps": "100", "attempt": "2", "tokens_per_step": []}',
         '{"event": "step", "step": 3, "loss": "low", "tokens_per_s": "fast"}',
         '{"event": "checkpoint", "step": 3, "path": 5}',
         '{"event": "stopped", "step": "x", "reason": NaN}'],
        {}, None, {"state": "stopped", "steps": None, "restarts": 0, "loss": None,
                   "last_checkpoint": None, "stopped.reason": None}),
    "lock files of the wrong shape": (
        GOOD, {".lock": '{"host": "h", "pid": 1, "since": NaN, "command": "x"}',
               ".lock.node-1": '{"host": "h", "pid": Infinity, "since": 1.0, "command": "x"}',
               ".lock.node-2": "[1]"},
        None, {"locks.0.holder": None, "locks.1.holder": None, "locks.2.holder": None}),
}  # fmt: skip


def _field(doc: object, dotted: str) -> object:
    for part in dotted.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@pytest.mark.parametrize("case", DAMAGED)
def test_status_of_a_damaged_run_dir_skips_what_it_cannot_read(case, tmp_path):
    lines, files, skip_line, fields = DAMAGED[case]
    run_dir = _run_dir(tmp_path, [])
    text = "".join(line + "\n" for line in lines)
    if case == "a truncated last line":
        text = text.removesuffix("\n")
    (run_dir / "metrics.jsonl").write_bytes(text.encode("latin-1"))
    for name, content in files.items():
        (run_dir / name).write_text(content)
    proc = run_fsdprun("status", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
    last = proc.stdout.splitlines()[-1]
    if skip_line is None:
        assert "skipped" not in proc.stdout, proc.stdout
    else:
        assert last == skip_line.format(run=run_dir), proc.stdout
    proc = run_fsdprun("status", str(run_dir), "--json", cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
    doc = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    for key, want in fields.items():
        assert _field(doc, key) == want, (key, doc)
