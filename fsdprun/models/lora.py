"""LoRA adapters: a trainable low-rank update `scale * B @ A` beside chosen Linear layers of the
decoder blocks, with every other parameter frozen (`lora:` in a recipe).

The adapters are written here rather than taken from peft, because:
- they must be built on the meta device and sharded by `fully_shard` before any memory exists,
  then materialized and initialized like every other parameter (`init_std`, seeded by name, the
  same at any world size); peft injects its layers into a model it expects to be materialized;
- parameter names must stay exactly the base model's (`layers.0.attention.wq.weight` keeps its
  name, so base checkpoints, HF weight files and `export` read it unchanged; the adapters add
  `...wq.lora_A.weight` and `...wq.lora_B.weight`); peft renames the base weight to
  `base_layer.weight` and inserts an adapter name (`lora_A.default.weight`);
- the whole feature is ~100 lines with no new dependency; peft's on-disk layout is still written
  for users (`peft_state_dict`, `peft_adapter_config`), so transformers/peft load the result.

Usage (before FSDP, on the meta model):

    with torch.device("meta"):
        model = build_model(cfg.model)
    apply_lora(model, cfg=cfg.lora)   # replaces matching Linears, freezes the rest

`models` never imports torch.distributed: these helpers work on unsharded modules or on plain
state dicts of full tensors (what export reads from a checkpoint).
"""

from __future__ import annotations

import fnmatch
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from fsdprun.config import LoraConfig
from fsdprun.errors import UserError

# The built-in Llama's Linear names and HuggingFace Llama's: a target may use either spelling.
LLAMA_TO_HF = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
               "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # fmt: skip
HF_TO_LLAMA = {hf: ours for ours, hf in LLAMA_TO_HF.items()}
# The built-in Llama's module paths inside a block → HuggingFace Llama's (peft keys).
_HF_BLOCK_PATHS = {"attention": "self_attn", "feed_forward": "mlp"}
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
PEFT_PREFIX = "base_model.model."


def is_adapter_name(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter matrix (trainable) rather than a base weight."""
    return name.endswith(ADAPTER_SUFFIXES)


class LoraLinear(nn.Module):
    """`base(x) + scale * lora_B(lora_A(dropout(x)))`, with the base Linear's own parameters.

    `weight` (and `bias`) are the very Parameters of the Linear it replaces, so their names,
    values and ties do not change. It is deliberately not an `nn.Linear`: transforms that look
    for Linears (float8, a second `apply_lora`) must not take it for a plain one.
    """

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.weight = base.weight
        self.bias = base.bias  # a Parameter or None (register_parameter semantics)
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **like)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **like)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.dropout(x))) * (
            self.scale
        )

    def delta(self) -> torch.Tensor:
        """`scale * B @ A` in fp32: what merging adds to the base weight."""
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, alpha={self.alpha}"


def _pattern_matches(pattern: str, path: str) -> bool:
    """A target matches a Linear by its own name (either spelling) or, with a dot or a
    wildcard, by its path inside the model (fnmatch)."""
    leaf = path.rsplit(".", 1)[-1]
    names = {leaf, LLAMA_TO_HF.get(leaf, leaf), HF_TO_LLAMA.get(leaf, leaf)}
    if pattern in names:
        return True
    if "." in pattern or any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, f"*.{pattern}")
    return False


def block_linears(model: nn.Module) -> list[str]:
    """Paths of the Linear layers inside the decoder blocks (`model.block_paths()`): the layers
    LoRA may adapt. The output projection is not among them (the chunked loss reads its weight
    directly, which would skip an adapter)."""
    out = []
    for block in model.block_paths():
        for sub, module in model.get_submodule(block).named_modules():
            if isinstance(module, nn.Linear) and sub:
                out.append(f"{block}.{sub}")
    return out


def expand_groups(model: nn.Module, targets: list[str]) -> list[str]:
    """`targets` with the group names `attention` and `mlp` replaced by the Linear names the
    model's family gives them (`model.lora_groups()`; `HF_FAMILIES` for HuggingFace models).

    Raises:
        UserError: a group the family has no Linear layers for.
    """
    groups = model.lora_groups()
    out = []
    for target in targets:
        if target not in groups:
            out.append(target)
        elif not groups[target]:
            raise UserError(
                f"lora.targets: {target}: the blocks of {_model_name(model)} have no Linear "
                f"layers in their {target} (a mixture of experts stores its experts as 3-D "
                "parameters, which LoRA does not adapt); drop it, e.g. lora.targets=[attention]"
            )
        else:
            out.extend(groups[target])
    return out


def _model_name(model: nn.Module) -> str:
    return getattr(model, "family_name", type(model).__name__)


def lora_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """The block Linear paths `targets` select (names, path patterns or groups).

    Raises:
        UserError: a target matches no Linear; names the targets and the available names.
    """
    targets = expand_groups(model, targets)
    linears = block_linears(model)
    unmatched = [t for t in targets if not any(_pattern_matches(t, p) for p in linears)]
    if unmatched:
        available = sorted({p.rsplit(".", 1)[-1] for p in linears})
        example = re.sub(r"\.\d+\.", ".*.", linears[0], count=1) if linears else "none"
        raise UserError(
            f"lora.targets: {', '.join(unmatched)} match no Linear layer of this model's blocks; "
            f"its Linear layers are {', '.join(available) or 'none'} (or give a path pattern "
            f"such as {example}, or the groups attention and mlp)"
        )
    return [p for p in linears if any(_pattern_matches(t, p) for t in targets)]


def apply_lora(model: nn.Module, *, cfg: LoraConfig) -> list[str]:
    """Replace the target Linears by `LoraLinear`, freeze every other parameter, and make
    `model.init_std` cover the adapters (A: normal with the variance of peft's default
    kaiming_uniform(a=sqrt(5)), std 1/sqrt(3 in_features); B: zeros, so the model starts as the
    base). Works on the meta device (the adapters are created where the weight lives).

    Returns:
        The adapted module paths; [] when cfg.rank is 0 (LoRA off, nothing changed).

    Raises:
        UserError: a target matches no Linear of the model's blocks.
    """
    if cfg.rank == 0:
        return []
    paths = lora_targets(model, list(cfg.targets))
    for path in paths:
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        base = getattr(parent, leaf)
        setattr(parent, leaf, LoraLinear(base, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))

    base_init_std = model.init_std

    def init_std(name: str) -> float | None:
        if name.endswith(".lora_B.weight"):
            return 0.0
        if name.endswith(".lora_A.weight"):
            module = model.get_submodule(name.removesuffix(".lora_A.weight"))
            return 1.0 / math.sqrt(3 * module.in_features)
        return base_init_std(name)

    # An instance attribute shadows the class's method: `parallel.init_value` (every engine's
    # initialization) then initializes adapters as above and the rest as before.
    model.init_std = init_std
    return paths


def num_trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter matrices under the model's own names (`...wq.lora_A.weight`), detached."""
    return {n: p.detach() for n, p in model.named_parameters() if is_adapter_name(n)}


def _adapter_scales(model: nn.Module) -> dict[str, float]:
    return {path: m.scale for path, m in model.named_modules() if isinstance(m, LoraLinear)}


@torch.no_grad()
def merge_adapter_weights(
    state: dict[str, torch.Tensor], *, scale: float | dict[str, float]
) -> dict[str, torch.Tensor]:
    """A state dict of full tensors with every adapter pair folded into its base weight:
    `P.weight + scale * P.lora_B.weight @ P.lora_A.weight` under the original name `P.weight`,
    the adapter keys dropped; in the base weight's dtype (the product is taken in fp32).

    Args:
        state: names → full tensors (a model's state dict, or tensors read from a checkpoint).
        scale: lora.alpha / lora.rank, or per module path.

    Raises:
        ValueError: an adapter without its pair or its base weight.
    """
    out = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for key in state:
        if not key.endswith(".lora_A.weight"):
            continue
        path = key.removesuffix(".lora_A.weight")
        a, b = state[key], state.get(f"{path}.lora_B.weight")
        base = state.get(f"{path}.weight")
        if b is None or base is None:
            raise ValueError(f"{path}: lora_A without lora_B or without the base weight")
        s = scale[path] if isinstance(scale, dict) else scale
        merged = base.float() + s * (b.float() @ a.float())
        out[f"{path}.weight"] = merged.to(base.dtype)
    return out


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with the adapters merged into the base weights, under the
    ORIGINAL parameter names (what the model had before `apply_lora`): load it into the base
    architecture, or export it. Needs full tensors (an unsharded model)."""
    return merge_adapter_weights(model.state_dict(), scale=_adapter_scales(model))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight in place and put plain `nn.Linear`s back: the
    model is then the base architecture again, with the same names. Returns `model`."""
    for path, module in list(model.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                           device="meta")  # fmt: skip
        linear.weight = module.weight
        linear.bias = module.bias
        linear.weight.copy_((linear.weight.float() + module.delta()).to(linear.weight.dtype))
        parent_path, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_path), leaf, linear)
    return model


_LLAMA_ADAPTER = re.compile(
    r"layers\.(\d+)\.(attention|feed_forward)\.(w[qkvo123])\.(lora_[AB]\.weight)"
)


def hf_llama_adapter_name(name: str) -> str:
    """A built-in Llama adapter name → HuggingFace Llama's module path + suffix, e.g.
    `layers.0.attention.wq.lora_A.weight` → `model.layers.0.self_attn.q_proj.lora_A.weight`.

    Raises:
        UserError: not an adapter of a Llama block Linear.
    """
    match = _LLAMA_ADAPTER.fullmatch(name)
    if not match:
        raise UserError(f"{name}: not a LoRA adapter of a Llama block; cannot name it for peft")
    layer, block, leaf, suffix = match.groups()
    return f"model.layers.{layer}.{_HF_BLOCK_PATHS[block]}.{LLAMA_TO_HF[leaf]}.{suffix}"


def peft_key(name: str) -> str:
    """An adapter's name in fsdprun → its key in peft's `adapter_model.safetensors`.

    HF models (`hf.` prefix): the HF module path; the built-in Llama: its HF Llama name. peft
    saves `base_model.model.<module path>.lora_A.weight` (the adapter name `default` removed).
    """
    hf = name.removeprefix("hf.") if name.startswith("hf.") else hf_llama_adapter_name(name)
    return PEFT_PREFIX + hf


def peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors (`adapter_state_dict`, or read from a checkpoint) under peft's keys."""
    return {peft_key(n): t for n, t in adapters.items() if is_adapter_name(n)}


def peft_adapter_config(
    adapters: dict[str, torch.Tensor], *, cfg: LoraConfig, base_model_name_or_path: str
) -> dict:
    """The content of peft's `adapter_config.json` for these adapters: LoRA on exactly the modules
    that carry one, bias none, for a causal LM.

    peft adapts every module whose path is a `target_modules` entry or ends with "." and one.
    Targets that are layer names (`q_proj`, `wq`) or groups (`attention`) adapted those layers in
    every block, so the HF names are the targets (as peft's own configs write them). A path pattern
    (`model.layers.1.self_attn.q_proj`, `layers.*.mlp.*`) adapted some blocks only: the leaf
    names would add adapters to every other block (with missing weights), so each adapted
    module's full HF path is listed instead.
    """
    paths = sorted({peft_key(n).removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for n in adapters
                    if is_adapter_name(n)})  # fmt: skip
    by_name = all("." not in t and not any(c in t for c in "*?[") for t in cfg.targets)
    modules = sorted({p.rsplit(".", 1)[-1] for p in paths}) if by_name else paths
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
