"""Inspect checkpoints without a process group and without reading any tensor data.

    fsdprun inspect-checkpoint runs/x/checkpoints/step-00000100     # one checkpoint
    fsdprun inspect-checkpoint runs/x                               # every checkpoint of a run
    fsdprun inspect-checkpoint CKPT --tensors 'model.layers.0.*' --json
    fsdprun inspect-checkpoint CKPT --diff OTHER_CKPT

Everything comes from DCP's `.metadata` (keys, shapes, dtypes, chunks, and where each stored item
lies in which file), the manifest and file sizes, so its time does not grow with the model: reading
`.metadata` takes milliseconds, loading torch for the model family's row about 1.6 s; a LoRA
checkpoint's base is compared with its recorded fingerprint (a `stat` per file while the files are
unchanged; one that changed is hashed again: `fingerprint`).
`inspect_path` builds the plain document that `--json` prints; `render` draws it with rich.
What a model's row says and which tensors an older checkpoint tied come from the run's model
family (`fsdprun.models`), never from its architecture code. Never imports torch.distributed
(`dcp_metadata` reads `.metadata`), nor builds a model; never imports the saving or loading side
(`save`, `restore`) and never joins a process group.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsdprun.checkpoint.dcp_metadata import Metadata, TensorStorageMetadata, read_metadata
from fsdprun.checkpoint.fingerprint import BaseCheck, compare_base, describe_check, refusal
from fsdprun.checkpoint.manifest import (
    CheckpointStatus,
    check_checkpoint,
    describe_base,
    list_checkpoints,
    verify_checkpoint,
)
from fsdprun.config import ModelConfig
from fsdprun.config.layout import mesh_text
from fsdprun.errors import UserError
from fsdprun.fmt import fmt_bytes, fmt_count
from fsdprun.models import model_spec
from fsdprun.report.console import Cell
from fsdprun.rundir import checkpoint_root, manifest_path

GROUPS = (("model", "model."), ("optimizer", "optim."))  # every other key is in "other"
GROUP_NAMES = (*(name for name, _ in GROUPS), "other")


# --------------------------------------------------------------------------------------------
# What a path is


def _run_dir_of(path: Path) -> Path | None:
    """The run directory when `path` is one (it has checkpoints/) or is its checkpoints/."""
    if checkpoint_root(path).is_dir():
        return path
    if path.is_dir() and path.name == checkpoint_root(Path()).name:
        return path.parent
    return None


def require_checkpoint_dir(path: Path, *, what: str = "") -> None:
    """Raise a one-line UserError unless `path` looks like a checkpoint folder (complete or not).

    A folder counts when it holds DCP's `.metadata`, the manifest or a shard file, so a save that
    died before writing `.metadata` is reported as incomplete rather than as "not a checkpoint".
    """
    label = f"{what} {path}" if what else str(path)
    if not path.exists():
        raise UserError(f"{label}: no such file or directory")
    if not path.is_dir():
        raise UserError(
            f"{label}: a file, not a checkpoint (a checkpoint is a folder such as "
            "RUN_DIR/checkpoints/step-00000100 with .metadata, *.distcp and manifest.json)"
        )
    run_dir = _run_dir_of(path)
    if run_dir is not None:
        complete = [s.path for s in list_checkpoints(run_dir) if s.complete]
        newest = f"; the newest complete one is {complete[-1]}" if complete else ""
        raise UserError(f"{label}: a run directory, not one checkpoint folder{newest}")
    markers = (path / ".metadata").exists() or manifest_path(path).exists()
    if not markers and not any(path.glob("*.distcp")):
        raise UserError(
            f"{label}: not a checkpoint (no .metadata, manifest.json or *.distcp) and not a run "
            "directory (no checkpoints/ folder)"
        )


# --------------------------------------------------------------------------------------------
# The document (plain data: what --json prints)


def inspect_path(
    path: Path, *, tensors: str | None = None, diff: Path | None = None, verify: bool = False
) -> dict[str, Any]:
    """Describe a checkpoint folder, or every checkpoint of a run directory.

    Args:
        path: a checkpoint folder, a run directory, or a run's checkpoints/ folder.
        tensors: fnmatch pattern on the flattened key; only matching tensors are listed/diffed.
        diff: another checkpoint folder to compare tensors (names, shapes, dtypes) with.
        verify: read every file of each complete checkpoint and compare it with the sha256 in
            its manifest; problems go to "verify_problems".

    Returns:
        {"kind": "checkpoint", "complete": ..., ...} or {"kind": "run", "checkpoints": [...]}.

    Raises:
        UserError: `path` (or `diff`) is neither a checkpoint nor a run directory.
    """
    run_dir = _run_dir_of(path)
    if run_dir is not None:
        if diff is not None:
            raise UserError(f"--diff compares two checkpoint folders; {path} is a run directory")
        doc = describe_run(run_dir)
        if verify:
            for c in doc["checkpoints"]:
                if c["complete"]:
                    c["verify_problems"] = verify_checkpoint(Path(c["path"]))
        return doc
    require_checkpoint_dir(path)
    doc = describe_checkpoint(path, tensors=tensors)
    if verify and doc["complete"]:
        doc["verify_problems"] = verify_checkpoint(path)
    if diff is not None and doc["complete"]:
        require_checkpoint_dir(diff, what="--diff")
        doc["diff"] = diff_checkpoints(path, diff, tensors=tensors)
    return doc


def problem(doc: dict[str, Any]) -> str | None:
    """Why the document's checkpoint(s) are not all complete, or None."""
    if doc["kind"] == "run":
        bad = [c for c in doc["checkpoints"] if not c["complete"] or c.get("verify_problems")]
        if not bad:
            return None
        return f"{len(bad)} of {len(doc['checkpoints'])} checkpoints incomplete: " + "; ".join(
            f"{c['name']}: {c['reason'] or '; '.join(c['verify_problems'])}" for c in bad
        )
    if not doc["complete"]:
        return f"{doc['path']} is incomplete: {doc['reason']}"
    if doc.get("verify_problems"):
        return f"{doc['path']} is corrupt: {'; '.join(doc['verify_problems'])}"
    other = doc.get("diff")
    if other is not None and not other["complete"]:
        return f"{other['other']} is incomplete: {other['reason']}"
    return None


def _tensor_bytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def _dtype_name(md: Any) -> str:
    if isinstance(md, TensorStorageMetadata):
        return str(md.properties.dtype).removeprefix("torch.")
    # BytesStorageMetadata: a pickled Python object. fsdprun writes none (optimizer param groups
    # are JSON in the train state) and refuses to load one; another tool's checkpoint may hold it.
    return "object"


def _group_of(key: str) -> str:
    return next((name for name, prefix in GROUPS if key.startswith(prefix)), "other")


def _bytes_on_disk(path: Path) -> tuple[int, int]:
    files = [p for p in path.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _status_doc(status: CheckpointStatus) -> dict[str, Any]:
    on_disk, num_files = _bytes_on_disk(status.path)
    manifest = status.manifest or {}
    return {
        "path": str(status.path),
        "name": status.path.name,
        "step": status.step,
        "complete": status.complete,
        "reason": status.reason,
        "saved_at": manifest.get("saved_at"),
        "world_size": manifest.get("world_size"),
        "bytes_on_disk": on_disk,
        "num_files": num_files,
    }


def describe_run(run_dir: Path) -> dict[str, Any]:
    """Every step-* checkpoint of a run, oldest first, with its status (no tensor listing).

    Raises:
        UserError: the run has no checkpoints at all.
    """
    statuses = list_checkpoints(run_dir)
    if not statuses:
        raise UserError(f"{run_dir}: no checkpoints in {checkpoint_root(run_dir)}")
    checkpoints = [_status_doc(s) for s in statuses]
    return {
        "kind": "run",
        "path": str(run_dir),
        "complete": all(c["complete"] for c in checkpoints),
        "checkpoints": checkpoints,
    }


def _recipe_summary(recipe: dict[str, Any]) -> dict[str, Any]:
    model = recipe.get("model", {})
    train = recipe.get("train", {})
    keys = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
            "max_seq_len", "tie_embeddings")  # fmt: skip
    return {
        "model": {k: model.get(k) for k in keys},
        "precision": recipe.get("precision", {}),
        "global_batch_size": train.get("global_batch_size"),
        "micro_batch_size": train.get("micro_batch_size"),
        "seq_len": train.get("seq_len"),
    }


def model_config(model: dict[str, Any]) -> ModelConfig:
    """A manifest's recipe `model:` section (plain data) as the typed section; keys it lacks take
    their defaults."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))


def tied_params(manifest: dict[str, Any]) -> dict[str, str]:
    """Model keys whose tensor is another key's (tied weights, stored under both names) → that
    key, both with the checkpoint's "model." prefix. Checkpoints record them in their train
    state; for older ones the model family says (Llama: from `model.tie_embeddings`)."""
    train_state = manifest.get("train_state") or {}
    if "tied_params" in train_state:
        ties = train_state["tied_params"]
    else:
        model = model_config(manifest.get("recipe", {}).get("model", {}))
        ties = model_spec(model).tied_params(model)
    return {f"model.{name}": f"model.{first}" for name, first in ties.items()}


def _base_check(manifest: dict[str, Any]) -> dict[str, str] | None:
    """How a LoRA checkpoint's base compares with the one found now: {"state", "detail"}."""
    base = manifest.get("lora_base")
    if base is None:
        return None
    check = compare_base(base, manifest["recipe"])
    return {"state": check.state, "detail": check.detail}


def base_problem(doc: dict[str, Any]) -> str | None:
    """The one line refusing a checkpoint document's LoRA base that changed, or None."""
    check = doc.get("base_check")
    if doc["kind"] != "checkpoint" or not check or check["state"] != "changed":
        return None
    return refusal(
        Path(doc["path"]), doc["lora_base"], BaseCheck(**check), command="resume or export"
    )


def describe_checkpoint(path: Path, *, tensors: str | None = None) -> dict[str, Any]:
    """One checkpoint: status, manifest summary, bytes per group, and its tensors."""
    status = check_checkpoint(path)
    doc: dict[str, Any] = {"kind": "checkpoint", **_status_doc(status)}
    if not status.complete:
        return doc
    metadata = read_metadata(path)
    manifest = status.manifest or {}
    groups = {name: {"tensors": 0, "objects": 0, "bytes": 0} for name in GROUP_NAMES}
    listed = []
    for key, md in metadata.state_dict_metadata.items():
        group = groups[_group_of(key)]
        if not isinstance(md, TensorStorageMetadata):
            group["objects"] += 1
            continue
        group["tensors"] += 1
        group["bytes"] += _tensor_bytes(md)
        if tensors is None or fnmatch.fnmatchcase(key, tensors):
            listed.append({
                "name": key, "shape": list(md.size), "dtype": _dtype_name(md),
                "bytes": _tensor_bytes(md), "shards": len(md.chunks),
            })  # fmt: skip
    tied = tied_params(manifest)
    model = model_config(manifest.get("recipe", {}).get("model", {}))
    num_params = sum(
        math.prod(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata) and key not in tied
    )
    doc.update(
        fsdprun_version=manifest.get("fsdprun_version"),
        torch_version=manifest.get("torch_version"),
        mesh=manifest.get("mesh"),  # absent from the oldest manifests
        lora_base=manifest.get("lora_base"),  # a LoRA checkpoint: adapters only, on this base
        base_check=_base_check(manifest),  # and whether that base is still the same
        train_state=manifest.get("train_state"),
        recipe=_recipe_summary(manifest.get("recipe", {})),
        model_description=model_spec(model).describe(model),
        num_params=num_params,  # a tied tensor once
        tied=tied,
        groups=groups,
        tensor_filter=tensors,
        tensors=listed,
        # Stored items are torch.save'd chunks: a little larger than their raw tensor bytes.
        bytes_referenced=sum(info.length for info in metadata.storage_data.values()),
    )
    return doc


def _entries(metadata: Metadata, pattern: str | None) -> dict[str, dict[str, Any]]:
    return {
        key: {
            "dtype": _dtype_name(md),
            "shape": list(md.size) if isinstance(md, TensorStorageMetadata) else None,
        }
        for key, md in metadata.state_dict_metadata.items()
        if pattern is None or fnmatch.fnmatchcase(key, pattern)
    }


# Stored items that are not tensors of the model: `train_state` is JSON in a uint8 tensor (see
# checkpoint/save.py), whose length changes with every step's numbers. A diff compares what it
# holds (the manifest's copy) instead of its byte length.
INTERNAL_KEYS = frozenset({"train_state"})


def _train_state_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The train state's numbers (step, tokens seen, world size, ...) that differ."""
    sa, sb = a.get("train_state") or {}, b.get("train_state") or {}
    return [
        {"key": k, "from": sa.get(k), "to": sb.get(k)}
        for k in sorted(sa.keys() | sb.keys())
        if not isinstance(sa.get(k, sb.get(k)), dict | list) and sa.get(k) != sb.get(k)
    ]


def diff_checkpoints(path: Path, other: Path, *, tensors: str | None = None) -> dict[str, Any]:
    """Keys added in `other`, removed from it, and changed in shape or dtype (metadata only),
    and the train state's numbers that differ (from the manifests).

    `path` must be complete; an incomplete `other` gives {"complete": False, "reason": ...}.
    """
    status = check_checkpoint(other)
    if not status.complete:
        return {"other": str(other), "complete": False, "reason": status.reason}
    a, b = (
        {k: v for k, v in _entries(read_metadata(p), tensors).items() if k not in INTERNAL_KEYS}
        for p in (path, other)
    )
    return {
        "other": str(other),
        "complete": True,
        "train_state": _train_state_changes(
            check_checkpoint(path).manifest or {}, status.manifest or {}
        ),
        "added": [{"name": k, **b[k]} for k in sorted(b.keys() - a.keys())],
        "removed": [{"name": k, **a[k]} for k in sorted(a.keys() - b.keys())],
        "changed": [
            {"name": k, "from": a[k], "to": b[k]}
            for k in sorted(a.keys() & b.keys())
            if a[k] != b[k]
        ],
    }


# --------------------------------------------------------------------------------------------
# Rendering


def _shape(shape: list[int] | None) -> str:
    if shape is None:
        return "-"
    return "×".join(map(str, shape)) if shape else "scalar"


def render(doc: dict[str, Any], console: Console, *, full: bool = False) -> None:
    """Draw an `inspect_path` document (a complete checkpoint, or a run's listing). A checkpoint
    is summed up (what it is, bytes per group); `full` lists its tensors too (a 70B checkpoint
    holds thousands: model, and the optimizer's two moments of each)."""
    if doc["kind"] == "run":
        _render_run(doc, console)
    else:
        _render_checkpoint(doc, console, full=full)


def _render_run(doc: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Checkpoints of {doc['path']}", title_justify="left")
    for name, justify in (
        ("step", "right"),
        ("folder", "left"),
        ("status", "left"),
        ("saved at", "left"),
        ("ranks", "right"),
        ("on disk", "right"),
    ):
        table.add_column(name, justify=justify)  # fmt: skip
    for c in doc["checkpoints"]:
        status = "[green]complete[/]" if c["complete"] else f"[red]incomplete:[/] {c['reason']}"
        # The time may go under the date (ISO's `T` as a space): 80 columns hold the table.
        saved_at = (c["saved_at"] or "-").replace("T", " ", 1)
        table.add_row(
            str(c["step"]), c["name"], status, saved_at,
            str(c["world_size"] or "-"), fmt_bytes(c["bytes_on_disk"]),
        )  # fmt: skip
    console.print(table)


def _render_checkpoint(doc: dict[str, Any], console: Console, *, full: bool) -> None:
    recipe = doc["recipe"]
    precision = recipe["precision"]
    groups = doc["groups"]
    info = Table.grid(padding=(0, 2))
    info.add_column(style="bold")
    info.add_column()
    # A long path folds after a `/`.
    path = Cell.parts(f"{doc['path']}", after="/")
    info.add_row("checkpoint", Cell([*path.pieces, "  ", Text("complete", style="green")]))
    info.add_row(
        "saved",
        f"step {doc['step']} on {doc['world_size']} ranks at {doc['saved_at']} "
        f"(fsdprun {doc['fsdprun_version']}, torch {doc['torch_version']})",
    )
    if doc.get("mesh"):
        info.add_row("mesh", _mesh_text(doc["mesh"]))
    info.add_row(
        "model",
        f"{doc['model_description']}; {fmt_count(doc['num_params'])} params"
        + "".join(f" ({k} tied to {v})" for k, v in doc.get("tied", {}).items()),
    )
    if doc.get("lora_base"):
        adapters = doc["groups"]["model"]["tensors"]
        check = doc.get("base_check")
        state = f" ({describe_check(BaseCheck(**check))})" if check else ""
        info.add_row(
            "contents", f"LoRA adapters only ({adapters} tensors); base: "
            f"{describe_base(doc['lora_base'])}{state}",
        )  # fmt: skip
    info.add_row(
        "training",
        f"param {precision.get('param_dtype')}, reduce {precision.get('reduce_dtype')}; "
        f"global batch {recipe['global_batch_size']} × seq {recipe['seq_len']} "
        f"(micro {recipe['micro_batch_size']})",
    )
    info.add_row(
        "bytes",
        " · ".join(
            f"{name} {fmt_bytes(g['bytes'])} ({g['tensors']} tensors"
            + (f", {g['objects']} objects)" if g["objects"] else ")")
            for name, g in groups.items()
        ),
    )
    info.add_row(
        "files",
        f"{fmt_bytes(doc['bytes_referenced'])} referenced by .metadata, "
        f"{fmt_bytes(doc['bytes_on_disk'])} on disk in {doc['num_files']} files",
    )
    console.print(info)
    if "diff" in doc:
        _render_diff(doc["diff"], console)
        return
    total = sum(g["tensors"] for g in groups.values())
    if not full:
        console.print(
            f"{total} tensors; --full lists them all, --tensors GLOB those matching "
            "(e.g. 'model.layers.0.*')"
        )
        return
    pattern = doc["tensor_filter"]
    title = f"Tensors matching {pattern!r}" if pattern else "Tensors"
    table = Table(title=f"{title} ({len(doc['tensors'])} of {total})", title_justify="left")
    table.add_column("name")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("bytes", justify="right")
    table.add_column("shards", justify="right")
    for t in doc["tensors"]:
        # Names fold after their dots, never mid-word; the other columns stay whole.
        table.add_row(Cell.parts(t["name"]), Cell.whole(_shape(t["shape"])), t["dtype"],
                      Cell.whole(fmt_bytes(t["bytes"])), str(t["shards"]))  # fmt: skip
    console.print(table)


def _mesh_text(mesh: dict[str, list]) -> str:
    """'2 replicate × 2 shard' (the device mesh the tensors were sharded over)."""
    return mesh_text(list(zip(mesh["dim_names"], mesh["shape"], strict=True)), joiner=" × ")


def _render_diff(diff: dict[str, Any], console: Console) -> None:
    if not diff["complete"]:
        return  # the command reports the reason
    state = diff.get("train_state") or []
    if state:
        console.print(
            "train state: "
            + ", ".join(f"{e['key']} {e['from']} -> {e['to']}" for e in state)
            + f" (this checkpoint -> {diff['other']})",
            soft_wrap=True,
        )
    if not (diff["added"] or diff["removed"] or diff["changed"]):
        console.print(f"no differences in tensor names, shapes or dtypes with {diff['other']}")
        return
    table = Table(title=f"Differences with {diff['other']}", title_justify="left")
    table.add_column("change")
    table.add_column("name")
    table.add_column("this checkpoint")
    table.add_column("other")
    for e in diff["removed"]:
        table.add_row(
            "[red]removed[/]", Cell.parts(e["name"]), f"{_shape(e['shape'])} {e['dtype']}", "-"
        )
    for e in diff["added"]:
        table.add_row(
            "[green]added[/]", Cell.parts(e["name"]), "-", f"{_shape(e['shape'])} {e['dtype']}"
        )
    for e in diff["changed"]:
        table.add_row(
            "[yellow]changed[/]", Cell.parts(e["name"]),
            f"{_shape(e['from']['shape'])} {e['from']['dtype']}",
            f"{_shape(e['to']['shape'])} {e['to']['dtype']}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"{len(diff['added'])} added, {len(diff['removed'])} removed, "
        f"{len(diff['changed'])} changed"
    )
