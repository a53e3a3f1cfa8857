"""Model architectures. `build_model` is the one place that picks the architecture of a recipe's
`model:` section: the built-in Llama, or a HuggingFace model from `model.hf_path`. Every model
it returns maps tokens to logits and offers `args`, `block_paths()` (the decoder blocks FSDP
wraps), `init_std(name)` and `init_buffers(device)`. `models` never imports torch.distributed."""

from torch import nn

from fsdprun.config import ModelConfig
from fsdprun.models.llama import ModelArgs, Transformer, TransformerBlock

__all__ = ["ModelArgs", "Transformer", "TransformerBlock", "build_model", "build_model_args"]


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


def build_model(cfg: ModelConfig) -> nn.Module:
    """The recipe's model on the current default device (call it under `torch.device("meta")`).

    Raises:
        UserError: model.hf_path without transformers installed, or an unusable folder.
    """
    if cfg.hf_path is not None:
        # Imported here: transformers is an optional extra and slow to import.
        from fsdprun.models.hf import HFCausalLM

        return HFCausalLM.from_folder(cfg.hf_path)
    return Transformer(build_model_args(cfg))
