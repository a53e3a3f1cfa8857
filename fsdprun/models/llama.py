"""The built-in Llama family (RMSNorm, RoPE, grouped-query attention, SwiGLU): its architecture,
parameter and FLOP counts, and its HuggingFace names, registered as `SPEC`.

How the model is sharded, compiled and checkpointed lives in `fsdprun.engines`; this file never
imports torch.distributed. Build it on the meta device and let the caller materialize it:

    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=256, n_layers=4, ...))
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdprun.config.sizes import llama_num_params
from fsdprun.errors import UserError
from fsdprun.families import BUILTIN_FAMILIES
from fsdprun.models import ModelArgs, ModelSpec
from fsdprun.models.attention import AttentionMask, attend, build_attention_mask
from fsdprun.models.moe import MoE, load_balancing_loss

# What the family can do (its TP plan, LoRA groups, context parallel, pipeline stages): data in
# `fsdprun.families`, declared as the HuggingFace model types are.
FAMILY = BUILTIN_FAMILIES["llama"]

if TYPE_CHECKING:
    from fsdprun.config import ModelConfig


def rope_table(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin of the rotary angles, shape (max_seq_len, head_dim // 2, 2), fp32."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(half, device=device).float() / half))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows of `table` at per-token `positions` (batch, seq): (batch, seq, head_dim // 2, 2).
    Packed rows restart their positions at each example."""
    return table[positions]


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x (batch, seq, heads, head_dim), at
    positions 0..seq-1 of a `rope_table`, or at the per-token positions of a `rope_at` table."""
    if table.ndim == 4:
        cos = table[..., 0][:, :, None, :].to(x.dtype)
        sin = table[..., 1][:, :, None, :].to(x.dtype)
    else:
        seq = x.shape[1]
        cos = table[:seq, :, 0][None, :, None, :].to(x.dtype)
        sin = table[:seq, :, 1][None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16/fp16 compute.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


class Attention(nn.Module):
    # The attention call, an attribute so that context parallel (`fsdprun.engines.cp`) can wrap
    # it in its all-to-all on each instance; the model itself never communicates.
    attend = staticmethod(attend)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_mask: AttentionMask = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv are column-sharded and this rank holds
        # n_heads / tp query heads and n_kv_heads / tp kv heads (the ratio is kept).
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v, attn_mask, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A mixture of experts in place of the SwiGLU with model.moe_experts (`models.moe`).
        if args.moe_experts:
            self.moe = MoE(
                args.dim, num_experts=args.moe_experts, top_k=args.moe_active,
                ffn_dim=args.moe_ffn_dim, shared_ffn_dim=args.moe_shared_ffn_dim,
                norm_topk_prob=args.moe_norm_topk_prob,
            )  # fmt: skip
        else:
            self.feed_forward = FeedForward(args)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_mask: AttentionMask = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, attn_mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    family_name = "model.family llama"  # what messages call the model

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0", "1", ... keeps checkpoint keys stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, so checkpoints hold only trained state.
        self.register_buffer("rope", rope_table(args), persistent=False)
        # A mixture of experts with model.moe_aux_loss_coef > 0: each forward keeps coef x the
        # load-balancing loss of its routers' logits in `router_aux_loss`, which the engine's
        # loss adds (`Engine.forward_loss`), as `HFCausalLM` keeps transformers' own.
        self.router_aux_coef = args.moe_aux_loss_coef if args.moe_experts else 0.0
        self.router_aux_loss: torch.Tensor | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits; with `head`, `head(final hidden states, output weight)` instead (a loss
        that never builds the whole logits, `fsdprun.loss`). The head runs here, inside the
        root module's forward, where FSDP has the output weight gathered.

        Packed rows: `positions` (batch, seq) are the RoPE positions of each token (restarting at
        0 per example; default 0..seq-1) and `doc_ids` (batch, seq) the example of each token, -1
        for padding: attention stays causal within each example (`fsdprun.models.attention`).
        """
        h = self.forward_hidden(tokens, positions=positions, doc_ids=doc_ids)
        if head is not None:
            return head(h, self.output.weight)
        return self.output(h)

    def forward_hidden(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the last norm), the input of the output projection."""
        rope = self.rope if positions is None else rope_at(self.rope, positions)
        # Built once per forward and shared by every block (a keyword through the activation
        # checkpointing and compile wrappers of the blocks).
        attn_mask = build_attention_mask(doc_ids, head_dim=self.args.head_dim)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope, attn_mask=attn_mask)
        if self.router_aux_coef:
            # Over the micro-batch's tokens, padding (doc id -1) excluded: transformers' loss
            # with a 2-D attention mask.
            real = None if doc_ids is None else (doc_ids >= 0).long()
            logits = tuple(layer.moe.router_logits for layer in self.layers.values())
            aux = load_balancing_loss(logits, self.args.moe_experts, self.args.moe_active, real)
            self.router_aux_loss = self.router_aux_coef * aux
        return self.norm(h)

    def lora_groups(self) -> dict[str, tuple[str, ...]]:
        """`lora.targets` groups: the attention and the feed-forward Linear names (`FAMILY`)."""
        return FAMILY.lora_groups()

    def block_paths(self) -> list[str]:
        """Module paths of the transformer blocks (FSDP units under the `block` policy)."""
        return [f"layers.{name}" for name in self.layers]

    def cp_attention_modules(
        self, *, index: int, count: int, zigzag: bool = False
    ) -> list[nn.Module]:
        """Each block's attention, whose `attend` context parallel wraps ([] where the family's
        attention is not exact under it: `Family.cp_attention`). The part this rank holds
        (`index` of `count`, `zigzag`) changes nothing else: the rotary table depends on
        positions only."""
        if not FAMILY.cp_attention:
            return []
        return [layer.attention for layer in self.layers.values()]

    def init_buffers(self, device: torch.device) -> None:
        """Recompute non-persistent buffers after `to_empty` (they hold garbage then)."""
        self.rope = rope_table(self.args, device=device)

    def init_std(self, name: str) -> float | None:
        """Initial std of parameter `name` (normal, mean 0); None means all ones (norm weights).

        Output projections of each residual branch are scaled by 1/sqrt(2 n_layers) (GPT-2).
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight",
                          "moe.experts.down_proj", "shared_expert.w2.weight")):  # fmt: skip
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02


def num_params(args: ModelArgs) -> int:
    """All trainable parameters (the tied output projection counted once); the formula is
    config's, so that `fsdprun recipes` counts without torch."""
    return llama_num_params(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        ffn_dim=args.ffn_dim, vocab_size=args.vocab_size, tie_embeddings=args.tie_embeddings,
        moe_experts=args.moe_experts, moe_ffn_dim=args.moe_ffn_dim,
        moe_shared_ffn_dim=args.moe_shared_ffn_dim,
    )  # fmt: skip


def num_matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in a matmul per token: every Linear, including the output
    projection even when tied; not the embedding lookup nor the norm weights. Of a mixture of
    experts: the router, the active experts' and the shared expert's."""
    kv = args.n_kv_heads * args.head_dim
    ffn = 3 * args.dim * args.ffn_dim
    if args.moe_experts:
        ffn = (args.dim * args.moe_experts + args.moe_active * 3 * args.dim * args.moe_ffn_dim
               + 3 * args.dim * args.moe_shared_ffn_dim)  # fmt: skip
    block = 2 * args.dim * args.dim + 2 * args.dim * kv + ffn
    return args.n_layers * block + args.vocab_size * args.dim


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6·N_matmul + 12·n_layers·dim·seq_len.

    6·N counts 2 FLOPs per multiply-add, forward plus twice that for backward; the second term is
    attention's QK^T and AV matmuls at this sequence length (PaLM's convention: no discount for
    the causal mask, no recompute for activation checkpointing).
    """
    return 6 * num_matmul_params(args) + 12 * args.n_layers * args.dim * seq_len


def build_model_args(cfg: ModelConfig) -> ModelArgs:
    """The architecture of the recipe's `model:` section."""
    return ModelArgs(
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads,
        ffn_dim=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        norm_eps=cfg.norm_eps,
        tie_embeddings=cfg.tie_embeddings,
        moe_experts=cfg.moe_experts,
        moe_active=cfg.moe_active,
        moe_ffn_dim=cfg.moe_ffn_dim or cfg.ffn_dim,
        moe_shared_ffn_dim=cfg.moe_shared_ffn_dim,
        moe_norm_topk_prob=cfg.moe_norm_topk_prob,
        moe_aux_loss_coef=cfg.moe_aux_loss_coef,
    )


# fsdprun Llama names → HuggingFace Llama names (within a block, then outside the blocks).
_HF_BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "moe.gate": "mlp.gate",
}  # fmt: skip
# The built-in MoE's stacked experts keep transformers' names (Mixtral's, under `mlp`).
_HF_EXPERT_NAMES = {"moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
                    "moe.experts.down_proj": "mlp.experts.down_proj"}  # fmt: skip
_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_llama_name(name: str) -> str:
    """An fsdprun Llama tensor name → its HuggingFace Llama name (the RoPE conventions agree:
    no permutation of q/k is needed).

    Raises:
        UserError: a name that is not part of the Llama architecture.
    """
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if match and match.group(2) in _HF_BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_HF_BLOCK_NAMES[match.group(2)]}.weight"
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match and match.group(2) in _HF_EXPERT_NAMES:
        return f"model.layers.{match.group(1)}.{_HF_EXPERT_NAMES[match.group(2)]}"
    raise UserError(f"{name}: not a Llama tensor; cannot name it for HuggingFace")


def hf_llama_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A LlamaConfig (as config.json data) for the recipe's `model:` section; a MixtralConfig
    for its mixture of experts (Llama's attention, transformers' top-k routing renormalized,
    stacked experts under the same names).

    Raises:
        UserError: a mixture of experts Mixtral does not express (a shared expert, top-k
            probabilities not renormalized).
    """
    args = build_model_args(cfg)
    if args.moe_experts and (args.moe_shared_ffn_dim or not args.moe_norm_topk_prob):
        raise UserError(
            "export --format hf: the built-in mixture of experts is written as a Mixtral "
            "folder, which has no shared expert (model.moe_shared_ffn_dim) and always "
            "renormalizes the top-k probabilities (model.moe_norm_topk_prob); use --format "
            "torch or safetensors"
        )
    moe = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "num_local_experts": args.moe_experts, "num_experts_per_tok": args.moe_active,
        "router_aux_loss_coef": args.moe_aux_loss_coef,
        "output_router_logits": args.moe_aux_loss_coef > 0, "router_jitter_noise": 0.0,
        "sliding_window": None,
    } if args.moe_experts else {}  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.moe_ffn_dim if args.moe_experts else args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # Both spellings: transformers 4.x reads rope_theta, 5.x rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _HF_DTYPE_NAMES.get(dtype, "float32"),
        **moe,
    }


def _describe(cfg: ModelConfig) -> str:
    kv = f" ({cfg.n_kv_heads} kv)" if cfg.n_kv_heads else ""
    ffn = f"ffn {cfg.ffn_dim}"
    if cfg.moe_experts:
        shared = f" + shared {cfg.moe_shared_ffn_dim}" if cfg.moe_shared_ffn_dim else ""
        ffn = (f"{cfg.moe_experts} experts ({cfg.moe_active} active) of ffn "
               f"{cfg.moe_ffn_dim or cfg.ffn_dim}{shared}")  # fmt: skip
    return (
        f"{cfg.family}: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads{kv}, "
        f"{ffn}, vocab {cfg.vocab_size}"
    )


def _tied_params(cfg: ModelConfig) -> dict[str, str]:
    return {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}


SPEC = ModelSpec(
    name="llama",
    build=lambda cfg: Transformer(build_model_args(cfg)),
    shape=lambda cfg: cfg,
    num_params=lambda cfg: num_params(build_model_args(cfg)),
    flops_per_token=lambda cfg, seq_len: flops_per_token(build_model_args(cfg), seq_len),
    describe=_describe,
    tied_params=_tied_params,
    hf_name=hf_llama_name,
    hf_config=hf_llama_config,
    hf_files=lambda cfg: [],
    tp_plan=lambda cfg: FAMILY.tp_plan,
)
