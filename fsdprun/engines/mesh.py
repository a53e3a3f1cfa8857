"""Sharding rules: what `fsdp.sharding` means once fsdp2's reshard_after_forward override is
applied, how many ranks share one copy of the model state (the shard group: one dimension of the
device mesh, the replicas being the other), the backward prefetch depth, and which combinations
each engine accepts.

The engines, `fsdprun plan` and the recipe checks (`fsdprun.config.validate`) all read these,
so a rule changes in one place. Plain functions of the recipe: never imports torch, nor any
fsdprun module other than the config schema.
"""

from __future__ import annotations

from fsdprun.config.schema import Engine, FsdpConfig, RecipeConfig, Sharding

BACKWARD_PREFETCH_MODES = ("pre", "post", "none")


def backward_prefetch_depth(fsdp: FsdpConfig) -> int:
    """fsdp.backward_prefetch as a depth: pre/post = 1 unit, none = 0, N = N (validated)."""
    value = str(fsdp.backward_prefetch)
    if value in BACKWARD_PREFETCH_MODES:
        return 0 if value == "none" else 1
    return int(value)


def effective_sharding(fsdp: FsdpConfig) -> Sharding:
    """fsdp.sharding with fsdp2's reshard_after_forward override applied."""
    s, raf = fsdp.sharding, fsdp.reshard_after_forward
    if raf is None or fsdp.engine is not Engine.fsdp2:
        return s
    if raf is False:
        return {Sharding.full: Sharding.grad_op, Sharding.hybrid: Sharding.hybrid_zero2}.get(s, s)
    return {Sharding.grad_op: Sharding.full, Sharding.hybrid_zero2: Sharding.hybrid}.get(s, s)


def shard_group_size(cfg: RecipeConfig, world_size: int | None = None) -> int:
    """Ranks that share one copy of the model state under the effective sharding."""
    ws = world_size if world_size is not None else cfg.world_size
    sharding = effective_sharding(cfg.fsdp)
    if cfg.fsdp.engine is Engine.ddp or sharding is Sharding.none:
        return 1
    if sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        return cfg.fsdp.shard_group_size or min(cfg.launch.nproc_per_node, ws)
    return ws


def sharding_errors(fsdp: FsdpConfig, *, world_size: int, nproc_per_node: int) -> list[str]:
    """What the engine and mesh refuse in the `fsdp:` section, one message per problem."""
    errors = []
    value = str(fsdp.backward_prefetch)
    if value not in BACKWARD_PREFETCH_MODES and not (value.isdigit() and int(value) >= 1):
        errors.append(
            f"fsdp.backward_prefetch: '{value}' is not valid; use pre, post, none or a depth >= 1"
        )
    if fsdp.engine is not Engine.fsdp2 and fsdp.reshard_after_forward is not None:
        errors.append(
            f"fsdp.reshard_after_forward is an fsdp2 knob; with fsdp.engine={fsdp.engine.value} "
            "set fsdp.sharding (full = reshard, grad_op = keep) instead"
        )
    if fsdp.shard_group_size is not None:
        if fsdp.shard_group_size < 1 or world_size % fsdp.shard_group_size:
            errors.append(
                f"fsdp.shard_group_size ({fsdp.shard_group_size}) must divide the world size "
                f"({world_size})"
            )
    elif fsdp.sharding in (Sharding.hybrid, Sharding.hybrid_zero2) and world_size % min(
        nproc_per_node, world_size
    ):
        errors.append(
            f"fsdp.sharding={fsdp.sharding.value}: launch.nproc_per_node ({nproc_per_node}) "
            f"must divide the world size ({world_size}); set fsdp.shard_group_size"
        )
    if fsdp.engine is Engine.ddp and fsdp.cpu_offload:
        errors.append("fsdp.cpu_offload needs a sharding engine; use fsdp.engine=fsdp1 or fsdp2")
    return errors
