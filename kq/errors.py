"""The one exception type that reaches the user as a single line.

Anything a user can cause (bad path, wrong family, indivisible group size, full disk)
raises KqError with a message that says what to do; the CLI prints it and exits 2.
Anything else is a bug and keeps its traceback.
"""


class KqError(Exception):
    """A user-facing failure: str(err) is the whole message."""


class QuietExit(Exception):
    """Under torchrun: another rank reports the error (one line); this one exits 2 silently."""
