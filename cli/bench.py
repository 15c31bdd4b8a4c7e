"""`nano bench MODEL --concurrency 64`: an offline load generator over the engine, or, with `--base-url`, over
HTTP against a running OpenAI-compatible server (nano serve, vLLM, SGLang).

Random prompts (seeded), at most `--concurrency` requests in flight, `--num-prompts` in all (default 5×
concurrency, the usual rule so that the run is not all ramp-up and drain); `--shared-prefix N` starts every prompt
with the same N tokens, `--multi-turn T` makes each prompt a conversation of T turns. A warm-up of prompts of its
own runs first and the counters restart after it. The figures (TTFT, TPOT, ITL, E2E, throughput, the engine's
counters, the prefix cache's) are loadgen.py's.
Tables go to stdout, live progress to stderr; `--json` prints every figure (with versions, machine and config) as
one JSON object on stdout instead, and `--output FILE` writes it to a file.
`--compare KEY=A,B`, `--sweep-concurrency`, `--disagg` and `--reproduce-blog` (blog.py) run several
configurations back to back in this one process and print them side by side, with ratios measured in the same run.
`--request-rate R` makes the prompts arrive as a Poisson process (seeded) instead of all at once, still at most
`--concurrency` in flight. `--base-url URL` sends the same workloads to a server, streamed, and measures every
latency at the client (loadgen.py's `drive_http`); the engine's rows come from the server's /metrics when it is
nano's, and are "–" otherwise.
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.presets import PRESETS, RANDOM_SUFFIX, check_model_name
from nano.tokenizer import Tokenizer, load_tokenizer

from .console import UsageError, check_output_path, err, out, tables_on_stderr, user_errors, warn, write_report
from .machine import environment

if TYPE_CHECKING:   # the load generator and the engine (numpy, torch) load once the command line is checked
    from .loadgen import Workload
from .options import FLAGS, SEED_RANGE, EngineOptions, Model, engine_flags, flag, parse_compare, typed_flags
from .plot import blog_chart, check_plot, plot_option, save, sweep_chart, sweep_text_chart

API_KEY_ENV = "NANO_API_KEY"                    # --api-key's default, as for nano serve
BYTE_VOCAB = 256     # --base-url: prompt ids are drawn below this when MODEL's config is not on this machine
MODES = ("compare", "sweep_concurrency", "reproduce_blog")   # the flags that run several configurations
# what each mode does without: a flag the mode sets or ignores is refused
IGNORED = {"sweep_concurrency": ("concurrency",),
           "reproduce_blog": ("concurrency", "num_prompts", "input_len", "output_len", "shared_prefix", "multi_turn",
                              "warmup", "request_rate", "kv_dtype", "kv_layout")}   # it sets the KV formats itself


class Endpoint(str, Enum):
    completions = "completions"
    chat = "chat"


# ---- the workload flags ------------------------------------------------------------------------------------------
def parse_range(flag: str, text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-256' -> (64, 256): lengths drawn uniformly from the range."""
    low, dash, high = text.partition("-")
    if not low.strip().isdigit() or (dash and not high.strip().isdigit()):
        raise UsageError(f"{flag} takes a length or a range like 64-256, not {text!r}")
    bounds = int(low), int(high or low)
    if not 1 <= bounds[0] <= bounds[1]:
        raise UsageError(f"{flag} {text}: lengths must be >= 1 and the range ascending")
    return bounds


def parse_concurrencies(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--sweep-concurrency takes numbers like 1,8,16,32,64; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError("--sweep-concurrency levels must be >= 1")
    return levels


@dataclass(frozen=True)
class Load:
    """What a measured run sends: the workload flags, parsed."""
    concurrency: int
    num_prompts: int | None     # None: 5 × the concurrency
    inputs: tuple[int, int]
    outputs: tuple[int, int]
    shared_prefix: int
    turns: int
    seed: int
    warmup: int
    request_rate: float | None  # None: all at once

    def prompts(self, level: int) -> int:
        """Prompts (conversations) measured at `level` requests in flight: --num-prompts, or 5 × the level."""
        return self.num_prompts or 5 * level

    def workloads(self, vocab_size: int, level: int, stream: str = "") -> tuple[Workload, Workload]:
        """The warm-up and the measured workload at `level` requests in flight. One engine may run several, and
        its prefix cache would hold prompts it has run, so each draws prompts of its own (`stream`: the first the
        seed's plain draws, the warm-ups and later sweep levels other draws); all share the one --shared-prefix."""
        from .loadgen import Workload
        draw = functools.partial(Workload.random, input_len=self.inputs, output_len=self.outputs,
                                 vocab_size=vocab_size, seed=self.seed, shared_prefix=self.shared_prefix)
        return (draw(min(self.warmup, level), stream="warm-up"),
                draw(self.prompts(level), turns=self.turns, stream=stream))

    def arrivals(self, workload: Workload) -> list[float] | None:
        from .loadgen import poisson_arrivals
        return None if self.request_rate is None else poisson_arrivals(len(workload.prompts), self.request_rate,
                                                                       self.seed)

    def check_context(self, config: ModelConfig) -> None:
        longest = self.shared_prefix + self.turns * (self.inputs[1] + self.outputs[1])   # the last turn's
        if longest > config.max_position_embeddings:
            lengths = "--input-len + --output-len" if self.turns == 1 else \
                "--multi-turn × (--input-len + --output-len)"
            raise NanoError(f"{'--shared-prefix + ' if self.shared_prefix else ''}{lengths} reach {longest} tokens "
                            f"but the model's context is {config.max_position_embeddings}")

    def describe(self, model: str, count: int | str) -> str:
        span = lambda bounds: str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"
        rate = self.request_rate
        return " · ".join([model, f"{count} prompts" if self.turns == 1 else
                           f"{count} conversations of {self.turns} turns",
                           *([f"shared prefix {self.shared_prefix}"] if self.shared_prefix else []),
                           f"input {span(self.inputs)}", f"output {span(self.outputs)}",
                           *([f"{rate:g} requests/s (Poisson)"] if rate is not None else []), f"seed {self.seed}"])


# ---- what a report says ------------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def simple_table(columns: list[str], left: tuple[str, ...] = ("",)) -> Table:
    """A table of nano's style with these columns, right-justified but those in `left`. Its title is printed
    as lines of its own (`print_titled`): a table's title would wrap at the table's width, mid-phrase."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right")
    return table


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
    [("server TTFT mean ms", lambda f: f.get("server_latency_ms", {}).get("ttft_mean"), 1),    # --base-url only
     ("server ITL mean ms", lambda f: f.get("server_latency_ms", {}).get("itl_mean"), 1),
     ("output tokens per chunk", lambda f: f.get("output_tokens_per_chunk"), 2)],
    [("integrity checked", lambda f: f["integrity"]["checked"], 0),
     ("integrity mismatched", lambda f: f["integrity"]["mismatched"], 0),
     ("integrity aborted", lambda f: f["integrity"]["aborted"], 0),
     ("integrity % of step time", lambda f: _percent(f["integrity"]["share_of_step_time"]), 2),
     ("KV transfers", lambda f: f.get("split", {}).get("transfers"), 0),
     ("KV moved MB", lambda f: f["split"]["bytes"] / 1e6 if "split" in f else None, 2),
     ("KV transfer ms (all)", lambda f: 1e3 * f["split"]["seconds"] if "split" in f else None, 1),
     ("KV transfer GB/s", lambda f: f.get("split", {}).get("gb_s"), 3),
     ("plain shm copy GB/s", lambda f: f.get("split", {}).get("plain_copy_gb_s"), 2),
     ("transfer % of plain copy", lambda f: 100 * f["split"]["share_of_plain_copy"] if "split" in f else None, 1)],
]
# the engine's rows: a server's run shows them ("–" where its /metrics does not say), as a reminder that they exist
ENGINE_ROWS = frozenset(label for label, _, _ in [*SECTIONS[2], *SECTIONS[3], *SECTIONS[-1][:3]])
SWEEP_COLUMNS: list[Row] = [
    ("conc", lambda f: f["concurrency"], 0), ("req/s", lambda f: f["requests_per_s"], 2),
    ("out tok/s", lambda f: f["output_tok_s"], 1), ("all tok/s", lambda f: f["total_tok_s"], 0),
    ("TTFT p50", lambda f: f["latency_ms"]["ttft"]["median"], 0),
    ("TTFT p95", lambda f: f["latency_ms"]["ttft"]["p95"], 0),
    ("TPOT p50", lambda f: f["latency_ms"]["tpot"]["median"], 1),
    ("ITL p95", lambda f: f["latency_ms"]["itl"]["p95"], 1),
    ("peak", lambda f: f["peak_running"], 0), ("preempt", lambda f: f["preemptions"], 0)]


def print_titled(title: str, table: Table) -> None:
    """A table under its title, printed as lines of their own that break where the title has a line break."""
    out.print(title, markup=False)
    out.print(table)


def latency_table(figures: dict[str, Any]) -> Table:
    """One run's latencies: a row per metric, a column per statistic."""
    table = simple_table(["latency ms", "mean", "median", "p95", "p99"], left=("latency ms",))
    for metric, stats in figures["latency_ms"].items():
        table.add_row(metric.upper(), *(_num(stats[s]) for s in ("mean", "median", "p95", "p99")))
    return table


def runs_table(runs: list[tuple[str, dict[str, Any]]], always: frozenset[str] = frozenset()) -> Table:
    """One column per run; with two or more, a ratio column for each run against the first (one run: the
    latencies go in `latency_table`). A row no run has a figure for is left out, unless its label is in
    `always`."""
    table = simple_table(["", *(name for name, _ in runs), *(f"{name} / {runs[0][0]}" for name, _ in runs[1:])])
    for column in table.columns[1 + len(runs):]:
        column.style = "bold"
    for number, section in enumerate(SECTIONS):
        if len(runs) == 1 and section is LATENCY_ROWS:
            continue
        rows = [(label, [get(figures) for _, figures in runs], digits) for label, get, digits in section]
        rows = [row for row in rows if row[0] in always or any(v is not None for v in row[1])]
        for index, (label, values, digits) in enumerate(rows):
            ratios = [_num(v / values[0], 3) if v is not None and values[0] else "–" for v in values[1:]]
            table.add_row(label, *(_num(v, digits) for v in values), *ratios,
                          end_section=index == len(rows) - 1 and number < len(SECTIONS) - 1)
    return table


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    table = simple_table([name for name, _, _ in SWEEP_COLUMNS], left=())
    for figures in rows:
        table.add_row(*(_num(get(figures), digits) for _, get, digits in SWEEP_COLUMNS))
    return table


# ---- configurations in this process ------------------------------------------------------------------------------
def run_variant(model: str, engine: EngineOptions, load: Load, levels: list[int], vocab_size: int, name: str,
                advance: Callable[[], None]) -> list[dict[str, Any]]:
    """Build one configuration's engine, measure it at each concurrency level (after that level's warm-up),
    shut it down. `advance`: as each measured request finishes."""
    from nano.disagg import SplitLLM

    from .loadgen import measure
    front = engine.build(model)
    if isinstance(front, SplitLLM):
        err.print(f"{name}: prefill worker pid {front.info['prefill']['pid']}, decode worker pid "
                  f"{front.info['decode']['pid']}, KV over {front.transport}", style="dim", markup=False)
    try:
        runs = []
        for index, level in enumerate(levels):
            warm, measured = load.workloads(vocab_size, level, f"level {index}" if index else "")
            runs.append(measure(front, measured, level, warm, advance, load.arrivals(measured)))
        return runs
    finally:
        front.close()   # the split's workers, or a tensor-parallel model's other ranks


def run_configurations(model: str, base: EngineOptions, load: Load, compare: str | None,
                       sweep_concurrency: str | None) -> dict[str, Any]:
    """One configuration, the --compare variants, or the --disagg pair, each at one concurrency or at every
    --sweep-concurrency level (a phase of the plan each, cli/progress.py); prints the tables and returns the
    runs."""
    from .progress import Phase, Progress

    config = base.config
    variants = (parse_compare(compare, base, ("kv-dtype", "weights", "integrity", "prefix-cache"))
                if compare is not None else
                [("split", base), ("single process", base.single_process_twin())] if base.disagg else
                [(f"weights {config.weights}, KV {config.kv_dtype}", base)])
    sweep = sweep_concurrency is not None
    levels = parse_concurrencies(sweep_concurrency) if sweep else [load.concurrency]
    from nano.llm import resolve_config
    model_config = resolve_config(model, config.weights_dir)[1]
    load.check_context(model_config)
    for _, variant in variants:   # what each configuration asks of this model (a KV budget that holds a page)
        variant.check_model(model)
    phases = [Phase(f"{name} · concurrency {level}", load.prompts(level) * load.turns)
              for name, _ in variants for level in levels]
    with Progress(phases) as progress:
        runs = {name: run_variant(model, variant, load, levels, model_config.vocab_size, name, progress.advance)
                for name, variant in variants}
    describe = load.describe(model, load.num_prompts or ("5 × concurrency" if sweep else 5 * load.concurrency))
    if sweep:
        for name, _ in variants:
            print_titled(f"{name} · {describe}\nlatencies in ms; peak: most requests running at once",
                         sweep_table(runs[name]))
        out.print(sweep_text_chart([(name, runs[name]) for name, _ in variants]), markup=False)
    else:
        print_titled(f"{describe} · concurrency {load.concurrency}",
                     runs_table([(name, runs[name][0]) for name, _ in variants]))
        if len(variants) == 1:
            out.print(latency_table(runs[variants[0][0]][0]))
    return {"mode": "sweep" if sweep else "compare" if len(variants) > 1 else "single",
            "runs": [{"name": name, "engine": variant.as_dict(), "results": runs[name]}
                     for name, variant in variants]}


# ---- against a server --------------------------------------------------------------------------------------------
def server_url(text: str) -> str:
    """The server's root: 'http://host:8000', 'http://host:8000/' and 'http://host:8000/v1' all give the first."""
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise UsageError(f"--base-url takes a URL like http://127.0.0.1:8000, not {text!r}")
    return url.removesuffix("/v1")


def local_model(model: str) -> tuple[ModelConfig | None, Tokenizer | None]:
    """MODEL's config and tokenizer when this machine has them without downloading anything: a preset (its
    stand-in, or its checkpoint in the Hugging Face cache), a checkpoint directory, or a hub id already in that
    cache. (None, None) otherwise: a server's model need not be one nano knows."""
    from nano.loader import read_config, resolve_model
    try:
        if model.removesuffix(RANDOM_SUFFIX) in PRESETS or os.path.isdir(os.path.expanduser(model)):
            resolved = resolve_model(model)
            path = resolved.path
            config = ModelConfig.from_hf(resolved.preset.nano_config if resolved.kind == "nano" else read_config(path))
        else:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json") if model.count("/") == 1 else None
            if not isinstance(cached, str):
                return None, None
            path = Path(cached).parent
            config = ModelConfig.from_hf(read_config(path))
    except (NanoError, KeyError, ValueError, TypeError):   # not a model nano can read: use no config
        return None, None
    try:
        return config, load_tokenizer(path, config)
    except (NanoError, OSError, ValueError):
        return config, None


def check_server(base_url: str, model: str, api_key: str | None) -> None:
    """Before the run: the server answers (else one error line, exit 1), takes the key, and serves MODEL (else a
    warning: its requests will fail, and are counted as failed)."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError as error:
        raise NanoError(f"cannot reach --base-url {base_url}: {error or type(error).__name__}") from None
    if response.status_code == 401:
        raise NanoError(f"--base-url {base_url} wants an API key: pass --api-key KEY (or set ${API_KEY_ENV})")
    try:
        served = [entry["id"] for entry in response.json()["data"]] if response.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        served = None
    if served is not None and model not in served:
        warn(f"the server at {base_url} serves {', '.join(map(repr, served)) or 'no model'}, not {model!r}: "
             f"its requests will fail")


def run_against_server(model: str, base_url: str, endpoint: str, api_key: str | None, load: Load) -> dict[str, Any]:
    """The one-configuration run, sent over HTTP to the server at `base_url`; prints its tables and returns it. A
    run in which every request failed measured nothing: one error line (exit 1) instead of tables of dashes."""
    from .progress import Phase, Progress

    config, tokenizer = local_model(model)
    if config is not None:
        load.check_context(config)
    if endpoint == "completions" and load.turns > 1 and tokenizer is None:
        raise NanoError(f"--multi-turn with --endpoint completions needs {model}'s tokenizer on this machine (a turn's "
                        f"reply comes back as text, and the next prompt is token ids); use --endpoint chat")
    check_server(base_url, model, api_key)
    vocab = config.vocab_size if config is not None else BYTE_VOCAB
    warm, measured = load.workloads(vocab, load.concurrency)
    from .loadgen import HttpTarget, measure_http
    target = HttpTarget(base_url, model, endpoint, api_key, tokenizer, load.shared_prefix)
    name = f"{endpoint} at {base_url.split('://', 1)[1]}"
    with Progress([Phase(f"{name} · concurrency {load.concurrency}", measured.num_requests)]) as progress:
        figures = measure_http(target, measured, load.concurrency, warm, progress.advance, load.arrivals(measured))
    if not figures["completed"]:
        raise NanoError(f"every request failed, so nothing was measured: {failures(figures)}")
    warn_of_server_figures(figures)
    engine_rows = "engine rows from its /metrics" if figures["obtained"]["engine"].startswith("the server's") else \
        "engine rows not available"
    print_titled(f"{load.describe(model, len(measured.prompts))} · concurrency {load.concurrency}\nover HTTP, "
                 f"measured at the client; {engine_rows}", runs_table([(name, figures)], always=ENGINE_ROWS))
    out.print(latency_table(figures))
    return {"mode": "server", "runs": [{"name": name, "server": {
        "base_url": base_url, "endpoint": endpoint, "model": model, "prompt_vocab": vocab,
        "local_tokenizer": tokenizer is not None}, "engine": None, "results": [figures]}]}


def failures(figures: dict[str, Any]) -> str:
    """'3 of 32 requests failed; 3 with: <the most common error>'."""
    error, count = next(iter(figures["errors"].items()), ("", 0))
    return f"{figures['failed']} of {figures['num_prompts']} requests failed" + (f"; {count} with: {error}"
                                                                                  if error else "")


def warn_of_server_figures(figures: dict[str, Any]) -> None:
    """A warning line when requests failed, or when the server made other token counts than were asked for."""
    if figures["failed"]:
        warn(failures(figures))
    elif figures["obtained"]["tokens"] == "the server's usage" and \
            figures["output_tokens"] != figures["output_tokens_requested"]:
        warn(f"the server generated {figures['output_tokens']:,} tokens where {figures['output_tokens_requested']:,} "
             f"were asked for: it may not honour ignore_eos")


# ---- the command -------------------------------------------------------------------------------------------------
Concurrency = Annotated[int, typer.Option(metavar="N", min=1, help="Most requests in flight at once.")]
NumPrompts = Annotated[int | None, typer.Option(
    metavar="N", min=1, help="Prompts in all, or conversations with --multi-turn (default: 5 × concurrency).")]
InputLen = Annotated[str, typer.Option(metavar="N|LO-HI", help="Prompt tokens: fixed, or uniform in a range.")]
OutputLen = Annotated[str, typer.Option(
    metavar="N|LO-HI", help="Tokens to generate per request (greedy, no early stop): fixed, or uniform in a range.")]
SharedPrefix = Annotated[int | None, typer.Option(
    metavar="N", min=1, help="Start every prompt with the same N random tokens (seeded), then its own --input-len "
                             "tokens: a workload for the prefix cache.")]
MultiTurn = Annotated[int, typer.Option(
    metavar="T", min=1, help="Make each prompt a conversation of T turns: turn k+1's prompt is turn k's prompt and "
                             "reply plus --input-len new tokens, sent when turn k has finished. Every turn is one "
                             "request in the figures.")]
Seed = Annotated[int, typer.Option(metavar="N", **SEED_RANGE, help="Seed for the random prompts and lengths.")]
Warmup = Annotated[int, typer.Option(
    metavar="N", min=0, help="Prompts run (and discarded) before measuring: single turns drawn apart from the "
                             "measured prompts, starting with the --shared-prefix if any.")]
Compare = Annotated[str | None, typer.Option(
    metavar="KEY=A,B", help="Run each value back to back and print them side by side with ratios: "
                            "kv-dtype=bf16,fp8 · weights=fp8,int4 · integrity=on,off · prefix-cache=on,off.")]
SweepConcurrency = Annotated[str | None, typer.Option(
    metavar="N,N,…", help="Measure at each concurrency (e.g. 1,8,16,32,64); prints throughput and latency against "
                          "concurrency, and a text chart. With --compare: each configuration.")]
ReproduceBlog = Annotated[bool, typer.Option(
    "--reproduce-blog", help="Reproduce the shape of the published results at small scale: FP8 vs BF16 KV under one "
                             "budget, INT4 vs resident FP8 weights for decode and prefill, integrity on vs off; "
                             "published figures beside measured ones. Its workloads are fixed, and it runs without "
                             "the prefix cache (its runs repeat the same prompts).")]
RequestRate = Annotated[float | None, typer.Option(
    metavar="R", help="Prompts (conversations with --multi-turn) arriving per second, as a Poisson process "
                      "(exponential gaps drawn from --seed), still at most --concurrency in flight; inf: all at once "
                      "(the default).")]
BaseUrl = Annotated[str | None, typer.Option(
    metavar="URL", help="Benchmark the OpenAI-compatible server at URL (nano serve, vLLM, SGLang) instead of an engine "
                        "in this process: the same workloads, streamed over HTTP, timed at the client. MODEL is the "
                        "name the server serves; its engine is configured where it was started, so the engine flags, "
                        "--compare, --sweep-concurrency and --reproduce-blog do not apply.")]
EndpointFlag = Annotated[Endpoint, typer.Option(
    metavar="completions|chat", help="With --base-url: /v1/completions (prompts sent as token ids) or "
                                     "/v1/chat/completions (prompts sent as messages of words).")]
ApiKey = Annotated[str | None, typer.Option(
    metavar="KEY", help=f"With --base-url: send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, if set).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print every figure, with versions, machine and config, as one "
                                                     "JSON object on stdout (the tables go to stderr).")]
Output = Annotated[Path | None, typer.Option("--output", "-o", metavar="FILE",
                                             help="Also write that JSON object to FILE.")]
Plot = plot_option("With --sweep-concurrency or --reproduce-blog: also draw its chart")


def check_flags(typed: frozenset[str], engine: EngineOptions, base_url: str | None, request_rate: float | None
                ) -> None:
    """--endpoint and --api-key need --base-url; with it, no flag that configures an engine here (the server's
    engine was configured where it started) and no mode that runs several engines. Else one mode at a time (but a
    sweep of each --compare configuration), and no flag a mode ignores (one problem per message)."""
    if request_rate is not None and not request_rate > 0:
        raise UsageError(f"--request-rate must be more than 0 (inf: all at once), not {request_rate:g}")
    for name in ("endpoint", "api_key"):
        if base_url is None and name in typed:
            raise UsageError(f"{flag(name)} needs --base-url (it says how to reach a server)")
    modes = [name for name in MODES if name in typed]
    engine_flags_typed = [name for name in FLAGS if name in engine.typed]
    if base_url is not None and modes:
        raise UsageError(f"{flag(modes[0])} does nothing with --base-url: it runs engines in this process; a server "
                         f"runs one, configured where it was started")
    if base_url is not None and engine_flags_typed:
        raise UsageError(f"{flag(engine_flags_typed[0])} does nothing with --base-url: the server's engine is "
                         f"configured where it was started (nano serve's flags)")
    if len(modes) > 1 and set(modes) != {"compare", "sweep_concurrency"}:   # a sweep of each configuration: yes
        raise UsageError(f"{flag(modes[0])} and {flag(modes[1])} cannot be combined; choose one")
    if engine.disagg and modes and modes != ["sweep_concurrency"]:
        raise UsageError(f"{flag(modes[0])} cannot be combined with --disagg (which compares the split with one "
                         f"process already)")
    for mode in modes:
        ignored = [name for name in IGNORED.get(mode, ()) if name in typed]
        if ignored:
            raise UsageError(f"{flag(ignored[0])} does nothing with {flag(mode)}")
    if "reproduce_blog" in typed and "prefix_cache" in typed and engine.config.prefix_cache:
        raise UsageError("--prefix-cache does nothing with --reproduce-blog (its experiments repeat the same prompts "
                         "on one engine, so they run without the cache)")


@engine_flags()
def bench(context: typer.Context, model: Model, concurrency: Concurrency = 64, num_prompts: NumPrompts = None,
          input_len: InputLen = "128", output_len: OutputLen = "32", shared_prefix: SharedPrefix = None,
          multi_turn: MultiTurn = 1, seed: Seed = 0, warmup: Warmup = 4, compare: Compare = None,
          sweep_concurrency: SweepConcurrency = None, reproduce_blog: ReproduceBlog = False,
          request_rate: RequestRate = None, base_url: BaseUrl = None, endpoint: EndpointFlag = Endpoint.completions,
          api_key: ApiKey = None, as_json: AsJson = False, output: Output = None, plot: Plot = None, *,
          engine: EngineOptions) -> None:
    """Benchmark the engine under load: throughput, latency percentiles, peak concurrency, KV use.

    Also the integrity counters. With --disagg: the prefill/decode split beside one process, with KV transfer
    figures. With --base-url: a running server, over HTTP (see docs/bench.md)."""
    with user_errors():
        check_flags(typed_flags(context), engine, base_url, request_rate)
        rate = None if request_rate is None or math.isinf(request_rate) else request_rate
        load = Load(concurrency, num_prompts, parse_range("--input-len", input_len),
                    parse_range("--output-len", output_len), shared_prefix or 0, multi_turn, seed, warmup, rate)
        base = server_url(base_url) if base_url is not None else None
        if base is None:   # the flags (--compare checks each of its configurations) and the model's name
            engine.check(model) if compare is None else check_model_name(model)
        if output is not None:
            check_output_path("--output", output)
        if plot is not None:
            if sweep_concurrency is None and not reproduce_blog:
                raise UsageError("--plot draws --sweep-concurrency or --reproduce-blog (a single run is one point: "
                                 "its table says it all)")
            check_plot(plot)
        with tables_on_stderr(as_json):
            if base is not None:
                key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
                report = run_against_server(model, base, endpoint.value, key, load)
            elif reproduce_blog:
                # its experiments run the same prompts again on one engine: a prefix cache would turn the repeats
                # into hits, which the published results never measured
                engine = engine.replace(prefix_cache=False)
                from . import blog
                report = blog.reproduce(model, engine, seed)
            else:
                report = run_configurations(model, engine, load, compare, sweep_concurrency)
        # which model ran: the engine's, or the name the server answered to
        from nano.llm import resolve_config
        label = f"{model!r} served at {base}" if base is not None else \
            resolve_config(model, engine.config.weights_dir)[0].label
        report = {"model": model, "label": label, "config": {
                      "concurrency": concurrency, "num_prompts": num_prompts, "input_len": input_len,
                      "output_len": output_len, "shared_prefix": shared_prefix, "multi_turn": multi_turn,
                      "seed": seed, "warmup": warmup, "request_rate": rate, "base_url": base,
                      "endpoint": endpoint.value if base is not None else None,
                      "engine": engine.as_dict() if base is None else None},
                  **report, "environment": environment()}
        if as_json:
            typer.echo(json.dumps(report))
        if output is not None:
            write_report("--output", output, report)
        if plot is not None:
            save((blog_chart if reproduce_blog else sweep_chart)(report), plot)
