"""`fsdprun train RECIPE` with no launch flags under Kubeflow Trainer v2, a PyTorchJob and SkyPilot
(docs/cluster.md), and the manifests in examples/kubernetes/ and examples/skypilot/.

The decision (fsdprun.launch.modes) is checked over a table of each platform's environments. The
runs are real: two "nodes" on this machine, each an `fsdprun train` started with exactly the
variables its platform sets (plus FSDPRUN_TEST_HOSTS, the test-only hosts file through which a
Kubernetes service's name starts to resolve while the nodes wait), train 2 nodes x 2 ranks with
the losses of the same job started by hand (`--nnodes 2 --nproc-per-node 2 --node-rank N
--rdzv-endpoint HOST:PORT`). Node 1 starts first in each (a pod scheduled before node 0's):
global rank 0, whose node prints the run and keeps metrics.jsonl, must still land on node 0.

Run with `pytest tests/test_cluster.py`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import Run, free_port, fsdprun_env, run_fsdprun, zygote_command
from test_cli import assert_one_line_error
from test_train import BASE, assert_same_losses
from typer.testing import CliRunner

from fsdprun.checkpoint import list_checkpoints
from fsdprun.cli import app
from fsdprun.launch.flags import LaunchFlags, launch_overrides
from fsdprun.launch.modes import decide
from fsdprun.launch.slurm import PORT_BASE, PORT_SPAN
from fsdprun.report.metrics import read_events

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRAINJOB_MASTER = "fsdprun-node-0-0.fsdprun"  # what Kubeflow Trainer names node 0
PYTORCHJOB_MASTER = "fsdprun-master-0"  # what a PyTorchJob names its Master pod
IPS = "127.0.0.1\n127.0.0.1"  # SKYPILOT_NODE_IPS of two "nodes" on this machine


def trainjob_env(node: int, nproc: int, port: int) -> dict[str, str]:
    """What Kubeflow Trainer v2's torch-distributed runtime sets in node `node`'s pod."""
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": TRAINJOB_MASTER, "PET_MASTER_PORT": str(port)}  # fmt: skip


def pytorchjob_env(pod: int, nproc: int, port: int) -> dict[str, str]:
    """What training-operator v1.9 sets in a PyTorchJob's pod (Master = pod 0; no elastic
    policy; pkg/controller.v1/pytorch/envvar.go and master.go): WORLD_SIZE and RANK count pods
    (x nprocPerNode when it is a number); PET_MASTER_* repeat MASTER_*."""
    return {"MASTER_ADDR": PYTORCHJOB_MASTER, "MASTER_PORT": str(port),
            "PET_MASTER_ADDR": PYTORCHJOB_MASTER, "PET_MASTER_PORT": str(port), "RANK": str(pod),
            "WORLD_SIZE": str(2 * nproc), "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(pod), "PET_NNODES": "2", "PYTHONUNBUFFERED": "1"}  # fmt: skip


def skypilot_env(node: int, gpus: int = 0) -> dict[str, str]:
    """What SkyPilot sets for `run:` on node `node` of a 2-node task."""
    return {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NODE_IPS": IPS,
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus), "SKYPILOT_TASK_ID": "sky-2026-12-04-1_x_1",
            "SKYPILOT_CLUSTER_INFO": "{}"}  # fmt: skip


def _launch(env: dict[str, str], **typed) -> tuple[str, list[str], str]:
    mode = decide(env, LaunchFlags(**typed))
    return mode.kind, launch_overrides(mode.flags), mode.describe()


# One environment a line: (platform, environment, typed flags, kind, overrides that must be there,
# launch.* keys that must not).
MODES = [
    ("none", {}, {}, "launcher", [], ["launch.nnodes", "launch.rdzv_endpoint"]),
    ("torchrun's worker in a TrainJob pod (PET_* inherited)",
     {**trainjob_env(1, 2, 29500), "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, {},
     "torchrun", [], ["launch.nnodes"]),
    ("TrainJob", trainjob_env(1, 8, 29500), {}, "pet",
     ["launch.nnodes=2", "launch.node_rank=1", "launch.nproc_per_node=8",
      f"launch.rdzv_endpoint={TRAINJOB_MASTER}:29500"], []),
    ("TrainJob, one node: loopback, not node 0's service",
     {**trainjob_env(0, 8, 29500), "PET_NNODES": "1"}, {}, "pet",
     ["launch.nnodes=1", "launch.node_rank=0"], ["launch.rdzv_endpoint"]),
    ("TrainJob, flags win one by one", trainjob_env(1, 8, 29500),
     {"nproc_per_node": "2", "node_rank": 0, "rdzv_endpoint": "h:1"}, "pet",
     ["launch.nnodes=2", "launch.node_rank=0", "launch.nproc_per_node=2",
      "launch.rdzv_endpoint=h:1"], []),
    ("TrainJob, a typed --standalone is one node", trainjob_env(1, 8, 29500),
     {"standalone": True}, "pet",
     ["launch.nnodes=1", "launch.node_rank=0", "launch.rdzv_endpoint=",
      "launch.nproc_per_node=8"], []),
    ("PyTorchJob: pod-level RANK/WORLD_SIZE never ranks", pytorchjob_env(1, 8, 23456), {}, "pet",
     ["launch.nnodes=2", "launch.node_rank=1", "launch.nproc_per_node=8",
      f"launch.rdzv_endpoint={PYTORCHJOB_MASTER}:23456"], []),
    ("PyTorchJob, elastic policy with min = max",
     {**pytorchjob_env(0, 8, 23456), "PET_RDZV_ENDPOINT": "fsdprun-worker-0:23456",
      "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "job-7", "PET_MAX_RESTARTS": "3",
      "PET_STANDALONE": ""}, {}, "pet",
     ["launch.rdzv_endpoint=fsdprun-worker-0:23456", "launch.rdzv_id=job-7",
      "launch.max_restarts=3"], []),
    ("SkyPilot GPU node", skypilot_env(1, gpus=8), {}, "skypilot",
     ["launch.nnodes=2", "launch.node_rank=1", "launch.nproc_per_node=8"], []),
    ("SkyPilot CPU node, the task's envs export MASTER_PORT",
     {**skypilot_env(0), "MASTER_PORT": "29511"}, {}, "skypilot",
     ["launch.nnodes=2", "launch.node_rank=0", "launch.rdzv_endpoint=127.0.0.1:29511"],
     ["launch.nproc_per_node"]),
    ("srun task (one of 4 on 2 nodes)",
     {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
      "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n[1-2]",
      "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n2"}, {}, "srun", [], []),
]  # fmt: skip


@pytest.mark.parametrize(("platform", "env", "typed", "kind", "present", "absent"), MODES,
                         ids=[m[0] for m in MODES])  # fmt: skip
def test_launch_mode_from_each_platforms_environment(platform, env, typed, kind, present, absent):
    got_kind, overrides, described = _launch(env, **typed)
    assert got_kind == kind
    for item in present:
        assert item in overrides, (item, overrides)
    for key in absent:
        assert not any(o.startswith(key + "=") for o in overrides), (key, overrides)
    if "RANK" in env and kind == "pet":  # the header says the pod-level ones were left alone
        assert f"pod-level RANK={env['RANK']}, WORLD_SIZE={env['WORLD_SIZE']} not used" in described


def test_skypilot_port_is_the_same_on_every_node_and_comes_from_the_task():
    """SkyPilot sets no port: without MASTER_PORT, both nodes derive the same one from
    SKYPILOT_TASK_ID, below Linux's ephemeral range; another task gets another."""
    endpoints = [
        next(o for o in _launch(skypilot_env(n))[1] if o.startswith("launch.rdzv_endpoint="))
        for n in (0, 1)
    ]
    assert endpoints[0] == endpoints[1]
    port = int(endpoints[0].rpartition(":")[2])
    assert PORT_BASE <= port < PORT_BASE + PORT_SPAN
    other = _launch({**skypilot_env(0), "SKYPILOT_TASK_ID": "sky-other"})[1]
    assert f"launch.rdzv_endpoint=127.0.0.1:{port}" not in other


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({**pytorchjob_env(0, 8, 23456), "PET_NNODES": "1:4"},
         ["PET_NNODES=1:4: fsdprun runs a fixed number of nodes", "give --nnodes 4"]),
        ({**trainjob_env(0, 8, 29500), "PET_NODE_RANK": "first"},
         ["PET_NODE_RANK='first': expected a whole number"]),
        ({**trainjob_env(0, 8, 29500), "PET_STANDALONE": "1"},
         ["PET_STANDALONE=1 is one node", "PET_NNODES=2"]),
        ({**trainjob_env(0, 8, 29500), "PET_RDZV_BACKEND": "etcd"},
         ["PET_RDZV_BACKEND=etcd: fsdprun's rendezvous is always c10d"]),
        ({"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "w-0:1"}, ["PET_NNODES=2 but no node rank"]),
        ({**skypilot_env(0), "SKYPILOT_TASK_ID": ""}, ["export MASTER_PORT in the task's"]),
    ],
    ids=["min:max", "bad rank", "standalone", "etcd", "no rank", "no port"],
)  # fmt: skip
def test_an_environment_fsdprun_cannot_use_is_one_line_naming_the_variable(env, fragments):
    result = CliRunner().invoke(app, ["train", "debug"], env=env)
    assert_one_line_error(result, *fragments)


def test_resume_and_tune_in_a_pytorchjob_pod_are_its_launcher_not_a_worker(tmp_path):
    """A PyTorchJob's pod-level RANK made `fsdprun resume` and `fsdprun tune` refuse, as if they
    ran under torchrun: they are the pod's launcher."""
    env = pytorchjob_env(1, 1, 23456)
    resumed = CliRunner().invoke(app, ["resume", str(tmp_path / "run")], env=env)
    assert_one_line_error(resumed, "not an fsdprun run directory")
    tuned = CliRunner().invoke(app, ["tune", "debug", "--out", str(tmp_path / "o"), "--dry-run",
                                     "--device-memory", "1GB", "--json"], env=env)  # fmt: skip
    assert tuned.exit_code == 0, tuned.output


# ------------------------------------------------------------------------------------------------
# Two "nodes" on this machine.


def _start(
    tmp_path: Path, envs: list[dict[str, str]], *args: str, flags=lambda node: []
) -> list[subprocess.Popen]:
    """One `fsdprun train debug ARGS FLAGS(N) --run-dir nodeN` per environment, output to
    nodeN.out/err; node 1 first, node 0 once node 1 waits (for node 0's name or its rendezvous):
    torch's c10d rendezvous gave the first comer of one host name global rank 0."""
    fsdprun = zygote_command(tmp_path)
    procs: dict[int, subprocess.Popen] = {}
    for node in reversed(range(len(envs))):
        out, err = (open(tmp_path / f"node{node}.{k}", "w") for k in ("out", "err"))  # noqa: SIM115
        run_dir = str(tmp_path / f"node{node}")
        procs[node] = subprocess.Popen(
            [fsdprun, "train", "debug", *args, *flags(node), "--run-dir", run_dir],
            cwd=tmp_path, env=fsdprun_env(**envs[node]), stdout=out, stderr=err, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while node and "waiting" not in _output(tmp_path, node):
            assert procs[node].poll() is None and time.monotonic() < deadline, _output(
                tmp_path, node
            )
            time.sleep(0.1)
    return [procs[node] for node in range(len(envs))]


def _output(tmp_path: Path, node: int) -> str:
    return "".join((tmp_path / f"node{node}.{k}").read_text() for k in ("out", "err"))


def _trained(tmp_path: Path, procs: list[subprocess.Popen]) -> Run:
    """The job both nodes ran, as global rank 0 recorded it: on node 0 (node 1 started first),
    which keeps metrics.jsonl and prints the run's step lines and summary."""
    for node, proc in enumerate(procs):
        assert proc.wait(timeout=300) == 0, _output(tmp_path, node)[-3000:]
    run = Run(None, tmp_path / "node0")
    assert run.events and not (tmp_path / "node1" / "metrics.jsonl").exists()
    assert re.search(r"^step 6 \|.*\n(.*\n)*final loss", _output(tmp_path, 0), re.M)
    assert run.start["nnodes"] == 2
    return run


# Each platform's job: 2 nodes x 2 ranks (the debug recipe's), micro batch 1: 2 accumulation steps.
JOB = (*BASE, "train.micro_batch_size=1", "launch.rdzv_timeout_s=120")


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory) -> Run:
    """The same job started by hand on two "nodes", with no platform's variable:
    `--nnodes 2 --nproc-per-node 2 --node-rank N --rdzv-endpoint HOST:PORT`."""
    root = tmp_path_factory.mktemp("by-hand")
    endpoint = f"127.0.0.1:{free_port()}"
    procs = _start(root, [{}, {}], *JOB, flags=lambda node: [
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
        "--rdzv-endpoint", endpoint])  # fmt: skip
    run = _trained(root, procs)
    assert (run.start["world_size"], run.start["grad_accum_steps"]) == (4, 2)
    assert "launch: fsdprun's launcher\n" in _output(root, 0)
    return run


def test_trainjob_waits_for_node_0s_name_then_trains_2_nodes_x_2_ranks(by_hand, tmp_path):
    """Kubeflow Trainer v2's environment, node 0's service name not resolving yet: both nodes
    say what they wait for, the name starts to resolve, and 2 nodes x 2 ranks train the job."""
    port, hosts = free_port(), tmp_path / "hosts"
    test_only = {"FSDPRUN_TEST_HOSTS": str(hosts)}
    procs = _start(tmp_path, [{**trainjob_env(n, 2, port), **test_only} for n in (0, 1)], *JOB)
    deadline = time.monotonic() + 120
    waiting = f"waiting for the rendezvous host {TRAINJOB_MASTER} to resolve"
    while not all(waiting in _output(tmp_path, n) for n in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            _output(tmp_path, n) for n in (0, 1)
        ]
        time.sleep(0.2)
    hosts.write_text(f"127.0.0.1 {TRAINJOB_MASTER}\n")  # node 0's pod is up
    run = _trained(tmp_path, procs)
    assert (run.start["world_size"], run.start["grad_accum_steps"]) == (4, 2)
    assert_same_losses(by_hand, run)
    out = _output(tmp_path, 0)  # node 0's launcher prints the run (its header and steps)
    assert "launch: each node's launcher, from torchrun's PET_* variables" in out
    assert f"PET_MASTER_ADDR={TRAINJOB_MASTER}, PET_MASTER_PORT={port}" in out


def test_a_node_0_name_that_never_resolves_gives_up_in_one_line(tmp_path):
    """A TrainJob whose node 0 never comes up: node 1 waits for its name, saying so, then gives
    up at the rendezvous timeout in one line (exit 2) and has written nothing."""
    timeout_s = 2
    proc = run_fsdprun("train", "debug", f"launch.rdzv_timeout_s={timeout_s}", "--run-dir",
                       str(tmp_path / "run"), cwd=tmp_path,
                       env=fsdprun_env(**trainjob_env(1, 1, free_port())))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"waiting for the rendezvous host {TRAINJOB_MASTER} to resolve")
    assert proc.stderr.strip() == (
        f"error: the rendezvous host {TRAINJOB_MASTER} did not resolve within "
        f"launch.rdzv_timeout_s={timeout_s}: check the name (node 0's host, or its pod's "
        "service) and that node 0 runs, or raise launch.rdzv_timeout_s"
    )
    assert not (tmp_path / "run").exists()


def test_pytorchjob_pods_rank_and_world_size_are_not_ranks(by_hand, tmp_path):
    """A PyTorchJob's pods, 2 x 2 ranks: RANK and WORLD_SIZE of the pods beside PET_*; the
    Master's service name (resolving from the start here) and port in MASTER_ADDR/MASTER_PORT."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 {PYTORCHJOB_MASTER}\n")
    port = free_port()
    envs = [{**pytorchjob_env(n, 2, port), "FSDPRUN_TEST_HOSTS": str(hosts)} for n in (0, 1)]
    run = _trained(tmp_path, _start(tmp_path, envs, *JOB))
    assert run.start["world_size"] == 4
    assert_same_losses(by_hand, run)
    # The header is node 0's, the Master pod's: its launcher runs global rank 0. v1.9's
    # PET_MASTER_* name the rendezvous.
    header = _output(tmp_path, 0)
    assert "pod-level RANK=0, WORLD_SIZE=4 not used (they count pods)" in header
    assert f"PET_MASTER_ADDR={PYTORCHJOB_MASTER}, PET_MASTER_PORT={port}" in header


def test_skypilot_nodes_train_and_a_lost_node_fails_the_other(by_hand, tmp_path):
    """SkyPilot's variables (CPU nodes: SKYPILOT_NUM_GPUS_PER_NODE=0, the recipe's 2 ranks each;
    MASTER_PORT from the task's envs) train the job. Then a second job, 1 rank a node: node 0
    killed mid-run (its pod gone) makes node 1 exit non-zero well within the rendezvous
    timeout."""
    port = free_port()
    envs = [{**skypilot_env(n), "MASTER_PORT": str(port)} for n in (0, 1)]
    run = _trained(tmp_path / "a", _start(_mkdir(tmp_path / "a"), envs, *JOB))
    assert run.start["world_size"] == 4
    assert_same_losses(by_hand, run)
    assert "launch: each node's launcher, from SkyPilot's SKYPILOT_* variables" in _output(
        tmp_path / "a", 0
    ) + _output(tmp_path / "a", 1)

    timeout_s = 30
    port = free_port()
    envs = [{**skypilot_env(n), "MASTER_PORT": str(port)} for n in (0, 1)]
    root = _mkdir(tmp_path / "b")
    procs = _start(root, envs, "train.steps=500", "output.log_every=1", "launch.nproc_per_node=1",
                   f"launch.rdzv_timeout_s={timeout_s}")  # fmt: skip
    deadline = time.monotonic() + 120
    while not re.search(r"^step 2 \|", _output(root, 0) + _output(root, 1), re.M):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            _output(root, n) for n in (0, 1)
        ]
        time.sleep(0.1)
    procs[0].send_signal(signal.SIGKILL)  # node 0, which hosts the rendezvous store
    killed = time.monotonic()
    code = procs[1].wait(timeout=timeout_s + 30)
    assert code == 1 and time.monotonic() - killed < timeout_s, _output(root, 1)[-3000:]
    [line] = (root / "node1.err").read_text().strip().splitlines()
    assert line.startswith("error: ") and ("lost node 0" in line or "lost the connection" in line)
    procs[0].wait(timeout=30)


def test_trainjob_shared_volume_example_is_one_command_for_every_start(tmp_path):
    """examples/kubernetes/trainjob-shared-volume.yaml's command as Trainer runs it in each pod
    (PET_* set; the shared volume: one folder both "nodes" see), the same command each time the
    job is applied: a crash before any checkpoint (exit 1); the job again trains from step 0,
    the crash's logs kept, and deleting it (SIGTERM to each pod's first process) stops both
    nodes at one agreed step with a checkpoint (exit 143); the job again resumes there and
    finishes the run; once more, it has nothing to do (exit 0). `fsdprun train` refused the
    second start ("already holds a run"), exit 2 on every retry."""
    doc = yaml.safe_load((EXAMPLES / "kubernetes/trainjob-shared-volume.yaml").read_text())
    command = doc["spec"]["trainer"]["command"]
    volume = tmp_path / "volume"
    run_dir = volume / "llama-8b"
    # The example's recipe and volume, made small for this machine (its checkpoint.every_steps
    # saves nothing in 12 steps: only a stop or the end does).
    argv = [a.replace("/runs/", f"{volume}/") for a in command]
    argv[argv.index("llama-8b")] = "debug"
    argv += ["train.steps=12", "output.log_every=1"]
    assert argv[:3] == ["fsdprun", "train", "debug"] and "--resume" in argv, argv
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 {TRAINJOB_MASTER}\n")
    bin_dir = Path(zygote_command(tmp_path)).parent  # `fsdprun` on PATH, through the zygote

    def apply(**extra: str) -> list[subprocess.Popen]:
        port = free_port()
        return [subprocess.Popen(
            argv, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=fsdprun_env(**trainjob_env(n, 1, port), FSDPRUN_TEST_HOSTS=str(hosts),
                            PATH=f"{bin_dir}:{os.environ['PATH']}", **extra),
        ) for n in (0, 1)]  # fmt: skip

    def finish(pods: list[subprocess.Popen]) -> list[str]:
        try:
            return [pod.communicate(timeout=300)[0] for pod in pods]
        except subprocess.TimeoutExpired:  # say what each pod said, not only that one hung
            for pod in pods:
                pod.kill()
            pytest.fail(f"a pod hung: {[p.communicate()[0] for p in pods]}")

    def starts() -> int:
        return sum(e["event"] == "start" for e in Run(None, run_dir).events)

    pods = apply(FSDPRUN_FAIL_AT="1:3")  # rank 1 (node 1) fails at step 3: nothing saved
    outputs = finish(pods)
    assert all(pod.returncode == 1 for pod in pods), outputs
    assert not list_checkpoints(run_dir) and [e["step"] for e in Run(None, run_dir).steps] == [1, 2]

    pods = apply()  # the same TrainJob again
    deadline = time.monotonic() + 120
    while starts() < 2 or Run(None, run_dir).events[-1]["event"] != "step":
        assert time.monotonic() < deadline and all(p.poll() is None for p in pods)
        time.sleep(0.05)
    for pod in pods:
        pod.send_signal(signal.SIGTERM)  # kubectl delete: every pod's first process
    outputs = finish(pods)
    assert [pod.returncode for pod in pods] == [143, 143], outputs
    assert all("holds no complete checkpoint: training again from step 0" in o for o in outputs)
    assert "the earlier sessions' metrics kept as metrics.earlier-1.jsonl" in outputs[0]
    earlier = read_events(run_dir / "metrics.earlier-1.jsonl")  # the crashed session's, kept
    assert [e["step"] for e in earlier if e["event"] == "step"] == [1, 2]
    assert earlier[-1]["event"] == "failed"
    [saved] = [c for c in list_checkpoints(run_dir) if c.complete][-1:]
    assert saved.step < 12

    pods = apply()  # and again
    outputs = finish(pods)
    assert [pod.returncode for pod in pods] == [0, 0], outputs
    assert all(f"resuming {run_dir} from step-{saved.step:08d}" in out for out in outputs)
    assert re.search(r"^step 12 \|", outputs[0], re.M)  # node 0 prints the run
    run = Run(None, run_dir)
    assert [e["step"] for e in run.steps] == list(range(1, 13))
    assert any(e["event"] == "resume" for e in run.events)

    pods = apply()  # a finished run: nothing to do, and nothing written
    outputs = finish(pods)
    assert [pod.returncode for pod in pods] == [0, 0], outputs
    assert all(f"{run_dir} finished its 12 steps; nothing to train" in out for out in outputs)
    assert Run(None, run_dir).events == run.events


def test_nodes_that_disagree_on_the_node_count_each_say_so(tmp_path):
    """PET_NNODES 2 on node 0 and 3 on node 1 (a TrainJob edited between two pods' starts): each
    node says, in one line (exit 2), that the nodes disagree on the node count, naming each
    node's variable. Node 0 said "2 of 2 nodes joined ...", node 1 "2 of 3" or torch's raw
    "Failed to recv"."""
    port = free_port()
    envs = [{**trainjob_env(n, 1, port), "PET_MASTER_ADDR": "127.0.0.1"} for n in (0, 1)]
    envs[1]["PET_NNODES"] = "3"
    # A global batch that 2 and 3 ranks both divide: each node's recipe is valid on its own.
    procs = _start(tmp_path, envs, "train.global_batch_size=6", "train.micro_batch_size=1",
                   "launch.rdzv_timeout_s=60")  # fmt: skip
    said = (
        "error: the nodes disagree on the node count: node 0 has PET_NNODES=2, node 1 has "
        "PET_NNODES=3; start every node of the job with the same number of nodes"
    )
    for node, proc in enumerate(procs):
        assert proc.wait(timeout=120) == 2, _output(tmp_path, node)
        assert (tmp_path / f"node{node}.err").read_text().strip() == said


def test_what_the_nodes_disagree_on_is_named_with_each_nodes_value():
    from fsdprun.launch.rendezvous import NodeFacts, disagreement

    def node(rank: int, nnodes: int, source: str = "PET_NNODES", host: str = "h") -> NodeFacts:
        return NodeFacts(f"{host}{rank}{nnodes}", host, rank, nnodes, source)

    assert disagreement([node(0, 2), node(1, 2)]) is None
    assert disagreement([node(0, 2)]) is None  # alone so far
    assert disagreement([node(1, 4, "--nnodes"), node(0, 2)]) == (
        "the nodes disagree on the node count: node 0 has PET_NNODES=2, node 1 has --nnodes 4; "
        "start every node of the job with the same number of nodes"
    )
    assert disagreement([node(0, 2, host="a"), node(0, 2, host="b")]) == (
        "two nodes have node rank 0 (a, b): give each node of the job its own node rank, 0 to 1"
    )


def test_train_resume_auto_refuses_only_another_recipe(tmp_path):
    """`--resume auto` over a run directory of another recipe (a key a resume could not change)
    is refused in one line naming the key; without it, any earlier run is refused. Under
    torchrun's variables (each rank its own launcher) it is refused too."""
    from fsdprun.config import load_recipe
    from fsdprun.launch.elastic import write_recipe

    run_dir = tmp_path / "run"
    write_recipe(run_dir, load_recipe("debug"))
    (run_dir / "metrics.jsonl").write_text("")  # a run began here
    other = run_fsdprun("train", "debug", "model.dim=32", "--run-dir", str(run_dir), "--resume",
                        "auto", cwd=tmp_path)  # fmt: skip
    assert other.returncode == 2, other.stdout + other.stderr
    assert other.stderr.strip() == (
        f"error: {run_dir} holds a run of another recipe (model.dim: 64 there, 32 here); "
        f"choose another --run-dir, or continue that run with `fsdprun resume {run_dir}`"
    )
    plain = run_fsdprun("train", "debug", "--run-dir", str(run_dir), cwd=tmp_path)
    assert plain.returncode == 2 and "already holds a run" in plain.stderr
    worker = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    result = CliRunner().invoke(app, ["train", "debug", "--resume", "auto"], env=worker)
    assert_one_line_error(result, "--resume auto is fsdprun's launcher's")


def _platform_table(doc: str, heading: str) -> set[str]:
    """The variables named in the first column of the table under `heading` of cluster.md."""
    section = doc.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z_]+)`", row.split("|")[1])}


def test_cluster_docs_name_every_variable_each_platform_sets():
    """docs/cluster.md's table for each platform names every variable the platform sets (the
    environments these tests start the nodes with): its PyTorchJob table lacked v1.9's
    PET_MASTER_ADDR and PET_MASTER_PORT."""
    doc = (EXAMPLES.parent / "docs" / "cluster.md").read_text()
    tables = {
        "### Kubeflow Trainer v2 (TrainJob)": trainjob_env(0, 8, 29500),
        "### PyTorchJob (training-operator v1)": pytorchjob_env(0, 8, 23456),
        "### SkyPilot": skypilot_env(0),
    }
    for heading, env in tables.items():
        named = _platform_table(doc, heading)
        assert set(env) - {"PYTHONUNBUFFERED", "SKYPILOT_CLUSTER_INFO"} <= named, heading


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# ------------------------------------------------------------------------------------------------
# The shipped manifests name only fields of their platform's published API (2026): Kubeflow
# Trainer v2.2+ (trainer.kubeflow.org/v1alpha1, pkg/apis/trainer/v1alpha1/trainjob_types.go;
# terminationGracePeriodSeconds in a runtime patch from v2.3), training-operator v1
# (kubeflow.org/v1 PyTorchJob), Kubernetes core/v1 for what they embed (a PersistentVolumeClaim),
# and SkyPilot's task YAML (docs.skypilot.co, reference/yaml-spec). ANY: a free-form map or
# value.

ANY = object()
META = {"name": None, "namespace": None, "labels": ANY, "annotations": ANY}
ENV_VAR = {"name": None, "value": None, "valueFrom": ANY}
RESOURCES = {"limits": ANY, "requests": ANY, "claims": ANY}
VOLUME_MOUNT = {"name": None, "mountPath": None, "subPath": None, "readOnly": None}
VOLUME = {"name": None, "persistentVolumeClaim": {"claimName": None, "readOnly": None},
          "emptyDir": {"medium": None, "sizeLimit": None}, "nfs": ANY, "hostPath": ANY,
          "configMap": ANY, "secret": ANY}  # fmt: skip
CONTAINER = {"name": None, "image": None, "command": [None], "args": [None], "env": [ENV_VAR],
             "ports": [{"name": None, "containerPort": None, "protocol": None}],
             "resources": RESOURCES, "volumeMounts": [VOLUME_MOUNT], "workingDir": None,
             "imagePullPolicy": None, "securityContext": ANY}  # fmt: skip
POD_SPEC = {"containers": [CONTAINER], "initContainers": [CONTAINER], "volumes": [VOLUME],
            "terminationGracePeriodSeconds": None, "restartPolicy": None, "nodeSelector": ANY,
            "tolerations": [ANY], "affinity": ANY, "serviceAccountName": None,
            "imagePullSecrets": [ANY], "securityContext": ANY, "hostNetwork": None}  # fmt: skip
CONTAINER_PATCH = {"name": None, "env": [ENV_VAR], "volumeMounts": [VOLUME_MOUNT],
                   "securityContext": ANY}  # fmt: skip
POD_SPEC_PATCH = {"serviceAccountName": None, "volumes": [VOLUME],
                  "initContainers": [CONTAINER_PATCH], "containers": [CONTAINER_PATCH],
                  "imagePullSecrets": [ANY], "securityContext": ANY, "nodeSelector": ANY,
                  "affinity": ANY, "tolerations": [ANY], "schedulingGates": [ANY],
                  "terminationGracePeriodSeconds": None}  # fmt: skip
PATCH_META = {"labels": ANY, "annotations": ANY}
TRAINJOB = {
    "apiVersion": None, "kind": None, "metadata": META,
    "spec": {
        "runtimeRef": {"name": None, "apiGroup": None, "kind": None},
        "initializer": ANY,
        "trainer": {"image": None, "command": [None], "args": [None], "env": [ENV_VAR],
                    "numNodes": None, "numProcPerNode": None, "resourcesPerNode": RESOURCES},
        "runtimePatches": [{"manager": None, "trainingRuntimeSpec": {"template": {
            "metadata": PATCH_META, "spec": {"replicatedJobs": [{"name": None, "template": {
                "metadata": PATCH_META, "spec": {"template": {
                    "metadata": PATCH_META, "spec": POD_SPEC_PATCH}}}}]}}}}],
        "suspend": None, "activeDeadlineSeconds": None, "managedBy": None,
    },
}  # fmt: skip
REPLICA = {"replicas": None, "restartPolicy": None,
           "template": {"metadata": META, "spec": POD_SPEC}}  # fmt: skip
PYTORCHJOB = {
    "apiVersion": None, "kind": None, "metadata": META,
    "spec": {
        "runPolicy": {"cleanPodPolicy": None, "ttlSecondsAfterFinished": None,
                      "activeDeadlineSeconds": None, "backoffLimit": None,
                      "schedulingPolicy": ANY, "suspend": None, "managedBy": None},
        "elasticPolicy": {"minReplicas": None, "maxReplicas": None, "rdzvBackend": None,
                          "rdzvPort": None, "rdzvHost": None, "rdzvId": None, "rdzvConf": ANY,
                          "standalone": None, "nProcPerNode": None, "maxRestarts": None,
                          "metrics": ANY},
        "nprocPerNode": None,
        "pytorchReplicaSpecs": {"Master": REPLICA, "Worker": REPLICA},
    },
}  # fmt: skip
SKYPILOT = {
    "name": None, "workdir": None, "num_nodes": None, "envs": ANY, "secrets": ANY,
    "file_mounts": ANY, "volumes": ANY, "setup": None, "run": None, "config": ANY,
    "resources": {"infra": None, "cloud": None, "region": None, "zone": None,
                  "accelerators": None, "accelerator_args": ANY, "cpus": None, "memory": None,
                  "instance_type": None, "use_spot": None, "disk_size": None, "disk_tier": None,
                  "network_tier": None, "max_hourly_cost": None, "image_id": None, "ports": ANY,
                  "labels": ANY, "autostop": ANY, "any_of": ANY, "ordered": ANY,
                  "job_recovery": ANY},
}  # fmt: skip
PVC = {
    "apiVersion": None, "kind": None, "metadata": META,
    "spec": {"accessModes": [None], "storageClassName": None, "volumeMode": None,
             "resources": {"requests": ANY, "limits": ANY}, "selector": ANY,
             "volumeName": None, "dataSource": ANY},
}  # fmt: skip
MANIFESTS = {
    "kubernetes/trainjob.yaml": ("trainer.kubeflow.org/v1alpha1", "TrainJob", TRAINJOB),
    "kubernetes/trainjob-shared-volume.yaml": (
        "trainer.kubeflow.org/v1alpha1", "TrainJob", TRAINJOB),
    "kubernetes/pytorchjob.yaml": ("kubeflow.org/v1", "PyTorchJob", PYTORCHJOB),
    "kubernetes/pytorchjob-shared-volume.yaml": ("kubeflow.org/v1", "PyTorchJob", PYTORCHJOB),
    "kubernetes/pvc.yaml": ("v1", "PersistentVolumeClaim", PVC),
    "kubernetes/shell.yaml": ("v1", "Pod", {"apiVersion": None, "kind": None, "metadata": META,
                                            "spec": POD_SPEC}),
    "skypilot/train.yaml": (None, None, SKYPILOT),
}  # fmt: skip
# The jobs that keep their run directory on the claim of pvc.yaml (the others: a pod's disk).
SHARED = ("kubernetes/trainjob-shared-volume.yaml", "kubernetes/pytorchjob-shared-volume.yaml",
          "skypilot/train.yaml")  # fmt: skip
LAUNCH_FLAGS = [f"--{f.replace('_', '-')}" for f in LaunchFlags.__dataclass_fields__
                if f != "sources"]  # fmt: skip


def _unknown_fields(doc, schema, path: str = "") -> list[str]:
    """The paths in `doc` that `schema` does not name."""
    if schema is ANY or schema is None:
        return [] if schema is ANY or not isinstance(doc, (dict, list)) else [f"{path} (nested)"]
    if isinstance(schema, list):
        assert isinstance(doc, list), path
        return [bad for i, item in enumerate(doc)
                for bad in _unknown_fields(item, schema[0], f"{path}[{i}]")]  # fmt: skip
    assert isinstance(doc, dict), path
    return [bad for key, value in doc.items()
            for bad in ([f"{path}.{key}"] if key not in schema
                        else _unknown_fields(value, schema[key], f"{path}.{key}"))]  # fmt: skip


def _commands(name: str, doc: dict) -> list[list[str]]:
    """The argv of each `fsdprun` the manifest runs."""
    if name.startswith("skypilot/"):
        return [shlex.split(doc["run"])]
    if doc["kind"] == "TrainJob":
        trainer = doc["spec"]["trainer"]
        return [[*trainer["command"], *trainer.get("args", [])]]
    return [[*c["command"], *c.get("args", [])]
            for r in doc["spec"]["pytorchReplicaSpecs"].values()
            for c in r["template"]["spec"]["containers"]]  # fmt: skip


def _pods(doc: dict) -> list[tuple[dict, dict, list[dict]]]:
    """(pod spec, fsdprun's container, its env) of each kind of pod a Kubernetes job makes: a
    TrainJob's from its runtime patch of the `node` job (the trainer's env beside it)."""
    if doc["kind"] == "PyTorchJob":
        return [(spec, c, c.get("env", [])) for r in doc["spec"]["pytorchReplicaSpecs"].values()
                for spec in [r["template"]["spec"]] for c in spec["containers"]]  # fmt: skip
    [patch] = doc["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    spec = node["template"]["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert (node["name"], container["name"]) == ("node", "node")  # torch-distributed's names
    return [(spec, container, doc["spec"]["trainer"].get("env", []))]


def _mounted(spec: dict, container: dict, path: str) -> dict:
    """The volume `container` mounts at `path`."""
    [mount] = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume


def test_shipped_manifests_name_only_their_platforms_fields_and_no_launch_flag():
    assert sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.glob("*/*.yaml")) == sorted(
        MANIFESTS
    )
    for name, (api_version, kind, schema) in MANIFESTS.items():
        doc = yaml.safe_load((EXAMPLES / name).read_text())
        if kind is not None:
            assert (doc["apiVersion"], doc["kind"]) == (api_version, kind), name
        assert _unknown_fields(doc, schema) == [], name
        text = yaml.safe_dump(doc)
        assert "PET_" not in text, name  # Kubeflow Trainer's webhook rejects a user's PET_*
    trainjob = yaml.safe_load((EXAMPLES / "kubernetes/trainjob.yaml").read_text())["spec"]
    assert (trainjob["runtimeRef"]["name"], trainjob["trainer"]["numNodes"],
            trainjob["trainer"]["numProcPerNode"]) == ("torch-distributed", 2, 8)  # fmt: skip
    # The operator finds MASTER_PORT as the Master's container `pytorch`, port `pytorchjob-port`.
    job = yaml.safe_load((EXAMPLES / "kubernetes/pytorchjob.yaml").read_text())["spec"]
    [master] = job["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert (master["name"], master["ports"][0]["name"]) == ("pytorch", "pytorchjob-port")


def test_shipped_jobs_run_the_repeatable_command_with_a_cluster_runs_defaults():
    """Every job's command is the one that is safe to repeat (`train RECIPE ... --resume auto`,
    no launch flag, keys `fsdprun config` accepts, checkpoint.every_steps set); every Kubernetes
    pod has a memory /dev/shm; the shared-volume jobs keep the run directory, the compile cache
    and HF_HOME on the claim pvc.yaml ships (ReadWriteMany) and give the stop's save a grace
    period (a TrainJob's through runtimePatches); nothing installs a `fsdprun` from an index."""
    claim = yaml.safe_load((EXAMPLES / "kubernetes/pvc.yaml").read_text())
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for name in MANIFESTS:
        text = (EXAMPLES / name).read_text()
        assert "pip install fsdprun" not in text, name  # not published: the image, or the wheel
        doc = yaml.safe_load(text)
        if doc.get("kind") == "Pod":  # the shell on the volume
            [shell] = doc["spec"]["containers"]
            runs = _mounted(doc["spec"], shell, "/runs")["persistentVolumeClaim"]
            assert runs["claimName"] == claim["metadata"]["name"]
        if doc.get("kind") in ("PersistentVolumeClaim", "Pod"):
            continue
        for argv in _commands(name, doc):
            assert argv[:2] == ["fsdprun", "train"] and argv[-2:] == ["--resume", "auto"], argv
            assert not [f for f in LAUNCH_FLAGS if f in argv], (name, argv)
            overrides = [a for a in argv[3:] if "=" in a and not a.startswith("-")]
            assert any(o.startswith("checkpoint.every_steps=") for o in overrides), argv
            checked = CliRunner().invoke(app, ["config", argv[2], *overrides])
            assert checked.exit_code == 0, (name, checked.output)
            run_dir = argv[argv.index("--run-dir") + 1]
            if name in SHARED:
                assert run_dir.startswith("/runs/"), argv
                assert "compile.cache_dir=/runs/compile-cache" in overrides, argv
        if name.startswith("skypilot/"):
            assert doc["envs"]["HF_HOME"].startswith("/runs/") and "/runs" in doc["file_mounts"]
            continue
        for spec, container, env in _pods(doc):
            assert _mounted(spec, container, "/dev/shm")["emptyDir"]["medium"] == "Memory", name
            if name in SHARED:
                runs = _mounted(spec, container, "/runs")["persistentVolumeClaim"]
                assert runs["claimName"] == claim["metadata"]["name"], name
                assert {"name": "HF_HOME", "value": "/runs/hf"} in env, name
                assert spec["terminationGracePeriodSeconds"] >= 120, name


def test_nodes_sharing_the_run_directory_write_its_recipe_without_a_gap(tmp_path):
    """Every node of a resumed multi-node run writes RUN_DIR/recipe.yaml, and on a shared volume
    (trainjob-shared-volume.yaml) they do it at once while `fsdprun resume` on another node reads
    it: recipe.yaml is never missing (it was renamed away, then written: a node resolving the
    run in between failed, and the other waited out the rendezvous), no node fails, and the
    earlier recipe is kept once."""
    from fsdprun.config import load_recipe
    from fsdprun.launch.elastic import write_recipe
    from fsdprun.rundir import recipe_path

    old, new = load_recipe("debug"), load_recipe("debug", ["train.steps=12"])
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave as finely as two nodes' processes would
    try:
        for trial in range(40):
            run_dir = _mkdir(tmp_path / f"run{trial}")
            write_recipe(run_dir, old)
            first = recipe_path(run_dir).read_text()
            start, errors, gaps = threading.Barrier(3), [], []

            def node(start=start, errors=errors, run_dir=run_dir):
                start.wait()
                try:
                    write_recipe(run_dir, new)
                except Exception as e:  # noqa: BLE001 - what a node would die of
                    errors.append(e)

            def reader(start=start, gaps=gaps, run_dir=run_dir):
                start.wait()
                for _ in range(200):
                    if not recipe_path(run_dir).exists():
                        gaps.append(1)

            threads = [threading.Thread(target=f) for f in (node, node, reader)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors and not gaps, (trial, errors, gaps)
            names = sorted(p.name for p in run_dir.iterdir() if p.suffix == ".yaml")
            assert names == ["recipe.1.yaml", "recipe.yaml"], (trial, names)
            assert (run_dir / "recipe.1.yaml").read_text() == first
            assert "steps: 12" in recipe_path(run_dir).read_text()
    finally:
        sys.setswitchinterval(switch)
