"""Model families: the registry that turns a recipe's `model:` section into a `ModelSpec`.

A family is a module under `fsdprun.models` that defines `SPEC`; `FAMILIES` names it (in
`fsdprun.families`, which config reads too). Adding a family is its module plus one line in
`FAMILIES`: building, `plan`, the run's parameter and FLOP counts, `inspect-checkpoint` and
`export --format hf` all go through the spec. `model.hf_path` chooses the `hf` family (any local
HuggingFace causal LM) whatever `model.family` says.

Every model a spec builds keeps the contract `CausalLM` (a typed Protocol, below): it maps
tokens to logits, names its decoder blocks, initializes its parameters and buffers, and gives
what LoRA and context parallel take hold of. What a family *can* do (its TP plan, LoRA groups,
whether its attention is exact under context parallel, its experts, its pipeline stages) is data
in `fsdprun.families`, not methods here. `ModelArgs` stays Llama's own dataclass rather than a
neutral shape type: every family fsdprun builds is a Llama-shaped decoder (the HF wrapper reads
its config.json into one and shares Llama's RoPE), and outside `models` only `args.vocab_size`
is read. A family of another shape would add its own fields there, not here.

This module never imports torch at load (a family's module does, when a recipe asks for it); no
module of `models` imports torch.distributed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fsdprun.errors import UserError
from fsdprun.families import FAMILIES, HF_FAMILY, TPPlan, family_problem

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdprun.config import ModelConfig


@dataclass(frozen=True)
class ModelArgs:
    """The Llama-shaped summary every model offers (`CausalLM.args`): counts, FLOPs and the
    synthetic data's vocabulary read it (the HF wrapper fills it from config.json)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # The built-in Llama as a mixture of experts (the model.moe_* keys; 0 experts: dense).
    moe_experts: int = 0
    moe_active: int = 2
    moe_ffn_dim: int = 0  # each expert's hidden size
    moe_shared_ffn_dim: int = 0
    moe_norm_topk_prob: bool = True
    moe_aux_loss_coef: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@runtime_checkable
class CausalLM(Protocol):
    """What every model a `ModelSpec` builds offers (an `nn.Module`): the built-in Llama
    (`models.llama.Transformer`) and any HuggingFace folder (`models.hf.HFCausalLM`)."""

    args: ModelArgs  # the Llama-shaped summary: counts, FLOPs, the synthetic data's vocab
    family_name: str  # what messages call the model ("model.family llama")

    def __call__(
        self,
        tokens: torch.Tensor,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits of `tokens` (batch, seq); with `head`, `head(final hidden states, output
        weight)` instead; `positions` and `doc_ids` of packed rows (doc id -1: padding)."""
        ...

    def forward_hidden(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states, the input of the output projection."""
        ...

    def block_paths(self) -> list[str]:
        """Module paths of the decoder blocks, in forward order (the FSDP units of `block`)."""
        ...

    def init_std(self, name: str) -> float | None:
        """`normal(0, std)` of parameter `name` for a seeded init; None: all ones (a norm)."""
        ...

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent buffers (RoPE tables) after `to_empty`."""
        ...

    def lora_groups(self) -> dict[str, tuple[str, ...]]:
        """`lora.targets` group names -> the Linear names each stands for (`Family`)."""
        ...

    def cp_attention_modules(
        self, *, index: int, count: int, zigzag: bool = False
    ) -> list[nn.Module]:
        """Each decoder block's attention module, whose `attend(q, k, v, mask, **kwargs)` (q, k,
        v: batch, heads, seq, head_dim; returns the same layout) context parallel wraps or
        replaces; [] where the family's attention is not exact under it
        (`Family.cp_attention`). This rank holds part `index` of `count` of each row
        (`zigzag`: the ring's two chunks; `fsdprun.config.layout.cp_chunks`): what the model
        takes from the whole row (the rotary factors that depend on a document's length) it
        takes from there."""
        ...


@dataclass(frozen=True)
class ModelSpec:
    """What fsdprun needs to know of a model family. Each function takes the recipe's `model:`
    section (a `ModelConfig`)."""

    name: str
    # The model on the current default device: call it under `torch.device("meta")`.
    build: Callable[[ModelConfig], CausalLM]
    # The section with its architecture keys (dim, n_layers, n_heads, n_kv_heads, ffn_dim,
    # vocab_size, ...) as the built model has them: what plan's activation estimates read.
    shape: Callable[[ModelConfig], ModelConfig]
    # Trainable parameters, a tied tensor once.
    num_params: Callable[[ModelConfig], int]
    # Training FLOPs per token (forward + backward) at a sequence length.
    flops_per_token: Callable[[ModelConfig, int], int]
    # One line for `inspect-checkpoint`'s model row.
    describe: Callable[[ModelConfig], str]
    # Parameters tied to another (name -> first name), for checkpoints that predate recording
    # them in their train state.
    tied_params: Callable[[ModelConfig], dict[str, str]]
    # `export --format hf`: a parameter name -> its HuggingFace name; the config.json data (with
    # the export's dtype); the files copied as they are (tokenizer files, an original config).
    hf_name: Callable[[str], str]
    hf_config: Callable[[ModelConfig, torch.dtype], dict[str, Any]]
    hf_files: Callable[[ModelConfig], list[Path]]
    # parallel.tp: the family's tensor-parallel plan for the model, or why it has none (one
    # clause; `fsdprun.engines.tp.tp_plan_problem` says it).
    tp_plan: Callable[[ModelConfig], TPPlan | str] = lambda cfg: "its family has none"


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The spec of the recipe's model: `hf` when model.hf_path is set, else model.family's.

    Raises:
        UserError: an unknown family, or `hf` without model.hf_path.
    """
    problem = family_problem(cfg.family, cfg.hf_path)
    if problem is not None:
        raise UserError(problem)
    family = HF_FAMILY if cfg.hf_path is not None else cfg.family
    return importlib.import_module(FAMILIES[family]).SPEC


def build_model(cfg: ModelConfig) -> CausalLM:
    """The recipe's model on the current default device (call it under `torch.device("meta")`).

    Raises:
        UserError: no such family; model.hf_path without transformers, or an unusable folder.
    """
    return model_spec(cfg).build(cfg)
