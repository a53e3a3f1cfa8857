"""float8 training of the Linear layers through torchao (`precision.float8`, `pip install
fsdprun[float8]`).

torchao's `convert_to_float8_training` swaps chosen `nn.Linear`s for `Float8Linear`, whose
forward and backward matmuls run in float8 (`torch._scaled_mm`) with dynamic scales: one per
tensor (`tensorwise`) or one per row (`rowwise`). The weight itself stays a high-precision
parameter (fp32 master shard, param_dtype when gathered), so optimizer state and checkpoints are
exactly those of a bf16 run: a float8 run's checkpoint loads into a bf16 run and exports to HF
unchanged. With `tensorwise`, FSDP2 all-gathers the weights in float8 (1 byte per parameter
instead of 2) and the scales of all weights are computed in one go after each optimizer step
(`precompute_float8_dynamic_scale_for_fsdp`).

Which Linears are converted (`float8_eligible`, printed in the run header and by `plan`): not
the output projection (its output feeds the loss, whose precision matters most, and it is the
layer torchao's recipes leave out), and not a Linear whose in or out features are not multiples
of 16 (`_scaled_mm` needs them so).

float8 matmuls need CUDA compute capability >= 8.9 (Ada, Hopper and later): anywhere else the
run is refused before launch (`float8_refusal`), with one line. The conversion is applied
before sharding, as torchao requires.

Never imports the training loop nor the launcher (`train`, `launch`); torchao only where Linears
are converted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import nn

from fsdprun.errors import UserError

FLOAT8_MIN_CAPABILITY = (8, 9)
DIM_MULTIPLE = 16
FILTER_TEXT = (
    "nn.Linear layers except the output projection and those whose in/out features are not "
    f"multiples of {DIM_MULTIPLE}"
)
# The MFU row of a float8 run: what its FLOPs and its peak mean.
MFU_CONVENTION = (
    "float8: MFU counts the same (bf16-equivalent) FLOPs over the bf16 dense peak, so it is "
    "comparable with a bf16 run and may exceed what bf16 could reach"
)


def float8_refusal(mode: str, device_kind: str, capability: tuple[int, int] | None) -> str | None:
    """Why `precision.float8=mode` cannot run on this device, or None when it can.

    Args:
        mode: off, tensorwise or rowwise.
        device_kind: cuda, cpu, npu, xpu.
        capability: the CUDA compute capability of the device (None when not CUDA).
    """
    if mode == "off":
        return None
    if device_kind != "cuda" or capability is None:
        return (
            f"precision.float8={mode} needs a CUDA GPU with compute capability >= 8.9 (Ada, "
            f"Hopper or later); this run's device is {device_kind}. Set precision.float8=off"
        )
    if tuple(capability) < FLOAT8_MIN_CAPABILITY:
        major, minor = capability
        return (
            f"precision.float8={mode} needs CUDA compute capability >= 8.9 (float8 matmuls); "
            f"this GPU has {major}.{minor}. Set precision.float8=off"
        )
    return None


def check_float8(mode: str, device_kind: str) -> None:
    """Refuse float8 on a device without float8 matmuls, and without torchao installed.

    Raises:
        UserError: one line saying why and what to set.
    """
    if mode == "off":
        return
    capability = None
    if device_kind == "cuda":
        import torch

        capability = torch.cuda.get_device_capability()
    reason = float8_refusal(mode, device_kind, capability)
    if reason:
        raise UserError(reason)
    import_torchao()


def import_torchao():
    """torchao's float8 package, or a one-line error saying how to install it."""
    try:
        from torchao import float8
    except ImportError as e:
        raise UserError(
            f"precision.float8 needs torchao: pip install 'fsdprun[float8]' ({e})"
        ) from e
    return float8


def float8_eligible(
    fqn: str, in_features: int, out_features: int, output_fqns: Iterable[str]
) -> bool:
    """Whether the Linear at `fqn` is converted to float8 (see the module docstring)."""
    if fqn in set(output_fqns):
        return False
    return in_features % DIM_MULTIPLE == 0 and out_features % DIM_MULTIPLE == 0


def output_fqns(model: nn.Module) -> set[str]:
    """Module paths of the output projection (the Linear returning the logits)."""
    hf = getattr(model, "hf", None)
    out = hf.get_output_embeddings() if hf is not None else getattr(model, "output", None)
    return {path for path, module in model.named_modules() if module is out}


def float8_linears(model: nn.Module) -> tuple[list[str], list[str]]:
    """(converted, skipped) Linear paths of `model` under the filter (works on meta models)."""
    outputs = output_fqns(model)
    converted, skipped = [], []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            ok = float8_eligible(path, module.in_features, module.out_features, outputs)
            (converted if ok else skipped).append(path)
    return converted, skipped


def apply_float8(model: nn.Module, *, mode: str) -> int:
    """Convert the eligible Linears of a (meta) model in place, before FSDP; returns how many.

    tensorwise turns on FSDP2's float8 all-gather; call `precompute_scales` after each
    optimizer step then.
    """
    if mode == "off":
        return 0
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(mode)
    if mode == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    outputs = output_fqns(model)

    def module_filter(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and float8_eligible(
            fqn, module.in_features, module.out_features, outputs
        )

    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def precompute_scales(model: nn.Module, *, mode: str) -> None:
    """After an optimizer step, with tensorwise float8 all-gather: compute every converted
    weight's scale in one fused pass (instead of one all-reduce per weight in the next forward)."""
    if mode == "tensorwise":
        import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def describe(mode: str, model: nn.Module | None = None) -> str:
    """The header/plan line: mode, filter, and (given a model) how many Linears it converts."""
    if mode == "off":
        return "off"
    text = f"{mode} ({FILTER_TEXT}"
    if model is not None:
        converted, skipped = float8_linears(model)
        text += f": {len(converted)} converted, {len(skipped)} kept"
        if skipped:
            text += f" ({', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''})"
    if mode == "tensorwise":
        text += "; float8 all-gather of the converted weights"
    return text + ")"
