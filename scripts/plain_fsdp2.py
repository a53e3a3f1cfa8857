"""A plain, hand-written FSDP2 training loop: the baseline `scripts/bench.py` measures fsdprun
against.

It deliberately shares nothing with fsdprun's engine (config, parallel, optim, worker): only the
model architecture and the synthetic dataset are imported, so both sides do identical work. The
rest is torch used directly, the way one would write it by hand: process group, 1-D mesh,
meta-device model, optional float8 (torchao's own recipe config, converted before sharding),
optional activation checkpointing and per-block torch.compile, `fully_shard` per block then the
root, `to_empty` + a simple init, AdamW, gradient accumulation with
`set_requires_gradient_sync`, clipping. No host sync inside the timed steps: the device is
synchronized once where timing starts (after the warm-up steps) and once at the end, and tokens/s
is the window's. Not run on its own: `bench.py` starts `worker` on every rank through
`elastic_launch`.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fsdprun.data import SyntheticData
from fsdprun.models.llama import ModelArgs, Transformer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PlainSpec:
    """Everything the plain loop needs, in plain values (pickled to every spawned rank)."""

    model_args: ModelArgs
    device_kind: str  # "cpu" or "cuda"
    param_dtype: str  # "bf16" | "fp16" | "fp32"
    reduce_dtype: str
    reshard_after_forward: bool
    ac_mode: str  # "none" | "full" | "every_n"
    ac_every_n: int
    compile: bool
    compile_per_block: bool
    compile_fullgraph: bool
    compile_mode: str | None  # None = torch.compile's default
    optim_impl: str  # "fused" | "foreach" | "for_loop"
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    decay: str  # "cosine" | "linear" | "constant"
    min_lr_ratio: float
    steps: int
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    grad_clip: float
    seed: int
    noise: float
    timing_warmup_steps: int
    float8: str = "off"  # "off" | "tensorwise" | "rowwise": torchao's recipe config as it is
    float8_skip_small: bool = False  # torchao's own filter of Linears too small to gain
    # A torch.profiler Chrome trace of rank 0 (None: no profiler), as fsdprun's `profile.*`:
    # `profile_wait` steps, one warm-up step, `profile_active` steps recorded.
    profile_trace: str | None = None
    profile_wait: int = 1
    profile_active: int = 2


def _lr_factor(step: int, spec: PlainSpec) -> float:
    """Linear warm-up, then cosine/linear/constant decay to min_lr_ratio (fsdprun's schedule)."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.decay == "constant":
        return 1.0
    progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps))
    shape = 1.0 - progress if spec.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * shape


def _convert_float8(model: Transformer, spec: PlainSpec) -> None:
    """torchao's float8 training with the recipe's default config (no float8 all-gather), on
    every Linear but the output projection whose dims are multiples of 16 (or torchao's own
    filter of small Linears)."""
    from torchao.float8 import (
        Float8LinearConfig,
        _auto_filter_for_recipe,
        convert_to_float8_training,
    )

    if spec.float8_skip_small:
        keep = _auto_filter_for_recipe(spec.float8, filter_fqns=["output"])
    else:

        def keep(module: torch.nn.Module, fqn: str) -> bool:
            n, k = module.weight.shape
            return fqn != "output" and n % 16 == 0 and k % 16 == 0

    config = Float8LinearConfig.from_recipe_name(spec.float8)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)


def _build_model(spec: PlainSpec, device: torch.device) -> Transformer:
    mesh = init_device_mesh(spec.device_kind, (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(spec.model_args)
    if spec.float8 != "off":
        _convert_float8(model, spec)
    blocks = list(model.layers.values())
    # Same order as torchtitan (and fsdprun): checkpoint wraps the block's forward, compile wraps
    # that, and fully_shard's hooks go around the whole so all-gathers stay outside the graphs.
    for i, block in enumerate(blocks):
        if spec.ac_mode == "full" or (spec.ac_mode == "every_n" and i % spec.ac_every_n == 0):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if spec.compile:
        for module in blocks if spec.compile_per_block else [model]:
            module.forward = torch.compile(
                module.forward, fullgraph=spec.compile_fullgraph, mode=spec.compile_mode
            )
    mp = MixedPrecisionPolicy(
        param_dtype=None if spec.param_dtype == "fp32" else DTYPES[spec.param_dtype],
        reduce_dtype=DTYPES[spec.reduce_dtype],
    )
    for i, block in enumerate(blocks):
        # As torchtitan does: the last block's parameters are needed first in backward, so
        # resharding them after forward would only buy an immediate second all-gather.
        reshard = spec.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=spec.reshard_after_forward)

    model.to_empty(device=device)
    with torch.no_grad():
        # Throughput does not depend on the values: a normal init per local shard is enough.
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    model.init_buffers(device)  # the RoPE table: garbage after to_empty
    return model


def _build_optimizer(model: Transformer, spec: PlainSpec) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        **impl[spec.optim_impl],
    )


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is KiB on Linux: the whole process's peak, torch runtime included.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a CPU-GPU sync: step times measure the device


def _profiler(spec: PlainSpec, device: torch.device):
    if spec.profile_trace is None:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(
        activities=activities,
        schedule=schedule(wait=spec.profile_wait, warmup=1, active=spec.profile_active),
        on_trace_ready=lambda p: p.export_chrome_trace(spec.profile_trace),
        record_shapes=True,
    )
    prof.start()
    return prof


def _train(spec: PlainSpec, device: torch.device) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed)
    model = _build_model(spec, device)
    optimizer = _build_optimizer(model, spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, spec))
    scaler = ShardedGradScaler() if spec.param_dtype == "fp16" else None
    data = SyntheticData(
        vocab_size=spec.model_args.vocab_size, seq_len=spec.seq_len, seed=spec.seed,
        noise=spec.noise,
    )  # fmt: skip
    accum = spec.global_batch_size // (spec.micro_batch_size * world)
    max_norm = spec.grad_clip if spec.grad_clip > 0 else float("inf")

    # The step's samples, made before the loop (as a data loader's workers would have them
    # ready): global step g, micro-step m, rank r read samples g*B + (m*W + r)*b ... + b - 1.
    batches = []
    for step in range(spec.steps):
        for micro in range(accum):
            start = step * spec.global_batch_size + (micro * world + rank) * spec.micro_batch_size
            tokens = torch.stack(
                [data.sample(i) for i in range(start, start + spec.micro_batch_size)]
            )
            batches.append(tokens.pin_memory() if device.type == "cuda" else tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup = min(spec.timing_warmup_steps, spec.steps - 1)
    step_times: list[float] = []  # host time to queue each step (the device may lag behind)
    prof = _profiler(spec, device) if rank == 0 else None
    for step in range(spec.steps):
        if step == warmup:
            _sync(device)  # timing starts with nothing queued
            window_start = time.perf_counter()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            tokens = batches[step * accum + micro].to(device, non_blocking=True)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            scaled = loss / accum
            (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.step()
    _sync(device)
    if prof is not None:
        prof.stop()
    window_s = time.perf_counter() - window_start
    measured = spec.steps - warmup

    dist.all_reduce(loss_sum)
    final_loss = loss_sum.item() / (accum * world)
    tokens_per_s = spec.global_batch_size * spec.seq_len * measured / window_s
    # Peak memory of the worst rank: the one that decides whether a run fits.
    peak = torch.tensor([_peak_memory_bytes(device)], dtype=torch.int64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del model, optimizer, scheduler
    if rank != 0:
        return None
    return {
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes": int(peak.item()),
        "final_loss": final_loss,
        "steps_measured": measured,
        "host_step_times_s": step_times,
    }


@record
def worker(spec: PlainSpec) -> dict | None:
    """One rank of the plain loop. Returns the results on rank 0, None elsewhere."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    if spec.device_kind == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    try:
        return _train(spec, device)
    finally:
        # FSDP state holds the device mesh: free it before the process group goes, or the
        # process aborts at exit now and then.
        gc.collect()
        dist.destroy_process_group()
