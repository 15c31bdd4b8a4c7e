"""`nano bench MODEL --concurrency 64`: an offline load generator over the engine.

Random prompts (seeded), at most `--concurrency` requests in flight, `--num-prompts` in all (default 5×
concurrency, the usual rule so that the run is not all ramp-up and drain). A warm-up runs first and the counters
restart after it. The figures (TTFT, TPOT, ITL, E2E, throughput, the engine's counters) are loadgen.py's.
Tables go to stdout, live progress to stderr; `--json` prints every figure (with versions, machine and config) as
one JSON object on stdout instead, and `--output FILE` writes it to a file.
`--compare KEY=A,B`, `--sweep-concurrency`, `--disagg` and `--reproduce-blog` (blog.py) run several
configurations back to back in this one process and print them side by side, with ratios measured in the same run.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from nano.disagg import SplitLLM
from nano.errors import NanoError
from nano.llm import resolve_config

from . import blog
from .console import UsageError, check_output_path, err, out, tables_on_stderr, user_errors, write_report
from .loadgen import Workload, measure
from .machine import environment
from .options import SEED_RANGE, EngineOptions, Model, engine_flags, typed_flags

COMPARE_KEYS = {"kv-dtype": "kv_dtype", "weights": "weights", "integrity": "integrity"}


# ---- flags ---------------------------------------------------------------------------------------------------
def parse_range(flag: str, text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-256' -> (64, 256): lengths drawn uniformly from the range."""
    low, dash, high = text.partition("-")
    if not low.strip().isdigit() or (dash and not high.strip().isdigit()):
        raise UsageError(f"{flag} takes a length or a range like 64-256, not {text!r}")
    bounds = int(low), int(high or low)
    if not 1 <= bounds[0] <= bounds[1]:
        raise UsageError(f"{flag} {text}: lengths must be >= 1 and the range ascending")
    return bounds



# ---- what a report says --------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


ROWS: list[tuple[str, Callable[[dict[str, Any]], float | None], int]] = [
    ("completed", lambda f: f["completed"], 0),
    ("failed", lambda f: f["failed"], 0),
    ("duration s", lambda f: f["duration_s"], 2),
    ("requests/s", lambda f: f["requests_per_s"], 2),
    ("input tok/s", lambda f: f["input_tok_s"], 1),
    ("output tok/s", lambda f: f["output_tok_s"], 1),
    ("total tok/s", lambda f: f["total_tok_s"], 1),
    ("peak running", lambda f: f["peak_running"], 0),
    ("preemptions", lambda f: f["preemptions"], 0),
    ("KV capacity tokens", lambda f: f["kv"]["capacity_tokens"], 0),
    ("KV peak tokens", lambda f: f["kv"]["peak_tokens"], 0),
    *[(f"{metric.upper()} {stat} ms", lambda f, m=metric, s=stat: f["latency_ms"][m][s], 1)
      for metric in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "median", "p95", "p99")],
    ("integrity checked", lambda f: f["integrity"]["checked"], 0),
    ("integrity mismatched", lambda f: f["integrity"]["mismatched"], 0),
    ("integrity aborted", lambda f: f["integrity"]["aborted"], 0),
    ("integrity % of step time", lambda f: 100 * f["integrity"]["share_of_step_time"], 2),
    ("KV transfers", lambda f: f.get("split", {}).get("transfers"), 0),
    ("KV moved MB", lambda f: f["split"]["bytes"] / 1e6 if "split" in f else None, 2),
    ("KV transfer ms (all)", lambda f: 1e3 * f["split"]["seconds"] if "split" in f else None, 1),
    ("KV transfer GB/s", lambda f: f.get("split", {}).get("gb_s"), 3),
    ("plain shm copy GB/s", lambda f: f.get("split", {}).get("plain_copy_gb_s"), 2),
    ("transfer % of plain copy", lambda f: 100 * f["split"]["share_of_plain_copy"] if "split" in f else None, 1),
]


def latency_table(figures: dict[str, Any]) -> Table:
    """One run's latencies: a row per metric, a column per statistic."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("latency ms", "mean", "median", "p95", "p99"):
        table.add_column(name, justify="left" if name == "latency ms" else "right")
    for metric, stats in figures["latency_ms"].items():
        table.add_row(metric.upper(), *(_num(stats[s]) for s in ("mean", "median", "p95", "p99")))
    return table


def runs_table(runs: list[tuple[str, dict[str, Any]]], title: str) -> Table:
    """One column per run; with two or more, a ratio column for each run against the first (one run: the
    latencies go in `latency_table`)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left")
    table.add_column("")
    for name, _ in runs:
        table.add_column(name, justify="right")
    for name, _ in runs[1:]:
        table.add_column(f"{name} / {runs[0][0]}", justify="right", style="bold")
    for label, get, digits in ROWS:
        values = [get(figures) for _, figures in runs]
        if all(v is None for v in values) or (len(runs) == 1 and label.split()[0] in ("TTFT", "TPOT", "ITL", "E2E")):
            continue
        ratios = [_num(v / values[0], 3) if v is not None and values[0] else "–" for v in values[1:]]
        table.add_row(label, *(_num(v, digits) for v in values), *ratios,
                      end_section=label in ("failed", "total tok/s", "KV peak tokens", "E2E p99 ms"))
    return table


def sweep_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left")
    columns = [("conc", lambda f: f["concurrency"], 0), ("req/s", lambda f: f["requests_per_s"], 2),
               ("out tok/s", lambda f: f["output_tok_s"], 1), ("all tok/s", lambda f: f["total_tok_s"], 0),
               ("TTFT p50", lambda f: f["latency_ms"]["ttft"]["median"], 0),
               ("TTFT p95", lambda f: f["latency_ms"]["ttft"]["p95"], 0),
               ("TPOT p50", lambda f: f["latency_ms"]["tpot"]["median"], 1),
               ("ITL p95", lambda f: f["latency_ms"]["itl"]["p95"], 1),
               ("peak", lambda f: f["peak_running"], 0), ("preempt", lambda f: f["preemptions"], 0)]
    for name, _, _ in columns:
        table.add_column(name, justify="right")
    for figures in rows:
        table.add_row(*(_num(get(figures), digits) for _, get, digits in columns))
    return table


# ---- configurations --------------------------------------------------------------------------------------------
def parse_compare(text: str, base: EngineOptions) -> list[tuple[str, EngineOptions]]:
    """'kv-dtype=bf16,fp8' -> [("kv-dtype=bf16", options with kv_dtype bf16), ("kv-dtype=fp8", ...)]."""
    key, _, values = text.partition("=")
    if key not in COMPARE_KEYS or not values:
        raise UsageError(f"--compare takes KEY=A,B with KEY one of {', '.join(COMPARE_KEYS)}; got {text!r}")
    variants = []
    for value in values.split(","):
        if key == "integrity":
            if value not in ("on", "off"):
                raise UsageError(f"--compare integrity= takes on,off; got {value!r}")
            setting: Any = value == "on"
        else:
            setting = value
        variant = dataclasses.replace(base, **{COMPARE_KEYS[key]: setting})
        variant.check()
        variants.append((f"{key}={value}", variant))
    if len(variants) < 2:
        raise UsageError(f"--compare needs at least two values, like {key}=A,B")
    return variants


def parse_concurrencies(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--sweep-concurrency takes numbers like 1,8,16,32,64; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError("--sweep-concurrency levels must be >= 1")
    return levels


def run_variant(model: str, engine_options: EngineOptions, workload_for: Callable[[int], Workload],
                concurrencies: list[int], warmup: int, name: str) -> list[dict[str, Any]]:
    """Build one configuration's engine, measure it at each concurrency, shut it down."""
    front = engine_options.build(model)
    if isinstance(front, SplitLLM):
        err.print(f"{name}: prefill worker pid {front.info['prefill']['pid']}, decode worker pid "
                  f"{front.info['decode']['pid']}, KV over {front.transport}", style="dim", markup=False)
    try:
        return [measure(front, workload_for(c), c, min(warmup, c), f"{name} · concurrency {c}")
                for c in concurrencies]
    finally:
        front.close()   # the split's workers, or a tensor-parallel model's other ranks


def run_configurations(model: str, base: EngineOptions, *, concurrency: int, num_prompts: int | None,
                       inputs: tuple[int, int], outputs: tuple[int, int], seed: int, warmup: int,
                       compare: str | None, sweep_concurrency: str | None) -> dict[str, Any]:
    """One configuration, the --compare variants, or the --disagg pair, each at one concurrency or at every
    --sweep-concurrency level; prints the tables and returns the runs."""
    variants = (parse_compare(compare, base) if compare is not None else
                [("split", base), ("single process", base.single_process_twin())] if base.disagg else
                [(f"weights {base.weights}, KV {base.kv_dtype}", base)])
    sweep = sweep_concurrency is not None
    levels = parse_concurrencies(sweep_concurrency) if sweep else [concurrency]
    config = resolve_config(model, base.weights_dir)[1]
    if inputs[1] + outputs[1] > config.max_position_embeddings:
        raise NanoError(f"--input-len + --output-len reach {inputs[1] + outputs[1]} tokens but the model's "
                        f"context is {config.max_position_embeddings}")

    def workload_for(level: int) -> Workload:
        return Workload.random(num_prompts or 5 * level, inputs, outputs, config.vocab_size, seed)

    runs = {name: run_variant(model, variant, workload_for, levels, warmup, name) for name, variant in variants}
    count = num_prompts or ("5 × concurrency" if sweep else 5 * concurrency)
    span = lambda bounds: str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"
    describe = f"{model} · {count} prompts · input {span(inputs)} · output {span(outputs)} · seed {seed}"
    if sweep:
        for name, _ in variants:
            out.print(sweep_table(runs[name], f"{name} · {describe} · latencies in ms; peak: most requests "
                                              f"running at once"))
    else:
        out.print(runs_table([(name, runs[name][0]) for name, _ in variants],
                             f"{describe} · concurrency {concurrency}"))
        if len(variants) == 1:
            out.print(latency_table(runs[variants[0][0]][0]))
    return {"mode": "sweep" if sweep else "compare" if len(variants) > 1 else "single",
            "runs": [{"name": name, "engine": variant.as_dict(), "results": runs[name]}
                     for name, variant in variants]}


@engine_flags()
def bench(
    context: typer.Context,
    model: Model,
    concurrency: Annotated[int, typer.Option(metavar="N", min=1, help="Most requests in flight at once.")] = 64,
    num_prompts: Annotated[int | None, typer.Option(
        metavar="N", min=1, help="Requests in all (default: 5 × concurrency).")] = None,
    input_len: Annotated[str, typer.Option(metavar="N|LO-HI", help="Prompt tokens: fixed, or uniform in a range."
                                           )] = "128",
    output_len: Annotated[str, typer.Option(metavar="N|LO-HI", help="Tokens to generate per request (greedy, "
                                            "no early stop): fixed, or uniform in a range.")] = "32",
    seed: Annotated[int, typer.Option(
        metavar="N", **SEED_RANGE, help="Seed for the random prompts and lengths.")] = 0,
    warmup: Annotated[int, typer.Option(
        metavar="N", min=0, help="Requests run (and discarded) before measuring.")] = 4,
    compare: Annotated[str | None, typer.Option(
        metavar="KEY=A,B", help="Run each value back to back and print them side by side with ratios: "
                                "kv-dtype=bf16,fp8 · weights=fp8,int4 · integrity=on,off.")] = None,
    sweep_concurrency: Annotated[str | None, typer.Option(
        metavar="N,N,…", help="Measure at each concurrency (e.g. 1,8,16,32,64); prints throughput and latency "
                              "against concurrency.")] = None,
    reproduce_blog: Annotated[bool, typer.Option(
        "--reproduce-blog", help="Reproduce the shape of the published results at small scale: FP8 vs BF16 KV "
                                 "under one budget, INT4 vs resident FP8 weights for decode and prefill, integrity "
                                 "on vs off; published figures beside measured ones. Its workloads are fixed.")
    ] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print every figure, with versions, machine and config, as one JSON object on stdout "
                       "(the tables go to stderr).")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="Also write that JSON object to FILE.")] = None,
    *,
    engine: EngineOptions,
) -> None:
    """Benchmark the engine under load: throughput, latency percentiles, peak concurrency, KV use.

    Also the integrity counters. With --disagg: the prefill/decode split beside one process, with KV transfer
    figures."""
    typed = typed_flags(context)
    with user_errors():
        check_modes(typed, engine)
        inputs, outputs = parse_range("--input-len", input_len), parse_range("--output-len", output_len)
        engine.check()
        if output is not None:
            check_output_path("--output", output)
        with tables_on_stderr(as_json):
            if reproduce_blog:
                report = blog.reproduce(model, engine, seed)
            else:
                report = run_configurations(model, engine, concurrency=concurrency, num_prompts=num_prompts,
                                            inputs=inputs, outputs=outputs, seed=seed, warmup=warmup,
                                            compare=compare, sweep_concurrency=sweep_concurrency)
        report = {"model": model, "label": resolve_config(model, engine.weights_dir)[0].label,   # which model ran
                  "config": {"concurrency": concurrency, "num_prompts": num_prompts,
                                             "input_len": input_len, "output_len": output_len, "seed": seed,
                                             "warmup": warmup, "engine": engine.as_dict()},
                  **report, "environment": environment()}
        if as_json:
            typer.echo(json.dumps(report))
        if output is not None:
            write_report("--output", output, report)


def check_modes(typed: frozenset[str], engine: EngineOptions) -> None:
    """One mode at a time, and no flag the mode ignores (one problem per message)."""
    modes = [name for name in ("compare", "sweep_concurrency", "reproduce_blog") if name in typed]
    flag = lambda name: "--" + name.replace("_", "-")
    if len(modes) > 1:
        raise UsageError(f"{flag(modes[0])} and {flag(modes[1])} cannot be combined; choose one")
    if engine.disagg and modes and modes[0] != "sweep_concurrency":
        raise UsageError(f"{flag(modes[0])} cannot be combined with --disagg (which compares the split with one "
                         f"process already)")
    ignored = {"sweep_concurrency": ("concurrency",),
               "reproduce_blog": ("concurrency", "num_prompts", "input_len", "output_len", "warmup")}
    for name in ignored.get(modes[0] if modes else "", ()):
        if name in typed:
            raise UsageError(f"{flag(name)} does nothing with {flag(modes[0])}")
