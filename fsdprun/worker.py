"""One training worker (one rank): the only place that sequences a run.

Started by `fsdprun.launch` through torch's elastic agent (`elastic_entry`), or directly by
torchrun/srun (`fsdprun train` sees RANK/WORLD_SIZE in the environment). It reads the resolved
recipe, joins the process group, builds and shards the model, trains, and on rank 0 writes
RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fsdprun import __version__
from fsdprun.checkpoint import (
    Checkpointer,
    SaveFailed,
    SaveRecord,
    build_state,
    find_resume_checkpoint,
    load_checkpoint,
    load_model_weights,
    new_checkpoint_group,
    read_manifest,
    step_dir,
)
from fsdprun.config import Dtype, ModelInit, NonFinite, RecipeConfig, config_to_dict, load_recipe
from fsdprun.data import BatchLayout, Dataset, build_datasets, load_batch
from fsdprun.data.prefetch import BatchLoader
from fsdprun.device import (
    Device,
    build_worker_device,
    process_group_backend,
    resolve_device_kind,
)
from fsdprun.engine import build_engine
from fsdprun.errors import UserError
from fsdprun.float8 import MFU_CONVENTION, apply_float8, check_float8, precompute_scales
from fsdprun.float8 import describe as describe_float8
from fsdprun.guard import (
    Heartbeat,
    StepAgreement,
    StopSignals,
    die_with_launcher,
    freeze,
    injected_step,
    restart_count,
)
from fsdprun.loopback import worker_store_args
from fsdprun.loss import describe_loss
from fsdprun.metrics import MetricsLog, peak_flops, read_events, throughput
from fsdprun.models import build_model
from fsdprun.models.llama import flops_per_token, num_params
from fsdprun.models.lora import apply_lora
from fsdprun.optim import build_lr_scheduler, build_optimizer, resume_lr_scheduler
from fsdprun.parallel import apply_activation_checkpointing, apply_compile, model_state_bytes
from fsdprun.profiling import StepProfiler, profile_record
from fsdprun.report import Reporter
from fsdprun.trackers import close_on_failure, open_trackers

RECIPE_FILE = "recipe.yaml"


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> Ranks:
        return cls(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                   int(os.environ["WORLD_SIZE"]))  # fmt: skip


@record
def elastic_entry(run_dir: str, recipe_name: str, resume_from: str | None = None) -> dict | None:
    """Entry point of a worker spawned by the elastic agent: the recipe is RUN_DIR/recipe.yaml."""
    die_with_launcher()
    try:
        resume = Path(resume_from) if resume_from else None
        return run(Path(run_dir), render=False, recipe_name=recipe_name, resume_from=resume)
    except BaseException:
        # The agent keeps only the message; the traceback goes to this rank's stderr.log.
        traceback.print_exc()
        raise


def run(
    run_dir: Path,
    *,
    render: bool,
    recipe_name: str | None = None,
    cfg: RecipeConfig | None = None,
    resume_from: Path | None = None,
) -> dict[str, Any] | None:
    """Train one rank. Returns the summary event on rank 0 (elsewhere {"stopped": ...} after a
    stop, else None).

    Args:
        run_dir: holds recipe.yaml (written by the launcher) and receives metrics.
        render: rank 0 prints the report itself (no launcher process is following the metrics).
        recipe_name: shown in the header.
        cfg: the resolved recipe when this process resolved it itself (external launcher);
            otherwise it is read from RUN_DIR/recipe.yaml.
        resume_from: a complete checkpoint to continue from.
    """
    ranks = Ranks.from_env()
    if cfg is None:
        # Validate against the real world size, which is what the workers actually got.
        cfg = load_recipe(str(run_dir / RECIPE_FILE), world_size=ranks.world_size).config
    _set_threads()
    kind = resolve_device_kind(cfg.launch.device.value)
    device = build_worker_device(kind, ranks.local_rank)
    timeout = timedelta(seconds=cfg.launch.timeout_s)
    dist.init_process_group(
        backend=process_group_backend(kind, cpu_offload=cfg.fsdp.cpu_offload),
        device_id=device.torch_device if kind != "cpu" else None,
        timeout=timeout,
        **_store_args(ranks, timeout),
    )
    try:
        _check_same_recipe(cfg)
        summary = _train(
            cfg, run_dir, ranks, device, render=render, recipe_name=recipe_name,
            resume_from=resume_from,
        )  # fmt: skip
    except BaseException as e:
        # On failure the process group is not destroyed: peers may be gone or stuck, and a
        # destroy would wait for them. The frames' locals (the model) are released regardless.
        close_on_failure()
        traceback.clear_frames(e.__traceback__)
        gc.collect()
        raise
    # Free FSDP state (which holds the device mesh) before the process group goes: destroying
    # the group under live DTensors aborts the process at exit now and then.
    gc.collect()
    dist.destroy_process_group()
    return summary


def _store_args(ranks: Ranks, timeout: timedelta) -> dict:
    """How the workers find each other: the agent's shared store under a per-attempt prefix
    (torchrun, multi-node), rank 0's store bound to loopback (fsdprun's single-node launcher,
    which does not share the agent's store: that one listens on every interface), else env://."""
    agent = _agent_store(timeout)
    if agent is not None:
        return {"store": agent, "rank": ranks.rank, "world_size": ranks.world_size}
    return worker_store_args(timeout)


def _agent_store(timeout: timedelta) -> dist.Store | None:
    """The elastic agent's rendezvous store under a prefix of this attempt, when the agent
    shares its store with the workers (torch's default, under torchrun and fsdprun's launcher).

    torch's env:// rendezvous uses the shared store without a per-attempt prefix, so a restarted
    group read the previous attempt's gloo addresses from it and failed to connect (measured
    with torch 2.13); the prefix gives every attempt its own keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"fsdprun/attempt-{restart_count()}", agent)


def _set_threads() -> None:
    # The elastic agent does not set OMP_NUM_THREADS as torchrun does; the launcher exports it.
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def _check_same_recipe(cfg: RecipeConfig) -> None:
    """Every rank must train the same recipe (nodes each read their own RUN_DIR/recipe.yaml)."""
    data = config_to_dict(cfg)
    # These differ between nodes by design.
    del data["launch"]["node_rank"], data["output"]["run_dir"]
    digest = hashlib.sha256(repr(data).encode()).hexdigest()[:16]
    digests: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"ranks were given different recipes (digests {sorted(set(digests))}); start every "
            "node with the same recipe and overrides"
        )


def _build(cfg: RecipeConfig, ranks: Ranks, device: Device):
    """The wrapped, initialized model (an `Engine`), its optimizer, schedule and (fp16) grad
    scaler."""
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = build_model(cfg.model)
    # LoRA first: the adapters are then checkpointed, compiled and sharded with their blocks.
    apply_lora(model, cfg=cfg.lora)
    # float8 converts Linears before checkpointing, compile and sharding wrap them (torchao).
    check_float8(cfg.precision.float8.value, device.kind)
    apply_float8(model, mode=cfg.precision.float8.value)
    num_ac = apply_activation_checkpointing(model, cfg=cfg.activation_checkpointing)
    apply_compile(model, cfg=cfg.compile)
    weights = None
    if cfg.model.hf_path is not None and cfg.model.init is ModelInit.pretrained:
        # Imported here: it needs safetensors, which comes with the optional hf extra.
        from fsdprun.hf import HFWeights

        weights = HFWeights(Path(cfg.model.hf_path), model)
    engine = build_engine(
        model, cfg, device=device.torch_device, device_kind=device.kind,
        world_size=ranks.world_size, weights=weights,
    )  # fmt: skip
    optimizer = build_optimizer(
        engine.model, cfg=cfg.optim, device_kind=device.kind, is_matrix=engine.is_matrix
    )
    scheduler = build_lr_scheduler(optimizer, cfg=cfg.schedule, total_steps=cfg.train.steps)
    # fp16 gradients underflow without loss scaling; bf16 and fp32 need none.
    scaler = engine.grad_scaler() if cfg.precision.param_dtype is Dtype.fp16 else None
    return engine, num_ac, optimizer, scheduler, scaler


def _restart_checkpoint(run_dir: Path, resume_from: Path | None) -> Path | None:
    """After an elastic restart, continue from the newest complete checkpoint, if any."""
    if restart_count() == 0:
        return resume_from
    try:
        return find_resume_checkpoint(run_dir)[0].path
    except UserError:
        return resume_from  # nothing saved yet: start over as this attempt began


def _train(
    cfg: RecipeConfig,
    run_dir: Path,
    ranks: Ranks,
    device: Device,
    *,
    render: bool,
    recipe_name: str | None,
    resume_from: Path | None,
) -> dict[str, Any] | None:
    wall_start = time.perf_counter()
    is_rank0 = ranks.rank == 0
    stop_signals = StopSignals(run_dir)
    heartbeat = Heartbeat(
        run_dir, ranks.rank, world_size=ranks.world_size, timeout_s=cfg.launch.timeout_s
    )
    engine, num_ac, optimizer, scheduler, scaler = _build(cfg, ranks, device)
    model = engine.model
    args = engine.inner.args
    layout = BatchLayout(cfg.train.global_batch_size, cfg.train.micro_batch_size, ranks.world_size)
    eval_every = cfg.eval.every_steps
    data, val_data = build_datasets(
        cfg.data, vocab_size=args.vocab_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed,
        with_val=eval_every > 0,
    )  # fmt: skip
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    fpt = flops_per_token(args, cfg.train.seq_len)
    resume_from = _restart_checkpoint(run_dir, resume_from)
    metrics = None
    if is_rank0:
        metrics_path = run_dir / cfg.output.metrics_file
        if restart_count() > 0:
            _drop_steps_after(metrics_path, _checkpoint_step(resume_from))
        metrics = MetricsLog(metrics_path)
        trackers = open_trackers(
            run_dir, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
            resume_step=_checkpoint_step(resume_from), recipe=config_to_dict(cfg),
        )  # fmt: skip
    reporter = Reporter() if (render and is_rank0) else None

    def emit(event: str, **fields: Any) -> None:
        if metrics is not None:
            record_ = metrics.write(event, **fields)
            trackers.handle(record_)
            if reporter is not None:
                reporter.handle(record_)

    emit("start", **_start_fields(cfg, run_dir, ranks, device, engine, num_ac, layout, data,
                                  val_data, recipe_name))  # fmt: skip

    checkpointer = Checkpointer(
        run_dir=run_dir, cfg=cfg.checkpoint, rank=ranks.rank, world_size=ranks.world_size,
        recipe=config_to_dict(cfg),
        process_group=new_checkpoint_group(cfg.checkpoint.async_save),
        warn=lambda message: emit("warning", message=message),
    )  # fmt: skip
    start_step, skipped_total = _restore(
        cfg, resume_from, model, optimizer, scheduler, scaler, ranks, device, emit
    )

    def saved(record: SaveRecord | None) -> None:
        if record is not None:
            emit("checkpoint", **dataclasses.asdict(record))

    def checkpoint_op(op, *, last: bool) -> None:
        """Run a Checkpointer call; a failed save (every rank gets it together) stops the run, or
        with on_save_error=continue training goes on, unless nothing follows to save again."""
        try:
            op()
        except SaveFailed as e:
            go_on = cfg.checkpoint.on_save_error.value == "continue" and not last
            emit("save_error", step=e.step, message=str(e), action="continue" if go_on else "stop")
            if not go_on:
                raise

    def save(step: int) -> None:
        train_state = {
            "step": step,
            "tokens_seen": step * tokens_per_step,
            "data_position": step * cfg.train.global_batch_size,
            "global_batch_size": cfg.train.global_batch_size,
            "world_size": ranks.world_size,
            "skipped_steps": skipped_total,
            "scheduler": scheduler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "tied_params": engine.tied,
        }
        state = build_state(model, optimizer, train_state, ranks.rank)
        record = checkpointer.save(step, state, train_state)
        if not record.async_save:
            saved(record)

    device.reset_peak_memory()
    step_times: list[float] = []
    model_state: dict[str, int] | None = None
    last_logged, skipped_in_row = start_step, 0
    window_start = time.perf_counter()
    loss_value = float("nan")
    val_loss: float | None = None
    stopped: dict[str, Any] | None = None
    fail_at = injected_step("FSDPRUN_FAIL_AT", ranks.rank)
    hang_at = injected_step("FSDPRUN_HANG_AT", ranks.rank)
    nonfinite_at = injected_step("FSDPRUN_NONFINITE_AT", ranks.rank)
    batches = BatchLoader(data, layout, ranks.rank, device.torch_device, steps=cfg.train.steps)
    profiler = StepProfiler(cfg.profile, run_dir=run_dir, rank=ranks.rank,
                            world_size=ranks.world_size, device_kind=device.kind)  # fmt: skip
    freeze_at = {
        phase: injected_step("FSDPRUN_FREEZE_AT", ranks.rank, phase)
        for phase in ("step", "save", "eval")
    }
    for step in range(start_step, cfg.train.steps):
        done = step + 1
        t0 = time.perf_counter()
        while done in hang_at and not stop_signals.requested:
            time.sleep(0.1)  # stops answering: the other ranks' collectives time out
        heartbeat.beat(done)
        if done in fail_at:
            raise RuntimeError(f"injected failure at step {done} (FSDPRUN_FAIL_AT)")
        with heartbeat.watch(done, "step"):
            if done in freeze_at["step"]:
                freeze()
            agreement = StepAgreement(
                stop=stop_signals.requested is not None,
                save_done=checkpointer.in_flight_done(),
                device=device.torch_device,
            )
            loss_sum, grad_norm = _forward_backward(
                engine, optimizer, scaler, batches, layout, step, device, cfg,
                poison=done in nonfinite_at,
            )  # fmt: skip
            agreed = agreement.finish(
                grad_norm=grad_norm, loss_sum=loss_sum, loss_only=scaler is not None
            )
        lr = scheduler.get_last_lr()[0]
        if agreed.nonfinite:
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                # unscale_ found the infs: back the scale off and reset the scaler's per-step
                # state, or the next step's unscale_ refuses to run.
                scaler.update()
            skipped_in_row += 1
            skipped_total += 1
            if cfg.train.nonfinite is NonFinite.abort or skipped_in_row > cfg.train.max_skipped:
                why = (
                    "train.nonfinite is abort"
                    if cfg.train.nonfinite is NonFinite.abort
                    else f"more than train.max_skipped={cfg.train.max_skipped} in a row"
                )
                last = checkpointer.records[-1].path if checkpointer.records else "none"
                raise RuntimeError(
                    f"non-finite loss or gradients at step {done} ({why}); nothing from this "
                    f"step was saved; last checkpoint: {last}"
                )  # fmt: skip
            emit("skip", step=done, skipped_in_row=skipped_in_row, skipped_total=skipped_total)
        else:
            skipped_in_row = 0
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            precompute_scales(model, mode=cfg.precision.float8.value)
            scheduler.step()
            # After the first step the optimizer took: an fp16 grad scaler skips overflowing
            # steps inside scaler.step, before AdamW has any state.
            if model_state is None and optimizer.state:
                model_state = model_state_bytes(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
        device.synchronize()  # a CPU-GPU sync: step times measure the device, not the queue
        step_times.append(time.perf_counter() - t0)

        if agreed.saves_done:
            checkpoint_op(lambda: saved(checkpointer.finish_in_flight()), last=False)
        if agreed.stop or checkpointer.should_save(done, cfg.train.steps):
            save_start = time.perf_counter()
            with heartbeat.watch(done, "save"):
                if done in freeze_at["save"]:
                    freeze()
                # An async save still in flight finishes (or fails) first: at most one at a time.
                checkpoint_op(lambda: saved(checkpointer.wait()), last=False)
                final = agreed.stop or done == cfg.train.steps
                checkpoint_op(lambda: save(done), last=final)  # noqa: B023 (called at once)
            window_start += time.perf_counter() - save_start  # not in tokens/s (as eval)
        if done % cfg.output.log_every == 0 or done == cfg.train.steps or agreed.stop:
            # Logging steps only (the loss is read back here, not every step): every rank
            # reaches this all-reduce at the same steps.
            with heartbeat.watch(done, "step"):
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
            loss_value = loss_sum.item() / (layout.grad_accum_steps * ranks.world_size)
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            window_s = time.perf_counter() - window_start
            emit(
                "step",
                step=done,
                loss=loss_value,
                lr=lr,
                grad_norm=norm.item(),
                tokens_per_s=tokens_per_step * (done - last_logged) / window_s,
                step_time_s=step_times[-1],
                tokens_seen=done * tokens_per_step,
                skipped=agreed.nonfinite,
                memory=device.peak_memory(),
            )
            last_logged, window_start = done, time.perf_counter()
        if eval_every and (done % eval_every == 0 or done == cfg.train.steps):
            eval_start = time.perf_counter()
            with heartbeat.watch(done, "eval"):
                if done in freeze_at["eval"]:
                    freeze()
                val_loss = _evaluate(engine, val_data, layout, cfg.eval.batches, ranks.rank,
                                     device)  # fmt: skip
            emit("eval", step=done, val_loss=val_loss, eval_time_s=time.perf_counter() - eval_start,
                 num_samples=cfg.eval.batches * cfg.train.global_batch_size)  # fmt: skip
            window_start += time.perf_counter() - eval_start  # not in the next tokens/s
        profiler.step()
        if agreed.stop:
            checkpoint_op(lambda: saved(checkpointer.wait()), last=True)
            stopped = {
                "step": done,
                "checkpoint": str(step_dir(run_dir, done)),
                "reason": stop_signals.requested or "another rank was asked to stop",
            }
            emit("stopped", **stopped)
            break

    batches.close()
    profiler.stop()
    checkpoint_op(lambda: saved(checkpointer.wait()), last=True)  # the end waits for a save
    if cfg.train.steps + 1 in fail_at:
        raise RuntimeError("injected failure after the last step (FSDPRUN_FAIL_AT)")
    ranks_info: list[dict[str, Any]] = [{}] * ranks.world_size
    mine = {"rank": ranks.rank, "model_state_bytes": model_state, **device.peak_memory()}
    dist.all_gather_object(ranks_info, mine)
    summary = None
    if is_rank0:
        summary = _summary(
            cfg, run_dir, ranks, device, step_times=step_times, tokens_per_step=tokens_per_step,
            fpt=fpt, ranks_info=ranks_info, loss_value=loss_value, val_loss=val_loss,
            start_step=start_step, skipped_total=skipped_total, stopped=stopped,
            checkpointer=checkpointer, wall_start=wall_start,
        )  # fmt: skip
        if cfg.profile.enabled:  # every rank wrote its trace before the all_gather above
            emit("profile", **profile_record(cfg.profile, run_dir=run_dir,
                                             world_size=ranks.world_size, start_step=start_step))
        emit("summary", **summary)
        metrics.close()
        trackers.close()
    # Every rank says how the run ended: a node's launcher whose ranks do not include rank 0
    # (the rendezvous orders nodes as it likes) must still exit 128 + signal after a stop.
    return summary if is_rank0 else ({"stopped": stopped} if stopped else None)


def _start_fields(
    cfg: RecipeConfig, run_dir: Path, ranks: Ranks, device: Device, engine, num_ac: int,
    layout: BatchLayout, data: Dataset, val_data: Dataset | None, recipe_name: str | None,
) -> dict[str, Any]:  # fmt: skip
    """The `start` event: what the header shows and metrics.jsonl keeps about the run."""
    args = engine.inner.args
    compile_ = cfg.compile
    return {
        "recipe": recipe_name or run_dir.name,
        "fsdprun_version": __version__,
        "torch_version": torch.__version__,
        "run_dir": str(run_dir),
        "world_size": ranks.world_size,
        "nnodes": cfg.launch.nnodes,
        "device_name": device.name(),
        "backend": dist.get_backend(),
        "engine": engine.kind.value,
        "engine_knobs": [dataclasses.asdict(k) for k in engine.knobs],
        "fsdp_units": [u.path or "<root>" for u in engine.units],
        "param_dtype": cfg.precision.param_dtype.value,
        "reduce_dtype": cfg.precision.reduce_dtype.value,
        "activation_checkpointing": (
            f"{cfg.activation_checkpointing.mode.value} ({num_ac} blocks)"
        ),
        "compile": "off" if not compile_.enabled else (
            "per block" if compile_.per_block else "whole model"),
        "loss": describe_loss(cfg.train),
        "float8": describe_float8(cfg.precision.float8.value, engine.inner),
        "num_params": num_params(args),
        "param_bytes": num_params(args) * 4,
        "param_shard_bytes": model_state_bytes(engine.model, None)["params"],
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum_steps": layout.grad_accum_steps,
        "seq_len": cfg.train.seq_len,
        "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len,
        # For the trackers' MFU of each logged step (the summary's is over the whole launch).
        "flops_per_token": flops_per_token(args, cfg.train.seq_len),
        "peak_flops_per_device": peak_flops(
            device.name(), cfg.precision.param_dtype.value, cfg.output.peak_tflops
        )[0],
        "steps": cfg.train.steps,
        "attempt": restart_count(),
        "data": data.description,
        "val_data": val_data.description if val_data is not None else None,
    }  # fmt: skip


def _restore(
    cfg: RecipeConfig, resume_from: Path | None, model, optimizer, scheduler, scaler,
    ranks: Ranks, device: Device, emit,
) -> tuple[int, int]:  # fmt: skip
    """Load a checkpoint to resume from (or `checkpoint.load_from` weights) and say so.

    Returns:
        (the step to start from, non-finite steps skipped so far).
    """
    if resume_from is not None:
        load_start = time.perf_counter()
        resumed = load_checkpoint(resume_from, model, optimizer, rank=ranks.rank)
        device.synchronize()
        load_s = time.perf_counter() - load_start
        start_step = resumed["step"]
        resume_lr_scheduler(scheduler, start_step)  # this recipe's train.steps, not the saved
        if scaler is not None and resumed.get("grad_scaler"):
            scaler.load_state_dict(resumed["grad_scaler"])
        # The data position is a global sample index: the same samples come next at any world
        # size because the global batch is kept.
        assert resumed["data_position"] == start_step * cfg.train.global_batch_size, resumed
        emit("restart" if restart_count() else "resume", step=start_step,
             checkpoint=str(resume_from), load_s=load_s, attempt=restart_count(),
             saved_world_size=resumed["world_size"], world_size=ranks.world_size)  # fmt: skip
        return start_step, resumed.get("skipped_steps", 0)
    if restart_count() > 0:
        emit("restart", step=0, checkpoint=None, attempt=restart_count())
    elif cfg.checkpoint.load_from:
        load_model_weights(Path(cfg.checkpoint.load_from), model)
        emit("load_weights", checkpoint=cfg.checkpoint.load_from)
    return 0, 0


def _summary(
    cfg: RecipeConfig, run_dir: Path, ranks: Ranks, device: Device, *, step_times: list[float],
    tokens_per_step: int, fpt: int, ranks_info: list[dict[str, Any]], loss_value: float,
    val_loss: float | None, start_step: int, skipped_total: int, stopped: dict[str, Any] | None,
    checkpointer: Checkpointer, wall_start: float,
) -> dict[str, Any]:  # fmt: skip
    """The `summary` event: throughput (warm-up steps excluded), per-rank memory, checkpoints."""
    peak, note = peak_flops(device.name(), cfg.precision.param_dtype.value, cfg.output.peak_tflops)
    if cfg.precision.float8.value != "off":
        note = f"{note}; {MFU_CONVENTION}" if note else MFU_CONVENTION
    return {
        "steps": cfg.train.steps,
        # None when this launch ran no step (a restart from the last step's checkpoint).
        "final_loss": loss_value if step_times else None,
        "final_val_loss": val_loss,
        "throughput": throughput(
            step_times,
            warmup_steps=min(cfg.output.timing_warmup_steps, max(0, len(step_times) - 1)),
            tokens_per_step=tokens_per_step,
            world_size=ranks.world_size,
            flops_per_token=fpt,
            peak_flops_per_device=peak,
        ),
        "timing_warmup_steps": cfg.output.timing_warmup_steps,
        "step_times_s": step_times,
        "flops_per_token": fpt,
        "peak_flops_per_device": peak,
        "mfu_note": note,
        "ranks": ranks_info,
        "metrics_file": str(run_dir / cfg.output.metrics_file),
        "wall_time_s": time.perf_counter() - wall_start,
        "start_step": start_step,
        "skipped_steps": skipped_total,
        "stopped": stopped,
        "checkpoints": [dataclasses.asdict(r) for r in checkpointer.records],
    }


def _forward_backward(
    engine, optimizer, scaler, batches, layout, step, device, cfg, *, poison
):
    """Forward and backward over the micro-batches of one step, then unscale and clip.

    Returns:
        (sum of this rank's micro-batch losses, the global gradient norm before clipping).
    """
    loss_sum = torch.zeros((), device=device.torch_device, dtype=torch.float32)
    for micro in range(layout.grad_accum_steps):
        # The last micro-step completes the reduction; what earlier ones reduce is the engine's
        # accumulation mode (sharded engines reduce-scatter every micro-step).
        with engine.micro_step(sync=micro == layout.grad_accum_steps - 1):
            inputs, targets = batches.load(step, micro)  # and the next one starts loading
            with engine.autocast():
                loss = engine.forward_loss(inputs, targets)
            if poison:
                loss = loss * float("inf")
            # Each micro-batch holds the same number of tokens, so averaging micro-losses over
            # accumulation steps (here) and ranks (the engine's gradient reduction) is the
            # global mean.
            scaled = loss / layout.grad_accum_steps
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    return loss_sum, engine.clip_grad_norm(max_norm)


def _evaluate(
    engine, data: Dataset, layout: BatchLayout, num_batches: int, rank: int, device: Device
) -> float:
    """Mean loss over the first `num_batches` global batches of the validation data.

    Every rank runs its share of each batch: the same number of forwards everywhere, so FSDP's
    all-gathers line up, then one all-reduce of the loss sum.
    """
    loss_sum = torch.zeros((), device=device.torch_device, dtype=torch.float32)
    # Eval mode: no dropout (HuggingFace configs may set it); no_grad keeps activations unsaved.
    engine.model.eval()
    with torch.no_grad():
        for batch in range(num_batches):
            for micro in range(layout.grad_accum_steps):
                indices = layout.indices(batch, micro, rank)
                inputs, targets = load_batch(data, indices, device.torch_device)
                with engine.autocast():
                    loss_sum += engine.forward_loss(inputs, targets)
    engine.model.train()
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    return loss_sum.item() / (num_batches * layout.grad_accum_steps * layout.world_size)


def _checkpoint_step(path: Path | None) -> int:
    return read_manifest(path)["step"] if path is not None else 0


def _drop_steps_after(metrics_path: Path, step: int) -> None:
    """After a restart from `step`, records of later steps are replayed: keep each step once.
    The file as it was is kept as metrics.attempt-N.jsonl."""
    if not metrics_path.exists():
        return
    attempt = restart_count()
    backup = metrics_path.with_name(f"{metrics_path.stem}.attempt-{attempt - 1}.jsonl")
    shutil.copyfile(metrics_path, backup)
    replayed = ("step", "checkpoint", "skip", "eval")
    keep = [e for e in read_events(metrics_path) if e["event"] not in replayed or e["step"] <= step]
    tmp = metrics_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in keep))
    tmp.replace(metrics_path)
