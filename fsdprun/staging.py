"""Writing a new output folder all at once: commands that create a folder (`export`,
`prepare-data`) write into a temporary folder beside it and rename it into place at the end.

A run that fails (a full disk, a file-size limit, a bad input line halfway) leaves nothing
behind: no partial files under the target name, so a retry is never refused for a folder that
is "not empty". The rename is atomic and replaces an empty folder the user made.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from fsdprun.errors import StorageError, describe_os_error, find_os_error
from fsdprun.fmt import fmt_bytes


@contextlib.contextmanager
def staged_folder(out: Path, *, option: str = "--out", needed: int | None = None) -> Iterator[Path]:
    """A new empty folder beside `out` to write into; renamed to `out` when the block succeeds,
    removed (with any parent folders made for it) when it fails.

    Args:
        option: how the command names `out` in messages.
        needed: bytes the output takes, about, for a full disk's message.

    Raises:
        StorageError: a write failed (it names `out` and why: no space, a file-size limit, a
            read-only or unwritable place).
    """
    made: list[Path] = []  # parent folders that did not exist, outermost first
    parent = out.absolute().parent
    while not parent.exists():
        made.insert(0, parent)
        parent = parent.parent
    # A hidden name of the same folder, so the rename never crosses filesystems.
    stage = out.absolute().with_name(f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        for folder in made:
            folder.mkdir()
        stage.mkdir()
    except OSError as e:
        _remove(stage, made)
        raise StorageError(f"cannot write {option} {out}: {describe_os_error(e)}") from None
    try:
        yield stage
        stage.rename(out)
    except BaseException as e:
        _remove(stage, made)
        os_error = find_os_error(e)
        if os_error is None:
            raise
        why = describe_os_error(os_error)
        if needed is not None and why == "no space left on device":
            free = shutil.disk_usage(parent).free
            why += f" (it needs about {fmt_bytes(needed)}, {fmt_bytes(free)} free)"
        raise StorageError(f"writing {option} {out} failed: {why}; nothing was left behind") from e


def _remove(stage: Path, made: list[Path]) -> None:
    shutil.rmtree(stage, ignore_errors=True)
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()
