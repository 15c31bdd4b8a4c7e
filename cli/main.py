"""The `nano` command line: the Typer app, one command per module, and the entry point.

    nano models [--json]              the presets: size, attention, KV-cache bytes per token, local checkpoint or not
    nano models --capacity [--json]   tokens of context that fit on an 8×H200 node, recomputed from the configs
    nano chat MODEL [options]         chat with a preset, a checkpoint directory or a Hugging Face hub id
    nano bench MODEL [options]        a load generator: throughput, latency percentiles, KV use (--reproduce-blog)
    nano profile MODEL [options]      where the time and memory of one prefill and one decode step go
    nano fault MODEL --FAULT          break the KV bookkeeping on purpose; see what the integrity check does

Imports point one way: this module imports the command modules (models, chat, bench, profile, fault); they
import the shared pieces below them (console: consoles, errors, number formats; options: the engine flags) and
never this module. `python -m nano` runs `main()` too (nano/__main__.py).
"""
from __future__ import annotations

import inspect

import typer

from . import bench, chat, fault, models, profile

app = typer.Typer(help="nano: a compact, readable inference engine for MLA + MoE models (Kimi K2.x, GLM-5.x).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def reflowed(docstring: str) -> str:
    """Each paragraph of a docstring on one line, so that the help reflows to the terminal's width (Typer keeps
    the line breaks of every paragraph but the first)."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(docstring).split("\n\n"))


for command in (models.models, chat.chat, bench.bench, profile.profile, fault.fault):
    app.command(help=reflowed(command.__doc__ or ""))(command)


def main() -> None:
    app(prog_name="nano")


if __name__ == "__main__":
    main()
