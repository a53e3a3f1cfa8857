"""Checkpoints: sharded DCP saves (sync or async), completeness, keep-last, and loading.

Layout: RUN_DIR/checkpoints/step-00000008/ holds DCP's shard files (`__<rank>_0.distcp`), DCP's
`.metadata`, and `manifest.json`, which rank 0 writes last, once every rank's shards and the
metadata are on disk. A checkpoint counts only when it is complete: `.metadata` and the manifest
present, every file the metadata refers to present and long enough. Incomplete folders are never
loaded, never counted toward keep-last and never deleted.

What a checkpoint holds (all through DCP, every rank writes its own shards; nothing is gathered):
- `model.*`, `optim.*`: `torch.distributed.checkpoint.state_dict.get_state_dict` — sharded
  DTensors, so a different world size reshards on load;
- `train_state`: a uint8 tensor holding JSON (step, tokens seen, data position as a global sample
  index, LR scheduler and grad-scaler state) — data, not pickled objects;
- `rng.rank<R>`: each rank's torch RNG state.
The functions here that only read (`check_checkpoint`, `list_checkpoints`) need no process group.

A save that fails on any rank (a full disk, a file-size limit, an unwritable folder) fails on
every rank at the same point with the same one-line reason (`SaveFailed`): the ranks exchange
their outcome after writing, rank 0 removes the partial folder, and earlier checkpoints are
never touched.
"""

from __future__ import annotations

import hashlib
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
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdprun import __version__
from fsdprun.config import CheckpointConfig
from fsdprun.errors import UserError, describe_os_error, find_os_error
from fsdprun.models.lora import is_adapter_name
from fsdprun.report import fmt_bytes

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_DIR_PREFIX = "step-"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"{_DIR_PREFIX}{step:08d}"


# --------------------------------------------------------------------------------------------
# Completeness (no process group, no tensor data)


@dataclass(frozen=True)
class CheckpointStatus:
    path: Path
    step: int | None
    complete: bool
    reason: str = ""  # why it is not complete
    manifest: dict[str, Any] | None = None


class ManifestError(ValueError):
    """A manifest.json fsdprun cannot trust: not JSON, not the shape fsdprun writes, or from a
    newer fsdprun. The message is the whole reason."""


# What a manifest must hold, with JSON types: the fields fsdprun reads. Optional ones are checked
# when present (older manifests lack sha256).
_MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format_version": int, "fsdprun_version": str, "step": int, "world_size": int,
    "files": dict, "train_state": dict, "recipe": dict,
}  # fmt: skip
_MANIFEST_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "torch_version": str, "saved_at": str, "sha256": dict, "mesh": dict, "async_save": bool,
    "save_time_s": (int, float), "blocked_s": (int, float),
}  # fmt: skip
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer",
               float: "a number", bool: "a boolean", type(None): "null"}  # fmt: skip


def _json_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    # JSON true/false are Python bools, which are ints too: not an integer field's value.
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def manifest_problem(data: Any) -> str | None:
    """Why `data` (a parsed manifest.json) is not a manifest fsdprun can trust, or None.

    The one place a manifest's shape is checked: required fields and their types, then the
    values fsdprun reads inside them (file sizes, checksums, recipe sections).
    """
    if not isinstance(data, dict):
        return f"manifest.json is corrupt: the top level is {_json_name(data)}, not an object"
    version = data.get("format_version")
    if _is(version, int) and version > FORMAT_VERSION:
        return (
            f"written by a newer fsdprun ({data.get('fsdprun_version')}, format {version}); "
            "upgrade fsdprun to read it"
        )
    for fields, required in ((_MANIFEST_FIELDS, True), (_MANIFEST_OPTIONAL, False)):
        for name, kind in fields.items():
            if name not in data:
                if required:
                    return f"manifest.json is corrupt: '{name}' is missing"
                continue
            if not _is(data[name], kind):
                want = _JSON_NAMES[kind] if isinstance(kind, type) else "a number"
                return f"manifest.json is corrupt: '{name}' is {_json_name(data[name])}, not {want}"
    if data["step"] < 0 or data["world_size"] < 1:
        return "manifest.json is corrupt: 'step' must be >= 0 and 'world_size' >= 1"
    if not all(_is(v, int) and v >= 0 for v in data["files"].values()):
        return "manifest.json is corrupt: 'files' values must be integer sizes in bytes"
    if not all(isinstance(v, str) for v in data.get("sha256", {}).values()):
        return "manifest.json is corrupt: 'sha256' values must be strings"
    for section, body in data["recipe"].items():
        if not isinstance(body, dict):
            return (
                f"manifest.json is corrupt: 'recipe.{section}' is {_json_name(body)}, not an object"
            )
    if "model" not in data["recipe"]:
        return "manifest.json is corrupt: 'recipe.model' is missing"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder `path`, checked by `manifest_problem`.

    Raises:
        OSError: it cannot be read.
        ManifestError: it is not JSON or not a manifest fsdprun can trust.
    """
    raw = (path / MANIFEST).read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # not UTF-8, or not JSON
        raise ManifestError(f"manifest.json is corrupt: not JSON ({e})") from None
    problem = manifest_problem(data)
    if problem:
        raise ManifestError(problem)
    return data


def check_checkpoint(path: Path) -> CheckpointStatus:
    """Whether `path` is a complete checkpoint, from metadata and file sizes alone."""
    step = _step_of(path)
    if not (path / ".metadata").is_file():
        return CheckpointStatus(path, step, False, "no .metadata (the save did not finish)")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or garbled pickle raises anything
        return CheckpointStatus(path, step, False, f".metadata unreadable ({type(e).__name__})")
    if not (path / MANIFEST).is_file():
        return CheckpointStatus(
            path, step, False, "no manifest.json (it is written last, after every rank finished)"
        )
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        return CheckpointStatus(path, step, False, str(e))
    except OSError as e:
        return CheckpointStatus(path, step, False, f"manifest.json unreadable ({e})")
    if step is not None and manifest["step"] != step:
        return CheckpointStatus(
            path, step, False,
            f"manifest.json is corrupt: it says step {manifest['step']} but the folder is "
            f"{path.name}",
        )  # fmt: skip
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return CheckpointStatus(path, step, False, f"shard file {name} is missing", manifest)
        size = file.stat().st_size
        if size < end:
            return CheckpointStatus(
                path, step, False, f"shard file {name} is truncated ({size} of {end} bytes)",
                manifest,
            )  # fmt: skip
    for name, size in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            return CheckpointStatus(path, step, False, f"{name} is missing", manifest)
        if file.stat().st_size != size:
            return CheckpointStatus(
                path, step, False,
                f"{name} has {file.stat().st_size} bytes, the manifest says {size}", manifest,
            )  # fmt: skip
    return CheckpointStatus(path, manifest["step"], True, "", manifest)


def _verified(status: CheckpointStatus) -> CheckpointStatus:
    if not status.complete:
        return status
    problems = verify_checkpoint(status.path)
    if not problems:
        return status
    reason = f"checksum verification failed: {'; '.join(problems)}"
    return CheckpointStatus(status.path, status.step, False, reason, status.manifest)


def _step_of(path: Path) -> int | None:
    name = path.name
    if name.startswith(_DIR_PREFIX) and name[len(_DIR_PREFIX) :].isdigit():
        return int(name[len(_DIR_PREFIX) :])
    return None


def list_checkpoints(run_dir: Path) -> list[CheckpointStatus]:
    """Every step-* folder of a run, oldest first, with its status."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return [check_checkpoint(p) for p in sorted(folders, key=_step_of)]


def find_resume_checkpoint(
    run_dir: Path, step: int | None = None, *, verify: bool = False
) -> tuple[CheckpointStatus, list]:
    """The newest complete checkpoint (or that of `step`), and the incomplete ones skipped.

    Args:
        verify: also read every file and compare checksums (slow: reads the whole checkpoint);
            a mismatch makes a checkpoint incomplete.

    Raises:
        UserError: no usable checkpoint.
    """
    statuses = list_checkpoints(run_dir)
    if verify:
        statuses = [_verified(s) for s in statuses]
    bad = [s for s in statuses if not s.complete]
    if step is not None:
        match = [s for s in statuses if s.step == step]
        if not match:
            steps = ", ".join(str(s.step) for s in statuses if s.complete) or "none"
            raise UserError(f"{run_dir}: no checkpoint of step {step} (complete ones: {steps})")
        if not match[0].complete:
            raise UserError(
                f"{match[0].path} is incomplete: {match[0].reason}; pick another --step"
            )
        return match[0], bad
    good = [s for s in statuses if s.complete]
    if not good:
        if bad:
            raise UserError(
                f"{run_dir}: no complete checkpoint ({len(bad)} incomplete: "
                f"{bad[-1].path.name}: {bad[-1].reason})"
            )
        raise UserError(
            f"{run_dir}: no checkpoints to resume from (looked in {checkpoint_root(run_dir)})"
        )
    return good[-1], bad


# --------------------------------------------------------------------------------------------
# State <-> DCP


def json_tensor(data: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8)


def tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(t.tolist()).decode())


def build_state(model, optimizer, train_state: dict[str, Any], rank: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Param groups (lr, betas, ...) would be pickled by DCP; keep them as JSON in the train state
    # so the checkpoint holds tensors only (see NoPickleLoadPlanner).
    train_state["optim_param_groups"] = optim_sd["param_groups"]
    return {
        "model": model_sd,
        "optim": {"state": optim_sd["state"]},
        "train_state": json_tensor(train_state),
        "rng": {f"rank{rank}": torch.get_rng_state()},
    }


class NoPickleLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only: a checkpoint item stored as a pickled object is refused rather than
    unpickled (DCP's default planner would run `torch.load(weights_only=False)` on it)."""

    def load_bytes(self, read_item, value) -> None:
        raise UserError(
            f"checkpoint item '{read_item.dest_index.fqn}' is a pickled object; fsdprun loads "
            "tensors only and does not unpickle checkpoint data"
        )


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (empty before the first step) so a checkpoint can be
    loaded into them: one step with zero gradients at lr 0 leaves the parameters unchanged."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def load_checkpoint(path: Path, model, optimizer, *, rank: int) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG state in place (resharding as needed); returns
    the train state."""
    metadata = FileSystemReader(str(path)).read_metadata()
    init_optimizer_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    train_meta = metadata.state_dict_metadata["train_state"]
    state: dict[str, Any] = {
        "model": model_sd,
        "optim": {"state": optim_sd["state"]},
        "train_state": torch.empty(train_meta.size, dtype=torch.uint8),
    }
    # A rank that did not exist at save time (a larger world) has no RNG state to restore; the
    # training step uses no randomness, so it keeps the seeded one.
    has_rng = f"rng.rank{rank}" in metadata.state_dict_metadata
    if has_rng:
        state["rng"] = {f"rank{rank}": torch.empty_like(torch.get_rng_state())}
    dcp.load(state, checkpoint_id=str(path), planner=NoPickleLoadPlanner())
    train_state = tensor_json(state["train_state"])
    optim_sd = {"state": state["optim"]["state"], "param_groups": train_state["optim_param_groups"]}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if has_rng:
        torch.set_rng_state(state["rng"][f"rank{rank}"])
    return train_state


def load_model_weights(path: Path, model) -> None:
    """Only the model's weights, from any complete fsdprun checkpoint (fine-tuning)."""
    status = check_checkpoint(path)
    if not status.complete:
        raise UserError(
            f"checkpoint.load_from: {path} is not a complete checkpoint: {status.reason}"
        )
    model_sd = get_model_state_dict(model)
    # LoRA on a base checkpoint: the base weights come from it, and adapters it lacks keep
    # their init (a LoRA checkpoint's adapters are loaded).
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    base_sd = {
        k: v for k, v in model_sd.items() if not is_adapter_name(k) or f"model.{k}" in saved
    }  # fmt: skip
    dcp.load({"model": base_sd}, checkpoint_id=str(path), planner=NoPickleLoadPlanner())
    strict = StateDictOptions(strict=len(base_sd) == len(model_sd))
    set_model_state_dict(model, base_sd, options=strict)


# --------------------------------------------------------------------------------------------
# Saving


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


@dataclass
class _Pending:
    record: SaveRecord
    future: Future | None
    started: float
    train_state: dict[str, Any]
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


@dataclass
class Checkpointer:
    """Saves checkpoints of one run. Every rank holds one and calls `save`, `finish_in_flight`
    and `wait` at the same steps (they run collectives); `in_flight_done` is local. A failed save
    raises `SaveFailed` from `save` (sync) or from the call that finishes it (async), on every
    rank."""

    run_dir: Path
    cfg: CheckpointConfig
    rank: int
    world_size: int
    recipe: dict[str, Any]
    process_group: Any = None  # the dedicated group of async saves
    warn: Callable[[str], None] | None = None  # rank 0: says when the next save may not fit
    records: list[SaveRecord] = field(default_factory=list)
    _pending: _Pending | None = None
    _space_warned: bool = False
    _resumed_bytes: int | None = None

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
        # Only rank 0 looks (another rank's DCP writer may already be creating the folder when a
        # rank checks), and nobody starts writing before an old folder is moved aside.
        if self.rank == 0:
            self._check_space(f"checkpoint {path.name}")
            if path.exists():
                _move_aside(path)
        dist.barrier()
        started = time.perf_counter()
        record = SaveRecord(step, str(path), 0.0, async_save=self.cfg.async_save)
        estimate = _state_bytes(state, self.world_size) if self.rank == 0 else 0
        pending = _Pending(record, None, started, train_state, estimate=estimate)
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

    def finish_in_flight(self) -> SaveRecord | None:
        """Finalize an async save that every rank has finished writing.

        Raises:
            SaveFailed: it failed on some rank.
        """
        return self._finish() if self._pending is not None else None

    def wait(self) -> SaveRecord | None:
        """Block until the save in flight, if any, is on disk and finalized.

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
        path = Path(record.path)
        # Each rank hashed the files it wrote and says whether its part failed; rank 0 writes
        # the manifest, or gives up on the folder, and tells every rank which: a rank whose
        # write failed never leaves the others waiting in a collective.
        mine = {"checksums": pending.checksums or {},
                "error": None if error is None else _error_text(error)}  # fmt: skip
        gathered: list[dict[str, Any]] = [{}] * self.world_size
        dist.all_gather_object(gathered, mine)
        outcome: list[str | None] = [None]
        if self.rank == 0:
            failed = {rank: g["error"] for rank, g in enumerate(gathered) if g["error"]}
            if not failed:
                try:
                    self._write_manifest(record, pending, gathered)
                except Exception as e:  # the other ranks wait for the outcome below
                    failed = {0: _error_text(e)}
            if failed:
                outcome[0] = self._give_up(path, failed, pending.estimate)
            else:
                self._apply_keep_last()
                self._check_space("the next checkpoint")
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise SaveFailed(record.step, outcome[0])
        self.records.append(record)
        return record

    def _write_manifest(self, record: SaveRecord, pending: _Pending, gathered: list) -> None:
        # DCP's coordinator (rank 0) writes .metadata only after gathering every rank's write
        # results, so once rank 0's save has returned, all shards are on disk.
        path = Path(record.path)
        checksums = {k: v for part in gathered for k, v in part["checksums"].items()}
        files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
        for name in files:
            if name not in checksums:  # .metadata, and files of no rank's prefix
                checksums[name] = file_sha256(path / name)
        record.bytes = sum(files.values())
        manifest = {
            "format_version": FORMAT_VERSION,
            "fsdprun_version": __version__,
            "torch_version": torch.__version__,
            "step": record.step,
            "world_size": self.world_size,
            "mesh": {"shape": [self.world_size], "dim_names": ["dp"]},
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "save_time_s": record.total_s,
            "blocked_s": record.blocked_s,
            "async_save": record.async_save,
            "files": files,
            "sha256": checksums,
            "train_state": pending.train_state,
            "recipe": self.recipe,
        }
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.rename(path / MANIFEST)  # atomic: a manifest is either whole or absent

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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _own_checksums(path: Path, rank: int) -> dict[str, str]:
    # DCP's FileSystemWriter names each rank's shard files __<rank>_<n>.distcp.
    return {p.name: file_sha256(p) for p in sorted(path.glob(f"__{rank}_*")) if p.is_file()}


def verify_checkpoint(path: Path) -> list[str]:
    """Read every file of a checkpoint and compare it with the manifest's sha256; returns the
    problems found (empty when every file matches)."""
    manifest = read_manifest(path)
    expected = manifest.get("sha256")
    if not expected:
        return ["the manifest has no checksums (saved by an older fsdprun)"]
    problems = []
    for name, digest in sorted(expected.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(file) != digest:
            problems.append(f"{name} does not match its checksum")
    return problems


def _move_aside(path: Path) -> Path | None:
    """A folder already at the save path (an earlier attempt's) is kept under another name."""
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{path.name}.old{n}").exists():
        n += 1
    return path.rename(path.with_name(f"{path.name}.old{n}"))


def set_aside_after(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoint folders of steps after `step` aside (`*.oldN`, nothing is deleted).

    A resume from `step` abandons the run's later checkpoints; left in place, an elastic
    restart (or a later resume), which takes the newest complete checkpoint, would continue the
    abandoned run instead of this one. Returns the folders' new paths.
    """
    later = [s.path for s in list_checkpoints(run_dir) if s.step is not None and s.step > step]
    return [moved for path in later if (moved := _move_aside(path)) is not None]


def new_checkpoint_group(enabled: bool):
    """A gloo group for async saves, so their collectives never interleave with training's."""
    return dist.new_group(backend="gloo") if enabled else None
