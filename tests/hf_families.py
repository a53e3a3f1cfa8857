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

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from fsdprun.config.composition import TINY_CONFIG, TINY_FAMILIES

# The shape (COMMON) and each model_type's own settings (FAMILIES) are the ones the composition
# table of docs/parallelism.md is computed at (fsdprun.config.composition): one source for both.
COMMON = TINY_CONFIG
FAMILIES: dict[str, dict] = TINY_FAMILIES


TEMPLATES = Path(__file__).resolve().parent / "chat_templates"


@dataclass(frozen=True)
class ChatTokens:
    """A family's chat template file (in TEMPLATES) and special tokens, which take ids 0, 1, 2...
    of the control bytes in order; pad, bos and eos name some of them (bos None: the family has
    none)."""

    template: str
    specials: tuple[str, ...]
    pad: str
    bos: str | None
    eos: str


QWEN = ChatTokens(
    "qwen3.jinja",
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    pad="<|endoftext|>",
    bos=None,
    eos="<|im_end|>",
)
GEMMA = ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
CHAT: dict[str, ChatTokens] = {
    "llama": ChatTokens("llama.jinja", ("<|finetune_right_pad_id|>", "<|begin_of_text|>",
                        "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                        "<|python_tag|>"), pad="<|finetune_right_pad_id|>",
                        bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "qwen2": dataclasses.replace(QWEN, template="qwen2.jinja"),
    "qwen3": QWEN,
    "mistral": ChatTokens("mistral.jinja", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]",
                          "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), pad="<unk>", bos="<s>", eos="</s>"),
    "gemma2": ChatTokens("gemma2.jinja", GEMMA, pad="<pad>", bos="<bos>", eos="<eos>"),
    "gemma3_text": ChatTokens("gemma3_text.jinja", (*GEMMA, "<start_of_image>"), pad="<pad>",
                              bos="<bos>", eos="<eos>"),
    "phi3": ChatTokens("phi3.jinja", ("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>",
                       "<|assistant|>", "<|end|>"), pad="<|endoftext|>", bos="<s>",
                       eos="<|endoftext|>"),
    "qwen3_moe": QWEN,
}  # fmt: skip


def tiny_config(model_type: str, **extra):
    """The family's tiny transformers config; `extra` sets more fields."""
    import transformers

    return transformers.AutoConfig.for_model(
        model_type, **{**COMMON, **FAMILIES[model_type], **extra}
    )


def save_tiny_hf(model_type: str, path: Path, **extra) -> Path:
    """The family's tiny random model and its chat tokenizer saved at `path` (seeded: the same
    weights every session); `extra` sets more config fields."""
    import torch
    import transformers

    config = tiny_config(model_type, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    save_chat_tokenizer(CHAT[model_type], path)
    return path


def save_chat_tokenizer(chat: ChatTokens, path: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) of `chat` in `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    text_bytes = [b for b in range(256) if b >= 32 or b in (9, 10, 13)]
    free = [b for b in range(256) if b not in text_bytes]
    symbol = bytes_to_unicode()
    vocab = {symbol[b]: b for b in text_bytes} | dict(zip(chat.specials, free, strict=False))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in chat.specials])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "pad_token": chat.pad, "bos_token": chat.bos, "eos_token": chat.eos,
        "chat_template": (TEMPLATES / chat.template).read_text(),
    }  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def rope_scaling(rope_type: str, threshold: int) -> dict:
    """Config fields of rope scaling `rope_type` (head_dim 16: 8 factors) whose factors change at
    `threshold` tokens, as transformers reads them: longrope's short factors up to
    original_max_position_embeddings, its long ones past it; dynamic NTK's base scaled past
    max_position_embeddings; yarn's factors fixed (original_max_position_embeddings only
    places its ramp). With weights of 5 x the default spread (initializer_range 0.1), so that
    the factors move a loss by 1e-4 and more, well past the tests' 1e-5 (at 0.02, 1e-5)."""
    return {"initializer_range": 0.1, **_rope_fields(rope_type, threshold)}


def _rope_fields(rope_type: str, threshold: int) -> dict:
    if rope_type == "longrope":
        params = {"short_factor": [1.0 + 0.1 * i for i in range(8)],
                  "long_factor": [1.0 + 0.8 * i for i in range(8)], "factor": 4.0,
                  "original_max_position_embeddings": threshold}  # fmt: skip
        # Phi-3 reads the original length from its own key before rope_parameters'.
        return {"max_position_embeddings": 4 * threshold,
                "original_max_position_embeddings": threshold,
                "rope_parameters": {"rope_type": "longrope", **params}}  # fmt: skip
    if rope_type == "dynamic":
        return {"max_position_embeddings": threshold,
                "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}  # fmt: skip
    assert rope_type == "yarn", rope_type
    return {"max_position_embeddings": 2 * threshold,
            "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                "original_max_position_embeddings": threshold}}  # fmt: skip
