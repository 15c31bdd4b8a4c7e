"""`SplitLLM`: the same submit/poll/generate/stream API as `LLM`, served by a prefill and a decode worker.

The front runs in the caller's process. It owns the request records, the staging slots and the event loop:
queued requests get a free slot and go to the prefill worker; a `Prefilled` transfer gives the first token and is
forwarded to the decode worker; tokens and the end come back from there. A slot is reused only after the decode
side has copied out of it, or when no live worker can still touch it, so nothing writes into a slot being read.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import torch

from nano.disagg import protocol as p
from nano.disagg.supervisor import Supervisor
from nano.engine import EngineConfig
from nano.errors import NanoError, UsageError
from nano.llm import RequestOutput, encode_request, resolve_config, text_stream
from nano.sampling import SamplingParams
from nano.scheduler import latency_metrics
from nano.settings import TRANSPORTS
from nano.tokenizer import load_tokenizer

@dataclass(eq=False, slots=True)
class SplitRequest:
    """The front's record of one request; it reads like the engine's `Request` (same timing fields), so code
    that measures requests (nano bench) takes either."""
    front_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int
    stage: str = "queued"          # queued -> prefill -> decode -> done
    slot: int | None = None
    stage_since: float = field(default_factory=time.perf_counter)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output else None

    @property
    def error(self) -> str | None:
        return self.output.error if self.output else None


@dataclass(slots=True)
class TransferStats:
    transfers: int = 0
    bytes: int = 0            # KV payload moved
    pack_s: float = 0.0       # prefill: export into the buffer + checksum
    unpack_s: float = 0.0     # decode: receive + checksum + copy into its pages (with any dtype conversion)

    @property
    def gb_per_s(self) -> float:
        seconds = self.pack_s + self.unpack_s
        return self.bytes / seconds / 1e9 if seconds else 0.0


class SplitLLM(Supervisor):
    """The front. transport "shm": KV through shared-memory staging slots (both workers on this host). "gloo": KV
    over torch.distributed point to point; the workers find the front's TCPStore at MASTER_ADDR / MASTER_PORT
    (default 127.0.0.1 and a free port) and may run on other hosts. Control always goes over a TCP socket to
    `listen`, authenticated with NANO_DISAGG_KEY. Roles not in `spawn` connect by themselves. `dtype` None is
    LLM's default (float32 on CPU, bfloat16 on GPU)."""

    def __init__(self, model: str, config: EngineConfig | None = None, *, prefill_kv_dtype: str = "bf16",
                 decode_kv_dtype: str = "fp8", staging_slots: int = 8, slot_bytes: int = 32 * 2**20,
                 timeout_s: float = 120.0, transport: str = "shm", listen: tuple[str, int] = ("127.0.0.1", 0),
                 spawn: Sequence[str] = p.ROLES, **settings: Any) -> None:
        """`config` (or keyword `settings`, as for LLM) is both workers' EngineConfig, except each worker's weights
        (`prefill_weights`, `decode_weights`: default bf16 and int4) and KV dtype (`prefill_kv_dtype`,
        `decode_kv_dtype`); `threads` applies to each worker (default: half of this process's)."""
        config = (config or EngineConfig()).replace(**settings)
        if transport not in TRANSPORTS:
            raise NanoError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        if set(spawn) - set(p.ROLES):
            raise NanoError(f"spawn takes roles from {', '.join(p.ROLES)}, not {', '.join(set(spawn) - set(p.ROLES))}")
        if transport == "shm" and set(spawn) != set(p.ROLES):
            raise NanoError("a worker on another host needs transport 'gloo' (shared memory is one host's)")
        configs = self.worker_configs(config, prefill_kv_dtype, decode_kv_dtype)
        resolved, self.config = resolve_config(model, config.weights_dir)
        for worker_config in configs.values():
            worker_config.check(pools=len(spawn))
            worker_config.check_fits(self.config)
        self.tokenizer = load_tokenizer(resolved.path, self.config)
        self.max_context = self.config.max_position_embeddings
        self.transport, self.timeout_s, self.slots = transport, timeout_s, staging_slots
        self.held: dict[int, str] = {}         # staging slot -> the role that may still write or read it
        self.requests: dict[int, SplitRequest] = {}
        self.queue: deque[SplitRequest] = deque()
        self.stats = TransferStats()
        self.replies: dict[str, dict[str, Any]] = {}   # counters the workers sent, by role
        self.generation = 0                    # gloo: bumped whenever a worker is replaced
        self._next_id = 0
        try:
            self._start_workers(model, configs, transport, spawn, listen, staging_slots, slot_bytes)
        except BaseException:
            self.close()
            raise
        self.label = self.info["decode"]["label"]

    @staticmethod
    def worker_configs(config: EngineConfig, prefill_kv_dtype: str, decode_kv_dtype: str,
                       name: Callable[[str], str] = str) -> dict[str, EngineConfig]:
        """Each worker's EngineConfig: its phase's weights and KV dtype. The prefill worker keeps the prefix cache;
        the decode worker imports every prompt's KV, so it would never look one up. `name` spells a setting in an
        error (EngineConfig.check)."""
        stored = None if config.weights == "auto" or config.weights_dir else config.weights
        formats = {"prefill": config.prefill_weights or stored or "bf16",
                   "decode": config.decode_weights or stored or "int4"}
        if config.int4_all and "int4" not in formats.values():
            raise UsageError(f"{name('int4_all')} needs int4 weights in a worker: add {name('weights')} int4, "
                             f"{name('prefill_weights')} int4 or {name('decode_weights')} int4")
        kv_dtypes = {"prefill": prefill_kv_dtype, "decode": decode_kv_dtype}
        threads = config.threads or max(1, torch.get_num_threads() // 2)
        return {role: config.replace(prefill_weights=formats[role], decode_weights=formats[role], threads=threads,
                                     kv_dtype=kv_dtypes[role], int4_all=config.int4_all and formats[role] == "int4",
                                     kv_layout=config.kv_layout if kv_dtypes[role] == "fp8" else "token",
                                     prefix_cache=config.prefix_cache and role == "prefill") for role in p.ROLES}

    def __enter__(self) -> SplitLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold (prompt + output): the context, or the smaller worker's KV pool."""
        return min(self.max_context, *(info["kv_tokens"] for info in self.info.values()))

    def submit(self, prompt: str | list[int], params: SamplingParams, name: str = "prompt") -> SplitRequest:
        """Queue one prompt (`poll` advances it); refused (NanoError) when prompt + max_tokens can never fit."""
        ids, total = encode_request(prompt, params, name, self.tokenizer, self.config, self.max_request_tokens)
        request = SplitRequest(self._next_id, ids, params, total)
        self._next_id += 1
        self.requests[request.front_id] = request
        self.queue.append(request)
        return request

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        params = params or SamplingParams()
        requests = [self.submit(prompt, params, f"prompt {i}") for i, prompt in enumerate(prompts)]
        while not all(r.output for r in requests):
            self.poll()
        return [r.output for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """As `LLM.stream`: a RequestOutput whenever new tokens came, the finished one last."""
        params = params or SamplingParams()
        request = self.submit(prompt, params)
        text, sent = text_stream(self.tokenizer, self.config, params), 0
        try:
            while not request.output:
                self.poll()
                if len(request.output_token_ids) > sent and not request.output:
                    text.add(request.output_token_ids[sent:])
                    sent = len(request.output_token_ids)
                    yield RequestOutput(request.front_id, request.prompt_token_ids, request.output_token_ids[:sent],
                                        text.text, None)
        finally:   # also when the caller stops early: the workers drop the request
            self.abort(request, "the stream was closed before the request finished")
        yield request.output

    def counters(self, reset: bool = False) -> dict[str, dict[str, Any]]:
        """Each live worker's `LLM.counters` (engine, KV pool, integrity), by role; `reset` starts them afresh."""
        self.replies.clear()
        roles = [role for role in p.ROLES if self._send(role, p.CountersQuery(reset))]
        deadline = time.monotonic() + self.timeout_s
        while any(role in self.channels and role not in self.replies for role in roles):
            if time.monotonic() > deadline:
                raise NanoError(f"the workers did not report their counters within {self.timeout_s:.0f} s")
            self.poll(0.1)
        return self.replies

    def abort(self, request: SplitRequest, error: str) -> None:
        """End a request the caller gave up on; the decode worker frees its pages."""
        if request.output:
            return
        if request.stage == "decode":
            self._send("decode", p.Abort(request.front_id))
        self._end(request, error)

    @property
    def free_slots(self) -> list[int]:
        """Slots no worker holds: transfers in flight at once (shm: the staging slots)."""
        return [slot for slot in range(self.slots) if slot not in self.held]

    # ---- the event loop ----------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.5) -> None:
        """Dispatch queued requests, then handle whatever the workers say within `timeout` seconds."""
        if "prefill" not in self.channels:
            for request in list(self.queue):
                self._end(request, "no prefill worker: it died (restart it with restart('prefill'))")
        while self.queue and len(self.held) < self.slots:
            request = self.queue.popleft()
            request.slot = self.free_slots[0]
            self.held[request.slot] = "prefill"
            self._to("prefill", request, p.Prefill(request.front_id, request.prompt_token_ids, request.params,
                                                   request.slot))
        ready = wait(list(self.channels.values()), timeout)
        for role, channel in list(self.channels.items()):
            try:
                while channel in ready and channel.poll():
                    self._handle(role, self._checked(channel.recv()))
            except (EOFError, OSError):   # the worker's end closed: it died, or its host went away
                self._lose(role, self._why_lost(role))
            except NanoError as error:    # it speaks something else: stop listening to it
                self._lose(role, f"the {role} worker sent a message the front refuses: {error}")
        now = time.perf_counter()
        for request in list(self.requests.values()):
            if now - request.stage_since > self.timeout_s:
                waited_for = "a staging slot" if request.stage == "queued" else f"the {request.stage} worker"
                self.abort(request, f"timed out after {self.timeout_s:.0f} s waiting for {waited_for}")

    def _send(self, role: str, message: p.Message) -> bool:
        """Send to a worker; False (and the worker is lost) if it is gone."""
        try:
            self.channels[role].send(message)
            return True
        except KeyError:
            return False
        except OSError:   # its end closed: why, as when a read finds it closed (whichever the front does first)
            self._lose(role, self._why_lost(role))
            return False

    def _to(self, role: str, request: SplitRequest, message: p.Message) -> bool:
        request.stage, request.stage_since = role, time.perf_counter()
        if self._send(role, message):
            return True
        if not request.output:   # lost before: why
            self._end(request, self.lost.get(role, f"no {role} worker"))
        return False

    def _checked(self, message: p.Message) -> p.Message:
        """The message, if the token ids in it are in the vocabulary (the protocol knows only that every int is in
        [0, 2**64), the front knows the model); else NanoError."""
        tokens = {p.Token: lambda: [message.token], p.Done: lambda: message.output.token_ids,   # by message kind
                  p.Prefilled: lambda: [message.transfer.first_token]}.get(type(message), list)()
        if any(token >= self.config.vocab_size for token in tokens):
            raise NanoError(f"token id {max(tokens)} is outside the vocabulary [0, {self.config.vocab_size})")
        return message

    def _handle(self, role: str, message: p.Message) -> None:
        if isinstance(message, p.Counters):
            self.replies[message.role] = message.figures
        elif isinstance(message, p.SlotFree):
            self.stats.unpack_s += message.unpack_s
            self.held.pop(message.slot, None)
        elif isinstance(message, p.Refused):
            self._lose(role, f"the {role} worker refused a message: {message.error}")
        elif isinstance(message, p.Prefilled):
            self._prefilled(message.transfer)
        elif isinstance(message, (p.Token, p.Done, p.Failed)):
            request = self.requests.get(message.request_id)
            if isinstance(message, p.Failed) and message.slot is not None:   # the worker is done with the slot
                self.held.pop(message.slot, None)
                if request is not None:
                    request.slot = None
            if request is None:   # it ended meanwhile: drop the late news
                return
            if isinstance(message, p.Token):   # news: the wait for the worker starts again
                request.output_token_ids.append(message.token)
                request.token_times.append(time.perf_counter())
                request.stage_since = request.token_times[-1]
            elif isinstance(message, p.Done):
                self._finish(request, message.output)
            else:
                self._end(request, f"{role} worker: {message.error}")

    def _prefilled(self, transfer: p.Transfer) -> None:
        request = self.requests.get(transfer.request_id)
        self.held.pop(transfer.slot, None)
        if request is None:   # it ended meanwhile; gloo: its send must still be received, to be dropped
            if self.transport == "gloo" and self._send("decode", p.Discard(transfer)):
                self.held[transfer.slot] = "decode"
            return
        self.stats.transfers += 1
        self.stats.bytes += sum(part.nbytes for part in transfer.parts)
        self.stats.pack_s += transfer.pack_s
        request.output_token_ids.append(transfer.first_token)
        request.token_times.append(time.perf_counter())
        self._forward(request, transfer)

    def _forward(self, request: SplitRequest, transfer: p.Transfer) -> None:
        """Send a prefilled request on to the decode worker, which frees the slot once it has copied the bytes."""
        request.slot = None
        if self._to("decode", request, p.Decode(transfer, request.params, request.max_total_tokens)):
            self.held[transfer.slot] = "decode"

    def _finish(self, request: SplitRequest, output: RequestOutput) -> None:
        request.finish_time = time.perf_counter()
        output.request_id, output.prompt_token_ids = request.front_id, request.prompt_token_ids
        output.metrics.update(latency_metrics(request.arrival_time, request.token_times, request.finish_time))
        request.output, request.stage = output, "done"
        self.requests.pop(request.front_id, None)
        if request in self.queue:
            self.queue.remove(request)

    def _end(self, request: SplitRequest, error: str) -> None:
        """End a request with an error, keeping its tokens so far. Its staging slot comes back at once unless a
        live prefill worker may still write into it (then when that worker reports, or dies)."""
        if request.slot is not None and not (request.stage == "prefill" and self.alive("prefill")):
            self.held.pop(request.slot, None)
        request.slot = None
        text = text_stream(self.tokenizer, self.config, request.params)
        text.add(request.output_token_ids)
        self._finish(request, RequestOutput(
            request.front_id, request.prompt_token_ids, list(request.output_token_ids), text.finish(), "abort", error,
            {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": len(request.output_token_ids)}))

    def _lose(self, role: str, error: str) -> None:
        """A worker is gone: close its channel, end the requests waiting on it, take back the slots it held."""
        if role not in self.channels:
            return
        self.lost[role] = error
        self.channels.pop(role).close()
        for request in list(self.requests.values()):
            if request.stage == role:
                self._end(request, error)
        self.held = {slot: holder for slot, holder in self.held.items() if holder != role}
