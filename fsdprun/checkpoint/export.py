"""Export a checkpoint's model weights as consolidated full tensors (safetensors or torch).

    fsdprun export runs/x/checkpoints/step-00001000 --out runs/x/export
    fsdprun export CKPT --out OUT --dtype bf16 --max-shard-size 2GB --format torch

No model is built and no process group or GPU is needed. safetensors files are streamed: the
header (names, dtypes, shapes, byte offsets) is computed from DCP's metadata up front, then DCP
reads a few tensors at a time — resharding the chunks of every rank's file into the full tensor —
and their bytes are appended, so peak memory is about one load group (at least the largest
tensor), not the model. `torch` output goes through torch.save, which needs a whole output shard
in memory. Names are the model's own (`model.` stripped), e.g. `layers.0.attention.wq.weight`.

`--format hf` writes a folder `transformers.AutoModelForCausalLM.from_pretrained` loads; the
run's model family (`fsdprun.models.ModelSpec`) names the weights and gives config.json and the
files to copy: for a run of a HuggingFace model (model.hf_path) its original config and tokenizer
files plus the trained weights under their HF names; for a built-in Llama run a LlamaConfig and
the weights renamed to HF Llama's names. Both get the run's end-of-text id as `eos_token_id` and
`bos_token_id` (where the config does not already say them), so `generate()` stops where the
training data did.

A LoRA checkpoint holds adapters only (its manifest's `lora_base` names the frozen base).
`--format hf` writes merged full weights (`base + alpha/rank * B @ A` under the base's names): the
run's LoRA model is rebuilt in this process on the CPU from the recorded base (the HF folder, the
load_from checkpoint, or the seeded init), the adapters loaded into it, then merged; this holds
the whole model in memory, unlike the streamed export. `--format peft` writes peft's adapter
folder (adapter_model.safetensors + adapter_config.json) for `PeftModel.from_pretrained`.
`safetensors` and `torch` write what the checkpoint holds (the adapters, fsdprun's names).
For hf and peft the base must be the one the adapters were trained on (the manifest's
fingerprint, `fsdprun.checkpoint.fingerprint`), or `accept_base_change`; `base` reads it from
another path (a copy). A missing base stops hf; peft writes its folder with a note, since its
config only names the base.

Knows no model family itself (never imports `fsdprun.models.llama` or
`.hf`: the spec does) and never starts a process group
(DCP reads with no_dist), nor imports the saving side (`save`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdprun import __version__
from fsdprun.checkpoint.fingerprint import ACCEPT_FLAG, compare_base, refusal, relocate
from fsdprun.checkpoint.inspect import model_config, require_checkpoint_dir, tied_params
from fsdprun.checkpoint.manifest import (
    CheckpointStatus,
    check_checkpoint,
    describe_base,
    lora_base,
    read_manifest,
)
from fsdprun.checkpoint.restore import NoPickleLoadPlanner
from fsdprun.config import LoraConfig, ModelConfig, parse_size
from fsdprun.data.files import read_description
from fsdprun.errors import UserError
from fsdprun.models import ModelSpec, model_spec
from fsdprun.models.lora import is_adapter_name, merged_state_dict
from fsdprun.staging import staged_folder

MODEL_PREFIX = "model."
FORMATS = ("safetensors", "torch", "hf", "peft")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Tensors DCP loads per call: bigger groups mean fewer calls, more memory (a tensor larger than
# this is loaded alone).
LOAD_GROUP_BYTES = 64 * 1024**2

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@dataclass(frozen=True)
class ExportedTensor:
    """One exported tensor: where it comes from and what it becomes."""

    key: str  # the checkpoint key, model.*
    name: str  # the exported name
    shape: tuple[int, ...]
    saved_dtype: torch.dtype
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExportResult:
    out: Path
    files: list[str]
    num_tensors: int
    num_params: int
    total_bytes: int  # tensor bytes, as in the index's total_size
    skipped: list[str]  # model.* entries that are not tensors
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. a LoRA base not found here


def exported_tensors(
    metadata: Metadata, *, dtype: torch.dtype | None
) -> tuple[list[ExportedTensor], list[str]]:
    """The model tensors in checkpoint order (floating ones converted to `dtype` if given), and
    the model.* keys that are not tensors (skipped)."""
    plans, skipped = [], []
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(MODEL_PREFIX):
            continue
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(key)
            continue
        saved = md.properties.dtype
        target = dtype if dtype is not None and saved.is_floating_point else saved
        plans.append(ExportedTensor(key, key[len(MODEL_PREFIX) :], tuple(md.size), saved, target))
    return plans, skipped


def data_eos_id(data: dict[str, Any]) -> int | None:
    """The end-of-text id of a run's data (its recipe's `data:` section): the one that ended each
    document of its token stream; None for synthetic data and token files without a data.json.

    Raises:
        UserError: the run's tokenizer.json cannot be read any more.
    """
    if data.get("source") == "text":
        from fsdprun.data.text import build_tokenizer

        try:
            tok = build_tokenizer(data["tokenizer"], data.get("eos_token"), require_eos=False)
            return tok.eos_id
        except UserError as e:
            raise UserError(f"the run's data.tokenizer (for its end-of-text id): {e}") from e
    if data.get("source") == "tokens" and data.get("paths"):
        description = read_description(Path(data["paths"][0]).parent)
        return description.get("eos_id") if description else None
    return None


def _hf_token_ids(recipe: dict[str, Any], config: dict[str, Any]) -> dict[str, int | None]:
    """The config.json keys to write for the special tokens that `config` does not already say:
    bos_token_id and eos_token_id, both the data's end-of-text id (in fsdprun's stream it ends
    each document, so it also precedes each one: a generation from nothing starts where a
    document does). Written as null when the data has none: left out, transformers would take
    Llama's defaults, 1 and 2, which are ordinary tokens here."""
    wanted = tuple(key for key in ("bos_token_id", "eos_token_id") if key not in config)
    if not wanted:
        return {}
    eos = data_eos_id(recipe.get("data", {}))
    return dict.fromkeys(wanted, eos)


def _write_hf_files(
    out: Path, spec: ModelSpec, model: ModelConfig, config: dict[str, Any],
    token_ids: dict[str, int | None],
) -> list[str]:  # fmt: skip
    """config.json and the model family's other files (an HF folder's tokenizer); their names.
    A copied config.json is rewritten only to add the special tokens."""
    written = []
    for file in spec.hf_files(model):
        shutil.copyfile(file, out / file.name)
        written.append(file.name)
    if "config.json" not in written:
        (out / "config.json").write_text(json.dumps({**config, **token_ids}, indent=2))
        written.append("config.json")
    elif token_ids:
        (out / "config.json").write_text(json.dumps({**config, **token_ids}, indent=2) + "\n")
    return written


def split_shards(plans: list[ExportedTensor], max_shard_bytes: int) -> list[list[ExportedTensor]]:
    """Consecutive tensors packed into shards of at most `max_shard_bytes` (a larger tensor gets
    a shard of its own, as HuggingFace does)."""
    shards: list[list[ExportedTensor]] = [[]]
    size = 0
    for plan in plans:
        if shards[-1] and size + plan.num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.num_bytes
    return shards


def shard_file_names(fmt: str, num_shards: int) -> tuple[list[str], str | None]:
    """File names of the shards and of the index (None for a single file): HF's convention."""
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if num_shards == 1:
        return [f"{stem}.{ext}"], None
    names = [f"{stem}-{i:05d}-of-{num_shards:05d}.{ext}" for i in range(1, num_shards + 1)]
    return names, f"{stem}.{ext}.index.json"


def safetensors_header(plans: list[ExportedTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte little-endian length plus the JSON header, padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for plan in plans:
        if plan.dtype not in _SAFETENSORS_DTYPES:
            raise UserError(f"{plan.key}: safetensors has no {plan.dtype}; use --format torch")
        header[plan.name] = {
            "dtype": _SAFETENSORS_DTYPES[plan.dtype],
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + plan.num_bytes],
        }
        offset += plan.num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _return_freed_memory_promptly() -> None:
    """Have glibc serve every allocation of 1 MiB or more with its own mmap, so a freed tensor
    goes back to the OS at once. By default the threshold climbs (up to 32 MiB) as blocks are
    freed, after which mid-sized tensors come from the heap and their freed pages stay resident:
    identical exports of a 520 MiB model then peaked anywhere from +0 to +148 MiB. No-op where
    there is no mallopt (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 1 << 20)


class _CachedReader(FileSystemReader):
    """Reads `.metadata` once: DCP re-reads it on every load call, and at scale it is large."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def iter_tensors(
    reader: FileSystemReader, plans: list[ExportedTensor], *, group_bytes: int = LOAD_GROUP_BYTES
) -> Iterator[tuple[ExportedTensor, torch.Tensor]]:
    """Full tensors in `plans` order, loaded by DCP in groups of about `group_bytes`."""
    start = 0
    while start < len(plans):
        end, size = start, 0
        while end < len(plans) and (end == start or size + plans[end].num_bytes <= group_bytes):
            size += plans[end].num_bytes
            end += 1
        group = plans[start:end]
        state = {p.key: torch.empty(p.shape, dtype=p.saved_dtype) for p in group}
        with warnings.catch_warnings():
            # Loading in one process without a process group is the point here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=NoPickleLoadPlanner(), no_dist=True)
        for p in group:
            yield p, state.pop(p.key).to(p.dtype)  # pop: free each tensor once it is written
        start = end


TensorReader = Callable[[list[ExportedTensor]], Iterator[tuple[ExportedTensor, torch.Tensor]]]


def _write_safetensors(
    file, read: TensorReader, plans: list[ExportedTensor], metadata: dict[str, str]
) -> None:
    file.write(safetensors_header(plans, metadata))
    for _, tensor in read(plans):
        # Raw bytes in place (no copy): a byte view of the contiguous tensor, via numpy's buffer.
        file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        del tensor  # not held while the next group loads


def _merged_plans(
    merged: dict[str, torch.Tensor], *, dtype: torch.dtype | None
) -> list[ExportedTensor]:
    """Export plans of merged weights (in memory), named as a checkpoint would name them."""
    return [
        ExportedTensor(f"{MODEL_PREFIX}{name}", name, tuple(t.shape), t.dtype,
                   dtype if dtype is not None and t.is_floating_point() else t.dtype)
        for name, t in merged.items()
    ]  # fmt: skip


def _export_peft(
    path: Path, out: Path, reader, plans: list[ExportedTensor], recipe: dict[str, Any]
) -> ExportResult:
    adapters = [p for p in plans if is_adapter_name(p.name)]
    with staged_folder(out, needed=sum(p.num_bytes for p in adapters)) as stage:
        files = _peft_export(stage, reader, adapters, recipe)
    return ExportResult(
        out=out, files=files, num_tensors=len(adapters),
        num_params=sum(math.prod(p.shape) for p in adapters),
        total_bytes=sum(p.num_bytes for p in adapters), skipped=[],
    )  # fmt: skip


def _section(cls: type, data: dict[str, Any] | None):
    """A manifest recipe's section (plain data) as its typed dataclass; missing keys default."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), data or {}))


def _load_model_tensors(path: Path, model, *, base_only: bool = False) -> None:
    """Fill `model`'s tensors (unsharded, CPU) with those checkpoint `path` holds, in place
    (DCP without a process group); `base_only` leaves the adapters alone."""
    saved = _CachedReader(str(path)).read_metadata().state_dict_metadata
    state = {
        k: v for k, v in model.state_dict().items()
        if f"{MODEL_PREFIX}{k}" in saved and not (base_only and is_adapter_name(k))
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(path), planner=NoPickleLoadPlanner(),
                 no_dist=True)  # fmt: skip


def merged_lora_weights(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full weights of a LoRA checkpoint with its adapters merged, under the base model's
    names: the run's model rebuilt on the CPU from the base its manifest records, then the
    checkpoint's tensors loaded into it (older LoRA checkpoints hold the base too).

    Raises:
        UserError: the recorded base cannot be read any more.
    """
    from fsdprun.engines.adapters import build_lora_model_on_cpu  # builds torch modules

    recipe = manifest["recipe"]
    base = manifest.get("lora_base") or lora_base(recipe)
    train = recipe.get("train") or {}
    model = build_lora_model_on_cpu(
        model_config(recipe["model"]), _section(LoraConfig, recipe.get("lora")),
        seed=train.get("seed", 0),
    )  # fmt: skip
    if base["source"] == "load_from":
        source = Path(base["path"])
        if not check_checkpoint(source).complete:
            raise UserError(
                f"{path}: its base, {describe_base(base)}, is not a complete checkpoint"
            )
        _load_model_tensors(source, model, base_only=True)
    _load_model_tensors(path, model)
    return merged_state_dict(model)


def _peft_export(
    stage: Path, reader, plans: list[ExportedTensor], recipe: dict[str, Any]
) -> list[str]:
    """peft's adapter folder from a LoRA checkpoint's adapter tensors; the files written."""
    from fsdprun.engines.adapters import save_peft_adapter

    adapters = {p.name: t for p, t in iter_tensors(reader, plans) if is_adapter_name(p.name)}
    base = lora_base(recipe)
    # peft's config names the base by folder or hub name: the HF folder where there is one.
    name = base["path"] if base["source"] == "hf_pretrained" else describe_base(base)
    files = save_peft_adapter(stage, adapters, cfg=_section(LoraConfig, recipe.get("lora")),
                              base_model_name_or_path=name)  # fmt: skip
    return [f.name for f in files]


def _checked_base(
    path: Path, manifest: dict[str, Any], *, fmt: str, base: Path | None, accept_change: bool
) -> tuple[dict[str, Any], list[str]]:
    """The manifest to export from (its recipe and `lora_base` pointed at `base` where given)
    and notes: a LoRA checkpoint's base must be the one it was trained on for `--format hf`
    (merged into) and `peft` (named); a missing base is only a note for peft, which needs the
    base's name alone.

    Raises:
        UserError: a missing base (hf), a changed one without `accept_change`, or a `base` that
            this export does not read.
    """
    recorded = manifest.get("lora_base")
    if recorded is None or fmt not in ("hf", "peft"):
        if base is not None:
            raise UserError(
                f"--base {base}: only --format hf or peft of a LoRA checkpoint read a base, and "
                f"this is --format {fmt} of "
                + ("a LoRA checkpoint" if recorded else f"{path}, which holds no LoRA adapters")
            )
        return manifest, []
    recipe = manifest["recipe"]
    if base is not None:
        try:
            recipe = relocate(recipe, base.resolve())
        except ValueError:
            raise UserError(
                f"--base {base}: the base of {path} is the seeded init (rebuilt from its recipe); "
                "there is no base to point at"
            ) from None
    current = {**recorded, **lora_base(recipe)}
    check = compare_base(recorded, recipe)
    relocated = {**manifest, "recipe": recipe, "lora_base": current}
    if check.state == "missing" and fmt == "peft":
        return relocated, [
            f"the LoRA base, {describe_base(current)}, is missing here ({check.detail}); the "
            "adapters need it where they are loaded (adapter_config.json names it as "
            "base_model_name_or_path)"
        ]
    if check.state == "missing" or (check.state == "changed" and not accept_change):
        raise UserError(refusal(path, current, check, command=f"export --format {fmt}"))
    if check.state == "changed":
        return relocated, [
            f"the LoRA base changed ({check.detail}); exporting with it as {ACCEPT_FLAG} asks"
        ]
    if check.state == "unverified":
        return relocated, [
            f"the LoRA base cannot be verified: {path.name} was saved by an older fsdprun without "
            "its fingerprint"
        ]
    return relocated, []


def _check_export(path: Path, out: Path, *, fmt: str, dtype: str | None) -> CheckpointStatus:
    """Refuse bad options, an incomplete checkpoint and an `out` in use before reading anything;
    returns the checkpoint's status."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    require_checkpoint_dir(path)
    status = check_checkpoint(path)
    if not status.complete:
        raise UserError(f"{path} is not a complete checkpoint: {status.reason}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder; nothing written")
    if fmt != "torch" and sys.byteorder != "little":
        raise UserError("safetensors export needs a little-endian machine")
    return status


@dataclass(frozen=True)
class _HFExport:
    """What `--format hf` writes beside the weights: the model family's names and config.json,
    and the tokenizer's special token ids."""

    spec: ModelSpec
    model: ModelConfig
    config: dict
    token_ids: dict


def _prepare_hf(
    path: Path,
    manifest: dict,
    plans: list[ExportedTensor],
    *,
    dtype: torch.dtype | None,
    merge_lora: bool,
) -> tuple[_HFExport, list[ExportedTensor], TensorReader | None]:
    """The HF names, config and token ids; a LoRA checkpoint's tensors are the merged weights
    (held in memory), read by the returned reader instead of the checkpoint's."""
    recipe = manifest["recipe"]
    model = model_config(recipe["model"])
    spec = model_spec(model)
    read = None
    if merge_lora:
        merged = merged_lora_weights(path, manifest)
        plans = _merged_plans(merged, dtype=dtype)

        def read(shard: list[ExportedTensor]) -> Iterator[tuple[ExportedTensor, torch.Tensor]]:
            return ((p, merged[p.key[len(MODEL_PREFIX) :]].to(p.dtype)) for p in shard)

    hf_config = spec.hf_config(model, plans[0].dtype)
    plans = [dataclasses.replace(p, name=spec.hf_name(p.name)) for p in plans]
    return _HFExport(spec, model, hf_config, _hf_token_ids(recipe, hf_config)), plans, read


def export_checkpoint(
    path: Path,
    out: Path,
    *,
    fmt: str = "safetensors",
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    base: Path | None = None,
    accept_base_change: bool = False,
) -> ExportResult:
    """Write the model weights of checkpoint `path` as full tensors into the new folder `out`.

    Args:
        fmt: `safetensors` (streamed), `torch` (torch.save per shard), `hf` or `peft`.
        dtype: `bf16` or `fp32` to convert floating tensors; None keeps the saved dtypes.
        max_shard_size: split the output into files of at most this size (e.g. "5GB").
        base: read a LoRA checkpoint's base from here (hf, peft), checked against its
            fingerprint.
        accept_base_change: export although the LoRA base is not the one it was trained on.

    Raises:
        UserError: a bad option, an incomplete checkpoint, an `out` that is not new or empty,
            or a LoRA base that is missing (hf) or changed.
    """
    max_shard_bytes = parse_size(max_shard_size, option="--max-shard-size")
    status = _check_export(path, out, fmt=fmt, dtype=dtype)
    reader = _CachedReader(str(path))
    plans, skipped = exported_tensors(reader.read_metadata(), dtype=DTYPES.get(dtype))
    if not plans:
        raise UserError(f"{path}: no model.* tensors to export")
    manifest = read_manifest(path)
    tied = set(tied_params(manifest))
    has_adapters = any(is_adapter_name(p.name) for p in plans)
    if fmt == "peft" and not has_adapters:
        raise UserError(f"--format peft: {path} holds no LoRA adapters; use --format hf")
    manifest, notes = _checked_base(
        path, manifest, fmt=fmt, base=base, accept_change=accept_base_change
    )
    recipe = manifest["recipe"]
    if fmt == "peft":
        return dataclasses.replace(_export_peft(path, out, reader, plans, recipe), notes=notes)

    def read(shard: list[ExportedTensor]) -> Iterator[tuple[ExportedTensor, torch.Tensor]]:
        return iter_tensors(reader, shard)

    if fmt == "hf":
        # Everything the HF files need is read before anything is written.
        hf, plans, merged_read = _prepare_hf(
            path, manifest, plans, dtype=DTYPES.get(dtype), merge_lora=has_adapters
        )
        read = merged_read or read
    shards = split_shards(plans, max_shard_bytes)
    names, index_name = shard_file_names("torch" if fmt == "torch" else "safetensors", len(shards))
    file_metadata = {
        "format": "pt",  # what transformers expects of a PyTorch safetensors file
        "fsdprun_version": __version__,
        "source": path.name,
        "step": str(status.step),
    }

    _return_freed_memory_promptly()
    total_bytes = sum(p.num_bytes for p in plans)
    # Everything goes into a folder beside OUT that becomes OUT once complete: a failed export
    # (a full disk, an unwritable place) leaves nothing under OUT's name.
    with staged_folder(out, needed=total_bytes) as stage:
        for name, shard in zip(names, shards, strict=True):
            if fmt != "torch":
                with (stage / name).open("wb") as f:
                    _write_safetensors(f, read, shard, file_metadata)
            else:
                # torch.save needs the whole shard in memory at once.
                torch.save({p.name: t for p, t in read(shard)}, stage / name)
        if index_name is not None:
            weight_map = {p.name: n for n, shard in zip(names, shards, strict=True) for p in shard}
            index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
            (stage / index_name).write_text(json.dumps(index, indent=2) + "\n")
        if fmt == "hf":
            names = [*names, *_write_hf_files(stage, hf.spec, hf.model, hf.config, hf.token_ids)]
    return ExportResult(
        out=out,
        files=[*names, *([index_name] if index_name else [])],
        num_tensors=len(plans),
        num_params=sum(math.prod(p.shape) for p in plans if p.key not in tied),  # tied: once
        total_bytes=total_bytes,
        skipped=skipped,
        notes=notes,
    )
