"""Throughput, MFU and the metrics event log — arithmetic and files, no printing.

MFU = achieved FLOP/s per device / the device's peak dense FLOP/s at the compute dtype, with
FLOPs per token from `fsdprun.models.llama.flops_per_token` (an estimate by convention: it counts
matmuls only). Peak figures are vendor datasheet numbers for dense (non-sparse) math.

Never imports torch or the training code.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Peak dense bf16/fp16 TFLOP/s of one device, matched in order against the device name.
PEAK_TFLOPS_16BIT: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H20", 148.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
]


def peak_flops(
    device_name: str, dtype: str, override_tflops: float | None
) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for MFU, and where the figure comes from (or why there is none).

    Args:
        device_name: e.g. "NVIDIA H200" or "CPU (x86_64)".
        dtype: the compute dtype, "bf16" | "fp16" | "fp32".
        override_tflops: the recipe's output.peak_tflops, which wins when set.
    """
    if override_tflops is not None:
        return override_tflops * 1e12, "output.peak_tflops"
    if device_name.startswith("CPU"):
        return None, "no peak figure for CPUs; set output.peak_tflops"
    if dtype == "fp32":
        return None, "fp32 peak depends on TF32 settings; set output.peak_tflops"
    for key, tflops in PEAK_TFLOPS_16BIT:
        if key in device_name:
            return tflops * 1e12, f"{key} {dtype} dense datasheet peak"
    return None, f"'{device_name}' is not in the peak table; set output.peak_tflops"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def throughput(
    step_times_s: list[float],
    *,
    warmup_steps: int,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: int,
    peak_flops_per_device: float | None,
    trained_tokens: list[int] | None = None,
) -> dict[str, Any]:
    """Throughput figures over the steps after `warmup_steps` (all steps if that leaves none).

    tokens/s and MFU count every token processed (padding included); `trained_tokens` (per step,
    aligned with `step_times_s`) gives trained_tokens_per_s, the targets that trained."""
    first = warmup_steps if step_times_s[warmup_steps:] else 0
    measured = step_times_s[first:]
    total_s = sum(measured)
    tokens_per_s = tokens_per_step * len(measured) / total_s if total_s > 0 else math.nan
    trained = sum(trained_tokens[first:]) / total_s if trained_tokens and total_s > 0 else None
    per_device = tokens_per_s / world_size
    flops_per_device = per_device * flops_per_token
    return {
        "steps_measured": len(measured),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "trained_tokens_per_s": trained,
        "step_time_p50_s": percentile(measured, 50),
        "step_time_p90_s": percentile(measured, 90),
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": flops_per_device / peak_flops_per_device if peak_flops_per_device else None,
    }


class MetricsLog:
    """Appends one JSON object per line to the run's metrics file (rank 0 only writes).

    A write that does not fit (a full disk: an async save can fill it while training goes on)
    must not kill rank 0: what was not written stays in memory, in order, and goes out with the
    next write that fits; the file only ever holds whole lines followed by a partial last one.
    """

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("ab", buffering=0)  # unbuffered: every write's count is exact
        self._unwritten = b""

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields}
        self._unwritten += (json.dumps(record) + "\n").encode()
        with contextlib.suppress(OSError):
            self._flush()
        return record

    def _flush(self) -> None:
        while self._unwritten:
            written = self._file.write(self._unwritten)
            self._unwritten = self._unwritten[written:]

    def close(self) -> None:
        """Write what is left (raises OSError if it still does not fit) and close."""
        try:
            self._flush()
        finally:
            self._file.close()


@dataclass
class MetricsRead:
    """What `read_metrics` found in a metrics file."""

    events: list[dict[str, Any]] = field(default_factory=list)
    # Whole lines that are not a JSON object naming its event (damaged or not ours).
    unreadable_lines: int = 0
    # A last line without its newline: normal while a run writes it, so not counted as damage.
    partial_last_line: bool = False

    def skipped_text(self, path: Path) -> str | None:
        """The one line a reader shows about what it skipped, or None when nothing was."""
        if not self.unreadable_lines:
            return None
        n = self.unreadable_lines
        return f"skipped {n} unreadable line{'s' if n != 1 else ''} of {path}"


def read_metrics(path: Path) -> MetricsRead:
    """The records of a metrics file, the one reader of it (`status`, `plot`, `compare`, the
    launcher's report and the restart's replay all read through here).

    A record is a whole line holding a JSON object whose "event" is a string; any other whole
    line (not JSON, not UTF-8, a list, a number, an object without an event) is skipped and
    counted. The last line without its newline is a line being written (or torn by a full disk):
    left out and not counted. A file not written yet reads as no events. Field values are not
    checked here: each reader takes the fields it uses by their types (`number`, `integer`).
    """
    read = MetricsRead()
    try:
        with path.open("rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    read.partial_last_line = True
                    continue
                try:
                    event = json.loads(line)
                except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
                    event = None
                if isinstance(event, dict) and isinstance(event.get("event"), str):
                    read.events.append(event)
                else:
                    read.unreadable_lines += 1
    except FileNotFoundError:
        pass
    return read


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file (`read_metrics` without the counts)."""
    return read_metrics(path).events


def run_state(events: list[dict[str, Any]], *, running: bool) -> str:
    """How a run stands, from its metrics events and whether its run directory's lock is held:
    "running", "not started" (no session began), "stopped" (the last session stopped where all
    ranks agreed to, to go on with resume), "finished" (the last session wrote its summary), or
    "failed" (the last session ended without either: an error, or a kill; or the launcher
    logged a `failed` event before any session began)."""
    if running:
        return "running"
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    if not starts:
        return "failed" if any(e["event"] == "failed" for e in events) else "not started"
    ended = {e["event"] for e in events[starts[-1] :]}
    if "stopped" in ended:
        return "stopped"
    return "finished" if "summary" in ended else "failed"


def integer(value: Any) -> int | None:
    """`value` if it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def number(value: Any) -> float | None:
    """`value` as a float if it is a JSON number (NaN and inf included; not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf, which JSON cannot hold) made None, so
    `json.dumps(..., allow_nan=False)` always writes valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def drop_steps_after(path: Path, step: int, *, attempt: int) -> None:
    """Before restart `attempt` replays the steps after `step` (its checkpoint), drop their
    records so that each step is logged once. The file as it was is kept as
    metrics.attempt-(N-1).jsonl."""
    _drop_steps_after(path, step, kept=path.with_name(f"{path.stem}.attempt-{attempt - 1}.jsonl"))


def drop_all_steps(path: Path) -> Path | None:
    """Before a new session trains a run again from step 0 (`train --resume auto` over a run
    with no complete checkpoint), drop the step records of the earlier sessions, as an elastic
    restart without a checkpoint does. The file as it was is kept as metrics.earlier-N.jsonl
    (the first free N), whose path this returns (None: no file yet)."""
    n = 1
    while (kept := path.with_name(f"{path.stem}.earlier-{n}.jsonl")).exists():
        n += 1
    return kept if _drop_steps_after(path, 0, kept=kept) else None


def _drop_steps_after(path: Path, step: int, *, kept: Path) -> bool:
    if not path.exists():
        return False
    shutil.copyfile(path, kept)
    replayed = ("step", "checkpoint", "skip", "eval")
    keep = [
        e for e in read_events(path)
        if e["event"] not in replayed or integer(e.get("step")) is None or e["step"] <= step
    ]  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in keep))
    tmp.replace(path)
    return True
