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
Arrivals are "as fast as the concurrency allows", or Poisson at a request rate (`poisson_arrivals`), still capped
by the concurrency.

Against a server (`nano bench --base-url`), `drive_http` sends the same workloads to an OpenAI-compatible API,
streamed, and times them at the client: a request's arrival is when it is sent, its "token times" are the
arrivals of the stream's chunks that carry text, and its end is the chunk that carries the finish reason. A
chunk may hold several tokens, so ITL there is the gap between chunks, and TPOT is (end - first chunk) /
(tokens - 1) with the tokens counted by the server's `usage` (or, when it sends none, the chunks).
`bench.py` (the command) and `blog.py` (--reproduce-blog) both build on it; it imports neither.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np

from nano.disagg import SplitLLM, TransferStats
from nano.llm import LLM
from nano.sampling import SamplingParams
from nano.scheduler import latency_metrics

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


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """When each of `count` prompts (or conversations) arrives, in seconds from the start of the run, at `rate`
    per second: the first at 0, then gaps drawn from an exponential distribution of mean 1 / rate, from
    `random.Random(f"{seed} arrivals").expovariate(rate)` (a stream of their own: the prompts are the same with
    or without a rate). An infinite rate: all at 0."""
    rng = random.Random(f"{seed} arrivals")
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return offsets


def drive(front: LLM | SplitLLM, workload: Workload, concurrency: int, advance: Callable[[], None] = lambda: None,
          arrivals: list[float] | None = None) -> tuple[list[TimedRequest], float]:
    """Keep at most `concurrency` conversations in flight, one request each (a plain prompt is a conversation of
    one turn; a later turn is submitted when the turn before it has finished, whatever its outcome), until every
    turn has finished. With `arrivals` (seconds from the start, one per conversation) a conversation is submitted
    no earlier than its arrival, and still only when one of the `concurrency` slots is free. Returns the finished
    requests (engine `Request`s or `SplitRequest`s: the same timing fields) conversation by conversation, turn by
    turn, and the wall time."""
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
            if arrivals is not None and time.perf_counter() - start < arrivals[pending[-1]]:
                break                    # the next conversation has not arrived yet
            i = pending.pop()
            submit(i, 0, workload.prompts[i], workload.output_lens[i])
        if not live:                     # nothing to step until the next arrival
            time.sleep(max(0.0, start + arrivals[pending[-1]] - time.perf_counter()))   # type: ignore[index]
            continue
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


def request_latencies(request: TimedRequest, chunked: bool = False) -> dict[str, float]:
    """TTFT, TPOT and E2E of one request (`latency_metrics`). `chunked`: its token times are a stream's chunks,
    each holding one token or more, so TPOT is taken over its tokens instead: (end - first chunk) / (tokens - 1)."""
    metrics = latency_metrics(request.arrival_time, request.token_times, request.finish_time)
    if chunked:
        metrics.pop("tpot_s", None)
        tokens = len(request.output_token_ids)
        if request.token_times and tokens > 1 and request.finish_time is not None:
            metrics["tpot_s"] = (request.finish_time - request.token_times[0]) / (tokens - 1)
    return metrics


KV_KEYS = ("dtype", "layout", "page_size", "pages", "capacity_tokens", "pool_bytes", "peak_pages", "peak_tokens",
           "peak_use")
INTEGRITY_KEYS = ("integrity", "checked", "mismatched", "aborted", "check_s", "share_of_step_time")
PREFIX_KEYS = ("enabled", "cached_tokens", "lookup_tokens", "hit_rate", "prefill_tokens")


def summarize(requests: list[TimedRequest], duration: float, concurrency: int, engine: dict[str, Any] | None,
              turns: int = 1, chunked: bool = False) -> dict[str, Any]:
    """The figures of one run: counts, throughput, the engine's counters, latency distributions, errors. With
    `turns` > 1 the requests are conversations' turns, in drive()'s order, and TTFT is also given by turn.
    `engine` None (a server's run, timed at the client): the engine's figures are None. `chunked`: see
    `request_latencies`."""
    completed = [r.finish_reason in ("stop", "length") for r in requests]
    ok = [r for r, done in zip(requests, completed) if done]
    latencies = [request_latencies(r, chunked) if done else {} for r, done in zip(requests, completed)]
    ttft, tpot, e2e = ([m[key] for m in latencies if key in m] for key in ("ttft_s", "tpot_s", "e2e_s"))
    itl = [later - earlier for r in ok for earlier, later in zip(r.token_times, r.token_times[1:])]
    input_tokens = sum(len(r.prompt_token_ids) for r in ok)
    output_tokens = sum(len(r.output_token_ids) for r in ok)
    figures = {
        "num_prompts": len(requests), "concurrency": concurrency, "completed": len(ok),
        "failed": len(requests) - len(ok), "duration_s": duration,
        "requests_per_s": len(ok) / duration, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "input_tok_s": input_tokens / duration, "output_tok_s": output_tokens / duration,
        "total_tok_s": (input_tokens + output_tokens) / duration,
        **engine_figures(engine),
        "latency_ms": {"ttft": distribution(ttft), "tpot": distribution(tpot), "itl": distribution(itl),
                       "e2e": distribution(e2e)},
        "errors": dict(Counter(r.error for r in requests if r.error).most_common(5)),
    }
    if turns > 1:
        figures["ttft_ms_by_turn"] = [distribution([m["ttft_s"] for m in latencies[turn::turns] if "ttft_s" in m]
                                                   )["median"] for turn in range(turns)]
    return figures


def engine_figures(engine: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's counters as figures; every one None without an engine (a server's run)."""
    if engine is None:
        return {"peak_running": None, "preemptions": None, "steps": None, "kv": dict.fromkeys(KV_KEYS),
                "integrity": dict.fromkeys(INTEGRITY_KEYS)}
    page_tokens = engine["peak_pages_used"] * engine["page_size"]
    return {
        "peak_running": engine["peak_running"], "preemptions": engine["preemptions"], "steps": engine["steps"],
        "kv": {"dtype": engine["kv_dtype"], "layout": engine.get("kv_layout"), "page_size": engine["page_size"],
               "pages": engine["num_pages"],
               "capacity_tokens": engine["kv_tokens"], "pool_bytes": engine["kv_bytes"],
               "peak_pages": engine["peak_pages_used"], "peak_tokens": page_tokens,
               "peak_use": engine["peak_pages_used"] / engine["num_pages"]},
        "integrity": {**{name: engine[name] for name in ("integrity", "checked", "mismatched", "aborted")},
                      "check_s": engine["integrity_s"], "share_of_step_time": engine["integrity_s"] / engine["step_s"]
                      if engine["step_s"] else 0.0},
    }


def prefix_cache_figures(engine: dict[str, Any]) -> dict[str, Any]:
    """What the prefix cache saved, from the counters of the engine that prefills (the split's prefill worker):
    prompt tokens computed, looked up at admission, and taken from the cache (whole pages) instead."""
    cached, looked_up = engine.get("cached_tokens", 0), engine.get("lookup_tokens", 0)
    return {"enabled": engine.get("prefix_cache", False), "cached_tokens": cached, "lookup_tokens": looked_up,
            "hit_rate": cached / looked_up if looked_up else None, "prefill_tokens": engine["prefill_tokens"]}


def measure(front: LLM | SplitLLM, workload: Workload, concurrency: int, warmup: Workload | int,
            advance: Callable[[], None], arrivals: list[float] | None = None) -> dict[str, Any]:
    """Warm up, reset the counters, run the workload, and return every figure. `warmup` is a workload of its own
    or a count of `workload`'s first prompts (which a prefix cache then holds when the measured run starts); it
    runs as fast as `concurrency` allows, the measured run at its `arrivals` if any (see `drive`). `advance` is
    called as each measured request finishes (the command's progress)."""
    warm = workload.head(warmup) if isinstance(warmup, int) else warmup
    if warm.prompts:
        drive(front, warm, concurrency)
    split = isinstance(front, SplitLLM)
    front.counters(reset=True)
    moved_before = dataclasses.replace(front.stats) if split else None
    requests, duration = drive(front, workload, concurrency, advance, arrivals)
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


# ---- against a server: an OpenAI-compatible API over HTTP --------------------------------------------------------
# Words a chat message is made of (`message_text`): common English, so a server's tokenizer takes each as about one
# token; with the model's tokenizer on this machine the text is cut to the workload's token count exactly.
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def message_text(ids: list[int], tokenizer: Any | None) -> str:
    """A chat message standing for the workload tokens `ids`: one word per token, chosen by the token (so the
    seed decides the text). With `tokenizer` (the model's, here) the text is cut to len(ids) of its tokens."""
    text = " ".join(WORDS[i % len(WORDS)] for i in ids)
    if tokenizer is not None:
        encoded = tokenizer.encode(text)
        if len(encoded) > len(ids):
            text = tokenizer.decode(encoded[:len(ids)])
    return text


@dataclass(eq=False)
class HttpRecord:
    """One streamed request as the client saw it; it has TimedRequest's fields. The token ids are what was sent
    (completions) or placeholders as many as the server's `usage` counted; `token_times` are the arrivals of the
    chunks that carried text."""
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    usage: dict[str, Any] | None = None


@dataclass
class HttpTarget:
    """Where and how to send a workload: `endpoint` "completions" (the prompt as token ids) or "chat" (messages
    of words, `message_text`; the first `shared_prefix` tokens of each prompt become one system message, the rest
    the user's). A conversation's next turn: completions, the ids sent, the reply's text encoded with
    `tokenizer` (which must be given then), then the new tokens; chat, the messages sent, the reply as the
    assistant's, then a new user message."""
    base_url: str                  # without /v1
    model: str                     # the name the server serves
    endpoint: str
    api_key: str | None = None
    tokenizer: Any | None = None   # the model's, when this machine has it
    shared_prefix: int = 0

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    def first(self, prompt: list[int]) -> Any:
        if self.endpoint == "completions":
            return list(prompt)
        prefix, own = prompt[:self.shared_prefix], prompt[self.shared_prefix:]
        return ([{"role": "system", "content": message_text(prefix, self.tokenizer)}] if prefix else []) + \
            [{"role": "user", "content": message_text(own, self.tokenizer)}]

    def next(self, sent: Any, reply: str, message: list[int]) -> Any:
        if self.endpoint == "completions":
            return sent + (self.tokenizer.encode(reply) if reply else []) + message
        return sent + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": message_text(message, self.tokenizer)}]

    def body(self, sent: Any, max_tokens: int) -> dict[str, Any]:
        """Standard fields only, and `ignore_eos` (vLLM, SGLang and nano take it): greedy, exactly max_tokens."""
        body: dict[str, Any] = {"model": self.model, "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "completions":
            body.update(prompt=sent, max_tokens=max_tokens)
        else:
            body.update(messages=sent, max_completion_tokens=max_tokens)
        return body

    async def send(self, client: httpx.AsyncClient, sent: Any, max_tokens: int) -> HttpRecord:
        """One streamed request. A failure of any kind (no connection, an HTTP error status, an error event in
        the stream, a stream that ends without a finish reason) is the record's `error`."""
        record = HttpRecord(list(sent) if self.endpoint == "completions" else [], max_tokens)
        pieces: list[str] = []
        record.arrival_time = time.perf_counter()
        try:
            async with client.stream("POST", self.url, json=self.body(sent, max_tokens)) as response:
                if response.status_code != 200:
                    await response.aread()
                    record.error = f"HTTP {response.status_code}: {error_message(response)}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[len("data:"):].strip()
                        if data == "[DONE]":
                            break
                        self._event(record, json.loads(data), pieces, time.perf_counter())
                        if record.error:
                            break
        except httpx.HTTPError as error:
            record.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        except (ValueError, TypeError, AttributeError) as error:   # an event that is not the API's JSON
            record.error = f"a malformed event in the stream: {error}"
        record.text = "".join(pieces)
        if record.error is None and record.finish_reason is None:
            record.error = "the stream ended without a finish reason"
        if record.error is None and record.finish_reason not in ("stop", "length"):
            record.error = f"finish reason {record.finish_reason!r}"
        if record.error is not None:
            record.finish_reason = None
        usage = record.usage or {}
        if isinstance(usage.get("prompt_tokens"), int) and usage["prompt_tokens"] != len(record.prompt_token_ids):
            record.prompt_token_ids = [0] * usage["prompt_tokens"]
        completion = usage.get("completion_tokens")
        record.output_token_ids = [0] * (completion if isinstance(completion, int) else len(record.token_times))
        return record

    def _event(self, record: HttpRecord, event: dict[str, Any], pieces: list[str], now: float) -> None:
        if event.get("error") is not None or event.get("object") == "error":
            error = event.get("error", event)
            record.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        if event.get("usage"):
            record.usage = event["usage"]
        for choice in event.get("choices") or []:
            text = choice.get("text") if self.endpoint == "completions" else (choice.get("delta") or {}).get("content")
            if text:
                pieces.append(text)
                record.token_times.append(now)
            if choice.get("finish_reason"):
                record.finish_reason, record.finish_time = choice["finish_reason"], now


def error_message(response: httpx.Response) -> str:
    """The message of an error response: OpenAI's {"error": {"message"}}, or {"message"} / {"detail"}, or the
    text's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        for message in (error.get("message") if isinstance(error, dict) else error, body.get("message"),
                        body.get("detail")):
            if message:
                return str(message)
    return json.dumps(body)[:200]


def http_client(target: HttpTarget, concurrency: int) -> httpx.AsyncClient:
    """One connection per request in flight; no timeout on reading a stream (a loaded server may take long to
    answer), 30 s to connect; no proxy from the environment (it would be measured too)."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    return httpx.AsyncClient(headers=headers, trust_env=False, timeout=httpx.Timeout(None, connect=30.0),
                             limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))


async def drive_http(target: HttpTarget, workload: Workload, concurrency: int,
                     advance: Callable[[], None] = lambda: None, arrivals: list[float] | None = None
                     ) -> tuple[list[HttpRecord], float]:
    """`drive` over HTTP: one event loop, a task per conversation, at most `concurrency` in flight (a later turn
    is sent when the turn before it has ended, whatever its outcome), each no earlier than its arrival. Returns
    the records conversation by conversation, turn by turn, and the wall time."""
    done: dict[tuple[int, int], HttpRecord] = {}
    slots = asyncio.Semaphore(concurrency)
    async with http_client(target, concurrency) as client:
        start = time.perf_counter()

        async def conversation(i: int) -> None:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with slots:
                sent, output_len = target.first(workload.prompts[i]), workload.output_lens[i]
                for turn in range(workload.turns):
                    record = done[i, turn] = await target.send(client, sent, output_len)
                    advance()
                    if turn + 1 < workload.turns:
                        message, output_len = workload.later_turns[i][turn]
                        sent = target.next(sent, record.text, message)

        await asyncio.gather(*(conversation(i) for i in range(len(workload.prompts))))
        duration = time.perf_counter() - start
    return [done[i, turn] for i in range(len(workload.prompts)) for turn in range(workload.turns)], duration


METRIC_LINE = re.compile(r"^(nano_\w+)(?:\{([^}]*)\})? (\S+)$", re.M)


def nano_metrics(target: HttpTarget) -> dict[str, dict[str, float]] | None:
    """A nano server's counters from its /metrics (name -> role -> value); None from any other server."""
    try:
        response = httpx.get(f"{target.base_url}/metrics", timeout=30, trust_env=False)
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or "nano_preemptions_total" not in response.text:
        return None
    counters: dict[str, dict[str, float]] = {}
    for name, labels, value in METRIC_LINE.findall(response.text):
        role = re.search(r'role="([^"]*)"', labels or "")
        counters.setdefault(name, {})[role.group(1) if role else ""] = float(value)
    return counters


def metrics_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What a nano server's counters say about a run (after - before; every client's requests in that time):
    preemptions and integrity counts over every engine, prompt tokens computed and cached on the one that
    prefills, and the server's own mean TTFT (engine arrival -> first token) and ITL (between tokens), from its
    histograms' sums and counts."""
    def grew(name: str, roles: tuple[str, ...] | None = None) -> int:
        now, then = after.get(name, {}), before.get(name, {})
        return int(sum(value - then.get(role, 0.0) for role, value in now.items() if roles is None or role in roles))
    prefills = ("engine", "prefill")
    total = lambda counters, name: counters.get(name, {}).get("", 0.0)
    mean_ms = lambda name: (1e3 * (total(after, f"{name}_sum") - total(before, f"{name}_sum")) / count
                            if (count := grew(f"{name}_count")) else None)
    return {"preemptions": grew("nano_preemptions_total"),
            "server_latency_ms": {"ttft_mean": mean_ms("nano_time_to_first_token_seconds"),
                                  "itl_mean": mean_ms("nano_inter_token_latency_seconds")},
            "integrity": {**dict.fromkeys(INTEGRITY_KEYS), **{key: grew(f"nano_integrity_{key}_total")
                                                              for key in ("checked", "mismatched", "aborted")}},
            "prefix_cache": {**dict.fromkeys(PREFIX_KEYS), "cached_tokens": grew("nano_cached_tokens_total", prefills),
                             "prefill_tokens": grew("nano_prefill_tokens_total", prefills)}}


def measure_http(target: HttpTarget, workload: Workload, concurrency: int, warmup: Workload,
                 advance: Callable[[], None], arrivals: list[float] | None = None) -> dict[str, Any]:
    """`measure` against a server: the warm-up, then the workload, streamed and timed at the client. The
    engine's figures come from the server's /metrics when it is nano's (counted before and after the measured
    run), else they are None; `obtained` says where each kind of figure came from."""
    if warmup.prompts:
        asyncio.run(drive_http(target, warmup, concurrency))
    before = nano_metrics(target)
    records, duration = asyncio.run(drive_http(target, workload, concurrency, advance, arrivals))
    after = nano_metrics(target) if before is not None else None
    figures = summarize(records, duration, concurrency, None, workload.turns, chunked=True)
    figures["prefix_cache"] = dict.fromkeys(PREFIX_KEYS)
    figures["server_latency_ms"] = {"ttft_mean": None, "itl_mean": None}
    if before is not None and after is not None:
        figures.update(metrics_figures(before, after))
    ok = [r for r in records if r.finish_reason in ("stop", "length")]
    with_usage = sum(1 for r in ok if r.usage)
    counted = ("no request completed" if not ok else "the server's usage" if with_usage == len(ok) else
               "counted at the client: the prompt's ids (completions) and the chunks with text" if not with_usage
               else "the server's usage, else counted at the client")
    figures["output_tokens_requested"] = sum(r.max_tokens for r in ok)
    chunks = sum(len(r.token_times) for r in ok)
    figures["output_tokens_per_chunk"] = figures["output_tokens"] / chunks if chunks else None
    figures["obtained"] = {
        "latency_ms": "measured at the client: sent -> chunks with text -> the chunk with the finish reason; ITL "
                      "between chunks, TPOT over the tokens",
        "throughput": "measured at the client: completed requests' tokens over the measured run's wall time",
        "tokens": counted,
        "engine": "the server's /metrics (nano), before and after the measured run, all clients" if after is not None
                  else "not available (the server is not nano's, or its /metrics did not answer)",
    }
    return figures
