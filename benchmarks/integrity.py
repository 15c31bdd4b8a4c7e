"""What the KV integrity check costs, measured in one run: integrity on vs tags-only vs off (the no-op tracker).

    python benchmarks/integrity.py [--model glm-5.2-random] [--requests 32] [--input-len 64] [--output-len 32]
                                   [--page-size 16] [--rounds 5] [--dtype float32] [--json FILE]

    on          IntegrityTracker: tags bumped on allocation, (page, tag) recorded per request, one batched
                check per step
    tags-only   the same bookkeeping, the per-step check skipped (what the check alone costs = on - tags-only)
    off         NullTracker (integrity=False): no tensors, no records, no check

The three take turns, round after round, after a warm-up round; the table shows medians. Each round runs all
requests at once (greedy, ignore_eos), so that every decode step checks the whole batch. Reported: output
tokens/s, p95 of the per-request time per output token (TPOT), p95 of the decode step time, and — measured
directly, immune to the noise of a shared machine — the time spent inside `check` as a share of step time.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from nano import LLM, SamplingParams   # noqa: E402
from nano.engine import Engine   # noqa: E402
from nano.integrity import IntegrityTracker   # noqa: E402


class TagsOnly(IntegrityTracker):
    """The bookkeeping (tags, records) without the per-step check."""

    def check(self, requests):   # noqa: D102
        return {}


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


def run(llm: LLM, mode: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    engine = Engine(llm.model, llm.pool, set(), max_running=len(prompts), max_step_tokens=4096,
                    integrity=mode != "off")
    if mode == "tags-only":
        engine.integrity = engine.scheduler.tracker = TagsOnly(llm.pool)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [engine.add(p, params, len(p) + output_len) for p in prompts]
    engine.step()                                   # the prefill step: every prompt at once
    step_times, start = [], time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    decode_s = time.perf_counter() - start
    assert all(r.finish_reason == "length" for r in requests), "a request did not finish cleanly"
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in requests]
    return {"tok_s": len(prompts) * (output_len - 1) / decode_s, "p95_tpot_ms": 1e3 * p95(tpot),
            "p95_step_ms": 1e3 * p95(step_times), "check_share": engine.stats.integrity_s / sum(step_times),
            "outputs": [r.output_token_ids for r in requests]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-5.2-random")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    console = Console()
    llm = LLM(args.model, page_size=args.page_size, dtype=args.dtype, progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(args.input_len)] for _ in range(args.requests)]
    modes = ["on", "tags-only", "off"]
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for round_ in range(args.rounds + 1):
        console.print(f"{'warm-up round' if round_ == 0 else f'round {round_}/{args.rounds}'} ...", style="dim")
        for mode in modes if round_ % 2 else reversed(modes):     # alternate the order: no mode always goes first
            result = run(llm, mode, prompts, args.output_len)
            if round_:
                samples[mode].append(result)
    outputs = {m: samples[m][0]["outputs"] for m in modes}
    assert outputs["on"] == outputs["off"] == outputs["tags-only"], "integrity changed an output"
    median = {m: {k: statistics.median(s[k] for s in samples[m]) for k in ("tok_s", "p95_tpot_ms", "p95_step_ms",
                                                                          "check_share")} for m in modes}
    table = Table(title=f"KV integrity overhead · {llm.label} · {args.requests} requests × ({args.input_len} in, "
                        f"{args.output_len} out), {args.page_size}-token pages, {llm.pool.kv_dtype} KV · torch "
                        f"{torch.__version__}, {torch.get_num_threads()} threads · median of {args.rounds} rounds",
                  title_justify="left")
    for name in ("integrity", "output tok/s", "× off", "p95 TPOT ms", "× off", "p95 step ms", "check / step"):
        table.add_column(name, justify="left" if name == "integrity" else "right")
    off = median["off"]
    for m in modes:
        row = median[m]
        table.add_row(m, f"{row['tok_s']:,.1f}", f"{row['tok_s'] / off['tok_s']:.3f}", f"{row['p95_tpot_ms']:.2f}",
                      f"{row['p95_tpot_ms'] / off['p95_tpot_ms']:.3f}", f"{row['p95_step_ms']:.2f}",
                      f"{100 * row['check_share']:.2f}%" if m == "on" else "")
    console.print(table)
    console.print("Outputs of the three modes are identical. End-to-end ratios move by a few % between rounds on a "
                  "shared machine; 'check / step' is the check's own time inside the measured steps.", style="dim")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "median": median,
                                               "samples": {m: [{k: v for k, v in s.items() if k != "outputs"}
                                                               for s in samples[m]] for m in modes}}, indent=2))


if __name__ == "__main__":
    main()
