"""What every command shares, below them all: the two consoles, the error helpers and the number formats.

Output conventions: the model's text goes to stdout, raw. Tables and slash-command answers go to stdout through
`out`. Everything else goes to stderr through `err`: which model is running, timings, progress, errors. So
`nano chat MODEL -p "..." > answer.txt` captures only the answer, and `--json` prints one JSON object on stdout
and nothing else there.

Every mistake ends with one line, `error: <message>` naming the flag as it is typed, and never a traceback. The
exit code says which kind:
    2  the command line itself is wrong, whatever the machine: an unknown flag, a value of the wrong type or out
       of range, flags that conflict or would do nothing together (`UsageError`; Click's own errors too)
    1  the command could not be carried out: a missing file or model, an unwritable output path, a KV budget
       larger than the free memory, a prompt longer than the context, a fault that went undetected (`NanoError`)
  130  interrupted (Ctrl-C)
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

from nano.errors import NanoError, UsageError

# tables and slash-command answers (model text is written raw); piped, 120 columns unless COLUMNS says otherwise
out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # what is running, timings, hints: one line each


# ---- errors (UsageError, from nano.errors: the command line is wrong by itself, exit 2) ---------------------------
def print_error(message: str) -> None:
    """One `error:` line on stderr (a multi-line message is joined into one)."""
    typer.echo(f"error: {' '.join(message.splitlines())}", err=True)


def warn(message: str) -> None:
    """One `warning:` line on stderr: the command goes on."""
    typer.echo(f"warning: {' '.join(message.splitlines())}", err=True)


def fail(message: str, exit_code: int = 1) -> NoReturn:
    print_error(message)
    raise typer.Exit(exit_code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a UsageError into one `error:` line and exit 2, any other NanoError into one and exit 1; Ctrl-C into
    a quiet exit 130."""
    try:
        yield
    except UsageError as error:
        fail(str(error), exit_code=2)
    except NanoError as error:
        fail(str(error))
    except KeyboardInterrupt:
        typer.echo("", err=True)  # finish the line that ^C interrupted
        raise typer.Exit(130) from None


@contextmanager
def tables_on_stderr(active: bool = True) -> Iterator[None]:
    """While active, what goes through `out` goes to stderr: stdout is kept for one JSON object (--json)."""
    if not active:
        yield
        return
    out.file = sys.stderr
    try:
        yield
    finally:
        out.file = None   # back to following sys.stdout, as created (not to the stream of this moment)


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


# ---- paths ----------------------------------------------------------------------------------------------------
def check_output_path(flag: str, path: Path) -> None:
    """Refuse an output file that could not be written, before any work starts (so no result is lost at the end):
    its folder must exist and be writable, and the path must not be a folder."""
    path = path.expanduser()
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise NanoError(f"{flag} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise NanoError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise NanoError(f"{flag} {path}: not writable")


def write_report(flag: str, path: Path, report: dict[str, Any]) -> None:
    """Write a command's JSON report to the file `flag` named (checked by check_output_path before the work), and
    say so on stderr."""
    try:
        path.expanduser().write_text(json.dumps(report, indent=2))
    except OSError as error:
        raise NanoError(f"{flag} {path}: {error.strerror or error}") from None
    err.print(f"wrote {path}", style="dim", markup=False)
