"""The error type for mistakes a user can fix (recipe, flags, files).

The CLI prints a `UserError` as one line and exits 2; anything else is a bug or a runtime
failure and keeps its traceback. Set FSDPRUN_DEBUG=1 to see the traceback of a UserError too.
"""


class UserError(Exception):
    """A problem in what the user asked for: the message names the key or path and the fix."""
