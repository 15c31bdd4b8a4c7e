"""The load generator under `nano bench`: a seeded random workload, a driver that keeps at most `concurrency`
requests in flight, and the figures of one measured run.

Per request it records the arrival, every token's time and the end; from those:

    TTFT  arrival -> first token          TPOT  (last token - first token) / (tokens - 1), per request
    ITL   gap between consecutive tokens  E2E   arrival -> end

TTFT, TPOT and E2E are `nano.scheduler.latency_metrics` (the engine's one definition); ITL is this module's.
`bench.py` (the command) and `blog.py` (--reproduce-blog) both build on it; it imports neither.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nano.disagg import SplitLLM, TransferStats
from nano.llm import LLM
from nano.sampling import SamplingParams
from nano.scheduler import latency_metrics

from .console import err
from .machine import copy_seconds


# ---- the workload ----------------------------------------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]      # token ids
    output_lens: list[int]

    @classmethod
    def random(cls, count: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
               seed: int) -> Workload:
        rng = random.Random(seed)
        prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(count)]
        return cls(prompts, [rng.randint(*output_len) for _ in range(count)])

    def head(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.output_lens[:count])


# ---- one measured run ------------------------------------------------------------------------------------------
class TimedRequest(Protocol):
    """What a finished request tells the load generator: an engine `Request` and the split's requests both have
    these fields."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    arrival_time: float
    token_times: list[float]
    finish_time: float | None
    finish_reason: str | None
    error: str | None


def drive(front: LLM | SplitLLM, workload: Workload, concurrency: int, advance: Callable[[], None] = lambda: None
          ) -> tuple[list[TimedRequest], float]:
    """Keep at most `concurrency` requests in flight until every prompt has finished; returns the finished
    requests (engine `Request`s or `SplitRequest`s: the same timing fields) in prompt order, and the wall time."""
    pending = list(range(len(workload.prompts)))[::-1]
    live, done = {}, {}
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.pop()
            params = SamplingParams(max_tokens=workload.output_lens[i], temperature=0.0, ignore_eos=True)
            live[i] = front.submit(workload.prompts[i], params, f"prompt {i}")
        front.poll()
        for i, request in list(live.items()):
            if request.finished:
                done[i] = live.pop(i)
                advance()
    return [done[i] for i in range(len(workload.prompts))], time.perf_counter() - start


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean / median / p95 / p99 in milliseconds (None when there is nothing to measure)."""
    if not values:
        return dict.fromkeys(("mean", "median", "p95", "p99"))
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99))}


def summarize(requests: list[TimedRequest], duration: float, concurrency: int, engine: dict[str, Any]
              ) -> dict[str, Any]:
    """The figures of one run: counts, throughput, the engine's counters, latency distributions, errors."""
    ok = [r for r in requests if r.finish_reason in ("stop", "length")]
    latencies = [latency_metrics(r.arrival_time, r.token_times, r.finish_time) for r in ok]
    ttft, tpot, e2e = ([m[key] for m in latencies if key in m] for key in ("ttft_s", "tpot_s", "e2e_s"))
    itl = [later - earlier for r in ok for earlier, later in zip(r.token_times, r.token_times[1:])]
    input_tokens = sum(len(r.prompt_token_ids) for r in ok)
    output_tokens = sum(len(r.output_token_ids) for r in ok)
    page_tokens = engine["peak_pages_used"] * engine["page_size"]
    return {
        "num_prompts": len(requests), "concurrency": concurrency, "completed": len(ok),
        "failed": len(requests) - len(ok), "duration_s": duration,
        "requests_per_s": len(ok) / duration, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "input_tok_s": input_tokens / duration, "output_tok_s": output_tokens / duration,
        "total_tok_s": (input_tokens + output_tokens) / duration,
        "peak_running": engine["peak_running"], "preemptions": engine["preemptions"], "steps": engine["steps"],
        "kv": {"dtype": engine["kv_dtype"], "page_size": engine["page_size"], "pages": engine["num_pages"],
               "capacity_tokens": engine["kv_tokens"], "pool_bytes": engine["kv_bytes"],
               "peak_pages": engine["peak_pages_used"], "peak_tokens": page_tokens,
               "peak_use": engine["peak_pages_used"] / engine["num_pages"]},
        "latency_ms": {"ttft": distribution(ttft), "tpot": distribution(tpot), "itl": distribution(itl),
                       "e2e": distribution(e2e)},
        "integrity": {**{name: engine[name] for name in ("integrity", "checked", "mismatched", "aborted")},
                      "check_s": engine["integrity_s"], "share_of_step_time": engine["integrity_s"] / engine["step_s"]
                      if engine["step_s"] else 0.0},
        "errors": dict(Counter(r.error for r in requests if r.error).most_common(5)),
    }


def measure(front: LLM | SplitLLM, workload: Workload, concurrency: int, warmup: int, label: str
            ) -> dict[str, Any]:
    """Warm up, reset the counters, run the workload, and return every figure."""
    if warmup:
        drive(front, workload.head(warmup), concurrency)
    split = isinstance(front, SplitLLM)
    front.counters(reset=True)
    moved_before = dataclasses.replace(front.stats) if split else None
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task(label, total=len(workload.prompts))
        requests, duration = drive(front, workload, concurrency, lambda: progress.advance(task))
    counters = front.counters()
    figures = summarize(requests, duration, concurrency, counters["decode"] if split else counters)
    if split:
        moved = TransferStats(*(now - before for now, before in zip(dataclasses.astuple(front.stats),
                                                                     dataclasses.astuple(moved_before))))
        copy_gb_s = plain_copy_gb_s(max(1, moved.bytes // max(1, moved.transfers)))
        figures["split"] = {
            "transport": front.transport, "transfers": moved.transfers, "bytes": moved.bytes,
            "seconds": moved.pack_s + moved.unpack_s, "gb_s": moved.gb_per_s, "plain_copy_gb_s": copy_gb_s,
            "share_of_plain_copy": moved.gb_per_s / copy_gb_s,
            "pids": {role: front.info[role]["pid"] for role in front.info}, "prefill_engine": counters["prefill"]}
    return figures


def plain_copy_gb_s(nbytes: int) -> float:
    """Bytes per second of a plain shared-memory transfer of `nbytes`: one copy in, one copy out."""
    return nbytes / (2 * copy_seconds(nbytes, shared=True)) / 1e9
