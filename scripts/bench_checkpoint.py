"""Checkpoint save/load throughput and async blocked time, measured through the real commands.

    .venv/bin/python scripts/bench_checkpoint.py [--nproc-per-node 2] [--out results.json]

Trains a Llama of a few hundred MB (fp32 weights; the checkpoint also holds AdamW's two moments,
about 3x the weights) for 3 steps with a checkpoint every step, once with sync saves and once with
`checkpoint.async=true`, then resumes the sync run from step 2 to time the load. Prints, per
mode, GB/s of the saves and the time training was blocked, and the load rate; the ratio
async-blocked / sync-blocked is the figure of merit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdprun.report.metrics import read_events

FSDPRUN = str(Path(sys.executable).parent / "fsdprun")
MODEL = [
    "model.dim=1024", "model.n_layers=4", "model.n_heads=16", "model.n_kv_heads=8",
    "model.ffn_dim=2816", "model.vocab_size=32000", "train.seq_len=64",
    "train.global_batch_size=2", "train.micro_batch_size=1", "train.steps=3",
    "checkpoint.every_steps=1", "checkpoint.keep_last=0", "output.log_every=1",
]  # fmt: skip


def fsdprun(*args: str, cwd: Path) -> None:
    subprocess.run([FSDPRUN, *args], cwd=cwd, check=True, capture_output=True, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node))
    )
    nproc = ["--nproc-per-node", str(args.nproc_per_node)]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for mode in ("sync", "async"):
            run = root / mode
            extra = ["checkpoint.async=true"] if mode == "async" else []
            fsdprun("train", "debug", *MODEL, *extra, *nproc, "--run-dir", str(run), cwd=root)
            saves = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "checkpoint"]
            results[mode] = {
                "checkpoint_bytes": saves[0]["bytes"],
                "blocked_s": statistics.median(s["blocked_s"] for s in saves),
                "total_s": statistics.median(s["total_s"] for s in saves),
                "save_gb_per_s": statistics.median(s["bytes"] / s["total_s"] / 1e9 for s in saves),
            }
        fsdprun("resume", str(root / "sync"), "--step", "2", *nproc, cwd=root)
        resume = next(e for e in read_events(root / "sync" / "metrics.jsonl")
                      if e["event"] == "resume")  # fmt: skip
        size = results["sync"]["checkpoint_bytes"]
        results["load"] = {
            "load_s": resume["load_s"],
            "load_gb_per_s": size / resume["load_s"] / 1e9,
        }
    results["async_blocked_over_sync_blocked"] = (
        results["async"]["blocked_s"] / results["sync"]["blocked_s"]
    )
    gb = results["sync"]["checkpoint_bytes"] / 1e9
    print(f"checkpoint size {gb:.2f} GB (model + AdamW state), {args.nproc_per_node} ranks")
    for mode in ("sync", "async"):
        r = results[mode]
        print(f"{mode:>5}: blocked {r['blocked_s']:.2f} s, total {r['total_s']:.2f} s, "
              f"{r['save_gb_per_s']:.2f} GB/s")  # fmt: skip
    print(f" load: {results['load']['load_s']:.2f} s, {results['load']['load_gb_per_s']:.2f} GB/s")
    print(f"async blocked / sync blocked = {results['async_blocked_over_sync_blocked']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
