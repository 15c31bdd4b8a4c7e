"""`nano profile MODEL`: where the time and the memory of one prefill step and one decode step go.

torch.profiler records the steps. The engine labels its own phases (schedule, integrity check, forward,
sampler; nano/engine.py); for the model's components this command hangs labels on the modules only while it
profiles (forward hooks: no cost otherwise): attention, the DSA indexer, the router, routed experts, shared
experts, dense MLPs and, inside them, the INT4 dequant-matmuls. Times are per step; a component's time excludes
the labelled components inside it.

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

import contextlib
import json
import math
import os
import random
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.nn.functional as F
import typer
from rich import box
from rich.table import Table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile as torch_profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from nano.errors import NanoError
from nano.llm import LLM
from nano.model import MLP, MLAttention, MoE, Router
from nano.parallel import COMMUNICATION
from nano.quant import Int4Linear, PhaseLinear
from nano.sampling import SamplingParams

from .console import check_output_path, err, format_bytes, out, user_errors
from .machine import copy_seconds, device_name
from .options import EngineOptions, Model, engine_flags

ENGINE_PHASES = ("schedule", "integrity check", "sampler")
INT4 = "int4 dequant-matmul"
# where an INT4 matmul runs, from its module path (checked in order): its time is taken out of that component
INT4_PLACES = [(".self_attn.indexer.", "indexer"), (".self_attn.", "attention"), (".mlp.experts.", "routed experts"),
               (".mlp.shared_experts.", "shared experts"), (".mlp.", "dense MLP")]


@contextmanager
def labelled_components(model: torch.nn.Module, chosen: list[torch.Tensor]) -> Iterator[None]:
    """Wrap each component's forward in a profiler range for as long as the block runs; the routers' choices
    are collected into `chosen` (expert ids [N, K] per call)."""
    handles, open_ranges, wrapped = [], [], []

    def label(module: torch.nn.Module, name: str) -> None:
        def enter(*_: Any) -> None:
            open_ranges.append(record_function(name).__enter__())

        def leave(*_: Any) -> None:
            open_ranges.pop().__exit__(None, None, None)
        handles.extend([module.register_forward_pre_hook(enter), module.register_forward_hook(leave)])

    for module in model.modules():
        if isinstance(module, MLAttention):
            label(module, "attention")
            if module.indexer is not None:   # its work is in two methods, not forward: wrap them on the instance
                for method in ("keys", "select"):
                    setattr(module.indexer, method, in_range("indexer", getattr(module.indexer, method)))
                    wrapped.append((module.indexer, method))
        elif isinstance(module, Router):
            label(module, "router")
            handles.append(module.register_forward_hook(lambda _m, _i, result: chosen.append(result[0])))
        elif isinstance(module, MoE):
            label(module, "moe")
            if module.shared_experts is not None:
                label(module.shared_experts, "shared experts")
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            place = next((where for part, where in INT4_PLACES if part in f".{name}."), "other")
            label(module, f"{INT4} ({place})")
    for layer in model.model.layers:
        if isinstance(layer.mlp, MLP):
            label(layer.mlp, "dense MLP")
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, method in wrapped:
            delattr(owner, method)   # the class's method shows through again


def in_range(name: str, function: Any) -> Any:
    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return function(*args, **kwargs)
    return labelled


def profiler_setup(device: torch.device) -> tuple[list[ProfilerActivity], str]:
    """What to record on `device`, and which event total is a component's time: on CUDA the kernels too, and
    their device time (kernel time; the CPU time of a GPU op is only its launch); on CPU, CPU time."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA], "device_time_total"
    return [ProfilerActivity.CPU], "cpu_time_total"


def component_times(prof: Any, steps: int, time_total: str = "cpu_time_total") -> dict[str, float]:
    """Milliseconds per step for each component, exclusive of the labelled parts inside it (the indexer inside
    attention, the router and shared experts inside the MoE, the INT4 matmuls inside whichever ran them).
    `time_total` is the event field to read (`profiler_setup`). Only the CPU-side ranges are read: on CUDA their
    device time sums the kernels launched inside them, while the GPU-side copy of a label spans idle time too."""
    inclusive: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == DeviceType.CPU:
            inclusive[event.key] = getattr(event, time_total) / 1e3 / steps
    get = lambda name: inclusive.get(name, 0.0)
    int4 = lambda place: get(f"{INT4} ({place})")
    comm = lambda part: get(f"{COMMUNICATION} ({part})")   # tensor parallelism's collectives, inside each part
    times = {"attention": get("attention") - get("indexer") - int4("attention") - comm("attention"),
             "indexer": get("indexer") - int4("indexer"),
             "router": get("router"),
             "routed experts": get("moe") - get("router") - get("shared experts") - int4("routed experts")
             - comm("moe"),
             "shared experts": get("shared experts") - int4("shared experts"),
             "dense MLP": get("dense MLP") - int4("dense MLP") - comm("dense MLP"),
             INT4: sum(v for k, v in inclusive.items() if k.startswith(INT4)),
             "other (norms, embeddings, lm_head)": get("forward") - get("attention") - get("moe") - get("dense MLP")
             - comm("embedding") - comm("lm_head")}
    communication = sum(v for k, v in inclusive.items() if k.startswith(COMMUNICATION))
    if communication:   # a tensor-parallel model (--tp): its collectives, taken out of the parts above
        times[COMMUNICATION] = communication
    for phase in ENGINE_PHASES:
        times[phase] = get(phase)
    return times


class ActivationMeter(TorchDispatchMode):
    """Peak bytes of the tensors that ops create while it is active: every op's new (non-view) outputs count
    until the tensor object dies. Writes into existing storage (the KV pool, in-place ops) do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(result)[0]:
            if (isinstance(tensor, torch.Tensor) and tensor._base is None
                    and tensor.untyped_storage().data_ptr() not in inputs):
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._freed, nbytes)
        return result


def phase_weight_bytes(module: torch.nn.Module, decode: bool) -> int:
    """Bytes a step of one phase reads from `module`'s weights: a PhaseLinear's side for that phase only."""
    if isinstance(module, PhaseLinear):
        return phase_weight_bytes(module.decode if decode else module.prefill, decode)
    own = sum(t.numel() * t.element_size() for t in [*module.parameters(recurse=False),
                                                     *module.buffers(recurse=False)] if t.device.type != "meta")
    return own + sum(phase_weight_bytes(child, decode) for child in module.children())


def bytes_read_by_step(llm: LLM, chosen: list[torch.Tensor], context_tokens: int, decode: bool) -> int:
    """Weights one step uses (every non-routed weight, in its phase's format; each routed expert once if any token
    chose it) plus the KV of every sequence it attends over. `chosen`: the routers' choices of the steps measured,
    one [N, K] tensor per MoE layer per step, in order (the mean over those steps is taken)."""
    model = llm.model
    moe_layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    total = phase_weight_bytes(model, decode) - phase_weight_bytes(model.model.embed_tokens, decode)
    total += model.cfg.hidden_size * model.model.embed_tokens.weight.element_size()   # rows looked up (tiny)
    expert_bytes = [phase_weight_bytes(moe.experts[0], decode) for moe in moe_layers]
    total -= sum(len(moe.experts) * size for moe, size in zip(moe_layers, expert_bytes))
    per_step = [chosen[i:i + len(moe_layers)] for i in range(0, len(chosen), len(moe_layers))]
    used = sum(sum(ids.unique().numel() * size for ids, size in zip(step, expert_bytes)) for step in per_step)
    kv = context_tokens * model.cfg.kv_bytes_per_token(llm.pool.kv_dtype)
    return total + used // max(1, len(per_step)) + kv


# FLOPs of the ops FlopCounterMode does not know: PyTorch's CPU INT4 matmul, x [M, K] -> [M, N]
_INT4_FLOPS = {torch.ops.aten._weight_int4pack_mm_for_cpu: lambda x, *_, out_shape: 2 * x[0] * x[1] * out_shape[1]}


def counted_flops(run: Any) -> int:
    """Floating-point operations of the matmuls `run()` executes, as torch's FlopCounterMode counts them (2 per
    multiply-add; elementwise ops and the GPU's Triton kernels are not counted)."""
    with FlopCounterMode(display=False, custom_mapping=_INT4_FLOPS) as counter:
        run()
    return counter.get_total_flops()


def dense_gemm_flop_s(rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of one dense matmul measured now: x [rows, hidden] @ W [4 * hidden, hidden]^T in the model's dtype,
    the fastest of 5 trials of enough calls for ~20 ms (other processes only ever slow it down)."""
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    weight = torch.randn(4 * hidden, hidden, dtype=dtype, device=device)
    wait = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    F.linear(x, weight)
    wait()
    started = time.perf_counter()
    F.linear(x, weight)
    wait()
    calls = max(1, int(0.02 / max(time.perf_counter() - started, 1e-6)))
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            F.linear(x, weight)
        wait()
        best = min(best, (time.perf_counter() - started) / calls)
    return 2 * rows * hidden * 4 * hidden / best


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send what C++ code writes to file descriptor 2 to /dev/null for the block: torch's profiler (kineto) prints
    `USDT: ... profiler_start/stop` lines there, past Python's sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def profiled(llm: LLM, chosen: list[torch.Tensor], activities: list[ProfilerActivity]) -> Iterator[Any]:
    """torch.profiler over the block, with the model's components labelled and the routers' choices collected."""
    prof = torch_profile(activities=activities)
    with labelled_components(llm.model, chosen):
        with quiet_stderr():
            prof.__enter__()
        try:
            yield prof
        finally:
            with quiet_stderr():
                prof.__exit__(None, None, None)


def timed_ms(run: Any, steps: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        run()
    return 1e3 * (time.perf_counter() - started) / steps


def measure_prefill(llm: LLM, prompt: Any, params: SamplingParams, activities: list[ProfilerActivity],
                    time_total: str) -> dict[str, Any]:
    """One prompt's prefill step, four times over: profiled, unprofiled (wall time), under FlopCounterMode, and
    under the ActivationMeter (each a fresh request, aborted after its step)."""
    def one_step(wrapper: Any = contextlib.nullcontext) -> Any:
        request = llm.submit(prompt(), params)
        with wrapper() as context:
            llm.poll()
        llm.engine.abort(request, "profiled")
        return context

    chosen: list[torch.Tensor] = []
    prof = one_step(lambda: profiled(llm, chosen, activities))
    wall_ms = timed_ms(one_step)
    flops = counted_flops(one_step)
    meter = one_step(ActivationMeter)
    return {"times": component_times(prof, 1, time_total), "wall_ms": wall_ms, "flops": flops,
            "chosen": chosen, "activation_peak": meter.peak}


def measure_decode(llm: LLM, requests: list[Any], steps: int, activities: list[ProfilerActivity],
                   time_total: str) -> dict[str, Any]:
    """`steps` unprofiled decode steps (wall time), one under FlopCounterMode, then `steps` profiled ones."""
    wall_ms = timed_ms(llm.poll, steps)
    context = sum(r.num_tokens for r in requests)   # the KV read mid-way through the timed steps
    flops = counted_flops(llm.poll)
    chosen: list[torch.Tensor] = []
    decoded_before = llm.engine.stats.decode_tokens
    with profiled(llm, chosen, activities) as prof:
        for _ in range(steps):
            llm.poll()
    return {"times": component_times(prof, steps, time_total), "wall_ms": wall_ms, "flops": flops,
            "chosen": chosen, "context": context - len(requests) * steps // 2, "prof": prof,
            "rows_per_step": (llm.engine.stats.decode_tokens - decoded_before) / steps}


def roofline(llm: LLM, step: dict[str, Any], context: int, rows: int, copy_gb_s: float, decode: bool
             ) -> dict[str, Any]:
    """One step's achieved bandwidth and FLOP rate against this machine's copy bandwidth and a dense GEMM of the
    step's rows, both measured now."""
    read = bytes_read_by_step(llm, step["chosen"], context, decode)
    gemm = dense_gemm_flop_s(rows, llm.config.hidden_size, llm.compute_dtype, llm.device)
    gb_s, flop_s = read / step["wall_ms"] / 1e6, step["flops"] / step["wall_ms"] * 1e3
    return {"step_ms": step["wall_ms"], "bytes_read": read, "gb_s": gb_s, "share_of_copy": gb_s / copy_gb_s,
            "flops": step["flops"], "gflop_s": flop_s / 1e9, "dense_gemm_gflop_s": gemm / 1e9,
            "dense_gemm_shape": [rows, llm.config.hidden_size, 4 * llm.config.hidden_size],
            "share_of_gemm": flop_s / gemm}


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
        engine = engine.replace(max_running=batch)
        llm = engine.build(model)
        report = run_profile(llm, batch, input_len, steps, trace)
    report = {"model": model, "label": llm.label, "engine": engine.as_dict(), **report}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_profile(report)
    if trace:
        err.print(f"wrote {trace} (decode steps; open in chrome://tracing or ui.perfetto.dev)", style="dim",
                  markup=False)


def run_profile(llm: LLM, batch: int, input_len: int, steps: int, trace: Path | None) -> dict[str, Any]:
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
    nbytes = 256 * 2**20
    copy_gb_s = 2 * nbytes / copy_seconds(nbytes, device=llm.device) / 1e9   # a copy reads and writes each byte
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
