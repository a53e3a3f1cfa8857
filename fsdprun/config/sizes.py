"""Sizes as people write them on the command line ('80GB', '2GiB', '500MB'): one parser for
`plan --device-memory` and `export --max-shard-size`. Never imports torch, nor any fsdprun
module other than the error types.
"""

from __future__ import annotations

import re

from fsdprun.errors import UserError

# Decimal units as HuggingFace and device vendors use them; KiB/MiB/GiB/TiB are binary.
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(
    text: str,
    *,
    option: str = "size",
    expected: str = "a positive size such as 5GB, 500MB or 2GiB",
    bare_unit: str = "B",
) -> int:
    """'5GB' -> 5_000_000_000; a bare number is in `bare_unit`.

    Args:
        option: the command-line option, named in the error.
        expected: what the error says a valid value looks like.

    Raises:
        UserError: not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and (match.group(2).upper() or bare_unit)
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise UserError(f"{option} {text!r}: expected {expected}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])
