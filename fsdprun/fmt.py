"""Numbers as a person reads them: bytes in binary units (`fmt_bytes`), counts of parameters,
tokens or examples in thousands, millions, billions (`fmt_count`).

On the ground floor, beside `errors`: an error line that spells a byte count (a file-size limit)
and every table of the report format with the same two functions. Imports nothing.
"""

from __future__ import annotations

GIB = 1024**3


def fmt_bytes(n: float | None) -> str:
    """`n` bytes in the largest binary unit it holds once ("1.50 GiB", "512 B"); "n/a" for None."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    """`n` things in the largest decimal unit it holds once ("1.24B", "7.00M", "512")."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"
