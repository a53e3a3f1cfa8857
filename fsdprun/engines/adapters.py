"""The run side of LoRA (`fsdprun.models.lora` holds the modules): initializing the adapters of a
model whose base weights came from files, and writing adapters in peft's folder layout.

Adapters are not in a pretrained HuggingFace folder, so `HFWeights` leaves them alone and
`init_adapters` gives them the values a random init would (`parallel.init_value`, seeded by the
recipe seed and the name): identical at any world size and under any engine.

Never imports the training loop nor the launcher (`train`, `launch`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdprun.config import LoraConfig
from fsdprun.engines.weights import init_value
from fsdprun.models.lora import is_adapter_name, peft_adapter_config, peft_state_dict

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


@torch.no_grad()
def init_adapters(model: nn.Module, *, seed: int, device: torch.device) -> int:
    """Initialize the LoRA adapter parameters of a materialized model (sharded or not) from
    their full seeded values, each rank keeping its shard; returns how many were set."""
    count = 0
    for name, param in model.named_parameters():
        if not is_adapter_name(name):
            continue
        full = init_value(model, name, param, seed=seed, device=device)
        if isinstance(param, DTensor):
            # Sliced locally (src_data_rank=None): no communication, see parallel.init_weights.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
        count += 1
    return count


def save_peft_adapter(
    folder: Path,
    adapters: dict[str, torch.Tensor],
    *,
    cfg: LoraConfig,
    base_model_name_or_path: str,
) -> list[Path]:
    """Write `adapter_model.safetensors` and `adapter_config.json` as peft saves them, so that
    `PeftModel.from_pretrained(base, folder)` loads the adapters.

    Args:
        adapters: full adapter tensors under fsdprun's names (`adapter_state_dict`, or read from
            a checkpoint).
        base_model_name_or_path: the base model's folder or hub name, recorded in the config.

    Returns:
        The two files written.
    """
    from safetensors.torch import save_file  # the optional hf extra

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in peft_state_dict(adapters).items()}
    weights, config = folder / PEFT_WEIGHTS, folder / PEFT_CONFIG
    save_file(tensors, str(weights), metadata={"format": "pt"})
    content = peft_adapter_config(
        adapters, cfg=cfg, base_model_name_or_path=base_model_name_or_path
    )
    config.write_text(json.dumps(content, indent=2) + "\n")
    return [weights, config]
