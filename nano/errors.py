"""The one exception type users see.

Anything that is the user's fault (a bad path, a corrupt checkpoint, a prompt that is too long, a nonsense
sampling value) raises `NanoError` with a one-line message; the CLI prints it and exits non-zero.
"""


class NanoError(Exception):
    """A user-facing error whose message is one complete line."""
