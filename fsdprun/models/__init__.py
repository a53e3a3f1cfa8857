"""Model architectures. `build_model_args` turns the recipe's `model:` section into the
architecture's arguments; `models` never imports torch.distributed."""

from fsdprun.config import ModelConfig
from fsdprun.models.llama import ModelArgs, Transformer, TransformerBlock

__all__ = ["ModelArgs", "Transformer", "TransformerBlock", "build_model_args"]


def build_model_args(cfg: ModelConfig) -> ModelArgs:
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
    )
