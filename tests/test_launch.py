"""Launch arguments, device selection errors, the report rendering, and running under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Run, free_port, fsdprun_env, run_fsdprun, start_fsdprun, zygote_command
from rich.console import Console

from fsdprun.checkpoint import list_checkpoints
from fsdprun.config import load_recipe
from fsdprun.device import BACKENDS, check_nproc, process_group_backend, resolve_device_kind
from fsdprun.errors import UserError
from fsdprun.launch.elastic import build_launch_plan
from fsdprun.launch.rendezvous import NODE_RANK_CONF, NODES_BACKEND
from fsdprun.loopback import RDZV_BACKEND
from fsdprun.models import model_spec
from fsdprun.report.console import Reporter
from fsdprun.tools.plan import CPU_FLOPS_PER_CORE, hardware_warnings, plan_memory


def test_single_node_binds_loopback_and_multi_node_uses_the_given_endpoint(tmp_path):
    cfg = load_recipe("debug").config
    plan = build_launch_plan(cfg, tmp_path, device_kind="cpu")
    assert plan.config.rdzv_endpoint == "127.0.0.1:0"
    assert plan.config.rdzv_backend == RDZV_BACKEND and plan.config.nproc_per_node == 2
    assert plan.config.local_addr == "127.0.0.1"  # the workers' MASTER_ADDR
    assert plan.env["GLOO_SOCKET_IFNAME"] == plan.env["NCCL_SOCKET_IFNAME"] == "lo"
    assert plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert (plan.config.min_nodes, plan.config.max_nodes) == (1, 1)
    assert "is_host" not in plan.config.rdzv_configs
    over = ["launch.nnodes=2", "launch.node_rank=1", "launch.rdzv_endpoint=10.1.2.3:29400"]
    cfg = load_recipe("debug", over).config
    plan = build_launch_plan(cfg, tmp_path, device_kind="cpu")
    assert plan.config.rdzv_endpoint == "10.1.2.3:29400"
    assert plan.config.rdzv_backend == NODES_BACKEND and plan.config.local_addr is None
    assert plan.env == {}  # multi-node: torch's own choices (see the README)
    assert plan.config.rdzv_configs["is_host"] is False
    assert plan.config.rdzv_configs[NODE_RANK_CONF] == 1  # node 1 takes group rank 1
    assert (plan.config.min_nodes, plan.config.max_nodes) == (2, 2)


def _listening_sockets(root: int) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket owned by `root` or its descendants,
    read from /proc (no `ss` needed)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:  # the kernel's list of each thread's children: no walk over every process
            for task in os.listdir(f"/proc/{pid}/task"):
                todo += map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except OSError:
            continue  # the process went away
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:
            continue  # the process or the fd went away
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in owner:  # 0A = LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((owner[cols[9]], socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def test_a_single_node_run_listens_on_loopback_only(tmp_path):
    # Restarts on (before the fix, the one setting where rank 0 hosted the workers' store).
    proc = start_fsdprun("train", "debug", "train.steps=4", "launch.max_restarts=1",
                         "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    seen: set[tuple[int, str, int]] = set()
    while proc.poll() is None:
        seen |= _listening_sockets(proc.pid)
        time.sleep(0.05)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert {addr for _, addr, _ in seen} <= {"127.0.0.1", "::1"}, seen
    launcher = {port for pid, _, port in seen if pid == proc.pid}
    workers = {port for pid, _, port in seen if pid != proc.pid} - launcher
    assert launcher, "the rendezvous store was never seen"
    assert len(workers) >= 3, seen  # rank 0's store and a gloo listener per rank


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_forked_workers_inherit_a_frozen_heap(method, tmp_path, monkeypatch):
    """On fork (CPU) the launcher freezes its heap just before the agent starts the workers, so
    their garbage collections skip everything they inherit (torch's objects and all). Either
    way what the command imported is frozen (`fsdprun.cli._load`)."""
    import gc

    from typer.testing import CliRunner

    import fsdprun.launch.elastic
    from fsdprun.cli import app

    seen = {}

    def agent(config, entry):
        def run(*args):
            seen[config.start_method] = (gc.get_freeze_count(), len(gc.get_objects()))
            raise UserError("the agent stops here")

        return run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FSDPRUN_START_METHOD", method)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch", agent)
    env = dict(os.environ)  # the launcher sets what its workers inherit
    gc.unfreeze()
    try:
        result = CliRunner().invoke(app, ["train", "debug", "--run-dir", "r"])
    finally:
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(env)
    assert result.exit_code == 2 and "the agent stops here" in result.stderr, result.output
    frozen, tracked = seen[method]
    assert frozen > 100_000, seen
    if method == "fork":  # nothing of the launcher's heap left for a worker's collections
        assert tracked < 1_000, seen


def test_missing_devices_are_user_errors():
    with pytest.raises(UserError, match="torch_npu is not importable.*launch.device=cpu"):
        resolve_device_kind("npu")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(UserError, match="no cuda device is available"):
            resolve_device_kind("cuda")
        assert resolve_device_kind("auto") == "cpu"
        with pytest.raises(UserError, match="no cuda, npu, xpu device here; launch.device=cpu"):
            resolve_device_kind("accelerator")
    check_nproc("cpu", 64)  # CPU ranks are processes: any number


def test_the_recipes_sized_for_gpus_say_so():
    from fsdprun.config import DeviceKind, builtin_recipes
    from fsdprun.config.reference import recipe_card

    for name, description in builtin_recipes().items():
        device = load_recipe(name).config.launch.device
        # The demos (under a million parameters) run on CPU; the shapes of real models need
        # GPUs (launch.device=cpu forces them).
        sized = recipe_card(name, description).num_params > 1e6
        assert (device is DeviceKind.accelerator) == sized, (name, device)


GIB = 2**30


def test_absurd_runs_for_the_hardware_found_are_warned_of():
    cfg = load_recipe("llama-1b", ["launch.device=cpu"]).config
    warnings = hardware_warnings(
        cfg, device_kind="cpu", memory_per_rank_bytes=8 * GIB,
        memory_source="RAM 16.0 GiB / 2 ranks", cpus_per_node=4,
    )  # fmt: skip
    memory, step = warnings
    planned = plan_memory(cfg).strategies["full"].total
    assert f"the plan puts {planned / GIB:.1f} GiB on each rank (full sharding on 1 rank)" in memory
    assert "a rank here has 8.0 GiB (RAM 16.0 GiB / 2 ranks)" in memory
    flops = model_spec(cfg.model).flops_per_token(cfg.model, 2048) * 8 * 2048
    step_s = flops / (CPU_FLOPS_PER_CORE * 4)
    assert f"on 4 CPU cores takes at least ~{step_s:,.0f} s" in step and "an estimate" in step
    # Enough memory and an accelerator: nothing to say (no CPU time estimate there).
    gpu = load_recipe("llama-8b").config
    args = dict(device_kind="cuda", memory_source="one cuda device", cpus_per_node=1)
    assert hardware_warnings(gpu, memory_per_rank_bytes=141 * 10**9, **args) == []
    assert len(hardware_warnings(gpu, memory_per_rank_bytes=16 * GIB, **args)) == 1
    # The demos are not absurd anywhere.
    demo = load_recipe("debug").config
    assert hardware_warnings(demo, device_kind="cpu", memory_per_rank_bytes=GIB,
                             memory_source="RAM", cpus_per_node=1) == []  # fmt: skip


def test_the_launcher_reads_gpu_memory_from_nvidia_smi_without_initializing_cuda(
    tmp_path, monkeypatch
):
    """memory_per_rank("cuda") asks nvidia-smi (NVML) for the first visible GPU, never torch:
    CUDA initialized in the launcher (torch's lazy init) breaks CUDA in any process forked
    after it."""
    from fsdprun import device as D

    calls = tmp_path / "calls"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                   f'case "$*" in *--id=7*) exit 6;; esac\necho 143771\n')  # fmt: skip
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def no_context(*_):
        raise AssertionError("initialized CUDA")

    monkeypatch.setattr(D.torch.cuda, "get_device_properties", no_context)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    total, source = D.memory_per_rank("cuda", 8)
    assert total == 143771 * 2**20 and source == "one cuda device, 140.4 GiB"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5b1c,3")
    assert D.memory_per_rank("cuda", 1)[0] == 143771 * 2**20
    assert calls.read_text().split("\n")[:2] == [
        "--query-gpu=memory.total --format=csv,noheader,nounits --id=0",
        "--query-gpu=memory.total --format=csv,noheader,nounits --id=GPU-5b1c",
    ]
    for visible in ("", "-1", "7"):  # none visible; nvidia-smi fails
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert D.memory_per_rank("cuda", 1) == (None, "cuda memory unknown (nvidia-smi gave none)")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert D.memory_per_rank("cuda", 1)[0] is None


def test_a_gpu_recipe_forced_onto_cpu_is_warned_of_before_launch(tmp_path):
    # The start method is checked after the warnings and before the run directory exists: the
    # warnings are seen without training an 886M model on CPU.
    proc = run_fsdprun("train", "llama-1b", "launch.device=cpu", "--run-dir", str(tmp_path / "r"),
                       cwd=tmp_path, env=fsdprun_env(FSDPRUN_START_METHOD="threads"))  # fmt: skip
    *warnings, error = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "FSDPRUN_START_METHOD='threads'" in error, proc.stderr
    assert not (tmp_path / "r").exists()
    assert all(w.startswith("warning: ") for w in warnings), warnings
    assert sum("takes at least" in w for w in warnings) == 1, warnings  # on any CPU
    planned = plan_memory(load_recipe("llama-1b", ["launch.device=cpu"]).config)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    too_big = planned.strategies["full"].total > ram  # one rank
    assert sum("the plan puts" in w for w in warnings) == too_big, warnings


def test_npu_without_torch_npu_exits_2_before_launch(tmp_path):
    proc = run_fsdprun("train", "debug", "launch.device=npu", "--run-dir", "r", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "torch_npu" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_multi_node_without_endpoint_is_refused(tmp_path):
    proc = run_fsdprun("train", "debug", "--nnodes", "2", "--nproc-per-node", "1", cwd=tmp_path)
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr


def _events() -> list[dict]:
    ranks = [
        {"rank": r, "peak_rss_bytes": 300 * 2**20,
         "model_state_bytes": {"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                               "total": 2**22}}
        for r in (0, 1)
    ]  # fmt: skip
    return [
        {"event": "start", "recipe": "debug", "num_params": 131_000, "world_size": 2, "nnodes": 1,
         "device_name": "CPU (x86_64)", "backend": "gloo", "engine": "fsdp2",
         "fsdp_units": ["layers.0", "layers.1", "<root>"], "param_dtype": "fp32",
         "reduce_dtype": "fp32", "activation_checkpointing": "none (0 blocks)", "compile": "off",
         "global_batch_size": 8, "seq_len": 64, "tokens_per_step": 512, "micro_batch_size": 2,
         "grad_accum_steps": 2, "steps": 2, "param_shard_bytes": 2**20, "param_bytes": 2**21,
         "run_dir": "runs/x"},
        {"event": "step", "step": 2, "loss": 4.5, "lr": 1e-3, "grad_norm": 0.5,
         "tokens_per_s": 1234.0, "step_time_s": 0.05},
        {"event": "summary", "final_loss": 4.5, "timing_warmup_steps": 1,
         "flops_per_token": 786_432, "mfu_note": "no peak figure for CPUs",
         "metrics_file": "runs/x/metrics.jsonl", "wall_time_s": 3.0, "ranks": ranks,
         "throughput": {"tokens_per_s": 7500.0, "tokens_per_s_per_device": 3750.0,
                        "step_time_p50_s": 0.068, "step_time_p90_s": 0.0825,
                        "tflops_per_device": 0.003, "mfu": None, "steps_measured": 28}},
    ]  # fmt: skip


def test_report_renders_the_numbers_it_is_given():
    console = Console(record=True, width=160)
    reporter = Reporter(console)
    for event in _events():
        reporter.handle(event)
    text = console.export_text()
    assert "world size 2 (1 node(s))" in text and "parameter shard per rank: 1.00 MiB" in text
    assert "step 2 | loss 4.5000 | lr 1.00e-03" in text
    assert "7,500" in text and "3,750" in text and "68.0 ms" in text and "82.5 ms" in text
    assert "n/a (no peak figure for CPUs)" in text
    assert "300.00 MiB" in text and "4.00 MiB" in text
    gpu = _events()
    gpu[2]["throughput"]["mfu"] = 0.523
    for r in gpu[2]["ranks"]:
        del r["peak_rss_bytes"]
        r.update(peak_allocated_bytes=40 * 2**30, peak_reserved_bytes=42 * 2**30)
    console = Console(record=True, width=160)
    Reporter(console).handle(gpu[2])
    text = console.export_text()
    assert "52.3%" in text and "40.00 GiB" in text and "42.00 GiB" in text


def test_report_of_a_launch_whose_steps_were_all_skipped():
    summary = _events()[2]
    for r in summary["ranks"]:
        r["model_state_bytes"] = None  # no optimizer step was taken
    console = Console(record=True, width=160)
    Reporter(console).handle(summary)
    text = console.export_text()
    assert "300.00 MiB" in text and text.count("n/a") >= 8  # 4 columns x 2 ranks


TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def test_hybrid_shards_within_the_node_an_external_launcher_reports():
    from fsdprun.config.layout import Layout
    from fsdprun.launch.direct import launch_overrides

    # llama-1b says one device per node; torchrun (or srun) started the job as it is.
    batch = ["fsdp.sharding=hybrid", "train.micro_batch_size=1", "train.global_batch_size=16"]
    for world, local in ((8, 8), (16, 8), (8, 4)):
        env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "RANK": str(world - 1)}
        overrides = [*batch, *launch_overrides(env)]
        cfg = load_recipe("llama-1b", overrides, world_size=world).config
        assert Layout.of(cfg, world).shard_group == local
        launch = cfg.launch
        assert (launch.nproc_per_node, launch.nnodes, launch.node_rank) == (
            local, world // local, world // local - 1)  # fmt: skip
    with pytest.raises(UserError, match="LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=8"):
        launch_overrides({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3", "RANK": "0"})


def test_torchrun_restarts_resume_and_hybrid_shards_over_the_real_node(fsdprun_runs, tmp_path):
    # fsdprun as torchrun's workers: 4 ranks on one node; the debug recipe says 2 per node.
    # Rank 1 fails at step 5 and torchrun restarts the group, which continues from step 4. Its
    # workers are `fsdprun` commands through the suite's warm zygote (8 torch imports less);
    # docs/cluster.md's `torchrun --nproc-per-node 2 -m fsdprun train debug` runs them exec'd.
    run_dir = tmp_path / "run"
    fsdprun = zygote_command(tmp_path)
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "4", "--max-restarts", "1", fsdprun,
         "train", "debug", "train.steps=6", "output.log_every=1",
         "checkpoint.every_steps=2", "fsdp.sharding=hybrid", "--run-dir", str(run_dir)],
        cwd=tmp_path, env=fsdprun_env(FSDPRUN_FAIL_AT="1:5"), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Run(proc, run_dir)
    restart = next(e for e in run.events if e["event"] == "restart")
    assert restart["step"] == 4 and restart["attempt"] == 1
    assert [e["step"] for e in run.steps] == [1, 2, 3, 4, 5, 6]
    plain = fsdprun_runs.train("train.steps=6", "output.log_every=1", "train.micro_batch_size=1")
    for step, (got, want) in enumerate(zip(run.losses, plain.check().losses, strict=True), 1):
        assert got == pytest.approx(want, abs=1e-5), step
    sharding = next(k for k in run.start["engine_knobs"] if k["key"] == "fsdp.sharding")
    assert "(1 replicate x 4 shard)" in sharding["applied"]
    # The manifest records the mesh the engine built, not a 1-D "dp" one.
    newest = list_checkpoints(run_dir)[-1]
    assert newest.step == 6
    assert newest.manifest["mesh"] == {"shape": [1, 4], "dim_names": ["replicate", "shard"]}
    assert (run.start["world_size"], run.start["nnodes"]) == (4, 1)
    # Rank 0 prints the report itself (no launcher process follows the metrics).
    assert "Throughput" in proc.stdout and (run_dir / "recipe.yaml").exists()


def test_a_restarted_torchrun_worker_continues_only_its_own_run_dir(tmp_path, monkeypatch):
    import json

    from fsdprun.checkpoint import checkpoint_root
    from fsdprun.launch.direct import claim_run_dir
    from fsdprun.rundir import agent_path

    run_dir = tmp_path / "run"
    resolved = load_recipe("debug")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    claim_run_dir(run_dir, resolved)  # the first attempt creates it ...
    checkpoint_root(run_dir).mkdir()  # ... and saves
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    claim_run_dir(run_dir, resolved)  # the restart continues it
    # A run directory another job (or fsdprun's own launcher) created is refused, restart or not.
    agent_path(run_dir).write_text(json.dumps({"agent": "elsewhere:1"}))
    with pytest.raises(UserError, match="already holds checkpoints"):
        claim_run_dir(run_dir, resolved)
    agent_path(run_dir).unlink()
    with pytest.raises(UserError, match="already holds checkpoints"):
        claim_run_dir(run_dir, resolved)


# What srun exports to each task of `srun --nodes 1 --ntasks 2` (the variables fsdprun reads).
SRUN_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "cn7",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURMD_NODENAME": "cn7",
}  # fmt: skip


def test_srun_variables_map_only_for_the_tasks_of_a_multi_task_step():
    from fsdprun.launch.slurm import first_host, srun_env

    task1 = {**SRUN_STEP, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    env = srun_env(task1)
    assert env == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": env["MASTER_PORT"]}  # fmt: skip
    assert 20000 <= int(env["MASTER_PORT"]) < 30000
    assert srun_env({**task1, "SLURM_STEP_ID": "1"})["MASTER_PORT"] != env["MASTER_PORT"]
    assert srun_env({**task1, "MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"
    # An sbatch script or salloc shell (no step), a one-task step, torchrun inside srun: no.
    batch = {k: v for k, v in task1.items() if not k.startswith("SLURM_STEP")}
    assert srun_env({**batch, "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == {}
    assert srun_env({**task1, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}) == {}
    assert srun_env({**task1, "RANK": "3"}) == {}
    # Two nodes: rank 0 listens on the step's first node.
    two = {**task1, "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURMD_NODENAME": "gpu008"}  # fmt: skip
    assert srun_env(two)["MASTER_ADDR"] == "gpu007" and srun_env(two)["LOCAL_WORLD_SIZE"] == "4"
    with pytest.raises(UserError, match="task 0 runs on gpu008, not on the step's first node"):
        srun_env({**two, "SLURM_PROCID": "0"})
    with pytest.raises(UserError, match=r"SLURM_STEP_TASKS_PER_NODE='3,1'.*--ntasks-per-node"):
        srun_env({**two, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "3,1"})
    with pytest.raises(UserError, match="export MASTER_ADDR"):
        srun_env({**two, "SLURM_STEP_NODELIST": "gpu[a-b]"})
    # One task per node with --nnodes: each task is its node's launcher (examples/slurm/), not
    # one worker of a world of 2; without --nnodes it stays one worker per node.
    per_node = {**two, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert srun_env(per_node, nnodes=2) == {}
    assert srun_env(per_node)["WORLD_SIZE"] == "2"
    assert srun_env(two, nnodes=2)["WORLD_SIZE"] == "8"  # 4 per node: the tasks are workers
    hosts = {"cn1": "cn1", "cn[1-4],gpu[2,5]": "cn1", "n[09-12]-ib[0-1]": "n09-ib0", "n[1-2": None}
    for nodelist, host in hosts.items():
        assert first_host(nodelist) == host, nodelist


def test_srun_tasks_train_together_as_one_job(tmp_path):
    run_dir = tmp_path / "run"
    step = {**SRUN_STEP, "MASTER_PORT": str(free_port())}  # tests run side by side on one host
    args = ["train", "debug", "train.steps=3", "output.log_every=1", "--run-dir", str(run_dir)]
    procs = [
        start_fsdprun(*args, cwd=tmp_path,
                      env=fsdprun_env(**step, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
        for r in (0, 1)
    ]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    run = Run(procs[0], run_dir)
    assert [e["event"] for e in run.events].count("start") == 1
    assert run.start["world_size"] == 2 and [e["step"] for e in run.steps] == [1, 2, 3]
    assert not (run_dir / "recipe.1.yaml").exists() and "Throughput" in outs[0][0]


def test_external_launcher_mistakes_are_one_line(tmp_path):
    env = fsdprun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = run_fsdprun("train", "debug", "--run-dir", str(tmp_path / "run"), cwd=tmp_path, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "MASTER_ADDR and MASTER_PORT not" in proc.stderr and not (tmp_path / "run").exists()
    # resume starts its own launcher: one per srun task would be two jobs in one directory.
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    env = fsdprun_env(**SRUN_STEP, SLURM_PROCID="0", SLURM_LOCALID="0")
    proc = run_fsdprun("resume", str(run_dir), cwd=tmp_path, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "fsdprun resume starts its own launcher" in proc.stderr
    assert list(run_dir.iterdir()) == []


def test_workers_fork_on_cpu_and_spawn_on_accelerators(monkeypatch):
    from fsdprun.errors import UserError
    from fsdprun.launch.elastic import start_method

    monkeypatch.delenv("FSDPRUN_START_METHOD", raising=False)
    monkeypatch.setattr("fsdprun.launch.elastic.accelerator_device_nodes", lambda: [])
    assert start_method("cpu") == "fork"
    assert start_method("cuda") == start_method("npu") == "spawn"
    # CPU ranks on a GPU machine: this launcher may have touched the CUDA driver.
    monkeypatch.setattr("fsdprun.launch.elastic.accelerator_device_nodes", lambda: ["/dev/nvidia0"])
    assert start_method("cpu") == "spawn"
    monkeypatch.setenv("FSDPRUN_START_METHOD", "spawn")
    assert start_method("cpu") == "spawn"
    monkeypatch.setenv("FSDPRUN_START_METHOD", "threads")
    with pytest.raises(UserError, match="FSDPRUN_START_METHOD='threads'"):
        start_method("cpu")


def test_a_bad_start_method_is_refused_before_the_run_dir_exists(tmp_path):
    proc = run_fsdprun("train", "debug", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                       env=fsdprun_env(FSDPRUN_START_METHOD="threads"))  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "FSDPRUN_START_METHOD='threads'" in proc.stderr and not (tmp_path / "run").exists()


def test_cpu_offload_on_an_accelerator_adds_gloo_for_cpu_tensors():
    # Clipping all-reduces the norm of CPU gradients under fsdp.cpu_offload: an accelerator's
    # backend alone (NCCL) has no CPU collectives.
    for kind, backend in BACKENDS.items():
        assert process_group_backend(kind, cpu_offload=False) == backend
        offload = process_group_backend(kind, cpu_offload=True)
        if kind == "cpu":
            assert offload == "gloo"
        else:
            by_device = dict(part.split(":") for part in offload.split(","))
            assert by_device == {"cpu": "gloo", kind: backend}
    assert process_group_backend("cuda", cpu_offload=True) == "cpu:gloo,cuda:nccl"
