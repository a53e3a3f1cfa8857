"""numpy, imported on its first use.

`fsdprun config` checks token and text files before anything launches and must answer at once:
the checks read headers and sizes, which need no numpy, so the data modules take numpy from here
and pay its import (about 0.1 s) only when they really touch an array. Each attribute is cached
on first access, so the hot data path costs a plain attribute lookup.

Never imports another fsdprun module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy  # noqa: F401 (what `np` stands for)


class _LazyNumpy:
    def __getattr__(self, name: str) -> Any:
        value = getattr(importlib.import_module("numpy"), name)
        setattr(self, name, value)  # later lookups skip __getattr__
        return value


np: Any = _LazyNumpy()
