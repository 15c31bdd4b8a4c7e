"""`nano eval MODEL`: what FP8 KV and INT4/FP8 weights cost in accuracy, teacher-forced over held-out text.

The flags become configurations (the engine flags as given, or one per `--compare` value) and a reference (the
model's own dtype, unquantized weights, KV in the model's dtype). nano/evaluate.py measures them; this module
prints one table per context and one for the greedy continuations, the configurations side by side, each figure
with its interval (or, with --json, the report as one JSON object; --output also writes it to a file).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from nano.errors import NanoError
from nano.settings import MAX_TOKENS

if TYPE_CHECKING:   # the method and the engine (torch) load once the command line is checked
    from nano.evaluate import Candidate, Delta, Estimate, Report, Settings, Text
    from nano.llm import LLM

from .console import UsageError, check_output_path, err, out, user_errors, warn, write_report
from .machine import device_name, environment
from .options import SEED_RANGE, EngineOptions, Model, engine_flags, parse_compare
from .plot import check_plot, eval_chart, plot_option, save

PlotFile = plot_option("Also draw each configuration's Δ bits/byte and KL against the context, with their intervals,")

EVAL_KEYS = ("kv-dtype", "weights", "policy")   # the --compare keys of nano eval
ALONE_HINT = ("The model alone: its own figures. To measure what a format costs, set configurations against it "
              "with --compare kv-dtype=bf16,fp8, weights=bf16,fp8,int4 or policy=bf16/int4,fp8/int4.")


# ---- flags -------------------------------------------------------------------------------------------------------
def parse_contexts(text: str) -> tuple[int, ...]:
    """'256,1024' -> (256, 1024)."""
    try:
        contexts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--context takes window sizes in tokens like 256,1024; got {text!r}") from None
    if min(contexts) < 2:
        raise UsageError(f"--context {text}: a window needs at least 2 tokens")
    if len(set(contexts)) != len(contexts):
        raise UsageError(f"--context {text}: a size is listed twice")
    return contexts


def configurations_of(compare: str | None, engine: EngineOptions) -> list[tuple[str, EngineOptions]]:
    """The configurations to measure: one per --compare value (one value is enough: each is set against the
    reference); without --compare, the engine flags as given. Each is checked."""
    if compare is not None:
        return parse_compare(compare, engine, EVAL_KEYS, least=1)
    engine.check()
    shown = [f"{name.replace('_', '-')}={getattr(engine.config, name)}" for name in
             ("weights", "prefill_weights", "decode_weights", "kv_dtype", "dtype") if name in engine.typed]
    return [(" ".join(shown) or "as given", engine)]


def reference_options(engine: EngineOptions) -> EngineOptions:
    """The reference: the model's own dtype, unquantized weights in both phases, KV in the model's dtype."""
    config = engine.config
    return engine.replace(weights=config.weights if config.weights_dir else "bf16", prefill_weights="bf16",
                          decode_weights="bf16", int4_all=False, kv_dtype="auto", typed=frozenset())


def identity(options: EngineOptions, unquantized: bool) -> tuple[str | bool, ...]:
    """What decides a configuration's numbers here (everything else is shared): configurations with equal
    identities run once. In an unquantized checkpoint, `auto` weights are the `bf16` ones."""
    phases = options.config.phase_weights
    if unquantized:
        phases = tuple("bf16" if phase == "auto" else phase for phase in phases)
    kv_dtype = options.config.resolved_kv_dtype
    return *phases, options.config.int4_all, kv_dtype, options.config.kv_layout if kv_dtype == "fp8" else ""


def candidate(name: str, model: str, options: EngineOptions, unquantized: bool) -> Candidate:
    from nano.evaluate import Candidate
    from nano.llm import LLM

    def build() -> LLM:
        llm = options.build(model)
        assert isinstance(llm, LLM)   # eval offers no --disagg
        return llm
    return Candidate(name, build, identity(options, unquantized))


def held_out_text(text: Path | None) -> Text:
    """--text FILE, or the text that ships with the trained stand-ins."""
    from nano.evaluate import HELDOUT_TEXT, read_text
    if text is None and not HELDOUT_TEXT.is_file():
        raise NanoError(f"no held-out text at {HELDOUT_TEXT} (it ships with the trained stand-ins); give one with "
                        f"--text FILE")
    return read_text(text or HELDOUT_TEXT, f"--text {text}" if text else str(HELDOUT_TEXT))


def run_eval(model: str, source: Text, reference: EngineOptions, configurations: list[tuple[str, EngineOptions]],
             settings: Settings, compared: bool, plot: Path | None = None) -> Report:
    """Check that the model takes every configuration and the settings (nothing loads), then measure them all
    against the reference, showing the plan and the progress (cli/progress.py); warn of intervals from too few
    windows or prompts. Unless `compared` (--compare named them), a configuration that is the reference is not
    set against itself: the reference is measured alone, and a `plot` (which draws configurations against the
    reference) is refused before anything runs."""
    from nano.evaluate import FEW_BLOCKS, evaluate
    from nano.llm import resolve_config

    from .progress import EvalProgress, Progress

    for options in (reference, *(options for _, options in configurations)):
        options.check_model(model)
    resolved, config = resolve_config(model, reference.config.weights_dir)
    settings.check_model(config.max_position_embeddings)
    err.print(resolved.label, markup=False)   # what runs, first (on stderr, docs/cli.md)
    unquantized = config.quantization_config is None
    base = candidate("reference", model, reference, unquantized)
    candidates = [candidate(name, model, options, unquantized) for name, options in configurations]
    if not compared:
        candidates = [c for c in candidates if c.key != base.key]
    if plot is not None and not candidates:
        raise UsageError(f"--plot {plot} draws configurations against the reference, and these flags run the "
                         f"reference alone: add --compare kv-dtype=bf16,fp8 (or weights=…, policy=…)")
    with Progress() as progress:
        report = evaluate(source, base, candidates, settings, EvalProgress(progress))
    for windows in report.contexts:
        if windows.windows < FEW_BLOCKS:
            warn(f"--context {windows.context}: {windows.windows} windows; an interval from fewer than "
                 f"{FEW_BLOCKS} is too narrow (give a longer text, or a larger --max-tokens)")
    if report.configurations and settings.prompts < FEW_BLOCKS:
        warn(f"--prompts {settings.prompts}: an interval from fewer than {FEW_BLOCKS} prompts is too narrow")
    return report


# ---- what the report says ----------------------------------------------------------------------------------------
def value(figure: Estimate | Delta | None, fmt: Callable[[float], str]) -> str:
    return "–" if figure is None else fmt(figure.value)


def interval(figure: Estimate | Delta | None, fmt: Callable[[float], str]) -> str:
    return "–" if figure is None else f"[{fmt(figure.low)}, {fmt(figure.high)}]"


CONTEXT_ROWS: list[tuple[str, str, Callable[[float], str]]] = [   # (label, ContextFigures field, format)
    ("bits per byte", "bits_per_byte", lambda v: f"{v:.4f}"),
    ("Δ bits per byte", "delta_bits_per_byte", lambda v: f"{v:+.4f}"),
    ("top-1 accuracy %", "top1_accuracy", lambda v: f"{100 * v:.2f}"),
    ("Δ top-1 accuracy, points", "delta_top1_accuracy", lambda v: f"{100 * v:+.2f}"),
    ("KL mean, nats/token", "kl_mean", lambda v: f"{v:.2e}"),
    ("KL p99, nats/token", "kl_p99", lambda v: f"{v:.2e}"),
    ("top-1 agreement %", "top1_agreement", lambda v: f"{100 * v:.2f}"),
]


def side_by_side(names: list[str]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    return table


def context_title(report: Report, i: int) -> str:
    windows = report.contexts[i]
    return (f"context {windows.context:,} tokens · {windows.windows:,} windows · {windows.tokens:,} predicted tokens "
            f"· {windows.bytes:,} bytes")


def context_table(report: Report, i: int) -> Table:
    """A column per configuration, the reference first; a row no configuration has (the comparisons, when the
    reference is measured alone) is left out."""
    runs = [report.reference, *report.configurations]
    table = side_by_side([run.name for run in runs])
    for label, field, fmt in CONTEXT_ROWS:
        figures = [getattr(run.contexts[i], field) for run in runs]
        if all(figure is None for figure in figures):
            continue
        table.add_row(label, *(value(figure, fmt) for figure in figures))
        table.add_row("  95% interval", *(interval(figure, fmt) for figure in figures), style="dim")
        if field.startswith("delta_"):
            table.add_row("  verdict", *("–" if f is None else f.verdict for f in figures))
    return table


def generation_title(report: Report) -> str:
    settings = report.settings
    return (f"greedy continuations · {settings.prompts} prompts of {settings.prompt_tokens} tokens from the text · "
            f"{settings.gen_tokens} tokens each")


def generation_table(report: Report) -> Table:
    settings = report.settings
    table = side_by_side([r.name for r in report.configurations])
    runs = [run.generation for run in report.configurations]
    table.add_row("tokens until the first difference from the reference: median",
                  *(value(run.median, lambda v: f"{v:g}") for run in runs))
    table.add_row("  95% interval", *(interval(run.median, lambda v: f"{v:g}") for run in runs), style="dim")
    table.add_row("  quartiles (25%, 75%)", *(f"{run.quartiles[0]:g}, {run.quartiles[1]:g}" for run in runs))
    table.add_row("  identical throughout", *(f"{run.identical} of {settings.prompts}" for run in runs))
    return table


def report_document(model: str, report: Report, reference: EngineOptions,
                    configurations: list[tuple[str, EngineOptions]]) -> dict[str, Any]:
    """What --json prints, --output writes and --plot draws: the report, the device, each configuration's engine
    settings and the environment."""
    import torch
    return {"model": model, **report.as_dict(), "measured_on": device_name(torch.device(report.device)),
            "engine": {"reference": reference.as_dict(),
                       **{name: options.as_dict() for name, options in configurations
                          if any(run.name == name for run in report.configurations)}},
            "environment": environment()}


def print_report(report: Report) -> None:
    """The text, one table per context, the continuations' table and a note on stdout (titles as lines of their
    own, so that a narrow table does not break them); alone, a hint on stderr."""
    import torch
    text, settings = report.text, report.settings
    tokens = (f"{text.tokens:,} tokens, the first {text.evaluated_tokens:,} evaluated" if text.tokens is not None
              else f"read only as far as used: {text.evaluated_tokens:,} tokens evaluated")
    out.print(f"text: {text.path} · {text.bytes:,} bytes · {tokens}", markup=False)
    for i in range(len(report.contexts)):
        out.print(context_title(report, i), markup=False)
        out.print(context_table(report, i))
    if report.configurations:
        out.print(generation_title(report), markup=False)
        out.print(generation_table(report))
    setup = report.reference.setup
    notes = [f"Measured here on {device_name(torch.device(report.device))}. Intervals: bootstrap over windows"
             + (f" (prompts for the continuations), {settings.resamples:,} resamples, seed {settings.seed}; each Δ "
                f"resamples the same windows for both sides. KL is KL(reference ‖ configuration) per predicted "
                f"token." if report.configurations else
                f", {settings.resamples:,} resamples, seed {settings.seed}.")
             + f" Reference: weights {setup['prefill_weights']}, KV {setup['kv_dtype']}, {setup['dtype']}"
             + (f" (matmuls in {setup['matmuls']}: docs/bench.md)." if setup["matmuls"] != setup["dtype"] else ".")]
    if any(run.setup["prefill_weights"] != run.setup["decode_weights"] for run in report.configurations):
        notes.append("Teacher-forced figures run the prefill weights (scoring is prefill); a different decode "
                     "format shows only in the greedy continuations.")
    out.print(" ".join(notes), style="dim", markup=False)
    if not report.configurations:
        err.print(ALONE_HINT, style="dim", markup=False)


# ---- the command -------------------------------------------------------------------------------------------------
@engine_flags(skip=("max_running", "disagg", "prefill_kv_dtype", "decode_kv_dtype", "transport"))
def eval(  # noqa: A001  (the command's name: `nano eval`)
    model: Model,
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Held-out UTF-8 text (default: the text that ships with the trained stand-ins, "
                             "nano/standins/heldout.txt).", show_default=False)] = None,
    contexts: Annotated[str, typer.Option(
        "--context", metavar="N,N,…", help="Window sizes in tokens; each evaluates non-overlapping windows of "
                                           "that many tokens.")] = "256,1024",
    max_tokens: Annotated[int, typer.Option(metavar="N", min=1, max=MAX_TOKENS, help="Most tokens predicted per "
                                            "context, from the start of the text.")] = 16384,
    prompts: Annotated[int, typer.Option(metavar="N", min=2, help="Greedy continuations: prompts cut from the "
                                                                  "evaluated tokens.")] = 16,
    prompt_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="Tokens per prompt.")] = 64,
    gen_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="Tokens each continuation generates.")] = 64,
    compare: Annotated[str | None, typer.Option(
        metavar="KEY=A,B", help="Configurations side by side, each against the reference: kv-dtype=bf16,fp8 · "
                                "weights=bf16,fp8,int4 · policy=bf16/int4,fp8/int4 (prefill/decode formats).")
    ] = None,
    seed: Annotated[int, typer.Option(metavar="N", **SEED_RANGE, help="Seed for the bootstrap.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object instead of the "
                                                         "tables.")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="Also write the JSON report to FILE.")] = None,
    plot: PlotFile = None,
    *,
    engine: EngineOptions,
) -> None:
    """Measure what a KV dtype or a weight format costs in accuracy, teacher-forced over held-out text.

    For each context: bits per byte, top-1 accuracy, and against the reference (the model's own dtype,
    unquantized weights, KV in the model's dtype) the per-token KL divergence (mean, p99) and top-1 agreement;
    then how long greedy continuations stay identical to the reference's. Every figure has a 95% bootstrap
    interval over windows; each delta gets a verdict: within noise, better or worse."""
    with user_errors():
        windows = parse_contexts(contexts)
        configurations = configurations_of(compare, engine)
        if output is not None:
            check_output_path("--output", output)
        if plot is not None:
            check_plot(plot)
        reference = reference_options(engine)
        reference.check(model)   # the model's name: the command line is checked before torch loads
        from nano.evaluate import Settings   # (its checks are the flags' own: they pass here)
        settings = Settings(windows, max_tokens, prompts, prompt_tokens, gen_tokens, seed=seed)
        source = held_out_text(text)
        report = run_eval(model, source, reference, configurations, settings, compare is not None, plot)
        document = report_document(model, report, reference, configurations)
        if as_json:
            typer.echo(json.dumps(document))
        else:
            print_report(report)
        if output is not None:
            write_report("--output", output, document)
        if plot is not None:
            save(eval_chart(document), plot)
