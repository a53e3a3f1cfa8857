"""A worker that died of SIGKILL, in words: which rank, at which step, its log, and why it was
probably killed.

Nothing inside a process can catch SIGKILL, so such a worker leaves no error file and the elastic
agent only knows "Signal 9 (SIGKILL) received by PID ...". On Linux that is most often the
kernel's out-of-memory killer: the line says so, with the rank's planned peak (`fsdprun plan`'s
figure for the recipe), the machine's memory (/proc/meminfo) and where the kernel log would
confirm it. The rank, its step and its log come from its heartbeat file (`guard.Heartbeat`).

Never imports torch at load: the planned peak is computed only when a worker was killed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from fsdprun.fmt import fmt_bytes
from fsdprun.rundir import heartbeat_paths, logs_dir

# Where the kernel says it killed a process for memory.
KERNEL_LOG_HINT = (
    "the kernel log would confirm it: `dmesg -T | grep -i -e 'out of memory' -e oom-kill` "
    "(or `journalctl -k`)"
)


def _heartbeat_of(run_dir: Path, pid: int) -> tuple[int, dict[str, Any]] | None:
    """(rank, heartbeat record) of the worker with process id `pid`, if its file says so."""
    for rank, path in heartbeat_paths(run_dir):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("pid") == pid:
            return rank, record
    return None


def mem_total_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The machine's memory (MemTotal), or None off Linux."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def planned_peak_bytes(cfg) -> int | None:
    """Rank 0's planned peak under the recipe's engine and sharding (`fsdprun plan`); the largest
    rank holds about that much. None when it cannot be planned."""
    try:
        from fsdprun.tools.plan import plan_memory  # builds on the meta device only

        plan = plan_memory(cfg)
        return plan.strategies[plan.recipe_strategy].total
    except Exception:  # a message about a dead worker must not fail in its turn
        return None


def _agent_log(run_dir: Path, local_rank: int, cfg) -> Path | None:
    """The newest stderr.log the elastic agent keeps for `local_rank` (logs/<id>/attempt_N/R/)."""
    root = logs_dir(run_dir, cfg.launch.log_dir if cfg is not None else None)
    # The agent names each job's folder <rdzv_id>_<random>: a shared --log-dir holds others' too.
    job = f"{cfg.launch.rdzv_id}_*" if cfg is not None else "*"
    logs = [p for p in root.glob(f"{job}/attempt_*/{local_rank}/stderr.log") if p.is_file()]
    return max(logs, key=lambda p: p.stat().st_mtime, default=None)


def describe_sigkill(
    run_dir: Path, *, rank: int, pid: int, local_rank: int, cfg, device_kind: str
) -> str:
    """One line about a worker killed by SIGKILL: rank, step, pid and log, then why it was
    probably killed (the OOM killer: planned peak, the machine's memory, the kernel log)."""
    found = _heartbeat_of(run_dir, pid)
    log = _agent_log(run_dir, local_rank, cfg)
    where = ""
    if found is not None:
        rank, beat = found
        step = beat.get("step")
        where = f" at step {step}" if step else " while starting"
        if beat.get("phase") == "save":
            where += " (in the checkpoint save)"
        elif beat.get("phase") == "eval":
            where += " (in the evaluation)"
        if beat.get("log") and Path(beat["log"]).is_file():
            log = Path(beat["log"])  # the rank's own record of where its stderr goes
    what = f"rank {rank} was killed by SIGKILL{where} (pid {pid})"
    if log is not None:
        what += f"; log: {log}"
    peak = planned_peak_bytes(cfg)
    total = mem_total_bytes()
    facts = []
    if peak is not None:
        memory = "device memory" if device_kind != "cpu" else "memory"
        facts.append(f"`fsdprun plan` puts a rank's peak {memory} at {fmt_bytes(peak)}")
    if total is not None:
        facts.append(f"this machine has {fmt_bytes(total)} (MemTotal)")
    facts_text = f": {' and '.join(facts)}" if facts else ""
    oom = f"SIGKILL is usually the kernel's out-of-memory killer{facts_text}"
    return f"{what}. {oom}; {KERNEL_LOG_HINT}"


def is_sigkill(exitcode: int) -> bool:
    """Whether a worker's exit code says it died of SIGKILL (the agent reports -signal)."""
    return exitcode == -signal.SIGKILL
