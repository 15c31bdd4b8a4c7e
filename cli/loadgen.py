"""The load generator under `nano bench`: a seeded random workload, a driver that keeps at most `concurrency`
requests in flight, and the figures of one measured run.

A workload is plain (one request per prompt) or made of conversations: a conversation's next turn is its
previous turn's prompt and generated tokens plus a new user message, submitted when that turn has finished. With a
shared prefix every first prompt starts with the same tokens. Both are what a prefix cache can reuse; the figures
say how much it did (the prefill side's counters: prompt tokens computed, looked up, taken from the cache).

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
from dataclasses import dataclass, field
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
Turn = tuple[list[int], int]      # a later turn of a conversation: the user's new tokens, the tokens to generate


@dataclass
class Workload:
    prompts: list[list[int]]      # token ids; in conversations, each one's first prompt
    output_lens: list[int]        # tokens to generate; in conversations, each one's first turn's
    later_turns: list[list[Turn]] = field(default_factory=list)   # per conversation, turns 2, 3, ... (empty: plain)

    @classmethod
    def random(cls, count: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
               seed: int, *, shared_prefix: int = 0, turns: int = 1, stream: str = "") -> Workload:
        """`count` random prompts (or conversations of `turns` turns, each new user message `input_len` tokens),
        the first prompts starting with the same `shared_prefix` tokens. A plain workload draws what it always
        has from `seed`, so a seed gives the same prompts with or without the other options. `stream` names other
        draws from the same seed (a warm-up's, a sweep level's): other prompts, the same shared prefix."""
        rng = random.Random(f"{seed} {stream}" if stream else seed)
        tokens = lambda length: [rng.randrange(vocab_size) for _ in range(length)]
        prompts = [tokens(rng.randint(*input_len)) for _ in range(count)]
        output_lens = [rng.randint(*output_len) for _ in range(count)]
        later = [[(tokens(rng.randint(*input_len)), rng.randint(*output_len)) for _ in range(turns - 1)]
                 for _ in range(count)] if turns > 1 else []
        prefix_rng = random.Random(f"{seed} shared prefix")
        prefix = [prefix_rng.randrange(vocab_size) for _ in range(shared_prefix)]
        return cls([prefix + prompt for prompt in prompts], output_lens, later)

    @property
    def turns(self) -> int:
        return 1 + len(self.later_turns[0]) if self.later_turns else 1

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * self.turns

    def head(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.output_lens[:count], self.later_turns[:count])


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
    """Keep at most `concurrency` conversations in flight, one request each (a plain prompt is a conversation of
    one turn; a later turn is submitted when the turn before it has finished, whatever its outcome), until every
    turn has finished. Returns the finished requests (engine `Request`s or `SplitRequest`s: the same timing
    fields) conversation by conversation, turn by turn, and the wall time."""
    pending = list(range(len(workload.prompts)))[::-1]
    live: dict[int, tuple[int, TimedRequest]] = {}     # conversation -> (its turn in flight, 0-based; the request)
    done: dict[tuple[int, int], TimedRequest] = {}

    def submit(i: int, turn: int, prompt: list[int], output_len: int) -> None:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        name = f"prompt {i}" if workload.turns == 1 else f"conversation {i}, turn {turn + 1}"
        live[i] = turn, front.submit(prompt, params, name)

    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.pop()
            submit(i, 0, workload.prompts[i], workload.output_lens[i])
        front.poll()
        for i, (turn, request) in list(live.items()):
            if not request.finished:
                continue
            done[i, turn] = live.pop(i)[1]
            advance()
            if turn + 1 < workload.turns:
                message, output_len = workload.later_turns[i][turn]
                submit(i, turn + 1, request.prompt_token_ids + request.output_token_ids + message, output_len)
    duration = time.perf_counter() - start
    return [done[i, turn] for i in range(len(workload.prompts)) for turn in range(workload.turns)], duration


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean / median / p95 / p99 in milliseconds (None when there is nothing to measure)."""
    if not values:
        return dict.fromkeys(("mean", "median", "p95", "p99"))
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99))}


def summarize(requests: list[TimedRequest], duration: float, concurrency: int, engine: dict[str, Any],
              turns: int = 1) -> dict[str, Any]:
    """The figures of one run: counts, throughput, the engine's counters, latency distributions, errors. With
    `turns` > 1 the requests are conversations' turns, in drive()'s order, and TTFT is also given by turn."""
    completed = [r.finish_reason in ("stop", "length") for r in requests]
    ok = [r for r, done in zip(requests, completed) if done]
    latencies = [latency_metrics(r.arrival_time, r.token_times, r.finish_time) if done else {}
                 for r, done in zip(requests, completed)]
    ttft, tpot, e2e = ([m[key] for m in latencies if key in m] for key in ("ttft_s", "tpot_s", "e2e_s"))
    itl = [later - earlier for r in ok for earlier, later in zip(r.token_times, r.token_times[1:])]
    input_tokens = sum(len(r.prompt_token_ids) for r in ok)
    output_tokens = sum(len(r.output_token_ids) for r in ok)
    page_tokens = engine["peak_pages_used"] * engine["page_size"]
    figures = {
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
    if turns > 1:
        figures["ttft_ms_by_turn"] = [distribution([m["ttft_s"] for m in latencies[turn::turns] if "ttft_s" in m]
                                                   )["median"] for turn in range(turns)]
    return figures


def prefix_cache_figures(engine: dict[str, Any]) -> dict[str, Any]:
    """What the prefix cache saved, from the counters of the engine that prefills (the split's prefill worker):
    prompt tokens computed, looked up at admission, and taken from the cache (whole pages) instead."""
    cached, looked_up = engine.get("cached_tokens", 0), engine.get("lookup_tokens", 0)
    return {"enabled": engine.get("prefix_cache", False), "cached_tokens": cached, "lookup_tokens": looked_up,
            "hit_rate": cached / looked_up if looked_up else None, "prefill_tokens": engine["prefill_tokens"]}


def measure(front: LLM | SplitLLM, workload: Workload, concurrency: int, warmup: Workload | int, label: str
            ) -> dict[str, Any]:
    """Warm up, reset the counters, run the workload, and return every figure. `warmup` is a workload of its own
    or a count of `workload`'s first prompts (which a prefix cache then holds when the measured run starts)."""
    warm = workload.head(warmup) if isinstance(warmup, int) else warmup
    if warm.prompts:
        drive(front, warm, concurrency)
    split = isinstance(front, SplitLLM)
    front.counters(reset=True)
    moved_before = dataclasses.replace(front.stats) if split else None
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task(label, total=workload.num_requests)
        requests, duration = drive(front, workload, concurrency, lambda: progress.advance(task))
    counters = front.counters()
    figures = summarize(requests, duration, concurrency, counters["decode"] if split else counters, workload.turns)
    figures["prefix_cache"] = prefix_cache_figures(counters["prefill"] if split else counters)
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
