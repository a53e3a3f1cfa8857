"""float8 training of the Linear layers through torchao (`precision.float8`, `pip install
fsdprun[float8]`).

torchao's `convert_to_float8_training` swaps chosen `nn.Linear`s for `Float8Linear`, whose
forward and backward matmuls run in float8 (`torch._scaled_mm`) with dynamic scales: one per
tensor (`tensorwise`) or one per row (`rowwise`). The weight itself stays a high-precision
parameter (fp32 master shard, param_dtype when gathered), so optimizer state and checkpoints are
exactly those of a bf16 run: a float8 run's checkpoint loads into a bf16 run and exports to HF
unchanged.

float8 all-gather (`precision.float8_all_gather`, tensorwise only): FSDP2 casts each weight
shard to float8 before the all-gather (1 byte per parameter on the wire instead of 2), and the
scales of all weights are computed in one go after each optimizer step
(`precompute_float8_dynamic_scale_for_fsdp`, one all-reduce instead of one per weight). That
pays only where weights are gathered across ranks. With a shard group of one rank nothing is
gathered: the cast, the scale precompute and FSDP's float8 copy-in are pure overhead, run
outside the compiled blocks every step (measured on one H200: fsdprun's float8 step at
0.77-0.86x a plain float8 loop with torchao's defaults). So `null` (auto, the default) turns it
on only with tensorwise and a shard group (`dp_shard`, times cp) of more than one rank;
`true`/`false` force it.

Under tensor and context parallel (`fsdprun.engines.tp`, `apply_float8_cp`) every cast takes
the scale of the whole tensor, as one rank's: torchao's float8 TP styles, DTensor's reductions
over the TP group, fsdprun's over the cp group.

Which Linears are converted (`float8_eligible`, printed in the run header and by `plan`): not
the output projection (its output feeds the loss, whose precision matters most, and it is the
layer torchao's recipes leave out), and not a Linear whose in or out features are not multiples
of 16 (`_scaled_mm` needs them so). `precision.float8_filter: skip_small` also keeps in high
precision the Linears too small to gain from float8, by the size thresholds torchao measured on
an H100 for each recipe (the rule torchtitan calls auto_filter_small_kn): the cast and scale
work of a small matmul costs more than its faster multiply saves.

float8 matmuls need CUDA compute capability >= 8.9 (Ada, Hopper and later): anywhere else the
run is refused before launch (`float8_refusal`), with one line. The conversion is applied
before sharding, as torchao requires.

Never imports the training loop nor the launcher (`train`, `launch`); torchao only where Linears
are converted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable

from torch import nn

from fsdprun.errors import UserError

FLOAT8_MIN_CAPABILITY = (8, 9)
# Test-only: lets the suite run float8 on CPU ranks (torch's CPU build has float8 matmuls, slow,
# so the float8 path's structure and losses can be checked on gloo). Never for users: a CPU has
# nothing to gain from float8.
TEST_ON_CPU_ENV = "FSDPRUN_TEST_FLOAT8_ON_CPU"
DIM_MULTIPLE = 16
FILTER_TEXT = (
    "nn.Linear layers except the output projection and those whose in/out features are not "
    f"multiples of {DIM_MULTIPLE}"
)
SKIP_SMALL_TEXT = {
    "tensorwise": "and those with in_features <= 4096 and out_features <= 1024",
    "rowwise": (
        "and those with out_features <= 2048, in_features <= 1024, or both out_features <= 4096 "
        "and in_features <= 2048"
    ),
}
# The MFU row of a float8 run: what its FLOPs and its peak mean.
MFU_CONVENTION = (
    "float8: MFU counts the same (bf16-equivalent) FLOPs over the bf16 dense peak, so it is "
    "comparable with a bf16 run and may exceed what bf16 could reach"
)


@dataclasses.dataclass(frozen=True)
class Float8Plan:
    """What `precision.*` float8 keys resolve to for one world size (`float8_plan`)."""

    mode: str  # off, tensorwise, rowwise
    all_gather: bool
    all_gather_why: str
    skip_small: bool

    def describe(self, model: nn.Module | None = None) -> str:
        return describe(self.mode, model, skip_small=self.skip_small,
                        all_gather=self.all_gather_why if self.mode != "off" else None)  # fmt: skip


def float8_plan(cfg, world_size: int | None = None) -> Float8Plan:
    """The float8 settings of recipe `cfg` at `world_size` (default: the recipe's)."""
    from fsdprun.config.layout import Layout
    from fsdprun.config.schema import Float8Filter

    mode = cfg.precision.float8.value
    # FSDP2 gathers each weight over its shard group and, under context parallel, the cp ranks
    # too (it shards over dp_shard x cp).
    group = Layout.of(cfg, world_size).fsdp_shards
    on, why = all_gather_choice(mode, cfg.precision.float8_all_gather, group)
    return Float8Plan(mode, on, why, cfg.precision.float8_filter is Float8Filter.skip_small)


def float8_refusal(mode: str, device_kind: str, capability: tuple[int, int] | None) -> str | None:
    """Why `precision.float8=mode` cannot run on this device, or None when it can.

    Args:
        mode: off, tensorwise or rowwise.
        device_kind: cuda, cpu, npu, xpu.
        capability: the CUDA compute capability of the device (None when not CUDA).
    """
    if mode == "off":
        return None
    if device_kind == "cpu" and os.environ.get(TEST_ON_CPU_ENV) == "1":
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


def too_small(mode: str, in_features: int, out_features: int) -> bool:
    """Whether a Linear is too small to gain from float8 under `mode` (`float8_filter:
    skip_small`): torchao's thresholds, measured on an H100, where float8's casts and scales cost
    more than its faster matmul saves. K is in_features, N out_features."""
    k, n = in_features, out_features
    if mode == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def float8_eligible(
    fqn: str, in_features: int, out_features: int, output_fqns: Iterable[str], *,
    mode: str = "tensorwise", skip_small: bool = False,
) -> bool:  # fmt: skip
    """Whether the Linear at `fqn` is converted to float8 (see the module docstring)."""
    if fqn in set(output_fqns):
        return False
    if in_features % DIM_MULTIPLE or out_features % DIM_MULTIPLE:
        return False
    return not (skip_small and too_small(mode, in_features, out_features))


def all_gather_choice(mode: str, setting: bool | None, shard_group: int) -> tuple[bool, str]:
    """Whether FSDP2 all-gathers the converted weights in float8 (`precision.float8_all_gather`),
    and why, for the header and `plan`.

    Args:
        mode: precision.float8 (off, tensorwise, rowwise).
        setting: precision.float8_all_gather (None: auto).
        shard_group: ranks the weights are sharded over (`dp_shard`, times cp; 1: nothing is
            gathered).
    """
    if mode != "tensorwise":
        return False, "off (tensorwise only)" if mode != "off" else "off"
    if setting is not None:
        return setting, f"{'on' if setting else 'off'} (precision.float8_all_gather={setting})"
    if shard_group > 1:
        return True, f"on (auto: weights are gathered over {shard_group} ranks)"
    return False, "off (auto: a shard group of 1 rank gathers nothing)"


def output_fqns(model: nn.Module) -> set[str]:
    """Module paths of the output projection (the Linear returning the logits)."""
    hf = getattr(model, "hf", None)
    out = hf.get_output_embeddings() if hf is not None else getattr(model, "output", None)
    return {path for path, module in model.named_modules() if module is out}


def float8_linears(
    model: nn.Module, *, mode: str = "tensorwise", skip_small: bool = False
) -> tuple[list[str], list[str]]:
    """(converted, skipped) Linear paths of `model` under the filter (works on meta models)."""
    outputs = output_fqns(model)
    converted, skipped = [], []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            ok = float8_eligible(path, module.in_features, module.out_features, outputs,
                                 mode=mode, skip_small=skip_small)  # fmt: skip
            (converted if ok else skipped).append(path)
    return converted, skipped


def apply_float8(
    model: nn.Module, *, mode: str, all_gather: bool = False, skip_small: bool = False
) -> int:
    """Convert the eligible Linears of a (meta) model in place, before FSDP; returns how many.

    `all_gather` (tensorwise only, `all_gather_choice`) turns on FSDP2's float8 all-gather; call
    `precompute_scales` after each optimizer step then. Otherwise torchao's own recipe config,
    unchanged.
    """
    if mode == "off":
        return 0
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(mode)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    outputs = output_fqns(model)

    def module_filter(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and float8_eligible(
            fqn, module.in_features, module.out_features, outputs, mode=mode,
            skip_small=skip_small,
        )  # fmt: skip

    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def tensorwise(module: nn.Module) -> bool:
    """Whether `module` is a Float8Linear of dynamic scales, one per tensor, for its input,
    weight and output gradient (the tensorwise recipe): what torchao's float8 TP styles and
    `apply_float8_cp` take."""
    config = getattr(module, "config", None)
    if type(module).__name__ != "Float8Linear" or config is None:
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    dynamic = all(c.scaling_type is ScalingType.DYNAMIC for c in casts)
    return dynamic and all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


def float8_tp_styles(mode: str, *, cp: bool, device_kind: str) -> bool:
    """Whether tensor parallel splits the float8 Linears with torchao's float8 TP styles
    (`engines.tp.apply_tp`): the tensorwise recipe without context parallel, on an accelerator.
    Their scales are taken over the TP group only, so under cp x tp torch's own styles split the
    Linears and `apply_float8_cp` casts; and they all-gather float8 tensors, which gloo (CPU
    ranks, the test switch) cannot send ("Invalid scalar type"): there too the Linears cast
    what torch's styles hand them, the same values in high precision on the wire."""
    return mode == "tensorwise" and not cp and device_kind != "cpu"


def _cast(x, module: nn.Module, dtype, role, meshes):
    """`x` (a tensor, or a DTensor of tensor parallel) cast to float8 for `module`'s matmul with
    the scale of the whole tensor its pieces on `meshes` make up: the largest magnitude over
    those ranks (every other step as torchao's own tensorwise cast, `tensor_to_scale`). A
    replica's equal maximum changes nothing, so `meshes` may hold dims a tensor is replicated
    on."""
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Replicate
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    with torch.no_grad():
        local = x.to_local() if isinstance(x, DTensor) else x
        amax = torch.max(torch.abs(local))
        for mesh in meshes:  # a CPU-GPU sync-free scalar all-reduce per mesh dim
            amax = funcol.all_reduce(amax, "MAX", mesh)
        scale = amax_to_scale(amax, dtype, module.config.round_scales_to_power_of_2)
        if isinstance(x, DTensor):
            replicas = [Replicate()] * x.device_mesh.ndim
            scale = DTensor.from_local(scale, x.device_mesh, replicas, run_check=False)
    return hp_tensor_and_scale_to_float8(x, scale, dtype, module.linear_mm_config, role)


@functools.cache
def _gradient_cast():
    """An autograd function: forward the identity; backward the gradient cast to float8 by
    `_cast` (torchao's NoopFwToFloat8BwDynamic, with the scale over the given meshes)."""
    import torch
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_training_tensor import GemmInputRole

    class GradientCast(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, module, meshes):
            ctx.module, ctx.meshes = module, meshes
            return y

        @staticmethod
        def backward(ctx, grad):
            if tensor_already_casted_to_fp8(grad):
                return grad, None, None
            dtype = ctx.module.config.cast_config_grad_output.target_dtype
            return _cast(grad, ctx.module, dtype, GemmInputRole.GRAD_OUTPUT, ctx.meshes), None, None

    return GradientCast


def apply_float8_cp(model: nn.Module, *, meshes: list) -> int:
    """Under context parallel: each tensorwise float8 Linear of `model` casts its input, and
    its output's gradient, with the scale of the whole tensor across `meshes` (the cp mesh, and
    the tp mesh under cp x tp), as one rank casts the whole rows; returns how many.

    torchao's Float8Linear takes the scale of what reaches it: under context parallel a rank's
    slice of the rows, so its casts (and so its losses) would differ from one rank's. A forward
    pre-hook casts the input (the matmul then takes it as it is, and keeps it, in float8, for
    the weight's gradient: one rank casts it the same way for both), a forward hook marks the
    output so that its gradient is cast likewise (after the bias's gradient reads it). Under
    cp x tp the input is cast after tensor parallel's hooks have laid it out, and the gradient
    after they have reduced it (the output hook goes first): what the matmul sees, in high
    precision on the wire (gloo cannot send float8). Costs one scalar all-reduce per cast and
    mesh dim. The weights are whole or TP DTensors there (FSDP has
    gathered them): their scales are the whole weight's already.
    """
    from torchao.float8.float8_training_tensor import GemmInputRole

    grad_cast = _gradient_cast()
    converted = [m for m in model.modules() if tensorwise(m)]

    def cast_input(module, args):
        x, *rest = args
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

        if tensor_already_casted_to_fp8(x):
            return None
        dtype = module.config.cast_config_input.target_dtype
        return (_cast(x, module, dtype, GemmInputRole.INPUT, meshes), *rest)

    def mark_output(module, args, output):
        return grad_cast.apply(output, module, meshes)

    for module in converted:
        module.register_forward_pre_hook(cast_input)
        module.register_forward_hook(mark_output, prepend=True)
    return len(converted)


def precompute_scales(model: nn.Module, *, all_gather: bool) -> None:
    """After an optimizer step, with float8 all-gather: compute every converted weight's scale in
    one fused pass (instead of one all-reduce per weight in the next forward). Without it there
    is nothing to precompute: each forward computes its weights' scales inside the compiled
    block."""
    if all_gather:
        import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def describe(
    mode: str, model: nn.Module | None = None, *, skip_small: bool = False,
    all_gather: str | None = None,
) -> str:  # fmt: skip
    """The header/plan line: mode, filter, (given a model) how many Linears it converts, and
    (given `all_gather_choice`'s reason) whether the weights are gathered in float8."""
    if mode == "off":
        return "off"
    text = f"{mode} ({FILTER_TEXT}"
    if skip_small:
        text += f", {SKIP_SMALL_TEXT[mode]} (float8_filter=skip_small)"
    if model is not None:
        converted, skipped = float8_linears(model, mode=mode, skip_small=skip_small)
        text += f": {len(converted)} converted, {len(skipped)} kept"
        if skipped:
            text += f" ({', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''})"
    if all_gather is not None:
        text += f"; float8 all-gather {all_gather}"
    return text + ")"
