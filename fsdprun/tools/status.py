"""`fsdprun status RUN_DIR`: whether a run is running and how far it got.

    fsdprun status runs/debug-20261130-120000          # two lines
    fsdprun status runs/debug-20261130-120000 --json
    fsdprun status tune-my                              # a tune's --out: the search

Read from files alone (no torch, no process group, nothing written): the run directory's lock
(held means running; the file names the holder), its metrics.jsonl (the last logged step, loss and
tokens/s, restarts, how the last session ended), each rank's heartbeat file (how long ago it last
answered) and the checkpoints folder (the newest checkpoint whose manifest is complete). For
multi-node jobs whose terminal output is in a batch log; `--watch` redraws it until the run ends.
A failed run names its error: the line the launcher printed, which it also logs (`failed`).
A `fsdprun tune` output folder (its trials.jsonl) shows the search instead: the trials done,
the best so far, the budget left, the last trial, and how the last session ended.

Files of a run can be damaged (a full disk, an editor, another program): what cannot be read is
skipped and counted (`skipped` in the document, one line in the text), a value of the wrong type
reads as absent, and `--json` is valid JSON whatever the files hold (NaN and inf become null).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdprun.errors import UserError
from fsdprun.report.metrics import integer, json_safe, number, read_metrics, run_state
from fsdprun.rundir import (
    RECIPE_FILE,
    TUNE_LOG_FILE,
    checkpoint_root,
    heartbeat_paths,
    lock_paths,
    manifest_path,
    metrics_path,
    recipe_path,
    step_of,
)
from fsdprun.runlock import Holder, is_locked, read_holder


def run_status(run_dir: Path) -> dict[str, Any]:
    """The state of the run in RUN_DIR, as one JSON-ready document.

    Raises:
        UserError: RUN_DIR is not an fsdprun run directory.
    """
    locks = lock_paths(run_dir)
    metrics = metrics_path(run_dir)
    if (run_dir / TUNE_LOG_FILE).is_file() and not metrics.is_file():
        return tune_status(run_dir)
    if not (locks or metrics.is_file() or recipe_path(run_dir).is_file()):
        raise UserError(
            f"{run_dir}: not an fsdprun run directory (no {RECIPE_FILE}, no lock) nor a tune's "
            f"--out (no {TUNE_LOG_FILE})"
        )
    lock_docs = _locks(run_dir)
    read = read_metrics(metrics)
    events = read.events
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    session = events[starts[-1] :] if starts else events
    # A step record is one with an integer step; any other is skipped like an unreadable line.
    steps = [e for e in events if e["event"] == "step" and integer(e.get("step")) is not None]
    bad_steps = sum(e["event"] == "step" for e in events) - len(steps)
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    running = any(lock["held"] for lock in lock_docs)
    stopped = next((e for e in session if e["event"] == "stopped"), None)
    failed = next((e for e in reversed(session) if e["event"] == "failed"), None)
    error = failed.get("error") if failed is not None else None
    state = run_state(events, running=running)
    start = session[0] if starts else {}
    last = steps[-1] if steps else {}
    total_steps, per_step = integer(start.get("steps")), number(start.get("tokens_per_step"))
    tokens_per_s = number(last.get("tokens_per_s"))
    eta_s = None
    if running and tokens_per_s and total_steps and per_step and math.isfinite(tokens_per_s):
        eta_s = max(total_steps - last["step"], 0) * per_step / tokens_per_s
    heartbeats, bad_beats = _heartbeats(run_dir)
    path = checkpoints[-1].get("path") if checkpoints else None
    return {
        "run_dir": str(run_dir),
        "state": state,
        "running": running,
        "locks": lock_docs,
        "last_step": last.get("step"),
        "steps": total_steps,
        "loss": number(last.get("loss")),
        "stopped": stopped,
        "error": error if isinstance(error, str) else None,
        "tokens_per_s": tokens_per_s,
        "eta_s": eta_s,
        # Each elastic restart starts the session again with attempt N.
        "restarts": max(
            (integer(e.get("attempt")) or 0 for e in session if e["event"] == "start"), default=0
        ),  # fmt: skip
        "heartbeats": heartbeats,
        "last_checkpoint": path if isinstance(path, str) else None,
        "newest_complete_checkpoint": _newest_complete(run_dir),
        "metrics_file": str(metrics),
        # What could not be read, by file (a partial last line of metrics.jsonl is not damage).
        "skipped": {
            "metrics_lines": read.unreadable_lines,
            "step_records": bad_steps,
            "heartbeat_files": bad_beats,
        },
    }


def _locks(run_dir: Path) -> list[dict[str, Any]]:
    docs = []
    for path in lock_paths(run_dir):
        holder = read_holder(path)
        docs.append({
            "file": path.name,
            "held": is_locked(path),
            "holder": holder.__dict__ if holder else None,
        })  # fmt: skip
    return docs


def tune_status(out_dir: Path) -> dict[str, Any]:
    """The state of the `fsdprun tune` search in OUT_DIR (its trials.jsonl), as one JSON-ready
    document: running or how its last session ended, the trials done by status, the best so
    far (as tune ranks them), the budget left while it runs, the last trial."""
    from fsdprun.tools.tune.search import select

    docs, bad = [], 0
    with contextlib.suppress(OSError):
        for line in (out_dir / TUNE_LOG_FILE).read_bytes().splitlines():
            try:
                doc = json.loads(line)
            except (ValueError, RecursionError):
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("event"), str):
                docs.append(doc)
            else:
                bad += 1
    trials = [d for d in docs if d["event"] == "trial" and _trial_shaped(d)]
    bad += sum(d["event"] == "trial" for d in docs) - len(trials)
    starts = [i for i, d in enumerate(docs) if d["event"] == "session"]
    session = docs[starts[-1]] if starts else {}
    done = next((d for d in docs[starts[-1] if starts else 0 :] if d["event"] == "done"), None)
    locks = _locks(out_dir)
    running = any(lock["held"] for lock in locks)
    state = ("running" if running else "finished" if done else
             "stopped" if starts or trials else "not started")  # fmt: skip
    header = docs[0] if docs and docs[0]["event"] == "tune" else {}
    best = None
    ranked = [r for r in select(trials).ranking if r.stats is not None] if trials else []
    if ranked:
        top = ranked[0]
        label = next((t.get("label") for t in trials if t["candidate"] == top.candidate), None)
        best = {"candidate": top.candidate, "label": label, "tokens_per_s": top.stats.median,
                "gain": top.gain, "round": top.round}  # fmt: skip
    budget_s = number(session.get("budget_s"))
    left_s = None
    began = session.get("started_at")
    if running and budget_s is not None and isinstance(began, str):
        with contextlib.suppress(ValueError):
            spent = time.time() - dt.datetime.fromisoformat(began).timestamp()
            left_s = max(budget_s - spent, 0.0)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    last = trials[-1] if trials else None
    return {
        "kind": "tune",
        "run_dir": str(out_dir),
        "state": state,
        "running": running,
        "locks": locks,
        "recipe": header.get("recipe") if isinstance(header.get("recipe"), str) else None,
        "num_trials": len(trials),
        "trials_by_status": counts,
        "best": best,
        "budget_s": budget_s,
        "budget_left_s": left_s,
        "last_trial": {key: last.get(key) for key in ("id", "label", "status", "reason")}
        if last else None,
        "done": done,
        "skipped": {"log_lines": bad},
    }  # fmt: skip


def _trial_shaped(doc: dict[str, Any]) -> bool:
    """Whether a trial record has what `select` reads (a damaged one is skipped and counted)."""
    ok = doc.get("status") == "ok"
    times = doc.get("step_times_s")
    return (
        isinstance(doc.get("id"), str) and isinstance(doc.get("candidate"), str)
        and doc["candidate"][1:].isdigit() and integer(doc.get("round")) is not None
        and isinstance(doc.get("status"), str)
        and (not ok or (number(doc.get("tokens_per_step")) is not None and isinstance(times, list)
                        and all(number(t) is not None for t in times)))
    )  # fmt: skip


def _heartbeats(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Each rank's last heartbeat (step, phase and seconds since it was written), and how many
    heartbeat files are not heartbeats (not JSON, or not of a heartbeat's shape)."""
    now = time.time()
    beats, bad = [], 0
    for rank, path in heartbeat_paths(run_dir):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue  # removed since it was listed (a heartbeat is replaced atomically)
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError):
            rec = None
        written = number(rec.get("time")) if isinstance(rec, dict) else None
        if written is None or not math.isfinite(written):
            bad += 1
            continue
        phase = rec.get("phase") if isinstance(rec.get("phase"), str) else None
        beats.append({"rank": rank, "step": integer(rec.get("step")), "phase": phase,
                      "age_s": round(now - written, 1)})  # fmt: skip
    return sorted(beats, key=lambda b: b["rank"]), bad


def _newest_complete(run_dir: Path) -> str | None:
    """The newest step-N folder whose manifest (written last, atomically) is there and names step
    N: the checkpoint `fsdprun resume` would take (it also checks sizes; this reads no data)."""
    folders = []
    for path in checkpoint_root(run_dir).glob("*"):
        step = step_of(path)
        if step is not None:
            folders.append((step, path))
    for step, path in sorted(folders, reverse=True):
        try:
            manifest = json.loads(manifest_path(path).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("step") == step:
            return str(path)
    return None


def status_json(doc: dict[str, Any]) -> str:
    """The document as JSON, valid whatever the run's files held (NaN and inf become null)."""
    return json.dumps(json_safe(doc), indent=1, allow_nan=False)


def render_status(doc: dict[str, Any]) -> str:
    """Two or three plain lines."""
    if doc.get("kind") == "tune":
        return _render_tune(doc)
    held = [lock for lock in doc["locks"] if lock["held"]]
    if doc["running"]:
        who = "; ".join(_holder_text(lock) for lock in held)
        first = f"{doc['run_dir']}: running, {who}"
    else:
        state = {
            "not started": "not running; no training session has started",
            "finished": "not running; the last session finished",
            "failed": f"not running; the last session failed: {doc['error']}"
            if doc.get("error")
            else "not running; the last session failed (it ended without a "
            f"summary: an error or a kill; see {doc['run_dir']}/logs)",
        }.get(doc["state"], "")
        if doc["state"] == "stopped":
            stopped = doc["stopped"]
            state = f"not running; stopped at step {stopped.get('step')} "
            state += f"({stopped.get('reason')})"
        first = f"{doc['run_dir']}: {state}"
        stale = [lock for lock in doc["locks"] if lock["holder"]]
        if stale:  # a holder that lets go cleanly empties the file
            first += "; its lock was not released by " + "; ".join(map(_holder_text, stale))
    lines = [first]
    if doc["last_step"] is None:
        lines.append("no step logged yet")
    else:
        of = f" of {doc['steps']}" if doc["steps"] else ""
        loss = f" (loss {doc['loss']:.4f})" if isinstance(doc["loss"], int | float) else ""
        speed = f", {doc['tokens_per_s']:,.0f} tokens/s" if doc.get("tokens_per_s") else ""
        lines.append(f"last logged step {doc['last_step']}{of}{loss}{speed}")
    newest = doc.get("newest_complete_checkpoint") or doc["last_checkpoint"]
    if newest:
        lines[-1] += f"; last checkpoint {Path(newest).name}"
    extra = []
    if doc.get("restarts"):
        extra.append(f"restarts: {doc['restarts']}")
    if doc["running"]:
        if doc.get("eta_s") is not None:
            extra.append(f"ETA {_duration(doc['eta_s'])}")
        beats = [f"rank {b['rank']} step {b['step']} ({b['phase']}) {b['age_s']:.1f} s ago"
                 for b in doc.get("heartbeats", [])]  # fmt: skip
        if beats:
            extra.append("heartbeats: " + ", ".join(beats))
    if extra:
        lines.append("; ".join(extra))
    skipped = skipped_text(doc)
    if skipped:
        lines.append(skipped)
    return "\n".join(lines) + "\n"


def _render_tune(doc: dict[str, Any]) -> str:
    held = [lock for lock in doc["locks"] if lock["held"]]
    what = f"tune of {doc['recipe']}" if doc.get("recipe") else "tune"
    if doc["running"]:
        first = f"{doc['run_dir']}: {what} running, " + "; ".join(map(_holder_text, held))
    elif doc["state"] == "finished":
        done = doc["done"]
        first = (f"{doc['run_dir']}: {what} finished: {done.get('verdict')}; wrote "
                 f"{done.get('tuned_yaml')}")  # fmt: skip
    elif doc["state"] == "stopped":
        first = (f"{doc['run_dir']}: {what} not running; its last session ended before the "
                 "search did (Ctrl-C, a kill, an error or a spent --budget): rerun the same "
                 "command to continue")  # fmt: skip
    else:
        first = f"{doc['run_dir']}: {what} not started"
    lines = [first]
    counts = ", ".join(f"{n} {status}" for status, n in sorted(doc["trials_by_status"].items()))
    trials = f"{doc['num_trials']} trials done" + (f" ({counts})" if counts else "")
    best = doc.get("best")
    if best:
        gain = ""
        if best["candidate"] != "c0" and best.get("gain") is not None:
            gain = f", {best['gain']:+.1%} over the baseline"
        trials += (f"; best so far {best['candidate']} ({best['label']}): "
                   f"{best['tokens_per_s']:,.0f} tokens/s{gain}")  # fmt: skip
    lines.append(trials)
    if doc.get("budget_left_s") is not None:
        lines.append(f"budget {_duration(doc['budget_s'])}: {_duration(doc['budget_left_s'])} "
                     "left")  # fmt: skip
    last = doc.get("last_trial")
    if last:
        reason = f" ({last['reason']})" if last.get("reason") else ""
        lines.append(f"last trial {last['id']} {last['label']}: {last['status']}{reason}")
    if doc["skipped"]["log_lines"]:
        lines.append(f"skipped {doc['skipped']['log_lines']} unreadable line(s) of "
                     f"{Path(doc['run_dir']) / TUNE_LOG_FILE}")  # fmt: skip
    return "\n".join(lines) + "\n"


def skipped_text(doc: dict[str, Any]) -> str | None:
    """One line saying what the status skipped, or None when every file read whole."""
    skipped = doc["skipped"]

    def count(n: int, what: str) -> list[str]:
        return [f"{n} {what.format('s' if n != 1 else '')}"] if n else []

    metrics = count(skipped["metrics_lines"], "unreadable line{}") + count(
        skipped["step_records"], "step record{} without an integer step")  # fmt: skip
    beats = count(skipped["heartbeat_files"], "unreadable heartbeat file{}")
    parts = ([f"{', '.join(metrics)} of {doc['metrics_file']}"] if metrics else []) + (
        [f"{beats[0]} in {Path(doc['run_dir']) / 'heartbeat'}"] if beats else [])  # fmt: skip
    return "skipped " + "; ".join(parts) if parts else None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h" if hours else "") + f"{rest // 60:02d}m{rest % 60:02d}s"


def watch_status(
    run_dir: Path,
    *,
    interval_s: float,
    write: Callable[[str], Any],
    sleep: Callable[[float], Any] = time.sleep,
) -> dict[str, Any]:
    """Render the status every `interval_s` while the run is running; returns the last document
    (the first one, at once, when the run is not running)."""
    while True:
        doc = run_status(run_dir)
        write(time.strftime("%H:%M:%S ") + render_status(doc))
        if not doc["running"]:
            return doc
        sleep(interval_s)


def _holder_text(lock: dict[str, Any]) -> str:
    holder = lock["holder"]
    return Holder(**holder).describe() if holder else "holder not recorded yet"
