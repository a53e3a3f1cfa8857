"""Tiny random HuggingFace folders of each model family fsdprun verifies against transformers,
made by transformers itself (`AutoConfig.for_model`, `from_config`, `save_pretrained`; no
download), for tests/test_hf_families.py.

Each is 2 layers of hidden 64 with GQA (4 heads, 2 kv heads, head_dim 16) and a 256-token
vocabulary, as the debug recipe's synthetic data wants. The families' own features are switched
on where a config key does it: sliding windows of 16 tokens (shorter than the debug recipe's 64,
so that the window cuts attention), Gemma 3's alternating local and global layers, 4 experts of
which 2 are active for Qwen3-MoE. Special tokens sit inside the vocabulary (phi3's default 32000
does not).
"""

from __future__ import annotations

from pathlib import Path

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

# model_type -> what its tiny config sets beyond COMMON.
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 16},
    "gemma2": {"sliding_window": 16},
    "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}


def tiny_config(model_type: str, **extra):
    """The family's tiny transformers config; `extra` sets more fields."""
    import transformers

    return transformers.AutoConfig.for_model(
        model_type, **{**COMMON, **FAMILIES[model_type], **extra}
    )


def save_tiny_hf(model_type: str, path: Path, **extra) -> Path:
    """The family's tiny random model saved at `path` (seeded: the same weights every session);
    `extra` sets more config fields."""
    import torch
    import transformers

    config = tiny_config(model_type, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path
