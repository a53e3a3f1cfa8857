"""FLOPs, MFU, throughput and schedule arithmetic, checked against hand computations."""

from __future__ import annotations

import math

import pytest

from fsdprun.config import Decay, ScheduleConfig, load_recipe
from fsdprun.data import BatchLayout, SyntheticData
from fsdprun.models.llama import build_model_args, flops_per_token, num_matmul_params, num_params
from fsdprun.report.metrics import peak_flops, percentile, throughput
from fsdprun.train.optim import lr_factor


def test_flops_per_token_llama_1b_by_hand():
    args = build_model_args(load_recipe("llama-1b").config.model)
    # per block: wq, wo 2048x2048; wk, wv 2048x1024 (8 kv heads x 128); w1, w2, w3 2048x5632
    block = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5632
    assert block == 47_185_920
    n_matmul = 16 * block + 32000 * 2048  # + output projection
    assert num_matmul_params(args) == n_matmul == 820_510_720
    assert flops_per_token(args, 2048) == 6 * 820_510_720 + 12 * 16 * 2048 * 2048
    assert flops_per_token(args, 2048) == 5_728_370_688


def test_num_params_matches_published_llama3_8b():
    args = build_model_args(load_recipe("llama-8b").config.model)
    assert num_params(args) == 8_030_261_248  # Meta's Llama-3-8B parameter count


def test_throughput_and_mfu():
    t = throughput(
        [10.0, 1.0, 2.0, 1.0], warmup_steps=1, tokens_per_step=4000, world_size=2,
        flops_per_token=10**9, peak_flops_per_device=1e12,
    )  # fmt: skip
    assert t["steps_measured"] == 3
    assert t["tokens_per_s"] == pytest.approx(3000.0)  # 3 x 4000 tokens in 4 s
    assert t["tokens_per_s_per_device"] == pytest.approx(1500.0)
    assert t["tflops_per_device"] == pytest.approx(1.5)  # 1500 tok/s x 1e9 FLOPs
    assert t["mfu"] == pytest.approx(1.5)
    assert t["step_time_p50_s"] == 1.0
    assert t["trained_tokens_per_s"] is None  # no counts given
    masked = throughput(
        [10.0, 1.0, 2.0, 1.0], warmup_steps=1, tokens_per_step=4000, world_size=2,
        flops_per_token=10**9, peak_flops_per_device=1e12, trained_tokens=[9, 500, 700, 800],
    )  # fmt: skip
    # Trained targets of the measured steps only; tokens/s and MFU still count every token.
    assert masked["trained_tokens_per_s"] == pytest.approx(2000 / 4)
    assert masked["tokens_per_s"] == t["tokens_per_s"] and masked["mfu"] == t["mfu"]
    assert throughput([1.0], warmup_steps=5, tokens_per_step=1, world_size=1,
                      flops_per_token=1, peak_flops_per_device=None)["mfu"] is None  # fmt: skip


def test_peak_table_never_guesses():
    assert peak_flops("NVIDIA H200", "bf16", None)[0] == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", None)[0] == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16", None)[0] == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp16", None)[0] == 312e12
    for name, dtype in [("CPU (x86_64)", "bf16"), ("NVIDIA H200", "fp32"), ("Mystery X1", "bf16")]:
        value, why = peak_flops(name, dtype, None)
        assert value is None and "output.peak_tflops" in why
    assert peak_flops("CPU (x86_64)", "fp32", 2.5) == (2.5e12, "output.peak_tflops")


def test_percentile():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("decay", list(Decay))
def test_lr_schedule(decay):
    cfg = ScheduleConfig(warmup_steps=4, decay=decay, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg=cfg, total_steps=14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    end = lr_factor(14, cfg=cfg, total_steps=14)
    assert end == pytest.approx(1.0 if decay is Decay.constant else 0.1)
    mid = lr_factor(9, cfg=cfg, total_steps=14)
    expected = {Decay.constant: 1.0, Decay.linear: 0.55, Decay.cosine: 0.55}[decay]
    assert mid == pytest.approx(expected)


def test_samples_depend_only_on_seed_and_index():
    a = SyntheticData(vocab_size=100, seq_len=16, seed=3, noise=0.1)
    b = SyntheticData(vocab_size=100, seq_len=16, seed=3, noise=0.1)
    assert a.sample(7).equal(b.sample(7)) and a.sample(7).shape == (17,)
    assert not a.sample(7).equal(a.sample(8))
    assert not a.sample(7).equal(
        SyntheticData(vocab_size=100, seq_len=16, seed=4, noise=0.1).sample(7)
    )


@pytest.mark.parametrize("world_size,micro", [(1, 8), (1, 2), (2, 1), (2, 4), (4, 2)])
def test_a_global_step_reads_the_same_samples_at_any_world_size(world_size, micro):
    layout = BatchLayout(global_batch_size=8, micro_batch_size=micro, world_size=world_size)
    for step in (0, 3):
        seen = sorted(
            i for m in range(layout.grad_accum_steps) for r in range(world_size)
            for i in layout.indices(step, m, r)
        )  # fmt: skip
        assert seen == list(range(step * 8, step * 8 + 8))


def test_tracker_rows_carry_trained_tokens_per_s_only_when_the_step_has_it():
    from fsdprun.report.trackers import Rows

    step = {"event": "step", "step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0,
            "tokens_seen": 96, "tokens_per_s": 1000.0, "step_time_s": 0.1}  # fmt: skip
    assert "perf/trained_tokens_per_s" not in Rows(0)(step).scalars
    row = Rows(0)({**step, "trained_tokens": 40, "trained_tokens_per_s": 125.0})
    assert row.step == 3 and row.scalars["perf/trained_tokens_per_s"] == 125.0


class _FakeEvent:
    """A device timing event (torch.cuda.Event's interface) on a clock the test moves, logging
    every call that would wait for the device."""

    clock = 0.0
    waits: list[str] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        _FakeEvent.waits.append("synchronize")

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1000  # milliseconds, as CUDA events give it


def test_step_timer_reads_device_events_only_when_asked():
    from fsdprun.device import StepTimer

    _FakeEvent.clock, _FakeEvent.waits = 0.0, []
    timer = StepTimer(_FakeEvent)
    for duration, gap in [(0.5, 0.0), (0.25, 2.0), (0.125, 0.0)]:
        timer.start()
        _FakeEvent.clock += duration
        timer.stop()
        _FakeEvent.clock += gap  # a save or an eval between steps: not a step's time
    assert _FakeEvent.waits == []  # no host sync while steps run
    assert timer.times() == [0.5, 0.25, 0.125]
    assert _FakeEvent.waits == ["synchronize"]  # one wait, for the last step's end
    assert timer.times() == [0.5, 0.25, 0.125] and _FakeEvent.waits == ["synchronize"]


def test_step_timer_on_the_host_clock_times_each_step():
    import time

    from fsdprun.device import StepTimer

    timer = StepTimer(None)
    timer.start()
    time.sleep(0.02)
    timer.stop()
    time.sleep(0.05)  # between steps: not counted
    timer.start()
    timer.stop()
    first, second = timer.times()
    assert 0.02 <= first < 0.05 and 0 <= second < 0.02
