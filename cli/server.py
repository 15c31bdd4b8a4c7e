"""The OpenAI-compatible HTTP server behind `nano serve` (Starlette on uvicorn).

    POST /v1/completions        prompt (text or token ids) -> text; streamed as server-sent events, or one body
    POST /v1/chat/completions   messages, rendered with the model's chat template -> the assistant's text
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop and every process it depends on run; else 503, why
    GET  /metrics               Prometheus text: requests, KV pages, tokens, preemptions, integrity, latencies

One thread owns the engine (`LLM` or the split's `SplitLLM`) and runs its loop (`EngineLoop`): it admits new
requests and aborts from a queue, steps the engine while anything is in flight, and hands each request's new
tokens to the HTTP handler that waits on it, through that handler's asyncio queue. Handlers never touch the
engine, so requests from every client are batched together, each step, as they arrive. A client that goes away
mid-stream aborts its request, which frees its pages. A failure in one request's handling ends that request only.

What one client may take is bounded (`HttpLimits`): the time to send a request head and a body, the body's size, the
open connections; a body is parsed and tokenized on a worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from nano.disagg import SplitLLM
from nano.errors import NanoError, brief
from nano.llm import LLM, check_request_fits, encode_prompt, text_stream
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


# ---- what one client may take --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpLimits:
    """The HTTP limits (`nano serve` flags of the same names; docs/serve.md section 3)."""
    header_timeout: float = 10.0   # s from a connection's start, or its last response, to a complete request head
    body_timeout: float = 30.0     # s from the request head to the body's end
    max_body: int = 8 * 2**20      # bytes of one request body
    max_connections: int = 512     # open connections; one more is answered 503 and closed (below 1,024 descriptors)
    shutdown_timeout: float = 5.0  # s a graceful shutdown waits for the requests in flight before it cancels them


FULL_BODY = json.dumps({"error": {"message": "the server has too many open connections; retry later",
                                  "type": "server_overloaded", "param": None, "code": None}}).encode()
FULL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"retry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(FULL_BODY), FULL_BODY))


def guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request head and a cap on open connections. uvicorn times a
    connection only between a response and the next request's first byte: one that never completes its head would
    hold its descriptor for ever. Here the head must be complete `header_timeout` after the connection opened or
    the last response went out, however its bytes trickle in; else the connection is closed."""

    class Guarded(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(FULL)
                transport.close()
            else:
                self._expect_head()

        def on_response_complete(self) -> None:
            self._expect_head()   # before a pipelined request the base class may start now
            super().on_response_complete()

        def _expect_head(self) -> None:
            self.loop.call_later(limits.header_timeout, self._head_due, self.cycle)

        def _head_due(self, cycle: Any) -> None:
            if self.cycle is cycle and not self.transport.is_closing():   # no new request since
                self.transport.close()

    return Guarded


class AcceptErrors(logging.Filter):
    """At descriptor exhaustion asyncio logs a traceback for every failed accept ('socket.accept() out of system
    resource'), one per slot of the listen backlog on each retry, and schedules a retry for each; at shutdown every
    retry still pending logs one more ('Exception in callback ..._start_serving': its socket is closed). 35 MB of
    stderr in 30 s: let one line of them through per `interval` seconds, with the count since the last."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval, self.last, self.dropped = interval, -math.inf, 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if not (message.startswith(self.MESSAGE) or "._start_serving(" in message.split("\n", 1)[0]):
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.dropped += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = f"{self.MESSAGE} (or a retry of it): {error} ({self.dropped} more since the last such line)"
        record.args, record.exc_info, record.exc_text = (), None, None
        self.last, self.dropped = now, 0
        return True


ACCEPT_ERRORS = AcceptErrors()


# ---- the access log ------------------------------------------------------------------------------------------
ACCESS_LOG = logging.getLogger("nano.access")
ACCESS_SCOPE_KEY = "nano.answer"   # where a completion's handler leaves its Answer in the request's ASGI scope
ACCESS_HANDLER = logging.StreamHandler()   # stderr, one line each
ACCESS_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))


class AccessLog:
    """ASGI middleware: one line per HTTP request on the `nano.access` logger once its response has ended (a stream's
    last event sent, or its client gone): the client's address, the method and path as sent, the status, the seconds
    from the request reaching the app to its response's end (measured by this process), and for a completion its
    prompt and completion tokens and finish reason."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 500   # 500: no response began (the app raised)

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            ACCESS_LOG.info(access_line(scope, status, time.monotonic() - start))


def access_line(scope: dict[str, Any], status: int, seconds: float) -> str:
    """`127.0.0.1:53412 "POST /v1/completions" 200 0.412 s prompt=8 completion=12 finish=length`. The path is the
    one sent (h11 lets through only visible ASCII there: one line whatever the client sends)."""
    client = scope.get("client")
    path = scope.get("raw_path") or scope["path"].encode("unicode_escape")
    query = scope.get("query_string") or b""
    target = (path + b"?" + query if query else path).decode("latin-1")
    line = f'{f"{client[0]}:{client[1]}" if client else "-"} "{scope["method"]} {target}" {status} {seconds:.3f} s'
    answer = scope.get(ACCESS_SCOPE_KEY)
    if answer is not None:
        usage = answer.usage()
        line += (f" prompt={usage['prompt_tokens']} completion={usage['completion_tokens']}"
                 f" finish={answer.finish_reason or 'none'}")
    return line


# ---- the engine loop ---------------------------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class Stream:
    """One request's link between its HTTP handler and the engine thread."""
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[tuple[str, Any]], None]   # called on the engine thread: ("tokens", ids) or ("end", info)
    request: Any = None                          # the engine's Request (or the split's SplitRequest), once admitted
    sent: int = 0                                # output tokens already delivered
    stop_strings: bool = False                   # its handler cuts the text at stop strings: the handler counts its end
    counted: bool = False                        # its end is in EngineLoop.finished


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

    def count(self, stream: Stream, reason: str) -> None:
        """Count a request's end in `finished`, once: under the reason its client is given (the first call wins)."""
        with self.lock:
            if not stream.counted:
                stream.counted = True
                self.finished[reason] = self.finished.get(reason, 0) + 1

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
                    self.front.poll()   # the one failure that stops the loop: the engine as a whole broke
                    self._deliver()
        except BaseException as error:   # every waiting client gets the error, then 503s
            with self.lock:   # from here on submit() and counters() refuse: nothing new reaches the queue
                self.error = f"the engine stopped: {type(error).__name__}: {brief(error)}"
            for stream in self.live:
                self._end(stream, {"finish_reason": "abort", "error": self.error})
            self.live.clear()
            while True:       # and what was queued before gets the error too
                try:
                    command, value = self.commands.get_nowait()
                except queue.Empty:
                    return
                if command == "submit":
                    self._end(value, {"finish_reason": "abort", "error": self.error})
                elif command == "counters":
                    value.set_exception(ApiError(503, self.error, "server_error"))

    def _handle(self, command: str, value: Any) -> None:
        """One command. A failure here is that request's (or that scrape's): it ends with the error."""
        if command == "submit":
            stream: Stream = value
            try:
                stream.request = self.front.submit(stream.prompt_ids, stream.params)
            except Exception as error:   # a NanoError is the request's fault; anything else is still only its own
                self._end(stream, {"finish_reason": "abort", "error": failure(error)})
                return
            self.live.append(stream)
        elif command == "abort":
            stream, reason = value
            try:
                if stream.request is not None and not stream.request.finished:
                    self.front.abort(stream.request, reason)
            except Exception as error:
                if stream in self.live:
                    self.live.remove(stream)
                    self._fail(stream, error)
            self._deliver()
        elif command == "counters":
            try:
                value.set_result(self.front.counters())
            except Exception as error:
                value.set_exception(ApiError(500, failure(error), "server_error"))

    def _deliver(self) -> None:
        """Hand every live request its new tokens; end the finished ones, and any whose handling fails."""
        still = []
        for stream in self.live:
            try:
                if not self._advance(stream):
                    still.append(stream)
            except Exception as error:
                self._fail(stream, error)
        self.live = still

    def _advance(self, stream: Stream) -> bool:
        """Deliver one request's new tokens, and its end once finished (then True)."""
        request = stream.request
        tokens = request.output_token_ids
        if len(tokens) > stream.sent:
            stream.deliver(("tokens", list(tokens[stream.sent:])))
            stream.sent = len(tokens)
        if not request.finished:
            return False
        if not stream.stop_strings:   # else its handler counts it: the stop string may come in these last tokens
            self.count(stream, request.finish_reason)
        times = request.token_times
        if times:
            self.ttft.observe(times[0] - request.arrival_time)
        for earlier, later in zip(times, times[1:]):
            self.itl.observe(later - earlier)
        self._end(stream, {"finish_reason": request.finish_reason, "error": request.error,
                           "completion_tokens": len(tokens)})
        return True

    def _fail(self, stream: Stream, error: Exception) -> None:
        """One live request's handling failed (aborting it, or handing it its tokens): end it in the engine and
        end its stream with the error (the caller takes it off `live`); the others go on. Its handler may be gone:
        that is the usual cause."""
        message = failure(error)
        if stream.request is not None and not stream.request.finished:
            with contextlib.suppress(Exception):
                self.front.abort(stream.request, message)
        self.count(stream, "abort")
        self._end(stream, {"finish_reason": "abort", "error": message})

    def _end(self, stream: Stream, info: dict[str, Any]) -> None:
        """A stream's last event, once: it no longer counts as pending. A handler whose event loop has closed
        (the server is shutting down) cannot take it, and needs it no more."""
        with self.lock:
            self.pending -= 1
        with contextlib.suppress(Exception):
            stream.deliver(("end", info))


def failure(error: Exception) -> str:
    """An exception as one line for the client: a NanoError says it all; anything else names its type."""
    return brief(error) if isinstance(error, NanoError) else f"internal error: {type(error).__name__}: {brief(error)}"


# ---- requests: parse and check the JSON body -----------------------------------------------------------------
KNOWN_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "max_tokens": (int,), "max_completion_tokens": (int,), "temperature": (int, float),
    "top_p": (int, float), "top_k": (int,), "seed": (int,), "n": (int,), "stream": (bool,),
    "stop": (str, list), "ignore_eos": (bool,), "stream_options": (dict,),
}


COMPLETIONS_MAX_TOKENS = 16   # OpenAI's default max_tokens on /v1/completions; chat's is all the room left


@dataclass(frozen=True)
class Completion:
    """A parsed request: what to run and how to answer."""
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool


def parse_request(body: Any, chat: bool, front: Front, model_name: str, longest_token: int) -> Completion:
    """A decoded JSON body as a checked request, or an ApiError. `longest_token`: the most bytes one token stands for
    (the prompt's length is checked from its bytes before it is tokenized)."""
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
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    limit = front.max_request_tokens
    refuse_unless_fits(least_prompt_tokens(body, chat, longest_token), max_tokens, limit, front.max_context,
                       at_least=True)
    prompt_ids = chat_prompt(body, front) if chat else completion_prompt(body, front)
    refuse_unless_fits(len(prompt_ids), max_tokens, limit, front.max_context)
    room = limit - len(prompt_ids)
    params = sampling_params(body, max_tokens or (room if chat else min(COMPLETIONS_MAX_TOKENS, room)))
    options = body.get("stream_options") or {}
    return Completion(prompt_ids, params, stop, bool(body.get("stream")), bool(options.get("include_usage")), chat)


def refuse_unless_fits(prompt_tokens: int, max_tokens: int | None, limit: int, context: int,
                       at_least: bool = False) -> None:
    """400 unless the prompt (`prompt_tokens`, or at least that many) and max_tokens fit the `limit` of one request
    (front.max_request_tokens): nano chat's check (nano.llm.check_request_fits), answered as HTTP."""
    try:
        check_request_fits(prompt_tokens, max_tokens, limit, context, at_least)
    except NanoError as error:
        raise ApiError(400, str(error), param="max_tokens" if max_tokens else "prompt") from None


def least_prompt_tokens(body: dict[str, Any], chat: bool, longest_token: int) -> int:
    """A lower bound on the prompt's tokens, from its size: a list of ids has its length; text of B UTF-8 bytes has
    at least ceil(B / longest_token) tokens (no token stands for more bytes); a chat, at least its contents'.
    0 for a malformed prompt (the parse says what is wrong with it)."""
    if chat:
        messages = body.get("messages")
        texts = []
        for message in messages if isinstance(messages, list) else []:
            with contextlib.suppress(ApiError):
                texts.append(message_text(message.get("content") if isinstance(message, dict) else None, ""))
    else:
        prompt = prompt_field(body)
        if isinstance(prompt, list):
            return len(prompt)
        texts = [prompt]
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts if isinstance(text, str))
    return -(-size // longest_token)


def sampling_params(body: dict[str, Any], max_tokens: int) -> SamplingParams:
    """The request's sampling parameters; without a `seed`, a fresh one for each reply (`SamplingParams.seeded`)."""
    given = lambda name, default: default if body.get(name) is None else body[name]
    try:
        return SamplingParams(temperature=float(given("temperature", 1.0)), top_p=float(given("top_p", 1.0)),
                              top_k=given("top_k", 0), seed=body.get("seed"), max_tokens=max_tokens,
                              ignore_eos=bool(body.get("ignore_eos"))).seeded()
    except OverflowError:   # an integer too large for a float
        raise ApiError(400, "'temperature' and 'top_p' must be numbers a float can hold") from None
    except NanoError as error:
        raise ApiError(400, str(error)) from None


def prompt_field(body: dict[str, Any]) -> Any:
    """The completion's prompt: a string or a list of ids, or a batch of one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def completion_prompt(body: dict[str, Any], front: Front) -> list[int]:
    prompt = prompt_field(body)
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
                or "content" not in message:
            raise ApiError(400, f"messages[{i}] must be an object with a role (system, user or assistant) and "
                                f"content (a string, or a list of text parts)", param="messages")
        plain.append({"role": message["role"], "content": message_text(message["content"], f"messages[{i}].content")})
    try:
        return checked_prompt(front.tokenizer.encode_chat(plain), front)
    except NanoError as error:
        raise ApiError(400, str(error), param="messages") from None


def message_text(content: Any, where: str) -> str:
    """A chat message's content as text: a string, or OpenAI's list of content parts, whose text parts
    (`{"type": "text", "text": ...}`) are joined with newlines, as vLLM joins them. Parts of other types (images,
    audio, files) are refused: the models served read text only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param="messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is None:
            raise ApiError(400, f"{where}[{j}] must be an object with a type", param="messages")
        if kind != "text":
            raise ApiError(400, f"{where}[{j}] is of type {kind!r:.40}: this server takes text parts only "
                                f"(type 'text')", param="messages")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}].text must be a string", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


def checked_prompt(prompt: str | list[int], front: Front) -> list[int]:
    try:
        return encode_prompt(prompt, "prompt", front.tokenizer, front.config)
    except NanoError as error:
        raise ApiError(400, str(error), param="prompt") from None


# ---- answers -----------------------------------------------------------------------------------------------------
class Server:
    """The routes, over one EngineLoop."""

    def __init__(self, front: Front, model_name: str, api_key: str | None, max_queue: int,
                 max_running: int = 256, limits: HttpLimits = HttpLimits(), access_log: bool = True) -> None:
        """`max_running` + `max_queue`: the requests in flight beyond which new ones get 503 (the engine's
        --max-running, and the waiting room the server allows beyond it). `access_log`: one line per request on
        stderr (`AccessLog`)."""
        self.front, self.model_name, self.api_key, self.limits = front, model_name, api_key, limits
        self.access_log = access_log
        self.loop = EngineLoop(front, max_queue, max_running)
        self.longest_token = max(map(len, front.tokenizer.token_bytes()))
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={404: self.not_found, 405: self.not_allowed,
                                                       Exception: self.internal_error})

    def uvicorn_config(self, **options: Any) -> uvicorn.Config:
        """uvicorn's settings for this app: the h11 protocol with the head deadline and the connection cap, a
        bounded graceful shutdown (one Ctrl-C stops the server), accept errors logged once per interval."""
        logging.getLogger("asyncio").addFilter(ACCEPT_ERRORS)   # once: a filter already there is not added again
        if self.access_log:   # (uvicorn's own access log stays off: it has neither durations nor tokens)
            ACCESS_LOG.addHandler(ACCESS_HANDLER)   # once: a handler already there is not added again
            ACCESS_LOG.setLevel(logging.INFO)
            ACCESS_LOG.propagate = False
        app = AccessLog(self.app) if self.access_log else self.app
        return uvicorn.Config(app, http=guarded_protocol(self.limits), loop="asyncio", log_level="warning",
                              access_log=False, timeout_graceful_shutdown=self.limits.shutdown_timeout,
                              **options)

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
                                                         "max_model_len": self.front.max_request_tokens}]})

    async def health(self, http: HttpRequest) -> Response:
        """200 "ok"; 503 with the reason when the engine loop has stopped or a process the front needs is gone."""
        reason = self.loop.error or ("the engine loop is not running" if not self.loop.thread.is_alive()
                                     else self.front.health())
        return error_response(503, reason, "server_error") if reason else PlainTextResponse("ok")

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
        given = http.headers.get("authorization", "").encode("latin-1")   # the header's own bytes (Starlette
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):   # decodes them as latin-1)
            return error_response(401, "a valid API key is required: Authorization: Bearer <key>",
                                  "authentication_error", code="invalid_api_key")
        return None

    async def _complete(self, http: HttpRequest, chat: bool) -> Response:
        if (denied := self._denied(http)) is not None:
            return denied
        try:
            request = await asyncio.to_thread(self._parse, await self._body(http), chat)
            events: asyncio.Queue = asyncio.Queue()
            running = asyncio.get_running_loop()
            stream = Stream(request.prompt_ids, request.params,
                            lambda event: running.call_soon_threadsafe(events.put_nowait, event),
                            stop_strings=bool(request.stop))
            self.loop.submit(stream)
        except ApiError as error:
            return error.response()
        answer = Answer(self, request, stream, events, chat, http)
        if request.stream:
            return StreamingResponse(answer.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.body()

    async def _body(self, http: HttpRequest) -> bytes:
        """The request body, read as a stream: 413 past --max-body (from Content-Length at once), 408 when it has
        not all come within --body-timeout of the request head."""
        limits, chunks, size = self.limits, [], 0
        too_large = ApiError(413, f"the request body is larger than this server's limit of {limits.max_body} bytes")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body:
            raise too_large

        async def read() -> None:
            nonlocal size
            async for chunk in http.stream():
                size += len(chunk)
                if size > limits.max_body:
                    raise too_large
                chunks.append(chunk)
        try:
            await asyncio.wait_for(read(), limits.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.body_timeout:g} s") from None
        except ClientDisconnect:
            raise ApiError(400, "the client closed the connection before the body ended") from None
        return b"".join(chunks)

    def _parse(self, body: bytes, chat: bool) -> Completion:
        """The body as a checked request; on a worker thread, so that decoding and tokenizing never hold up the
        event loop (a prompt too long for the server is refused from its size before it is tokenized)."""
        try:
            decoded = json.loads(body)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as error:   # not JSON, not UTF-8, or an integer of more digits than Python converts
            raise ApiError(400, f"the request body is not valid JSON: {error}") from None
        return parse_request(decoded, chat, self.front, self.model_name, self.longest_token)


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
        self.finish_reason: str | None = None   # the one the client is given, once known
        http.scope[ACCESS_SCOPE_KEY] = self     # what the access log reads at the response's end

    async def _pieces(self) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
        """(new text, None) while tokens come, then ("", end info) once."""
        while True:
            kind, value = await self.events.get()
            if kind == "tokens":
                self.completion_tokens += len(value)
                new = self.text.add(value)
                if self.text.stopped:   # a stop string: the rest is not wanted, free the pages now
                    self._ended("stop")   # (before the abort: the request ends as a "stop" whatever comes first)
                    self.server.loop.abort(self.stream, "a stop string was generated")
                    yield new, {"finish_reason": "stop", "error": None}
                    return
                if new:
                    yield new, None
            else:
                self._ended(value["finish_reason"])
                yield self.text.finish(), value
                return

    def _ended(self, reason: str) -> None:
        """The request's finish reason as its client gets it, once: /metrics counts it, the access log prints it."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.server.loop.count(self.stream, reason)

    def _give_up(self, why: str) -> None:
        """The handler ends before the request did (its client left, or a bug): an abort, counted as one."""
        if self.finish_reason is None:
            self._ended("abort")
            self.server.loop.abort(self.stream, why)

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
        try:
            if self.chat:
                yield self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])
            async for text, end in self._pieces():
                if end is None:
                    yield self._chunk([self._choice(text, None, delta=True)])
                    continue
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
        finally:   # the client went away before the end: its request is aborted
            self._give_up("the client closed the stream")

    async def body(self) -> Response:
        text, end = "", None
        watcher = asyncio.ensure_future(self._abort_when_the_client_leaves())
        try:
            async for piece, end in self._pieces():   # noqa: B007 (`end`: the last piece's, read below)
                text += piece
        finally:
            watcher.cancel()
            self._give_up("its handler ended before it")   # (a failure, or the server's shutdown)
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

