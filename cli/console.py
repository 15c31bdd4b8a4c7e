"""What every command shares, below them all: the two consoles, the error helpers and the number formats.

Output conventions: the model's text goes to stdout, raw. Tables and slash-command answers go to stdout through
`out`. Everything else goes to stderr through `err`: which model is running, timings, progress, errors. So
`nano chat MODEL -p "..." > answer.txt` captures only the answer. A mistake the user can make (an unknown model,
a bad flag value, a prompt longer than the context) ends with one line, `error: <message>`, and exit code 1,
never a traceback. Usage errors (an unknown flag, a missing argument) are Typer's and exit with 2.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from rich.console import Console

from nano.errors import NanoError

# tables and slash-command answers (model text is written raw); piped, 120 columns unless COLUMNS says otherwise
out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # what is running, timings, hints: one line each


# ---- errors ---------------------------------------------------------------------------------------------------
def print_error(message: str) -> None:
    """One `error:` line on stderr (a multi-line message is joined into one)."""
    typer.echo(f"error: {' '.join(message.splitlines())}", err=True)


def fail(message: str, exit_code: int = 1) -> NoReturn:
    print_error(message)
    raise typer.Exit(exit_code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a NanoError into one `error:` line and exit 1; Ctrl-C into a quiet exit 130."""
    try:
        yield
    except NanoError as error:
        fail(str(error))
    except KeyboardInterrupt:
        typer.echo("", err=True)  # finish the line that ^C interrupted
        raise typer.Exit(130) from None


# ---- numbers --------------------------------------------------------------------------------------------------
def format_count(count: int) -> str:
    """Three significant digits: 1_026_408_232_448 -> '1.03T', 15_960_110_208 -> '16.0B', 77_430_440 -> '77.4M'."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}{suffix}"
    return str(count)


def format_bytes(nbytes: float) -> str:
    """Binary units, three significant digits: 33_554_432 -> '32.0 MiB'."""
    for suffix, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {suffix}"
    return f"{nbytes:.0f} B"
