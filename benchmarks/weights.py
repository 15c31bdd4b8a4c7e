"""Weight formats side by side, measured in one run: decode and prefill speed, resident weight bytes.

    python benchmarks/weights.py [--model glm-5.2-random] [--dtype bfloat16] [--json FILE] [--quick] [--threads N]

Six ways to hold the same model (a nano stand-in, or a checkpoint you pass as --model):

    bf16                 the routed experts unquantized
    fp8                  every Linear but lm_head / kv_b_proj as resident FP8 128x128 blocks (on CPU: dequantized
                         at every call, so slow: FP8 on CPU is for memory and correctness)
    int4                 the routed experts packed INT4 (compressed-tensors, group 32), as Kimi ships them
    int4 --int4-all      every Linear packed but the lm_head, the routers and kv_b_proj
    bf16 pf + int4 dec   BF16 for prefill steps, INT4 for decode steps (both resident)
    fp8 pf + int4 dec    the report's GLM-5.2 policy: FP8 everywhere for prefill, INT4 routed experts for decode

For each it measures decode tokens/s at batch 1 and at batch 32 (greedy, ignore_eos, 16-token prompts so that a
batch of 32 prefills in one step and then decodes in lockstep), prefill tokens/s (the time to first token of a
512-token prompt, one step), and its resident weight bytes. The configurations take turns, round after round
(a warm-up round first), and the table shows the median of the rounds, so that a burst of load from another
process hits every configuration alike. Every ratio is against bf16 in the same run.

A second table times one Linear of the real Kimi expert shape [2048, 7168] in BF16, FP8 and INT4 at 1 to 512
rows: the stand-in's experts are [256, 512], so small that a call's fixed cost, not its bytes, sets its time.

See docs/int4.md for what the numbers mean.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich import box
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from nano import LLM, SamplingParams   # noqa: E402
from nano.quant import Fp8Linear, Int4Linear, weight_bytes_by_format   # noqa: E402

CONFIGS: list[tuple[str, dict]] = [
    ("bf16", dict(weights="bf16")),
    ("fp8", dict(weights="fp8")),
    ("int4", dict(weights="int4")),
    ("int4 --int4-all", dict(weights="int4", int4_all=True)),
    ("bf16 pf + int4 dec", dict(prefill_weights="bf16", decode_weights="int4")),
    ("fp8 pf + int4 dec", dict(prefill_weights="fp8", decode_weights="int4")),
]
ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+$")
console = Console(width=None if sys.stdout.isatty() else 150)   # a file or pipe gets the whole table


# ---- measurements ----------------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(count: int, length: int) -> list[list[int]]:
    """Fixed, distinct token-id prompts (byte ids, valid in every vocabulary nano builds)."""
    return [[32 + (7 * i + 13 * j) % 90 for j in range(length)] for i in range(count)]


def decode_rate(llm: LLM, batch: int, tokens: int) -> float:
    """Generated tokens after each request's first / the decode time, summed over a batch that decodes together."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(prompts(batch, 16), params)
    after_first = sum(len(o.token_ids) - 1 for o in outs)
    decode_s = max(o.metrics["tpot_s"] * (len(o.token_ids) - 1) for o in outs)
    return after_first / decode_s


def prefill_rate(llm: LLM, length: int) -> float:
    """Prompt tokens / time to first token for one prompt of `length` tokens (one step up to 512).

    Through generate rather than score: a step is what tells the engine which phase (and so which weights) runs."""
    out = llm.generate(prompts(1, length), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    return length / out.metrics["ttft_s"]


def routed_expert_bytes(llm: LLM) -> int:
    """Resident bytes of the routed experts, all formats (a prefill/decode split counts both copies)."""
    return sum(sum(weight_bytes_by_format(module).values()) for name, module in llm.model.named_modules()
               if ROUTED_EXPERT.match(name))


LAYER_FORMATS = ("bf16", "fp8", "int4")
SCALED_MM = "torch._scaled_mm"   # FP8 x FP8 (W8A8, one scale per tensor): PyTorch's own FP8 matmul, for comparison


def layer_bench(device: torch.device, rows: list[int], reps: int, copies: int) -> list[dict]:
    """One Kimi K2 expert gate_proj [2048, 7168]: BF16 F.linear vs Fp8Linear vs Int4Linear, median ms per call.
    `copies` distinct matrices are used in turn, so that (as in a decode step) the weights come from memory, not
    cache."""
    n, k = 2048, 7168
    gen = torch.Generator().manual_seed(0)
    dense = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).to(device) for _ in range(copies)]
    fp8 = [Fp8Linear.from_float(w) for w in dense]
    packed = [Int4Linear.from_float(w, 32) for w in dense]
    resident = {"bf16": n * k * 2, **{fmt: sum(b.numel() * b.element_size() for b in layers[0].buffers())
                                      for fmt, layers in (("fp8", fp8), ("int4", packed))}}   # codes and scales
    results = []
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
        timings = {}
        x_fp8, one = x.float().clamp(-448, 448).to(torch.float8_e4m3fn), torch.tensor(1.0, device=device)
        for fmt, call in (("bf16", lambda i: F.linear(x, dense[i])), ("fp8", lambda i: fp8[i](x)),
                          ("int4", lambda i: packed[i](x)),
                          (SCALED_MM, lambda i: torch._scaled_mm(x_fp8, fp8[i].weight.t(), one, one,
                                                                 out_dtype=torch.bfloat16))):
            for i in range(copies):   # warm-up
                call(i)
            samples = []
            for _ in range(reps):
                sync(device)
                start = time.perf_counter()
                for i in range(copies):
                    call(i)
                sync(device)
                samples.append((time.perf_counter() - start) / copies)
            timings[fmt] = statistics.median(samples)
        results.append({"rows": m, **{f"{fmt}_ms": timings[fmt] * 1e3 for fmt in (*LAYER_FORMATS, SCALED_MM)},
                        **{f"{fmt}_bytes": resident[fmt] for fmt in LAYER_FORMATS}})
    return results


# ---- threads on a shared machine -------------------------------------------------------------------------------

def contended(threads: int) -> tuple[bool, float, float]:
    """Is another process holding a core? Then every parallel region of `threads` threads waits for a time slice
    (milliseconds) at its barrier. Times a small op with 1 and with `threads` threads: (contended, us, us)."""
    w, x = torch.randn(2048, 512, dtype=torch.bfloat16), torch.randn(4, 512, dtype=torch.bfloat16)

    def per_call(n: int) -> float:   # leaves torch at n threads
        torch.set_num_threads(n)
        F.linear(x, w)
        start = time.perf_counter()
        for _ in range(30):
            F.linear(x, w)
        return (time.perf_counter() - start) / 30 * 1e6

    one, many = per_call(1), per_call(threads)
    return many > 4 * one + 200, one, many


def load_average() -> float | None:
    """The 1-minute load average: above the CPU count, other processes were competing for the cores."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device, threads: int, note: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": threads, "threads_note": note, "device": str(device),
            "load_avg_start": load_average()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ---- output ----------------------------------------------------------------------------------------------------

def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}×" if base else "-"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def spread(samples: list[float]) -> str:
    """Half the range of the samples, in % of their median: how far the rounds disagreed."""
    median = statistics.median(samples)
    return f"±{50 * (max(samples) - min(samples)) / median:.0f}%" if len(samples) > 1 and median else ""


def print_report(info: dict, settings: dict, rows: list[dict], layers: list[dict]) -> None:
    console.print(f"[bold]nano weight formats[/bold] · {settings['label']} · dtype {settings['dtype']}")
    console.print(f"machine: {info['cpu']}, {info['cpu_count']} CPUs ({info['cpu_capability']}), "
                  f"torch {info['torch']}, {info['torch_threads']} torch thread(s){info['threads_note']}; "
                  f"device {info['device']}{' (' + info['gpu'] + ')' if 'gpu' in info else ''}; "
                  f"load average {info['load_avg_start']} at start, {info['load_avg_end']} at end")
    console.print(f"method: median of {settings['rounds']} rounds after a warm-up round, configurations in turn; "
                  f"decode at batch 1 ({settings['tokens_b1']} tokens) and batch {settings['batch']} "
                  f"({settings['tokens_batch']} tokens each), 16-token prompts, greedy, ignore_eos; prefill = "
                  f"{settings['prefill_tokens']}-token prompt / TTFT. ± is half the range of the rounds.\n")

    base = rows[0]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    heads = ["weights", "decode b1\ntok/s", "", f"decode b{settings['batch']}\ntok/s", "", "prefill\ntok/s", "",
             "weights\nMiB", "", "routed\nexperts MiB", ""]
    for i, head in enumerate(heads):
        table.add_column(head, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        cells = [row["name"]]
        for key in ("decode_b1", "decode_batch", "prefill"):
            cells += [f"{row[key]:,.1f} {spread(row[key + '_samples'])}".strip(), ratio(row[key], base[key])]
        cells += [mib(row["weight_bytes"]), ratio(row["weight_bytes"], base["weight_bytes"]),
                  mib(row["routed_bytes"]), ratio(row["routed_bytes"], base["routed_bytes"])]
        table.add_row(*cells)
    console.print(table)
    console.print("resident weight MiB by format (llm.weight_bytes()):")
    for row in rows:
        console.print(f"  {row['name']:<20}" + ", ".join(f"{fmt} {mib(size)}"
                                                        for fmt, size in sorted(row["bytes_by_format"].items())))

    if layers:
        console.print("\n[bold]one Kimi expert Linear, [2048, 7168][/bold] (resident: " + ", ".join(
            f"{fmt.upper()} {layers[0][fmt + '_bytes'] / 1e6:.1f} MB" for fmt in LAYER_FORMATS)
            + f"; median ms per call, {settings['layer_copies']} distinct matrices in turn)")
        lt = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for head in ("rows (M)", *(f"{fmt} ms" for fmt in LAYER_FORMATS), "fp8 / bf16 time", "_scaled_mm / bf16",
                     "int4 speed-up",
                     *(f"{fmt} GB/s" for fmt in LAYER_FORMATS), "bf16 GFLOP/s"):
            lt.add_column(head, justify="right")
        for r in layers:
            flops = 2 * r["rows"] * 2048 * 7168
            lt.add_row(str(r["rows"]), *(f"{r[fmt + '_ms']:.2f}" for fmt in LAYER_FORMATS),
                       f"{r['fp8_ms'] / r['bf16_ms']:.2f}×", f"{r[SCALED_MM + '_ms'] / r['bf16_ms']:.2f}×",
                       f"{r['bf16_ms'] / r['int4_ms']:.2f}×",
                       *(f"{r[fmt + '_bytes'] / r[fmt + '_ms'] / 1e6:.1f}" for fmt in LAYER_FORMATS),
                       f"{flops / r['bf16_ms'] / 1e6:,.0f}")
        console.print(lt)
        console.print("GB/s = the layer's resident weight bytes / time (what a bandwidth-bound call is limited by); "
                      "GFLOP/s = 2·M·N·K / time (what a compute-bound call is limited by). On CPU, fp8 dequantizes "
                      "the whole weight at every call (no FP8 arithmetic): memory and correctness, not speed. "
                      "_scaled_mm: PyTorch's FP8 x FP8 matmul (activations cast to FP8 too), for comparison.",
                      style="dim")


# ---- main ------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="glm-5.2-random",
                        help="a preset (here its random-weight stand-in) or a checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="model dtype; the CPU INT4 kernel takes bf16 activations (fp32 is a reference path)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, or 1 when another process holds a core)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny counts, one round")
    parser.add_argument("--no-layer", action="store_true", help="skip the one-layer Kimi-shape table")
    parser.add_argument("--json", metavar="FILE", help="also write every sample and setting as JSON")
    args = parser.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu" and torch.get_num_threads() > 1:
        busy, one, many = contended(torch.get_num_threads())
        if busy:
            note = (f" (another process holds a core: a small op took {many:,.0f} us on "
                    f"{torch.get_num_threads()} threads vs {one:,.0f} us on 1, so 1 thread; --threads to force)")
            torch.set_num_threads(1)
    threads = torch.get_num_threads()

    quick = args.quick
    settings = {"model": args.model, "dtype": args.dtype, "rounds": args.rounds or (1 if quick else 7),
                "batch": 32, "tokens_b1": 4 if quick else 48, "tokens_batch": 3 if quick else 24,
                "prefill_tokens": 64 if quick else 512, "layer_rows": [1, 32] if quick else [1, 4, 8, 32, 512],
                "layer_reps": 2 if quick else 5, "layer_copies": 2 if quick else 8}
    info = machine_info(device, threads, note)

    started = time.perf_counter()
    llms: list[tuple[str, LLM]] = []
    for name, kwargs in CONFIGS:
        console.print(f"building {name} ...", style="dim")
        llms.append((name, LLM(args.model, dtype=args.dtype, device=str(device), kv_budget="48MiB",
                               progress=False, **kwargs)))
    settings["label"] = llms[0][1].label
    samples: dict[str, dict[str, list[float]]] = {name: {"decode_b1": [], "decode_batch": [], "prefill": []}
                                                  for name, _ in CONFIGS}
    for round_ in range(settings["rounds"] + 1):   # round 0 warms up (allocations, first-call paths)
        console.print("warm-up round ..." if round_ == 0 else f"round {round_}/{settings['rounds']} ...",
                      style="dim")
        for name, llm in llms:
            got = {"decode_b1": decode_rate(llm, 1, 3 if round_ == 0 else settings["tokens_b1"]),
                   "decode_batch": decode_rate(llm, settings["batch"], 3 if round_ == 0 else settings["tokens_batch"]),
                   "prefill": prefill_rate(llm, settings["prefill_tokens"])}
            if round_:
                for key, value in got.items():
                    samples[name][key].append(value)

    rows = []
    for name, llm in llms:
        by_format = llm.weight_bytes()
        row = {"name": name, "bytes_by_format": by_format, "weight_bytes": sum(by_format.values()),
               "routed_bytes": routed_expert_bytes(llm)}
        for key, values in samples[name].items():
            row[key], row[key + "_samples"] = statistics.median(values), values
        rows.append(row)
    del llms
    layers = [] if args.no_layer else layer_bench(device, settings["layer_rows"], settings["layer_reps"],
                                                  settings["layer_copies"])
    info["load_avg_end"] = load_average()
    settings["wall_s"] = time.perf_counter() - started

    print_report(info, settings, rows, layers)
    console.print(f"\n{settings['wall_s']:.0f} s", style="dim")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "settings": settings, "configs": rows,
                                               "layer": layers}, indent=2))


if __name__ == "__main__":
    main()
