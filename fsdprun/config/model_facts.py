"""The model's facts, read once: its shape, attention, rope, experts and family entry, from the
recipe's `model:` section (the built-in Llama) or from a `model.hf_path` folder's config.json.

`model_facts(cfg.model)` is what every room asks about the model before one is built: the
recipe checks (heads and ffn that parallel.tp must divide, kv heads for parallel.cp), the data
preflight (the vocabulary), plan, the engines' knob tables and the HF family (its model type).
config.json is parsed here and nowhere else (`config_json`): an export copies it through this
module too. A folder whose config.json cannot be read gives None, which each check leaves to the
one refusal that names the folder (validate: "has no config.json").

Torch-free and transformers-free: `fsdprun config` and the launcher's checks read the JSON
directly. transformers builds the model from the same file (`fsdprun.models.hf`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdprun.families import HF_FAMILY, Family, family_entry

if TYPE_CHECKING:
    from fsdprun.config.schema import ModelConfig

CONFIG_JSON = "config.json"


@dataclass(frozen=True)
class ModelFacts:
    """What fsdprun knows of the recipe's model without building it. A field is None where the
    folder's config.json does not say (a check that needs it then leaves the folder alone)."""

    family: str  # the ModelSpec family: `llama` (built-in) or `hf`
    model_type: str | None  # config.json's model_type; None for a built-in family
    n_layers: int | None
    dim: int | None
    n_heads: int | None
    n_kv_heads: int | None
    head_dim: int | None
    ffn_dim: int | None
    vocab_size: int | None
    tie_embeddings: bool
    rope_type: str = "default"  # rope_scaling's type (`longrope`, `dynamic`, `yarn`, ...)
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attention_dropout: float = 0.0
    attn_softcap: float | None = None  # Gemma 2's attn_logit_softcapping of the scores
    num_experts: int | None = None  # experts per mixture-of-experts layer; None: dense
    num_experts_per_tok: int | None = None
    expert_ffn_dim: int | None = None  # each expert's hidden size (moe_intermediate_size)
    moe_layers: int | None = None  # the layers that are sparse (the others dense); None: dense
    attention_bias: bool = False  # config.json's attention_bias (or mlp_bias): biased Linears
    # config.json's output_router_logits: true (and a router_aux_loss_coef other than 0): the
    # mixture of experts' load-balancing loss is added to the training loss.
    router_aux_loss: bool = False
    remote_code: bool = False  # config.json's auto_map: the folder ships its own model code
    source: str = "the recipe's model section"  # what messages name as the facts' origin

    @property
    def hf(self) -> bool:
        return self.family == HF_FAMILY

    @property
    def entry(self) -> Family:
        """The family's capabilities (`fsdprun.families`): its TP plan, LoRA groups, context
        parallel attention, experts and pipeline stages."""
        return family_entry(self.family, self.model_type)

    def tp_shape(self) -> dict[str, int] | None:
        """The dims parallel.tp must divide, by the keys that set them (the recipe's model.*
        keys, or config.json's); None when the folder does not say them all. Not the vocab:
        DTensor shards it unevenly (`fsdprun.config.layout`)."""
        if self.n_heads is None or self.n_kv_heads is None or self.ffn_dim is None:
            return None
        if self.hf:
            # A mixture of experts' experts are split between the TP ranks whole.
            experts = {"num_experts": self.num_experts} if self.num_experts else {}
            return {"num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
                    "intermediate_size": self.ffn_dim, **experts}  # fmt: skip
        return {"model.n_heads": self.n_heads, "model.n_kv_heads": self.n_kv_heads,
                "model.ffn_dim": self.ffn_dim}  # fmt: skip

    def cp_unverified(self) -> str | None:
        """The model as a refusal names it when its family does not declare its attention for
        context parallel (`Family.cp_attention`), else None."""
        if self.entry.cp_attention:
            return None
        if self.hf:
            return f"model.hf_path's model_type {self.model_type!r}"
        return f"model.family {self.family}"


def model_facts(cfg: ModelConfig) -> ModelFacts | None:
    """The facts of the recipe's model: its `model:` section's for a built-in family, its
    config.json's for model.hf_path (None when that file cannot be read as a JSON object)."""
    if cfg.hf_path is None:
        n_kv = cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads
        moe = cfg.moe_experts > 0  # the model.moe_* keys: the built-in Llama's experts
        return ModelFacts(
            family=cfg.family, model_type=None, n_layers=cfg.n_layers, dim=cfg.dim,
            n_heads=cfg.n_heads, n_kv_heads=n_kv,
            head_dim=cfg.dim // cfg.n_heads if cfg.n_heads else None, ffn_dim=cfg.ffn_dim,
            vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings,
            max_position_embeddings=cfg.max_seq_len,
            num_experts=cfg.moe_experts if moe else None,
            num_experts_per_tok=cfg.moe_active if moe else None,
            expert_ffn_dim=(cfg.moe_ffn_dim or cfg.ffn_dim) if moe else None,
            router_aux_loss=moe and cfg.moe_aux_loss_coef != 0,
        )  # fmt: skip
    return _folder_facts(*_stamp(Path(cfg.hf_path)))


def config_json(folder: str | Path) -> dict[str, Any] | None:
    """A HuggingFace folder's config.json as a dict, None when it is missing, unreadable or not
    a JSON object (read afresh: an export copies what is on disk now)."""
    try:
        data = json.loads((Path(folder) / CONFIG_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stamp(folder: Path) -> tuple[str, int, int]:
    """(folder, config.json's mtime and size): the cache key, so that a file changed on disk
    is read again."""
    try:
        st = (folder / CONFIG_JSON).stat()
        return str(folder), st.st_mtime_ns, st.st_size
    except OSError:
        return str(folder), -1, -1


@functools.cache
def _folder_facts(folder: str, mtime_ns: int, size: int) -> ModelFacts | None:
    hf = config_json(folder)
    if hf is None:
        return None
    text = hf.get("text_config")
    text = text if isinstance(text, dict) else {}
    heads = _count(hf.get("num_attention_heads"))
    kv = _count(hf.get("num_key_value_heads")) or heads
    dim = _count(hf.get("hidden_size"))
    head_dim = _count(hf.get("head_dim")) or (dim // heads if dim and heads else None)
    # transformers 5 writes `rope_parameters` (with rope_theta inside), earlier ones
    # `rope_scaling`; a folder may carry either.
    rope = next((r for r in (hf.get("rope_parameters"), hf.get("rope_scaling"))
                 if isinstance(r, dict)), None)  # fmt: skip
    rope_type = str((rope or {}).get("rope_type") or (rope or {}).get("type") or "default")
    layer_types = hf.get("layer_types")
    experts = _count(hf.get("num_experts")) or _count(hf.get("num_local_experts"))
    return ModelFacts(
        family=HF_FAMILY,
        model_type=hf.get("model_type") if isinstance(hf.get("model_type"), str) else None,
        n_layers=_count(hf.get("num_hidden_layers")),
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=head_dim,
        ffn_dim=_count(hf.get("intermediate_size")),
        # A multimodal folder's language model keeps its vocabulary in text_config.
        vocab_size=_count(hf.get("vocab_size")) or _count(text.get("vocab_size")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_type=rope_type,
        rope_scaling=rope,
        max_position_embeddings=_count(hf.get("max_position_embeddings")),
        original_max_position_embeddings=_count(hf.get("original_max_position_embeddings"))
        or _count((rope or {}).get("original_max_position_embeddings")),
        sliding_window=_count(hf.get("sliding_window")),
        layer_types=tuple(map(str, layer_types)) if isinstance(layer_types, list) else None,
        attention_dropout=_number(hf.get("attention_dropout")),
        attn_softcap=_number(hf.get("attn_logit_softcapping")) or None,
        num_experts=experts,
        num_experts_per_tok=_count(hf.get("num_experts_per_tok")),
        expert_ffn_dim=_count(hf.get("moe_intermediate_size")) if experts else None,
        moe_layers=_sparse_layers(hf, experts),
        attention_bias=hf.get("attention_bias") is True or hf.get("mlp_bias") is True,
        router_aux_loss=hf.get("output_router_logits") is True
        and _number(hf.get("router_aux_loss_coef", 1.0)) != 0,
        remote_code=isinstance(hf.get("auto_map"), dict),
        source=f"{Path(folder) / CONFIG_JSON}",
    )


def _sparse_layers(hf: dict[str, Any], experts: int | None) -> int | None:
    """How many decoder layers are mixtures of experts, as transformers' Qwen3-MoE decides
    (layer i unless it is in mlp_only_layers or (i + 1) is no multiple of decoder_sparse_step;
    Mixtral's every layer); None for a dense model or a layer count it cannot read."""
    layers = _count(hf.get("num_hidden_layers"))
    if not experts or layers is None:
        return None
    step = _count(hf.get("decoder_sparse_step")) or 1
    dense = hf.get("mlp_only_layers") if isinstance(hf.get("mlp_only_layers"), list) else []
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _count(value: Any) -> int | None:
    """A positive whole number of config.json (heads, layers, a vocabulary), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        return None
    return int(value) if value > 0 else None


def _number(value: Any) -> float:
    """A rate of config.json (attention_dropout): 0.0 where it is absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value)
