"""A checkpoint's manifest.json (write, read, validate) and the completeness of a checkpoint.

Rank 0 writes RUN_DIR/checkpoints/step-N/manifest.json last, once every rank's shards and DCP's
`.metadata` are on disk, and atomically. A checkpoint counts only when it is complete:
`.metadata` and the manifest present, the manifest the shape fsdprun writes (`manifest_problem`)
and naming the folder's step, every file the metadata refers to present and long enough, every
file the manifest lists of the size it says. Incomplete folders are never loaded, never counted
toward keep-last and never deleted.

The manifest records what the run was (recipe, train state, world size, the device mesh the
tensors are sharded over) and each file's size and sha256. Fields added over time are optional
when read, so checkpoints of older fsdprun versions still load.

A LoRA run's checkpoints hold only what trains (the adapters, their optimizer state, the train
state); its manifest's `lora_base` says where the frozen base comes from, which resume and export
rebuild: a pretrained HF folder, a `checkpoint.load_from` checkpoint, or the
seeded init (reproducible from the recipe's seed: nothing to keep), and what that base was (its
fingerprint: `fsdprun.checkpoint.fingerprint`; absent from older manifests).

Reads files only: never imports torch at load (`inspect-checkpoint` uses this without it, DCP's
`.metadata` read by `dcp_metadata`), nor anything of saving or loading tensors.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdprun import __version__
from fsdprun.checkpoint.dcp_metadata import read_metadata
from fsdprun.rundir import checkpoint_root, manifest_path, step_of

FORMAT_VERSION = 1


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
    "save_time_s": (int, float), "blocked_s": (int, float), "lora_base": dict,
}  # fmt: skip
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer",
               float: "a number", bool: "a boolean", type(None): "null"}  # fmt: skip


def _json_name(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    # JSON true/false are Python bools, which are ints too: not an integer field's value.
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _is_mesh(mesh: dict[str, Any]) -> bool:
    shape, names = mesh.get("shape"), mesh.get("dim_names")
    return (
        isinstance(shape, list) and isinstance(names, list) and len(shape) == len(names)
        and all(_is(n, int) and n >= 1 for n in shape) and all(isinstance(n, str) for n in names)
    )  # fmt: skip


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
    mesh = data.get("mesh")
    if mesh is not None and not _is_mesh(mesh):
        return (
            "manifest.json is corrupt: 'mesh' must hold 'shape' (sizes >= 1) and 'dim_names' "
            "(one name per size)"
        )
    for section, body in data["recipe"].items():
        if not isinstance(body, dict):
            return (
                f"manifest.json is corrupt: 'recipe.{section}' is {_json_name(body)}, not an object"
            )
    if "model" not in data["recipe"]:
        return "manifest.json is corrupt: 'recipe.model' is missing"
    return None


def lora_base(recipe: dict[str, Any]) -> dict[str, Any] | None:
    """Where the frozen base of a LoRA run (`lora.rank` > 0 in its resolved recipe) comes from,
    in the order the worker applies them (a load_from checkpoint overrides pretrained weights):
    {"source": "load_from" | "hf_pretrained", "path": ...} or {"source": "seed", "seed": N};
    None for a run without LoRA."""
    if not (recipe.get("lora") or {}).get("rank"):
        return None
    load_from = (recipe.get("checkpoint") or {}).get("load_from")
    if load_from:
        return {"source": "load_from", "path": str(load_from)}
    model = recipe["model"]
    if model.get("hf_path") and model.get("init", "pretrained") == "pretrained":
        return {"source": "hf_pretrained", "path": str(model["hf_path"])}
    return {"source": "seed", "seed": (recipe.get("train") or {}).get("seed", 0)}


def describe_base(base: dict[str, Any]) -> str:
    """One phrase naming a LoRA checkpoint's base (`lora_base`), for inspect and messages."""
    if base["source"] == "load_from":
        return f"the weights of checkpoint {base['path']} (checkpoint.load_from)"
    if base["source"] == "hf_pretrained":
        return f"the pretrained HF folder {base['path']}"
    return f"the seeded init (train.seed={base['seed']}; rebuilt from the recipe, nothing stored)"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder `path`, checked by `manifest_problem`.

    Raises:
        OSError: it cannot be read.
        ManifestError: it is not JSON or not a manifest fsdprun can trust.
    """
    raw = manifest_path(path).read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # not UTF-8, or not JSON
        raise ManifestError(f"manifest.json is corrupt: not JSON ({e})") from None
    problem = manifest_problem(data)
    if problem:
        raise ManifestError(problem)
    return data


def write_manifest(
    path: Path,
    *,
    step: int,
    world_size: int,
    mesh: dict[str, list],
    save_time_s: float,
    blocked_s: float,
    async_save: bool,
    checksums: dict[str, str],
    train_state: dict[str, Any],
    recipe: dict[str, Any],
    base: dict[str, Any] | None = None,
) -> int:
    """Write the manifest of checkpoint folder `path`, whose files are all on disk; returns the
    bytes of those files.

    Args:
        mesh: {"shape": [...], "dim_names": [...]} of the device mesh the tensors are sharded
            over.
        checksums: sha256 of the files the ranks hashed; the others (.metadata) are hashed here.
        base: a LoRA run's `lora_base` with its fingerprint (`fsdprun.checkpoint.fingerprint`);
            None records `lora_base(recipe)` alone.
    """
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    checksums = dict(checksums)
    for name in files:
        if name not in checksums:  # .metadata, and files of no rank's prefix
            checksums[name] = file_sha256(path / name)
    manifest = {
        "format_version": FORMAT_VERSION,
        "fsdprun_version": __version__,
        "torch_version": _torch_version(),
        "step": step,
        "world_size": world_size,
        "mesh": mesh,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "save_time_s": save_time_s,
        "blocked_s": blocked_s,
        "async_save": async_save,
        "files": files,
        "sha256": checksums,
        "train_state": train_state,
        "recipe": recipe,
    }
    base = base or lora_base(recipe)
    if base is not None:  # only LoRA runs: other manifests keep their shape
        manifest["lora_base"] = base
    final = manifest_path(path)
    tmp = final.with_name(final.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(final)  # atomic: a manifest is either whole or absent
    return sum(files.values())


def _torch_version() -> str:
    import torch  # loaded already: only a saving rank writes a manifest

    return torch.__version__


def check_checkpoint(path: Path) -> CheckpointStatus:
    """Whether `path` is a complete checkpoint, from metadata and file sizes alone."""
    step = step_of(path)
    if not (path / ".metadata").is_file():
        return CheckpointStatus(path, step, False, "no .metadata (the save did not finish)")
    try:
        metadata = read_metadata(path)
    except Exception as e:  # a truncated or garbled pickle raises anything
        return CheckpointStatus(path, step, False, f".metadata unreadable ({type(e).__name__})")
    if not manifest_path(path).is_file():
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


def list_checkpoints(run_dir: Path) -> list[CheckpointStatus]:
    """Every step-* folder of a run, oldest first, with its status."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [check_checkpoint(p) for p in sorted(folders, key=step_of)]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


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
