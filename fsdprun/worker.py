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
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fsdprun import __version__
from fsdprun.checkpoint import (
    Checkpointer,
    SaveRecord,
    build_state,
    load_checkpoint,
    load_model_weights,
    new_checkpoint_group,
)
from fsdprun.config import Dtype, RecipeConfig, config_to_dict, load_recipe
from fsdprun.data import BatchLayout, build_dataset, load_batch
from fsdprun.device import Device, build_worker_device, resolve_device_kind
from fsdprun.metrics import MetricsLog, peak_flops, throughput
from fsdprun.models import Transformer, build_model_args
from fsdprun.models.llama import flops_per_token, num_params
from fsdprun.optim import build_lr_scheduler, build_optimizer
from fsdprun.parallel import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    init_weights,
    model_state_bytes,
)
from fsdprun.report import Reporter

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
def elastic_entry(run_dir: str, recipe_name: str, resume_from: str | None = None) -> None:
    """Entry point of a worker spawned by the elastic agent: the recipe is RUN_DIR/recipe.yaml."""
    try:
        resume = Path(resume_from) if resume_from else None
        run(Path(run_dir), render=False, recipe_name=recipe_name, resume_from=resume)
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
    """Train one rank. Returns the summary event on rank 0 (None elsewhere).

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
    _set_threads(cfg)
    kind = resolve_device_kind(cfg.launch.device.value)
    device = build_worker_device(kind, ranks.local_rank)
    dist.init_process_group(
        backend=device.backend,
        device_id=device.torch_device if kind != "cpu" else None,
    )
    try:
        _check_same_recipe(cfg)
        return _train(
            cfg, run_dir, ranks, device, render=render, recipe_name=recipe_name,
            resume_from=resume_from,
        )  # fmt: skip
    finally:
        # Free FSDP state (which holds the device mesh) before the process group goes: destroying
        # the group under live DTensors aborts the process at exit now and then.
        gc.collect()
        dist.destroy_process_group()


def _set_threads(cfg: RecipeConfig) -> None:
    # The elastic agent does not set OMP_NUM_THREADS as torchrun does; the launcher exports it.
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def _injected_failure(rank: int) -> int | None:
    """Fault injection for tests and drills: FSDPRUN_FAIL_AT=RANK:STEP makes that rank raise at
    the start of that (1-based) step."""
    spec = os.environ.get("FSDPRUN_FAIL_AT")
    if not spec:
        return None
    fail_rank, fail_step = (int(x) for x in spec.split(":"))
    return fail_step if fail_rank == rank else None


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
    torch.manual_seed(cfg.train.seed)
    mesh = init_device_mesh(device.kind, (ranks.world_size,))
    args = build_model_args(cfg.model)

    with torch.device("meta"):
        model = Transformer(args)
    num_ac = apply_activation_checkpointing(model, cfg=cfg.activation_checkpointing)
    apply_compile(model, cfg=cfg.compile)
    units = apply_fsdp(
        model,
        mesh=mesh,
        cfg=cfg.fsdp,
        param_dtype=cfg.precision.param_dtype,
        reduce_dtype=cfg.precision.reduce_dtype,
        pin_memory=device.kind != "cpu",
    )
    init_weights(model, seed=cfg.train.seed, device=device.torch_device)
    optimizer = build_optimizer(model, cfg=cfg.optim, device_kind=device.kind)
    scheduler = build_lr_scheduler(optimizer, cfg=cfg.schedule, total_steps=cfg.train.steps)
    # fp16 gradients underflow without loss scaling; bf16 and fp32 need none.
    scaler = ShardedGradScaler() if cfg.precision.param_dtype is Dtype.fp16 else None

    layout = BatchLayout(cfg.train.global_batch_size, cfg.train.micro_batch_size, ranks.world_size)
    data = build_dataset(
        cfg.data, vocab_size=args.vocab_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed
    )
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    fpt = flops_per_token(args, cfg.train.seq_len)
    metrics = MetricsLog(run_dir / cfg.output.metrics_file) if is_rank0 else None
    reporter = Reporter() if (render and is_rank0) else None

    def emit(event: str, **fields: Any) -> None:
        if metrics is not None:
            record_ = metrics.write(event, **fields)
            if reporter is not None:
                reporter.handle(record_)

    shard_bytes = model_state_bytes(model, None)["params"]
    emit(
        "start",
        recipe=recipe_name or run_dir.name,
        fsdprun_version=__version__,
        torch_version=torch.__version__,
        run_dir=str(run_dir),
        world_size=ranks.world_size,
        nnodes=cfg.launch.nnodes,
        device_name=device.name(),
        backend=device.backend,
        engine="fsdp2",
        fsdp_units=[u.path or "<root>" for u in units],
        param_dtype=cfg.precision.param_dtype.value,
        reduce_dtype=cfg.precision.reduce_dtype.value,
        activation_checkpointing=f"{cfg.activation_checkpointing.mode.value} ({num_ac} blocks)",
        compile="off" if not cfg.compile.enabled else (
            "per block" if cfg.compile.per_block else "whole model"),
        num_params=num_params(args),
        param_bytes=num_params(args) * 4,
        param_shard_bytes=shard_bytes,
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum_steps=layout.grad_accum_steps,
        seq_len=cfg.train.seq_len,
        tokens_per_step=tokens_per_step,
        steps=cfg.train.steps,
    )  # fmt: skip

    checkpointer = Checkpointer(
        run_dir=run_dir, cfg=cfg.checkpoint, rank=ranks.rank, world_size=ranks.world_size,
        recipe=config_to_dict(cfg),
        process_group=new_checkpoint_group(cfg.checkpoint.async_save),
    )  # fmt: skip
    start_step = 0
    if resume_from is not None:
        load_start = time.perf_counter()
        resumed = load_checkpoint(resume_from, model, optimizer, rank=ranks.rank)
        device.synchronize()
        load_s = time.perf_counter() - load_start
        scheduler.load_state_dict(resumed["scheduler"])
        if scaler is not None and resumed.get("grad_scaler"):
            scaler.load_state_dict(resumed["grad_scaler"])
        start_step = resumed["step"]
        # The data position is a global sample index: the same samples come next at any world
        # size because the global batch is kept.
        assert resumed["data_position"] == start_step * cfg.train.global_batch_size, resumed
        emit("resume", step=start_step, checkpoint=str(resume_from), load_s=load_s,
             saved_world_size=resumed["world_size"], world_size=ranks.world_size)  # fmt: skip
    elif cfg.checkpoint.load_from:
        load_model_weights(Path(cfg.checkpoint.load_from), model)
        emit("load_weights", checkpoint=cfg.checkpoint.load_from)

    def saved(record: SaveRecord | None) -> None:
        if record is not None:
            emit("checkpoint", **dataclasses.asdict(record))

    device.reset_peak_memory()
    step_times: list[float] = []
    model_state: dict[str, int] | None = None
    last_logged = start_step
    window_start = time.perf_counter()
    loss_value = float("nan")
    fail_at = _injected_failure(ranks.rank)
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        if fail_at == step + 1:
            raise RuntimeError(f"injected failure at step {step + 1} (FSDPRUN_FAIL_AT)")
        loss_sum = torch.zeros((), device=device.torch_device, dtype=torch.float32)
        for micro in range(layout.grad_accum_steps):
            last_micro = micro == layout.grad_accum_steps - 1
            # Reduce-scatter gradients only once per optimizer step.
            model.set_requires_gradient_sync(last_micro)
            inputs, targets = load_batch(
                data, layout.indices(step, micro, ranks.rank), device.torch_device
            )
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            # Each micro-batch holds the same number of tokens, so averaging micro-losses over
            # accumulation steps (here) and ranks (FSDP's reduce-scatter) is the global mean.
            scaled = loss / layout.grad_accum_steps
            (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lr = scheduler.get_last_lr()[0]
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        if model_state is None:
            model_state = model_state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        device.synchronize()  # a CPU-GPU sync: step times measure the device, not the queue
        step_times.append(time.perf_counter() - t0)

        done = step + 1
        saved(checkpointer.poll())
        if checkpointer.should_save(done, cfg.train.steps):
            train_state = {
                "step": done,
                "tokens_seen": done * tokens_per_step,
                "data_position": done * cfg.train.global_batch_size,
                "global_batch_size": cfg.train.global_batch_size,
                "world_size": ranks.world_size,
                "scheduler": scheduler.state_dict(),
                "grad_scaler": scaler.state_dict() if scaler is not None else None,
            }
            state = build_state(model, optimizer, train_state, ranks.rank)
            record = checkpointer.save(done, state, train_state)
            if not record.async_save:
                saved(checkpointer.records[-1])
        if done % cfg.output.log_every == 0 or done == cfg.train.steps:
            # The only collective outside FSDP's: every rank reaches it at the same steps.
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
                memory=device.peak_memory(),
            )
            last_logged, window_start = done, time.perf_counter()

    saved(checkpointer.wait())  # the run's end waits for a save in flight
    ranks_info: list[dict[str, Any]] = [{}] * ranks.world_size
    mine = {"rank": ranks.rank, "model_state_bytes": model_state, **device.peak_memory()}
    dist.all_gather_object(ranks_info, mine)
    peak, note = peak_flops(device.name(), cfg.precision.param_dtype.value, cfg.output.peak_tflops)
    summary = None
    if is_rank0:
        summary = {
            "steps": cfg.train.steps,
            "final_loss": loss_value,
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
            "checkpoints": [dataclasses.asdict(r) for r in checkpointer.records],
        }
        emit("summary", **summary)
        metrics.close()
    del model, optimizer, scheduler, checkpointer
    return summary
