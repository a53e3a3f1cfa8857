"""Where a profiled step's time goes, from a torch.profiler Chrome trace (`profile.enabled`).

    python scripts/trace_summary.py RUN_DIR/profile/rank-0.pt.trace.json [--top 12] [--json]

Within the recorded steps (the `ProfilerStep#N` spans; the whole trace where there are none):

- GPU busy: the union of the device's kernels, copies and sets over the steps' wall time, and
  what is left idle (kernel gaps: the host did not feed the GPU in time, or waited for it);
- device time by kind: matrix products (cuBLAS, CUTLASS, nvjet, float8 `_scaled_mm`),
  attention (flash, cuDNN, flex), collectives (NCCL), Triton-fused kernels (compile's
  elementwise and norms), copies and sets, the rest;
- the kernels that take longest, in all;
- host syncs: the runtime calls that block the CPU on the GPU (stream/device/event
  synchronize, blocking copies), their count and time;
- the longest idle gaps, each with the CPU operator running when it began;
- host ops: the aten operators the host dispatched per step outside compiled graphs (top-level
  ones only: an op inside another op, or inside a compiled region, is not counted again). Each
  is Python and dispatcher work, and on a GPU at least one launch, between the compiled
  blocks; `host_ops` is what the CPU tests compare with the plain loop's.

A CPU-only trace has no device activity: only the CPU operators' inclusive time is summarized.
Prints text, or one JSON document with --json. Exact arithmetic over the trace's microseconds;
kinds are read from kernel names (a guess where a library names kernels unusually).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
KINDS = (  # first match wins
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|flex", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|scaled_mm|wgmma|sm90_", re.I)),
    ("triton fused", re.compile(r"^triton_", re.I)),
)
SYNC_CALLS = re.compile(
    r"^cuda(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy|Memcpy2D)$"
)


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def kind_of(event: dict) -> str:
    if event.get("cat") == "gpu_memcpy":
        return "copy"
    if event.get("cat") == "gpu_memset":
        return "set"
    name = event.get("name", "")
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, sorted and non-overlapping."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def clip(start: float, end: float, lo: float, hi: float) -> tuple[float, float] | None:
    start, end = max(start, lo), min(end, hi)
    return (start, end) if end > start else None


# Spans of compiled code: torch.compile's region, the compiled autograd functions (forward and
# backward) and Inductor's graph calls.
COMPILED = re.compile(r"^(Torch-Compiled Region|CompiledFunction|## Call CompiledFxGraph)")


def host_ops(events: list[dict]) -> dict:
    """Top-level aten operators per profiled step, outside compiled regions: {"per_step": mean
    count over the steps, "steps": N, "by_name": {op: count over all steps}}. Nesting is by time
    on each thread (backward runs on autograd's threads)."""
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in steps] or [
        (min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))
    ]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        name = str(e.get("name", ""))
        if lo <= e["ts"] < hi and (name.startswith("aten::") or COMPILED.match(name)):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    counts: dict[str, int] = defaultdict(int)
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_end = -1.0  # the end of the outermost op or region still open
        for e in ops:
            if e["ts"] < open_end:
                continue  # inside an op or a compiled region already counted (or not counted)
            open_end = e["ts"] + e["dur"]
            if e["name"].startswith("aten::"):
                counts[e["name"]] += 1
    total = sum(counts.values())
    return {"per_step": total / max(len(spans), 1), "steps": len(steps), "by_name": dict(counts)}


def summarize(events: list[dict], top: int = 12, gaps: int = 5) -> dict:
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    spans = steps or events
    lo = min(e["ts"] for e in spans)
    hi = max(e["ts"] + e["dur"] for e in spans)
    wall = hi - lo
    device = []
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            part = clip(e["ts"], e["ts"] + e["dur"], lo, hi)
            if part:
                device.append((e, part))
    doc: dict = {"steps": len(steps), "wall_us": wall, "device_events": len(device),
                 "host_ops_per_step": host_ops(events)["per_step"]}  # fmt: skip
    if not device:
        inclusive: dict[str, float] = defaultdict(float)
        for e in events:
            if e.get("cat") == "cpu_op":
                inclusive[e["name"]] += e["dur"]
        doc["cpu_ops"] = sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]
        return doc
    busy = merged([part for _, part in device])
    busy_us = sum(end - start for start, end in busy)
    doc["busy_us"] = busy_us
    doc["busy_fraction"] = busy_us / wall if wall else 0.0
    by_kind: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e, (start, end) in device:
        by_kind[kind_of(e)] += end - start
        by_kernel[e["name"]][0] += end - start
        by_kernel[e["name"]][1] += 1
    total = sum(by_kind.values())
    doc["by_kind"] = {k: {"us": v, "share": v / total} for k, v in
                      sorted(by_kind.items(), key=lambda kv: -kv[1])}  # fmt: skip
    doc["top_kernels"] = [
        {"name": name, "us": us, "count": count}
        for name, (us, count) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    syncs = [
        e for e in events
        if e.get("cat") == "cuda_runtime" and SYNC_CALLS.match(e.get("name", ""))
        and clip(e["ts"], e["ts"] + e["dur"], lo, hi)
    ]  # fmt: skip
    doc["host_syncs"] = {"count": len(syncs), "us": sum(e["dur"] for e in syncs),
                         "calls": sorted({e["name"] for e in syncs})}  # fmt: skip
    holes = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:], strict=False)]
    holes += [(lo, busy[0][0])] if busy[0][0] > lo else []
    holes += [(busy[-1][1], hi)] if busy[-1][1] < hi else []
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    doc["gaps"] = []
    for start, end in sorted(holes, key=lambda h: h[0] - h[1])[:gaps]:
        running = [e for e in cpu_ops if e["ts"] <= start < e["ts"] + e["dur"]]
        innermost = min(running, key=lambda e: e["dur"])["name"] if running else None
        doc["gaps"].append({"start_us": start - lo, "us": end - start, "cpu_op": innermost})
    doc["idle_us"] = wall - busy_us
    return doc


def render(doc: dict) -> str:
    steps = f"{doc['steps']} profiled step(s)" if doc["steps"] else "the whole trace"
    ops = f"{doc['host_ops_per_step']:,.0f} aten ops a step outside compiled graphs"
    lines = [f"{steps}: {doc['wall_us'] / 1e3:,.2f} ms of wall time; {ops}"]
    if not doc["device_events"]:
        lines.append("no device activity in this trace (CPU run): CPU operators by inclusive time")
        lines += [f"  {us / 1e3:10,.2f} ms  {name}" for name, us in doc["cpu_ops"]]
        return "\n".join(lines)
    lines.append(f"GPU busy {doc['busy_fraction']:.1%} ({doc['busy_us'] / 1e3:,.2f} ms); idle "
                 f"{doc['idle_us'] / 1e3:,.2f} ms")  # fmt: skip
    lines.append("device time by kind:")
    lines += [f"  {kind:13} {v['us'] / 1e3:10,.2f} ms  {v['share']:6.1%}"
              for kind, v in doc["by_kind"].items()]  # fmt: skip
    lines.append("longest kernels (total, count):")
    lines += [f"  {k['us'] / 1e3:10,.2f} ms  x{k['count']:<5} {k['name'][:90]}"
              for k in doc["top_kernels"]]  # fmt: skip
    s = doc["host_syncs"]
    lines.append(f"host syncs: {s['count']} call(s), {s['us'] / 1e3:,.2f} ms"
                 + (f" ({', '.join(s['calls'])})" if s["calls"] else ""))  # fmt: skip
    lines.append("longest idle gaps (start in the steps, length, CPU operator running then):")
    lines += [f"  at {g['start_us'] / 1e3:9,.2f} ms  {g['us'] / 1e3:8,.2f} ms  {g['cpu_op'] or '-'}"
              for g in doc["gaps"]]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=12, help="kernels to list")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    try:
        events = load_events(args.trace)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.trace}: not a readable Chrome trace ({e})", file=sys.stderr)
        return 2
    if not events:
        print(f"error: {args.trace}: no complete events", file=sys.stderr)
        return 2
    doc = summarize(events, top=args.top)
    print(json.dumps(doc) if args.json else render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
