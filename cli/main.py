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
"""
from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import torch
import typer
from typer.core import TyperGroup

import nano
from nano.parallel import stop_ranks

from . import bench, chat, eval, fault, models, profile, serve
from .console import print_error
from .options import MODEL_HELP


class NanoGroup(TyperGroup):
    """The `nano` group, whose entry point reports a bad command line (Click's usage errors: an unknown flag, a
    missing argument, a value of the wrong type or out of range) as one `error:` line and exit code 2."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            sys.exit(130)
        except Exception as error:   # Click's exceptions (its vendored copy inside typer has no public name)
            message, context = getattr(error, "format_message", None), getattr(error, "ctx", None)
            if message is None:
                raise
            if type(error).__name__ == "NoArgsIsHelpError":    # `nano` or `nano chat` alone: the help
                typer.echo(context.get_help())
                sys.exit(0)
            hint = f" (see '{context.command_path} -h')" if context is not None and error.exit_code == 2 else ""
            print_error(message() + hint)
            sys.exit(error.exit_code)
        finally:   # a command's tensor-parallel ranks end with it (also when nano runs in process, as in tests)
            stop_ranks()
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=NanoGroup, no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
                  help="nano: a compact, readable inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x).")


def show_version(value: bool) -> None:
    if value:
        typer.echo(f"nano {nano.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})")
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


def main() -> None:
    app(prog_name="nano")


if __name__ == "__main__":
    main()
