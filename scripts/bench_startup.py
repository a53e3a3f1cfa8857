"""Start-up of the commands that answer at once: `fsdprun --help`, `--version`, `recipes`,
`config debug`, `config debug --explain` and `status RUN`, each timed as a whole process from its
start to its exit (wall seconds, and its CPU seconds: user + sys of the process and its
children). Every round runs each command once, in turn, so a drift of the machine's speed
reaches them all alike; a first round warms the file cache and is not counted. `python -c pass`
is the floor: the interpreter's own start-up. The goal (issue 57): each median under 0.5 s on a
quiet 2-core machine.

    .venv/bin/python scripts/bench_startup.py [--runs 11] [--json]

Run it on an idle machine. On a shared one the wall seconds mostly say how busy it was; the CPU
seconds are steadier, but still grow with the load (caches, frequency). Results:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 0.5
FSDPRUN = str(Path(sys.executable).parent / "fsdprun")


def commands(run_dir: Path) -> dict[str, list[str]]:
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "fsdprun --help": [FSDPRUN, "--help"],
        "fsdprun --version": [FSDPRUN, "--version"],
        "fsdprun recipes": [FSDPRUN, "recipes"],
        "fsdprun config debug": [FSDPRUN, "config", "debug"],
        "fsdprun config debug --explain": [FSDPRUN, "config", "debug", "--explain"],
        "fsdprun status RUN": [FSDPRUN, "status", str(run_dir)],
    }


def time_once(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one run of `argv`, its output thrown away."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11, help="counted rounds (default 11)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # A run directory as `status` reads it: a started run with one logged step.
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        events = [
            {"event": "start", "step": 0, "steps": 20, "world_size": 2},
            {"event": "step", "step": 1, "loss": 5.5},
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        todo = commands(run_dir)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in todo}
        for round_ in range(args.runs + 1):
            for name, argv in todo.items():
                measured = time_once(argv)
                if round_:  # the first round warms the file cache
                    times[name].append(measured)
    result = {
        name: {"wall_s": spread([w for w, _ in runs]), "cpu_s": spread([c for _, c in runs])}
        for name, runs in times.items()
    }
    if args.json:
        print(json.dumps({"runs": args.runs, "goal_s": GOAL_S, "commands": result}, indent=1))
        return
    print(f"{args.runs} runs each; seconds as min / median / max; goal: median wall < {GOAL_S} s")
    print(f"{'command':<32} {'wall s':>22}  {'cpu s':>22}")
    for name, row in result.items():
        wall, cpu = row["wall_s"], row["cpu_s"]
        cells = [" / ".join(f"{d[k]:.3f}" for k in ("min", "median", "max")) for d in (wall, cpu)]
        verdict = "ok" if wall["median"] < GOAL_S else "over"
        mark = "" if name.startswith("python") else f"  {verdict}"
        print(f"{name:<32} {cells[0]:>22}  {cells[1]:>22}{mark}")


if __name__ == "__main__":
    main()
