"""Why twice the requests can cost almost nothing: decode steps against batch size, the bench's concurrency
sweep, and FP8 against BF16 KV under one KV budget — each measured in one run, configurations interleaved.

    python benchmarks/decode_batch.py [--model glm-5.2-random] [--parts steps,sweep,budget,dtype] [--rounds 3]
                                      [--batches 1,4,16,64] [--json FILE]

steps   B sequences of --input-len tokens are prefilled, then --steps decode steps are timed, for B in --batches,
        with BF16 and FP8 KV. A decode step reads every weight its tokens use once, whatever B: its time grows far
        slower than B, and the decode throughput B / step time grows nearly with B.
sweep   the bench workload of issue 26 (random prompts of --input-len tokens, --output-len out, greedy): at
        concurrency C, C prompts at once (C = 1: 4 prompts, one after another); output tok/s includes the prefill.
budget  --budget-prompts prompts at concurrency 64 with a KV budget (--kv-budget) that holds about 31 BF16
        requests: FP8 KV holds twice the tokens, so about twice the requests run at once.
dtype   the sweep's workload at concurrency 16 in float32, in bfloat16 as nano runs it on this device
        (LLM.compute_dtype: float32 matmuls on a CPU without bf16 ones), and in bfloat16 computed in bf16.

Each round runs every configuration once, in the order A, B, ... then reversed in the next round (A-B-B-A), on
engines built once (the same weights). The tables give medians with min–max over the rounds. nano is imported
before torch (libgomp's short spin, nano/__init__.py), with one thread unless OMP_NUM_THREADS says otherwise (as
the figures in docs/bench.md). The script runs on older trees too (a before/after comparison: run a copy of it from
a worktree of the older commit).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
os.environ.setdefault("OMP_NUM_THREADS", "1")                     # read by torch (and nano) when they load

from nano import LLM, SamplingParams   # noqa: E402  (nano before torch)
from nano.cli.loadgen import Workload, drive, summarize   # noqa: E402

import torch   # noqa: E402
from rich.console import Console   # noqa: E402
from rich.table import Table   # noqa: E402

console = Console(width=150)


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def interleaved(configs: list[str], rounds: int, run: Callable[[str], float | dict]) -> dict[str, list]:
    """Run each configuration once per round, the order reversed every other round (A-B-B-A)."""
    results: dict[str, list] = {config: [] for config in configs}
    for round_ in range(rounds):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            results[config].append(run(config))
    return results


def decode_step_ms(llm: LLM, batch: int, input_len: int, steps: int) -> float:
    """Prefill `batch` random prompts, then the mean wall time of `steps` decode steps of all of them."""
    generator = torch.Generator().manual_seed(batch)
    # enough tokens that the first sequences, decoding while the later ones prefill, are still running
    params = SamplingParams(max_tokens=steps + batch * input_len // 256 + 8, temperature=0.0, ignore_eos=True)
    requests = [llm.submit(torch.randint(0, llm.config.vocab_size, (input_len,), generator=generator).tolist(),
                           params) for _ in range(batch)]
    while any(not r.output_token_ids for r in requests):
        llm.poll()
    before = llm.counters()
    started = time.perf_counter()
    for _ in range(steps):
        llm.poll()
    elapsed = (time.perf_counter() - started) / steps
    after = llm.counters()
    assert after["decode_tokens"] - before["decode_tokens"] == batch * steps and not any(r.finished for r in requests) \
        and after["prefill_tokens"] == before["prefill_tokens"], "not a pure decode batch"
    for r in requests:
        llm.abort(r, "measured")
    return 1e3 * elapsed


def part_steps(args: argparse.Namespace, report: dict[str, Any]) -> None:
    llms = {kv: LLM(args.model, kv_dtype=kv, prefix_cache=False, progress=False)
            for kv in ("bf16", "fp8")}
    configs = [f"{kv} {batch}" for batch in args.batches for kv in llms]
    for llm in llms.values():
        decode_step_ms(llm, 2, args.input_len, 2)   # warm-up
    runs = interleaved(configs, args.rounds,
                       lambda c: decode_step_ms(llms[c.split()[0]], int(c.split()[1]), args.input_len, args.steps))
    table = Table(title=f"{llms['bf16'].label}: one decode step, {args.input_len}-token prompts, measured here "
                        f"({args.rounds} rounds, median (min–max))", title_justify="left")
    for column in ("batch", *(f"{kv} {what}" for kv in llms for what in ("step ms", "decode tok/s", "vs batch 1")),
                   "fp8 / bf16 step"):
        table.add_column(column, justify="right")
    rows = []
    for batch in args.batches:
        row: dict[str, Any] = {"batch": batch}
        cells = [str(batch)]
        for kv in llms:
            ms, base = runs[f"{kv} {batch}"], statistics.median(runs[f"{kv} {args.batches[0]}"])
            tok_s = [1e3 * batch / m for m in ms]
            row[kv] = {"step_ms": ms, "decode_tok_s_median": statistics.median(tok_s),
                       "vs_first_batch": statistics.median(tok_s) / (1e3 * args.batches[0] / base)}
            cells += [spread(ms), spread(tok_s, "{:.0f}"), f"{row[kv]['vs_first_batch']:.1f}×"]
        cells.append(f"{statistics.median(runs[f'fp8 {batch}']) / statistics.median(runs[f'bf16 {batch}']):.2f}")
        table.add_row(*cells)
        rows.append(row)
    console.print(table)
    report["steps"] = rows


def sweep_run(llm: LLM, workload: Workload, concurrency: int) -> dict[str, Any]:
    requests, duration = drive(llm, workload, concurrency)
    return summarize(requests, duration, concurrency, None)


def part_sweep(args: argparse.Namespace, report: dict[str, Any]) -> None:
    llm = LLM(args.model, prefix_cache=False, progress=False)
    workload = Workload.random(max(args.concurrencies), (args.input_len,) * 2, (args.output_len,) * 2,
                               llm.config.vocab_size, seed=0)
    sweep_run(llm, Workload.random(2, (16, 16), (4, 4), llm.config.vocab_size, 0, stream="warm-up"), 2)
    runs = interleaved([str(c) for c in args.concurrencies], args.rounds,
                       lambda c: sweep_run(llm, workload.head(max(4, int(c))), int(c)))
    first = statistics.median(r["output_tok_s"] for r in runs[str(args.concurrencies[0])])
    table = Table(title=f"{llm.label}: the bench sweep, {args.input_len} in / {args.output_len} out, measured here "
                        f"({args.rounds} rounds, median (min–max))", title_justify="left")
    for column in ("concurrency", "prompts", "output tok/s", f"vs concurrency {args.concurrencies[0]}",
                   "TPOT p50 ms"):
        table.add_column(column, justify="right")
    rows = []
    for c in args.concurrencies:
        tok_s = [r["output_tok_s"] for r in runs[str(c)]]
        tpot = [r["latency_ms"]["tpot"]["median"] for r in runs[str(c)]]
        rows.append({"concurrency": c, "prompts": max(4, c), "output_tok_s": tok_s, "tpot_p50_ms": tpot,
                     "vs_first": statistics.median(tok_s) / first})
        table.add_row(str(c), str(max(4, c)), spread(tok_s), f"{rows[-1]['vs_first']:.1f}×", spread(tpot))
    console.print(table)
    report["sweep"] = rows


def part_budget(args: argparse.Namespace, report: dict[str, Any]) -> None:
    llms = {kv: LLM(args.model, kv_dtype=kv, kv_budget=args.kv_budget, page_size=16, prefix_cache=False,
                    progress=False) for kv in ("bf16", "fp8")}
    vocab = llms["bf16"].config.vocab_size
    workload = Workload.random(args.budget_prompts, (args.input_len,) * 2, (args.output_len,) * 2, vocab, seed=0)
    warm = Workload.random(4, (16, 16), (4, 4), vocab, 0, stream="warm-up")

    def run(kv: str) -> dict[str, Any]:
        llm = llms[kv]
        sweep_run(llm, warm, 4)
        llm.counters(reset=True)
        requests, duration = drive(llm, workload, 64)
        return {**summarize(requests, duration, 64, llm.counters()), "tokens": [r.output_token_ids for r in requests]}

    runs = interleaved(list(llms), args.rounds, run)
    same = all(r["tokens"] == runs["bf16"][0]["tokens"] for r in runs["bf16"])
    table = Table(title=f"{llms['bf16'].label}: FP8 vs BF16 KV under one budget of {args.kv_budget:,} B, "
                        f"{args.budget_prompts} prompts at concurrency 64, measured here ({args.rounds} rounds)",
                  title_justify="left")
    for column in ("KV", "KV tokens", "peak running", "output tok/s", "TPOT p50 ms"):
        table.add_column(column, justify="right")
    summary: dict[str, Any] = {}
    for kv, results in runs.items():
        tok_s = [r["output_tok_s"] for r in results]
        tpot = [r["latency_ms"]["tpot"]["median"] for r in results]
        summary[kv] = {"kv_tokens": llms[kv].pool.tokens, "peak_running": results[0]["peak_running"],
                       "output_tok_s": tok_s, "tpot_p50_ms": tpot}
        table.add_row(kv, f"{llms[kv].pool.tokens:,}", str(results[0]["peak_running"]), spread(tok_s), spread(tpot))
    console.print(table)
    throughput = statistics.median(summary["fp8"]["output_tok_s"]) / statistics.median(summary["bf16"]["output_tok_s"])
    running = summary["fp8"]["peak_running"] / summary["bf16"]["peak_running"]
    console.print(f"FP8 / BF16: output tok/s {throughput:.2f}× (medians), peak running {running:.2f}×; "
                  f"BF16 outputs identical across rounds: {same}")
    report["budget"] = {**summary, "throughput_ratio": throughput, "running_ratio": running}


def part_dtype(args: argparse.Namespace, report: dict[str, Any]) -> None:
    llms = {"float32": LLM(args.model, dtype="float32", prefix_cache=False, progress=False),
            "bfloat16": LLM(args.model, dtype="bfloat16", prefix_cache=False, progress=False),
            "bfloat16, bf16 matmuls": LLM(args.model, dtype="bfloat16", prefix_cache=False, progress=False)}
    llms["bfloat16, bf16 matmuls"].model.hold_weights_in(torch.bfloat16)
    workload = Workload.random(16, (args.input_len,) * 2, (args.output_len,) * 2, llms["float32"].config.vocab_size,
                               seed=0)
    warm = Workload.random(2, (16, 16), (4, 4), llms["float32"].config.vocab_size, 0, stream="warm-up")
    for llm in llms.values():
        sweep_run(llm, warm, 2)
    runs = interleaved(list(llms), args.rounds, lambda name: sweep_run(llms[name], workload, 16)["output_tok_s"])
    table = Table(title=f"{llms['float32'].label}: 16 prompts at concurrency 16, {args.input_len} in / "
                        f"{args.output_len} out, by dtype, measured here ({args.rounds} rounds, median (min–max))",
                  title_justify="left")
    for column in ("dtype", "matmuls in", "output tok/s", "vs float32"):
        table.add_column(column, justify="right")
    base = statistics.median(runs["float32"])
    for name, tok_s in runs.items():
        matmuls = str(llms[name].model.lm_head.weight.dtype).removeprefix("torch.")
        table.add_row(name, matmuls, spread(tok_s), f"{statistics.median(tok_s) / base:.2f}×")
    console.print(table)
    report["dtype"] = {name: {"output_tok_s": tok_s, "vs_float32": statistics.median(tok_s) / base}
                       for name, tok_s in runs.items()}


PARTS = {"steps": part_steps, "sweep": part_sweep, "budget": part_budget, "dtype": part_dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-5.2-random")
    parser.add_argument("--parts", default="steps,sweep,budget")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--concurrencies", default="1,4,16,64")
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kv-budget", type=int, default=11_300_000)
    parser.add_argument("--budget-prompts", type=int, default=96)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.concurrencies = [int(c) for c in args.concurrencies.split(",")]
    except ValueError:
        parser.error("--batches and --concurrencies take comma-separated integers")
    if min(args.rounds, args.input_len, args.output_len, args.steps, *args.batches,
           *args.concurrencies) < 1:
        parser.error("every count must be >= 1")
    load = os.getloadavg()[0]
    console.print(f"load average {load:.1f} on {os.cpu_count()} CPUs at the start; {torch.get_num_threads()} torch "
                  f"thread(s)")
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "load_at_start": load}
    for part in parts:
        PARTS[part](args, report)
    report["load_at_end"] = os.getloadavg()[0]
    console.print(f"load average {report['load_at_end']:.1f} at the end")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
