"""One training worker (one rank): its process lifecycle, the only place that sequences a run.

Started by `fsdprun.launch.elastic` through torch's elastic agent (`elastic_entry`), or directly by
torchrun/srun (`fsdprun train` sees RANK/WORLD_SIZE in the environment). It reads the resolved
recipe, joins the process group, builds and shards the model, restores a checkpoint, hands the
steps to `fsdprun.train.loop`, and on rank 0 writes RUN_DIR/metrics.jsonl and the summary. A
collective that fails is named by the heartbeat (`guard`); the failure goes up to the launcher.

Never imports the CLI or the launcher (they import this module).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fsdprun import __version__
from fsdprun.checkpoint import (
    Checkpointer,
    find_resume_checkpoint,
    load_checkpoint,
    load_model_weights,
    new_checkpoint_group,
    read_manifest,
)
from fsdprun.children import MODE_ENV
from fsdprun.compile_cache import combine_ranks, compile_stats, describe_cache_dir, use_cache_dir
from fsdprun.config import Dtype, ModelConfig, ModelInit, RecipeConfig, config_to_dict, load_recipe
from fsdprun.config.layout import (
    Layout,
    cp_impl,
    cp_zigzag,
    stage_blocks,
)
from fsdprun.config.model_facts import model_facts
from fsdprun.config.schedule import bubble_fraction, in_flight
from fsdprun.data import BatchLayout, Dataset, build_datasets
from fsdprun.device import (
    Device,
    build_worker_device,
    process_group_backend,
    resolve_device_kind,
)
from fsdprun.engines import build_engine
from fsdprun.engines.cp import apply_cp
from fsdprun.engines.ep import ExpertLoad, apply_ep, experts_paths
from fsdprun.engines.float8 import (
    MFU_CONVENTION,
    apply_float8,
    apply_float8_cp,
    check_float8,
    float8_plan,
    float8_tp_styles,
)
from fsdprun.engines.mesh import build_device_mesh, cp_mesh, ep_mesh, tp_mesh
from fsdprun.engines.pp import prune_model, stage_parts, stage_tp_plan
from fsdprun.engines.tp import apply_tp, wait_block_inputs
from fsdprun.engines.transforms import apply_activation_checkpointing, apply_compile
from fsdprun.engines.weights import model_state_bytes
from fsdprun.errors import UserError
from fsdprun.loopback import worker_store_args
from fsdprun.loss import describe_loss
from fsdprun.models import build_model, model_spec
from fsdprun.models.lora import apply_lora, num_trainable_params
from fsdprun.report.console import Reporter
from fsdprun.report.metrics import MetricsLog, drop_steps_after, peak_flops, throughput
from fsdprun.report.trackers import close_on_failure, describe_trackers, open_trackers
from fsdprun.rundir import RunDirWatch, recipe_path, tokenized_dir
from fsdprun.train.guard import Heartbeat, StopSignals, die_with_launcher, restart_count
from fsdprun.train.loop import Events, LoopResult, Trainable, TrainLoop
from fsdprun.train.optim import build_lr_scheduler, build_optimizer, resume_lr_scheduler
from fsdprun.train.profiling import profile_record
from fsdprun.train.state import TrainState


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
    _keep_output_in_log()
    try:
        resume = Path(resume_from) if resume_from else None
        return run(Path(run_dir), render=False, recipe_name=recipe_name, resume_from=resume)
    except BaseException:
        # The agent keeps only the message; the traceback goes to this rank's stderr.log.
        traceback.print_exc()
        raise


def _keep_output_in_log() -> None:
    """Point sys.stdout and sys.stderr at this worker's log files (the agent's redirect of fds 1
    and 2) for the rest of the process. torch gives the fds back to the terminal when the entry
    point returns, before the process ends: what daemon threads or exit hooks printed after
    that (a tracker thread's traceback) reached the terminal, ahead of the launcher's `error:`
    line or glued to it."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        stream.flush()
        # Line-buffered, as the standard streams are, on a copy of the fd that stays the log's.
        kept = os.fdopen(os.dup(fd), "w", buffering=1, encoding=stream.encoding,
                         errors="backslashreplace")  # fmt: skip
        setattr(sys, name, kept)


def run(
    run_dir: Path,
    *,
    render: bool,
    recipe_name: str | None = None,
    cfg: RecipeConfig | None = None,
    resume_from: Path | None = None,
) -> dict[str, Any] | None:
    """Train one rank. Returns the summary event on rank 0 (elsewhere {"stopped": ...} after a
    stop, else None); on every rank {"vanished": {"step", "checkpoint"}} when RUN_DIR was
    deleted or moved under the run (it stopped there, saving nothing).

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
        cfg = load_recipe(str(recipe_path(run_dir)), world_size=ranks.world_size).config
    _set_threads()
    # Before anything compiles (torch reads the variable when it first needs the folder).
    use_cache_dir(cfg.compile.cache_dir)
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
        _check_same_start(cfg, resume_from if restart_count() == 0 else None)
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


def _check_same_start(cfg: RecipeConfig, resume_from: Path | None) -> None:
    """Every rank must train the same recipe (nodes each read their own RUN_DIR/recipe.yaml) from
    the same checkpoint (each node's launcher chose it in the RUN_DIR it sees: `train --resume
    auto` on nodes whose run directories are not one shared folder could choose differently)."""
    data = config_to_dict(cfg)
    # These differ between nodes by design.
    del data["launch"]["node_rank"], data["output"]["run_dir"]
    digest = hashlib.sha256(repr(data).encode()).hexdigest()[:16]
    step = read_manifest(resume_from)["step"] if resume_from is not None else 0
    starts: list[tuple[str, int]] = [("", 0)] * dist.get_world_size()
    dist.all_gather_object(starts, (digest, step))
    if len({d for d, _ in starts}) > 1:
        raise RuntimeError(
            f"ranks were given different recipes (digests {sorted({d for d, _ in starts})}); "
            "start every node with the same recipe and overrides"
        )
    if len({s for _, s in starts}) > 1:
        raise UserError(
            f"the nodes would start from different steps ({sorted({s for _, s in starts})}: "
            "each node's run directory holds other checkpoints); put the run directory on a "
            "volume every node mounts"
        )


@dataclass(frozen=True)
class BuildFacts:
    """What the build did, for the run header."""

    num_ac_blocks: int  # blocks under activation checkpointing
    lora_paths: list[str]  # the Linears LoRA adapted ([]: LoRA off)
    num_trainable_params: int  # counted on the unsharded (meta) model, a tied tensor once


def _build(cfg: RecipeConfig, ranks: Ranks, device: Device) -> tuple[Trainable, BuildFacts]:
    """The wrapped, initialized model (an `Engine`), its optimizer, schedule and (fp16) grad
    scaler; and what the header says of the build."""
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = build_model(cfg.model)
    # LoRA first: the adapters are then checkpointed, compiled and sharded with their blocks.
    lora_paths = apply_lora(model, cfg=cfg.lora)
    # Counted before sharding: an FSDP1 model's parameters are then views of the local shard
    # (and before pipeline parallel keeps this rank's stages only).
    num_trainable = num_trainable_params(model)
    layout = Layout.of(cfg, ranks.world_size)
    facts = model_facts(cfg.model)
    stage_plan, local_stages = None, layout.local_stages(ranks.rank)
    if layout.is_pp:
        # First of all: every transform below then sees this rank's stages only.
        counts = stage_blocks(cfg, facts, model.args.n_layers)
        stage_plan = prune_model(model, stages=facts.entry.stages, counts=counts,
                                 local=local_stages)  # fmt: skip
    # float8 converts Linears before checkpointing, compile and sharding wrap them (torchao).
    check_float8(cfg.precision.float8.value, device.kind)
    f8 = float8_plan(cfg, ranks.world_size)
    apply_float8(model, mode=f8.mode, all_gather=f8.all_gather, skip_small=f8.skip_small)
    # Tensor parallel first of the parallelisms (torchtitan's order): TP, then context
    # parallel's attention, then activation checkpointing (which recomputes the all-to-all
    # with the rest of the block), then per-block compile, then FSDP over the mesh's
    # data-parallel dims (with cp: dp_shard x cp).
    mesh, tp_rows = None, []
    if layout.is_tp or layout.is_cp or layout.is_pp or layout.is_ep:
        mesh = build_device_mesh(layout, device.kind)
    if layout.is_tp:
        plan = stage_tp_plan(model_spec(cfg.model).tp_plan(cfg.model), model)
        float8 = float8_tp_styles(f8.mode, cp=layout.is_cp, device_kind=device.kind)
        tp_rows = apply_tp(model, tp_mesh=tp_mesh(mesh), plan=plan, float8=float8)
    if layout.is_cp:
        apply_cp(model, mesh=cp_mesh(mesh), impl=cp_impl(cfg, facts))
        # A float8 cast's scale is the whole rows', as on one rank (engines/float8.py).
        apply_float8_cp(model, meshes=[cp_mesh(mesh), *([tp_mesh(mesh)] if layout.is_tp else [])])
    # Expert parallel: the experts sharded over the ep dim, their forward the all-to-all.
    # Found before FSDP wraps the blocks (an HF model names its blocks by their class).
    experts = experts_paths(model, facts.entry.experts if facts is not None else None)
    if layout.is_ep:
        apply_ep(model, mesh=ep_mesh(mesh), paths=experts)
    load = None
    if facts is not None and facts.num_experts and experts and not layout.is_pp:
        # The load-balance figures: the tokens each expert receives, logged every log_every
        # (not under pp: a pipeline rank holds some of the layers, and only the last stage
        # runs the loss that counts them; docs/limits.md).
        load = ExpertLoad(
            model, experts, num_experts=facts.num_experts, device=device.torch_device,
            ep_group=ep_mesh(mesh).get_group() if layout.is_ep else None, replicas=layout.tp,
        )  # fmt: skip
    num_ac = apply_activation_checkpointing(model, cfg=cfg.activation_checkpointing)
    apply_compile(model, cfg=cfg.compile)
    if mesh is not None and cfg.compile.enabled and cfg.compile.per_block:
        # The embedding's async redistribute must not reach a compiled block (engines/tp.py).
        wait_block_inputs(model)
    weights = None
    if cfg.model.hf_path is not None and cfg.model.init is ModelInit.pretrained:
        # Imported here: it needs safetensors, which comes with the optional hf extra.
        from fsdprun.engines.hf_weights import HFWeights

        weights = HFWeights(Path(cfg.model.hf_path), model)
    parts = None
    if stage_plan is not None:
        # Each stage of this rank its own FSDP root, after every other transform.
        parts = stage_parts(model, stages=facts.entry.stages, plan=stage_plan,
                            local=local_stages)  # fmt: skip
    engine = build_engine(
        model, cfg, device=device.torch_device, device_kind=device.kind,
        world_size=ranks.world_size, weights=weights, mesh=mesh, tp_plan=tp_rows, parts=parts,
    )  # fmt: skip
    engine.expert_load = load
    # fp16 gradients underflow without loss scaling; bf16 and fp32 need none.
    scaler = engine.grad_scaler() if cfg.precision.param_dtype is Dtype.fp16 else None
    optimizer = build_optimizer(
        engine.model, cfg=cfg.optim, device_kind=device.kind, is_matrix=engine.is_matrix,
        scaler=scaler,
    )  # fmt: skip
    scheduler = build_lr_scheduler(optimizer, cfg=cfg.schedule, total_steps=cfg.train.steps)
    return Trainable(engine, optimizer, scheduler, scaler), BuildFacts(
        num_ac, lora_paths, num_trainable
    )


def _model_counts(cfg: ModelConfig, seq_len: int) -> tuple[int, int]:
    """(parameters, training FLOPs per token) of the model, for the header and MFU."""
    spec = model_spec(cfg)
    return spec.num_params(cfg), spec.flops_per_token(cfg, seq_len)


def _restart_checkpoint(run_dir: Path, resume_from: Path | None) -> Path | None:
    """After an elastic restart, continue from the newest complete checkpoint, if any."""
    if restart_count() == 0:
        return resume_from
    try:
        return find_resume_checkpoint(run_dir)[0].path
    except UserError:
        return resume_from  # nothing saved yet: start over as this attempt began


def _open_events(
    cfg: RecipeConfig, run_dir: Path, ranks: Ranks, *, render: bool, resume_from: Path | None
) -> Events:
    """Rank 0's metrics.jsonl, trackers and (when it renders) console report; other ranks log
    nothing. After a restart, the steps it replays are dropped from metrics.jsonl first."""
    if ranks.rank != 0:
        return Events()
    metrics_path = run_dir / cfg.output.metrics_file
    resume_step = read_manifest(resume_from)["step"] if resume_from is not None else 0
    if restart_count() > 0:
        drop_steps_after(metrics_path, resume_step, attempt=restart_count())
    metrics = MetricsLog(metrics_path)
    trackers = open_trackers(
        run_dir, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
        resume_step=resume_step, recipe=config_to_dict(cfg),
    )  # fmt: skip
    return Events(metrics, trackers, Reporter() if render else None)


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
    """Build, restore, run the loop, and report how the run ended."""
    wall_start = time.perf_counter()
    stop_signals = StopSignals(run_dir)
    watch = RunDirWatch(run_dir)  # nothing is written once RUN_DIR names another folder
    heartbeat = Heartbeat(
        run_dir, ranks.rank, world_size=ranks.world_size, timeout_s=cfg.launch.timeout_s,
        watch=watch,
    )  # fmt: skip
    trainable, facts = _build(cfg, ranks, device)
    # The ranks of a TP x CP group read the same samples (each cp rank keeps its slice).
    parallel = Layout.of(cfg, ranks.world_size)
    layout = BatchLayout.of(parallel, cfg.train, zigzag=cp_zigzag(cfg, model_facts(cfg.model)))
    data, val_data = build_datasets(
        cfg.data, vocab_size=trainable.engine.inner.args.vocab_size, seq_len=cfg.train.seq_len,
        seed=cfg.train.seed, with_val=cfg.eval.every_steps > 0, saved=tokenized_dir(run_dir),
    )  # fmt: skip
    counts = _model_counts(cfg.model, cfg.train.seq_len)
    resume_from = _restart_checkpoint(run_dir, resume_from)
    events = _open_events(cfg, run_dir, ranks, render=render, resume_from=resume_from)
    events.emit("start", **_start_fields(cfg, run_dir, ranks, device, trainable.engine, facts,
                                         layout, data, val_data, recipe_name, counts,
                                         resume_from))  # fmt: skip
    checkpointer = Checkpointer(
        run_dir=run_dir, cfg=cfg.checkpoint, rank=ranks.rank, world_size=ranks.world_size,
        recipe=config_to_dict(cfg),
        process_group=new_checkpoint_group(cfg.checkpoint.async_save), warn=events.warn,
        watch=watch,
    )  # fmt: skip
    start_step, skipped_steps = _restore(cfg, resume_from, trainable, ranks, device, events)
    result = TrainLoop(
        cfg, trainable, run_dir=run_dir, rank=ranks.rank, device=device, data=data,
        val_data=val_data, layout=layout, events=events, checkpointer=checkpointer,
        heartbeat=heartbeat, stop_signals=stop_signals, skipped_steps=skipped_steps, watch=watch,
    ).run(start_step)  # fmt: skip
    if result.vanished_at is not None:
        # Every rank stopped at the same step; the launcher (or rank 0 under torchrun) says it
        # in one line. Its error files would have gone under the vanished RUN_DIR.
        close_on_failure()
        records = checkpointer.records
        last = records[-1].path if records else (str(resume_from) if resume_from else None)
        return {"vanished": {"step": result.vanished_at, "checkpoint": last}}
    ranks_info: list[dict[str, Any]] = [{}] * ranks.world_size
    layout = Layout.of(cfg, ranks.world_size)
    stages = {"stages": layout.local_stages(ranks.rank)} if layout.is_pp else {}
    mine = {"rank": ranks.rank, **stages, "model_state_bytes": result.model_state_bytes,
            **device.peak_memory(), "compile": compile_stats()}  # fmt: skip
    dist.all_gather_object(ranks_info, mine)
    if ranks.rank != 0:
        # Every rank says how the run ended: a node's launcher whose ranks do not include rank 0
        # (the rendezvous orders nodes as it likes) must still exit 128 + signal after a stop.
        return {"stopped": result.stopped} if result.stopped else None
    summary = _summary(
        cfg, run_dir, ranks, device, result, flops_per_token=counts[1], ranks_info=ranks_info,
        start_step=start_step, checkpointer=checkpointer, wall_start=wall_start,
    )  # fmt: skip
    load = trainable.engine.expert_load
    if load is not None and (experts := load.run_summary()) is not None:
        summary["experts"] = experts  # the tokens each expert received over the logged steps
    if cfg.profile.enabled:  # every rank wrote its trace before the all_gather above
        events.emit("profile", **profile_record(cfg.profile, run_dir=run_dir,
                                                world_size=ranks.world_size,
                                                start_step=start_step))  # fmt: skip
    events.emit("summary", **summary)
    events.close()
    return summary


def _start_fields(
    cfg: RecipeConfig, run_dir: Path, ranks: Ranks, device: Device, engine, facts: BuildFacts,
    layout: BatchLayout, data: Dataset, val_data: Dataset | None, recipe_name: str | None,
    counts: tuple[int, int], resume_from: Path | None,
) -> dict[str, Any]:  # fmt: skip
    """The `start` event: what the header shows and metrics.jsonl keeps about the run."""
    num_params_, flops_per_token_ = counts
    compile_, parallel = cfg.compile, Layout.of(cfg, ranks.world_size)
    return {
        "recipe": recipe_name or run_dir.name,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # plot's title
        "fsdprun_version": __version__,
        "torch_version": torch.__version__,
        "run_dir": str(run_dir),
        "world_size": ranks.world_size,
        "nnodes": cfg.launch.nnodes,
        # How this node's `fsdprun` was started (fsdprun.launch.modes), as its launcher decided.
        "launch": os.environ.get(MODE_ENV),
        "device_name": device.name(),
        "backend": dist.get_backend(),
        "engine": engine.kind.value,
        "engine_knobs": [dataclasses.asdict(k) for k in engine.knobs],
        "fsdp_units": [u.path or "<root>" for u in engine.units],
        # The device mesh (dim name, size), outermost first, and the TP plan of every module.
        "mesh": [list(dim) for dim in parallel.mesh_dims],
        "dp": parallel.dp,  # data-parallel ranks: each reads its share of the batch
        "tp": parallel.tp,
        "cp": parallel.cp,
        "ep": parallel.ep,
        "cp_impl": cp_impl(cfg, model_facts(cfg.model)) if parallel.is_cp else None,
        "pp": parallel.pp,
        "pipeline": _pipeline_fields(cfg, parallel, layout.grad_accum_steps, engine),
        "tp_plan": [list(row) for row in engine.tp_plan],
        "param_dtype": cfg.precision.param_dtype.value,
        "reduce_dtype": cfg.precision.reduce_dtype.value,
        "activation_checkpointing": (
            f"{cfg.activation_checkpointing.mode.value} ({facts.num_ac_blocks} blocks)"
        ),
        "compile": "off" if not compile_.enabled else (
            "per block" if compile_.per_block else "whole model"),
        "compile_cache": describe_cache_dir(compile_.cache_dir)
            if compile_.enabled or compile_.cache_dir else None,
        "loss": describe_loss(cfg.train),
        "float8": float8_plan(cfg, ranks.world_size).describe(engine.inner),
        "num_params": num_params_,
        "weights": _describe_weights(cfg, resume_from),
        "num_trainable_params": facts.num_trainable_params,
        "lora": None if not facts.lora_paths else {
            "rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout,
            "targets": list(cfg.lora.targets), "num_modules": len(facts.lora_paths)},
        "param_bytes": num_params_ * 4,
        "param_shard_bytes": model_state_bytes(engine.model, None)["params"],
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum_steps": layout.grad_accum_steps,
        "seq_len": cfg.train.seq_len,
        "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len,
        # For the trackers' MFU of each logged step (the summary's is over the whole launch).
        "flops_per_token": flops_per_token_,
        "peak_flops_per_device": peak_flops(
            device.name(), cfg.precision.param_dtype.value, cfg.output.peak_tflops
        )[0],
        "steps": cfg.train.steps,
        "attempt": restart_count(),
        "data": data.description,
        "val_data": val_data.description if val_data is not None else None,
        "trackers": describe_trackers(
            run_dir, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb),
    }  # fmt: skip


def _pipeline_fields(
    cfg: RecipeConfig, parallel: Layout, micro_batches: int, engine
) -> dict | None:
    """The pipeline in the `start` event (None without pp): its schedule, the blocks of each
    stage, how many micro-batches stage 0 holds in flight, and the schedule's bubble."""
    if not parallel.is_pp:
        return None
    p = cfg.parallel
    return {
        "schedule": p.pp_schedule.value,
        "stages_per_rank": parallel.pp_stages_per_rank,
        "blocks": stage_blocks(cfg, model_facts(cfg.model), engine.inner.args.n_layers),
        "micro_batches": micro_batches,
        "in_flight": in_flight(p.pp_schedule, parallel.pp, micro_batches,
                               parallel.pp_stages_per_rank),
        "bubble": bubble_fraction(p.pp_schedule, parallel.pp, micro_batches,
                                  parallel.pp_stages_per_rank),
    }  # fmt: skip


def _describe_weights(cfg: RecipeConfig, resume_from: Path | None) -> str:
    """Where the weights the run starts from come from (the run header's line)."""
    if cfg.checkpoint.load_from:
        base = f"loaded from {cfg.checkpoint.load_from} (checkpoint.load_from)"
    elif cfg.model.hf_path is None:
        base = f"random init (train.seed={cfg.train.seed})"
    elif cfg.model.init is ModelInit.pretrained:
        base = f"pretrained, read from {cfg.model.hf_path}"
    else:
        base = f"random init (model.init=random, train.seed={cfg.train.seed})"
    if resume_from is None:
        return base
    if cfg.lora.rank > 0:  # a LoRA checkpoint holds the adapters only: the base is rebuilt
        return f"{base}; adapters resumed from {resume_from}"
    return f"resumed from {resume_from}"


def _restore(
    cfg: RecipeConfig, resume_from: Path | None, trainable: Trainable, ranks: Ranks,
    device: Device, events: Events,
) -> tuple[int, int]:  # fmt: skip
    """Load a checkpoint to resume from (or `checkpoint.load_from` weights) and say so.

    Returns:
        (the step to start from, non-finite steps skipped so far).
    """
    model = trainable.engine.model
    if resume_from is not None:
        load_start = time.perf_counter()
        if cfg.lora.rank > 0 and cfg.checkpoint.load_from:
            # A LoRA checkpoint holds the adapters only: rebuild the base as the run did (the
            # build already did a pretrained or seeded base).
            load_model_weights(Path(cfg.checkpoint.load_from), model)
        saved = load_checkpoint(resume_from, model, trainable.optimizer, rank=ranks.rank)
        device.synchronize()
        load_s = time.perf_counter() - load_start
        resumed = TrainState.from_dict(saved)
        # This recipe's train.steps, not the saved: the schedule is a function of the step.
        resume_lr_scheduler(trainable.scheduler, resumed.step)
        if trainable.scaler is not None and resumed.grad_scaler:
            trainable.scaler.load_state_dict(resumed.grad_scaler)
        # The data position is a global sample index: the same samples come next at any world
        # size because the global batch is kept.
        assert resumed.data_position == resumed.step * cfg.train.global_batch_size, saved
        events.emit("restart" if restart_count() else "resume", step=resumed.step,
                    checkpoint=str(resume_from), load_s=load_s, attempt=restart_count(),
                    saved_world_size=resumed.world_size, world_size=ranks.world_size)  # fmt: skip
        return resumed.step, resumed.skipped_steps
    if restart_count() > 0:
        events.emit("restart", step=0, checkpoint=None, attempt=restart_count())
    elif cfg.checkpoint.load_from:
        load_model_weights(Path(cfg.checkpoint.load_from), model)
        events.emit("load_weights", checkpoint=cfg.checkpoint.load_from)
    return 0, 0


def _summary(
    cfg: RecipeConfig, run_dir: Path, ranks: Ranks, device: Device, result: LoopResult, *,
    flops_per_token: int, ranks_info: list[dict[str, Any]], start_step: int,
    checkpointer: Checkpointer, wall_start: float,
) -> dict[str, Any]:  # fmt: skip
    """The `summary` event: throughput (warm-up steps excluded), per-rank memory, checkpoints."""
    peak, note = peak_flops(device.name(), cfg.precision.param_dtype.value, cfg.output.peak_tflops)
    if cfg.precision.float8.value != "off":
        note = f"{note}; {MFU_CONVENTION}" if note else MFU_CONVENTION
    step_times = result.step_times_s
    compiled = combine_ranks([r["compile"] for r in ranks_info])
    if not cfg.compile.enabled and (compiled is None or not compiled["time_s"]):
        compiled = None  # nothing compiled: no row in the summary
    return {
        "steps": cfg.train.steps,
        # None when this launch ran no step (a restart from the last step's checkpoint).
        "final_loss": result.loss if step_times else None,
        "final_val_loss": result.val_loss,
        "throughput": throughput(
            step_times,
            warmup_steps=min(cfg.output.timing_warmup_steps, max(0, len(step_times) - 1)),
            tokens_per_step=cfg.train.global_batch_size * cfg.train.seq_len,
            world_size=ranks.world_size,
            flops_per_token=flops_per_token,
            peak_flops_per_device=peak,
            trained_tokens=result.trained_tokens,
        ),
        "timing_warmup_steps": cfg.output.timing_warmup_steps,
        "step_times_s": step_times,
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": peak,
        "mfu_note": note,
        "ranks": ranks_info,
        "metrics_file": str(run_dir / cfg.output.metrics_file),
        "wall_time_s": time.perf_counter() - wall_start,
        # Seconds compiling (slowest rank) and the compile caches' hits and misses (all ranks).
        "compile": compiled,
        "start_step": start_step,
        "skipped_steps": result.skipped_steps,
        "stopped": result.stopped,
        "checkpoints": [dataclasses.asdict(r) for r in checkpointer.records],
    }
