"""What `nano profile` measures with (cli/profile.py is the command): profiler ranges on the model's components,
their times, the peak of activations, the matmul FLOPs, and the roofs a step is set against.

The command imports this module once its command line is checked: torch loads with it.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile as torch_profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from nano.llm import LLM
from nano.model import MLP, MLAttention, MoE, Router
from nano.parallel import COMMUNICATION
from nano.quant import Int4Linear, PhaseLinear
from nano.sampling import SamplingParams

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
