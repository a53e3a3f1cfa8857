"""The run side of LoRA (`fsdprun.models.lora` holds the modules): initializing the adapters of a
model whose base weights came from files, and writing adapters in peft's folder layout.

Adapters are not in a pretrained HuggingFace folder, so `HFWeights` leaves them alone and
`init_adapters` gives them the values a random init would (`engines.weights.init_value`, seeded
by the recipe seed and the name): identical at any world size and under any engine.
`build_lora_model_on_cpu` rebuilds a run's LoRA model in one process (export's merged weights):
the same base as the run's build, since every value is a function of the name, not the ranks.

Never imports the training loop nor the launcher (`train`, `launch`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fsdprun.config import LoraConfig, ModelConfig, ModelInit
from fsdprun.engines.weights import init_value, init_weights, set_full_value
from fsdprun.models import build_model
from fsdprun.models.lora import apply_lora, is_adapter_name, peft_adapter_config, peft_state_dict

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
        set_full_value(param, init_value(model, name, param, seed=seed, device=device))
        count += 1
    return count


@torch.no_grad()
def build_lora_model_on_cpu(
    model_cfg: ModelConfig, lora_cfg: LoraConfig, *, seed: int
) -> nn.Module:
    """A run's LoRA model, unsharded on the CPU, with the base and adapters the run started from:
    pretrained HF weights (`model.hf_path`, init pretrained) or the seeded init; adapters at
    their seeded init. A `checkpoint.load_from` base is the caller's to load on top."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    apply_lora(model, cfg=lora_cfg)
    cpu = torch.device("cpu")
    if model_cfg.hf_path is not None and model_cfg.init is ModelInit.pretrained:
        from fsdprun.engines.hf_weights import HFWeights  # the optional hf extra

        HFWeights(Path(model_cfg.hf_path), model).load(model, device=cpu)
        init_adapters(model, seed=seed, device=cpu)
    else:
        init_weights(model, seed=seed, device=cpu)
    return model.eval()


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
