"""The OpenAI-compatible HTTP server behind `nano serve` (Starlette on uvicorn).

    POST /v1/completions        prompt (text or token ids) -> text; streamed as server-sent events, or one body
    POST /v1/chat/completions   messages, rendered with the model's chat template -> the assistant's text
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs
    GET  /metrics               Prometheus text: requests, KV pages, tokens, preemptions, integrity, latencies

One thread owns the engine (`LLM` or the split's `SplitLLM`) and runs its loop (`EngineLoop`): it admits new
requests and aborts from a queue, steps the engine while anything is in flight, and hands each request's new
tokens to the HTTP handler that waits on it, through that handler's asyncio queue. Handlers never touch the
engine, so requests from every client are batched together, each step, as they arrive. A client that goes away
mid-stream aborts its request, which frees its pages.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import hmac
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nano.disagg import SplitLLM
from nano.errors import NanoError
from nano.llm import LLM, encode_prompt, text_stream
from nano.sampling import SamplingParams

Front = LLM | SplitLLM
# Prometheus histogram bounds, in seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ApiError(Exception):
    """An error the client caused (or a full queue): an OpenAI-style JSON body with this status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), self.kind, self.param, self.code, self.headers)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


# ---- the engine loop ---------------------------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class Stream:
    """One request's link between its HTTP handler and the engine thread."""
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[tuple[str, Any]], None]   # called on the engine thread: ("tokens", ids) or ("end", info)
    request: Any = None                          # the engine's Request (or the split's SplitRequest), once admitted
    sent: int = 0                                # output tokens already delivered
    stopped: bool = False                        # its handler found a stop string and ended it: a "stop", not an abort


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.samples += 1


class EngineLoop:
    """The thread that owns the engine. Everything else talks to it through `commands`."""

    def __init__(self, front: Front, max_queue: int, max_running: int = 256) -> None:
        self.front, self.max_queue, self.max_running = front, max_queue, max_running
        self.commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.live: list[Stream] = []
        self.pending = 0              # streams submitted by handlers and not yet ended
        self.lock = threading.Lock()  # guards `pending`, counted up by handlers and down by the engine thread
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="nano-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.commands.put(("stop", None))
        self.thread.join(timeout=30)

    def submit(self, stream: Stream) -> None:
        """Queue a request; 503 when the engine already has `max_running` running and `max_queue` waiting."""
        with self.lock:
            if self.error:
                raise ApiError(503, self.error, "server_error")
            if self.pending >= self.capacity:
                raise ApiError(503, f"the server is at capacity ({self.pending} requests in flight); retry later",
                               "server_overloaded", headers={"Retry-After": "1"})
            self.pending += 1
        self.commands.put(("submit", stream))

    @property
    def capacity(self) -> int:
        return self.max_queue + self.max_running

    def abort(self, stream: Stream, reason: str) -> None:
        self.commands.put(("abort", (stream, reason)))

    def counters(self) -> Future:
        """The engine's counters, read on the engine thread (a future the handler awaits)."""
        future: Future = Future()
        with self.lock:
            if self.error:
                future.set_exception(ApiError(503, self.error, "server_error"))
            else:
                self.commands.put(("counters", future))
        return future

    def _run(self) -> None:
        try:
            while True:
                block = not self.live
                while True:
                    try:
                        command, value = self.commands.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    if command == "stop":
                        return
                    self._handle(command, value)
                if self.live:
                    self.front.poll()
                    self._deliver()
        except BaseException as error:   # the engine broke: every waiting client gets the error, then 503s
            with self.lock:   # from here on submit() and counters() refuse: nothing new reaches the queue
                self.error = f"the engine stopped: {type(error).__name__}: {error}"
            for stream in self.live:
                stream.deliver(("end", {"finish_reason": "abort", "error": self.error}))
            self.live.clear()
            while True:       # and what was queued before gets the error too
                try:
                    command, value = self.commands.get_nowait()
                except queue.Empty:
                    return
                if command == "submit":
                    value.deliver(("end", {"finish_reason": "abort", "error": self.error}))
                elif command == "counters":
                    value.set_exception(ApiError(503, self.error, "server_error"))

    def _handle(self, command: str, value: Any) -> None:
        if command == "submit":
            stream: Stream = value
            try:
                stream.request = self.front.submit(stream.prompt_ids, stream.params)
            except NanoError as error:
                with self.lock:
                    self.pending -= 1
                stream.deliver(("end", {"finish_reason": "abort", "error": str(error)}))
                return
            self.live.append(stream)
        elif command == "abort":
            stream, reason = value
            if stream.request is not None and not stream.request.finished:
                self.front.abort(stream.request, reason)
            self._deliver()
        elif command == "counters":
            value.set_result(self.front.counters())

    def _deliver(self) -> None:
        """Hand every live request its new tokens; end the finished ones."""
        still = []
        for stream in self.live:
            request = stream.request
            tokens = request.output_token_ids
            if len(tokens) > stream.sent:
                stream.deliver(("tokens", list(tokens[stream.sent:])))
                stream.sent = len(tokens)
            if not request.finished:
                still.append(stream)
                continue
            with self.lock:
                self.pending -= 1
            reason = "stop" if stream.stopped else request.finish_reason
            self.finished[reason] = self.finished.get(reason, 0) + 1
            times = request.token_times
            if times:
                self.ttft.observe(times[0] - request.arrival_time)
            for earlier, later in zip(times, times[1:]):
                self.itl.observe(later - earlier)
            stream.deliver(("end", {"finish_reason": request.finish_reason, "error": request.error,
                                    "completion_tokens": len(tokens)}))
        self.live = still


# ---- requests: parse and check the JSON body -----------------------------------------------------------------
KNOWN_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "max_tokens": (int,), "max_completion_tokens": (int,), "temperature": (int, float),
    "top_p": (int, float), "top_k": (int,), "seed": (int,), "n": (int,), "stream": (bool,),
    "stop": (str, list), "ignore_eos": (bool,), "stream_options": (dict,),
}


@dataclass(frozen=True)
class Completion:
    """A parsed request: what to run and how to answer."""
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool


def parse_request(body: Any, chat: bool, front: Front, model_name: str) -> Completion:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, kinds in KNOWN_TYPES.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}", param=name)
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"the model '{body['model']}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    prompt_ids = chat_prompt(body, front) if chat else completion_prompt(body, front)
    pool = getattr(front, "pool", None)   # one process: the prompt must fit its KV pool (the split checks its own)
    if pool is not None and len(prompt_ids) + 1 > pool.tokens:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) does not fit this server's KV pool "
                            f"({pool.tokens} tokens)", param="prompt")
    room = front.max_context - len(prompt_ids)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"this model's context is {front.max_context} tokens; the prompt takes "
                            f"{len(prompt_ids)} and max_tokens asks for {max_tokens}", param="max_tokens")
    try:
        params = SamplingParams(temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                                top_k=body.get("top_k", 0), seed=body.get("seed"), max_tokens=max_tokens or room,
                                ignore_eos=body.get("ignore_eos", False))
    except NanoError as error:
        raise ApiError(400, str(error)) from None
    options = body.get("stream_options") or {}
    return Completion(prompt_ids, params, stop, bool(body.get("stream")), bool(options.get("include_usage")), chat)


def completion_prompt(body: dict[str, Any], front: Front) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]    # a batch of one
    if not isinstance(prompt, (str, list)):
        raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    return checked_prompt(prompt, front)


def chat_prompt(body: dict[str, Any], front: Front) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant") \
                or not isinstance(message.get("content"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role (system, user or assistant) and "
                                f"string content", param="messages")
        plain.append({"role": message["role"], "content": message["content"]})
    try:
        return checked_prompt(front.tokenizer.encode_chat(plain), front)
    except NanoError as error:
        raise ApiError(400, str(error), param="messages") from None


def checked_prompt(prompt: str | list[int], front: Front) -> list[int]:
    try:
        return encode_prompt(prompt, "prompt", front.tokenizer, front.config)
    except NanoError as error:
        raise ApiError(400, str(error), param="prompt") from None


# ---- answers -----------------------------------------------------------------------------------------------------
class Server:
    """The routes, over one EngineLoop."""

    def __init__(self, front: Front, model_name: str, api_key: str | None, max_queue: int,
                 max_running: int = 256) -> None:
        """`max_running` + `max_queue`: the requests in flight beyond which new ones get 503 (the engine's
        --max-running, and the waiting room the server allows beyond it)."""
        self.front, self.model_name, self.api_key = front, model_name, api_key
        self.loop = EngineLoop(front, max_queue, max_running)
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={404: self.not_found, 405: self.not_allowed,
                                                       Exception: self.internal_error})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The engine thread runs while the app does."""
        self.loop.start()
        try:
            yield
        finally:
            self.loop.stop()

    # ---- routes ----------------------------------------------------------------------------------------------
    async def completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, chat=False)

    async def chat_completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, chat=True)

    async def models(self, http: HttpRequest) -> Response:
        if (denied := self._denied(http)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "nano",
                                                         "max_model_len": self.front.max_context}]})

    async def health(self, http: HttpRequest) -> Response:
        if self.loop.error:
            return error_response(503, self.loop.error, "server_error")
        return PlainTextResponse("ok")

    async def metrics(self, http: HttpRequest) -> Response:
        try:
            counters = await asyncio.wrap_future(self.loop.counters())
        except ApiError as error:
            return error.response()
        return PlainTextResponse(prometheus(counters, self.loop, self.front), media_type="text/plain; version=0.0.4")

    async def not_found(self, http: HttpRequest, exc: Exception) -> Response:
        return error_response(404, f"no route {http.method} {http.url.path}", code="not_found")

    async def not_allowed(self, http: HttpRequest, exc: Exception) -> Response:
        return error_response(405, f"{http.method} is not allowed on {http.url.path}")

    async def internal_error(self, http: HttpRequest, exc: Exception) -> Response:
        """A bug in a handler: that request gets a 500 JSON error; the server and the engine go on."""
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    # ---- one completion --------------------------------------------------------------------------------------
    def _denied(self, http: HttpRequest) -> Response | None:
        if self.api_key is None:
            return None
        given = http.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return error_response(401, "a valid API key is required: Authorization: Bearer <key>",
                                  "authentication_error", code="invalid_api_key")
        return None

    async def _complete(self, http: HttpRequest, chat: bool) -> Response:
        if (denied := self._denied(http)) is not None:
            return denied
        try:
            try:
                body = json.loads(await http.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ApiError(400, f"the request body is not valid JSON: {error}") from None
            request = parse_request(body, chat, self.front, self.model_name)
            events: asyncio.Queue = asyncio.Queue()
            running = asyncio.get_running_loop()
            stream = Stream(request.prompt_ids, request.params,
                            lambda event: running.call_soon_threadsafe(events.put_nowait, event))
            self.loop.submit(stream)
        except ApiError as error:
            return error.response()
        answer = Answer(self, request, stream, events, chat, http)
        if request.stream:
            return StreamingResponse(answer.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.body()


class Answer:
    """The reply to one completion request, streamed or whole."""

    def __init__(self, server: Server, request: Completion, stream: Stream, events: asyncio.Queue,
                 chat: bool, http: HttpRequest) -> None:
        self.server, self.request, self.stream, self.events, self.chat = server, request, stream, events, chat
        self.http = http
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text = text_stream(server.front.tokenizer, server.front.config, request.params, request.stop)
        self.completion_tokens = 0

    async def _pieces(self) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
        """(new text, None) while tokens come, then ("", end info) once."""
        while True:
            kind, value = await self.events.get()
            if kind == "tokens":
                self.completion_tokens += len(value)
                new = self.text.add(value)
                if self.text.stopped:   # a stop string: the rest is not wanted, free the pages now
                    self.stream.stopped = True
                    self.server.loop.abort(self.stream, "a stop string was generated")
                    yield new, {"finish_reason": "stop", "error": None}
                    return
                if new:
                    yield new, None
            else:
                if value["finish_reason"] == "abort" and self.text.stopped:
                    value = {**value, "finish_reason": "stop", "error": None}
                yield self.text.finish(), value
                return

    async def _abort_when_the_client_leaves(self) -> None:
        """A whole-body request whose client hung up is aborted (a stream's is, when its generator is closed)."""
        while not await self.http.is_disconnected():
            await asyncio.sleep(0.25)
        self.server.loop.abort(self.stream, "the client closed the connection")

    def usage(self) -> dict[str, int]:
        prompt = len(self.request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def _choice(self, text: str, finish_reason: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        content = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
        return {"index": 0, ("delta" if delta else "message"): content, "logprobs": None,
                "finish_reason": finish_reason}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        ended = False
        try:
            if self.chat:
                yield self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])
            async for text, end in self._pieces():
                if end is None:
                    yield self._chunk([self._choice(text, None, delta=True)])
                    continue
                ended = True
                if end["finish_reason"] == "abort":
                    if text:
                        yield self._chunk([self._choice(text, None, delta=True)])
                    error = {"message": end["error"] or "the request was aborted", "type": "server_error",
                             "param": None, "code": "aborted"}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                else:
                    yield self._chunk([self._choice(text, end["finish_reason"], delta=True)])
                    if self.request.include_usage:
                        yield self._chunk([], self.usage())
                yield "data: [DONE]\n\n"
        finally:   # the client went away (or the stream ended): a request still running is aborted
            if not ended:
                self.server.loop.abort(self.stream, "the client closed the stream")

    async def body(self) -> Response:
        text, end = "", None
        watcher = asyncio.ensure_future(self._abort_when_the_client_leaves())
        try:
            async for piece, end in self._pieces():   # noqa: B007 (`end`: the last piece's, read below)
                text += piece
        finally:
            watcher.cancel()
        if end["finish_reason"] == "abort":
            return error_response(500, end["error"] or "the request was aborted", "server_error", code="aborted")
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.server.model_name,
                             "choices": [self._choice(text, end["finish_reason"], delta=False)],
                             "usage": self.usage()})


# ---- /metrics ----------------------------------------------------------------------------------------------------
def prometheus(counters: dict[str, Any], loop: EngineLoop, front: Front) -> str:
    """The Prometheus text format: gauges and counters from the engine, histograms from the loop."""
    engines = counters if isinstance(front, SplitLLM) else {"engine": counters}
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP nano_{name} {help_text}", f"# TYPE nano_{name} {kind}"])
        lines.extend(f"nano_{name}{labels} {value}" for labels, value in samples)

    by_role = lambda key: [(f'{{role="{role}"}}', c.get(key, 0)) for role, c in engines.items()]
    running = sum(1 for stream in loop.live if stream.request is not None)
    metric("requests_running", "gauge", "Requests the server has handed to the engine and not ended.",
           [("", running)])
    metric("requests_waiting", "gauge", "Requests accepted but not yet handed to the engine.",
           [("", max(0, loop.pending - running))])
    metric("requests_finished_total", "counter", "Requests ended, by finish reason.",
           [(f'{{reason="{reason}"}}', count) for reason, count in loop.finished.items()])
    metric("kv_pages_used", "gauge", "KV pages referenced by requests.",
           [(f'{{role="{role}"}}', c["num_pages"] - c["free_pages"]) for role, c in engines.items()])
    metric("kv_pages_free", "gauge", "KV pages free or evictable (cached, unreferenced).", by_role("free_pages"))
    for key, help_text in (("prefill_tokens", "Prompt tokens computed in prefill."),
                           ("decode_tokens", "Tokens computed in decode steps."),
                           ("cached_tokens", "Prompt tokens taken from the prefix cache."),
                           ("preemptions", "Requests preempted."), ("checked", "Integrity: request rows checked."),
                           ("mismatched", "Integrity: page entries that did not match."),
                           ("aborted", "Integrity: requests aborted.")):
        name = key if key not in ("checked", "mismatched", "aborted") else f"integrity_{key}"
        metric(f"{name}_total", "counter", help_text, by_role(key))
    for name, help_text, histogram in (("time_to_first_token_seconds", "Arrival to first token.", loop.ttft),
                                       ("inter_token_latency_seconds", "Gap between consecutive tokens.", loop.itl)):
        lines.extend([f"# HELP nano_{name} {help_text}", f"# TYPE nano_{name} histogram"])
        cumulative = 0
        for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts):
            cumulative += count
            lines.append(f'nano_{name}_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}} {cumulative}')
        lines += [f"nano_{name}_sum {histogram.total}", f"nano_{name}_count {histogram.samples}"]
    return "\n".join(lines) + "\n"

