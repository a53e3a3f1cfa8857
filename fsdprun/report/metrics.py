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


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete, parseable records of a metrics file: a line being written (or a torn one)
    is left out, and a file not written yet reads as no events (`status` and `plot` read the
    files of running runs)."""
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


def drop_steps_after(path: Path, step: int, *, attempt: int) -> None:
    """Before restart `attempt` replays the steps after `step` (its checkpoint), drop their
    records so that each step is logged once. The file as it was is kept as
    metrics.attempt-(N-1).jsonl."""
    if not path.exists():
        return
    shutil.copyfile(path, path.with_name(f"{path.stem}.attempt-{attempt - 1}.jsonl"))
    replayed = ("step", "checkpoint", "skip", "eval")
    keep = [e for e in read_events(path) if e["event"] not in replayed or e["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in keep))
    tmp.replace(path)
