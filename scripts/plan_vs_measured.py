"""How far `fsdprun plan` is from what runs measure.

For every run directory under DIR (e.g. the output of `fsdprun compare ... --run-dir DIR`, or a
single run), plan the run's own recipe (RUN_DIR/recipe.yaml, at its world size) and put the
plan's model state per rank next to the model state the run measured (its memory table), and,
on a GPU, the plan's total next to the measured peak allocated. Prints a Markdown table.

    python scripts/plan_vs_measured.py runs/compare-debug-20261129-230000
    python scripts/plan_vs_measured.py DIR --bench bench.json   # also a bench.py result (GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdprun.config import RecipeConfig, load_recipe
from fsdprun.report.metrics import read_events
from fsdprun.tools.plan import plan_memory


def _err(plan: int, measured: int) -> str:
    return f"{(plan - measured) / measured:+.2%}"


def row(label: str, cfg: RecipeConfig, rank0: dict) -> list[str]:
    """Plan `cfg` and set it beside rank 0's measured memory (a summary's `ranks[0]`)."""
    plan = plan_memory(cfg)
    s = plan.strategies[plan.recipe_strategy]
    state_plan = s.params + s.grads + s.optimizer
    state = rank0["model_state_bytes"]["total"]
    peak = rank0.get("peak_allocated_bytes")
    return [
        label, plan.recipe_strategy, str(cfg.world_size), f"{state_plan:,}", f"{state:,}",
        _err(state_plan, state),
        f"{s.total:,}" if peak else "-", f"{peak:,}" if peak else "-",
        _err(s.total, peak) if peak else "- (CPU: RSS holds the runtime)",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a run directory or a directory of them")
    parser.add_argument(
        "--bench", type=Path, help="a scripts/bench.py --out JSON (its fsdprun side)"
    )
    parser.add_argument("--recipe", default="llama-1b", help="the recipe the bench ran")
    args = parser.parse_args(argv)
    rows = []
    runs = [args.dir] if (args.dir / "metrics.jsonl").exists() else sorted(args.dir.iterdir())
    for run in runs:
        metrics = run / "metrics.jsonl"
        if not metrics.exists():
            continue
        events = read_events(metrics)
        if not events or events[-1]["event"] != "summary":
            rows.append([run.name, "-", "-", "-", "-", "run failed", "-", "-", "-"])
            continue
        cfg = load_recipe(str(run / "recipe.yaml")).config
        rows.append(row(run.name, cfg, events[-1]["ranks"][0]))
    if args.bench is not None and args.bench.exists():
        bench = json.loads(args.bench.read_text())
        cfg = load_recipe(args.recipe, bench["overrides"]).config
        rows.append(row(f"bench {args.recipe}", cfg, bench["best"]["fsdprun"]["ranks"][0]))
    header = ["run", "strategy", "ranks", "model state plan", "measured", "error",
              "plan total", "peak allocated", "error"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
