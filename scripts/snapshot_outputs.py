"""What fsdprun prints, recorded and compared: `config`, `plan`, `tune --dry-run` of every
shipped recipe and of the dp, tp 2, cp 2 and cp 2 x tp 2 layouts; the run header and
`inspect-checkpoint` of a short `train` at each of those layouts on 4 CPU ranks.

A refactor may move code, not change what users read. Record before, compare after:

    .venv/bin/python scripts/snapshot_outputs.py --record   # writes tests/golden/outputs.json
    .venv/bin/python scripts/snapshot_outputs.py            # compares; exit 1 and a diff if not

Paths, times, dates and measured figures are masked (they differ from run to run); everything
else must be identical, byte for byte. About 3 minutes on a 2-core CPU VM (four 4-rank runs).
Re-record only when a change is meant to change an output, and say which in the commit.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "outputs.json"
FSDPRUN = [sys.executable, "-m", "fsdprun"]

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
# The parallel layouts on 4 ranks; each is also planned on llama-8b at 8 ranks.
LAYOUTS = {
    "dp": [],
    "tp2": ["parallel.tp=2"],
    "cp2": ["parallel.cp=2"],
    # 4 kv heads: the all-to-all (the debug model's 2 would take the ring there).
    "cp2tp2": ["parallel.cp=2", "parallel.tp=2", "model.n_kv_heads=4"],
}
TINY_TRAIN = ["train.steps=2", "checkpoint.every_steps=2", "output.log_every=1"]


def _commands(tmp: Path) -> dict[str, list[str]]:
    """name -> the fsdprun arguments of every read-only command recorded."""
    cmds: dict[str, list[str]] = {}
    for recipe in RECIPES:
        cmds[f"config {recipe}"] = ["config", recipe]
        cmds[f"plan {recipe}"] = ["plan", recipe]
        memory = "8GB" if "demo" in recipe or recipe == "debug" else "80GB"
        cmds[f"tune {recipe}"] = ["tune", recipe, "--dry-run", "--device-memory", memory,
                                  "--out", str(tmp / "tune" / recipe)]  # fmt: skip
    for name, over in LAYOUTS.items():
        cmds[f"config debug {name}"] = ["config", "debug", *over, "launch.nproc_per_node=4"]
        cmds[f"plan debug {name}"] = ["plan", "debug", "--world-size", "4", *over]
        cmds[f"plan llama-8b {name}"] = ["plan", "llama-8b", *over]
        cmds[f"plan llama-8b {name} eager"] = ["plan", "llama-8b", *over, "compile.enabled=false"]
        cmds[f"plan hf-finetune-demo {name}"] = [
            "plan", "hf-finetune-demo", "--world-size", "4", *over]  # fmt: skip
        cmds[f"tune debug {name}"] = [
            "tune", "debug", "--dry-run", "--device-memory", "8GB", "--nproc-per-node", "4", *over,
            "--out", str(tmp / "tune" / f"debug-{name}"),
        ]  # fmt: skip
    return cmds


_MASKS = (
    (re.compile(r"/tmp/[^\s'\"]*|/work/[^\s'\"]*"), "<path>"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+\-Z0-9:]*"), "<time>"),
    (re.compile(r"\b\d{8}-\d{6}\b"), "<stamp>"),
    (re.compile(r"wall time [\d.]+ s"), "wall time <s>"),
    (re.compile(r"in [\d.]+ s \(training blocked [\d.]+ s\)"), "in <s>"),
    (re.compile(r"\b\d[\d.]* s\b(?= to import| of)"), "<s>"),
    # glog's prefix of a library's warning: its time and the process id.
    (re.compile(r"^W\d{4} [\d:.]+ +\d+ ", re.M), "W<time> <pid> "),
)


def _mask(text: str) -> str:
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "COLUMNS": "120", "FSDPRUN_NO_COLOR": "1", "NO_COLOR": "1"}
    proc = subprocess.run([*FSDPRUN, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    return _mask(f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}")


def _header(stdout: str) -> str:
    """The run header: every line before the first step or checkpoint line."""
    lines = []
    for line in stdout.splitlines():
        if re.match(r"(step \d+ \||checkpoint step )", line):
            break
        lines.append(line)
    return "\n".join(lines)


def _train(name: str, over: list[str], tmp: Path) -> dict[str, str]:
    run_dir = tmp / f"run-{name}"
    out = _run(["train", "debug", *TINY_TRAIN, *over, "--nproc-per-node", "4",
                "--run-dir", str(run_dir)], tmp)  # fmt: skip
    ckpt = run_dir / "checkpoints" / "step-00000002"
    return {
        f"header debug {name}": _header(out),
        f"inspect debug {name}": _run(["inspect-checkpoint", str(ckpt)], tmp),
    }


def snapshot() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        outputs = {}
        with ThreadPoolExecutor(2) as pool:
            cmds = _commands(tmp)
            texts = pool.map(lambda a: _run(a, tmp), cmds.values())
            outputs.update(zip(cmds, texts, strict=True))
        for name, over in LAYOUTS.items():  # one 4-rank run at a time: two cores
            outputs.update(_train(name, over, tmp))
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write tests/golden/outputs.json")
    args = parser.parse_args()
    outputs = snapshot()
    if args.record:
        GOLDEN.write_text(json.dumps(outputs, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(outputs)} outputs in {GOLDEN.relative_to(ROOT)}")
        return 0
    recorded = json.loads(GOLDEN.read_text())
    differ = 0
    for key in sorted(set(recorded) | set(outputs)):
        before, after = recorded.get(key), outputs.get(key)
        if before == after:
            continue
        differ += 1
        print(f"--- {key}")
        diff = difflib.unified_diff((before or "").splitlines(), (after or "").splitlines(),
                                    "recorded", "now", lineterm="", n=1)  # fmt: skip
        print("\n".join(diff))
    print(f"{len(outputs) - differ} of {len(outputs)} outputs identical"
          + (f"; {differ} differ" if differ else ""))  # fmt: skip
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
