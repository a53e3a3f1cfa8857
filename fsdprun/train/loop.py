"""The training loop of one rank: the step (forward and backward over a global batch's
micro-batches, then the optimizer step or, for a non-finite one, a skip), evaluation, the logged
figures and the save policy.

`fsdprun.train.worker` sets up the process group, the model, the data and the checkpointer, then
calls `TrainLoop.run`. Every decision that changes control flow (stop, skip a non-finite step,
finish an async save) comes from the step's `StepAgreement`, so every rank reaches the same
collectives in the same order.

The loss is computed in one place, `micro_loss(engine, batch)`, from one `Batch`: what the
training step and evaluation feed the model and the loss function goes through there. It is a
sum of token losses; the step divides it by N, the global count of the step's trained targets
(`step_num_targets`), so that the step loss and its gradients are the global token mean however
many targets each micro-batch and rank holds (fine-tuning data masks prompts and padding).

Never imports the launcher, the CLI or the console report: events leave through `Events`.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdprun.checkpoint import Checkpointer, SaveFailed, SaveRecord, build_state, step_dir
from fsdprun.config import NonFinite, RecipeConfig
from fsdprun.data import Batch, BatchLayout, Dataset, load_batch
from fsdprun.data.prefetch import BatchLoader, StepBatches
from fsdprun.device import Device, StepTimer
from fsdprun.engines.float8 import float8_plan, precompute_scales
from fsdprun.engines.weights import model_state_bytes
from fsdprun.loss import num_targets as count_targets
from fsdprun.report.metrics import MetricsLog
from fsdprun.rundir import RunDirVanished, RunDirWatch
from fsdprun.train.guard import (
    Agreement,
    Heartbeat,
    StepAgreement,
    StopSignals,
    freeze,
    injected_step,
)
from fsdprun.train.profiling import StepProfiler
from fsdprun.train.state import TrainState


def micro_loss(engine, batch: Batch) -> torch.Tensor:
    """Summed token loss of one micro-batch over its trained targets, under the engine's autocast
    (training and eval)."""
    with engine.autocast():
        return engine.forward_loss(batch)


def step_num_targets(
    batches: StepBatches, *, tokens_per_step: int, device: torch.device, tp: int = 1, pp: int = 1
) -> int | torch.Tensor:
    """N, the global count of the step's trained targets: what the step's summed token losses
    are divided by, so that the loss is the global token mean whatever the masks.

    Windows and synthetic data train every target: N is the global batch's token count, known
    without reading or communicating. Fine-tuning data: this rank's count over its micro-batches
    (read on the host, no device sync), all-reduced (SUM) once per step, before the first
    backward. At least 1: a step without any trained target adds zero gradients, not 0/0.
    The `tp` ranks of a tensor-parallel group hold the same batch: the sum over all ranks counts
    each target tp times, and the `pp` stages of a pipeline too read the same batch (pp times).
    The cp ranks of a context-parallel group each count their own slice of the rows: the sum
    counts each target once.
    """
    if batches.every_target_trains:
        return tokens_per_step
    # int64: exact at any batch size (fp32 counts round beyond 2**24 tokens a step). `full` fills
    # on the device from a kernel argument; `torch.tensor(n, device=cuda)` copies from pageable
    # host memory, a synchronizing copy (caught by set_sync_debug_mode on an H200).
    count = torch.full((), batches.num_targets(), dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return (count // (tp * pp)).clamp(min=1)


def forward_backward(
    engine, optimizer, scaler, batches: StepBatches, *, num_targets: int | torch.Tensor,
    world_size: int, grad_clip: float, device: torch.device, poison: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward and backward over one step's micro-batches, then unscale (fp16) and clip
    (`grad_clip` 0: measure the norm only). `poison` makes the loss infinite (a drill).

    Args:
        num_targets: N, the step's global count of trained targets (`step_num_targets`).
        world_size: the ranks the engine divides reduced gradients by (data-parallel ranks x
            cp: `BatchLayout.reduce_ranks`).

    Returns:
        (the sum of this rank's token losses, the global gradient norm before clipping).
    """
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    # The engines average gradients over ranks (they divide the reduced sum by the data-parallel
    # world size), so backward on `sum * world_size / N` leaves the gradient of the global token
    # mean, sum over every rank and micro-batch / N. With every target trained this is
    # mean / num_micro, the same number (N and the divisors are powers of two in practice).
    scale = world_size / num_targets
    num_micro = len(batches.host)
    if engine.pipeline is not None:
        # The pipeline's schedule runs the micro-batches through this rank's stages, each
        # last-stage loss scaled as below; the loss sum is zero off the last stage.
        micro = [batches.load(i) for i in range(num_micro)]
        with engine.loss_context():
            loss_sum = engine.pipeline.forward_backward(micro, scale=scale, scaler=scaler,
                                                        poison=poison)  # fmt: skip
        num_micro = 0
    for micro in range(num_micro):
        # The last micro-step completes the reduction; what earlier ones reduce is the engine's
        # accumulation mode (sharded engines reduce-scatter every micro-step). Tensor parallel:
        # forward and backward of the loss run under loss parallel.
        with engine.micro_step(sync=micro == num_micro - 1), engine.loss_context():
            loss = micro_loss(engine, batches.load(micro))
            if poison:
                loss = loss * float("inf")
            scaled = loss * scale
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    return loss_sum, engine.clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))


def evaluate(
    engine, data: Dataset, layout: BatchLayout, *, num_batches: int, rank: int, device: Device
) -> float:
    """Token mean loss over the first `num_batches` global batches of the validation data.

    Every rank (`rank`: the global one) runs its share of each batch: the same number of
    forwards everywhere, so FSDP's all-gathers line up, then one all-reduce of the loss sum and
    the count of trained targets (under context parallel both over this rank's slice).
    """
    totals = torch.zeros(2, device=device.torch_device, dtype=torch.float32)  # loss sum, count
    # Eval mode: no dropout (HuggingFace configs may set it); no_grad keeps activations unsaved.
    engine.model.eval()
    # Tensor parallel: every rank of a TP group adds the same sums, which leaves their ratio.
    pipeline = engine.pipeline
    with torch.no_grad(), engine.loss_context():
        for index in range(num_batches):
            micro = []
            for m in range(layout.grad_accum_steps):
                indices = layout.indices(index, m, layout.data_rank(rank))
                micro.append(layout.local(load_batch(data, indices, device.torch_device), rank))
            if pipeline is not None:
                # The loss is on the last stage's ranks: the others add nothing to either sum.
                totals[0] += pipeline.evaluate(micro)
                if pipeline.has_last:
                    totals[1] += sum(count_targets(batch.targets) for batch in micro)
                continue
            for batch in micro:
                totals[0] += micro_loss(engine, batch)
                totals[1] += count_targets(batch.targets)
    engine.model.train()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    loss_sum, count = totals.tolist()
    return loss_sum / max(count, 1.0)


def as_counts(values: list[int | torch.Tensor]) -> list[int]:
    """Per-step counts of trained targets as host integers (one device read for the tensors)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return list(values)
    host = iter(torch.stack(tensors).tolist())
    return [next(host) if isinstance(v, torch.Tensor) else v for v in values]


class Events:
    """Where the run's events go: on rank 0 a line of metrics.jsonl each, handed on to the
    trackers and (when this process renders) the console report; other ranks have none."""

    def __init__(self, metrics: MetricsLog | None = None, trackers=None, reporter=None):
        self.metrics, self.trackers, self.reporter = metrics, trackers, reporter

    def emit(self, event: str, **fields: Any) -> None:
        if self.metrics is not None:
            record = self.metrics.write(event, **fields)
            self.trackers.handle(record)
            if self.reporter is not None:
                self.reporter.handle(record)
            self._tracker_warnings()

    def warn(self, message: str) -> None:
        self.emit("warning", message=message)

    def _tracker_warnings(self) -> None:
        # A tracker that could not write was dropped (it warns once; the run goes on).
        for message in self.trackers.take_warnings():
            self.warn(message)

    def close(self) -> None:
        if self.metrics is not None:
            self.trackers.close()  # first: a tracker's last write that fails is still logged
            self._tracker_warnings()
            self.metrics.close()


@dataclass(frozen=True)
class Trainable:
    """What a step updates: the wrapped model (an `Engine`), its optimizer, the lr schedule and
    (fp16 only) the grad scaler."""

    engine: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Any | None


class Saves:
    """Checkpoint saves from the loop, each reported as a `checkpoint` event once it is on disk.

    A failed save fails on every rank together (`SaveFailed`): it stops the run, or with
    `checkpoint.on_save_error: continue` training goes on, unless nothing follows to save again.
    """

    def __init__(self, checkpointer: Checkpointer, events: Events, trainable: Trainable, *,
                 rank: int, go_on_after_error: bool, adapters_only: bool):  # fmt: skip
        self.checkpointer, self.events, self.trainable = checkpointer, events, trainable
        self.rank, self.go_on_after_error = rank, go_on_after_error
        self.adapters_only = adapters_only  # LoRA: the frozen base is not saved

    def wait(self, *, last: bool) -> None:
        """Wait for the async save in flight, if any."""
        with self._failure_policy(last=last):
            self._saved(self.checkpointer.wait())

    def save(self, train_state: TrainState, *, last: bool) -> None:
        with self._failure_policy(last=last):
            record = train_state.to_dict()
            t = self.trainable
            state = build_state(t.engine.model, t.optimizer, record, self.rank,
                                adapters_only=self.adapters_only)  # fmt: skip
            saved = self.checkpointer.save(train_state.step, state, record)
            if not saved.async_save:
                self._saved(saved)

    def _saved(self, record: SaveRecord | None) -> None:
        if record is not None:
            self.events.emit("checkpoint", **dataclasses.asdict(record))

    @contextmanager
    def _failure_policy(self, *, last: bool):
        try:
            yield
        except SaveFailed as e:
            go_on = self.go_on_after_error and not last
            self.events.emit(
                "save_error", step=e.step, message=str(e), action="continue" if go_on else "stop"
            )
            if not go_on:
                raise


@dataclass
class LoopResult:
    """What the run's summary needs from the loop."""

    step_times_s: list[float]
    loss: float  # the last logged (nan when no step was logged)
    val_loss: float | None
    skipped_steps: int  # non-finite steps skipped, the resumed run's included
    model_state_bytes: dict[str, int] | None  # after the first step the optimizer took
    stopped: dict[str, Any] | None  # the `stopped` event after an agreed stop
    trained_tokens: list[int]  # per step of step_times_s: the global count of trained targets
    vanished_at: int | None = None  # the step at which every rank found RUN_DIR gone


class _Faults:
    """The steps at which this rank misbehaves on purpose (FSDPRUN_*_AT; tests and drills)."""

    def __init__(self, rank: int):
        self.fail = injected_step("FSDPRUN_FAIL_AT", rank)
        self.hang = injected_step("FSDPRUN_HANG_AT", rank)
        self.nonfinite = injected_step("FSDPRUN_NONFINITE_AT", rank)
        self.freeze = {
            phase: injected_step("FSDPRUN_FREEZE_AT", rank, phase)
            for phase in ("step", "save", "eval")
        }

    def freeze_at(self, step: int, phase: str) -> None:
        if step in self.freeze[phase]:
            freeze()


@dataclass(frozen=True)
class _Step:
    agreed: Agreement
    loss_sum: torch.Tensor
    num_targets: int | torch.Tensor  # N, the step's global count of trained targets
    grad_norm: torch.Tensor
    lr: float  # the step's, read before the schedule moves on


class TrainLoop:
    """Steps `start_step + 1` .. `train.steps` of one rank (1-based), with evaluation, logging and
    saves, until the end or an agreed stop."""

    def __init__(
        self, cfg: RecipeConfig, trainable: Trainable, *, run_dir: Path, rank: int,
        device: Device, data: Dataset, val_data: Dataset | None, layout: BatchLayout,
        events: Events, checkpointer: Checkpointer, heartbeat: Heartbeat,
        stop_signals: StopSignals, skipped_steps: int, watch: RunDirWatch | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.t, self.run_dir, self.rank = cfg, trainable, run_dir, rank
        self.device, self.data, self.val_data, self.layout = device, data, val_data, layout
        self.events, self.checkpointer = events, checkpointer
        self.heartbeat, self.stop_signals, self.watch = heartbeat, stop_signals, watch
        self.saves = Saves(
            checkpointer, events, trainable, rank=rank,
            go_on_after_error=cfg.checkpoint.on_save_error.value == "continue",
            adapters_only=cfg.lora.rank > 0,
        )  # fmt: skip
        self.tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        self.timer = StepTimer.for_device(device)
        self.trained: list[int | torch.Tensor] = []  # N of each step, read when logged
        self.skipped_in_row, self.skipped_total = 0, skipped_steps
        self.model_state: dict[str, int] | None = None
        self.loss, self.val_loss = float("nan"), None
        self.last_logged, self.window_start = 0, 0.0
        self.faults = _Faults(rank)
        # tensorwise float8 with float8 all-gather: the weights' scales after each update.
        self.float8_all_gather = float8_plan(cfg, layout.num_ranks).all_gather
        # Data by data-parallel rank (the ranks of a TP x CP group read the same samples), each
        # cp rank keeping its slice of the sequence.
        self.batches = BatchLoader(data, layout, rank, device.torch_device,
                                   steps=cfg.train.steps)  # fmt: skip

    def run(self, start_step: int) -> LoopResult:
        cfg = self.cfg
        self.device.reset_peak_memory()
        self.last_logged, self.window_start = start_step, time.perf_counter()
        stopped = None
        profiler = StepProfiler(cfg.profile, run_dir=self.run_dir, rank=self.rank,
                                world_size=self.layout.num_ranks, device_kind=self.device.kind,
                                start_step=start_step,
                                warn=self.events.warn if self.rank == 0 else None)  # fmt: skip
        # The first step's scales too (initialized or restored weights): without them torchao
        # scales each weight over FSDP's shards only, which under TP are one TP shard's.
        precompute_scales(self.t.engine.model, all_gather=self.float8_all_gather)
        try:
            for step in range(start_step, cfg.train.steps):
                done = step + 1
                result = self._step(step)
                if result.agreed.vanished:
                    raise RunDirVanished(done)
                self._save_if_due(
                    done, stop=result.agreed.stop, saves_done=result.agreed.saves_done
                )
                if (
                    done % cfg.output.log_every == 0
                    or done == cfg.train.steps
                    or result.agreed.stop
                ):
                    self._log(done, result)
                if cfg.eval.every_steps and (
                    done % cfg.eval.every_steps == 0 or done == cfg.train.steps
                ):
                    self._evaluate(done)
                profiler.step()
                if result.agreed.stop:
                    stopped = self._stop(done)
                    break
            self.saves.wait(last=True)  # the end waits for a save
        except RunDirVanished as e:
            # Every rank raised it at the same step (agreed, or found by the save's own check):
            # no save, no trace, no summary under a path that may now be someone else's folder.
            self.batches.close()
            return LoopResult(self.step_times, self.loss, self.val_loss, self.skipped_total,
                              self.model_state, None, as_counts(self.trained),
                              vanished_at=e.step)  # fmt: skip
        self.batches.close()
        profiler.stop()
        if cfg.train.steps + 1 in self.faults.fail:
            raise RuntimeError("injected failure after the last step (FSDPRUN_FAIL_AT)")
        return LoopResult(self.step_times, self.loss, self.val_loss, self.skipped_total,
                          self.model_state, stopped, as_counts(self.trained))  # fmt: skip

    @property
    def step_times(self) -> list[float]:
        return self.timer.times()

    def _step(self, step: int) -> _Step:
        done = step + 1
        self.timer.start()
        while done in self.faults.hang and not self.stop_signals.requested:
            time.sleep(0.1)  # stops answering: the other ranks' collectives time out
        self.heartbeat.beat(done)
        if done in self.faults.fail:
            raise RuntimeError(f"injected failure at step {done} (FSDPRUN_FAIL_AT)")
        t = self.t
        with self.heartbeat.watch(done, "step"):
            self.faults.freeze_at(done, "step")
            agreement = StepAgreement(
                stop=self.stop_signals.requested is not None,
                save_done=self.checkpointer.in_flight_done(),
                device=self.device.torch_device,
                vanished=self.watch is not None and self.watch.vanished(),  # one stat a step
            )
            batches = self.batches.load_step(step)  # and the next step's start loading
            num_targets = step_num_targets(batches, tokens_per_step=self.tokens_per_step,
                                           device=self.device.torch_device,
                                           tp=self.layout.tp, pp=self.layout.pp)  # fmt: skip
            loss_sum, grad_norm = forward_backward(
                t.engine, t.optimizer, t.scaler, batches, num_targets=num_targets,
                world_size=self.layout.reduce_ranks, grad_clip=self.cfg.train.grad_clip,
                device=self.device.torch_device, poison=done in self.faults.nonfinite,
            )  # fmt: skip
            pending = agreement.start_read(
                grad_norm=grad_norm, loss_sum=loss_sum, loss_only=t.scaler is not None
            )
            stepped = self._queue_optimizer_step(pending.nonfinite)
            agreed = pending.read()
        lr = t.scheduler.get_last_lr()[0]
        if agreed.nonfinite:
            self._skip(done)
        else:
            self._update(stepped=stepped)
        self.timer.stop()  # no host sync: the next step is queued while this one runs
        self.trained.append(num_targets)
        return _Step(agreed, loss_sum, num_targets, grad_norm, lr)

    def _queue_optimizer_step(self, nonfinite: torch.Tensor) -> bool:
        """Queue the optimizer step before the host knows whether the step is finite, where the
        optimizer can skip on the device: torch's fused AdamW takes a `found_inf` tensor (the
        protocol torch's GradScaler uses, `_step_supports_amp_scaling`) and then leaves the
        weights, moments and step count as they were. The host then waits only for the step's
        flags, while the device already runs the update: no idle device between backward and
        the optimizer while the host reads the flags and launches the optimizer's kernels.
        Returns whether the step was queued (else `_update` steps after the read, as fp16's
        grad scaler and the foreach/for-loop kernels need)."""
        t = self.t
        # The flag is set when the optimizer is built; a resumed state dict may bring param
        # groups of another kernel (a checkpoint of a foreach run), which refuse found_inf.
        fused = all(group.get("fused") for group in t.optimizer.param_groups)
        if (
            t.scaler is not None
            or not fused
            or not getattr(t.optimizer, "_step_supports_amp_scaling", False)
        ):
            return False
        # float32 of shape [] as the step counters (a grad scaler's [1] fails to broadcast).
        t.optimizer.found_inf = nonfinite
        try:
            t.optimizer.step()
        finally:
            del t.optimizer.found_inf
        return True

    def _update(self, *, stepped: bool) -> None:
        """The optimizer step of a finite step (unless already queued), and the schedule's."""
        t = self.t
        self.skipped_in_row = 0
        if stepped:
            pass  # queued before the read (`_queue_optimizer_step`)
        elif t.scaler is not None:
            t.scaler.step(t.optimizer)
            t.scaler.update()
        else:
            t.optimizer.step()
        precompute_scales(t.engine.model, all_gather=self.float8_all_gather)
        t.scheduler.step()
        # After the first step the optimizer took: an fp16 grad scaler skips overflowing
        # steps inside scaler.step, before AdamW has any state.
        if self.model_state is None and t.optimizer.state:
            self.model_state = model_state_bytes(t.engine.model, t.optimizer)
        t.optimizer.zero_grad(set_to_none=True)

    def _skip(self, done: int) -> None:
        """The non-finite policy: drop the step's gradients and go on, or abort
        (`train.nonfinite: abort`, or more than `train.max_skipped` skips in a row)."""
        t, train = self.t, self.cfg.train
        t.optimizer.zero_grad(set_to_none=True)
        if t.scaler is not None:
            # unscale_ found the infs: back the scale off and reset the scaler's per-step
            # state, or the next step's unscale_ refuses to run.
            t.scaler.update()
        self.skipped_in_row += 1
        self.skipped_total += 1
        if train.nonfinite is NonFinite.abort or self.skipped_in_row > train.max_skipped:
            why = (
                "train.nonfinite is abort"
                if train.nonfinite is NonFinite.abort
                else f"more than train.max_skipped={train.max_skipped} in a row"
            )
            records = self.checkpointer.records
            last = records[-1].path if records else "none"
            raise RuntimeError(
                f"non-finite loss or gradients at step {done} ({why}); nothing from this "
                f"step was saved; last checkpoint: {last}"
            )  # fmt: skip
        self.events.emit("skip", step=done, skipped_in_row=self.skipped_in_row,
                         skipped_total=self.skipped_total)  # fmt: skip

    def _save_if_due(self, done: int, *, stop: bool, saves_done: bool) -> None:
        """The save policy: report async saves every rank has finished; save at the recipe's
        interval, at the last step and at an agreed stop."""
        if saves_done:
            self.saves.wait(last=False)  # every rank has finished it
        if not (stop or self.checkpointer.should_save(done, self.cfg.train.steps)):
            return
        save_start = time.perf_counter()
        with self.heartbeat.watch(done, "save"):
            self.faults.freeze_at(done, "save")
            # An async save still in flight finishes (or fails) first: at most one at a time.
            self.saves.wait(last=False)
            self.saves.save(self._train_state(done), last=stop or done == self.cfg.train.steps)
        self.window_start += time.perf_counter() - save_start  # not in tokens/s (as eval)

    def _train_state(self, step: int) -> TrainState:
        t, train = self.t, self.cfg.train
        return TrainState.at_step(
            step, global_batch_size=train.global_batch_size, seq_len=train.seq_len,
            world_size=self.layout.num_ranks, skipped_steps=self.skipped_total,
            scheduler=t.scheduler.state_dict(),
            grad_scaler=t.scaler.state_dict() if t.scaler is not None else None,
            tied_params=t.engine.tied,
        )  # fmt: skip

    def _log(self, done: int, result: _Step) -> None:
        """The `step` event. Logging steps only read the loss back (not every step): every rank
        reaches this all-reduce of the loss sums at the same steps. tokens_per_s counts every
        token processed (padding included, as MFU does); trained_tokens_per_s only the trained
        targets (fewer with fine-tuning data)."""
        load = self.t.engine.expert_load
        with self.heartbeat.watch(done, "step"):
            dist.all_reduce(result.loss_sum, op=dist.ReduceOp.SUM)
            # A mixture of experts: the tokens each expert received since the last log.
            experts = load.summary() if load is not None else None
        # Each TP group's ranks computed the same loss (once per group): count it once. The cp
        # ranks' sums are over their own tokens: their sum is the group's.
        self.loss = float(result.loss_sum / self.layout.tp / result.num_targets)
        norm = result.grad_norm
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        window_s = time.perf_counter() - self.window_start
        window = len(self.trained) - (done - self.last_logged)
        trained = as_counts(self.trained[window:])
        # Host integers from here on (read with the loss): no device scalar per step is kept
        # for the rest of the run.
        self.trained[window:] = trained
        self.events.emit(
            "step",
            step=done,
            loss=self.loss,
            lr=result.lr,
            grad_norm=norm.item(),
            tokens_per_s=self.tokens_per_step * (done - self.last_logged) / window_s,
            step_time_s=self.step_times[-1],
            tokens_seen=done * self.tokens_per_step,
            trained_tokens=trained[-1],
            trained_tokens_per_s=sum(trained) / window_s,
            skipped=result.agreed.nonfinite,
            memory=self.device.peak_memory(),
            **({"experts": experts} if experts is not None else {}),
        )
        self.last_logged, self.window_start = done, time.perf_counter()

    def _evaluate(self, done: int) -> None:
        eval_start = time.perf_counter()
        with self.heartbeat.watch(done, "eval"):
            self.faults.freeze_at(done, "eval")
            self.val_loss = evaluate(self.t.engine, self.val_data, self.layout,
                                     num_batches=self.cfg.eval.batches, rank=self.rank,
                                     device=self.device)  # fmt: skip
        self.events.emit(
            "eval", step=done, val_loss=self.val_loss, eval_time_s=time.perf_counter() - eval_start,
            num_samples=self.cfg.eval.batches * self.cfg.train.global_batch_size,
        )  # fmt: skip
        self.window_start += time.perf_counter() - eval_start  # not in the next tokens/s

    def _stop(self, done: int) -> dict[str, Any]:
        """An agreed stop: its checkpoint is on disk before the `stopped` event."""
        self.saves.wait(last=True)
        stopped = {
            "step": done,
            "checkpoint": str(step_dir(self.run_dir, done)),
            "reason": self.stop_signals.requested or "another rank was asked to stop",
            # A signal this rank received itself (SLURM signals every process), or None: a STOP
            # file, which the launcher also writes on its own SIGTERM/SIGINT (it knows that one).
            "signal": self.stop_signals.signal_name,
            "run_dir": str(self.run_dir),
        }
        self.events.emit("stopped", **stopped)
        return stopped
