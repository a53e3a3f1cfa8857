"""Known notices of the libraries fsdprun loads that tell its user nothing to act on, kept off
the command's own console so that the first line a user reads is fsdprun's: a run's header, a
plan. Each one has a name and the reason it is noise, in `KNOWN_NOTICES`.

A notice is dropped only in the process that hid it (`fsdprun` itself: cli.main) and only on
its way to that console. The ranks' log files keep it: the workers a launcher forks inherit the
filter but let every record through, spawned workers and torchrun's or srun's ranks never hide
anything (`train` shows them again in a rank), and FSDPRUN_DEBUG=1 hides nothing at all.

Imports logging only: a library's logger exists before the library loads, so the filters are
in place before torch or torchao can write.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Notice:
    name: str
    logger: str  # the logger that writes it
    pattern: str  # a regular expression that the message matches from its start
    why: str
    cpu_torch_only: bool = False  # noise only where torch was built without CUDA

    def matches(self, record: logging.LogRecord) -> bool:
        if self.cpu_torch_only:
            torch = sys.modules.get("torch")
            if torch is None or torch.version.cuda is not None:
                return False
        return re.match(self.pattern, record.getMessage()) is not None


KNOWN_NOTICES = (
    Notice(
        name="pytree-enum-register-constant",
        logger="torch.utils._pytree",
        pattern=r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile",
        why="torchao registers its Enums (ScaleCalculationMode, KernelPreference) with "
        "torch.utils._pytree.register_constant as it loads, which torch 2.13 deprecates for "
        "Enums; transformers' quantizers import torchao whenever it is installed, so every run "
        "of an HF folder opened with it. torchao's call to change, nothing for a user to do.",
    ),
    Notice(
        name="torchao-cuda-kernels-without-cuda",
        logger="torchao",
        pattern=r"Failed to load \S*torchao/_C\w*\.\S*so: ",
        why="torchao's wheel ships CUDA kernel libraries (mxfp8, CUTLASS for sm90a) and tries to "
        "load each as it loads; on a torch built without CUDA none can, and fsdprun uses none of "
        "them (its float8 matmuls are torch._scaled_mm). On a CUDA torch the line stays: there "
        "it is a broken install.",
        cpu_torch_only=True,
    ),
)


class _OffThisConsole(logging.Filter):
    """Drops `notice` in the process that made the filter; a forked child lets it through."""

    def __init__(self, notice: Notice):
        super().__init__(notice.name)
        self.notice = notice
        self.pid = os.getpid()

    def filter(self, record: logging.LogRecord) -> bool:
        return os.getpid() != self.pid or not self.notice.matches(record)


def hide_known_notices() -> None:
    """Keep every notice of `KNOWN_NOTICES` off this process's console from now on."""
    for notice in KNOWN_NOTICES:
        logger = logging.getLogger(notice.logger)
        if not any(isinstance(f, _OffThisConsole) for f in logger.filters):
            logger.addFilter(_OffThisConsole(notice))


def show_known_notices() -> None:
    """Let them through again (a rank: its log keeps what its libraries say)."""
    for notice in KNOWN_NOTICES:
        logger = logging.getLogger(notice.logger)
        for f in [f for f in logger.filters if isinstance(f, _OffThisConsole)]:
            logger.removeFilter(f)
