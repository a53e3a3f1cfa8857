"""Export a checkpoint's model weights as consolidated full tensors (safetensors or torch).

    fsdprun export runs/x/checkpoints/step-00001000 --out runs/x/export
    fsdprun export CKPT --out OUT --dtype bf16 --max-shard-size 2GB --format torch

No model is built and no process group or GPU is needed. safetensors files are streamed: the
header (names, dtypes, shapes, byte offsets) is computed from DCP's metadata up front, then DCP
reads a few tensors at a time — resharding the chunks of every rank's file into the full tensor —
and their bytes are appended, so peak memory is about one load group (at least the largest
tensor), not the model. `torch` output goes through torch.save, which needs a whole output shard
in memory. Names are the model's own (`model.` stripped), e.g. `layers.0.attention.wq.weight`.

`--format hf` writes a folder `transformers.AutoModelForCausalLM.from_pretrained` loads: for a
run of a HuggingFace model (model.hf_path) its original config and tokenizer files plus the
trained weights under their HF names; for a built-in Llama run a LlamaConfig and the weights
renamed to HF Llama's names (the RoPE conventions agree: no permutation of q/k is needed).
Both get the run's end-of-text id as `eos_token_id` and `bos_token_id` (where an HF folder's
config.json does not already say them), so `generate()` stops where the training data did.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import re
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdprun import __version__
from fsdprun.checkpoint import NoPickleLoadPlanner, check_checkpoint, read_manifest
from fsdprun.data.files import read_description
from fsdprun.errors import UserError
from fsdprun.inspect_ckpt import require_checkpoint_dir, tied_params
from fsdprun.models.lora import is_adapter_name
from fsdprun.staging import staged_folder

MODEL_PREFIX = "model."
FORMATS = ("safetensors", "torch", "hf")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_PREFIX = "hf."  # the attribute holding a HuggingFace model in fsdprun's wrapper
# fsdprun Llama names → HuggingFace Llama names (within a block, then outside the blocks).
_HF_BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Weight files of a HuggingFace folder: replaced by the trained weights, not copied.
_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".h5", ".msgpack")
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
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
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


@dataclass(frozen=True)
class TensorPlan:
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


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units as HuggingFace uses; KiB/MiB/GiB are binary).

    Raises:
        UserError: not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise UserError(
            f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def plan_tensors(
    metadata: Metadata, *, dtype: torch.dtype | None
) -> tuple[list[TensorPlan], list[str]]:
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
        plans.append(TensorPlan(key, key[len(MODEL_PREFIX) :], tuple(md.size), saved, target))
    return plans, skipped


def hf_llama_name(name: str) -> str:
    """An fsdprun Llama tensor name → its HuggingFace Llama name.

    Raises:
        UserError: a name that is not part of the Llama architecture.
    """
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if match and match.group(2) in _HF_BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_HF_BLOCK_NAMES[match.group(2)]}.weight"
    raise UserError(f"{name}: not a Llama tensor; cannot name it for HuggingFace")


def hf_llama_config(model: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A LlamaConfig (as config.json data) for the recipe's `model:` section."""
    n_kv = model["n_kv_heads"] if model["n_kv_heads"] is not None else model["n_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model["dim"],
        "intermediate_size": model["ffn_dim"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": n_kv,
        "head_dim": model["dim"] // model["n_heads"],
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["max_seq_len"],
        "hidden_act": "silu",
        "rms_norm_eps": model["norm_eps"],
        # Both spellings: transformers 4.x reads rope_theta, 5.x rope_parameters.
        "rope_theta": model["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "tie_word_embeddings": model["tie_embeddings"],
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _HF_DTYPE_NAMES.get(dtype, "float32"),
    }


def _hf_plans(plans: list[TensorPlan], model: dict[str, Any]) -> list[TensorPlan]:
    """`plans` under their HuggingFace names.

    Raises:
        UserError: the checkpoint holds LoRA adapters, which transformers would silently drop.
    """
    adapters = [p.name for p in plans if is_adapter_name(p.name)]
    if adapters:
        # Not yet: merging them (models.lora.merge_adapter_weights) or writing peft's folder
        # (adapters.save_peft_adapter) is to be wired here.
        raise UserError(
            f"--format hf: the checkpoint holds {len(adapters)} LoRA adapter tensors, which the "
            "HF export cannot write yet; use --format safetensors (fsdprun's names, adapters "
            "included)"
        )
    hf_path = model.get("hf_path")
    if hf_path:
        # Checked before anything is written: the config and tokenizer come from there.
        if not (Path(hf_path) / "config.json").is_file():
            raise UserError(
                f"the run's model.hf_path {hf_path} has no config.json any more; the HF export "
                "copies its config and tokenizer files from there"
            )
        # The wrapped model's own names, e.g. model.layers.0.self_attn.q_proj.weight.
        return [dataclasses.replace(p, name=p.name.removeprefix(HF_PREFIX)) for p in plans]
    return [dataclasses.replace(p, name=hf_llama_name(p.name)) for p in plans]


def data_eos_id(data: dict[str, Any]) -> int | None:
    """The end-of-text id of a run's data (its recipe's `data:` section): the one that ended each
    document of its token stream; None for synthetic data and token files without a data.json.

    Raises:
        UserError: the run's tokenizer.json cannot be read any more.
    """
    if data.get("source") == "text":
        from fsdprun.data.text import build_tokenizer

        try:
            return build_tokenizer(data["tokenizer"]).eos_id
        except UserError as e:
            raise UserError(f"the run's data.tokenizer (for its end-of-text id): {e}") from e
    if data.get("source") == "tokens" and data.get("paths"):
        description = read_description(Path(data["paths"][0]).parent)
        return description.get("eos_id") if description else None
    return None


def _hf_token_ids(recipe: dict[str, Any]) -> dict[str, int | None]:
    """The config.json keys to write for the special tokens: bos_token_id and eos_token_id, both
    the data's end-of-text id (in fsdprun's stream it ends each document, so it also precedes
    each one: a generation from nothing starts where a document does). Written as null when the
    data has none: left out, transformers would take Llama's defaults, 1 and 2, which are
    ordinary tokens here. A HuggingFace run keeps what its folder's config.json says."""
    wanted = ("bos_token_id", "eos_token_id")
    hf_path = recipe["model"].get("hf_path")
    if hf_path:
        source = json.loads((Path(hf_path) / "config.json").read_text())
        wanted = tuple(key for key in wanted if key not in source)
    if not wanted:
        return {}
    eos = data_eos_id(recipe.get("data", {}))
    return dict.fromkeys(wanted, eos)


def _write_hf_files(
    out: Path, model: dict[str, Any], plans: list[TensorPlan], token_ids: dict[str, int | None]
) -> list[str]:
    """config.json (and, for a HuggingFace run, its tokenizer and other files); their names."""
    hf_path = model.get("hf_path")
    if not hf_path:
        dtype = plans[0].dtype if plans else torch.float32
        config = {**hf_llama_config(model, dtype), **token_ids}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return ["config.json"]
    source = Path(hf_path)
    copied = []
    for file in sorted(source.iterdir()):
        if file.is_file() and not file.name.endswith(_HF_WEIGHT_SUFFIXES):
            shutil.copyfile(file, out / file.name)
            copied.append(file.name)
    if token_ids:
        config = json.loads((source / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **token_ids}, indent=2) + "\n")
    return copied


def split_shards(plans: list[TensorPlan], max_shard_bytes: int) -> list[list[TensorPlan]]:
    """Consecutive tensors packed into shards of at most `max_shard_bytes` (a larger tensor gets
    a shard of its own, as HuggingFace does)."""
    shards: list[list[TensorPlan]] = [[]]
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


def safetensors_header(plans: list[TensorPlan], metadata: dict[str, str]) -> bytes:
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
    reader: FileSystemReader, plans: list[TensorPlan], *, group_bytes: int = LOAD_GROUP_BYTES
) -> Iterator[tuple[TensorPlan, torch.Tensor]]:
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


def _write_safetensors(file, reader, plans: list[TensorPlan], metadata: dict[str, str]) -> None:
    file.write(safetensors_header(plans, metadata))
    for _, tensor in iter_tensors(reader, plans):
        # Raw bytes in place (no copy): a byte view of the contiguous tensor, via numpy's buffer.
        file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        del tensor  # not held while the next group loads


def export_checkpoint(
    path: Path,
    out: Path,
    *,
    fmt: str = "safetensors",
    dtype: str | None = None,
    max_shard_size: str = "5GB",
) -> ExportResult:
    """Write the model weights of checkpoint `path` as full tensors into the new folder `out`.

    Args:
        fmt: `safetensors` (streamed) or `torch` (torch.save per shard).
        dtype: `bf16` or `fp32` to convert floating tensors; None keeps the saved dtypes.
        max_shard_size: split the output into files of at most this size (e.g. "5GB").

    Raises:
        UserError: a bad option, an incomplete checkpoint, or an `out` that is not new or empty.
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    max_shard_bytes = parse_size(max_shard_size)
    require_checkpoint_dir(path)
    status = check_checkpoint(path)
    if not status.complete:
        raise UserError(f"{path} is not a complete checkpoint: {status.reason}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder; nothing written")
    if fmt != "torch" and sys.byteorder != "little":
        raise UserError("safetensors export needs a little-endian machine")

    reader = _CachedReader(str(path))
    plans, skipped = plan_tensors(reader.read_metadata(), dtype=DTYPES.get(dtype))
    if not plans:
        raise UserError(f"{path}: no model.* tensors to export")
    manifest = read_manifest(path)
    tied = set(tied_params(manifest))
    recipe = manifest["recipe"] if fmt == "hf" else {"model": {}}
    model_cfg = recipe["model"]
    token_ids: dict[str, int | None] = {}
    if fmt == "hf":
        plans = _hf_plans(plans, model_cfg)
        token_ids = _hf_token_ids(recipe)
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
                    _write_safetensors(f, reader, shard, file_metadata)
            else:
                # torch.save needs the whole shard in memory at once.
                torch.save({p.name: t for p, t in iter_tensors(reader, shard)}, stage / name)
        if index_name is not None:
            weight_map = {p.name: n for n, shard in zip(names, shards, strict=True) for p in shard}
            index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
            (stage / index_name).write_text(json.dumps(index, indent=2) + "\n")
        if fmt == "hf":
            names = [*names, *_write_hf_files(stage, model_cfg, plans, token_ids)]
    return ExportResult(
        out=out,
        files=[*names, *([index_name] if index_name else [])],
        num_tensors=len(plans),
        num_params=sum(math.prod(p.shape) for p in plans if p.key not in tied),  # tied: once
        total_bytes=total_bytes,
        skipped=skipped,
    )
