"""`nano eval MODEL`: what FP8 KV and INT4/FP8 weights cost in accuracy, teacher-forced over held-out text.

The flags become configurations (the engine flags as given, or one per `--compare` value) and a reference (the
model's own dtype, unquantized weights, KV in the model's dtype). nano/evaluate.py measures them; this module
prints one table per context and one for the greedy continuations, the configurations side by side, each figure
with its interval (or, with --json, the report as one JSON object; --output also writes it to a file).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nano.errors import NanoError
from nano.evaluate import (FEW_BLOCKS, HELDOUT_TEXT, Candidate, Delta, Estimate, Report, Settings, evaluate,
                           read_text)
from nano.kv import KV_DTYPES
from nano.llm import LLM, default_device, default_dtype, model_kv_dtype, resolve_config
from nano.quant import WEIGHT_FORMATS

from .console import UsageError, check_output_path, err, out, user_errors, warn, write_report
from .machine import device_name, environment
from .options import SEED_RANGE, EngineOptions, Model, engine_flags

COMPARE_KEYS = ("kv-dtype", "weights", "policy")
# the engine fields each --compare key sets in every configuration (typing one of their flags too does nothing)
COMPARED_FIELDS = {"kv-dtype": ("kv_dtype",), "weights": ("weights", "prefill_weights", "decode_weights"),
                   "policy": ("weights", "prefill_weights", "decode_weights")}


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


def parse_compare(compare: str | None, engine: EngineOptions) -> list[tuple[str, EngineOptions]]:
    """The configurations to measure: 'kv-dtype=bf16,fp8' -> [("kv-dtype=bf16", options), ("kv-dtype=fp8", ...)];
    without --compare, the engine flags as given. Each is checked."""
    if compare is None:
        engine.check()
        shown = [f"{name.replace('_', '-')}={getattr(engine, name)}" for name in
                 ("weights", "prefill_weights", "decode_weights", "kv_dtype", "dtype") if name in engine.typed]
        return [(" ".join(shown) or "as given", engine)]
    key, _, listed = compare.partition("=")
    if key not in COMPARE_KEYS or not listed:
        raise UsageError(f"--compare takes KEY=A,B,… with KEY one of {', '.join(COMPARE_KEYS)}; got {compare!r}")
    values = listed.split(",")
    if "" in values or len(set(values)) != len(values):
        raise UsageError(f"--compare {compare}: a value is empty or listed twice")
    for name in COMPARED_FIELDS[key]:
        if name in engine.typed and not (name == "weights" and engine.weights_dir):
            raise UsageError(f"--{name.replace('_', '-')} does nothing with --compare {key}=…, which sets it in "
                             f"every configuration")
    variants = []
    for value in values:
        if key == "kv-dtype":
            if value not in KV_DTYPES:
                raise UsageError(f"--compare kv-dtype= takes {', '.join(KV_DTYPES)}; got {value!r}")
            variant = dataclasses.replace(engine, kv_dtype=value)
        else:
            prefill, slash, decode = value.partition("/") if key == "policy" else (value, "/", value)
            if not slash or prefill not in WEIGHT_FORMATS or decode not in WEIGHT_FORMATS:
                shape = "PREFILL/DECODE formats like bf16/int4" if key == "policy" else "weight formats"
                raise UsageError(f"--compare {key}= takes {shape} ({', '.join(WEIGHT_FORMATS)}); got {value!r}")
            variant = dataclasses.replace(engine, prefill_weights=prefill, decode_weights=decode,
                                          int4_all=engine.int4_all and "int4" in (prefill, decode))
        variants.append((f"{key}={value}", variant))
    if engine.int4_all and not any(variant.int4_all for _, variant in variants):
        raise UsageError(f"--int4-all needs int4 weights, and no value of --compare {compare} has them")
    for _, variant in variants:
        variant.check()
    return variants


def reference_options(engine: EngineOptions) -> EngineOptions:
    """The reference: the model's own dtype, unquantized weights in both phases, KV in the model's dtype."""
    return dataclasses.replace(engine, weights=engine.weights if engine.weights_dir else "bf16",
                               prefill_weights="bf16", decode_weights="bf16", int4_all=False, kv_dtype="auto",
                               typed=frozenset())


def identity(options: EngineOptions, unquantized: bool) -> tuple[str | bool, ...]:
    """What decides a configuration's numbers here (everything else is shared): configurations with equal
    identities run once. In an unquantized checkpoint, `auto` weights are the `bf16` ones."""
    fmt = "auto" if options.weights_dir else options.weights
    phases = [options.prefill_weights or fmt, options.decode_weights or fmt]
    if unquantized:
        phases = ["bf16" if phase == "auto" else phase for phase in phases]
    model_kv = model_kv_dtype(options.dtype or default_dtype(default_device()))
    return *phases, options.int4_all, model_kv if options.kv_dtype == "auto" else options.kv_dtype


def candidate(name: str, model: str, options: EngineOptions, unquantized: bool) -> Candidate:
    def build() -> LLM:
        llm = options.build(model)
        assert isinstance(llm, LLM)   # eval offers no --disagg
        return llm
    return Candidate(name, build, identity(options, unquantized))


# ---- what the report says ---------------------------------------------------------------------------------------
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


def side_by_side(title: str, names: list[str]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left")
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    return table


def context_table(report: Report, i: int) -> Table:
    windows = report.contexts[i]
    runs = [report.reference, *report.configurations]
    table = side_by_side(f"context {windows.context:,} tokens · {windows.windows:,} windows · {windows.tokens:,} "
                         f"predicted tokens · {windows.bytes:,} bytes", [run.name for run in runs])
    for label, field, fmt in CONTEXT_ROWS:
        figures = [getattr(run.contexts[i], field) for run in runs]
        table.add_row(label, *(value(figure, fmt) for figure in figures))
        table.add_row("  95% interval", *(interval(figure, fmt) for figure in figures), style="dim")
        if field.startswith("delta_"):
            table.add_row("  verdict", *("–" if f is None else f.verdict for f in figures))
    return table


def generation_table(report: Report) -> Table:
    settings = report.settings
    table = side_by_side(f"greedy continuations · {settings.prompts} prompts of {settings.prompt_tokens} tokens "
                         f"from the text · {settings.gen_tokens} tokens each", [r.name for r in report.configurations])
    runs = [run.generation for run in report.configurations]
    table.add_row("tokens until the first difference from the reference: median",
                  *(value(run.median, lambda v: f"{v:g}") for run in runs))
    table.add_row("  95% interval", *(interval(run.median, lambda v: f"{v:g}") for run in runs), style="dim")
    table.add_row("  quartiles (25%, 75%)", *(f"{run.quartiles[0]:g}, {run.quartiles[1]:g}" for run in runs))
    table.add_row("  identical throughout", *(f"{run.identical} of {settings.prompts}" for run in runs))
    return table


def print_report(report: Report) -> None:
    text, settings = report.text, report.settings
    out.print(report.label, markup=False)
    out.print(f"text: {text.path} · {text.bytes:,} bytes · {text.tokens:,} tokens, the first "
              f"{text.evaluated_tokens:,} evaluated", markup=False)
    for i in range(len(report.contexts)):
        out.print(context_table(report, i))
    out.print(generation_table(report))
    setup = report.reference.setup
    notes = [f"Measured here on {device_name(torch.device(report.device))}. Intervals: bootstrap over windows "
             f"(prompts for the continuations), {settings.resamples:,} resamples, seed {settings.seed}; each Δ "
             f"resamples the same windows for both sides. KL is KL(reference ‖ configuration) per predicted token. "
             f"Reference: weights {setup['prefill_weights']}, KV {setup['kv_dtype']}, {setup['dtype']}"
             + (f" (matmuls in {setup['matmuls']}: docs/bench.md)." if setup["matmuls"] != setup["dtype"] else ".")]
    if any(run.setup["prefill_weights"] != run.setup["decode_weights"] for run in report.configurations):
        notes.append("Teacher-forced figures run the prefill weights (scoring is prefill); a different decode "
                     "format shows only in the greedy continuations.")
    out.print(" ".join(notes), style="dim", markup=False)


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
    max_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="Most tokens predicted per context (from "
                                                                     "the start of the text).")] = 16384,
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
    *,
    engine: EngineOptions,
) -> None:
    """Measure what a KV dtype or a weight format costs in accuracy, teacher-forced over held-out text.

    For each context: bits per byte, top-1 accuracy, and against the reference (the model's own dtype,
    unquantized weights, KV in the model's dtype) the per-token KL divergence (mean, p99) and top-1 agreement;
    then how long greedy continuations stay identical to the reference's. Every figure has a 95% bootstrap
    interval over windows; each delta gets a verdict: within noise, better or worse."""
    with user_errors():
        settings = Settings(parse_contexts(contexts), max_tokens, prompts, prompt_tokens, gen_tokens, seed=seed)
        configurations = parse_compare(compare, engine)
        if output is not None:
            check_output_path("--output", output)
        if text is None and not HELDOUT_TEXT.is_file():
            raise NanoError(f"no held-out text at {HELDOUT_TEXT} (it ships with the trained stand-ins); give one "
                            f"with --text FILE")
        source = read_text(text or HELDOUT_TEXT, f"--text {text}" if text else str(HELDOUT_TEXT))
        reference = reference_options(engine)
        for options in (reference, *(options for _, options in configurations)):
            options.check_model(model)
        config = resolve_config(model, engine.weights_dir)[1]
        settings.check_model(config.max_position_embeddings)
        unquantized = config.quantization_config is None
        with Progress(TextColumn("evaluating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("evaluating", total=None)
            report = evaluate(source, candidate("reference", model, reference, unquantized),
                              [candidate(name, model, options, unquantized) for name, options in configurations],
                              settings,
                              lambda done, total: bar.update(task, completed=done, total=total))
        for windows in report.contexts:
            if windows.windows < FEW_BLOCKS:
                warn(f"--context {windows.context}: {windows.windows} windows; an interval from fewer than "
                     f"{FEW_BLOCKS} is too narrow (give a longer text, or a larger --max-tokens)")
        if settings.prompts < FEW_BLOCKS:
            warn(f"--prompts {settings.prompts}: an interval from fewer than {FEW_BLOCKS} prompts is too narrow")
        document: dict[str, Any] = {"model": model, **report.as_dict(),
                                    "measured_on": device_name(torch.device(report.device)),
                                    "engine": {"reference": reference.as_dict(),
                                               **{name: options.as_dict() for name, options in configurations}},
                                    "environment": environment()}
        if as_json:
            typer.echo(json.dumps(document))
        else:
            print_report(report)
        if output is not None:
            write_report("--output", output, document)
