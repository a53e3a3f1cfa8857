"""Saving checkpoints: sharded DCP saves (sync or async), the manifest written last, keep-last,
and a failed save that every rank reports the same way.

Every rank writes its own shards through DCP; nothing is gathered on one rank. A checkpoint holds
`model.*` and `optim.*` (`get_state_dict`'s sharded DTensors, so a different world size reshards
on load), `train_state` (a uint8 tensor holding JSON, optimizer param groups included: data, not
pickled objects) and `rng.rank<R>` (each rank's torch RNG state). A LoRA run's `model.*` holds
only the trainable adapters: its frozen base is rebuilt from the source the manifest names.

A save that fails on any rank (a full disk, a file-size limit, an unwritable folder) fails on
every rank at the same point with the same one-line reason (`SaveFailed`): the ranks exchange
their outcome after writing, rank 0 removes the partial folder, and earlier checkpoints are
never touched. A RUN_DIR that no longer names the run's directory (deleted, moved) is found by
every rank together before a save writes anything and as it finishes (`RunDirVanished`). What
the run does next (checkpoint.on_save_error) is the training loop's call.

Never imports the training loop, the engines or the launcher; loading lives in `restore`.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from fsdprun.checkpoint.fingerprint import base_fingerprint
from fsdprun.checkpoint.manifest import file_sha256, list_checkpoints, lora_base, write_manifest
from fsdprun.checkpoint.restore import move_aside
from fsdprun.config import CheckpointConfig
from fsdprun.errors import describe_os_error, find_os_error
from fsdprun.fmt import fmt_bytes
from fsdprun.rundir import RunDirVanished, RunDirWatch, checkpoint_root, step_dir


def json_tensor(data: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8)


def build_state(
    model, optimizer, train_state: dict[str, Any], rank: int, *, adapters_only: bool = False
) -> dict[str, Any]:
    """What a checkpoint holds. `adapters_only` (LoRA): the frozen base parameters are left
    out of `model.*`, so a checkpoint is the adapters and their optimizer state only."""
    options = StateDictOptions(ignore_frozen_params=adapters_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    # Param groups (lr, betas, ...) would be pickled by DCP; keep them as JSON in the train state
    # so the checkpoint holds tensors only (see NoPickleLoadPlanner).
    train_state["optim_param_groups"] = optim_sd["param_groups"]
    return {
        "model": model_sd,
        "optim": {"state": optim_sd["state"]},
        "train_state": json_tensor(train_state),
        "rng": {f"rank{rank}": torch.get_rng_state()},
    }


def mesh_record(model_state: dict[str, Any], world_size: int) -> dict[str, list]:
    """The device mesh the model's tensors are sharded over, as the manifest records it.

    Read from the state itself rather than from the recipe, so it is the mesh the engine built:
    a DTensor's (fsdp2; fsdp1, whose sharded state dict DCP asks for as DTensors), e.g.
    {"shape": [2, 2], "dim_names": ["replicate", "shard"]} for hybrid sharding, [2, 2] of
    ["dp_shard", "cp"] under context parallel; a 1-D "dp" mesh
    over every rank when there is none (ddp's replicas).
    """
    mesh = next((v.device_mesh for v in model_state.values() if isinstance(v, DTensor)), None)
    if mesh is None:
        return {"shape": [world_size], "dim_names": ["dp"]}
    # The whole mesh the tensors' mesh was cut from: under context parallel FSDP shards over a
    # flattened `dp_shard_cp` dim, which would hide the cp degree the run had.
    mesh = mesh._get_root_mesh()
    # A 1-D mesh has no names (full and grad_op sharding): "dp", as manifests always said.
    names = list(mesh.mesh_dim_names or ["dp"])
    assert len(names) == mesh.ndim, (names, mesh.shape)
    return {"shape": list(mesh.shape), "dim_names": names}


def new_checkpoint_group(enabled: bool):
    """A gloo group for async saves, so their collectives never interleave with training's."""
    return dist.new_group(backend="gloo") if enabled else None


@dataclass
class SaveRecord:
    step: int
    path: str
    blocked_s: float
    total_s: float = 0.0
    bytes: int = 0
    async_save: bool = False


class SaveFailed(RuntimeError):
    """A checkpoint was not written. Raised on every rank at the same point with the same
    message (which checkpoint, why, bytes needed and free, what is intact); the partial folder is
    already gone."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def _os_error_of(error: BaseException) -> OSError | None:
    """The OSError behind a failed write, also among the per-rank failures of DCP's
    CheckpointException."""
    if isinstance(error, CheckpointException):
        found = (find_os_error(exc) for exc, _ in error.failures.values())
        return next((e for e in found if e is not None), None)
    return find_os_error(error)


def _error_text(error: BaseException) -> str:
    """One line saying why a save failed on this rank."""
    os_error = _os_error_of(error)
    if os_error is not None:
        return describe_os_error(os_error)
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class _FileWriter(FileSystemWriter):
    """DCP's file writer, re-raising a failed write as the OSError underneath. torch.save's C++
    stream turns the OSError of a full disk (ENOSPC) or of a file-size limit (EFBIG) into a
    RuntimeError ("unexpected pos ..."), and DCP pickles exceptions from rank to rank, which drops
    the cause; an OSError keeps its errno when pickled."""

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            future.wait()
        except Exception as e:
            raise _os_error_of(e) or e  # noqa: B904 (the cause would not survive pickling)
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:
            raise _os_error_of(e) or e  # noqa: B904


def _state_bytes(state: dict[str, Any], world_size: int) -> int:
    """About what a checkpoint of `state` takes on disk: the full (global) size of every tensor,
    plus one RNG state per rank."""
    total = 0
    todo = [state]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo += value.values()
        elif isinstance(value, torch.Tensor):
            total += math.prod(value.shape) * value.dtype.itemsize
    rng = sum(t.numel() * t.dtype.itemsize for t in state.get("rng", {}).values())
    return total + rng * (world_size - 1)


def _own_checksums(path: Path, rank: int) -> dict[str, str]:
    # DCP's FileSystemWriter names each rank's shard files __<rank>_<n>.distcp.
    return {p.name: file_sha256(p) for p in sorted(path.glob(f"__{rank}_*")) if p.is_file()}


@dataclass
class _Pending:
    record: SaveRecord
    future: Future | None
    started: float
    train_state: dict[str, Any]
    mesh: dict[str, list]
    checksums: dict[str, str] | None = None
    error: BaseException | None = None
    estimate: int = 0  # bytes the save needs, about (rank 0)
    done_event: threading.Event = field(default_factory=threading.Event)

    def set_checksums(self, path: Path, rank: int, future: Future) -> None:
        try:
            if future.exception() is None:
                self.checksums = _own_checksums(path, rank)
        except BaseException as e:  # reported by _finish in the main thread
            self.error = e
        finally:
            self.done_event.set()


class _BaseFingerprint:
    """A LoRA run's base fingerprint, computed once by rank 0 in a thread beside training:
    hashing a large base's files takes seconds (see `fsdprun.checkpoint.fingerprint`)."""

    def __init__(self, recipe: dict[str, Any], *, known: dict[str, Any] | None):
        self._base: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(recipe, known), name="fsdprun-base-fingerprint", daemon=True
        )
        self._thread.start()

    def _run(self, recipe: dict[str, Any], known: dict[str, Any] | None) -> None:
        try:
            self._base = base_fingerprint(recipe, known=known)
        except Exception as e:  # reported by the first manifest that needs it
            self._error = e

    def result(self) -> tuple[dict[str, Any] | None, BaseException | None]:
        self._thread.join()
        return self._base, self._error


def _recorded_base(run_dir: Path) -> dict[str, Any] | None:
    """The base fingerprint of the run's newest complete checkpoint (resumed or restarted runs):
    its files' sha256 need no second reading where they are unchanged."""
    for status in reversed(list_checkpoints(run_dir)):
        if status.complete and (status.manifest or {}).get("lora_base"):
            return status.manifest["lora_base"]
    return None


@dataclass
class Checkpointer:
    """Saves checkpoints of one run. Every rank holds one and calls `save` and `wait` at the
    same steps (they run collectives); `in_flight_done` is local. A failed save raises
    `SaveFailed` from `save` (sync) or from the `wait` that finishes it (async), on every rank."""

    run_dir: Path
    cfg: CheckpointConfig
    rank: int
    world_size: int
    recipe: dict[str, Any]
    process_group: Any = None  # the dedicated group of async saves
    warn: Callable[[str], None] | None = None  # rank 0: says when the next save may not fit
    watch: RunDirWatch | None = None  # RUN_DIR as the run found it: saves go nowhere else
    records: list[SaveRecord] = field(default_factory=list)
    _pending: _Pending | None = None
    _space_warned: bool = False
    _resumed_bytes: int | None = None
    _base: _BaseFingerprint | None = None

    def __post_init__(self) -> None:
        # At construction, after the model (and its base) is loaded: the fingerprint is of the
        # base this run trains on, and its files are likely still in the page cache.
        if self.rank == 0 and lora_base(self.recipe) is not None:
            self._base = _BaseFingerprint(self.recipe, known=_recorded_base(self.run_dir))

    def _base_record(self) -> dict[str, Any] | None:
        """The fingerprinted `lora_base` for rank 0's manifests; None records the path alone."""
        if self._base is None:
            return None
        base, error = self._base.result()
        if error is not None:
            self._base = None  # warned once; later manifests name the base alone, alike
            if self.warn is not None:
                self.warn(
                    f"the LoRA base could not be fingerprinted ({error}); checkpoints name it "
                    "by path alone, and resume and export cannot tell whether it changed"
                )
        return base

    def should_save(self, step: int, total_steps: int) -> bool:
        every = self.cfg.every_steps
        return bool((every and step % every == 0) or (self.cfg.save_final and step == total_steps))

    def save(self, step: int, state: dict[str, Any], train_state: dict[str, Any]) -> SaveRecord:
        """Start (async) or do (sync) a save of `state` as step `step`.

        Raises:
            SaveFailed: (sync) the save failed on some rank; the run can go on.
        """
        self.wait()  # at most one save in flight
        path = step_dir(self.run_dir, step)
        # DCP creates the folder with its parents: a RUN_DIR deleted (or replaced) under the run
        # would be recreated. Every rank looks, and all agree, before anyone writes.
        vanished = self._vanished()
        # Only rank 0 looks (another rank's DCP writer may already be creating the folder when a
        # rank checks), and nobody starts writing before an old folder is moved aside.
        if self.rank == 0 and not vanished:
            try:
                self._check_space(f"checkpoint {path.name}")
                move_aside(path)
            except OSError:
                if not self._vanished():
                    raise
            # Looked again: gone meanwhile, DCP would recreate it. (What is left is the instant
            # between the agreement below and DCP's mkdir; the end of the save looks again.)
            vanished = self._vanished()
        gone: list[bool] = [False] * self.world_size
        dist.all_gather_object(gone, vanished)  # also the barrier after move_aside
        if any(gone):
            raise RunDirVanished(step)
        started = time.perf_counter()
        record = SaveRecord(step, str(path), 0.0, async_save=self.cfg.async_save)
        estimate = _state_bytes(state, self.world_size) if self.rank == 0 else 0
        mesh = mesh_record(state["model"], self.world_size)
        pending = _Pending(record, None, started, train_state, mesh, estimate=estimate)
        writer = _FileWriter(str(path))
        if self.cfg.async_save:
            result = dcp.async_save(
                state, checkpoint_id=str(path), storage_writer=writer,
                process_group=self.process_group,
            )  # fmt: skip
            # Newer torch may return a response object holding the upload future.
            future = getattr(result, "upload_completion", result)
            record.blocked_s = time.perf_counter() - started
            # Hash this rank's files in the writer thread, as soon as they are written.
            future.add_done_callback(lambda f: pending.set_checksums(path, self.rank, f))
            pending.future = future
            self._pending = pending
        else:
            try:
                # DCP agrees on a write error itself: it raises on every rank.
                dcp.save(state, checkpoint_id=str(path), storage_writer=writer)
                record.blocked_s = time.perf_counter() - started
                pending.checksums = _own_checksums(path, self.rank)
            except (Exception, CheckpointException) as e:  # CheckpointException is no Exception
                pending.error = e
            self._pending = pending
            self._finish()
            record.blocked_s = record.total_s  # hashing and the manifest block training too
        return record

    def in_flight_done(self) -> bool:
        """Whether this rank has nothing in flight (feeds the per-step agreement)."""
        p = self._pending
        return p is None or p.future is None or p.checksums is not None or p.future.done()

    def wait(self) -> SaveRecord | None:
        """Finish the save in flight, if any: block until every rank's part is on disk, then
        write the manifest. Called by every rank at the same step: once they agree that their
        async writes are done, or whenever the run must not go on without the save.

        Raises:
            SaveFailed: it failed on some rank.
        """
        return self._finish() if self._pending is not None else None

    def _finish(self) -> SaveRecord:
        pending, self._pending = self._pending, None
        error = pending.error
        if pending.future is not None:
            try:
                pending.future.result()  # re-raises a failed write
            except (Exception, CheckpointException) as e:
                error = e
            pending.done_event.wait()  # the hashing callback has run
            error = error or pending.error
        record = pending.record
        record.total_s = time.perf_counter() - pending.started
        # Each rank hashed the files it wrote and says whether its part failed; rank 0 writes
        # the manifest, or gives up on the folder, and tells every rank which: a rank whose
        # write failed never leaves the others waiting in a collective.
        mine = {"checksums": pending.checksums or {},
                "error": None if error is None else _error_text(error),
                "vanished": self._vanished()}  # fmt: skip
        gathered: list[dict[str, Any]] = [{}] * self.world_size
        dist.all_gather_object(gathered, mine)
        if any(g["vanished"] for g in gathered):
            raise RunDirVanished(record.step)  # no manifest, no clean-up under RUN_DIR
        outcome = self._outcome(record, pending, gathered) if self.rank == 0 else [None, False]
        dist.broadcast_object_list(outcome, src=0)
        message, vanished = outcome
        if vanished:
            raise RunDirVanished(record.step)  # no manifest, no clean-up under RUN_DIR
        if message is not None:
            raise SaveFailed(record.step, message)
        self.records.append(record)
        return record

    def _vanished(self) -> bool:
        return self.watch is not None and self.watch.vanished()

    def _outcome(self, record: SaveRecord, pending: _Pending, gathered: list) -> list[Any]:
        """Rank 0, once every rank's part is written: the manifest, or the give-up, and the
        clean-up. Returns, for every rank: why the save failed (None: it did not), and whether
        it failed because RUN_DIR vanished meanwhile (then nothing more is written there). A
        checkpoint whose manifest is written stands even if RUN_DIR goes right after: its
        clean-up is skipped, and the loop stops the run at its next step."""
        failed = {rank: g["error"] for rank, g in enumerate(gathered) if g["error"]}
        if not failed:
            try:
                self._write_manifest(record, pending, gathered)
            except Exception as e:  # the other ranks wait for the outcome
                failed = {0: _error_text(e)}
        try:
            if failed:
                if self._vanished():
                    return [None, True]
                return [self._give_up(Path(record.path), failed, pending.estimate), False]
            self._apply_keep_last()
            self._check_space("the next checkpoint")
        except OSError:
            if not self._vanished():
                raise
            return [None, bool(failed)]
        return [None, False]

    def _write_manifest(self, record: SaveRecord, pending: _Pending, gathered: list) -> None:
        # DCP's coordinator (rank 0) writes .metadata only after gathering every rank's write
        # results, so once rank 0's save has returned, all shards are on disk.
        record.bytes = write_manifest(
            Path(record.path), step=record.step, world_size=self.world_size, mesh=pending.mesh,
            save_time_s=record.total_s, blocked_s=record.blocked_s, async_save=record.async_save,
            checksums={k: v for part in gathered for k, v in part["checksums"].items()},
            train_state=pending.train_state, recipe=self.recipe, base=self._base_record(),
        )  # fmt: skip

    def _give_up(self, path: Path, failed: dict[int, str], estimate: int) -> str:
        """Rank 0, after a failed save: remove the partial folder (renamed first, so that what
        a failed removal leaves is no step-* folder) and say what happened, in one line."""
        aside = path.with_name(f"{path.name}.partial")
        try:
            if aside.exists():
                shutil.rmtree(aside)
            if path.exists():
                path.rename(aside)
                shutil.rmtree(aside)
            cleanup = "the partial folder was removed"
        except OSError as e:
            left = aside if aside.exists() else path
            cleanup = f"the partial folder {left.name} could not be removed ({e.strerror})"
        root = checkpoint_root(self.run_dir)
        # Free space now that the partial folder is gone: what the next attempt has.
        free = shutil.disk_usage(root if root.is_dir() else self.run_dir).free
        needed = self._last_size() or estimate
        reasons = sorted(set(failed.values()))
        earlier = [s for s in list_checkpoints(self.run_dir) if s.complete]
        intact = (
            f"the earlier checkpoint {earlier[-1].path.name} is intact (`fsdprun resume "
            f"{self.run_dir}` continues from it)" if earlier else "there is no earlier checkpoint"
        )  # fmt: skip
        return (
            f"checkpoint {path.name} was not saved: {'; '.join(reasons)} in {root} (it needs "
            f"about {fmt_bytes(needed)}, {fmt_bytes(free)} free); {intact}; {cleanup}"
        )

    def _last_size(self) -> int:
        """Bytes of the newest checkpoint of this run (this session's, or the one resumed)."""
        if self.records:
            return self.records[-1].bytes
        if self._resumed_bytes is None:
            complete = [s for s in list_checkpoints(self.run_dir) if s.complete]
            self._resumed_bytes = sum(complete[-1].manifest["files"].values()) if complete else 0
        return self._resumed_bytes

    def _check_space(self, what: str) -> None:
        """Rank 0: warn (once, until it fits again) when the free space is less than the last
        checkpoint took: a new checkpoint is written in full before keep-last removes any."""
        needed = self._last_size() if self.warn is not None else 0
        if not needed:
            return
        root = checkpoint_root(self.run_dir)
        where = root if root.is_dir() else self.run_dir
        free = shutil.disk_usage(where).free
        if free >= needed:
            self._space_warned = False
        elif not self._space_warned:
            self._space_warned = True
            self.warn(
                f"{what} will probably not fit: the last one took {fmt_bytes(needed)}, "
                f"{fmt_bytes(free)} is free in {where}"
            )

    def _apply_keep_last(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        complete = [s for s in list_checkpoints(self.run_dir) if s.complete]
        for old in complete[: -self.cfg.keep_last]:
            try:
                shutil.rmtree(old.path)
            except OSError as e:  # the new checkpoint is complete: not a reason to fail
                if self.warn is not None:
                    self.warn(f"checkpoint.keep_last: could not remove {old.path}: {e}")
