"""The model families' names: which module defines each family's `ModelSpec`, and why a recipe's
`model.family` / `model.hf_path` choose none.

Both `config` (which refuses an unknown family before anything loads) and `models` (which
imports the family's module and reads its `SPEC`) need these names, and `models` reads config's
sections, so the names live here, at the package's ground floor, rather than in either: config
then never imports `models`, and the two packages import each other in no circle. Adding a
family is its module under `fsdprun.models` plus one line in `FAMILIES`.

Never imports torch nor an fsdprun module (`fsdprun config` loads it).
"""

from __future__ import annotations

from dataclasses import dataclass

# Family name -> the module defining its SPEC (imported when a recipe asks for the family).
FAMILIES = {
    "llama": "fsdprun.models.llama",
    "hf": "fsdprun.models.hf",
}
HF_FAMILY = "hf"  # chosen by model.hf_path


def family_problem(family: str, hf_path: str | None) -> str | None:
    """Why `model.family` / `model.hf_path` choose no family (one line), or None."""
    if family not in FAMILIES:
        return f"model.family: '{family}' is not known; the families are {', '.join(FAMILIES)}"
    if family == HF_FAMILY and hf_path is None:
        return "model.family: 'hf' needs model.hf_path (a HuggingFace model folder or Hub id)"
    return None


@dataclass(frozen=True)
class HFFamily:
    """What a transformers model type (config.json's `model_type`) needs of the `hf` family.

    The decoder layers FSDP wraps come from the model's own `_no_split_modules`, the non-persistent
    buffers from its `_init_weights` (`fsdprun.models.hf`): neither needs an entry.
    """

    attn_implementation: str = "sdpa"
    """transformers' attention implementation to build with; "sdpa" unless the model refuses
    it (it must also accept fsdprun's 4-D boolean masks of packed rows)."""
    stacked: tuple[StackedExperts, ...] = ()
    """Parameters that checkpoints store expert by expert (`fsdprun.engines.hf_weights`)."""
    lora_attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """The Linear layers of a block's attention: what `lora.targets: [attention]` adapts."""
    lora_mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    """The Linear layers of a block's MLP (`lora.targets: [mlp]`); none where the MLP has no
    Linear to adapt (experts stored as 3-D parameters)."""

    def lora_groups(self) -> dict[str, tuple[str, ...]]:
        """The `lora.targets` group names and the layer names each stands for."""
        return {"attention": self.lora_attention, "mlp": self.lora_mlp}


@dataclass(frozen=True)
class StackedExperts:
    """A 3-D parameter [experts, rows, columns] that transformers stacks in memory from one 2-D
    tensor per expert and part in the checkpoint (its `conversion_mapping`): expert e's rows
    are its parts' rows, concatenated in order."""

    param: str
    """The parameter's name within its block, e.g. "mlp.experts.gate_up_proj"."""
    parts: tuple[str, ...]
    """The checkpoint's names of expert {e}'s parts within the block."""
    active_key: str = "num_experts_per_tok"
    """The config key of how many experts each token passes through: the FLOPs per token count
    that share of the experts' weights."""


# The model types whose training, 1 and 2 ranks, equals a plain transformers + AdamW loop and
# whose HF export gives fsdprun's logits (tests/test_hf_families.py; the table in
# docs/families.md). Others still load: they take the defaults, unverified.
HF_FAMILIES = {
    "llama": HFFamily(),
    "qwen2": HFFamily(),
    "qwen3": HFFamily(),
    # The experts are 3-D parameters and the router no Linear either: LoRA adapts attention only.
    "qwen3_moe": HFFamily(
        lora_mlp=(),
        stacked=(
            StackedExperts(
                "mlp.experts.gate_up_proj",
                ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
            ),
            StackedExperts("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
        ),
    ),
    "mistral": HFFamily(),
    # transformers builds Gemma 2 with eager attention only: SDPA cannot soft-cap the scores.
    "gemma2": HFFamily(attn_implementation="eager"),
    "gemma3_text": HFFamily(),
    # Fused projections: one Linear for q, k and v, one for the gate and up projections.
    "phi3": HFFamily(lora_attention=("qkv_proj", "o_proj"), lora_mlp=("gate_up_proj", "down_proj")),
}
