"""Loading a HuggingFace folder's pretrained weights into an FSDP-sharded model, shard-wise.

Each rank reads only the rows of each tensor it holds: FSDP2 shards every parameter on dim 0
with `torch.chunk` semantics (on a 2-D replicate x shard mesh, along the shard dim only), and
`safetensors.safe_open(...).get_slice(name)[start:stop]` reads just those rows from the
memory-mapped file. No rank ever holds the whole model, and no collective is needed (every rank
opens the same files). A mixture of experts whose checkpoint stores one tensor per expert, where
transformers stacks them into one 3-D parameter (the family's `StackedExperts`), is read the
same way: each rank reads the experts of its rows only. One code path for every torch version
in range: DCP's HuggingFace storage reader exists only in newer ones. DDP's plain parameters are
read whole; FSDP1 reads each unit's full tensors while it materializes the unit
(`HFWeights.full`), before flattening and sharding.

Never imports the training loop nor the launcher (`train`, `launch`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdprun.engines.weights import set_full_value
from fsdprun.errors import UserError
from fsdprun.families import Family
from fsdprun.models.hf import HF_PREFIX, hf_family
from fsdprun.models.lora import is_adapter_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it, from the index (sharded) or the one file.

    Raises:
        UserError: no safetensors weights in the folder.
    """
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"model.hf_path: {index} is not a safetensors index (no weight_map: {e}); "
                "download the folder's weights again"
            ) from e
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with open_weights(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise UserError(
        f"model.hf_path: {path} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
        "weights are read; or set model.init=random)"
    )


def open_weights(file: Path):
    """`safe_open` of one safetensors file of the folder.

    Raises:
        UserError: the file is missing or its header cannot be read (a download cut short),
            naming it.
    """
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"model.hf_path: {file} cannot be read ({str(e).strip() or type(e).__name__}): an "
            "incomplete or damaged download; download the folder's weights again"
        ) from e


def chunk_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk `rank` when `rows` are split as `torch.chunk` does (and so
    FSDP2's dim-0 sharding): ceil-sized chunks, the last ones short or empty."""
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _row_sharded(param: DTensor) -> bool:
    """Whether every placement is a replica or a plain dim-0 shard (FSDP2 without TP)."""
    return all(p.is_replicate() or (type(p) is Shard and p.dim == 0) for p in param.placements)


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of the full parameter that this rank's shard holds.

    Mesh dims are applied in order, as DTensor does: a replicated dim keeps the rows, a dim-0
    shard chunks the rows left by the dims before it (FSDP2's placements: `(Shard(0),)` on a 1-D
    mesh, `(Replicate(), Shard(0))` on hybrid and `none`'s replicate x shard mesh).
    """
    start, stop = 0, param.shape[0]
    if not isinstance(param, DTensor):
        return start, stop
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        # FSDP2 shards dim 0 only (_StridedShard, Partial: other parallelisms, not built here).
        assert type(placement) is Shard and placement.dim == 0, param.placements
        first, last = chunk_rows(stop - start, mesh.get_local_rank(dim), mesh.size(dim))
        start, stop = start + first, start + last
    assert stop - start == param.to_local().shape[0], (start, stop, param.placements)
    return start, stop


def _expert_parts(family: Family, hf_name: str, num_experts: int) -> list[list[str]] | None:
    """The checkpoint names of each expert's parts of the stacked parameter `hf_name`, or None
    when the family stacks no such parameter."""
    for rule in family.stacked:
        if hf_name.endswith("." + rule.param):
            block = hf_name.removesuffix(rule.param)  # "model.layers.0."
            return [[block + part.format(e=e) for part in rule.parts] for e in range(num_experts)]
    return None


class _StackedSlice:
    """A stacked-experts parameter read like a safetensors slice: expert e (row e of dim 0) is
    its parts' tensors concatenated; rows [start:stop] read only those experts."""

    def __init__(self, experts: list[list[Any]]):
        self.experts = experts

    def get_shape(self) -> list[int]:
        shapes = [part.get_shape() for part in self.experts[0]]
        return [len(self.experts), sum(s[0] for s in shapes), *shapes[0][1:]]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return torch.stack([torch.cat([p[:] for p in parts]) for parts in self.experts[rows]])


class HFWeights:
    """The safetensors weights of a HuggingFace folder for an `HFCausalLM`, by its parameter
    names (the HF names under `hf.`). Built on the meta model before any engine wraps it, so a
    missing or misshapen tensor is reported before anything is allocated.

    Raises:
        UserError: no safetensors files, a parameter missing from them or of another shape.
    """

    def __init__(self, path: Path, model: nn.Module):
        self.path = path
        self._files = weight_files(path)
        self._handles: dict[Path, Any] = {}
        # The first name of each parameter: a tied folder stores a shared tensor under that one
        # only, and `load` ties the other names to it again.
        first: dict[int, str] = {}
        self._canonical = {
            name: first.setdefault(id(param), name)
            for name, param in model.named_parameters(remove_duplicate=False)
        }
        # LoRA adapters are not in the folder: `adapters.init_adapters` initializes them.
        wanted = {
            name: name.removeprefix(HF_PREFIX)
            for name, _ in model.named_parameters() if not is_adapter_name(name)
        }  # fmt: skip
        self._wanted = wanted
        # Parameters a mixture of experts stacks in memory from per-expert checkpoint tensors
        # (the family's `stacked` entries), unless the folder holds them stacked (an export):
        # the checkpoint's names of each expert's parts.
        family = hf_family(model.hf.config)
        self._stacked: dict[str, list[list[str]]] = {}
        for name, param in model.named_parameters():
            if name in wanted and wanted[name] not in self._files:
                experts = _expert_parts(family, wanted[name], param.shape[0])
                if experts and all(p in self._files for parts in experts for p in parts):
                    self._stacked[name] = experts
        missing = [hf for name, hf in wanted.items()
                   if hf not in self._files and name not in self._stacked]  # fmt: skip
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(missing[:5]) + more
            raise UserError(f"model.hf_path: {path} lacks the weights {shown}")
        for name, param in model.named_parameters():
            if name not in wanted:
                continue
            shape = tuple(self._slice(name).get_shape())
            if shape != tuple(param.shape):
                first = self._stacked[name][0][0] if name in self._stacked else wanted[name]
                raise UserError(
                    f"model.hf_path: {wanted[name]} has shape {shape} in "
                    f"{self._files[first].name}, the model expects {tuple(param.shape)}"
                )

    def _slice(self, name: str):
        """Parameter `name` as a safetensors slice (`get_shape()`, rows by `[start:stop]`)."""
        if name in self._stacked:
            return _StackedSlice(
                [[self._file_slice(p) for p in parts] for parts in self._stacked[name]]
            )
        return self._file_slice(self._canonical[name].removeprefix(HF_PREFIX))

    def _file_slice(self, hf_name: str):
        file = self._files[hf_name]
        if file not in self._handles:
            self._handles[file] = open_weights(file)
        return self._handles[file].get_slice(hf_name)

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor of parameter `name`, in the file's dtype: for FSDP1, which asks for
        each module's parameters as it materializes the module.

        Raises:
            UserError: `name` is tied to another parameter; FSDP1 materializes each module's
                own copy, which would train them untied.
        """
        first = self._canonical[name]
        if first != name:
            raise UserError(
                f"model.hf_path: {self.path} ties {name.removeprefix(HF_PREFIX)} to "
                f"{first.removeprefix(HF_PREFIX)}, which fsdp.engine=fsdp1 would train untied; "
                "use fsdp.engine=fsdp2 or ddp"
            )
        return self._slice(name)[:]

    @torch.no_grad()
    def load(
        self, model: nn.Module, *, device: torch.device, buffer_device: torch.device | None = None,
        roots: list[nn.Module] | None = None,
    ) -> None:  # fmt: skip
        """Materialize the meta `model` (FSDP2-sharded, or not wrapped yet) on `device` and fill
        each parameter, or each rank's shard of it, from the files; buffers on `buffer_device`
        (default `device`). `roots`: the FSDP roots that hold its parameters where `model` is
        none (a pipeline rank's stages, `fsdprun.engines.pp`)."""
        for root in roots or [model]:
            root.to_empty(device=device)
        # to_empty gives each module holding a tied parameter a copy of its own (not under
        # FSDP2, which manages the one parameter): tie them again, as the folder has them.
        for name, first in self._canonical.items():
            path, _, attr = name.rpartition(".")
            module, tied = model.get_submodule(path), model.get_parameter(first)
            if getattr(module, attr) is not tied:
                setattr(module, attr, tied)
        for name, param in model.named_parameters():
            if name not in self._wanted:
                continue
            if isinstance(param, DTensor) and not _row_sharded(param):
                # Tensor parallel: shards of other dims (row-wise Linears, Shard(1)) or strided
                # ones (FSDP's dim-0 shard of a column-wise shard): the whole tensor is read and
                # this rank keeps its part (one full-size temporary per parameter).
                set_full_value(param, self._slice(name)[:].to(param.dtype))
                continue
            start, stop = shard_rows(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            if stop > start:
                # Only these rows are read from disk; the copy converts the dtype (bf16 files).
                local.copy_(self._slice(name)[start:stop])
        model.init_buffers(buffer_device or device)
