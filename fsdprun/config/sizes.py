"""Sizes as people write them on the command line ('80GB', '2GiB', '500MB'): one parser for
`plan --device-memory` and `export --max-shard-size`; and the parameter count of a recipe's
model without building it (`fsdprun recipes`): the Llama family's from its shape (the formula
`fsdprun.models.llama` counts with), a HuggingFace folder's from its safetensors headers.
Never imports torch, nor any fsdprun module other than the error types.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from fsdprun.errors import UserError

# Decimal units as HuggingFace and device vendors use them; KiB/MiB/GiB/TiB are binary.
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(
    text: str,
    *,
    option: str = "size",
    expected: str = "a positive size such as 5GB, 500MB or 2GiB",
    bare_unit: str = "B",
) -> int:
    """'5GB' -> 5_000_000_000; a bare number is in `bare_unit`.

    Args:
        option: the command-line option, named in the error.
        expected: what the error says a valid value looks like.

    Raises:
        UserError: not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and (match.group(2).upper() or bare_unit)
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise UserError(f"{option} {text!r}: expected {expected}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def llama_num_params(
    *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
    tie_embeddings: bool, moe_experts: int = 0, moe_ffn_dim: int | None = None,
    moe_shared_ffn_dim: int = 0,
) -> int:  # fmt: skip
    """All trainable parameters of a Llama shape (the tied output projection counted once); with
    `moe_experts`, each block's feed-forward is that many SwiGLU experts of `moe_ffn_dim`
    (default `ffn_dim`), a router and a shared expert of `moe_shared_ffn_dim` (0: none)."""
    kv = n_kv_heads * (dim // n_heads)
    ffn = 3 * dim * ffn_dim
    if moe_experts:
        ffn = (
            moe_experts * (3 * dim * (moe_ffn_dim or ffn_dim) + dim) + 3 * dim * moe_shared_ffn_dim
        )
    block = 2 * dim * dim + 2 * dim * kv + ffn + 2 * dim
    head = 0 if tie_embeddings else vocab_size * dim
    return vocab_size * dim + n_layers * block + dim + head


def safetensors_num_params(folder: Path) -> int | None:
    """Elements of every tensor in a HuggingFace folder's *.safetensors files, read from their
    JSON headers alone (a tied weight is stored once); None without a readable one."""
    total, found = 0, False
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for n in entry["shape"]:
                    count *= n
                total += count
        found = True
    return total if found else None


# HuggingFace families whose parameters `config_num_params` counts from config.json alone, and
# what each adds to the Llama shape: biases on q, k and v; a norm of the head dim on q and k;
# four norms a layer (before and after attention and the feed-forward) instead of two.
_COUNTED = {"llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"}
_QKV_BIAS = {"qwen2"}
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text"}
_FOUR_NORMS = {"gemma2", "gemma3_text"}


def config_num_params(facts) -> int | None:
    """A HuggingFace folder's parameters from its config.json facts (`config.model_facts`'s
    `ModelFacts`), for a folder with no weights to read (a recipe that initializes at random):
    the `_COUNTED` families as transformers builds them (the tied output counted once, a
    mixture of experts' routers and its dense layers); None for another family, biases beyond
    Qwen2's, or a size config.json does not give."""
    f = facts
    sizes = (f.n_layers, f.dim, f.n_heads, f.head_dim, f.vocab_size) if f is not None else (None,)
    if f is None or f.model_type not in _COUNTED or f.attention_bias or None in sizes:
        return None
    q, kv = f.n_heads * f.head_dim, (f.n_kv_heads or f.n_heads) * f.head_dim
    layer = 2 * f.dim * q + 2 * f.dim * kv + (4 if f.model_type in _FOUR_NORMS else 2) * f.dim
    layer += (q + 2 * kv) * (f.model_type in _QKV_BIAS)
    layer += 2 * f.head_dim * (f.model_type in _QK_NORM)
    sparse = f.moe_layers or 0
    if sparse and f.expert_ffn_dim is None or sparse < f.n_layers and f.ffn_dim is None:
        return None
    moe = sparse * f.num_experts * (3 * f.dim * f.expert_ffn_dim + f.dim) if sparse else 0
    dense = (f.n_layers - sparse) * 3 * f.dim * (f.ffn_dim or 0)
    embeddings = f.vocab_size * f.dim * (1 if f.tie_embeddings else 2)
    return embeddings + f.n_layers * layer + dense + moe + f.dim


def model_num_params(model) -> int | None:
    """A recipe's model parameters (`model`: its ModelConfig) without building it: the Llama
    family's from its shape, a HuggingFace folder's from its safetensors headers (None when the
    folder cannot be read)."""
    if model.hf_path is None:
        return llama_num_params(
            dim=model.dim, n_layers=model.n_layers, n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads if model.n_kv_heads is not None else model.n_heads,
            ffn_dim=model.ffn_dim, vocab_size=model.vocab_size,
            tie_embeddings=model.tie_embeddings, moe_experts=model.moe_experts,
            moe_ffn_dim=model.moe_ffn_dim, moe_shared_ffn_dim=model.moe_shared_ffn_dim,
        )  # fmt: skip
    return safetensors_num_params(Path(model.hf_path))
