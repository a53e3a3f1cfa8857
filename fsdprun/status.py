"""`fsdprun status RUN_DIR`: whether a run is running and how far it got.

    fsdprun status runs/debug-20261130-120000          # two lines
    fsdprun status runs/debug-20261130-120000 --json

Read from files alone (no torch, no process group, nothing written): the run directory's lock
(held means running; the file names the holder) and its metrics.jsonl (the last logged step and
how the last session ended).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fsdprun.errors import UserError
from fsdprun.runlock import LOCK_FILE, Holder, is_locked, read_holder

RECIPE_FILE = "recipe.yaml"  # fsdprun.worker.RECIPE_FILE, which imports torch


def run_status(run_dir: Path) -> dict[str, Any]:
    """The state of the run in RUN_DIR, as one JSON-ready document.

    Raises:
        UserError: RUN_DIR is not an fsdprun run directory.
    """
    locks = sorted(run_dir.glob(f"{LOCK_FILE}*")) if run_dir.is_dir() else []
    metrics = run_dir / _metrics_file(run_dir)
    if not (locks or metrics.is_file() or (run_dir / RECIPE_FILE).is_file()):
        raise UserError(f"{run_dir}: not an fsdprun run directory (no {RECIPE_FILE}, no lock)")
    lock_docs = []
    for path in locks:
        holder = read_holder(path)
        lock_docs.append({
            "file": path.name,
            "held": is_locked(path),
            "holder": holder.__dict__ if holder else None,
        })  # fmt: skip
    events = _read_events(metrics)
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
        state = "ended"  # no summary, no lock: it failed or was killed
    return {
        "run_dir": str(run_dir),
        "state": state,
        "running": running,
        "locks": lock_docs,
        "last_step": steps[-1]["step"] if steps else None,
        "steps": session[0].get("steps") if starts else None,
        "loss": steps[-1].get("loss") if steps else None,
        "stopped": stopped,
        "last_checkpoint": checkpoints[-1].get("path") if checkpoints else None,
        "metrics_file": str(metrics),
    }


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
            "ended": "not running; the last session ended without a summary (it failed or was "
            f"killed; see {doc['run_dir']}/logs)",
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
        lines.append(f"last logged step {doc['last_step']}{of}{loss}")
    if doc["last_checkpoint"]:
        lines[-1] += f"; last checkpoint {Path(doc['last_checkpoint']).name}"
    return "\n".join(lines) + "\n"


def _holder_text(lock: dict[str, Any]) -> str:
    holder = lock["holder"]
    return Holder(**holder).describe() if holder else "holder not recorded yet"


def _metrics_file(run_dir: Path) -> str:
    """output.metrics_file of the run's recipe (metrics.jsonl when it cannot be read)."""
    try:
        recipe = yaml.safe_load((run_dir / RECIPE_FILE).read_text())
        return str(recipe["output"]["metrics_file"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return "metrics.jsonl"


def _read_events(path: Path) -> list[dict[str, Any]]:
    """Complete, parseable records of a metrics file (a line being written is left out)."""
    events = []
    try:
        with path.open() as f:
            for line in f:
                if line.endswith("\n"):
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(event, dict):
                        events.append(event)
    except FileNotFoundError:
        pass
    return events
