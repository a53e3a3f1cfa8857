"""examples/slurm/: the sbatch scripts run as SLURM would run them, simulated on one machine.

Two "nodes" are two copies of the script with SLURM_NODEID 0 and 1 (SLURM runs the batch script
on the first node and srun starts a task on each; here each copy plays one node's part). A fake
`scontrol` names two hosts that resolve to 127.0.0.1 and records `requeue`; a fake `srun` sets
what srun exports to the tasks of a one-task-per-node step and execs the command. The runs are
real: fsdprun's launcher on each "node", one CPU rank each, one run of world size 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Run, free_port, fsdprun_env, run_fsdprun, zygote_command

from fsdprun.checkpoint import list_checkpoints

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "slurm"
SCONTROL = """#!/bin/bash
case "$1" in
  show) [ "$2" = hostnames ] && printf 'localhost\\nlocalhost\\n' ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
  *) exit 1 ;;
esac
"""
# srun's task environment for `srun --ntasks-per-node=1` over the job's nodes (this copy plays
# the task on node SLURM_NODEID); srun's own options are dropped.
SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
export SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=$SLURM_JOB_NUM_NODES SLURM_PROCID=$SLURM_NODEID \\
  SLURM_STEP_TASKS_PER_NODE="1(x$SLURM_JOB_NUM_NODES)" SLURM_LOCALID=0 \\
  SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_NUM_NODES=$SLURM_JOB_NUM_NODES
exec "$@"
"""
STEPS = ("train.steps=30", "checkpoint.every_steps=5", "output.log_every=1")


@pytest.fixture
def cluster(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    port = free_port()
    # The scripts' `$FSDPRUN` through the suite's zygote: each command its own process, as
    # run_fsdprun's; the client forwards the preemptible script's SIGTERM to it.
    fsdprun = zygote_command(tmp_path)

    def start(script: str, *args: str) -> list[subprocess.Popen]:
        procs = []
        for node in (0, 1):
            env = fsdprun_env(
                PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FSDPRUN=fsdprun,
                NPROC_PER_NODE="1", RDZV_PORT=str(port), SCONTROL_LOG=str(tmp_path / "scontrol"),
                SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]",
                SLURM_NODEID=str(node),
            )  # fmt: skip
            procs.append(subprocess.Popen(
                ["bash", str(EXAMPLES / script), "debug", str(tmp_path / "run"), *args],
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))  # fmt: skip
        return procs

    return start, tmp_path


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    outputs = ["".join(p.communicate(timeout=240)) for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]


def test_sbatch_runs_one_launcher_per_node_as_one_job(cluster):
    """The two-node job, then docs/commands.md's way on with fewer nodes: `fsdprun resume RUN
    --nnodes 1` of its step-2 checkpoint reshards onto one node's one rank and gives the job's
    own steps 3 and 4 (another world size sums in another order: to 1e-6)."""
    start, tmp_path = cluster
    args = ("train.steps=4", "output.log_every=1", "checkpoint.every_steps=2")
    results = _finish(start("train.sbatch", *args))
    assert [rc for rc, _ in results] == [0, 0], results
    run = Run(None, tmp_path / "run")
    assert [e["step"] for e in run.steps] == [1, 2, 3, 4]
    assert (run.start["world_size"], run.start["nnodes"]) == (2, 2)
    assert len([e for e in run.events if e["event"] == "start"]) == 1  # one run, not two
    job = {e["step"]: e["loss"] for e in run.steps}
    proc = run_fsdprun("resume", str(tmp_path / "run"), "--step", "2", "--nnodes", "1",
                       "--nproc-per-node", "1", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    resumed = Run(None, tmp_path / "run")
    (start_event,) = [e for e in resumed.events if e["event"] == "start"][1:]
    assert (start_event["world_size"], start_event["nnodes"]) == (1, 1)
    again = {e["step"]: e["loss"] for e in resumed.steps}  # the later record of a step wins
    assert [e["step"] for e in resumed.steps].count(3) == 2
    for step in (3, 4):
        assert again[step] == pytest.approx(job[step], abs=1e-6), step


def test_preemptible_sbatch_saves_on_sigterm_requeues_and_resumes(cluster):
    start, tmp_path = cluster
    run_dir = tmp_path / "run"
    procs = start("train-preemptible.sbatch", *STEPS)
    deadline = time.time() + 120
    while not any(e["event"] == "step" for e in Run(None, run_dir).events):
        assert time.time() < deadline and all(p.poll() is None for p in procs), _finish(procs)
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)  # SLURM's --signal=B:TERM: the batch shell of node 0
    results = _finish(procs)
    # Node 0's launcher, signalled, says the run stopped at a checkpoint (srun's exit status is
    # its tasks' highest, so the batch script of a real job sees this 143 whatever node 1 says).
    assert results[0][0] == 143 and results[1][0] in (0, 143), results
    assert "forwarding to fsdprun" in results[0][1] and "requeueing job 4242" in results[0][1]
    assert (tmp_path / "scontrol").read_text().splitlines()[0] == "requeue 4242"
    [saved] = [c for c in list_checkpoints(run_dir) if c.complete][-1:]
    assert saved.step < 30
    # The requeued job: the same script, the same arguments, continues from the checkpoint.
    stopped = results
    results = _finish(start("train-preemptible.sbatch", *STEPS))
    assert [rc for rc, _ in results] == [0, 0], results
    assert f"resuming {run_dir}" in results[0][1]
    run = Run(None, run_dir)
    assert {e["step"] for e in run.steps} == set(range(1, 31))
    assert any(e["event"] == "resume" for e in run.events)
    requeues = (tmp_path / "scontrol").read_text().count("requeue")
    assert requeues == (2 if stopped[1][0] == 143 else 1)  # none after the finished job
