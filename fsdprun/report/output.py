"""Consoles that fit where the output goes: a terminal, or a log (CI, `| tee`, a SLURM file).

On a terminal rich lays everything out for the terminal's width, as a user expects. Anywhere else
rich would assume 80 columns and break long lines into pieces: a run directory's path or a
`metrics in ...` line cut in two cannot be copied or grepped. There, lines are never wrapped (a
log viewer shows a line whole or scrolls) and tables are laid out for `LOG_TABLE_WIDTH` columns,
wide enough for every table fsdprun prints, narrow enough to read in a log. `COLUMNS`, when set,
is the width tables are laid out for, on a terminal or not.

Imports rich's console only (the CLI builds its error console at load time).
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

LOG_TABLE_WIDTH = 120


def output_console(*, stderr: bool = False, **options: Any) -> Console:
    """A rich Console for stdout (or stderr) that wraps only on a terminal.

    Args:
        stderr: write to stderr instead of stdout.
        options: further `Console` arguments (`highlight`, `record`, ...).
    """
    console = Console(stderr=stderr, **options)
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) > 0 else LOG_TABLE_WIDTH
    return Console(stderr=stderr, **{**options, "width": width, "soft_wrap": True})
