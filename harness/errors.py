"""The one exception type the CLI turns into a one-line message and exit status 2."""


class UsageError(Exception):
    """Bad input from the user: the message names the problem and the fix, on one line."""

    exit_code = 2
