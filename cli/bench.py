"""`nano bench MODEL --concurrency 64`: an offline load generator over the engine.

Random prompts (seeded), at most `--concurrency` requests in flight, `--num-prompts` in all (default 5×
concurrency, the usual rule so that the run is not all ramp-up and drain); `--shared-prefix N` starts every prompt
with the same N tokens, `--multi-turn T` makes each prompt a conversation of T turns. A warm-up of prompts of its
own runs first and the counters restart after it. The figures (TTFT, TPOT, ITL, E2E, throughput, the engine's
counters, the prefix cache's) are loadgen.py's.
Tables go to stdout, live progress to stderr; `--json` prints every figure (with versions, machine and config) as
one JSON object on stdout instead, and `--output FILE` writes it to a file.
`--compare KEY=A,B`, `--sweep-concurrency`, `--disagg` and `--reproduce-blog` (blog.py) run several
configurations back to back in this one process and print them side by side, with ratios measured in the same run.
"""
from __future__ import annotations

import dataclasses
import functools
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

COMPARE_KEYS = {"kv-dtype": "kv_dtype", "weights": "weights", "integrity": "integrity", "prefix-cache": "prefix_cache"}
ON_OFF_KEYS = ("integrity", "prefix-cache")     # --compare keys that take on,off


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


Row = tuple[str, Callable[[dict[str, Any]], float | None], int]    # label, the figure (None: none), digits
LATENCY_ROWS: list[Row] = [(f"{metric.upper()} {stat} ms", lambda f, m=metric, s=stat: f["latency_ms"][m][s], 1)
                           for metric in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "median", "p95", "p99")]
SECTIONS: list[list[Row]] = [   # a table's rows, in sections; a row whose figure no run has is left out
    [("completed", lambda f: f["completed"], 0),
     ("failed", lambda f: f["failed"], 0)],
    [("duration s", lambda f: f["duration_s"], 2),
     ("requests/s", lambda f: f["requests_per_s"], 2),
     ("input tok/s", lambda f: f["input_tok_s"], 1),
     ("output tok/s", lambda f: f["output_tok_s"], 1),
     ("total tok/s", lambda f: f["total_tok_s"], 1)],
    [("peak running", lambda f: f["peak_running"], 0),
     ("preemptions", lambda f: f["preemptions"], 0),
     ("KV capacity tokens", lambda f: f["kv"]["capacity_tokens"], 0),
     ("KV peak tokens", lambda f: f["kv"]["peak_tokens"], 0)],
    [("prefill tokens computed", lambda f: f["prefix_cache"]["prefill_tokens"], 0),
     ("cached prompt tokens", lambda f: f["prefix_cache"]["cached_tokens"], 0),
     ("prefix hit rate %", lambda f: _percent(f["prefix_cache"]["hit_rate"]), 1)],
    LATENCY_ROWS,
    [("TTFT turn 1 median ms", lambda f: f["ttft_ms_by_turn"][0] if "ttft_ms_by_turn" in f else None, 1),
     ("TTFT last turn median ms", lambda f: f["ttft_ms_by_turn"][-1] if "ttft_ms_by_turn" in f else None, 1)],
    [("integrity checked", lambda f: f["integrity"]["checked"], 0),
     ("integrity mismatched", lambda f: f["integrity"]["mismatched"], 0),
     ("integrity aborted", lambda f: f["integrity"]["aborted"], 0),
     ("integrity % of step time", lambda f: 100 * f["integrity"]["share_of_step_time"], 2),
     ("KV transfers", lambda f: f.get("split", {}).get("transfers"), 0),
     ("KV moved MB", lambda f: f["split"]["bytes"] / 1e6 if "split" in f else None, 2),
     ("KV transfer ms (all)", lambda f: 1e3 * f["split"]["seconds"] if "split" in f else None, 1),
     ("KV transfer GB/s", lambda f: f.get("split", {}).get("gb_s"), 3),
     ("plain shm copy GB/s", lambda f: f.get("split", {}).get("plain_copy_gb_s"), 2),
     ("transfer % of plain copy", lambda f: 100 * f["split"]["share_of_plain_copy"] if "split" in f else None, 1)],
]


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


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
    for number, section in enumerate(SECTIONS):
        if len(runs) == 1 and section is LATENCY_ROWS:
            continue
        rows = [(label, [get(figures) for _, figures in runs], digits) for label, get, digits in section]
        rows = [row for row in rows if any(v is not None for v in row[1])]
        for index, (label, values, digits) in enumerate(rows):
            ratios = [_num(v / values[0], 3) if v is not None and values[0] else "–" for v in values[1:]]
            table.add_row(label, *(_num(v, digits) for v in values), *ratios,
                          end_section=index == len(rows) - 1 and number < len(SECTIONS) - 1)
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
        if key in ON_OFF_KEYS:
            if value not in ("on", "off"):
                raise UsageError(f"--compare {key}= takes on,off; got {value!r}")
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


def run_variant(model: str, engine_options: EngineOptions,
                workloads_for: Callable[[int, int], tuple[Workload, Workload]], concurrencies: list[int], name: str
                ) -> list[dict[str, Any]]:
    """Build one configuration's engine, measure it at each concurrency (after that level's warm-up), shut it
    down."""
    front = engine_options.build(model)
    if isinstance(front, SplitLLM):
        err.print(f"{name}: prefill worker pid {front.info['prefill']['pid']}, decode worker pid "
                  f"{front.info['decode']['pid']}, KV over {front.transport}", style="dim", markup=False)
    try:
        runs = []
        for index, level in enumerate(concurrencies):
            warm, measured = workloads_for(index, level)
            runs.append(measure(front, measured, level, warm, f"{name} · concurrency {level}"))
        return runs
    finally:
        front.close()   # the split's workers, or a tensor-parallel model's other ranks


def run_configurations(model: str, base: EngineOptions, *, concurrency: int, num_prompts: int | None,
                       inputs: tuple[int, int], outputs: tuple[int, int], shared_prefix: int, turns: int,
                       seed: int, warmup: int, compare: str | None, sweep_concurrency: str | None
                       ) -> dict[str, Any]:
    """One configuration, the --compare variants, or the --disagg pair, each at one concurrency or at every
    --sweep-concurrency level; prints the tables and returns the runs."""
    variants = (parse_compare(compare, base) if compare is not None else
                [("split", base), ("single process", base.single_process_twin())] if base.disagg else
                [(f"weights {base.weights}, KV {base.kv_dtype}", base)])
    sweep = sweep_concurrency is not None
    levels = parse_concurrencies(sweep_concurrency) if sweep else [concurrency]
    config = resolve_config(model, base.weights_dir)[1]
    longest = shared_prefix + turns * (inputs[1] + outputs[1])     # the last turn's prompt and output
    if longest > config.max_position_embeddings:
        lengths = "--input-len + --output-len" if turns == 1 else "--multi-turn × (--input-len + --output-len)"
        raise NanoError(f"{'--shared-prefix + ' if shared_prefix else ''}{lengths} reach {longest} tokens but the "
                        f"model's context is {config.max_position_embeddings}")

    def workloads_for(index: int, level: int) -> tuple[Workload, Workload]:
        """The warm-up and the measured workload at the index-th level. One engine runs them all, and its prefix
        cache would hold prompts it has run, so each draws prompts of its own: the first level the seed's plain
        draws, the warm-ups (single turns) and later levels other draws. All share the one --shared-prefix."""
        draw = functools.partial(Workload.random, input_len=inputs, output_len=outputs, vocab_size=config.vocab_size,
                                 seed=seed, shared_prefix=shared_prefix)
        return (draw(min(warmup, level), stream="warm-up"),
                draw(num_prompts or 5 * level, turns=turns, stream=f"level {index}" if index else ""))

    runs = {name: run_variant(model, variant, workloads_for, levels, name) for name, variant in variants}
    count = num_prompts or ("5 × concurrency" if sweep else 5 * concurrency)
    span = lambda bounds: str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"
    describe = " · ".join([model, f"{count} prompts" if turns == 1 else f"{count} conversations of {turns} turns",
                           *([f"shared prefix {shared_prefix}"] if shared_prefix else []), f"input {span(inputs)}",
                           f"output {span(outputs)}", f"seed {seed}"])
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
        metavar="N", min=1, help="Prompts in all, or conversations with --multi-turn (default: 5 × concurrency)."
    )] = None,
    input_len: Annotated[str, typer.Option(metavar="N|LO-HI", help="Prompt tokens: fixed, or uniform in a range."
                                           )] = "128",
    output_len: Annotated[str, typer.Option(metavar="N|LO-HI", help="Tokens to generate per request (greedy, "
                                            "no early stop): fixed, or uniform in a range.")] = "32",
    shared_prefix: Annotated[int | None, typer.Option(
        metavar="N", min=1, help="Start every prompt with the same N random tokens (seeded), then its own "
                                 "--input-len tokens: a workload for the prefix cache.")] = None,
    multi_turn: Annotated[int, typer.Option(
        metavar="T", min=1, help="Make each prompt a conversation of T turns: turn k+1's prompt is turn k's prompt "
                                 "and reply plus --input-len new tokens, sent when turn k has finished. Every turn "
                                 "is one request in the figures.")] = 1,
    seed: Annotated[int, typer.Option(
        metavar="N", **SEED_RANGE, help="Seed for the random prompts and lengths.")] = 0,
    warmup: Annotated[int, typer.Option(
        metavar="N", min=0, help="Prompts run (and discarded) before measuring: single turns drawn apart from "
                                 "the measured prompts, starting with the --shared-prefix if any.")] = 4,
    compare: Annotated[str | None, typer.Option(
        metavar="KEY=A,B", help="Run each value back to back and print them side by side with ratios: "
                                "kv-dtype=bf16,fp8 · weights=fp8,int4 · integrity=on,off · prefix-cache=on,off."
    )] = None,
    sweep_concurrency: Annotated[str | None, typer.Option(
        metavar="N,N,…", help="Measure at each concurrency (e.g. 1,8,16,32,64); prints throughput and latency "
                              "against concurrency.")] = None,
    reproduce_blog: Annotated[bool, typer.Option(
        "--reproduce-blog", help="Reproduce the shape of the published results at small scale: FP8 vs BF16 KV "
                                 "under one budget, INT4 vs resident FP8 weights for decode and prefill, integrity "
                                 "on vs off; published figures beside measured ones. Its workloads are fixed, and it "
                                 "runs without the prefix cache (its runs repeat the same prompts).")
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
                # its experiments run the same prompts again on one engine: a prefix cache would turn the repeats
                # into hits, which the published results never measured
                engine = dataclasses.replace(engine, prefix_cache=False)
                report = blog.reproduce(model, engine, seed)
            else:
                report = run_configurations(model, engine, concurrency=concurrency, num_prompts=num_prompts,
                                            inputs=inputs, outputs=outputs, shared_prefix=shared_prefix or 0,
                                            turns=multi_turn, seed=seed, warmup=warmup, compare=compare,
                                            sweep_concurrency=sweep_concurrency)
        report = {"model": model, "label": resolve_config(model, engine.weights_dir)[0].label,   # which model ran
                  "config": {"concurrency": concurrency, "num_prompts": num_prompts,
                                             "input_len": input_len, "output_len": output_len,
                                             "shared_prefix": shared_prefix, "multi_turn": multi_turn, "seed": seed,
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
               "reproduce_blog": ("concurrency", "num_prompts", "input_len", "output_len", "shared_prefix",
                                  "multi_turn", "warmup")}
    for name in ignored.get(modes[0] if modes else "", ()):
        if name in typed:
            raise UsageError(f"{flag(name)} does nothing with {flag(modes[0])}")
    if "reproduce_blog" in typed and "prefix_cache" in typed and engine.prefix_cache:
        raise UsageError("--prefix-cache does nothing with --reproduce-blog (its experiments repeat the same prompts "
                         "on one engine, so they run without the cache)")
