"""`nano profile MODEL`: where the time and the memory of one prefill step and one decode step go.

torch.profiler records the steps (cli/profiler.py holds the measuring). The engine labels its own phases
(schedule, integrity check, forward, sampler; nano/engine.py); for the model's components this command hangs
labels on the modules only while it profiles (forward hooks: no cost otherwise): attention, the DSA indexer, the
router, routed experts, shared experts, dense MLPs and, inside them, the INT4 dequant-matmuls. Times are per step;
a component's time excludes the labelled components inside it.

On CUDA, component times are kernel time: the profiler records the CUDA activity too, and a component's time
is the device time of the kernels launched inside its range (a GPU op's CPU time is only its launch). On CPU
they are CPU time (`profiler_setup`).

Memory: resident weights by format, the KV pool, and the peak of activations during the prefill step (every
tensor an op creates, counted until it is freed: `ActivationMeter`). The roofline, for the prefill step and the
decode step: the bytes the step has to read (the weights it uses, with only the routed experts its tokens chose,
plus the KV of every sequence) over its unprofiled time, against this machine's copy bandwidth; and its matmul
FLOPs (FlopCounterMode) over that time, against a dense GEMM of the step's rows in the model's dtype — both
roofs measured in the same run.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from nano.errors import NanoError

from .console import check_output_path, err, format_bytes, out, user_errors
from .machine import copy_seconds, device_name, environment
from .options import EngineOptions, Model, engine_flags
from .plot import check_plot, plot_option, profile_chart, save

PlotFile = plot_option("Also draw the roofline (this machine's roofs, both steps as points) and the components' split")

if TYPE_CHECKING:
    from nano.llm import LLM


@engine_flags(skip=("kv_budget", "max_running", "disagg", "prefill_kv_dtype", "decode_kv_dtype", "transport"))
def profile(
    model: Model,
    batch: Annotated[int, typer.Option(metavar="N", min=1, help="Sequences in the decode step.")] = 8,
    input_len: Annotated[int, typer.Option(metavar="N", min=2, help="Prompt tokens per sequence; the prefill step "
                                                             "processes one prompt of this length.")] = 256,
    steps: Annotated[int, typer.Option(metavar="N", min=1, help="Decode steps to profile (times are per step).")] = 8,
    trace: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Export the decode steps as a Chrome trace (open in chrome://tracing or Perfetto).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every figure as one JSON object.")] = False,
    plot: PlotFile = None,
    *,
    engine: EngineOptions,
) -> None:
    """Time and memory of one prefill step and one decode step, per component, and where each step sits under
    this machine's roofs.

    Components: attention, indexer, router, experts, INT4 dequant, integrity check, sampler, scheduling (kernel
    time on CUDA). Also memory by kind, and for each step its achieved bandwidth against this machine's copy
    bandwidth and its FLOP rate against a dense GEMM of the same dtype, both measured in the same run."""
    with user_errors():
        if trace is not None:
            check_output_path("--trace", trace)
        if plot is not None:
            check_plot(plot)
        engine = engine.replace(max_running=batch)
        llm = engine.build(model)
        report = run_profile(llm, batch, input_len, steps, trace)
        report = {"model": model, "label": llm.label, "engine": engine.as_dict(), **report,
                  "environment": environment()}
        if as_json:
            typer.echo(json.dumps(report, indent=2))
        else:
            print_profile(report)
        if plot is not None:
            save(profile_chart(report), plot)
    if trace:
        err.print(f"wrote {trace} (decode steps; open in chrome://tracing or ui.perfetto.dev)", style="dim",
                  markup=False)


def run_profile(llm: LLM, batch: int, input_len: int, steps: int, trace: Path | None) -> dict[str, Any]:
    from nano.sampling import SamplingParams

    from .profiler import measure_decode, measure_prefill, profiler_setup, roofline
    activities, time_total = profiler_setup(llm.device)
    output_len = tokens_to_generate(llm, batch, input_len, steps)
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(llm.config.vocab_size) for _ in range(input_len)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompt()], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # warm-up
    prefill = measure_prefill(llm, prompt, params, activities, time_total)
    # the decode steps: `batch` sequences, prefilled first (not measured)
    requests = [llm.submit(prompt(), params) for _ in range(batch)]
    while any(len(r.output_token_ids) < 1 for r in requests):
        llm.poll()
    decode = measure_decode(llm, requests, steps, activities, time_total)
    if trace:
        export_trace(decode["prof"], trace)
    if any(r.finished for r in requests):
        raise NanoError("a sequence finished while the decode steps were measured")   # output_len guards this
    for r in requests:
        llm.engine.abort(r, "profiled")
    # a copy reads and writes each byte. On a CPU one copy of 256 MiB takes tens of ms, long enough to time alone:
    # the fastest of 10 single copies (5 timings of 20 cost seconds on a busy machine); on a GPU it takes ~0.1 ms,
    # so 20 in a row outweigh the launch
    nbytes, (repeats, trials) = 256 * 2**20, (20, 5) if llm.device.type == "cuda" else (1, 10)
    copy_gb_s = 2 * nbytes / copy_seconds(nbytes, repeats=repeats, trials=trials, device=llm.device) / 1e9
    return {
        "times": "kernel time (CUDA)" if time_total == "device_time_total" else "CPU time",
        "device": device_name(llm.device),
        "prefill": {"tokens": input_len, "ms": {k: round(v, 4) for k, v in prefill["times"].items()},
                    "roofline": roofline(llm, prefill, input_len, input_len, copy_gb_s, decode=False)},
        "decode": {"batch": batch, "steps": steps, "rows_per_step": decode["rows_per_step"],
                   "ms": {k: round(v, 4) for k, v in decode["times"].items()},
                   "step_ms_unprofiled": decode["wall_ms"],
                   "roofline": roofline(llm, decode, decode["context"], batch, copy_gb_s, decode=True)},
        "memory_bytes": {"weights": llm.weight_bytes(), "kv_pool": llm.pool.nbytes,
                         "activations_peak_prefill": prefill["activation_peak"]},
        "copy_gb_s": copy_gb_s,
    }


def tokens_to_generate(llm: LLM, batch: int, input_len: int, steps: int) -> int:
    """Enough tokens that no sequence finishes while the batch is measured: its prefill chunks (the early sequences
    decode meanwhile, and their decode tokens come out of each step's budget), then the timed, counted and
    profiled decode steps. The prompt and those tokens must fit the context and the batch the KV pool."""
    budget = llm.engine.max_step_tokens
    if input_len > budget:
        raise NanoError(f"--input-len {input_len}: one prefill step takes at most {budget} tokens")
    output_len = -(-batch * input_len // max(1, budget - batch)) + 2 * steps + 4
    if input_len + output_len >= llm.max_context:
        raise NanoError(f"--batch {batch}, --input-len {input_len} and --steps {steps} need {input_len + output_len:,} "
                        f"tokens per sequence (the prompt, the decode steps while the batch's prefill runs, "
                        f"then the measured steps), more than the context ({llm.max_context:,} tokens)")
    if batch * llm.engine.scheduler.pages_for(input_len + output_len) > llm.pool.num_pages:
        raise NanoError(f"{batch} sequences of {input_len + output_len} tokens do not fit the KV pool "
                        f"({llm.pool.tokens:,} tokens); lower --batch or --input-len")
    return output_len


def export_trace(prof: Any, trace: Path) -> None:
    """The decode steps as a Chrome trace, to --trace FILE."""
    try:
        prof.export_chrome_trace(str(trace.expanduser()))
    except OSError as error:
        raise NanoError(f"--trace {trace}: {error.strerror or error}") from None
    if not trace.expanduser().is_file():    # torch may log a failed export instead of raising
        raise NanoError(f"--trace {trace}: the trace was not written")


def print_profile(report: dict[str, Any]) -> None:
    prefill, decode = report["prefill"]["ms"], report["decode"]["ms"]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title=f"{report['label']} · prefill: 1 × {report['prefill']['tokens']} tokens · decode: batch "
                        f"{report['decode']['batch']}, mean of {report['decode']['steps']} steps · "
                        f"{report['times']}")
    for name in ("component", "prefill ms", "%", "decode ms", "%"):
        table.add_column(name, justify="left" if name == "component" else "right")
    totals = sum(prefill.values()), sum(decode.values())
    for name in prefill:
        table.add_row(name, f"{prefill[name]:.2f}", f"{100 * prefill[name] / totals[0]:.1f}",
                      f"{decode[name]:.2f}", f"{100 * decode[name] / totals[1]:.1f}")
    table.add_row("total (profiled)", f"{totals[0]:.2f}", "100", f"{totals[1]:.2f}", "100", style="bold")
    out.print(table)
    memory = report["memory_bytes"]
    out.print("memory: weights " + ", ".join(f"{fmt} {format_bytes(size)}" for fmt, size in
                                             sorted(memory["weights"].items()))
              + f" · KV pool {format_bytes(memory['kv_pool'])} · activations (prefill peak) "
                f"{format_bytes(memory['activations_peak_prefill'])}", markup=False)
    roofs = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title=f"roofline · measured here on {report['device']} · copy {report['copy_gb_s']:.1f} GB/s "
                        f"(read + write) · FLOPs: the matmuls, counted by FlopCounterMode")
    for name in ("step", "ms", "reads", "GB/s", "% of copy", "GFLOP/s", "dense GEMM", "GFLOP/s ", "% of GEMM"):
        roofs.add_column(name, justify="left" if name in ("step", "dense GEMM") else "right")
    for phase in ("prefill", "decode"):
        roof = report[phase]["roofline"]
        rows, hidden, inner = roof["dense_gemm_shape"]
        roofs.add_row(phase, f"{roof['step_ms']:.1f}", format_bytes(roof["bytes_read"]), f"{roof['gb_s']:.2f}",
                      f"{100 * roof['share_of_copy']:.0f}", f"{roof['gflop_s']:.1f}",
                      f"{rows}×{hidden}·{hidden}×{inner}", f"{roof['dense_gemm_gflop_s']:.1f}",
                      f"{100 * roof['share_of_gemm']:.0f}")
    out.print(roofs)
    out.print("Times are the profiler's (which adds its own overhead to every labelled call); a component's time "
              "excludes the labelled parts inside it. See docs/bench.md.", style="dim", markup=False)
