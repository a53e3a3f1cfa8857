"""Loading a HuggingFace folder's pretrained weights into an FSDP-sharded model, shard-wise.

Each rank reads only the rows of each tensor it holds: FSDP2 shards every parameter on dim 0
with `torch.chunk` semantics, and `safetensors.safe_open(...).get_slice(name)[start:stop]` reads
just those rows from the memory-mapped file. No rank ever holds the whole model, and no
collective is needed (every rank opens the same files). One code path for every torch version
in range: DCP's HuggingFace storage reader exists only in newer ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdprun.errors import UserError
from fsdprun.models.hf import HF_PREFIX

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, from the index (sharded) or the one file.

    Raises:
        UserError: no safetensors weights in the folder.
    """
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise UserError(
        f"model.hf_path: {path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
        "weights are read; or set model.init=random)"
    )


def chunk_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk `rank` when `rows` are split as `torch.chunk` does (and so
    FSDP2's dim-0 sharding): ceil-sized chunks, the last ones short or empty."""
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of the full parameter that this rank's shard holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    mesh = param.device_mesh
    assert mesh.ndim == 1 and param.placements == (Shard(0),), param.placements
    return chunk_rows(param.shape[0], mesh.get_local_rank(), mesh.size())


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: Path, *, device: torch.device) -> None:
    """Materialize the meta, FSDP-sharded `model` (an `HFCausalLM`) on `device` and fill each
    parameter shard from the folder's safetensors files.

    Raises:
        UserError: a parameter missing from the files or of another shape.
    """
    files = weight_files(path)
    model.to_empty(device=device)
    wanted = {name: name.removeprefix(HF_PREFIX) for name, _ in model.named_parameters()}
    missing = [hf for hf in wanted.values() if hf not in files]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise UserError(f"model.hf_path: {path} lacks the weights {shown}")
    handles = {}
    for name, param in model.named_parameters():
        file = files[wanted[name]]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        sliced = handles[file].get_slice(wanted[name])
        if tuple(sliced.get_shape()) != tuple(param.shape):
            raise UserError(
                f"model.hf_path: {wanted[name]} has shape {tuple(sliced.get_shape())} in "
                f"{file.name}, the model expects {tuple(param.shape)}"
            )
        start, stop = shard_rows(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        if stop > start:
            # Only these rows are read from disk; the copy converts the dtype (bf16 files).
            local.copy_(sliced[start:stop])
    model.init_buffers(device)
