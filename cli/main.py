"""The `nano` command line: the Typer app, one command per module, and the entry point.

    nano models [--json]              the presets: size, attention, KV-cache bytes per token, local checkpoint or not
    nano models --capacity [--json]   tokens of context that fit on an 8×H200 node, recomputed from the configs
    nano chat MODEL [options]         chat with a preset, a checkpoint directory or a Hugging Face hub id
    nano bench MODEL [options]        a load generator: throughput, latency percentiles, KV use (--reproduce-blog)
    nano profile MODEL [options]      where the time and memory of one prefill and one decode step go
    nano fault MODEL --FAULT          break the KV bookkeeping on purpose; see what the integrity check does
    nano eval MODEL [options]         accuracy on held-out text: bits per byte, top-1, KL against a reference

Imports point one way: this module imports the command modules (models, chat, bench, profile, fault, eval); they
import the shared pieces below them (console: consoles, errors, number formats; options: the engine flags) and
never this module. `python -m nano` runs `main()` too (nano/__main__.py).

The help is Click's plain format (the layout of argparse, vllm and ollama), and every error Click finds in a
command line becomes one `error:` line with exit code 2, like nano's own (see console.py for the convention).

Nothing here or in the command modules imports torch at the top: a command imports the engine once its command
line is checked, so `nano -h`, `--version` and a mistyped flag answer at once (benchmarks/startup.py). Ctrl-C at
any moment, from loading the command line to a command's end, exits 130 without a traceback.
"""
from __future__ import annotations

import sys

try:   # Ctrl-C while the command line loads (the window before main() can catch it)
    import inspect
    import os
    import shlex
    import signal
    from collections.abc import Sequence
    from types import FrameType
    from typing import Annotated, Any

    import typer
    from typer.core import TyperGroup

    import nano

    from . import bench, chat, eval, fault, models, profile, serve
    from .console import print_error
    from .options import MODEL_HELP
except KeyboardInterrupt:   # exit 130 (128 + SIGINT), as a shell reports a command Ctrl-C ended
    print(file=sys.stderr)   # end the line ^C was typed on
    sys.exit(130)


class NanoGroup(TyperGroup):
    """The `nano` group, whose entry point reports a bad command line (Click's usage errors: an unknown flag, a
    missing argument, a value of the wrong type or out of range) as one `error:` line and exit code 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:   # Click's form of Ctrl-C (it has ended the line already)
            sys.exit(130)
        except Exception as error:   # Click's exceptions (its vendored copy inside typer has no public name)
            message, context = getattr(error, "format_message", None), getattr(error, "ctx", None)
            if message is None:
                raise
            if type(error).__name__ == "NoArgsIsHelpError":    # `nano` or `nano chat` alone: the help
                typer.echo(context.get_help())
                sys.exit(0)
            text = message().replace("Value error, ", "")   # Typer's check of a choice words it as pydantic does
            hint = f" (see '{context.command_path} -h')" if context is not None and error.exit_code == 2 else ""
            if context is not None and context.command.name == "chat" and "unexpected extra arg" in text:
                words = text.partition(" (")[2].removesuffix(")")   # Click lists them last, in parentheses
                hint = (f"; to send {'them' if ' ' in words else 'it'} as a message: {context.command_path} "
                        f"{shlex.quote(context.params.get('model') or 'MODEL')} -p {shlex.quote(words)}")
            print_error(text + hint)
            sys.exit(error.exit_code)
        finally:   # a command's tensor-parallel ranks end with it (also when nano runs in process, as in tests)
            if "nano.parallel" in sys.modules:   # no ranks without it (and importing it would load torch)
                from nano.parallel import stop_ranks
                stop_ranks()
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=NanoGroup, no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
                  help="nano: a compact, readable inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x).")


def show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version   # torch's version without importing torch
        typer.echo(f"nano {nano.__version__} (torch {version('torch')}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def nano_options(version: Annotated[bool, typer.Option(
        "--version", "-V", is_eager=True, callback=show_version, help="Print the version and exit.")] = False
                 ) -> None:
    """nano: a compact, readable inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x)."""


def reflowed(docstring: str) -> str:
    """Each paragraph of a docstring on one line, so that the help reflows to the terminal's width; a paragraph
    that starts with Click's \\b marker (a table) keeps its lines."""
    paragraphs = inspect.cleandoc(docstring).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)


for command in (models.models, chat.chat, serve.serve, bench.bench, profile.profile, fault.fault, eval.eval):
    text = reflowed(command.__doc__ or "")
    if "model" in inspect.signature(command).parameters:
        text += "\n\n" + MODEL_HELP
    app.command(help=text, short_help=text.split("\n\n")[0])(command)


def interrupt(signal_number: int, frame: FrameType | None) -> None:
    """Ctrl-C: a KeyboardInterrupt, which every command turns into exit 130 (and nano chat into the end of a reply),
    except while torch is being imported. Its C++ side calls into Python then, and an exception raised there is lost
    or aborts the process (pybind11 calls std::terminate): nano ends at once instead, with nothing to clean up (torch
    comes before any engine, rank or worker)."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "torch":
            print(file=sys.stderr, flush=True)
            os._exit(130)
        frame = frame.f_back
    raise KeyboardInterrupt


def main() -> None:
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        app(prog_name="nano")
    except KeyboardInterrupt:   # outside Click's own catch: while Typer builds the commands, or the ranks stop
        print(file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    main()
