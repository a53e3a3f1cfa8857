"""The second, minimal plain loop `scripts/bench.py --minimal` runs: a check on the first.

`plain_fsdp2.py` is the reference every fsdprun side is measured against, so its own speed must
be trusted. This loop is written separately and as short as an expert's first version: the same
model and data, `fully_shard` per block then the root with the same mixed precision, per-block
`torch.compile` and torchao float8 as the spec says, fused AdamW at a constant learning rate,
clipping, one micro-batch a step (no accumulation, no activation checkpointing: bench refuses
the check otherwise). Timing is CUDA events around the measured steps (on CPU, wall time), with
no host sync in between. Its tokens/s should match plain_fsdp2's within the run's noise; a gap
means one of the two loops does work the other does not.
"""

from __future__ import annotations

import gc
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plain_fsdp2 import PlainSpec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdprun.data import SyntheticData
from fsdprun.models.llama import Transformer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _train(spec: PlainSpec, device: torch.device) -> dict | None:
    world = dist.get_world_size()
    assert spec.global_batch_size == spec.micro_batch_size * world, "one micro-batch a step"
    with torch.device("meta"):
        model = Transformer(spec.model_args)
    if spec.float8 != "off":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(spec.float8),
            module_filter_fn=lambda m, fqn: fqn != "output" and m.weight.shape[0] % 16 == 0
            and m.weight.shape[1] % 16 == 0,
        )  # fmt: skip
    mesh = init_device_mesh(device.type, (world,))
    param_dtype = None if spec.param_dtype == "fp32" else DTYPES[spec.param_dtype]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[spec.reduce_dtype])
    blocks = list(model.layers.values())
    for block in blocks:
        if spec.compile:
            block.compile()
        # The last block's parameters are the first backward needs: kept, not gathered twice.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block is not blocks[-1])
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).normal_(0.0, 0.02)
    model.init_buffers(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=spec.betas, eps=spec.eps,
        weight_decay=spec.weight_decay, fused=spec.optim_impl == "fused",
    )  # fmt: skip
    data = SyntheticData(vocab_size=spec.model_args.vocab_size, seq_len=spec.seq_len,
                         seed=spec.seed, noise=spec.noise)  # fmt: skip
    b, rank = spec.micro_batch_size, dist.get_rank()
    first = [(step * world + rank) * b for step in range(spec.steps)]
    batches = [torch.stack([data.sample(i) for i in range(f, f + b)]) for f in first]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    warmup = min(spec.timing_warmup_steps, spec.steps - 1)
    for step in range(spec.steps):
        if step == warmup:
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            wall = time.perf_counter()
        tokens = batches[step].to(device, non_blocking=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if cuda:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        window_s = start.elapsed_time(end) / 1000
    else:
        window_s = time.perf_counter() - wall
    measured = spec.steps - warmup
    final = loss.detach()
    dist.all_reduce(final)
    # The device's peak; on CPU the process's peak resident set (ru_maxrss is KiB on Linux).
    peak = (torch.cuda.max_memory_allocated(device) if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    del model, optimizer
    if rank != 0:
        return None
    return {
        "tokens_per_s": spec.global_batch_size * spec.seq_len * measured / window_s,
        "peak_memory_bytes": peak,
        "final_loss": final.item() / world,
        "steps_measured": measured,
    }


@record
def worker(spec: PlainSpec) -> dict | None:
    """One rank of the minimal loop. Returns the results on rank 0, None elsewhere."""
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cuda = spec.device_kind == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    try:
        return _train(spec, device)
    finally:
        gc.collect()
        dist.destroy_process_group()
