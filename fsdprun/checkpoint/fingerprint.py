"""The fingerprint of a LoRA checkpoint's frozen base, and what changed in the base since.

A LoRA checkpoint holds only the adapters; resume and export rebuild the base from where the
manifest's `lora_base` says (`manifest.lora_base`). Beside that, the manifest records what the
base was, so a base still found under its name but no longer the same is refused, not trained
on or merged into:

- a pretrained HF folder: for config.json and each weights file (`*.safetensors`, the index), its
  size, sha256 (the whole file, streamed) and mtime (`files`);
- a `checkpoint.load_from` checkpoint: its step and one sha256 over its manifest's per-file
  sha256 list (which covers DCP's `.metadata` and every shard), so no tensor is read;
- the seeded init: the seed and the recipe's model section (plus config.json's entry where the
  model is an HF folder initialized at random: the architecture comes from it).

Why whole files, with a stat shortcut. sha256 of the whole files is the only fingerprint that
notices every change: a sampled or partial hash misses a change confined to some tensors (another
fine-tune of the same shapes that touched a few layers, an edited lm_head), size and mtime alone
would call an identical copy or a fresh download of the same model changed (so `--base` could
not vouch for a copy), and hashes of the loaded tensors depend on the world size (each rank
holds a shard) or need a gather. Its cost, measured
on this project's shared, loaded 2-core machine: sha256 streams 0.6 GB/s on one core (it has
SHA-NI; an idle server core should do 1.5-2 GB/s, not measured here). The 528 KB tiny folder
takes 0.5 ms (0.2 ms when only `stat` is needed); an 8B model in bf16 (16 GB) would take about
27 s at that rate, 8-11 s on an idle core. That is paid once per run: rank 0 hashes in a thread
beside training (`fsdprun.checkpoint.save`), right after the load brought the files into the
page cache. Later checks (resume, export, inspect, a resumed run's saves) take a file whose size
and `mtime_ns` equal the recorded ones as unchanged without reading it, so an untouched base
costs a `stat` per file; a replaced or copied file is hashed again. The shortcut's one blind
spot is content rewritten in place with the same size and the same mtime to the nanosecond
(done on purpose, e.g. `touch -r`); `resume --verify` re-reads every file.

Reads files only (no tensor data); imports nothing of torch beyond what `manifest` does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdprun.checkpoint.manifest import (
    ManifestError,
    describe_base,
    file_sha256,
    lora_base,
    read_manifest,
)
from fsdprun.rundir import manifest_path

# The fields a fingerprint adds to `lora_base`'s {"source", "path" | "seed"}.
FINGERPRINT_FIELDS = ("files", "step", "content_sha256", "model")
# What the base's fingerprint covers in an HF folder: the architecture and the weights.
_WEIGHTS = (".safetensors", ".safetensors.index.json")
ACCEPT_FLAG = "--accept-base-change"
BASE_FLAG = "--base PATH"


@dataclass(frozen=True)
class BaseCheck:
    """How a LoRA checkpoint's recorded base compares with the base found now.

    state: "same"; "changed" (`detail` names what); "missing" (`detail` names what is gone);
    "unverified" (the manifest has no fingerprint: saved by an older fsdprun).
    """

    state: str
    detail: str = ""


def _folder_files(folder: Path, *, weights: bool) -> list[Path]:
    files = [folder / "config.json"] if (folder / "config.json").is_file() else []
    if weights:
        files += [p for p in sorted(folder.iterdir()) if p.is_file() and p.name.endswith(_WEIGHTS)]
    return files


def _file_entries(
    files: list[Path], known: dict[str, Any], *, verify: bool
) -> dict[str, dict[str, Any]]:
    entries = {}
    for file in files:
        st = file.stat()
        old = known.get(file.name) or {}
        unchanged = old.get("bytes") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns
        digest = old["sha256"] if unchanged and not verify and "sha256" in old else None
        entries[file.name] = {
            "bytes": st.st_size,
            "sha256": digest or file_sha256(file),  # the expensive line: reads the whole file
            "mtime_ns": st.st_mtime_ns,
        }
    return entries


def checkpoint_identity(path: Path) -> dict[str, Any]:
    """A checkpoint's step and one sha256 over its manifest's per-file checksums (the sizes and
    `.metadata`'s own sha256 for a manifest without them), from the manifest alone.

    Raises:
        OSError, ManifestError: no readable manifest.
    """
    manifest = read_manifest(path)
    sums = manifest.get("sha256") or {
        **{name: str(size) for name, size in manifest["files"].items()},
        ".metadata": file_sha256(path / ".metadata"),
    }
    text = json.dumps(sorted(sums.items()), separators=(",", ":")).encode()
    return {"step": manifest["step"], "content_sha256": hashlib.sha256(text).hexdigest()}


def base_fingerprint(
    recipe: dict[str, Any], *, known: dict[str, Any] | None = None, verify: bool = False
) -> dict[str, Any] | None:
    """`lora_base(recipe)` with the fingerprint of that base as it is now; None without LoRA.

    Args:
        known: a recorded fingerprint of the same folder: its files of unchanged size and mtime
            keep their recorded sha256 instead of being read again.
        verify: read and hash every file, whatever `known` says.

    Raises:
        OSError, ManifestError: the base cannot be read (`base_missing` says when it is gone).
    """
    base = lora_base(recipe)
    if base is None:
        return None
    if base["source"] == "hf_pretrained":
        # Another folder's record (a copy pointed at with --base) vouches for nothing here.
        same = known is not None and known.get("path") == base["path"]
        files = _folder_files(Path(base["path"]), weights=True)
        return {
            **base,
            "files": _file_entries(files, known["files"] if same else {}, verify=verify),
        }
    if base["source"] == "load_from":
        return {**base, **checkpoint_identity(Path(base["path"]))}
    model = dict(recipe["model"])
    fingerprint = {**base, "model": model}
    if model.get("hf_path"):
        files = _folder_files(Path(model["hf_path"]), weights=False)
        fingerprint["files"] = _file_entries(files, {}, verify=verify)  # config.json: tiny
    return fingerprint


def base_missing(base: dict[str, Any]) -> str | None:
    """What of a base (a `lora_base` record, fingerprinted or not) is gone, or None."""
    if base["source"] == "seed":
        return None
    path = Path(base["path"])
    if not path.is_dir():
        return f"no folder {path}"
    if base["source"] == "load_from" and not manifest_path(path).is_file():
        return f"no manifest.json in {path}"
    if base["source"] == "hf_pretrained":
        present = [p for p in _folder_files(path, weights=True) if p.name.endswith(_WEIGHTS)]
        if not present:
            had = [n for n in base.get("files") or {} if n.endswith(_WEIGHTS)]
            return f"no weights files in {path}" + (f" (it had {', '.join(had)})" if had else "")
    return None


def _first_difference(old: dict[str, Any], new: dict[str, Any], prefix: str) -> str | None:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{prefix}{key} {old.get(key)!r} -> {new.get(key)!r}"
    return None


def _files_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    changes = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            changes.append(f"{name} is gone")
        elif name not in old:
            changes.append(f"{name} is new")
        elif old[name].get("sha256") != new[name]["sha256"]:
            changes.append(
                f"{name} differs ({old[name].get('bytes')} -> {new[name]['bytes']} bytes, sha256 "
                f"{str(old[name].get('sha256'))[:12]} -> {new[name]['sha256'][:12]})"
            )
    return ", ".join(changes) or None


def compare_base(
    recorded: dict[str, Any], recipe: dict[str, Any], *, verify: bool = False
) -> BaseCheck:
    """The base recorded in a LoRA checkpoint's manifest against the one `recipe` builds now
    (the run's own recipe, or one pointed at a copy of the base)."""
    current = lora_base(recipe) or {}
    if current.get("source") != recorded.get("source"):
        return BaseCheck("changed", f"the base is now {describe_base(current)}")
    gone = base_missing({**current, "files": recorded.get("files")})
    if gone:
        return BaseCheck("missing", gone)
    if not any(field in recorded for field in FINGERPRINT_FIELDS):
        return BaseCheck("unverified")
    try:
        now = base_fingerprint(recipe, known=recorded, verify=verify) or {}
    except (OSError, ManifestError) as e:
        return BaseCheck("missing", f"it cannot be read ({e})")
    if current["source"] == "seed":
        detail = (
            _first_difference({"seed": recorded.get("seed")}, {"seed": now["seed"]}, "train.")
            or _first_difference(recorded.get("model") or {}, now["model"], "model.")
            or _files_difference(recorded.get("files") or {}, now.get("files") or {})
        )
    elif current["source"] == "load_from":
        detail = None
        if (recorded.get("step"), recorded.get("content_sha256")) != (
            now["step"], now["content_sha256"]
        ):  # fmt: skip
            detail = (
                f"{current['path']} is now step {now['step']}'s checkpoint (was step "
                f"{recorded.get('step')}'s)" if now["step"] != recorded.get("step")
                else f"the checksums of {current['path']}'s files differ"
            )  # fmt: skip
    else:
        detail = _files_difference(recorded.get("files") or {}, now["files"])
    return BaseCheck("changed", detail) if detail else BaseCheck("same")


def describe_check(check: BaseCheck) -> str:
    """A few words for inspect's `contents` row: how the base compares now."""
    return {
        "same": "verified",
        "changed": f"CHANGED since the save: {check.detail}",
        "missing": f"MISSING: {check.detail}",
        "unverified": "not verifiable (saved without its fingerprint by an older fsdprun)",
    }[check.state]


def refusal(ckpt: Path, base: dict[str, Any], check: BaseCheck, *, command: str) -> str:
    """The one line refusing a changed or missing base, naming the override."""
    if check.state == "changed":
        return (
            f"the LoRA base of {ckpt} is not the one it was trained on: {describe_base(base)}: "
            f"{check.detail}; {command} with {ACCEPT_FLAG} to use it on purpose"
        )
    return (
        f"the LoRA base of {ckpt}, {describe_base(base)}, is missing ({check.detail}); {command} "
        f"with {BASE_FLAG} to use a copy of it elsewhere (checked against its fingerprint)"
    )


def relocate(recipe: dict[str, Any], base_path: Path) -> dict[str, Any]:
    """A copy of a LoRA run's recipe (manifest form) whose base is read from `base_path`.

    Raises:
        ValueError: the base is the seeded init (`base_path` has nothing to stand for).
    """
    base = lora_base(recipe)
    if base is None or base["source"] == "seed":
        raise ValueError("the base is not a folder")
    recipe = {section: dict(body) for section, body in recipe.items()}
    if base["source"] == "load_from":
        recipe["checkpoint"]["load_from"] = str(base_path)
    else:
        recipe["model"]["hf_path"] = str(base_path)
    return recipe
