"""What `fsdprun tune` was asked (`TuneArgs`): the recipe, the budget, the space and the search's
settings, as the CLI gathers them; tune() and its report read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fsdprun.tools.tune.search import (
    DEFAULT_CONFIRM,
    DEFAULT_FINALISTS,
    DEFAULT_REPEATS,
    DEFAULT_STEPS,
)
from fsdprun.tools.tune.space import DEFAULT_MARGIN


@dataclass
class TuneArgs:
    recipe: str
    overrides: list[str]  # the user's key=value overrides
    launch_overrides: list[str]  # from the launch flags
    launch_flags: list[str]  # the same flags as typed, for the printed train command
    out_dir: Path
    budget_s: float
    device_memory_bytes: int | None = None
    space: list[str] = field(default_factory=list)
    allow_numerics: bool = False
    steps: int = DEFAULT_STEPS
    repeats: int = DEFAULT_REPEATS
    finalists: int = DEFAULT_FINALISTS
    confirm: int = DEFAULT_CONFIRM  # pairs of the winner and the baseline after the search
    trial_timeout_s: float | None = None
    margin: float = DEFAULT_MARGIN
    dry_run: bool = False  # print the space, the pruning and the order; run nothing
