"""Benchmark `fsdprun tune`: tune a recipe, then time the tuned layer against the starting recipe.

1. `fsdprun tune RECIPE ... --out OUT` (its own trials, as a user would run it);
2. `fsdprun train OUT/tuned.yaml` and `fsdprun train RECIPE`, interleaved (start, tuned, start,
   tuned, ...) with the same step count, so that drift of the machine hits both alike;
3. prints each side's tokens/s (from each run's metrics.jsonl summary, warm-up steps left out)
   as min/median/max over the repeats, the ratio of the medians, and the time tune took.

    python scripts/bench_tune.py                      # the debug model, 1 x 8 accumulation, CPU
    python scripts/bench_tune.py llama-1b --device-memory 141GB --budget 6m --nproc-per-node 1

The default (no recipe) is the debug-sized model with micro_batch_size 1 and 8 accumulation
steps at 2 ranks (global batch 16), tuned over the default space with --device-memory 8GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEBUG_MB1 = "extends: debug\ntrain:\n  global_batch_size: 16\n  micro_batch_size: 1\n"


def fsdprun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fsdprun", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))


def tokens_per_s(run_dir: Path) -> float:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])
    return summary["throughput"]["tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="recipe (default: debug at 1 x 8 accumulation)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--device-memory", default="8GB")
    parser.add_argument("--budget", default="8m", help="tune's --budget")
    parser.add_argument("--space", action="append", default=[], help="tune's --space")
    parser.add_argument("--steps", type=int, default=30, help="steps of each timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    recipe = args.recipe
    if recipe is None:
        recipe = str(work / "debug-mb1.yaml")
        Path(recipe).write_text(DEBUG_MB1)
    launch = ["--nproc-per-node", str(args.nproc_per_node)]
    out = work / "tune"
    space = [x for s in args.space for x in ("--space", s)]
    start = time.perf_counter()
    proc = fsdprun("tune", recipe, "--out", str(out), "--device-memory", args.device_memory,
                   "--budget", args.budget, *space, *launch, "--json")  # fmt: skip
    tune_s = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return 1
    report = json.loads(proc.stdout)
    print(f"tune: {report['num_trials']} trials in {tune_s:.0f} s; {report['verdict']}")
    print(f"winner: {report['winner']} {report['winner_label']}")
    sides = {"start": recipe, "tuned": str(out / "tuned.yaml")}
    figures: dict[str, list[float]] = {name: [] for name in sides}
    common = [f"train.steps={args.steps}", "checkpoint.save_final=false", *launch]
    for rep in range(args.repeats):
        for name, ref in sides.items():
            run_dir = work / f"{name}-{rep}"
            run = fsdprun("train", ref, *common, "--run-dir", str(run_dir))
            if run.returncode != 0:
                print(f"{name} run {rep} failed: {run.stderr[-2000:]}")
                return 1
            figures[name].append(tokens_per_s(run_dir))
    for name, values in figures.items():
        print(f"{name:>6}: tokens/s min {min(values):,.0f} median {statistics.median(values):,.0f} "
              f"max {max(values):,.0f} over {len(values)} runs of {args.steps} steps")  # fmt: skip
    ratio = statistics.median(figures["tuned"]) / statistics.median(figures["start"])
    print(f"tuned / start: {ratio:.2f}x tokens/s (medians); tune took {tune_s:.0f} s")
    print(json.dumps({"ratio": ratio, "tune_s": tune_s, "figures": figures,
                      "winner": report["winner_label"], "verdict": report["verdict"]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
