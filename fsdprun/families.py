"""The model families as data: which module defines each family's `ModelSpec`, why a recipe's
`model.family` / `model.hf_path` choose none, and what each family can do (`Family`): its
tensor-parallel plan, its LoRA groups, whether its attention is exact under context parallel,
where its experts live, and how its layers split into pipeline stages.

Both `config` (which refuses an unknown family, and a layout the family cannot take, before
anything loads) and `models` (which imports the family's module and reads its `SPEC`) need these
facts, and `models` reads config's sections, so they live here, at the package's ground floor,
rather than in either: config then never imports `models`, and the two packages import each
other in no circle. Adding a family is its module under `fsdprun.models`, one line in `FAMILIES`
and its entry in `BUILTIN_FAMILIES`; adding a HuggingFace model type is one `HF_FAMILIES` entry
(and its row in tests/hf_families.py). A capability is a field here, never a branch on a
family's name in the engine, the checks or the model.

Never imports torch nor an fsdprun module (`fsdprun config` loads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


# The tensor-parallel styles a `TPPlan` names (`fsdprun.engines.tp` turns each into torch's
# ParallelStyle; a plan is plain data here, beside the families).
TP_STYLES = {
    "colwise": "ColwiseParallel: output features sharded (q/k/v, gate/up)",
    "rowwise": "RowwiseParallel: input features sharded; output reduce-scattered on the "
    "sequence (sequence parallel)",
    "norm": "SequenceParallel: weight replicated, activations sharded on the sequence",
    "residual_norm": "SequenceParallel on a sub-layer's output before the residual add: weight "
    "replicated, the local sequence shard handed on",
    "head_norm": "SequenceParallel on the heads (dim 2) of a per-head q/k norm: weight "
    "replicated, each rank normalizing its heads",
    "colwise_gather": "ColwiseParallel, output all-gathered: a fused projection whose model "
    "slices the whole output (Phi-3's qkv, gate_up)",
    "rowwise_split": "RowwiseParallel of a whole input (after colwise_gather): each rank takes "
    "its input columns; output reduce-scattered on the sequence",
    "block_input": "PrepareModuleInput: all-gather the sequence-sharded input (first argument)",
    "embedding": "RowwiseParallel: vocab rows sharded; output sharded on the sequence",
    "output": "ColwiseParallel: vocab sharded, logits left sharded for loss parallel",
    "moe": "a mixture of experts' block: input all-gathered on the sequence, computed on local "
    "tensors, the experts' shares reduce-scattered back onto the sequence",
    "router": "the router, replicated: every rank routes every token alike",
    "experts": "the stacked experts split by experts (Shard(0)): each rank runs its experts / tp "
    "on the tokens routed to them",
}


@dataclass(frozen=True)
class TPPlan:
    """How a family's model is tensor-parallelized: a style of `TP_STYLES` per module path.

    `blocks`: paths inside each decoder block (relative to it); `top`: paths from the model's
    root (embedding, final norm, output). The activations between blocks are sharded on the
    sequence (dim 1, sequence parallel), gathered by each `block_input` module.
    `block_inputs`: how many positional arguments each `block_input` module takes (layouts are
    given per argument); 0 = its input is the keyword `hidden_states`.
    """

    blocks: dict[str, str]
    top: dict[str, str]
    block_inputs: dict[str, int] = field(default_factory=dict)

    def extended(self, **blocks: str) -> TPPlan:
        """This plan with more (or other) block modules: `extended(**{"self_attn.q_norm": ...})`."""
        return TPPlan({**self.blocks, **blocks}, self.top, self.block_inputs)


# HuggingFace decoders with Llama's module names (transformers' own `base_model_tp_plan` splits
# Llama, Mistral, Qwen2 the same way), with sequence parallel as the built-in Llama: the
# activations between decoder layers are sharded on the sequence, the norms run on the local
# slice, and each attention / MLP gathers its input (PrepareModuleInput, Shard(1) -> Replicate).
# The decoder derives the positions and the causal mask from the activations' (local) length:
# `fsdprun.models.hf.packed_inputs` passes whole-row position_ids (so the rotary table covers the
# row), and the mask is either fsdprun's whole 4-D one (packed rows, sliding windows) or none,
# SDPA's `is_causal` then applying on the gathered sequence. The attention reshapes with -1
# heads, so column-sharded q/k/v give it the local heads. The decoder layer calls self_attn with
# the keyword `hidden_states`, the MLP with one positional argument.
HF_LLAMA_TP = TPPlan(
    blocks={
        "input_layernorm": "norm", "self_attn": "block_input", "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "post_attention_layernorm": "norm", "mlp": "block_input",
        "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
    },
    top={"hf.model.embed_tokens": "embedding", "hf.model.norm": "norm", "hf.lm_head": "output"},
    block_inputs={"self_attn": 0, "mlp": 1},
)  # fmt: skip
# Qwen3's RMSNorm of each head's q and k (over head_dim, after the column-wise q/k_proj): each
# rank normalizes its own heads with the whole weight, whose gradient sums over every head.
HEAD_NORMS = {"self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"}
# Gemma 2 and 3 norm each sub-layer's output before its residual add (post_attention_layernorm
# there is that, not the MLP's input norm as in Llama) and the MLP's input with
# pre_feedforward_layernorm. The residual stream is the local sequence shard (the row-wise
# projections hand it on so): the post-norms hand on theirs the same way. Their embedding scale
# and (1 + w) norms are the model's own arithmetic on the split tensors.
GEMMA_NORMS = {"post_attention_layernorm": "residual_norm", "pre_feedforward_layernorm": "norm",
               "post_feedforward_layernorm": "residual_norm"}  # fmt: skip
# Phi-3 fuses q, k, v into qkv_proj and gate, up into gate_up_proj, and slices the fused output
# by the whole model's widths (config.num_attention_heads x head_dim; chunk(2)): a column shard
# of it is not the local heads' q, k and v. The fused weights are split by rows (1/tp of each on
# a rank) and their outputs all-gathered, as transformers' own Phi-3 plan does
# (colwise_gather_output); attention and the activation run whole on every rank, and o_proj and
# down_proj take their input columns of the whole result.
PHI3_TP = TPPlan(
    blocks={
        "input_layernorm": "norm", "self_attn": "block_input",
        "self_attn.qkv_proj": "colwise_gather", "self_attn.o_proj": "rowwise_split",
        "post_attention_layernorm": "norm", "mlp": "block_input",
        "mlp.gate_up_proj": "colwise_gather", "mlp.down_proj": "rowwise_split",
    },
    top=HF_LLAMA_TP.top,
    block_inputs=HF_LLAMA_TP.block_inputs,
)  # fmt: skip
# A mixture of experts (transformers' Qwen3-MoE) with Qwen3's attention: the sparse block's
# input gathered and its output reduced like a dense MLP's, its router replicated, its stacked
# experts split by experts between the TP ranks (`fsdprun.engines.tp_styles`: transformers keeps
# each expert's gate and up projections in one tensor whose output it halves, which a column
# split cannot cut with torch's public placements). A folder whose blocks mix dense and sparse
# MLPs has no such plan for its dense ones: the layout check refuses it.
MOE_TP = TPPlan(
    blocks={**{rel: style for rel, style in HF_LLAMA_TP.blocks.items()
               if not rel.startswith("mlp")}, **HEAD_NORMS,
            "mlp": "moe", "mlp.gate": "router", "mlp.experts": "experts"},
    top=HF_LLAMA_TP.top,
    block_inputs={"self_attn": 0},
)  # fmt: skip


@dataclass(frozen=True)
class Stages:
    """How a family's model splits into pipeline stages: the modules before the decoder blocks
    (on the first stage), the container of the blocks (split between the stages), and the
    modules after them (on the last stage), as module paths from the model's root."""

    first: tuple[str, ...]
    blocks: str
    last: tuple[str, ...]


# transformers' causal LMs of Llama's shape: model.embed_tokens (and the rotary embedding the
# decoder computes its positions with), model.layers, then model.norm and lm_head.
HF_STAGES = Stages(("hf.model.embed_tokens", "hf.model.rotary_emb"), "hf.model.layers",
                   ("hf.model.norm", "hf.lm_head"))  # fmt: skip


@dataclass(frozen=True)
class Family:
    """What fsdprun knows a model family can do: the built-in Llama's entry
    (`BUILTIN_FAMILIES`) and each transformers model type's (config.json's `model_type`,
    `HF_FAMILIES`) are declared the same way.

    For HuggingFace models, the decoder layers FSDP wraps come from the model's own
    `_no_split_modules`, the non-persistent buffers from its `_init_weights`
    (`fsdprun.models.hf`): neither needs an entry.
    """

    tp_plan: TPPlan | str = HF_LLAMA_TP
    """parallel.tp's plan (`fsdprun.engines.tp`), or why there is none (one clause). Any plan
    splits a model only where its modules are the plan's (`tp_plan_problem`, before launch)."""
    lora_attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """The Linear layers of a block's attention: what `lora.targets: [attention]` adapts."""
    lora_mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    """The Linear layers of a block's MLP (`lora.targets: [mlp]`); none where the MLP has no
    Linear to adapt (experts stored as 3-D parameters)."""
    cp_attention: bool = False
    """Whether context parallel may take over the family's attention call
    (`cp_attention_modules`: the all-to-all wraps it, the ring replaces it): the call must give
    everything that shapes the scores as data, the whole row's mask or none (causal), and for
    HuggingFace models transformers' `scaling`, `sliding_window` and `softcap` arguments, which
    both apply on whole-row positions. Each family declaring it trains under cp 2 as on one
    rank (tests/test_cp.py, tests/test_cp_families.py)."""
    experts: str | None = None
    """The module of each decoder block that holds its experts (a mixture of experts), None for
    a dense model. Its forward takes `(hidden (tokens, dim), top_k_index (tokens, k),
    top_k_weights (tokens, k))` after the family's own router, and it holds the experts
    stacked as `gate_up_proj` [experts, 2 x ffn, dim] and `down_proj` [experts, dim, ffn]
    with `act_fn` between, as transformers' Qwen3-MoE and Mixtral experts do: expert parallel
    (`fsdprun.engines.ep`) shards it and replaces its forward with the all-to-all dispatch, and
    the load-balance figures count the tokens its forward receives. A block without it (a
    dense layer among sparse ones) is left alone."""
    stages: Stages | None = HF_STAGES
    """How the layers split into pipeline stages (None: not declared)."""
    attn_implementation: str = "sdpa"
    """transformers' attention implementation to build with; "sdpa" unless the model refuses
    it (it must also accept fsdprun's 4-D boolean masks of packed rows). HF models only."""
    stacked: tuple[StackedExperts, ...] = ()
    """Parameters that checkpoints store expert by expert (`fsdprun.engines.hf_weights`)."""

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
    "llama": Family(cp_attention=True),
    "qwen2": Family(cp_attention=True),
    # Per-head q/k norms: applied on each rank's slice before the exchange, as rotary is.
    "qwen3": Family(tp_plan=HF_LLAMA_TP.extended(**HEAD_NORMS), cp_attention=True),
    # The experts are 3-D parameters and the router no Linear either: LoRA adapts attention only.
    # Routing is per token (the router's auxiliary loss is not: refused under cp, layout.py).
    "qwen3_moe": Family(
        cp_attention=True,
        lora_mlp=(),
        experts="mlp.experts",
        tp_plan=MOE_TP,
        stacked=(
            StackedExperts(
                "mlp.experts.gate_up_proj",
                ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
            ),
            StackedExperts("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
        ),
    ),
    "mistral": Family(cp_attention=True),
    # transformers builds Gemma 2 with eager attention only: SDPA cannot soft-cap the scores
    # (under cp the soft-capping goes through the ring's and eager attention's score path).
    "gemma2": Family(
        attn_implementation="eager", tp_plan=HF_LLAMA_TP.extended(**GEMMA_NORMS), cp_attention=True
    ),
    "gemma3_text": Family(
        tp_plan=HF_LLAMA_TP.extended(**GEMMA_NORMS, **HEAD_NORMS), cp_attention=True
    ),
    # Fused projections: one Linear for q, k and v, one for the gate and up projections; its
    # partial rotary is applied before the attention call, on each rank's slice.
    "phi3": Family(
        cp_attention=True,
        lora_attention=("qkv_proj", "o_proj"),
        lora_mlp=("gate_up_proj", "down_proj"),
        tp_plan=PHI3_TP,
    ),
}

# The built-in families, declared as the HuggingFace types are.
# Megatron's split with sequence parallel (torchtitan's Llama plan): between blocks the
# activations are sharded on the sequence; each norm works on its shard; the attention and
# feed-forward inputs are all-gathered (`block_input`), their first matmuls column-sharded and
# their last row-sharded, reduce-scattered back onto the sequence. The output stays
# vocab-sharded for loss parallel: the whole logits are never gathered.
LLAMA_TP = TPPlan(
    blocks={
        "attention_norm": "norm", "attention": "block_input", "attention.wq": "colwise",
        "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
        "ffn_norm": "norm", "feed_forward": "block_input", "feed_forward.w1": "colwise",
        "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    },
    top={"tok_embeddings": "embedding", "norm": "norm", "output": "output"},
    # Attention takes (x, rope, attn_mask), the feed-forward (x).
    block_inputs={"attention": 3, "feed_forward": 1},
)  # fmt: skip
BUILTIN_FAMILIES = {
    "llama": Family(
        tp_plan=LLAMA_TP,
        lora_attention=("wq", "wk", "wv", "wo"),
        lora_mlp=("w1", "w3", "w2"),
        cp_attention=True,
        stages=Stages(("tok_embeddings",), "layers", ("norm", "output")),
        # With model.moe_experts > 0 (`fsdprun.models.moe`): each block's feed-forward is a
        # mixture of experts whose router is `moe.gate`.
        experts="moe.experts",
    ),
}


# A family registered in `FAMILIES` without an entry here: it can do nothing it has not declared.
UNDECLARED = Family(tp_plan="its family declares none", lora_attention=(), lora_mlp=(),
                    stages=None)  # fmt: skip


def family_entry(family: str, model_type: str | None = None) -> Family:
    """What the recipe's model can do: its built-in family's entry, or for `hf` its model
    type's (`HF_FAMILIES`; the defaults, unverified, for a type not listed)."""
    if family == HF_FAMILY:
        return HF_FAMILIES.get(model_type, Family())
    return BUILTIN_FAMILIES.get(family, UNDECLARED)
