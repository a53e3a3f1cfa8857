"""Benchmark fsdprun against a plain, hand-written FSDP2 loop doing the same work: like with
like.

Each fsdprun side runs exactly as a user would (`fsdprun train RECIPE ... --run-dir TMP`, reading
the summary from TMP/metrics.jsonl) and is measured against the plain loop of
`scripts/plain_fsdp2.py` built from the *same* resolved recipe: the same model, data, batch
layout, precision (float8 too: torchao's own recipe config, converted before sharding), compile
and activation checkpointing; started here with torch's `elastic_launch`. Sides whose plain
loops would be identical share one. Every side runs in every repeat, interleaved, to even out
drift. Prints each side's tokens/s and peak memory (max over ranks) as min/median/max over the
repeats, with the ratio of the medians to its own plain loop; exits 0 whatever the ratio.

`--variant NAME=KEY=VALUE,KEY=VALUE` adds an fsdprun side with extra overrides. Where the
overrides change what the plain loop reproduces (float8, compile, dtypes, full checkpointing) the
side gets its own plain loop, `plain:NAME`; where the plain loop has no equivalent (the chunked
loss, selective checkpointing: what each buys) it is measured against the base plain loop, and
a note says so. A variant the machine refuses (float8 on a CPU) is reported and skipped.
`--minimal` adds `scripts/plain_minimal.py`, a second, shorter plain loop with the base side's
settings, run once (in the first repeat): a check that the reference itself runs as fast as the
simplest loop (their ratio should be 1 within noise).

    python scripts/bench.py                              # recipe `debug`
    python scripts/bench.py debug --steps 30 --repeats 3 --out bench.json
    python scripts/bench.py my.yaml model.dim=512 --nproc-per-node 4
    python scripts/bench.py llama-1b --minimal --variant float8=precision.float8=tensorwise \
        --variant eager=compile.enabled=false
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import plain_minimal
from plain_fsdp2 import PlainSpec, worker
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdprun.config import (
    CheckpointMode,
    CompileMode,
    Engine,
    Float8Filter,
    LossKind,
    RecipeConfig,
    Sharding,
    load_recipe,
)
from fsdprun.config.layout import effective_sharding
from fsdprun.device import resolve_device_kind
from fsdprun.engines.base import backward_prefetch_depth
from fsdprun.errors import UserError
from fsdprun.models.llama import build_model_args
from fsdprun.report.metrics import read_events
from fsdprun.train.optim import resolved_implementation

console = Console(highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="debug", help="recipe name or YAML path")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides")
    parser.add_argument("--nproc-per-node", type=int, help="ranks (default: the recipe's)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (train.steps)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=OVERRIDES",
        help="an extra fsdprun side: NAME=KEY=VALUE[,KEY=VALUE...] (fsdprun only)",
    )  # fmt: skip
    parser.add_argument(
        "--no-base", action="store_true", help="run only the variants, not plain fsdprun"
    )
    parser.add_argument(
        "--minimal", action="store_true",
        help="also run scripts/plain_minimal.py once (the base side's settings) as a check of "
        "the plain loop",
    )  # fmt: skip
    # Intermixed: options may come between the recipe and its overrides.
    return parser.parse_intermixed_args(argv)


def build_overrides(args: argparse.Namespace) -> list[str]:
    """The user's overrides plus the flags, as overrides: the same list goes to both sides."""
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.nproc_per_node is not None:
        overrides.append(f"launch.nproc_per_node={args.nproc_per_node}")
    return overrides


def parse_variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """fsdprun sides → their extra overrides ("fsdprun" = none, unless --no-base)."""
    sides = {} if args.no_base else {"fsdprun": []}
    for text in args.variant:
        name, sep, overrides = text.partition("=")
        if not sep or not name or name in sides or name == "plain":
            raise UserError(f"--variant {text!r}: expected a new NAME=KEY=VALUE[,KEY=VALUE...]")
        sides[name] = [o for o in overrides.split(",") if o]
    if not sides:
        raise UserError("--no-base without --variant: nothing to compare with the plain loop")
    return sides


def stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def build_plain_spec(cfg: RecipeConfig, device_kind: str) -> PlainSpec:
    # As fsdprun resolves it: the plain loop's fp16 also steps through ShardedGradScaler.
    fp16 = cfg.precision.param_dtype.value == "fp16"
    impl = resolved_implementation(cfg.optim.implementation, device_kind, sharded_scaler=fp16)
    return PlainSpec(
        model_args=build_model_args(cfg.model),
        device_kind=device_kind,
        param_dtype=cfg.precision.param_dtype.value,
        reduce_dtype=cfg.precision.reduce_dtype.value,
        reshard_after_forward=effective_sharding(cfg.fsdp) is Sharding.full,
        ac_mode=cfg.activation_checkpointing.mode.value,
        ac_every_n=cfg.activation_checkpointing.every_n,
        compile=cfg.compile.enabled,
        compile_per_block=cfg.compile.per_block,
        compile_fullgraph=cfg.compile.fullgraph,
        compile_mode=None if cfg.compile.mode is CompileMode.default else cfg.compile.mode.value,
        optim_impl=impl.value,
        lr=cfg.optim.lr,
        betas=(cfg.optim.betas[0], cfg.optim.betas[1]),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        warmup_steps=cfg.schedule.warmup_steps,
        decay=cfg.schedule.decay.value,
        min_lr_ratio=cfg.schedule.min_lr_ratio,
        steps=cfg.train.steps,
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_len=cfg.train.seq_len,
        grad_clip=cfg.train.grad_clip,
        seed=cfg.train.seed,
        noise=cfg.data.noise,
        timing_warmup_steps=cfg.output.timing_warmup_steps,
        float8=cfg.precision.float8.value,
        float8_skip_small=cfg.precision.float8_filter is Float8Filter.skip_small,
    )


def unmatched_settings(cfg: RecipeConfig) -> list[str]:
    """Recipe settings the plain loop does not reproduce (it wraps per block, no prefetch)."""
    fsdp = cfg.fsdp
    notes = []
    if fsdp.wrap.value != "block":
        notes.append(f"fsdp.wrap={fsdp.wrap.value}")
    if fsdp.forward_prefetch or backward_prefetch_depth(fsdp) > 1:
        notes.append("explicit fsdp prefetch")
    if fsdp.engine is not Engine.fsdp2:
        notes.append(f"fsdp.engine={fsdp.engine.value} (the plain loop is FSDP2)")
    if effective_sharding(fsdp) not in (Sharding.full, Sharding.grad_op):
        notes.append(f"fsdp.sharding={fsdp.sharding.value} (the plain loop uses a 1-D mesh)")
    if fsdp.cpu_offload:
        notes.append("fsdp.cpu_offload")
    if cfg.activation_checkpointing.mode is CheckpointMode.selective:
        notes.append("activation_checkpointing.mode=selective (the plain loop checkpoints nothing)")
    if cfg.train.loss is not LossKind.plain:
        notes.append(f"train.loss={cfg.train.loss.value}")
    return notes


def pair_sides(
    variants: dict[str, list[str]], specs: dict[str, PlainSpec]
) -> tuple[dict[str, PlainSpec], dict[str, str]]:
    """The plain loops to run and which one each fsdprun side is measured against: sides with
    equal plain specs share one; the first is `plain`, others `plain:SIDE`."""
    plains: dict[str, PlainSpec] = {}
    like: dict[str, str] = {}
    for side in variants:
        spec = specs[side]
        name = next((n for n, s in plains.items() if s == spec), None)
        if name is None:
            name = "plain" if not plains else f"plain:{side}"
            plains[name] = spec
        like[side] = name
    return plains, like


def busy_cores(interval_s: float = 0.5) -> float | None:
    """Cores' worth of CPU time used by anything over `interval_s` (Linux /proc/stat; else None)."""

    def sample() -> tuple[int, int]:
        # First line: cpu user nice system idle iowait irq softirq steal ... (clock ticks).
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError):
        return None
    if total1 == total0:
        return None
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / (total1 - total0))


def run_fsdprun(recipe: str, overrides: list[str], run_dir: Path, device_kind: str) -> dict:
    """`fsdprun train` as a subprocess, as a user runs it; returns the figures of its summary."""
    exe = Path(sys.executable).parent / "fsdprun"
    if not exe.exists():
        raise UserError(f"no fsdprun console script beside {sys.executable}; pip install -e .")
    cmd = [str(exe), "train", recipe, *overrides, "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = read_events(run_dir / "metrics.jsonl")[-1]
    assert summary["event"] == "summary", summary["event"]
    key = "peak_allocated_bytes" if device_kind == "cuda" else "peak_rss_bytes"
    return {
        "tokens_per_s": summary["throughput"]["tokens_per_s"],
        "peak_memory_bytes": max(r[key] for r in summary["ranks"]),
        "final_loss": summary["final_loss"],
        "steps_measured": summary["throughput"]["steps_measured"],
        "step_times_s": summary["step_times_s"],
        "throughput": summary["throughput"],  # TFLOP/s and MFU where the device has a peak
        "ranks": summary["ranks"],
    }


def run_plain(spec: PlainSpec, nproc: int, log_dir: Path, *, minimal: bool = False) -> dict:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id="bench-plain",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.1,  # as fsdprun's launcher: the agent polls its workers this often
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    entry = plain_minimal.worker if minimal else worker
    return elastic_launch(config, entry)(spec)[0]


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def report(results: dict) -> None:
    table = Table(title=f"fsdprun vs plain FSDP2, like with like — {results['recipe']}")
    memory = f"peak {results['memory_kind']} (max rank, median)"
    for col in ("side", "tokens/s min / median / max", "vs", "ratio", memory, "ratio",
                "final loss"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("side", "vs") else "right")
    for side, st in results["stats"].items():
        if "error" in st:
            table.add_row(side, st["error"][:60], "", "", "", "", "")
            continue
        t, m = st["tokens_per_s"], st["peak_memory_bytes"]
        ratio = results["ratios"].get(side, {})
        table.add_row(
            side,
            f"{t['min']:,.0f} / {t['median']:,.0f} / {t['max']:,.0f}",
            ratio.get("against", ""),
            f"{ratio['tokens_per_s']:.3f}" if ratio else "",
            _size(int(m["median"])),
            f"{ratio['memory']:.3f}" if ratio else "",
            f"{st['final_loss']:.4f}",
        )
    console.print(table)
    for side, ratio in results["ratios"].items():
        console.print(
            f"{side}/{ratio['against']} tokens/s = {ratio['tokens_per_s']:.3f}, "
            f"peak memory = {ratio['memory']:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = build_overrides(args)
    try:
        resolved = load_recipe(args.recipe, overrides)
        cfg = resolved.config
        kind = resolve_device_kind(cfg.launch.device.value)
        if cfg.launch.nnodes != 1:
            raise UserError(
                f"bench runs on one node; the recipe has launch.nnodes={cfg.launch.nnodes}"
            )
        if args.repeats < 1:
            raise UserError(f"--repeats must be at least 1, not {args.repeats}")
        variants = parse_variants(args)
        configs = {side: load_recipe(args.recipe, overrides + extra).config
                   for side, extra in variants.items()}  # fmt: skip
    except UserError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    nproc = cfg.launch.nproc_per_node
    plains, like = pair_sides(variants, {s: build_plain_spec(c, kind) for s, c in configs.items()})
    minimal_spec = build_plain_spec(cfg, kind) if args.minimal else None
    if minimal_spec is not None and (
        cfg.train.global_batch_size != cfg.train.micro_batch_size * nproc
        or cfg.activation_checkpointing.mode is not CheckpointMode.none
    ):
        console.print(
            "[red]error:[/red] --minimal needs one micro-batch a step and no activation "
            "checkpointing (train.micro_batch_size x ranks = train.global_batch_size)"
        )
        return 2
    if cfg.activation_checkpointing.mode is CheckpointMode.none and not cfg.compile.enabled:
        mode = "eager"
    else:
        mode = f"AC {cfg.activation_checkpointing.mode.value}, compile {cfg.compile.enabled}"
    console.print(
        f"{resolved.name}: {nproc} x {kind}, {cfg.train.steps} steps "
        f"(first {cfg.output.timing_warmup_steps} not timed), {cfg.precision.param_dtype.value}, "
        f"{mode}, {args.repeats} runs each"
    )
    for side, side_cfg in configs.items():
        for note in unmatched_settings(side_cfg):
            console.print(f"[yellow]note:[/yellow] {side}: {like[side]} ignores {note}")
    # As fsdprun's launcher does (the elastic agent sets no OMP_NUM_THREADS): CPU ranks split
    # the cores, GPU ranks get one thread. Set here, the fsdprun subprocess inherits it too.
    threads = max(1, (os.cpu_count() or 1) // nproc) if kind == "cpu" else 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    busy = busy_cores() if kind == "cpu" else None
    if busy is not None and busy > 0.25:
        # CPU ranks share the cores with everything else: other work shows up as noise.
        console.print(
            f"[yellow]note:[/yellow] {busy:.1f} of {os.cpu_count()} cores were busy before "
            "starting; other processes will make the figures noisy"
        )

    # Per repeat: each side right after its plain loop (a plain loop once), then the check.
    order: list[str] = []
    for side in variants:
        if like[side] not in order:
            order.append(like[side])
        order.append(side)
    if minimal_spec is not None:
        order.append("minimal")
    runs: dict[str, list[dict]] = {side: [] for side in order}
    errors: dict[str, str] = {}

    def summarize() -> dict:
        """The results so far (written after every run: a time limit keeps what was done)."""
        summary: dict[str, dict] = {}
        for side, rs in runs.items():
            if side in errors:
                summary[side] = {"error": errors[side], "overrides": variants.get(side, [])}
                continue
            if not rs:
                continue
            summary[side] = {
                "overrides": variants.get(side, []),
                "tokens_per_s": stats([r["tokens_per_s"] for r in rs]),
                "peak_memory_bytes": stats([r["peak_memory_bytes"] for r in rs]),
                "final_loss": rs[-1]["final_loss"],
            }
        # Each fsdprun side against its like plain loop; the minimal loop against `plain`, and
        # the plain loop against the minimal one (the reference's own check).
        against = {**like, "minimal": "plain"}
        ratios = {}
        for side, ref in against.items():
            st, base = summary.get(side), summary.get(ref)
            if not st or not base or "error" in st or "error" in base:
                continue
            ratios[side] = {
                "against": ref,
                "tokens_per_s": st["tokens_per_s"]["median"] / base["tokens_per_s"]["median"],
                "memory": st["peak_memory_bytes"]["median"] / base["peak_memory_bytes"]["median"],
            }
        best = {side: max(rs, key=lambda r: r["tokens_per_s"]) for side, rs in runs.items() if rs}
        results = {
            "recipe": resolved.name,
            "overrides": overrides,
            "device": kind,
            "nproc_per_node": nproc,
            "steps": cfg.train.steps,
            "timing_warmup_steps": cfg.output.timing_warmup_steps,
            "repeats": args.repeats,
            "memory_kind": "allocated" if kind == "cuda" else "RSS",
            "like": like,  # fsdprun side -> the plain loop it is measured against
            "runs": runs,
            "stats": summary,
            "ratios": ratios,  # medians over the repeats, side / its like plain loop
            "best": best,
        }
        if "fsdprun" in ratios:
            results["tokens_per_s_ratio"] = ratios["fsdprun"]["tokens_per_s"]
            results["memory_ratio"] = ratios["fsdprun"]["memory"]
        return results

    with tempfile.TemporaryDirectory(prefix="fsdprun-bench-") as tmp:
        for i in range(args.repeats):
            for side in order:
                if side in errors or (side == "minimal" and i > 0):
                    continue
                start = time.perf_counter()
                try:
                    if side in plains:
                        result = run_plain(plains[side], nproc, Path(tmp) / f"{side}-{i}")
                    elif side == "minimal":
                        result = run_plain(minimal_spec, nproc, Path(tmp) / f"minimal-{i}",
                                           minimal=True)  # fmt: skip
                    else:
                        run_dir = Path(tmp) / f"{side}-{i}"
                        extra = overrides + variants[side]
                        result = run_fsdprun(args.recipe, extra, run_dir, kind)
                except (UserError, ChildFailedError) as e:
                    if side in ("plain", "fsdprun"):
                        console.print(f"[red]error:[/red] {side} run {i + 1} failed: {e}")
                        return 1
                    # A side this machine refuses (float8 without float8 matmuls): say so, and
                    # drop the fsdprun side of a refused plain loop with it.
                    errors[side] = str(e).strip().splitlines()[-1].removeprefix("error: ")
                    console.print(f"[yellow]skipped:[/yellow] {side}: {errors[side]}")
                    for other, ref in like.items():
                        if ref == side and other not in errors:
                            errors[other] = f"its plain loop {side} failed"
                    continue
                # End to end, start-up included (the plain side's launcher has torch imported).
                result["wall_s"] = time.perf_counter() - start
                runs[side].append(result)
                console.print(
                    f"  run {i + 1}/{args.repeats} {side:16} {result['tokens_per_s']:>10,.0f} "
                    f"tokens/s  peak {_size(result['peak_memory_bytes'])}  "
                    f"({result['wall_s']:.1f} s end to end)"
                )
                if args.out is not None and runs[order[0]]:
                    args.out.write_text(json.dumps(summarize(), indent=2) + "\n")

    results = summarize()
    report(results)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
