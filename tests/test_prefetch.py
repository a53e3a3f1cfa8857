"""The data path prepares the next step's micro-batches while the current step trains, and the
batches are exactly `load_batch`'s; the GPU test checks that non-logging steps never sync with
the host."""

from __future__ import annotations

import threading

import pytest
import torch

from fsdprun.config import load_recipe
from fsdprun.data import BatchLayout, build_datasets, load_batch
from fsdprun.data.prefetch import BatchLoader


class _SlowData:
    """A dataset that records from which thread, and in what order, samples are read."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []
        self.description, self.num_samples = inner.description, inner.num_samples

    def sample(self, index: int) -> torch.Tensor:
        self.reads.append((index, threading.current_thread().name))
        return self.inner.sample(index)


def test_next_step_is_prepared_before_the_step_runs():
    cfg = load_recipe("debug").config
    data, _ = build_datasets(cfg.data, vocab_size=256, seq_len=32, seed=0)
    slow = _SlowData(data)
    layout = BatchLayout(global_batch_size=8, micro_batch_size=2, world_size=2)  # 2 micro-steps
    loader = BatchLoader(slow, layout, rank=1, device=torch.device("cpu"), steps=3)
    for step in range(3):
        got = loader.load_step(step)
        assert got.every_target_trains and got.num_targets() == 2 * 2 * 32
        for micro in range(2):
            expected = load_batch(data, layout.indices(step, micro, 1), torch.device("cpu"))
            assert torch.equal(got.load(micro).inputs, expected.inputs)
            assert torch.equal(got.load(micro).targets, expected.targets)
        # Before this step's first forward: the next step's batches are on their way (or
        # done), read on the loader's thread.
        if step + 1 < 3:
            assert list(loader.pending) == [step + 1]
            loader.pending[step + 1].result(timeout=10)
            following = {i for m in range(2) for i in layout.indices(step + 1, m, 1)}
            threads = {name for index, name in slow.reads if index in following}
            assert threads and all(name.startswith("fsdprun-batch") for name in threads)
        else:
            assert loader.pending == {}  # nothing past the last step
    loader.close()


def test_out_of_order_load_still_gives_the_right_batch():
    cfg = load_recipe("debug").config
    data, _ = build_datasets(cfg.data, vocab_size=256, seq_len=32, seed=0)
    layout = BatchLayout(global_batch_size=4, micro_batch_size=2, world_size=2)
    loader = BatchLoader(data, layout, rank=0, device=torch.device("cpu"), steps=10)
    loader.load_step(0)
    inputs = loader.load_step(5).load(0).inputs  # a resume jumps ahead: the guess is not used
    expected = load_batch(data, layout.indices(5, 0, 0), torch.device("cpu")).inputs
    assert torch.equal(inputs, expected)
    loader.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("recipe", "extra", "port"),
    [
        ("debug", ["train.loss=chunked"], 29533),
        # Packed chat rows on the built-in Llama: a FlexAttention block mask per micro-batch,
        # and the step's trained-target count (one small copy, one all-reduce).
        ("sft-demo", ["model.hf_path=null", "model.init=random", "model.max_seq_len=256"], 29534),
    ],
    ids=["pretraining", "packed-chat"],
)
def test_non_logging_steps_do_not_sync_with_the_host(tmp_path, recipe, extra, port):
    """One rank on CUDA: a step that logs nothing runs under
    torch.cuda.set_sync_debug_mode("error") as the loop runs it: the step's agreement started
    (its flags copied to the device from pinned memory), forward, backward, clip, the flags'
    copy back started, the fused optimizer step queued with the non-finite flag as found_inf,
    then the flags read (an event's wait, which the mode does not count as a sync, since it
    waits for the flags alone)."""
    import os

    import torch.distributed as dist

    from fsdprun.device import build_worker_device
    from fsdprun.train.guard import StepAgreement
    from fsdprun.train.loop import forward_backward, step_num_targets
    from fsdprun.train.worker import Ranks, _build

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")  # fmt: skip
    cfg = load_recipe(recipe, ["launch.device=cuda", "precision.param_dtype=bf16", *extra]).config
    device = build_worker_device("cuda", 0)
    dist.init_process_group("nccl", device_id=device.torch_device)
    try:
        ranks = Ranks(0, 0, 1)
        trainable, _ = _build(cfg, ranks, device)
        engine, optimizer, scheduler = trainable.engine, trainable.optimizer, trainable.scheduler
        layout = BatchLayout(cfg.train.global_batch_size, cfg.train.micro_batch_size, 1)
        data, _ = build_datasets(cfg.data, vocab_size=cfg.model.vocab_size,
                                 seq_len=cfg.train.seq_len, seed=0)  # fmt: skip
        batches = BatchLoader(data, layout, 0, device.torch_device, steps=4)
        for step in range(4):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")  # warm-up first
            try:
                step_batches = batches.load_step(step)
                num_targets = step_num_targets(
                    step_batches, tokens_per_step=cfg.train.global_batch_size * cfg.train.seq_len,
                    device=device.torch_device,
                )  # fmt: skip
                agreement = StepAgreement(stop=False, save_done=True, device=device.torch_device)
                loss_sum, grad_norm = forward_backward(
                    engine, optimizer, trainable.scaler, step_batches, num_targets=num_targets,
                    world_size=1, grad_clip=cfg.train.grad_clip, device=device.torch_device,
                )  # fmt: skip
                pending = agreement.start_read(grad_norm=grad_norm, loss_sum=loss_sum,
                                               loss_only=False)  # fmt: skip
                optimizer.found_inf = pending.nonfinite
                optimizer.step()
                del optimizer.found_inf
                agreed = pending.read()
                assert not agreed.nonfinite and not agreed.stop
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        batches.close()
        del trainable, engine, optimizer
    finally:
        dist.destroy_process_group()
