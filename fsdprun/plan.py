"""Memory plan of a recipe before any GPU is rented: FSDP units and per-rank memory by component.

    fsdprun plan llama-70b --world-size 64 --device-memory 80GB

The model is built on the meta device (no memory), the FSDP units come from `plan_units` exactly as
`apply_fsdp` wraps them, and each parameter's per-rank shard is computed from its real shape:
FSDP2 shards dim 0 and pads it to a multiple of the shard group, so rank 0 holds ceil(dim0 / N)
rows (the shape `model_state_bytes` measures in a run). An 8B or 70B recipe plans in about a
second. A fake process group is not needed: the shard shapes follow from the shapes alone.

Model state follows the ZeRO paper's mixed-precision Adam accounting, as fsdprun keeps it:
fp32 master parameters (4 B), fp32 gradients (4 B), two fp32 Adam moments (8 B) = 16 B/param,
plus AdamW's 4-byte step counter per tensor. Strategies divide it differently:

- full    full sharding (ZeRO-3): parameters, gradients, optimizer state / N.
- grad_op (ZeRO-2): gradients and optimizer state / N; the fp32 parameter shards / N too, but
          every unit's gathered copy (param_dtype) stays from forward to backward: the whole
          model in param_dtype is counted under gathered buffers.
- hybrid  full sharding inside groups of fsdp.shard_group_size ranks (default: one node),
          replicated across groups.
- ddp     nothing sharded (DistributedDataParallel; also what `sharding: none` holds).
FSDP1 shards each unit's flat parameter instead (`_fsdp1_rank0`): the unit's parameters
concatenated (with use_orig_params, each aligned to 16 bytes of param_dtype) and padded to a
multiple of the shard group; rank 0 holds the first 1/N of it, and the plan counts exactly what
a run measures there.

Gathered buffers and activations are estimates; `ACTIVATION_FORMULA` says how they are computed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from fsdprun.config import (
    CheckpointMode,
    Dtype,
    Engine,
    Float8,
    LossKind,
    RecipeConfig,
    Sharding,
    backward_prefetch_depth,
    effective_sharding,
    load_recipe,
    shard_group_size,
)
from fsdprun.engine import translate
from fsdprun.errors import UserError
from fsdprun.float8 import MFU_CONVENTION, float8_linears
from fsdprun.float8 import describe as describe_float8
from fsdprun.loss import describe_loss
from fsdprun.models import Transformer, build_model_args
from fsdprun.parallel import plan_units

DTYPE_BYTES = {Dtype.bf16: 2, Dtype.fp16: 2, Dtype.fp32: 4}
MASTER_BYTES = 4  # sharded parameters and their gradients are fp32 whatever param_dtype is
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
ADAM_STEP_BYTES = 4  # AdamW's per-tensor `step`, a 0-d fp32 tensor

ACTIVATION_FORMULA = (
    "per block and token, eager: 8*dim (the fp32 input of each RMSNorm) + c*(6*dim + 4*ffn_dim + "
    "2*kv_dim), c = bytes of param_dtype (each norm's value before and after its weight, q after "
    "RoPE, the attention output; k and v after RoPE; w1, w3, silu and product outputs); "
    "compiled (compile.enabled): c*(6*dim + 2*kv_dim + 3*ffn_dim) + 4*(n_heads + 2) (AOTAutograd "
    "recomputes the norms and keeps the fp32 statistics only); both counted with "
    "saved_tensors_hooks on a Llama block (within 2%). A checkpointed block keeps only its input, "
    "seq*micro*dim*c, and one block is recomputed at a time; plus the logits, "
    "seq*micro*vocab*(c + 8) eager (their fp32 copy and log-softmax in the loss) or "
    "seq*micro*(vocab*c + 8) with the loss compiled. Selective checkpointing (every block) keeps "
    "per token c*(5*dim + 2*kv_dim + 2*ffn_dim) + 4*n_heads (the block input, the matmul and "
    "attention outputs, attention's fp32 logsumexp), plus one block recomputed at a time. "
    "train.loss=chunked replaces the logits by seq*micro*dim*c + vocab*dim*(c + 4) (the "
    "gradients of the hidden states and the output weight, its fp32 accumulator) + "
    "chunk*vocab*(c + 12) (one chunk's logits, log-probabilities and their gradient)"
)
BUFFER_FORMULA = (
    "unsharded params in param_dtype (precision.float8=tensorwise: 1 byte for the weights of "
    "converted Linears, gathered in float8): the root unit (FSDP2 keeps the root gathered from "
    "forward to backward) + the largest other unit x (1 + prefetch depth)"
)
_SIZE_UNITS = {"GB": 10**9, "TB": 10**12, "MB": 10**6, "GIB": 2**30, "TIB": 2**40, "MIB": 2**20}


def parse_memory(text: str) -> int:
    """'80GB' -> 80_000_000_000 (GB/TB/MB decimal, GiB/TiB/MiB binary; a bare number is GB).

    Raises:
        UserError: not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and (match.group(2).upper() or "GB")
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--device-memory {text!r}: expected a size such as 80GB, 141GB or 24GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class PlannedUnit:
    """One FSDP unit as `apply_fsdp` would make it ("" = the root, last)."""

    path: str
    num_params: int
    unsharded_bytes: int  # gathered, in param_dtype
    shard_bytes: int  # fp32 master shard on rank 0
    reshard_after_forward: bool
    forward_prefetch: list[str]
    backward_prefetch: list[str] | str  # explicit unit paths, or "implicit"


@dataclass
class StrategyMemory:
    """Bytes on rank 0 under one sharding strategy."""

    shard_group: int
    params: int
    grads: int
    optimizer: int
    gathered_buffers: int
    activations: int
    total: int = 0
    fits: bool | None = None

    def __post_init__(self) -> None:
        self.total = (
            self.params + self.grads + self.optimizer + self.gathered_buffers + self.activations
        )


@dataclass
class MemoryPlan:
    recipe: str
    world_size: int
    nnodes: int
    nproc_per_node: int
    num_params: int
    param_dtype: str
    recipe_strategy: str
    device_memory_bytes: int | None
    units: list[PlannedUnit]
    strategies: dict[str, StrategyMemory]
    engine: str = "fsdp2"
    knobs: list[dict] = field(default_factory=list)
    activation_formula: str = ACTIVATION_FORMULA
    buffer_formula: str = BUFFER_FORMULA
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _rank0_elems(shape: torch.Size, shards: int) -> int:
    # FSDP2 Shard(0) pads dim 0 to a multiple of `shards`: rank 0 gets ceil(dim0 / shards) rows.
    if not shape:
        return 1
    rows = min(shape[0], math.ceil(shape[0] / shards))
    return rows * math.prod(shape[1:])


def _unit_groups(model: nn.Module, paths: list[str]) -> list[tuple[str, list[nn.Parameter]]]:
    """Each unit's own parameters, as apply_fsdp takes them: not yet taken, forward order, root
    last."""
    modules = dict(model.named_modules())
    taken: set[int] = set()
    groups = []
    for path in paths:
        own = [p for p in modules[path].parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        groups.append((path, own))
    groups.append(("", [p for p in model.parameters() if id(p) not in taken]))
    return groups


def _fsdp1_unit_groups(model: nn.Module, paths: list[str]) -> list[tuple[str, list[nn.Parameter]]]:
    """Each FSDP1 unit's own parameters in flat-parameter order, root last. FSDP1 wraps bottom
    up: a nested unit owns its parameters, the root what no unit owns."""
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    for path in ["", *sorted(paths, key=len)]:  # deeper units claim their params last
        for p in modules[path].parameters():
            owner[id(p)] = path
    return [
        (path, [p for p in modules[path].parameters() if owner[id(p)] == path])
        for path in [*paths, ""]
    ]


def _fsdp1_rank0(params: list[nn.Parameter], shards: int, align: int) -> tuple[int, int]:
    """Elements and tensors of one FSDP1 unit that rank 0 holds and the optimizer steps.

    The flat parameter is the unit's parameters end to end; with use_orig_params each starts at
    a multiple of `align` elements (16 bytes of param_dtype; `align` 0 = flat parameters). Every
    rank holds ceil(numel / N) of it (FSDP1 pads it to a multiple of N), rank 0 the first. With
    flat parameters that whole slice is one tensor, padding included; with use_orig_params only
    the parameters' parts in it count, and only parameters with a part there get optimizer state.
    """
    spans, total = [], 0
    for p in params:
        if align and total % align:
            total += align - total % align
        spans.append((total, total + p.numel()))
        total += p.numel()
    size = math.ceil(total / shards)
    if not align:
        return size, 1
    held = [min(end, size) - start for start, end in spans if start < size]
    return sum(held), sum(1 for n in held if n > 0)


def _model_state(
    params: list[nn.Parameter],
    shards: int,
    fsdp1_units: list[list[nn.Parameter]] | None = None,
    align: int = 0,
) -> dict[str, int]:
    """Rank 0's fp32 parameters, gradients and Adam state: per parameter (FSDP2's dim-0
    shards, or nothing sharded), or per FSDP1 flat parameter when `fsdp1_units` are given."""
    if fsdp1_units is not None:
        counts = [_fsdp1_rank0(unit, shards, align) for unit in fsdp1_units if unit]
        sharded, tensors = sum(c[0] for c in counts), sum(c[1] for c in counts)
    else:
        sharded, tensors = sum(_rank0_elems(p.shape, shards) for p in params), len(params)
    return {
        "params": MASTER_BYTES * sharded,
        "grads": MASTER_BYTES * sharded,
        "optimizer": ADAM_STATE_BYTES * sharded + ADAM_STEP_BYTES * tensors,
    }


def block_activation_bytes(cfg: RecipeConfig) -> int:
    """Bytes one transformer block saves for backward for one micro-batch, not checkpointed
    (see ACTIVATION_FORMULA)."""
    m, t = cfg.model, cfg.train
    c = DTYPE_BYTES[cfg.precision.param_dtype]
    kv_dim = (m.n_kv_heads or m.n_heads) * (m.dim // m.n_heads)
    if cfg.compile.enabled:
        per_token = c * (6 * m.dim + 2 * kv_dim + 3 * m.ffn_dim) + 4 * (m.n_heads + 2)
    else:
        per_token = 8 * m.dim + c * (6 * m.dim + 4 * m.ffn_dim + 2 * kv_dim)
    return t.seq_len * t.micro_batch_size * per_token


def selective_block_bytes(cfg: RecipeConfig) -> int:
    """Bytes one block keeps under selective checkpointing for one micro-batch (see
    ACTIVATION_FORMULA)."""
    m, t = cfg.model, cfg.train
    c = DTYPE_BYTES[cfg.precision.param_dtype]
    kv_dim = (m.n_kv_heads or m.n_heads) * (m.dim // m.n_heads)
    per_token = c * (5 * m.dim + 2 * kv_dim + 2 * m.ffn_dim) + 4 * m.n_heads
    return t.seq_len * t.micro_batch_size * per_token


def loss_bytes(cfg: RecipeConfig) -> int:
    """Bytes the loss keeps for one micro-batch: the logits (plain) or the chunked loss's saved
    gradients plus one chunk (see ACTIVATION_FORMULA)."""
    m, t = cfg.model, cfg.train
    c = DTYPE_BYTES[cfg.precision.param_dtype]
    tokens = t.seq_len * t.micro_batch_size
    if t.loss is LossKind.chunked:
        chunk = min(t.loss_chunk_size, tokens)
        return tokens * m.dim * c + m.vocab_size * m.dim * (c + 4) + chunk * m.vocab_size * (c + 12)
    if cfg.compile.enabled:  # the compiled loss keeps the logits and two fp32 values per token
        return tokens * (m.vocab_size * c + 8)
    return tokens * m.vocab_size * (c + 8)


def activation_bytes(cfg: RecipeConfig) -> int:
    """Activations one rank keeps for backward for one micro-batch (estimate; see
    ACTIVATION_FORMULA)."""
    m, t = cfg.model, cfg.train
    c = DTYPE_BYTES[cfg.precision.param_dtype]
    tokens = t.seq_len * t.micro_batch_size
    block = block_activation_bytes(cfg)
    ac = cfg.activation_checkpointing
    checkpointed = {
        CheckpointMode.none: 0,
        CheckpointMode.full: m.n_layers,
        CheckpointMode.selective: m.n_layers,
        CheckpointMode.every_n: len(range(0, m.n_layers, max(ac.every_n, 1))),
    }[ac.mode]
    per_checkpointed = (
        selective_block_bytes(cfg) if ac.mode is CheckpointMode.selective else tokens * m.dim * c
    )
    kept = checkpointed * per_checkpointed + (m.n_layers - checkpointed) * block
    recompute = block if checkpointed else 0  # one block's activations while it is recomputed
    return kept + recompute + loss_bytes(cfg)


def plan_memory(
    cfg: RecipeConfig, *, recipe: str = "", device_memory_bytes: int | None = None
) -> MemoryPlan:
    """Plan units and per-rank memory of `cfg` at its launch.* world size, on the meta device.

    Args:
        cfg: a validated recipe (launch.nproc_per_node x launch.nnodes = the world size).
        recipe: its name, for the report.
        device_memory_bytes: memory of one device; None = launch.device_memory_gb, or unknown.

    Returns:
        The plan; `strategies[s].fits` is None when the device memory is unknown.
    """
    if getattr(cfg.model, "hf_path", None) is not None:
        raise UserError(
            "fsdprun plan does not read model.hf_path models yet; plan the model.* shape"
        )
    world, per_node = cfg.world_size, cfg.launch.nproc_per_node
    with torch.device("meta"):
        model = Transformer(build_model_args(cfg.model))
    params = list(model.parameters())  # tied weights appear once, as in the optimizer
    pbytes = DTYPE_BYTES[cfg.precision.param_dtype]
    fsdp = cfg.fsdp

    # Mirror apply_fsdp: units take the parameters not yet taken, in forward order, then the root
    # (FSDP1: a nested unit owns its parameters).
    paths = plan_units(model, cfg=fsdp)
    fsdp1 = fsdp.engine is Engine.fsdp1
    groups = _fsdp1_unit_groups(model, paths) if fsdp1 else _unit_groups(model, paths)
    # FSDP1 aligns each parameter in the flat parameter to 16 bytes of param_dtype, with
    # use_orig_params only.
    align = 16 // pbytes if fsdp1 and fsdp.use_orig_params else 0
    float8 = cfg.precision.float8.value
    f8_weights: set[int] = set()
    if cfg.precision.float8 is Float8.tensorwise:  # float8 all-gather: 1 byte per weight element
        modules = dict(model.named_modules())
        f8_weights = {id(modules[path].weight) for path in float8_linears(model)[0]}

    def gathered(own: list[nn.Parameter]) -> int:
        return sum(p.numel() * (1 if id(p) in f8_weights else pbytes) for p in own)

    sharding = effective_sharding(fsdp)
    reshard_units = sharding in (Sharding.full, Sharding.hybrid)
    depth_bwd = backward_prefetch_depth(fsdp)
    group = shard_group_size(cfg)
    units = []
    # DDP has no units: one bucketed all-reduce over the whole model.
    for i, (path, own) in enumerate([] if fsdp.engine is Engine.ddp else groups):
        is_root = path == ""
        # FSDP2 keeps the last block gathered (backward needs it at once); FSDP1 reshards every
        # unit; neither reshards the root after forward.
        last_kept = i == len(paths) - 1 and fsdp.engine is Engine.fsdp2
        reshard = reshard_units and not last_kept and not is_root
        if is_root:
            fwd, bwd = [], []
        elif fsdp.engine is Engine.fsdp1:
            # FSDP1 prefetches at most one unit each way; its backward mode is named.
            fwd = paths[i + 1 : i + 2] if fsdp.forward_prefetch > 0 else []
            mode = str(fsdp.backward_prefetch)
            bwd = {"post": "BACKWARD_POST", "none": "none"}.get(mode, "BACKWARD_PRE")
        else:
            fwd = paths[i + 1 : i + 1 + fsdp.forward_prefetch]
            bwd = (
                list(reversed(paths[max(0, i - depth_bwd) : i]))
                if depth_bwd > 1 and fsdp.engine is Engine.fsdp2
                else "implicit"
            )
        numel = sum(p.numel() for p in own)
        units.append(
            PlannedUnit(
                path=path,
                num_params=numel,
                unsharded_bytes=gathered(own),
                shard_bytes=MASTER_BYTES * (
                    _fsdp1_rank0(own, group, align)[0] if fsdp1 and own
                    else sum(_rank0_elems(p.shape, group) for p in own)
                ),  # fmt: skip
                reshard_after_forward=reshard,
                forward_prefetch=fwd,
                backward_prefetch=bwd,
            )
        )

    root = gathered(groups[-1][1])
    largest = max((gathered(own) for _, own in groups[:-1]), default=0)
    depth = max(fsdp.forward_prefetch, depth_bwd)
    sharded_buffers = root + largest * (1 + depth)
    whole = gathered(params)  # every unit gathered at once
    acts = activation_bytes(cfg)
    hybrid_group = fsdp.shard_group_size or min(per_node, world)
    autocast_copies = 0 if cfg.precision.param_dtype is Dtype.fp32 else whole

    fsdp1_units = [own for _, own in groups] if fsdp1 else None

    def memory(shards: int, gathered: int, *, ddp: bool = False) -> StrategyMemory:
        state = _model_state(params, shards, None if ddp else fsdp1_units, align)
        return StrategyMemory(shards, **state, gathered_buffers=gathered, activations=acts)

    strategies = {
        # Autocast keeps a param_dtype copy of every weight for backward (DDP's only "buffer").
        "ddp": memory(1, autocast_copies, ddp=True),
        "full": memory(world, sharded_buffers),
        # ZeRO-2: the gathered parameters stay from forward to backward, all units at once.
        "grad_op": memory(world, whole),
        "hybrid": memory(hybrid_group, sharded_buffers),
    }
    recipe_strategy = "ddp" if fsdp.engine is Engine.ddp else sharding.value
    if recipe_strategy == "hybrid_zero2":
        strategies["hybrid_zero2"] = memory(group, whole)
    elif recipe_strategy == "none":
        strategies["none"] = memory(1, whole)  # FSDP's compute copy of the replicated params
    elif recipe_strategy == "hybrid" and group != hybrid_group:
        strategies["hybrid"] = memory(group, sharded_buffers)
    if device_memory_bytes is None and cfg.launch.device_memory_gb is not None:
        device_memory_bytes = int(cfg.launch.device_memory_gb * 10**9)
    if device_memory_bytes is not None:
        for s in strategies.values():
            s.fits = s.total <= device_memory_bytes
    shard_rule = (
        "each unit's flat parameter padded to a multiple of N, rank 0 holding the first 1/N"
        + (" (parameters aligned to 16 bytes in it)" if align else "")
        if fsdp1 else "each parameter's rank-0 shard of ceil(dim0 / N) rows"
    )  # fmt: skip
    notes = [
        "model state: fp32 params 4 B + fp32 grads 4 B + Adam moments 8 B per param "
        f"(+ 4 B step per tensor), from {shard_rule}",
        f"prefetch depth {depth} (max of fsdp.forward_prefetch and fsdp.backward_prefetch)",
        "not counted: allocator fragmentation and cache, communication buffers, the CUDA "
        "context, unsharded gradients before their reduce-scatter",
        "ddp: gathered buffers are autocast's param_dtype copies of the weights; its fp32 norm "
        "activations are not modelled (the ddp total is the least certain)",
    ]
    if cfg.train.loss is LossKind.chunked:
        notes.append(f"loss: {describe_loss(cfg.train)}")
    if float8 != "off":
        notes.append(f"float8: {describe_float8(float8, model)}")
        notes.append(MFU_CONVENTION)
    return MemoryPlan(
        recipe=recipe,
        world_size=world,
        nnodes=cfg.launch.nnodes,
        nproc_per_node=per_node,
        num_params=sum(p.numel() for p in params),
        param_dtype=cfg.precision.param_dtype.value,
        recipe_strategy=recipe_strategy,
        engine=fsdp.engine.value,
        knobs=[asdict(k) for k in translate(cfg)],
        device_memory_bytes=device_memory_bytes,
        units=units,
        strategies=strategies,
        notes=notes,
    )


def plan_recipe(
    recipe: str,
    overrides: list[str],
    *,
    world_size: int | None = None,
    nnodes: int | None = None,
    device_memory_bytes: int | None = None,
) -> MemoryPlan:
    """Resolve `recipe` at the asked world size and plan it.

    `world_size` keeps the recipe's nproc_per_node when it divides (more or fewer nodes), else
    puts all ranks on one node; with `nnodes` too, nproc_per_node = world_size / nnodes.

    Raises:
        UserError: an invalid recipe, or a world size the node count does not divide.
    """
    launch: list[str] = []
    if world_size is not None:
        if world_size < 1:
            raise UserError(f"--world-size must be >= 1 (got {world_size})")
        if nnodes is None:
            per_node = load_recipe(recipe, overrides, check=False).config.launch.nproc_per_node
            nnodes = world_size // per_node if world_size % per_node == 0 else 1
        if nnodes < 1 or world_size % nnodes:
            raise UserError(
                f"--world-size {world_size} is not divisible by --nnodes {nnodes}; ranks are "
                "spread evenly over the nodes"
            )
        launch = [f"launch.nproc_per_node={world_size // nnodes}", f"launch.nnodes={nnodes}"]
    elif nnodes is not None:
        launch = [f"launch.nnodes={nnodes}"]
    resolved = load_recipe(recipe, [*overrides, *launch])
    return plan_memory(
        resolved.config, recipe=resolved.name, device_memory_bytes=device_memory_bytes
    )
