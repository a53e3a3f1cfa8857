"""The error types for problems a user can fix, and `diagnostic`, the one printer of warnings.

The CLI prints a `UserError` as one line and exits 2, a `StorageError` as one line and exits 1;
anything else is a bug or a runtime failure and keeps its traceback. Set FSDPRUN_DEBUG=1 to see
the traceback of these too. Errors, `warning:` and `note:` lines all go to stderr, so that
`fsdprun train ... > log` keeps them in view and stdout holds the command's own output.

Imports of fsdprun only the ground floor's number formats (`fmt`): every module imports this one.
"""

from __future__ import annotations

import errno
import sys
from typing import Literal

from fsdprun.fmt import fmt_bytes


class UserError(Exception):
    """A problem in what the user asked for: the message names the key or path and the fix."""


class StorageError(Exception):
    """The machine refused a write (a full disk, a file-size limit, a read-only or unwritable
    place): the message names the path and why; nothing partial was left behind."""


def diagnostic(kind: Literal["warning", "note"], message: str) -> None:
    """Print `kind: message` on stderr as one line (not wrapped, no markup: paths stay whole).

    The caller decides who prints: in a run, rank 0's Reporter, or a rank into its own log.
    """
    message = "\\n".join(message.splitlines())  # one line whatever it quotes, as an error line
    # sys.stderr is looked up at each call: while rich's live progress bar runs, it stands in
    # for sys.stderr and prints the line above the bar.
    print(f"{kind}: {message}", file=sys.stderr, flush=True)


def find_os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, or through its causes and contexts): torch.save's C++
    stream, for one, reports the OSError of a failed write as a RuntimeError raised during it."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__]
    return None


def describe_os_error(error: OSError) -> str:
    """Why a write failed, in words: ENOSPC and EFBIG (a file-size limit, `ulimit -f`) name
    their cause, which the raw messages hide behind "file too large" or a torch stream error."""
    if error.errno == errno.ENOSPC:
        return "no space left on device"
    if error.errno == errno.EDQUOT:
        return "disk quota exceeded"
    if error.errno == errno.EFBIG:
        import resource  # Unix only, like EFBIG from a limit

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit == resource.RLIM_INFINITY:
            return "file too large for the filesystem"
        return f"file too large: over the file-size limit of {fmt_bytes(limit)} (ulimit -f)"
    if error.errno == errno.EROFS:
        return "read-only file system"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    text = error.strerror or str(error) or type(error).__name__
    return text[0].lower() + text[1:]


# The machine refused the write: a full disk, a quota, a file-size limit, a read-only or
# unwritable place. Others (a file where a folder is expected) come from the path given.
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                       errno.EPERM)  # fmt: skip
_REMEDY = {
    errno.ENOSPC: "free some space there",
    errno.EDQUOT: "free some space there",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EROFS: "make that filesystem writable",
    errno.EACCES: "make it writable for this user",
    errno.EPERM: "make it writable for this user",
}


def write_error(
    what: str, error: OSError, *, option: str, then: str = ""
) -> UserError | StorageError:
    """The one-line error for a write that failed: `what` failed (it names the path), why, and
    the fix; a StorageError (exit 1) when the machine refused it, else a UserError (exit 2).

    Args:
        option: the command-line option that chooses the place, for the fix (`--out`).
        then: what to do once the place is fixed, where the work so far is kept there (`rerun
            the same command: it continues`); without it the fix offers another `option` too.
    """
    remedy = _REMEDY.get(error.errno)
    if then:
        fix = f"{remedy or 'fix that'}, then {then}"
    else:
        fix = f"{remedy}, or give another {option}" if remedy else f"give another {option}"
    message = f"{what}: {describe_os_error(error)}; {fix}"
    return StorageError(message) if error.errno in _ENVIRONMENT_ERRNOS else UserError(message)
