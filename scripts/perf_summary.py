"""The performance figures of a `scripts/gpu_check.sh perf` run, one line per side.

python scripts/perf_summary.py WORK_DIR     # reads WORK_DIR/perf*.json

Each side's ratio is against the plain loop it is like (`vs`): bench.py pairs a float8 side with
the plain float8 loop, an eager side with the plain eager loop.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

GIB = 2**30


def side_line(side: str, results: dict) -> str:
    st = results["stats"][side]
    if "error" in st:
        return f"  {side:18} skipped: {st['error']}"
    t, m = st["tokens_per_s"], st["peak_memory_bytes"]
    ratio = results["ratios"].get(side)
    vs = (
        f"x{ratio['tokens_per_s']:.3f} tokens/s, x{ratio['memory']:.3f} memory vs "
        f"{ratio.get('against', 'plain')}"
        if ratio
        else ""
    )
    mfus = [r["throughput"].get("mfu") for r in results["runs"][side] if r.get("throughput")]
    mfus = [x for x in mfus if x is not None]
    mfu = f"  MFU {statistics.median(mfus):.1%}" if mfus else ""
    return (
        f"  {side:18} tokens/s {t['min']:,.0f} / {t['median']:,.0f} / {t['max']:,.0f} "
        f"(min/median/max, n={len(results['runs'][side])})  peak {m['median'] / GIB:.2f} GiB  "
        f"{vs}{mfu}"
    )


def main(work: Path) -> None:
    paths = sorted(work.glob("perf*.json"))
    if not paths:
        print("perf: no result (timed out before its first pair of runs, or failed)")
    for path in paths:
        name = path.stem
        r = json.loads(path.read_text())
        print(
            f"{name}: {r['recipe']} {' '.join(r['overrides'])}; {r['device']}; {r['steps']} "
            f"steps (first {r['timing_warmup_steps']} untimed); {r['repeats']} repeat(s) asked"
        )
        for side in r["stats"]:
            print(side_line(side, r))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
