"""The one exception type users see.

Anything that is the user's fault (a bad path, a corrupt checkpoint, a prompt that is too long, a nonsense
sampling value) raises `NanoError` with a one-line message; the CLI prints it and exits non-zero.
"""

import re


class NanoError(Exception):
    """A user-facing error whose message is one complete line."""


class UsageError(NanoError):
    """A setting that is wrong by itself, whatever the machine: a value out of range, settings that conflict or
    would do nothing together (the CLI exits 2 for these, 1 for other NanoErrors)."""


def brief(error: BaseException | str) -> str:
    """An error's first line, for a one-line message: without the C++ source location torch and gloo put first
    (`[/__w/pytorch/...]`) or append (`at /...`), and without the advice gloo appends."""
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically")[0]
    for marker in (" [/", "[/", " at /"):
        line = line.split(marker)[0]
    return line.strip() or (error if isinstance(error, str) else type(error).__name__)
