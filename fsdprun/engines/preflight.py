"""What a worker's build would refuse of the recipe's model, found before any worker starts.

The model is built on the meta device from its family (an HF folder: transformers reads its
config.json; no weights are read, nothing is allocated), then checked as the worker's build
would use it: the family's TP plan against its modules (`engines.tp.tp_refusal`), its
experts against expert parallel's dispatch (`engines.ep.check_ep`), LoRA's
targets (`models.lora.apply_lora`), and for pretrained weights every tensor the model needs,
there and of its shape, in safetensors files whose headers can be read
(`engines.hf_weights.HFWeights`, which the worker builds the same way). Each problem is one
line, a `UserError`, and nothing is written: the launcher runs this before it touches the run
directory.

`fsdprun train` and `resume` run all of it; `plan` runs what a layout needs (`weights=False`:
a plan on a laptop may name a folder of config.json alone). Imports torch where it runs.
"""

from __future__ import annotations

from pathlib import Path

from fsdprun.config import ModelInit, RecipeConfig
from fsdprun.config.layout import Layout
from fsdprun.config.model_facts import model_facts
from fsdprun.engines.ep import check_ep
from fsdprun.engines.tp import tp_refusal
from fsdprun.errors import UserError
from fsdprun.models import model_spec
from fsdprun.models.lora import apply_lora


def check_model(cfg: RecipeConfig, *, weights: bool = True) -> None:
    """Build the recipe's model on the meta device and check it as the worker would.

    Raises:
        UserError: a folder transformers cannot build (an unknown model_type), a TP plan that
            does not split the model, a LoRA target it lacks, a weights file that cannot be
            read, or a tensor missing or of another shape than the model's.
    """
    import torch

    with torch.device("meta"):
        model = model_spec(cfg.model).build(cfg.model)
    refusal = tp_refusal(cfg, model)
    if refusal is not None:
        raise UserError(refusal)
    facts = model_facts(cfg.model)
    check_ep(model, Layout.of(cfg), facts.entry.experts if facts else None,
             family=model.family_name)  # fmt: skip
    apply_lora(model, cfg=cfg.lora)
    if weights and cfg.model.hf_path is not None and cfg.model.init is ModelInit.pretrained:
        from fsdprun.engines.hf_weights import HFWeights  # safetensors: the hf extra

        HFWeights(Path(cfg.model.hf_path), model)
