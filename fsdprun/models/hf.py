"""The `hf` family: any local HuggingFace causal LM, built by transformers from the folder's
config.json, behind the interface the rest of fsdprun expects of a model: `forward(tokens,
head=None) -> logits`, `args`, `block_paths()`, `init_std(name)`, `init_buffers(device)`.
Parameter and FLOP counts come from the model itself, built on the meta device.

Architecture only: the pretrained weights are loaded shard-wise by `fsdprun.engines.hf_weights`
after FSDP has sharded the model. Never imports torch.distributed. Build it on the meta device:

    with torch.device("meta"):
        model = HFCausalLM.from_folder("path/to/hf-model")
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fsdprun.config.model_facts import config_json, model_facts
from fsdprun.errors import UserError
from fsdprun.families import HF_FAMILY, Family, TPPlan, family_entry
from fsdprun.models import ModelArgs, ModelSpec
from fsdprun.models.attention import document_causal_mask
from fsdprun.models.rope import DocumentRope

if TYPE_CHECKING:
    from fsdprun.config import ModelConfig

# Parameter names in this module are the HuggingFace names under this attribute.
HF_PREFIX = "hf."


def import_transformers():
    """The transformers package, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise UserError(
            "model.hf_path needs transformers: pip install 'fsdprun[hf]' (or transformers>=4.40)"
        ) from e
    return transformers


def args_from_hf_config(config) -> ModelArgs:
    """The Llama-shaped summary of a HuggingFace config that parameter counts, FLOPs and the
    synthetic data (vocab_size) use."""
    dim = config.hidden_size
    n_heads = config.num_attention_heads
    return ModelArgs(
        dim=dim,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        ffn_dim=getattr(config, "intermediate_size", None) or 4 * dim,
        vocab_size=config.vocab_size,
        max_seq_len=getattr(config, "max_position_embeddings", 2048),
        norm_eps=getattr(config, "rms_norm_eps", 1e-5),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def hf_family(config) -> Family:
    """The family entry of a HuggingFace config (the defaults for an unlisted model type)."""
    return family_entry(HF_FAMILY, getattr(config, "model_type", None))


def attention_windows(config) -> dict[str, int | None]:
    """Each attention layer type of the model (config.json's `layer_types`) and its sliding
    window, None for full attention, as transformers decides them: without `layer_types`, every
    layer slides when `sliding_window` is set (Mistral, Phi-3).

    Raises:
        UserError: a layer type other than full or sliding attention (chunked attention).
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return {"full_attention": None} if window is None else {"sliding_attention": window}
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UserError(
            f"model.hf_path: attention layer types {', '.join(unknown)} (config.json's "
            "layer_types) are not supported; full_attention and sliding_attention are"
        )
    return {t: window if t == "sliding_attention" else None for t in dict.fromkeys(types)}


def packed_inputs(
    tokens: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    windows: dict[str, int | None] | None = None,
    additive: bool = False,
) -> dict[str, Any]:
    """The keyword inputs of a transformers decoder for (possibly packed) rows.

    Without positions and doc_ids, and no window that slides: `input_ids` and `position_ids`
    0..seq-1, so transformers takes its own causal path (no mask: SDPA's `is_causal`). The
    positions are passed rather than left to transformers, which would count them from the
    activations' length: under sequence parallel that is the local slice, while the rotary table
    must cover the whole row (each attention sees it gathered). For the same reason a model
    whose layers slide gets fsdprun's mask of the whole row: transformers would build its
    window's mask from the local slice (under tensor parallel, rank 0 died on a 32-wide mask
    against 64 gathered positions).
    Otherwise `position_ids` and a boolean 4-D mask (batch, 1, seq, seq) that transformers hands
    to SDPA as it is (masking_utils, transformers >= 4.53): attention causal within each example,
    padding attending to itself. The mask is passed even for positions alone: without one,
    transformers would infer a packing from where the positions restart, which the built-in
    Llama does not do. transformers takes such a mask as it is, so the sliding windows of
    `windows` (`attention_windows`) are cut into it here: one mask when the layers share one
    window, else one per layer type (the models with `layer_types` take such a dict).
    `additive`: the masks as eager attention adds them to the scores (0 or the lowest float32),
    not as booleans, which it would add as 0 and 1.

    Raises:
        UserError: transformers older than 4.53 (it wants 4-D masks in another form).
    """
    slides = any(window is not None for window in (windows or {}).values())
    if positions is None and doc_ids is None:
        whole = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        if not slides:
            return {"input_ids": tokens, "position_ids": whole}
        positions = whole.expand(tokens.shape[0], -1)
    transformers = import_transformers()
    from packaging.version import Version  # a dependency of transformers

    if Version(transformers.__version__) < Version("4.53"):
        raise UserError(
            f"packed batches (doc_ids/positions) with model.hf_path need transformers>=4.53, "
            f"found {transformers.__version__}: pip install -U transformers"
        )
    if doc_ids is None:
        # (batch, seq) of the tokens, or of a later pipeline stage's activations (batch, seq,
        # dim) that its pruned embedding hands on.
        doc_ids = torch.zeros(tokens.shape[:2], dtype=torch.long, device=tokens.device)
    # Under context parallel the tokens are this rank's chunks and doc_ids the whole row's: the
    # masks are the whole row's, which attention sees.
    mask = document_causal_mask(doc_ids)
    masks = {
        kind: _as_attention_mask(mask, window=window, additive=additive)
        for kind, window in (windows or {"full_attention": None}).items()
    }  # fmt: skip
    attention_mask = next(iter(masks.values())) if len(masks) == 1 else masks
    inputs: dict[str, Any] = {"input_ids": tokens, "attention_mask": attention_mask}
    if positions is not None:
        inputs["position_ids"] = positions
    return inputs


def _as_attention_mask(mask: torch.Tensor, *, window: int | None, additive: bool) -> torch.Tensor:
    """A boolean (batch, 1, seq, seq) mask of whole rows with a sliding `window` cut into it
    (a query sees the `window` positions up to its own), as booleans or, `additive`, as eager
    attention adds a mask to the scores (0 or the lowest float32), not as booleans, which it
    would add as 0 and 1."""
    if window is not None:
        idx = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (idx[:, None] - idx[None, :] < window)
    if additive:
        low = torch.finfo(torch.float32).min
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, low)
    return mask


# transformers' name of fsdprun's attention implementation under context parallel (registered
# when a model asks for it, `HFCausalLM.cp_attention_modules`).
CP_ATTENTION = "fsdprun_cp"


def _cp_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention implementation under context parallel: the module's `attend`
    (the family's own attention on whole rows inside the all-to-all of `fsdprun.engines.cp`,
    or the ring) on q, k, v (batch, heads, seq / cp, head_dim) with transformers' arguments
    (`scaling`, `sliding_window`, `softcap`, `dropout`); returns (batch, seq / cp, heads,
    head_dim) and no weights, as transformers' own implementations do."""
    return module.attend(query, key, value, attention_mask, **kwargs).transpose(1, 2), None


def _whole_row_attend(module, attention, eager, query, key, value, attention_mask, **kwargs):
    """The family's attention `attention` (transformers' SDPA, or the model's `eager` function)
    on whole rows, in the (batch, heads, seq, head_dim) layout the all-to-all exchanges. Plain
    rows come without a mask (the decoder builds none under context parallel: its slice is not
    the row): SDPA then takes its causal path (the fused kernels), while a sliding window, or
    eager attention, which has no causal path, gets the whole row's causal mask here."""
    window = kwargs.get("sliding_window")
    if attention_mask is None and (window is not None or eager):
        seq = query.shape[2]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()[None, None]
        attention_mask = _as_attention_mask(causal, window=window, additive=eager)
    out, _ = attention(module, query, key, value, attention_mask, **kwargs)
    return out.transpose(1, 2)


def _no_mask(*args, **kwargs) -> None:
    return None


@functools.cache
def _register_cp_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention_forward)
    # The decoder builds no mask under context parallel: it would be its slice's (transformers
    # counts the positions from the activations' length, and takes zig-zag positions for a
    # packing). Plain rows have none (the attention applies causality and windows on whole-row
    # positions); packed rows bring fsdprun's whole-row mask, which transformers takes as is.
    AttentionMaskInterface.register(CP_ATTENTION, _no_mask)


class HFCausalLM(nn.Module):
    """Wraps an `AutoModelForCausalLM` so that calling it maps tokens to logits."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.args = args_from_hf_config(hf_model.config)
        self.windows = attention_windows(hf_model.config)
        self.additive_mask = hf_family(hf_model.config).attn_implementation == "eager"
        # Context parallel: this rank holds slice `index` of `count` of each row
        # (`cp_attention_modules`).
        self.row_slice = (0, 1, False)
        # Rope types whose factors transformers chooses from the input's length (longrope,
        # dynamic) take them per document, at its length in the whole row (`models.rope`).
        self.document_rope = DocumentRope(hf_model)
        # A mixture of experts whose config.json enables the router's auxiliary loss
        # (`output_router_logits`, router_aux_loss_coef > 0): each forward keeps
        # coef x transformers' own load-balancing loss of its router logits in `router_aux_loss`,
        # which the engine's loss adds (`Engine.forward_loss`).
        config = hf_model.config
        coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
        self.router_aux_coef = coef if getattr(config, "output_router_logits", False) else 0.0
        self.router_aux_loss: torch.Tensor | None = None
        if self.router_aux_coef:
            module = importlib.import_module(type(hf_model).__module__)
            self._load_balancing_loss = getattr(module, "load_balancing_loss_func", None)
            if self._load_balancing_loss is None:
                raise UserError(
                    f"model.hf_path: config.json sets output_router_logits: true, but "
                    f"{type(hf_model).__name__} has no load_balancing_loss_func to compute the "
                    "router's auxiliary loss; set output_router_logits to false there"
                )
        # transformers names the classes that must not be split across devices: the decoder
        # layers, which are exactly the blocks FSDP should wrap.
        self.block_classes = tuple(getattr(hf_model, "_no_split_modules", None) or ())
        if not self.block_paths():
            raise UserError(
                f"model.hf_path: cannot find the decoder layers of {type(hf_model).__name__} "
                f"(_no_split_modules = {list(self.block_classes)})"
            )

    @property
    def family_name(self) -> str:
        """What messages call the model: the folder's model_type and class (`hf` builds any)."""
        return f"model.hf_path's {self.hf.config.model_type} ({type(self.hf).__name__})"

    @classmethod
    def from_folder(cls, path: str | Path, *, trust_remote_code: bool = False) -> HFCausalLM:
        """Build the architecture of the folder's config.json (weights are not read); with
        `trust_remote_code`, from the model code the folder ships (config.json's auto_map).

        transformers allocates on the current default device: call this under
        `torch.device("meta")` to allocate nothing.

        Raises:
            UserError: a config.json transformers cannot read or does not know (an unknown
                model_type), in one line. transformers is told the folder's code may not run
                unless `trust_remote_code`: it then refuses rather than asks on a terminal.
        """
        transformers = import_transformers()
        from packaging.version import Version  # a dependency of transformers

        trust = {"trust_remote_code": trust_remote_code}
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(path), local_files_only=True, **trust
            )
        except (ValueError, KeyError, OSError) as e:
            raise UserError(f"model.hf_path: {path}: {_first_sentence(e)}") from e
        # fp32 whatever the folder's config.json says (most Llama releases say bfloat16, which
        # from_config would follow): these are the sharded master weights and what AdamW's state
        # is made like; compute in lower precision comes from precision.param_dtype's policy.
        # transformers 4.56 renamed from_config's torch_dtype to dtype.
        new_name = Version(transformers.__version__) >= Version("4.56")
        fp32 = {"dtype" if new_name else "torch_dtype": torch.float32}
        try:
            hf_model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=hf_family(config).attn_implementation, **fp32,
                **trust,
            )  # fmt: skip
        except ValueError as e:
            raise UserError(f"model.hf_path: {path}: {_first_sentence(e)}") from e
        return cls(hf_model)

    def forward(
        self,
        tokens: torch.Tensor,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits; with `head`, `head(final hidden states, output weight)`; `positions` and
        `doc_ids` of packed rows as in `Transformer.forward`."""
        if head is None and self.router_aux_coef:
            # The decoder, then the output projection: the causal LM's forward would compute the
            # auxiliary loss itself with the attention mask it is given, which its
            # load_balancing_loss_func cannot take in fsdprun's 4-D form (packed, padded rows).
            hidden = self.forward_hidden(tokens, positions=positions, doc_ids=doc_ids)
            return self.hf.get_output_embeddings()(hidden)
        if head is None:
            inputs = self._inputs(tokens, positions=positions, doc_ids=doc_ids)
            with self._documents(tokens, doc_ids):
                return self.hf(**inputs, use_cache=False).logits
        hidden = self.forward_hidden(tokens, positions=positions, doc_ids=doc_ids)
        return head(hidden, self.output_weight())

    def forward_hidden(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's last hidden states, the input of the output projection."""
        inputs = self._inputs(tokens, positions=positions, doc_ids=doc_ids)
        with self._documents(tokens, doc_ids):
            out = self.hf.get_decoder()(**inputs, use_cache=False, **self._router_kwargs())
        self._keep_router_aux_loss(out, doc_ids)
        return out.last_hidden_state

    def _router_kwargs(self) -> dict[str, bool]:
        return {"output_router_logits": True} if self.router_aux_coef else {}

    def _keep_router_aux_loss(self, out, doc_ids: torch.Tensor | None) -> None:
        """coef x the load-balancing loss of the micro-batch's router logits, computed by the
        model's own module (`load_balancing_loss_func`, as its forward computes it with labels)
        over the micro-batch's tokens, padding (doc id -1) excluded as transformers excludes it
        with a 2-D attention mask; a packed row's documents count together."""
        if not self.router_aux_coef:
            return
        real = None if doc_ids is None else (doc_ids >= 0).long()
        # The causal LM's own expert counts, as its forward passes them (config.json names
        # them per family: num_experts, num_local_experts).
        aux = self._load_balancing_loss(
            out.router_logits, self.hf.num_experts, self.hf.num_experts_per_tok, real
        )
        self.router_aux_loss = self.router_aux_coef * aux

    def _documents(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None):
        """The rotary factors of each token's document in the whole row, for one forward."""
        index, count, zigzag = self.row_slice
        local = tokens.shape[1]
        return self.document_rope.documents(doc_ids, local=local, index=index, count=count,
                                            zigzag=zigzag)  # fmt: skip

    def _inputs(self, tokens, *, positions, doc_ids) -> dict:
        if self.row_slice[1] > 1 and doc_ids is None:
            # Context parallel's plain rows: this rank's chunks at their positions, and no
            # mask (one made here would be the slice's): the attention applies causality and
            # sliding windows to whole-row positions. Packed rows bring the whole row's doc_ids.
            return {"input_ids": tokens, "position_ids": positions}
        # Packed rows: each layer type's sliding window cut into the document mask.
        return packed_inputs(tokens, positions=positions, doc_ids=doc_ids, windows=self.windows,
                             additive=self.additive_mask)  # fmt: skip

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight, for a loss that applies it itself.

        Raises:
            UserError: the model does more than `hidden @ weight.T` to get its logits (a bias,
                logit scaling or soft-capping), which such a loss would silently drop.
        """
        out = self.hf.get_output_embeddings()
        extra = [
            key for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            if getattr(self.hf.config, key, None) not in (None, 1, 1.0)
        ]  # fmt: skip
        if not isinstance(out, nn.Linear) or out.bias is not None or extra:
            raise UserError(
                f"train.loss=chunked: {type(self.hf).__name__} computes its logits with more "
                f"than a bias-free Linear ({', '.join(extra) or type(out).__name__}); use "
                "train.loss=plain"
            )
        return out.weight

    def lora_groups(self) -> dict[str, tuple[str, ...]]:
        """`lora.targets` groups: the family's attention and MLP Linear names (`HF_FAMILIES`)."""
        return hf_family(self.hf.config).lora_groups()

    def cp_attention_modules(
        self, *, index: int, count: int, zigzag: bool = False
    ) -> list[nn.Module]:
        """Each decoder layer's self_attn, made ready for context parallel, where this rank
        holds part `index` of `count` of each row (`zigzag`: the ring's two chunks,
        `fsdprun.config.layout.cp_chunks`): transformers then calls fsdprun's attention
        implementation (`CP_ATTENTION`), which calls the module's `attend`: the family's own
        attention (`Family.attn_implementation`: SDPA, or the model's eager function, which
        soft-caps Gemma 2's scores) on whole rows, which the all-to-all wraps or the ring
        replaces; the rotary factors that depend on a document's length come from the whole
        row's. [] for a model type that does not declare its attention for context parallel
        (`Family.cp_attention`)."""
        family = hf_family(self.hf.config)
        if not family.cp_attention:
            return []
        _register_cp_attention()
        self.hf.config._attn_implementation = CP_ATTENTION
        self.row_slice = (index, count, zigzag)
        modules = [self.get_submodule(f"{path}.self_attn") for path in self.block_paths()]
        eager = family.attn_implementation == "eager"
        for module in modules:
            if eager:  # the model's own, module-level (Gemma 2's soft-caps the scores)
                attention = importlib.import_module(type(module).__module__).eager_attention_forward
            else:
                from transformers.integrations.sdpa_attention import sdpa_attention_forward

                attention = sdpa_attention_forward
            module.attend = functools.partial(_whole_row_attend, module, attention, eager)
        return modules

    def block_paths(self) -> list[str]:
        """Module paths of the decoder layers, in forward order."""
        return [
            path for path, m in self.named_modules()
            if path and type(m).__name__ in self.block_classes
        ]  # fmt: skip

    def init_std(self, name: str) -> float | None:
        """`model.init=random`: normal(0, initializer_range) for matrices, ones for norm
        weights (1-D weights), zeros for biases (std 0)."""
        if name.endswith(".bias"):
            return 0.0
        param = self.get_parameter(name)
        if param.ndim == 1:
            return None
        return getattr(self.hf.config, "initializer_range", 0.02)

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent buffers (rotary frequencies, Gemma's embedding scale)
        after `to_empty`.

        They hold garbage then, and a checkpoint does not store them. A buffer-only module built
        from the config (as rotary embeddings are) is rebuilt on `device` and its buffers copied.
        Any other module's buffers are filled by transformers' own `_init_weights`, which is
        what `from_pretrained` runs after loading on the meta device; it is run on a stand-in
        of the module whose parameters are meta tensors, so that the loaded weights cannot be
        touched. Buffers it leaves unfilled are refused rather than trained with garbage.

        Raises:
            UserError: a buffer neither rule fills.
        """
        for path, module in self.named_modules():
            own = dict(module.named_buffers(recurse=False))
            if not own:
                continue
            if next(module.parameters(recurse=False), None) is None and hasattr(module, "config"):
                with torch.device(device):
                    fresh = type(module)(module.config)
                for name, buf in own.items():
                    buf.copy_(getattr(fresh, name))
                continue
            unfilled = self._init_buffers_as_transformers(module, own)
            if unfilled:
                raise UserError(
                    f"model.hf_path: cannot initialize the buffers of {path} "
                    f"({type(module).__name__}): {', '.join(unfilled)}"
                )

    def _init_buffers_as_transformers(
        self, module: nn.Module, own: dict[str, torch.Tensor]
    ) -> list[str]:
        """Fill `module`'s own buffers with the model's `_init_weights`; the names it left
        unfilled (a NaN sentinel still there; any non-float buffer, which has none)."""
        init_weights = getattr(self.hf, "_init_weights", None)
        if init_weights is None or any(not buf.is_floating_point() for buf in own.values()):
            return list(own)
        for buf in own.values():
            buf.fill_(float("nan"))
        stand_in = copy.copy(module)  # same class (what _init_weights dispatches on), same buffers
        stand_in._parameters = {
            name: None if p is None else nn.Parameter(torch.empty(p.shape, device="meta"))
            for name, p in module._parameters.items()
        }  # fmt: skip
        init_weights(stand_in)
        return [name for name, buf in own.items() if buf.isnan().any()]


def _first_sentence(error: Exception) -> str:
    """The first line of a library's error message (transformers' run to several paragraphs),
    for a one-line refusal."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.strip()


# Weight files of a HuggingFace folder: an export replaces them by the trained weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".h5", ".msgpack")


class _Counts(NamedTuple):
    """What a folder's model counts (`_meta_counts`)."""

    args: ModelArgs
    num_params: int  # a tied tensor once
    matmul: int  # the weights each token multiplies
    attention_width: int  # the query heads x head_dim that q·k and attention·v span


@functools.cache
def _meta_counts(path: str, trust_remote_code: bool = False) -> _Counts:
    """The folder's model summary, its parameters (a tied tensor once), the weights each
    token multiplies: every matrix but the embedding tables (a tied output projection
    included: it is its Linear's too; a mixture of experts' router), and of stacked experts
    the share each token passes through; and its attention's width, query heads x head_dim (not
    the hidden size: Qwen3 and Gemma releases differ; GQA's kv heads serve several query heads,
    each of which attends). Counted on a model built on the meta device (allocates nothing;
    cached: the worker asks more than once)."""
    with torch.device("meta"):
        model = HFCausalLM.from_folder(path, trust_remote_code=trust_remote_code)
    num_params = sum(p.numel() for p in model.parameters())
    config = model.hf.config
    stacked = {rule.param.rpartition(".")[2]: rule for rule in hf_family(config).stacked}
    matmul = 0
    for path_, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        for name, param in module.named_parameters(recurse=False):
            rule = stacked.get(name)
            if rule is not None and f"{path_}.{name}".endswith("." + rule.param):
                # [experts, rows, columns]: each token through `active_key` of the experts.
                matmul += param.numel() // param.shape[0] * getattr(config, rule.active_key)
            elif param.ndim >= 2:
                matmul += param.numel()
    args = model.args
    head_dim = getattr(config, "head_dim", None) or args.dim // args.n_heads
    return _Counts(args, num_params, matmul, args.n_heads * head_dim)


def _shape(cfg: ModelConfig) -> ModelConfig:
    args = _meta_counts(cfg.hf_path, cfg.trust_remote_code).args
    return dataclasses.replace(
        cfg, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads, ffn_dim=args.ffn_dim, vocab_size=args.vocab_size,
        max_seq_len=args.max_seq_len, norm_eps=args.norm_eps, tie_embeddings=args.tie_embeddings,
    )  # fmt: skip


def _flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """6·N_matmul + 12·n_layers·(n_heads·head_dim)·seq_len: `fsdprun.models.llama.
    flops_per_token`'s count, with the attention's own width (`_meta_counts`)."""
    counts = _meta_counts(cfg.hf_path, cfg.trust_remote_code)
    return 6 * counts.matmul + 12 * counts.args.n_layers * counts.attention_width * seq_len


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The folder's config.json as it is (the export's dtype does not change it)."""
    config = config_json(cfg.hf_path)
    if config is None:
        raise UserError(
            f"the run's model.hf_path {cfg.hf_path} has no config.json any more; the HF export "
            "copies its config and tokenizer files from there"
        )
    return config


def _hf_files(cfg: ModelConfig) -> list[Path]:
    """Every file of the folder but its weights: config, tokenizer, generation config."""
    return [
        file for file in sorted(Path(cfg.hf_path).iterdir())
        if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES)
    ]  # fmt: skip


def _tp_plan(cfg: ModelConfig) -> TPPlan | str:
    """The tensor-parallel plan of the folder's family (`HF_FAMILIES`), or why it has none."""
    facts = model_facts(cfg)
    return family_entry(HF_FAMILY, facts.model_type if facts else None).tp_plan


SPEC = ModelSpec(
    name="hf",
    build=lambda cfg: HFCausalLM.from_folder(cfg.hf_path, trust_remote_code=cfg.trust_remote_code),
    shape=_shape,
    num_params=lambda cfg: _meta_counts(cfg.hf_path, cfg.trust_remote_code).num_params,
    flops_per_token=_flops_per_token,
    describe=lambda cfg: f"hf: {cfg.hf_path}",
    # Unknown without the checkpoint's own record (the folder may be gone): none, as before.
    tied_params=lambda cfg: {},
    # The wrapped model's own names, e.g. model.layers.0.self_attn.q_proj.weight.
    hf_name=lambda name: name.removeprefix(HF_PREFIX),
    hf_config=_hf_config,
    hf_files=_hf_files,
    tp_plan=_tp_plan,
)
