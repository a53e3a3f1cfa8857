"""Which modules of a model become FSDP units (the recipe's wrap policy) and which parameters each
one owns: what fsdp2 and fsdp1 build from, and what `fsdprun plan` counts. (The mesh they shard
over: `fsdprun.engines.mesh`.)

Needs torch (`nn.Module` trees); never imports an engine module.
"""

from __future__ import annotations

from torch import nn

from fsdprun.config import FsdpConfig, WrapPolicy
from fsdprun.errors import UserError


def _shared_params(model: nn.Module) -> dict[int, set[str]]:
    """Parameters owned directly by more than one module (tied weights) → owner paths."""
    owners: dict[int, set[str]] = {}
    for path, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(path)
    return {pid: paths for pid, paths in owners.items() if len(paths) > 1}


def _within(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def plan_units(model: nn.Module, *, cfg: FsdpConfig) -> list[str]:
    """Module paths to wrap as their own FSDP units, in forward (registration) order; the root
    is wrapped last and is not listed.

    A module that shares a parameter with a module outside it (tied embeddings) is never a unit
    of its own: one parameter can belong to only one FSDP unit.
    """
    shared = _shared_params(model)
    modules = dict(model.named_modules())

    def wrappable(path: str) -> bool:
        # FSDP hooks run around forward: containers without one (ModuleDict) cannot be units.
        return type(modules[path]).forward is not nn.Module.forward and not splits_tied(path)

    def splits_tied(path: str) -> bool:
        for p in modules[path].parameters():
            owners = shared.get(id(p))
            if owners and not all(_within(o, path) for o in owners):
                return True
        return False

    if cfg.wrap is WrapPolicy.none:
        return []
    if cfg.wrap is WrapPolicy.block:
        return model.block_paths()
    if cfg.wrap is WrapPolicy.classes:
        known = sorted({type(m).__name__ for m in modules.values()})
        unknown = [c for c in cfg.wrap_classes if c not in known]
        if unknown:
            raise UserError(
                f"fsdp.wrap_classes: {', '.join(unknown)} not in this model; its classes are "
                f"{', '.join(known)}"
            )
        chosen = [
            path for path, m in modules.items()
            if path and type(m).__name__ in cfg.wrap_classes and wrappable(path)
        ]  # fmt: skip
        return chosen
    # size: post-order, counting only parameters not yet taken by a unit below.
    taken: set[int] = set()
    chosen = []

    def visit(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)
        if not path:
            return
        free = [p for p in module.parameters() if id(p) not in taken]
        if sum(p.numel() for p in free) >= cfg.min_num_params and wrappable(path):
            chosen.append(path)
            taken.update(id(p) for p in free)

    visit("", model)
    order = {path: i for i, path in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def own_params(model: nn.Module, unit_paths: list[str]) -> dict[str, int]:
    """Parameters each unit owns (not those of units nested in it); "" = the root."""
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    for path in ["", *sorted(unit_paths, key=len)]:  # deeper units claim their params last
        for p in modules[path].parameters():
            owner[id(p)] = path
    counts = dict.fromkeys(["", *unit_paths], 0)
    for p in model.parameters():  # shared (tied) parameters come once
        counts[owner[id(p)]] += p.numel()
    return counts
