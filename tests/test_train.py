"""Training end to end through the real `fsdprun train` command: CPU, gloo, 1-2 ranks.

Losses must not depend on the world size, the accumulation split, or the FSDP knobs (fp32):
the same global step sees the same samples and the same initial weights everywhere. Checks of
what an engine or a knob does (not of the launch) train two ranks in the session's persistent
gloo process group instead (tests/gloo_pool.py: the worker's own `_train`, no launcher).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import Run, free_port, fsdprun_env, run_fsdprun, zygote_command

from fsdprun.errors import UserError
from fsdprun.train.guard import PEER_LOST

# 6 steps of the debug recipe, logging every step; global batch 8.
BASE = ("train.steps=6", "output.log_every=1")


def assert_same_losses(a: Run, b: Run, tol: float = 1e-5) -> None:
    assert len(a.losses) == len(b.losses) == 6
    for step, (x, y) in enumerate(zip(a.losses, b.losses, strict=True), start=1):
        assert x == pytest.approx(y, abs=tol, rel=tol), f"step {step}: {x} vs {y}"


@pytest.fixture(scope="module")
def world2_micro1(fsdprun_runs) -> Run:
    # world 2 x micro 1 -> 4 accumulation steps
    return fsdprun_runs.train(*BASE, "train.micro_batch_size=1", nproc=2).check()


def test_debug_recipe_end_to_end(world2_micro1: Run):
    out = world2_micro1.proc.stdout
    for text in ("Throughput", "Memory per rank", "tokens/s (total)", "MFU", "peak RSS",
                 "model state", "step 6 | loss"):  # fmt: skip
        assert text in out, text
    assert world2_micro1.proc.stderr.strip() == ""
    # The header: a seeded init, the data; no LoRA, no tracker (neither is on).
    assert "\n  weights: random init (train.seed=0)\n" in out
    assert "\n  data: synthetic (noise " in out and "LoRA:" not in out and "trackers:" not in out
    assert world2_micro1.start["num_trainable_params"] == world2_micro1.start["num_params"]
    assert [e["step"] for e in world2_micro1.steps] == [1, 2, 3, 4, 5, 6]
    step = world2_micro1.steps[0]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory"} <= step.keys()
    summary = world2_micro1.summary
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["throughput"]["tokens_per_s"] > 0
    assert (world2_micro1.run_dir / "recipe.yaml").exists()
    assert list((world2_micro1.run_dir / "logs").rglob("stdout.log"))


def test_world_size_does_not_change_losses(world2_micro1: Run, fsdprun_runs):
    world1 = fsdprun_runs.train(*BASE, "train.micro_batch_size=4", nproc=1).check()
    assert_same_losses(world2_micro1, world1)
    # The parameter shard of each of 2 ranks is half the model (up to uneven row splits).
    total = world1.start["param_shard_bytes"]
    assert total == world1.start["param_bytes"]
    assert world2_micro1.start["param_shard_bytes"] == pytest.approx(total / 2, rel=0.01)
    for r in world2_micro1.summary["ranks"]:
        full = world1.summary["ranks"][0]["model_state_bytes"]
        for part in ("params", "grads", "optimizer"):
            assert r["model_state_bytes"][part] == pytest.approx(full[part] / 2, rel=0.01)


def test_gradient_accumulation_matches_one_big_batch(world2_micro1: Run, fsdprun_runs):
    micro4 = fsdprun_runs.train(*BASE, "train.micro_batch_size=4", nproc=2).check()
    assert world2_micro1.start["grad_accum_steps"] == 4 and micro4.start["grad_accum_steps"] == 1
    assert_same_losses(world2_micro1, micro4)


@pytest.mark.parametrize(
    ("overrides", "nproc"),
    [
        (("fsdp.engine=fsdp1",), 2),
        (("fsdp.sharding=hybrid", "fsdp.shard_group_size=2"), 4),
        (("fsdp.accumulate_unsharded=true",), 2),
    ],
    ids=["fsdp1-reduce-scatter-every-micro-step", "fsdp2-hybrid-2x2-all-reduce-on-the-last",
         "fsdp2-accumulate-unsharded"],
)  # fmt: skip
def test_accumulation_matches_one_big_batch_under_each_engine(
    fsdprun_runs, gloo_pool, overrides, nproc
):
    # fp32: gradients reduce-scattered into their shards on every micro-step (the default) or
    # kept whole until the last (the opt-in knob) give the losses of one big batch. Two ranks
    # train in the session's gloo process group (tests/gloo_pool.py); four are launched.
    big_batch = fsdprun_runs.train(*BASE, "train.micro_batch_size=4", nproc=2).check()
    run = (
        gloo_pool.train(*BASE, "train.micro_batch_size=1", *overrides)
        if nproc == gloo_pool.world
        else fsdprun_runs.train(*BASE, "train.micro_batch_size=1", *overrides, nproc=nproc)
    ).check()
    assert run.start["grad_accum_steps"] == 8 // nproc
    assert_same_losses(run, big_batch)


def test_fsdp_knobs_keep_the_math(world2_micro1: Run, gloo_pool):
    knobs = gloo_pool.train(
        *BASE, "train.micro_batch_size=1", "activation_checkpointing.mode=full",
        "fsdp.forward_prefetch=1", "fsdp.backward_prefetch=2", "fsdp.reshard_after_forward=false",
        "fsdp.wrap=size", "fsdp.min_num_params=40000",
    )  # fmt: skip
    assert knobs.start["activation_checkpointing"] == "full (2 blocks)"
    # size policy, post-order: a feed-forward (37K params) is under 40K, a block (49K) is not;
    # the embedding and output projection (16K each) stay in the root
    assert knobs.start["fsdp_units"] == ["layers.0", "layers.1", "<root>"]
    assert_same_losses(world2_micro1, knobs)


def test_bf16_trains(gloo_pool):
    run = gloo_pool.train("train.steps=12", "output.log_every=1", "precision.param_dtype=bf16")
    assert run.start["param_dtype"] == "bf16"
    assert run.losses[-1] < run.losses[0] - 0.3


def test_fp16_with_grad_scaler_cpu_offload_and_tied_embeddings(fsdprun_runs, gloo_pool):
    run = gloo_pool.train(
        "train.steps=8", "output.log_every=1", "precision.param_dtype=fp16",
        "fsdp.cpu_offload=true", "model.tie_embeddings=true",
    )  # fmt: skip
    assert run.losses[-1] < run.losses[0]
    untied = run.start["num_params"] + 256 * 64  # the debug vocab x dim output projection
    assert untied == fsdprun_runs.train(*BASE, "train.micro_batch_size=1").start["num_params"]


def test_clipping_scales_gradients_as_torch_does_under_every_engine(gloo_pool):
    """A clip far below the gradient norm acts at every step; fsdp2 (its own scaling of the
    local shards), fsdp1 (FSDP's clip_grad_norm_) and ddp (torch's clip_grad_norm_) agree.
    optim.eps=1 makes AdamW's step follow the gradient's scale (it otherwise divides it out)."""
    micro1 = (*BASE, "train.micro_batch_size=1", "optim.eps=1", "optim.lr=0.5")
    clipped = {e: gloo_pool.train(*micro1, "train.grad_clip=0.05", f"fsdp.engine={e}")
               for e in ("fsdp2", "fsdp1", "ddp")}  # fmt: skip
    assert all(e["grad_norm"] > 0.5 for e in clipped["fsdp2"].steps)  # so the clip acts
    free = gloo_pool.train(*micro1, "train.grad_clip=0")
    assert abs(clipped["fsdp2"].losses[-1] - free.losses[-1]) > 0.05
    for engine in ("fsdp1", "ddp"):
        assert_same_losses(clipped["fsdp2"], clipped[engine])


def test_every_adamw_kernel_trains_the_same_and_auto_takes_fused_where_it_works(
    world2_micro1: Run, gloo_pool, tmp_path
):
    """fused (what `auto` picks on CPU: the launched run's kernel), foreach and for_loop: the
    same math. Under fp16 with an FSDP engine the sharded gradient scaler breaks torch's fused
    step, so `auto` takes foreach there (the fp16 test above trains with it) and an explicit
    `fused` is refused."""
    import torch

    from fsdprun.config import OptimImpl, load_recipe
    from fsdprun.train.optim import build_optimizer, resolved_implementation

    cfg = load_recipe("debug").config.optim
    model = torch.nn.Linear(4, 4)
    # world2_micro1 trains with `auto`, which is torch's fused AdamW on CPU.
    assert resolved_implementation(OptimImpl.auto, "cpu") is OptimImpl.fused
    assert build_optimizer(model, cfg=cfg, device_kind="cpu").defaults["fused"] is True
    micro1 = (*BASE, "train.micro_batch_size=1")
    for impl in ("foreach", "for_loop"):
        assert_same_losses(world2_micro1, gloo_pool.train(*micro1, f"optim.implementation={impl}"))

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    fp16 = build_optimizer(model, cfg=cfg, device_kind="cpu", scaler=ShardedGradScaler("cpu"))
    assert fp16.defaults["foreach"] is True and not fp16.defaults["fused"]
    plain = build_optimizer(model, cfg=cfg, device_kind="cpu", scaler=torch.amp.GradScaler("cpu"))
    assert plain.defaults["fused"] is True  # DDP's plain scaler takes the fused step
    assert resolved_implementation(OptimImpl.auto, "mps") is OptimImpl.foreach
    assert resolved_implementation(OptimImpl.for_loop, "cuda") is OptimImpl.for_loop

    fp16_fused = ("optim.implementation=fused", "precision.param_dtype=fp16")
    proc = run_fsdprun("config", "debug", *fp16_fused, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "optim.implementation=fused" in line and "fsdp.engine=fsdp2" in line, line
    with pytest.raises(UserError, match="optim.implementation=fused .* fsdp.engine=fsdp1"):
        load_recipe("debug", [*fp16_fused, "fsdp.engine=fsdp1"])
    load_recipe("debug", [*fp16_fused, "fsdp.engine=ddp"])  # the plain scaler works with it


def test_failing_worker_names_rank_error_and_log(tmp_path):
    proc = run_fsdprun(
        "train", "debug", *BASE, "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_FAIL_AT="1:2"),
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "rank 1 failed: RuntimeError: injected failure at step 2" in lines[0]
    log = lines[0].split("log: ")[1].strip()
    assert log.endswith("stderr.log") and "injected failure" in Path(log).read_text()
    assert "Traceback" not in proc.stderr
    # Later, from the run directory alone: `fsdprun status` names the same line.
    status = run_fsdprun("status", str(tmp_path / "run"), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == (
        f"{tmp_path / 'run'}: not running; the last session failed: {lines[0][len('error: ') :]}"
    )


def _failure(attempt: Path, rank: int, message: str | None, timestamp: int, exitcode: int = 1):
    """A failed worker as the elastic agent reads it: the error file @record writes in the
    attempt's folder (none when `message` is None: a worker that exited without one)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = attempt / str(rank) / "error.json"
    error_file.parent.mkdir(parents=True, exist_ok=True)
    error_file.unlink(missing_ok=True)
    (error_file.parent / "stderr.log").write_text(f"rank {rank}'s traceback\n")
    if message is not None:
        info = {"py_callstack": "Traceback ...", "timestamp": str(timestamp)}
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(error_file))  # fmt: skip


@pytest.mark.parametrize("lag_s", [0, 1])  # error files carry whole seconds: a tie, and later
def test_the_rank_that_failed_is_named_before_the_rank_that_lost_it(tmp_path, lag_s):
    """The agent reports the first worker of a node it finds exited, which may be the one that
    only lost its connection (the end-to-end test above, on a fast machine), or several with
    the same whole-second stamps: the rank that failed on its own is named all the same, with
    its own log."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from fsdprun.launch.elastic import describe_failure

    def described(failures) -> str:
        return str(describe_failure(ChildFailedError("w", failures), tmp_path))

    attempt = tmp_path / "attempt_0"
    lost = f"RuntimeError: {PEER_LOST} at step 2 (it exited; its own log says why)"
    own = "RuntimeError: injected failure at step 2"
    failures = {0: _failure(attempt, 0, lost, 100), 1: _failure(attempt, 1, own, 100 + lag_s)}
    assert described(failures) == f"rank 1 failed: {own}; log: {attempt / '1' / 'stderr.log'}"
    # Only the rank that lost its peer reported: its sibling's error file names the cause.
    assert described({0: failures[0]}) == described(failures)
    # Ranks 2 and 3 of the job on this node (local ranks 0 and 1).
    failure = _failure(attempt, 0, lost, 100)
    assert described({2: failure}).startswith(f"rank 3 failed: {own}")
    # A worker that exited without an error file is still the cause, named by its exit code.
    failures[1] = _failure(attempt, 1, None, 0, exitcode=3)
    assert described(failures).startswith("rank 1 failed: exit code 3; log: ")
    # Every rank lost its peer (the cause is elsewhere: another node): the first of them.
    failures = {0: _failure(attempt, 0, lost, 100 + lag_s), 1: _failure(attempt, 1, lost, 100)}
    assert described(failures).startswith(f"rank {1 if lag_s else 0} failed: {lost}")


def test_existing_run_is_never_overwritten(world2_micro1: Run, tmp_path):
    metrics = world2_micro1.run_dir / "metrics.jsonl"
    before = hashlib.sha256(metrics.read_bytes()).hexdigest()
    proc = run_fsdprun("train", "debug", "--run-dir", str(world2_micro1.run_dir), cwd=tmp_path)
    assert proc.returncode == 2
    # The run saved a final checkpoint, so the refusal points to `fsdprun resume`.
    assert "already holds checkpoints; continue it with `fsdprun resume" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert hashlib.sha256(metrics.read_bytes()).hexdigest() == before


def test_two_nodes_over_c10d_rendezvous(world2_micro1: Run, tmp_path):
    """Two `fsdprun train` processes on one machine, one worker each, train one job together."""
    import subprocess

    endpoint = f"127.0.0.1:{free_port()}"
    # Both through the suite's zygote (each its own process, as run_fsdprun's), side by side.
    fsdprun = zygote_command(tmp_path)
    procs = []
    for node in (0, 1):
        args = ["train", "debug", *BASE, "train.micro_batch_size=1", "--nnodes", "2",
                "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
                "--run-dir", str(tmp_path / f"node{node}")]  # fmt: skip
        procs.append(
            subprocess.Popen(
                [fsdprun, *args],
                cwd=tmp_path,
                env=fsdprun_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    runs = [Run(None, tmp_path / f"node{n}") for n in (0, 1)]
    with_metrics = [r for r in runs if r.events]
    assert len(with_metrics) == 1  # only the node that got global rank 0 writes metrics
    run = with_metrics[0]
    assert run.start["world_size"] == 2 and run.start["nnodes"] == 2
    assert_same_losses(world2_micro1, run)
