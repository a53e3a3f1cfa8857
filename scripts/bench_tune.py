"""Benchmark `fsdprun tune`: tune a recipe, then time the tuned layer against the starting recipe.

1. `fsdprun tune RECIPE ... --out OUT` (its own trials, as a user would run it);
2. `fsdprun train OUT/tuned.yaml` and `fsdprun train RECIPE`, interleaved (start, tuned, start,
   tuned, ...) with the same step count, so that drift of the machine hits both alike;
3. prints each side's tokens/s (from each run's metrics.jsonl summary, warm-up steps left out)
   as min/median/max over the repeats, the ratio of the medians, and the time tune took.

    python scripts/bench_tune.py                      # the debug model, 1 x 8 accumulation, CPU
    python scripts/bench_tune.py llama-1b --device-memory 141GB --budget 6m --nproc-per-node 1
    python scripts/bench_tune.py --gpu    # one H200: llama-1b and llama-8b-sized layers, <= 8 min
    python scripts/bench_tune.py --gpu --cases llama-1b      # llama-1b only, about half of that

The default (no recipe) is the debug-sized model with micro_batch_size 1 and 8 accumulation
steps at 2 ranks (global batch 16), tuned over the default space with --device-memory 8GB.
`--gpu` tunes GPU_CASES (below) on one device with its measured free memory, each within a
90 s budget, then times each tuned layer against its start (2 runs of 8 steps a side). Not yet
run on a GPU (docs/performance.md).
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

from fsdprun.tools.tune.trials import short_schedule

DEBUG_MB1 = "extends: debug\ntrain:\n  global_batch_size: 16\n  micro_batch_size: 1\n"


def fsdprun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fsdprun", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))


def tokens_per_s(run_dir: Path) -> float:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])
    return summary["throughput"]["tokens_per_s"]


# On one H200 (--gpu): starting recipes an engineer might write first (eager, 1 x 8 accumulation),
# for llama-1b and for llama-8b-sized layers (its dim, heads, ffn and vocabulary; 4 of its 32
# blocks, so that model state and activations fit one GPU), each with fewer warm-up steps so that
# a trial is short. Budgets: both cases, tune and timed runs, within GPU_TOTAL_S.
GPU_CASES = {
    "llama-1b": "extends: llama-1b\ncompile:\n  enabled: false\ntrain:\n  global_batch_size: 8\n"
                "  micro_batch_size: 1\noutput:\n  timing_warmup_steps: 2\n",
    "llama-8b-layers": "extends: llama-8b\nmodel:\n  n_layers: 4\ncompile:\n  enabled: false\n"
                       "activation_checkpointing:\n  mode: none\ntrain:\n  global_batch_size: 8\n"
                       "  micro_batch_size: 1\n  seq_len: 4096\nlaunch:\n  nproc_per_node: 1\n"
                       "output:\n  timing_warmup_steps: 2\n",
}  # fmt: skip
GPU_TOTAL_S = 480.0
GPU_TUNE_BUDGET = "90s"
GPU_STEPS, GPU_REPEATS = 8, 2


def bench(recipe: str, *, work: Path, launch: list[str], tune_args: list[str], steps: int,
          repeats: int) -> dict | None:  # fmt: skip
    """Tune `recipe`, then time the tuned layer against it, interleaved; the figures, or None
    (printed why) when a command failed."""
    out = work / "tune"
    start = time.perf_counter()
    proc = fsdprun("tune", recipe, "--out", str(out), *tune_args, *launch, "--json")
    tune_s = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return None
    report = json.loads(proc.stdout)
    print(f"tune: {report['num_trials']} trials in {tune_s:.0f} s; {report['verdict']}")
    print(f"winner: {report['winner']} {report['winner_label']} ({report['hardware']})")
    print(report["confirmation"]["line"])  # tune's own measured ratio, beside the one timed here
    sides = {"start": recipe, "tuned": str(out / "tuned.yaml")}
    figures: dict[str, list[float]] = {name: [] for name in sides}
    common = [
        f"train.steps={steps}",
        "checkpoint.save_final=false",
        *launch,
        *short_schedule(recipe, [], steps),
    ]  # as tune's trials cut a long warm-up
    for rep in range(repeats):
        for name, ref in sides.items():
            run_dir = work / f"{name}-{rep}"
            run = fsdprun("train", ref, *common, "--run-dir", str(run_dir))
            if run.returncode != 0:
                print(f"{name} run {rep} failed: {run.stderr[-2000:]}")
                return None
            figures[name].append(tokens_per_s(run_dir))
    for name, values in figures.items():
        print(f"{name:>6}: tokens/s min {min(values):,.0f} median {statistics.median(values):,.0f} "
              f"max {max(values):,.0f} over {len(values)} runs of {steps} steps")  # fmt: skip
    ratio = statistics.median(figures["tuned"]) / statistics.median(figures["start"])
    print(f"tuned / start: {ratio:.2f}x tokens/s (medians); tune took {tune_s:.0f} s")
    return {"ratio": ratio, "tune_s": tune_s, "figures": figures, "winner": report["winner_label"],
            "verdict": report["verdict"], "hardware": report["hardware"],
            "tune_measured_ratio": report["measured_ratio"]}  # fmt: skip


def main_gpu(work: Path, cases: list[str]) -> int:
    """The GPU cases named (all by default) on one device, within GPU_TOTAL_S; a case that would
    start too late to finish is skipped and said so."""
    started, results = time.perf_counter(), {}
    for n, name in enumerate(cases):
        text = GPU_CASES[name]
        left = GPU_TOTAL_S - (time.perf_counter() - started)
        if left < GPU_TOTAL_S / len(GPU_CASES) * 0.8:
            print(f"{name}: skipped, {left:.0f} s left of {GPU_TOTAL_S:.0f} s")
            continue
        case = work / name
        case.mkdir()
        recipe = case / f"{name}-start.yaml"
        recipe.write_text(text)
        print(f"== {name} (starting recipe {recipe}, case {n + 1} of {len(cases)})")
        result = bench(str(recipe), work=case, launch=["--nproc-per-node", "1"],
                       tune_args=["--budget", GPU_TUNE_BUDGET, "--steps", "3"], steps=GPU_STEPS,
                       repeats=GPU_REPEATS)  # fmt: skip
        if result is None:
            return 1
        results[name] = result
    print(json.dumps({"gpu": results, "total_s": time.perf_counter() - started}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="recipe (default: debug at 1 x 8 accumulation)")
    parser.add_argument("--gpu", action="store_true",
                        help="llama-1b and llama-8b-sized layers on one GPU, in 8 min")  # fmt: skip
    known = ", ".join(GPU_CASES)
    parser.add_argument("--cases", default=",".join(GPU_CASES),
                        help=f"with --gpu: these cases only (of {known})")  # fmt: skip
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--device-memory", default="8GB")
    parser.add_argument("--budget", default="8m", help="tune's --budget")
    parser.add_argument("--space", action="append", default=[], help="tune's --space")
    parser.add_argument("--steps", type=int, default=30, help="steps of each timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side")
    parser.add_argument("--work", type=Path, help="folder for the search and the runs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-tune-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        cases = args.cases.split(",")
        unknown = sorted(set(cases) - set(GPU_CASES))
        if unknown:
            parser.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(GPU_CASES)}")
        return main_gpu(work, cases)
    recipe = args.recipe
    if recipe is None:
        recipe = str(work / "debug-mb1.yaml")
        Path(recipe).write_text(DEBUG_MB1)
    space = [x for s in args.space for x in ("--space", s)]
    result = bench(recipe, work=work, launch=["--nproc-per-node", str(args.nproc_per_node)],
                   tune_args=["--device-memory", args.device_memory, "--budget", args.budget,
                              *space], steps=args.steps, repeats=args.repeats)  # fmt: skip
    if result is None:
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
