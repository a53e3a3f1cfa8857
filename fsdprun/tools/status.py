"""`fsdprun status RUN_DIR`: whether a run is running and how far it got.

    fsdprun status runs/debug-20261130-120000          # two lines
    fsdprun status runs/debug-20261130-120000 --json

Read from files alone (no torch, no process group, nothing written): the run directory's lock
(held means running; the file names the holder), its metrics.jsonl (the last logged step, loss and
tokens/s, restarts, how the last session ended), each rank's heartbeat file (how long ago it last
answered) and the checkpoints folder (the newest checkpoint whose manifest is complete). For
multi-node jobs whose terminal output is in a batch log; `--watch` redraws it until the run ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdprun.errors import UserError
from fsdprun.report.metrics import read_events
from fsdprun.rundir import (
    RECIPE_FILE,
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
    if not (locks or metrics.is_file() or recipe_path(run_dir).is_file()):
        raise UserError(f"{run_dir}: not an fsdprun run directory (no {RECIPE_FILE}, no lock)")
    lock_docs = []
    for path in locks:
        holder = read_holder(path)
        lock_docs.append({
            "file": path.name,
            "held": is_locked(path),
            "holder": holder.__dict__ if holder else None,
        })  # fmt: skip
    events = read_events(metrics)
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    session = events[starts[-1] :] if starts else events
    steps = [e for e in events if e.get("event") == "step"]
    checkpoints = [e for e in events if e.get("event") == "checkpoint"]
    running = any(lock["held"] for lock in lock_docs)
    stopped = next((e for e in session if e.get("event") == "stopped"), None)
    if running:
        state = "running"
    elif not starts:
        state = "not started"
    elif stopped is not None:
        state = "stopped"
    elif any(e.get("event") == "summary" for e in session):
        state = "finished"
    else:
        state = "failed"  # no summary, no lock: it failed or was killed
    start = session[0] if starts else {}
    last = steps[-1] if steps else {}
    eta_s = None
    if running and last.get("tokens_per_s") and start.get("steps") and start.get("tokens_per_step"):
        left = max(start["steps"] - last["step"], 0)
        eta_s = left * start["tokens_per_step"] / last["tokens_per_s"]
    return {
        "run_dir": str(run_dir),
        "state": state,
        "running": running,
        "locks": lock_docs,
        "last_step": steps[-1]["step"] if steps else None,
        "steps": session[0].get("steps") if starts else None,
        "loss": steps[-1].get("loss") if steps else None,
        "stopped": stopped,
        "tokens_per_s": last.get("tokens_per_s"),
        "eta_s": eta_s,
        # Each elastic restart starts the session again with attempt N.
        "restarts": max(
            (e.get("attempt") or 0 for e in session if e.get("event") == "start"), default=0
        ),  # fmt: skip
        "heartbeats": _heartbeats(run_dir),
        "last_checkpoint": checkpoints[-1].get("path") if checkpoints else None,
        "newest_complete_checkpoint": _newest_complete(run_dir),
        "metrics_file": str(metrics),
    }


def _heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """Each rank's last heartbeat: step, phase and seconds since it was written."""
    now = time.time()
    beats = []
    for rank, path in heartbeat_paths(run_dir):
        try:
            rec = json.loads(path.read_text())
            beats.append({"rank": rank, "step": rec.get("step"), "phase": rec.get("phase"),
                          "age_s": round(now - float(rec["time"]), 1)})  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not a heartbeat
    return sorted(beats, key=lambda b: b["rank"])


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


def render_status(doc: dict[str, Any]) -> str:
    """Two or three plain lines."""
    held = [lock for lock in doc["locks"] if lock["held"]]
    if doc["running"]:
        who = "; ".join(_holder_text(lock) for lock in held)
        first = f"{doc['run_dir']}: running, {who}"
    else:
        state = {
            "not started": "not running; no training session has started",
            "finished": "not running; the last session finished",
            "failed": "not running; the last session failed (it ended without a summary: an "
            f"error or a kill; see {doc['run_dir']}/logs)",
        }.get(doc["state"], "")
        if doc["state"] == "stopped":
            state = f"not running; stopped at step {doc['stopped'].get('step')} "
            state += f"({doc['stopped'].get('reason')})"
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
    return "\n".join(lines) + "\n"


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
