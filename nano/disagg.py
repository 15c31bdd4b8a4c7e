"""Prefill and decode in two OS processes, each with its own formats (disaggregated serving).

Prefill is compute-bound and decode memory-bound, so production runs them on separate pools, each configured for
its phase: prefill with BF16 KV and BF16/FP8 weights, decode with FP8 KV and INT4 weights. Here:

    front (this process)          prefill worker (process)            decode worker (process)
    ───────────────────           ────────────────────────            ───────────────────────
    submit ── prefill(id, prompt, slot) ─▶ engine: prompt -> KV + first token
                                   pack the prompt's KV into staging slot, checksum it
           ◀── prefilled(Transfer) ─┘
    first token out (TTFT)
           ── decode(Transfer) ─────────────────────────────────────▶ check version + checksum, allocate own pages
                                                                      (tagged by its integrity tracker), convert to
                                                                      its KV dtype, free the slot, decode
           ◀── token ... / done(RequestOutput) ──────────────────────┘

Control (request id, slot, page ids and tags, first token, checksum, protocol version) travels on one pipe per
worker; the KV bytes travel through a shared-memory staging buffer split into slots. Only the prompt's tokens move
(token-major, not whole pages). A slot is reused only after the decode side has copied out of it (or its request
has ended), so nothing writes into a slot that is still being read.

Failure: a worker that dies, or a request that waits longer than `timeout_s`, ends its in-flight requests with an
error — never a hang, never another request's text; `restart(role)` starts a replacement and serving continues.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe, resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from nano.errors import NanoError
from nano.llm import LLM, RequestOutput, encode_prompt, resolve_config
from nano.sampling import SamplingParams
from nano.tokenizer import load_tokenizer

PROTOCOL_VERSION = 1
ROLES = ("prefill", "decode")


@dataclass
class Transfer:
    """The control message that goes with one request's KV (the bytes are in the staging slot)."""
    version: int
    request_id: int
    slot: int
    layout: list[tuple[str, str, tuple[int, ...], int, int]]   # (name, dtype, shape, offset, bytes) in the slot
    nbytes: int
    checksum: int                 # Adler-32 of the slot's first `nbytes` bytes
    prompt_token_ids: list[int]
    first_token: int
    src_pages: list[int]          # the prefill pool's pages and their integrity tags, for the record
    src_tags: list[int]
    kv_dtype: str                 # the prefill pool's KV dtype
    pack_s: float = 0.0           # prefill side: time to copy the KV into the slot and checksum it


class Staging:
    """A shared-memory byte buffer (POSIX shm, by name) in `slots` equal slots; every process maps the same memory."""

    def __init__(self, slots: int, slot_bytes: int, name: str | None = None) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.shm = SharedMemory(name=name, create=name is None, size=slots * slot_bytes)
        if name is not None:   # attached, not owned: the front unlinks it, not the Python resource tracker here
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self.buffer = torch.frombuffer(self.shm.buf, dtype=torch.uint8)

    def close(self, unlink: bool) -> None:
        del self.buffer
        self.shm.close()
        if unlink:
            self.shm.unlink()

    def slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.buffer[start:start + (self.slot_bytes if nbytes is None else nbytes)]

    def pack(self, index: int, parts: dict[str, torch.Tensor]) -> tuple[list, int, int]:
        """Copy tensors into a slot; returns (layout, bytes, Adler-32 checksum)."""
        layout, offset = [], 0
        for name, tensor in parts.items():
            raw = tensor.contiguous().view(torch.uint8).flatten()
            if offset + raw.numel() > self.slot_bytes:
                raise NanoError(f"the prompt's KV needs more than a staging slot's {self.slot_bytes:,} bytes; "
                                f"start the split with larger staging slots")
            self.slot(index)[offset:offset + raw.numel()] = raw
            layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, raw.numel()))
            offset += raw.numel()
        return layout, offset, self.checksum(index, offset)

    def checksum(self, index: int, nbytes: int) -> int:
        return zlib.adler32(self.slot(index, nbytes).numpy())

    def unpack(self, transfer: Transfer) -> dict[str, torch.Tensor]:
        data = self.slot(transfer.slot)
        return {name: data[offset:offset + size].view(getattr(torch, dtype)).view(shape)
                for name, dtype, shape, offset, size in transfer.layout}


# ---- the workers ------------------------------------------------------------------------------------------------

def worker_main(role: str, conn: Connection, staging: Staging) -> None:
    """A worker process: its own LLM in its own formats (the front's first message), commands on `conn`."""
    llm_options = conn.recv()
    torch.set_num_threads(llm_options.pop("threads"))
    try:
        llm = LLM(**llm_options, progress=False)
    except NanoError as error:
        conn.send(("dead", str(error)))
        return
    conn.send(("ready", os.getpid(), llm.label, llm.pool.kv_dtype, llm.prefill_weights, llm.decode_weights))
    engine, in_flight, waiting_imports = llm.engine, {}, deque()
    while True:
        if not engine.has_work() and not waiting_imports or conn.poll():
            try:
                message = conn.recv()
            except EOFError:   # the front is gone
                return
            if message[0] == "stop":
                return
            if message[0] == "abort":   # decode: the front gave up on this request (e.g. a closed stream)
                _abort_import(llm, message[1], waiting_imports, in_flight, conn)
            elif role == "prefill":   # ("prefill", front id, prompt ids, params, slot)
                _, front_id, prompt_ids, params, slot = message
                r = engine.add(prompt_ids, SamplingParams(**{**vars(params), "max_tokens": 1}),
                               len(prompt_ids) + 1, keep_pages=True)
                in_flight[r.request_id] = (r, front_id, slot)
            else:                   # ("decode", Transfer, params, max_total_tokens)
                waiting_imports.append(message[1:])
            continue
        if role == "decode":
            _admit_transfers(llm, staging, waiting_imports, in_flight, conn)
        for r, token in engine.step():
            if r.request_id not in in_flight:
                continue
            if role == "prefill" and r.finished:
                _, front_id, slot = in_flight.pop(r.request_id)
                if r.finish_reason == "abort":
                    conn.send(("failed", front_id, r.error, slot))
                else:
                    start = time.perf_counter()
                    parts = llm.pool.export_tokens(r.page_table, len(r.prompt_token_ids))
                    try:
                        layout, nbytes, checksum = staging.pack(slot, parts)
                    except NanoError as error:
                        conn.send(("failed", front_id, str(error), slot))
                    else:
                        conn.send(("prefilled", Transfer(
                            PROTOCOL_VERSION, front_id, slot, layout, nbytes, checksum, r.prompt_token_ids,
                            r.output_token_ids[0], r.expected_pages or r.page_table, r.expected_tags,
                            llm.pool.kv_dtype, time.perf_counter() - start)))
                engine.release(r)
            elif role == "decode":
                front_id = in_flight[r.request_id]
                if token is not None:
                    conn.send(("token", front_id, token))
                if r.finished:
                    del in_flight[r.request_id]
                    conn.send(("done", front_id, llm._output(r)))


def _abort_import(llm: LLM, front_id: int, waiting: deque, in_flight: dict, conn: Connection) -> None:
    for item in list(waiting):
        if item[0].request_id == front_id:    # not admitted yet: just give its slot back
            waiting.remove(item)
            conn.send(("slot_free", item[0].slot))
    for request_id, owner in list(in_flight.items()):
        if owner == front_id:
            del in_flight[request_id]
            running = [r for r in llm.engine.running if r.request_id == request_id]
            for r in running:
                llm.engine.abort(r, "aborted by the front")


def _admit_transfers(llm: LLM, staging: Staging, waiting: deque, in_flight: dict, conn: Connection) -> None:
    """Decode side: verify each arrived transfer, copy it into pages of our own pool, free its slot."""
    engine = llm.engine
    while waiting:
        transfer, params, max_total_tokens = waiting[0]
        error = None
        if transfer.version != PROTOCOL_VERSION:
            error = f"protocol version {transfer.version} from the prefill worker, this decode worker speaks " \
                    f"{PROTOCOL_VERSION}"
        elif staging.checksum(transfer.slot, transfer.nbytes) != transfer.checksum:
            error = (f"KV transfer checksum mismatch for request {transfer.request_id} (slot {transfer.slot}, "
                     f"{transfer.nbytes:,} bytes): the bytes changed between prefill and decode")
        elif llm.engine.pages_for(len(transfer.prompt_token_ids) + 1) > llm.pool.num_pages:
            error = f"request {transfer.request_id}'s prompt needs more pages than the decode pool holds"
        if error:
            waiting.popleft()
            conn.send(("slot_free", transfer.slot))
            conn.send(("failed", transfer.request_id, error, None))
            continue
        start = time.perf_counter()
        r = engine.add_prefilled(transfer.prompt_token_ids, transfer.first_token, params, max_total_tokens,
                                 lambda pages: llm.pool.import_tokens(pages, staging.unpack(transfer)))
        if r is None:   # the pool is full: decode on, and try again after the step
            return
        waiting.popleft()
        conn.send(("slot_free", transfer.slot, time.perf_counter() - start))
        if r.finished:    # max_tokens 1, or the first token was a stop token
            conn.send(("done", transfer.request_id, llm._output(r)))
        else:
            in_flight[r.request_id] = transfer.request_id


# ---- the front --------------------------------------------------------------------------------------------------

@dataclass
class SplitRequest:
    front_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stage: str = "queued"          # queued -> prefill -> decode -> done
    slot: int | None = None
    stage_since: float = field(default_factory=time.perf_counter)
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    output: RequestOutput | None = None


@dataclass
class TransferStats:
    transfers: int = 0
    bytes: int = 0
    pack_s: float = 0.0       # prefill: KV -> slot, with checksum
    unpack_s: float = 0.0     # decode: check, slot -> own pages (with dtype conversion)

    @property
    def gb_per_s(self) -> float:
        seconds = self.pack_s + self.unpack_s
        return self.bytes / seconds / 1e9 if seconds else 0.0


class SplitLLM:
    """The front: the same generate/stream API as LLM, served by a prefill worker and a decode worker."""

    def __init__(self, model: str, *, prefill_weights: str = "bf16", decode_weights: str = "int4",
                 prefill_kv_dtype: str = "bf16", decode_kv_dtype: str = "fp8", weights_dir: str | None = None,
                 dtype: str | None = None, seed: int = 0, page_size: int = 64, kv_budget: str | int | None = None,
                 max_running: int = 256, max_step_tokens: int = 512, int4_all: bool = False,
                 integrity: bool = True, staging_slots: int = 8, slot_bytes: int = 32 * 2**20,
                 timeout_s: float = 120.0, threads: int | None = None) -> None:
        resolved, self.config = resolve_config(model, weights_dir)
        self.tokenizer = load_tokenizer(resolved.path if resolved.kind == "checkpoint" else None, self.config)
        self.max_context = self.config.max_position_embeddings
        common = dict(model=model, weights_dir=weights_dir, dtype=dtype or "bfloat16", seed=seed,
                      page_size=page_size, kv_budget=kv_budget, max_running=max_running,
                      max_step_tokens=max_step_tokens, int4_all=int4_all, integrity=integrity,
                      threads=threads or max(1, torch.get_num_threads() // 2))
        self.options = {"prefill": {**common, "weights": prefill_weights, "kv_dtype": prefill_kv_dtype},
                        "decode": {**common, "weights": decode_weights, "kv_dtype": decode_kv_dtype}}
        self.staging = Staging(staging_slots, slot_bytes)
        self.free_slots = deque(range(staging_slots))
        self.timeout_s = timeout_s
        self.requests: dict[int, SplitRequest] = {}
        self.queue: deque[SplitRequest] = deque()
        self.orphan_slots: set[int] = set()    # slots of ended requests that the prefill worker may still write
        self.stats = TransferStats()
        self.corrupt_next_transfer = False     # `nano fault --corrupt-transfer` sets it
        self._next_id = 0
        self.processes: dict[str, subprocess.Popen] = {}
        self.conns: dict[str, Connection] = {}
        self.info: dict[str, dict[str, Any]] = {}
        try:
            for role in ROLES:
                self._start(role)
            for role in ROLES:
                self._wait_ready(role)
        except BaseException:
            self.close()
            raise
        self.label = self.info["decode"]["label"]

    # ---- workers ---------------------------------------------------------------------------------------------
    def _start(self, role: str) -> None:
        """`python -m nano.disagg ROLE FD SHM SLOTS SLOT_BYTES`: a fresh interpreter (nothing of the caller's
        program is re-imported), in its own session (a Ctrl-C reaches the front, which then stops it)."""
        front_end, worker_end = Pipe()
        args = [sys.executable, "-m", "nano.disagg", role, str(worker_end.fileno()), self.staging.shm.name,
                str(self.staging.slots), str(self.staging.slot_bytes)]
        self.processes[role] = subprocess.Popen(args, pass_fds=[worker_end.fileno()], start_new_session=True)
        worker_end.close()
        front_end.send(dict(self.options[role]))
        self.conns[role] = front_end

    def alive(self, role: str) -> bool:
        return self.processes[role].poll() is None

    def _wait_ready(self, role: str) -> None:
        conn = self.conns[role]
        try:
            if not conn.poll(self.timeout_s):
                raise NanoError(f"the {role} worker did not start within {self.timeout_s:.0f} s")
            message = conn.recv()
        except (EOFError, OSError):
            raise NanoError(f"the {role} worker exited while starting "
                            f"(exit code {self.processes[role].wait()})") from None
        if message[0] == "dead":
            raise NanoError(f"{role} worker: {message[1]}")
        _, pid, label, kv_dtype, prefill_weights, decode_weights = message
        self.info[role] = {"pid": pid, "label": label, "kv_dtype": kv_dtype,
                           "weights": prefill_weights if role == "prefill" else decode_weights}

    def restart(self, role: str) -> None:
        """Replace a dead (or live) worker with a fresh one; its in-flight requests end with errors first."""
        self.processes[role].kill()
        self.processes[role].wait()
        self._worker_lost(role, f"the {role} worker was restarted")
        self._start(role)
        self._wait_ready(role)

    def kill(self, role: str) -> None:
        """SIGKILL a worker (what `nano fault --kill-prefill` does)."""
        self.processes[role].kill()

    def close(self) -> None:
        for role, process in self.processes.items():
            try:
                self.conns[role].send(("stop",))
                process.wait(timeout=5)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()
        self.processes.clear()
        self.staging.close(unlink=True)

    def __enter__(self) -> SplitLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams, name: str = "prompt") -> SplitRequest:
        request = SplitRequest(self._next_id, encode_prompt(prompt, name, self.tokenizer, self.config), params)
        self._next_id += 1
        self.requests[request.front_id] = request
        self.queue.append(request)
        return request

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        params = params or SamplingParams()
        requests = [self.submit(p, params, f"prompt {i}") for i, p in enumerate(prompts)]
        while not all(r.output for r in requests):
            self.poll()
        return [r.output for r in requests]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[int]:
        request = self.submit(prompt, params or SamplingParams())
        sent = 0
        try:
            while True:
                while sent < len(request.token_ids):
                    sent += 1
                    yield request.token_ids[sent - 1]
                if request.output:
                    return
                self.poll()
        finally:   # also when the caller stops early: the workers drop the request
            self.abort(request, "the stream was closed before the request finished")
            self.last_output = request.output

    def abort(self, request: SplitRequest, error: str) -> None:
        """End a request the caller gave up on; the decode worker frees its pages."""
        if request.output:
            return
        if request.stage == "decode":
            try:
                self.conns["decode"].send(("abort", request.front_id))
            except (OSError, EOFError):
                pass
        self._end(request, error)

    # ---- the event loop ----------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.5) -> None:
        """Dispatch queued requests, then handle whatever the workers say within `timeout` seconds."""
        if not self.alive("prefill"):
            for request in list(self.queue):
                self._end(request, "no prefill worker: it died (restart it with restart('prefill'))")
        while self.queue and self.free_slots:
            request = self.queue.popleft()
            request.slot = self.free_slots.popleft()
            self._to("prefill", request, ("prefill", request.front_id, request.prompt_token_ids, request.params,
                                          request.slot))
        ready = wait(list(self.conns.values()), timeout)
        for role in ROLES:
            conn = self.conns[role]
            try:
                while conn in ready and conn.poll():
                    self._handle(role, conn.recv())
            except (EOFError, OSError):   # the worker's end closed: it died
                self.processes[role].wait()
            if role in self.info and not self.alive(role) and self.info[role].get("pid"):
                self._worker_lost(role, f"the {role} worker (pid {self.info[role]['pid']}) died with exit code "
                                        f"{self.processes[role].returncode}")
                self.info[role]["pid"] = None
        now = time.perf_counter()
        for request in list(self.requests.values()):
            if request.stage in ROLES and now - request.stage_since > self.timeout_s:
                self._end(request, f"timed out after {self.timeout_s:.0f} s waiting for the {request.stage} worker")

    def _to(self, role: str, request: SplitRequest, message: tuple) -> None:
        request.stage, request.stage_since = role, time.perf_counter()
        try:
            self.conns[role].send(message)
        except (OSError, EOFError):
            self._end(request, f"the {role} worker is gone")

    def _handle(self, role: str, message: tuple) -> None:
        kind = message[0]
        if kind == "slot_free":
            self.free_slots.append(message[1])
            self.stats.unpack_s += message[2] if len(message) > 2 else 0.0
            return
        transfer: Transfer | None = message[1] if kind == "prefilled" else None
        request = self.requests.get(transfer.request_id if transfer else message[1])
        if request is None:   # it ended meanwhile: drop the late news; a prefill reply means its slot is free now
            slot = transfer.slot if transfer else message[3] if kind == "failed" and role == "prefill" else None
            if slot is not None:
                self.orphan_slots.discard(slot)
                self.free_slots.append(slot)
            return
        if transfer:
            self.stats.transfers += 1
            self.stats.bytes += transfer.nbytes
            self.stats.pack_s += transfer.pack_s
            request.token_ids.append(transfer.first_token)
            request.token_times.append(time.perf_counter())
            if self.corrupt_next_transfer:   # a fault on the wire: flip one byte after the checksum was taken
                self.corrupt_next_transfer = False
                self.staging.slot(transfer.slot)[transfer.nbytes // 2] ^= 0xFF
            request.slot = None   # the decode side frees it once it has copied the bytes out
            self._to("decode", request, ("decode", transfer, request.params,
                                         len(request.prompt_token_ids) + request.params.max_tokens))
        elif kind == "token":
            request.token_ids.append(message[2])
            request.token_times.append(time.perf_counter())
        elif kind == "done":
            self._finish(request, message[2])
        elif kind == "failed":
            self._end(request, f"{role} worker: {message[2]}")

    def _finish(self, request: SplitRequest, output: RequestOutput) -> None:
        output.request_id = request.front_id
        times = request.token_times
        output.metrics.update(e2e_s=time.perf_counter() - request.arrival)
        if times:
            output.metrics["ttft_s"] = times[0] - request.arrival
        if len(times) > 1:
            output.metrics["tpot_s"] = (times[-1] - times[0]) / (len(times) - 1)
        request.output, request.stage = output, "done"
        self.requests.pop(request.front_id, None)
        if request in self.queue:
            self.queue.remove(request)

    def _end(self, request: SplitRequest, error: str) -> None:
        """End a request with an error, keeping its tokens so far. Its staging slot comes back at once unless a
        live prefill worker may still write into it (then when that worker reports, or dies)."""
        if request.slot is not None:
            if request.stage == "prefill" and self.alive("prefill"):
                self.orphan_slots.add(request.slot)
            else:
                self.free_slots.append(request.slot)
            request.slot = None
        self._finish(request, RequestOutput(
            request.front_id, request.prompt_token_ids, list(request.token_ids),
            self.tokenizer.decode(request.token_ids), "abort", error,
            {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": len(request.token_ids)}))

    def _worker_lost(self, role: str, error: str) -> None:
        for request in list(self.requests.values()):
            if request.stage == role:
                self._end(request, error)
        # slots nobody will touch any more: all but those of requests still waiting on a live prefill worker
        if role == "prefill":
            self.orphan_slots.clear()
        held = {r.slot for r in self.requests.values() if r.slot is not None} | self.orphan_slots
        self.free_slots = deque(s for s in range(self.staging.slots) if s not in held)


if __name__ == "__main__":   # a worker: python -m nano.disagg ROLE FD SHM SLOTS SLOT_BYTES
    from nano import disagg   # the module by its name, so that what it pickles (Transfer) unpickles in the front
    role_arg, fd, shm_name, slots_arg, slot_bytes_arg = sys.argv[1:6]
    worker_staging = disagg.Staging(int(slots_arg), int(slot_bytes_arg), name=shm_name)
    try:
        disagg.worker_main(role_arg, Connection(int(fd)), worker_staging)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    finally:
        worker_staging.close(unlink=False)
