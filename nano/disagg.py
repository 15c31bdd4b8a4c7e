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

Control (request id, slot, page ids and tags, first token, checksum, protocol version) travels on one TCP
socket per worker (authenticated with a shared key); the KV bytes travel on a data path: on one host a
shared-memory staging buffer split into slots, across hosts torch.distributed point-to-point over gloo. Only the
prompt's tokens move (token-major, not whole pages). A slot is reused only after the decode side has copied out of
it (or its request has ended), so nothing writes into a slot that is still being read.

Failure: a worker that dies, or a request that waits longer than `timeout_s`, ends its in-flight requests with an
error — never a hang, never another request's text; `restart(role)` starts a replacement and serving continues.
"""
from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import AuthenticationError, resource_tracker
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
import torch.distributed as dist

from nano.errors import NanoError
from nano.llm import LLM, RequestOutput, encode_prompt, resolve_config
from nano.sampling import SamplingParams
from nano.tokenizer import load_tokenizer

PROTOCOL_VERSION = 2
ROLES = ("prefill", "decode")
TRANSPORTS = ("shm", "gloo")


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
    generation: int = 0           # gloo: the group its bytes were sent on (a replaced worker's are stale)


def pack(parts: dict[str, torch.Tensor], out: torch.Tensor) -> tuple[list, int]:
    """Copy tensors back to back into the byte buffer `out`; returns (layout, bytes used)."""
    layout, offset = [], 0
    for name, tensor in parts.items():
        raw = tensor.contiguous().view(torch.uint8).flatten()
        if offset + raw.numel() > out.numel():
            raise NanoError(f"the prompt's KV needs more than a staging slot's {out.numel():,} bytes; "
                            f"start the split with larger staging slots")
        out[offset:offset + raw.numel()] = raw
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, raw.numel()))
        offset += raw.numel()
    return layout, offset


def unpack(layout: list, data: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: data[offset:offset + size].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, offset, size in layout}


def checksum(data: torch.Tensor) -> int:
    return zlib.adler32(data.numpy())


class Staging:
    """Data path on one host: a shared-memory byte buffer (POSIX shm, by name) in `slots` equal slots that every
    process maps. The prefill worker packs into a slot; the decode worker reads the same memory."""

    def __init__(self, slots: int, slot_bytes: int, name: str | None = None) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.shm = SharedMemory(name=name, create=name is None, size=slots * slot_bytes)
        if name is not None:   # attached, not owned: the front unlinks it, not the Python resource tracker here
            resource_tracker.unregister(self.shm._name, "shared_memory")
        self.buffer = torch.frombuffer(self.shm.buf, dtype=torch.uint8)

    def close(self, unlink: bool = False) -> None:
        del self.buffer
        self.shm.close()
        if unlink:
            self.shm.unlink()

    def slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.buffer[start:start + (self.slot_bytes if nbytes is None else nbytes)]

    def stage(self, slot: int, request_id: int, parts: dict[str, torch.Tensor]) -> tuple[list, int, int]:
        """Prefill: pack into the slot; returns (layout, bytes, Adler-32 checksum)."""
        layout, nbytes = pack(parts, self.slot(slot))
        return layout, nbytes, checksum(self.slot(slot, nbytes))

    def post(self, transfer: Transfer) -> None:
        """Prefill, before the control message goes out: nothing to add, the bytes are where decode reads."""

    def receive(self, transfer: Transfer) -> torch.Tensor:
        """Decode: the transfer's bytes (a view of the slot)."""
        return self.slot(transfer.slot, transfer.nbytes)

class GlooPath:
    """Data path across hosts: torch.distributed point-to-point over gloo (TCP). Rank 0 is the prefill worker,
    rank 1 the decode worker; they meet through the front's TCPStore (MASTER_ADDR:MASTER_PORT). Each group has a
    generation: when a worker is replaced, the front tells both live workers to form a fresh group under a new
    prefix (`connect`), and bytes sent on an older group are refused as stale, never waited for.

    Prefill packs into its own buffer and posts an asynchronous send tagged with the request id, then sends the
    control message; decode, on the control message, receives into a buffer of its own. Every posted send is
    matched by exactly one receive (the front forwards even an ended request's transfer, to be drained), so no
    send waits forever while both workers live."""

    def __init__(self, rank: int, host: str, port: int, timeout_s: float) -> None:
        self.rank, self.timeout = rank, timedelta(seconds=timeout_s)
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        except (RuntimeError, OSError) as error:
            raise NanoError(f"cannot reach the front's TCPStore at {host}:{port}: {error}") from None
        self.group: dist.ProcessGroupGloo | None = None
        self.generation = -1
        self.outbox: dict[int, tuple[torch.Tensor, Any]] = {}   # request id -> (packed bytes, send work)

    def connect(self, generation: int) -> None:
        """Form the group with the peer (blocks until it joins, at most the timeout)."""
        self.outbox.clear()
        self.group, self.generation = None, generation
        try:
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"nano-disagg/{generation}", self.store),
                                               self.rank, 2, self.timeout)
        except RuntimeError as error:
            raise NanoError(f"could not form the KV data group with the other worker: "
                            f"{str(error).splitlines()[0]}") from None

    def stage(self, slot: int, request_id: int, parts: dict[str, torch.Tensor]) -> tuple[list, int, int]:
        self.outbox = {rid: (data, work) for rid, (data, work) in self.outbox.items() if not work.is_completed()}
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        data = torch.empty(nbytes, dtype=torch.uint8)
        layout, _ = pack(parts, data)
        if self.group is None:
            raise NanoError("no KV data path: the decode worker has not joined (it is being replaced)")
        try:
            self.outbox[request_id] = (data, self.group.send([data], 1, request_id))
        except RuntimeError as error:   # the group broke (decode died): a regroup follows
            raise NanoError(f"sending the KV to the decode worker failed: {str(error).splitlines()[0]}") from None
        return layout, nbytes, checksum(data)

    def post(self, transfer: Transfer) -> None:
        transfer.generation = self.generation

    def receive(self, transfer: Transfer) -> torch.Tensor:
        if self.group is None or transfer.generation != self.generation:
            raise NanoError(f"request {transfer.request_id}'s KV was sent to a worker that has since been "
                            f"replaced (group {transfer.generation}, now {self.generation})")
        data = torch.empty(transfer.nbytes, dtype=torch.uint8)
        try:
            self.group.recv([data], 0, transfer.request_id).wait()
        except RuntimeError as error:
            raise NanoError(f"receiving request {transfer.request_id}'s KV from the prefill worker failed: "
                            f"{str(error).splitlines()[0]}") from None
        return data

    def close(self) -> None:
        self.group = None


DataPath = Staging | GlooPath


# ---- the workers ------------------------------------------------------------------------------------------------

def worker_main(role: str, conn: Connection) -> None:
    """A worker process: its own LLM in its own formats and a data path (the front's first message), then
    commands on `conn`."""
    setup = conn.recv()
    transport = setup.pop("transport")
    torch.set_num_threads(setup.pop("threads"))
    try:
        llm = LLM(**setup, progress=False)
        if transport["kind"] == "shm":
            path: DataPath = Staging(transport["slots"], transport["slot_bytes"], name=transport["name"])
        else:
            path = GlooPath(ROLES.index(role), transport["host"], transport["port"], transport["timeout_s"])
    except NanoError as error:
        conn.send(("dead", str(error)))
        return
    conn.send(("ready", os.getpid(), socket.gethostname(), llm.label, llm.pool.kv_dtype, llm.prefill_weights,
               llm.decode_weights))
    try:
        _serve(role, conn, llm, path)
    finally:
        path.close()


def _serve(role: str, conn: Connection, llm: LLM, path: DataPath) -> None:
    engine, in_flight, waiting_imports = llm.engine, {}, deque()
    while True:
        if not engine.has_work() and not waiting_imports or conn.poll():
            try:
                message = conn.recv()
            except EOFError:   # the front is gone
                return
            if message[0] == "stop":
                return
            if message[0] == "regroup":   # both workers are up (again): form the data group, this generation
                try:
                    path.connect(message[1])
                except NanoError:   # the peer died meanwhile: no data path until the front's next regroup
                    pass
            elif message[0] == "discard":   # decode: an ended request's bytes, drained so the send completes
                try:
                    path.receive(message[1])
                except NanoError:
                    pass
                conn.send(("slot_free", message[1].slot))
            elif message[0] == "counters":
                conn.send(("counters", role, llm.counters(reset=message[1])))
            elif message[0] == "abort":   # decode: the front gave up on this request (e.g. a closed stream)
                _abort_import(llm, message[1], waiting_imports, in_flight, conn)
            elif role == "prefill":   # ("prefill", front id, prompt ids, params, slot)
                _, front_id, prompt_ids, params, slot = message
                r = engine.add(prompt_ids, SamplingParams(**{**vars(params), "max_tokens": 1}),
                               len(prompt_ids) + 1, keep_pages=True)
                in_flight[r.request_id] = (r, front_id, slot)
            else:                   # ("decode", Transfer, params, max_total_tokens, corrupt): take the bytes now
                _, transfer, params, max_total_tokens, corrupt = message
                data, error, start = None, None, time.perf_counter()
                try:
                    data = path.receive(transfer)
                except NanoError as failure:
                    error = str(failure)
                if corrupt and data is not None:   # `nano fault --corrupt-transfer`: one byte flipped in transit
                    data[transfer.nbytes // 2] ^= 0xFF
                waiting_imports.append((transfer, params, max_total_tokens, data, error,
                                        time.perf_counter() - start))
            continue
        if role == "decode":
            _admit_transfers(llm, waiting_imports, in_flight, conn)
        for r, token in engine.step():
            if r.request_id not in in_flight:
                continue
            if role == "prefill" and r.finished:
                _, front_id, slot = in_flight.pop(r.request_id)
                if r.finish_reason == "abort":
                    conn.send(("failed", front_id, r.error, slot))
                else:
                    start = time.perf_counter()
                    try:
                        layout, nbytes, check = path.stage(slot, front_id, engine.export_kv(r))
                    except NanoError as error:
                        conn.send(("failed", front_id, str(error), slot))
                    else:
                        transfer = Transfer(PROTOCOL_VERSION, front_id, slot, layout, nbytes, check,
                                            r.prompt_token_ids, r.output_token_ids[0],
                                            r.expected_pages or r.page_table, r.expected_tags, llm.pool.kv_dtype,
                                            time.perf_counter() - start)
                        path.post(transfer)
                        conn.send(("prefilled", transfer))
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
        if item[0].request_id == front_id:    # not admitted yet (its bytes already arrived): give its slot back
            waiting.remove(item)
            conn.send(("slot_free", item[0].slot))
    for request_id, owner in list(in_flight.items()):
        if owner == front_id:
            del in_flight[request_id]
            running = [r for r in llm.engine.scheduler.running if r.request_id == request_id]
            for r in running:
                llm.engine.abort(r, "aborted by the front")


def _admit_transfers(llm: LLM, waiting: deque, in_flight: dict, conn: Connection) -> None:
    """Decode side: verify each arrived transfer, copy it into pages of our own pool, free its slot."""
    engine = llm.engine
    while waiting:
        transfer, params, max_total_tokens, data, error, receive_s = waiting[0]
        if error:
            pass
        elif transfer.version != PROTOCOL_VERSION:
            error = f"protocol version {transfer.version} from the prefill worker, this decode worker speaks " \
                    f"{PROTOCOL_VERSION}"
        elif checksum(data) != transfer.checksum:
            error = (f"KV transfer checksum mismatch for request {transfer.request_id} (slot {transfer.slot}, "
                     f"{transfer.nbytes:,} bytes): the bytes changed between prefill and decode")
        elif llm.engine.scheduler.pages_for(len(transfer.prompt_token_ids) + 1) > llm.pool.num_pages:
            error = f"request {transfer.request_id}'s prompt needs more pages than the decode pool holds"
        if error:
            waiting.popleft()
            conn.send(("slot_free", transfer.slot))
            conn.send(("failed", transfer.request_id, error, None))
            continue
        start = time.perf_counter()
        r = engine.add_prefilled(transfer.prompt_token_ids, transfer.first_token, params, max_total_tokens,
                                 lambda pages: llm.pool.import_tokens(pages, unpack(transfer.layout, data)))
        if r is None:   # the pool is full: decode on, and try again after the step
            return
        waiting.popleft()
        conn.send(("slot_free", transfer.slot, receive_s + time.perf_counter() - start))
        if r.finished:    # max_tokens 1, or the first token was a stop token
            conn.send(("done", transfer.request_id, llm._output(r)))
        else:
            in_flight[r.request_id] = transfer.request_id


# ---- the front --------------------------------------------------------------------------------------------------

@dataclass
class SplitRequest:
    """The front's record of one request; it reads like the engine's `Request` (same timing fields), so code
    that measures requests (nano bench) takes either."""
    front_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
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
    """The front: the same generate/stream API as LLM, served by a prefill worker and a decode worker.

    transport "shm": KV through shared-memory staging slots (both workers on this host). "gloo": KV over
    torch.distributed point to point; the workers find the front's TCPStore at MASTER_ADDR / MASTER_PORT (default
    127.0.0.1 and a free port) and may run on other hosts. Control always goes over a TCP socket to `listen`,
    authenticated with NANO_DISAGG_KEY. Roles not in `spawn` are not started here: the front waits for
    `python -m nano.disagg ROLE HOST:PORT` to connect (from another host, say)."""

    def __init__(self, model: str, *, prefill_weights: str = "bf16", decode_weights: str = "int4",
                 prefill_kv_dtype: str = "bf16", decode_kv_dtype: str = "fp8", weights_dir: str | None = None,
                 dtype: str | None = None, seed: int = 0, page_size: int = 64, kv_budget: str | int | None = None,
                 max_running: int = 256, max_step_tokens: int = 512, int4_all: bool = False,
                 integrity: bool = True, staging_slots: int = 8, slot_bytes: int = 32 * 2**20,
                 timeout_s: float = 120.0, threads: int | None = None, transport: str = "shm",
                 listen: tuple[str, int] = ("127.0.0.1", 0), spawn: Sequence[str] = ROLES) -> None:
        if transport not in TRANSPORTS:
            raise NanoError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        if set(spawn) - set(ROLES):
            raise NanoError(f"spawn takes roles from {', '.join(ROLES)}, not {', '.join(set(spawn) - set(ROLES))}")
        if transport == "shm" and set(spawn) != set(ROLES):
            raise NanoError("a worker on another host needs transport 'gloo' (shared memory is one host's)")
        self.key = os.environ.get("NANO_DISAGG_KEY") or (secrets.token_hex(16) if set(spawn) == set(ROLES) else "")
        if not self.key:
            raise NanoError("set NANO_DISAGG_KEY (the same secret on every host) to accept workers from elsewhere")
        resolved, self.config = resolve_config(model, weights_dir)
        self.tokenizer = load_tokenizer(resolved.path if resolved.kind == "checkpoint" else None, self.config)
        self.max_context = self.config.max_position_embeddings
        common = dict(model=model, weights_dir=weights_dir, dtype=dtype or "bfloat16", seed=seed,
                      page_size=page_size, kv_budget=kv_budget, max_running=max_running,
                      max_step_tokens=max_step_tokens, int4_all=int4_all, integrity=integrity,
                      threads=threads or max(1, torch.get_num_threads() // 2))
        self.options = {"prefill": {**common, "weights": prefill_weights, "kv_dtype": prefill_kv_dtype},
                        "decode": {**common, "weights": decode_weights, "kv_dtype": decode_kv_dtype}}
        self.transport, self.spawned, self.timeout_s = transport, tuple(spawn), timeout_s
        self.slots = staging_slots        # transfers in flight at once (shm: the staging slots)
        self.free_slots = deque(range(staging_slots))
        self.requests: dict[int, SplitRequest] = {}
        self.queue: deque[SplitRequest] = deque()
        self.orphan_slots: set[int] = set()    # slots of ended requests that the prefill worker may still write
        self.decode_slots: set[int] = set()    # slots the decode worker has been told to read and not yet freed
        self.stats = TransferStats()
        self.corrupt_next_transfer = False     # `nano fault --corrupt-transfer` sets it
        self._next_id = 0
        self.generation = 0                    # gloo: bumped whenever a worker is replaced
        self.processes: dict[str, subprocess.Popen] = {}
        self.conns: dict[str, Connection] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.replies: dict[str, dict[str, Any]] = {}   # counters the workers sent, by role
        self.staging = self.store = None
        try:
            self.listener = socket.create_server(listen)
        except OSError as error:
            raise NanoError(f"cannot listen for workers on {listen[0]}:{listen[1]}: {error.strerror or error}"
                            ) from None
        try:
            if transport == "shm":
                self.staging = Staging(staging_slots, slot_bytes)
            else:
                host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "0")
                try:
                    self.store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,
                                               timeout=timedelta(seconds=timeout_s))
                except (RuntimeError, ValueError) as error:
                    raise NanoError(f"cannot host the TCPStore at MASTER_ADDR={host} MASTER_PORT={port}: "
                                    f"{str(error).splitlines()[0]}") from None
                self.store_address = (host, self.store.port)
            for role in self.spawned:
                self._spawn(role)
            self._accept(ROLES)
            self._regroup()
        except BaseException:
            self.close()
            raise
        self.label = self.info["decode"]["label"]

    # ---- workers ---------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Where workers connect: HOST:PORT."""
        host, port = self.listener.getsockname()[:2]
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def _spawn(self, role: str) -> None:
        """`python -m nano.disagg ROLE HOST:PORT`: a fresh interpreter (nothing of the caller's program is
        re-imported), in its own session (a Ctrl-C reaches the front, which then stops it)."""
        self.processes[role] = subprocess.Popen([sys.executable, "-m", "nano.disagg", role, self.address],
                                                env={**os.environ, "NANO_DISAGG_KEY": self.key},
                                                start_new_session=True)

    def _setup(self, role: str) -> dict[str, Any]:
        if self.transport == "shm":
            transport = {"kind": "shm", "name": self.staging.shm.name, "slots": self.staging.slots,
                         "slot_bytes": self.staging.slot_bytes}
        else:
            transport = {"kind": "gloo", "host": self.store_address[0], "port": self.store_address[1],
                         "timeout_s": self.timeout_s}
        return {**self.options[role], "transport": transport}

    def _accept(self, roles: Sequence[str]) -> None:
        """Take connections until every role in `roles` has a worker that says it is ready (or fail clearly)."""
        deadline, pending = time.monotonic() + self.timeout_s, set(roles)
        while pending:
            for role in pending & set(self.spawned):
                if self.processes[role].poll() is not None:
                    raise NanoError(f"the {role} worker exited while starting "
                                    f"(exit code {self.processes[role].returncode})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NanoError(f"no {' or '.join(sorted(pending))} worker connected to {self.address} within "
                                f"{self.timeout_s:.0f} s")
            if not select.select([self.listener], [], [], min(0.5, remaining))[0]:
                continue
            sock, _ = self.listener.accept()
            conn = Connection(sock.detach())
            try:
                with receive_timeout(conn, 10.0):   # a client that connects and says nothing is dropped
                    deliver_challenge(conn, self.key.encode())
                    answer_challenge(conn, self.key.encode())
                    role = conn.recv()
            except (AuthenticationError, EOFError, OSError):   # a stranger, or a worker with another key
                conn.close()
                continue
            if role not in pending:
                conn.close()
                continue
            conn.send(self._setup(role))
            self.conns[role] = conn
            pending.discard(role)
        for role in roles:
            self._wait_ready(role)

    def _wait_ready(self, role: str) -> None:
        conn = self.conns[role]
        try:
            if not conn.poll(self.timeout_s):
                raise NanoError(f"the {role} worker did not start within {self.timeout_s:.0f} s")
            message = conn.recv()
        except (EOFError, OSError):
            code = f" (exit code {self.processes[role].wait()})" if role in self.spawned else ""
            raise NanoError(f"the {role} worker exited while starting{code}") from None
        if message[0] == "dead":
            raise NanoError(f"{role} worker: {message[1]}")
        _, pid, host, label, kv_dtype, prefill_weights, decode_weights = message
        self.info[role] = {"pid": pid, "host": host, "label": label, "kv_dtype": kv_dtype,
                           "weights": prefill_weights if role == "prefill" else decode_weights}

    def alive(self, role: str) -> bool:
        return role in self.conns and (role not in self.spawned or self.processes[role].poll() is None)

    def restart(self, role: str) -> None:
        """Replace a dead (or live) worker; its in-flight requests end with errors first. A spawned role gets a new
        process; otherwise the front waits for a new worker to connect. With gloo, once both roles are up they
        form a new group."""
        if role in self.spawned:
            self.processes[role].kill()
            self.processes[role].wait()
        if role in self.conns:
            self._lose(role, f"the {role} worker was restarted")
        if role in self.spawned:
            self._spawn(role)
        self._accept([role])
        self._regroup()

    def _regroup(self) -> None:
        """gloo: with both workers up, have them form the data group of a new generation (transfers sent on an
        older one are refused as stale). A worker that cannot be told is lost."""
        if self.transport != "gloo":
            return
        self.poll(0.0)   # notice a worker that died meanwhile, before asking it to join
        if set(self.conns) != set(ROLES):
            return
        self.generation += 1
        for role in ROLES:
            try:
                self.conns[role].send(("regroup", self.generation))
            except OSError:
                self._lose(role, f"the {role} worker is gone")

    def kill(self, role: str) -> None:
        """SIGKILL a spawned worker (what `nano fault --kill-prefill` does)."""
        self.processes[role].kill()

    def close(self) -> None:
        for role in list(self.conns):
            try:
                self.conns[role].send(("stop",))
            except OSError:
                pass
        self.store = None   # the TCPStore's port is released with it
        for process in self.processes.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for conn in self.conns.values():
            conn.close()
        self.processes.clear()
        self.conns.clear()
        self.listener.close()
        if self.staging is not None:
            self.staging.close(unlink=True)
            self.staging = None

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
                while sent < len(request.output_token_ids):
                    sent += 1
                    yield request.output_token_ids[sent - 1]
                if request.output:
                    return
                self.poll()
        finally:   # also when the caller stops early: the workers drop the request
            self.abort(request, "the stream was closed before the request finished")
            self.last_output = request.output

    def counters(self, reset: bool = False) -> dict[str, dict[str, Any]]:
        """Each live worker's `LLM.counters` (engine, KV pool, integrity), by role; `reset` starts them afresh."""
        self.replies.clear()
        roles = list(self.conns)
        for role in roles:
            try:
                self.conns[role].send(("counters", reset))
            except OSError:
                self._lose(role, f"the {role} worker is gone")
        deadline = time.monotonic() + self.timeout_s
        while any(role in self.conns and role not in self.replies for role in roles):
            if time.monotonic() > deadline:
                raise NanoError(f"the workers did not report their counters within {self.timeout_s:.0f} s")
            self.poll(0.1)
        return self.replies

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
        if "prefill" not in self.conns:
            for request in list(self.queue):
                self._end(request, "no prefill worker: it died (restart it with restart('prefill'))")
        while self.queue and self.free_slots:
            request = self.queue.popleft()
            request.slot = self.free_slots.popleft()
            self._to("prefill", request, ("prefill", request.front_id, request.prompt_token_ids, request.params,
                                          request.slot))
        ready = wait(list(self.conns.values()), timeout)
        for role, conn in list(self.conns.items()):
            try:
                while conn in ready and conn.poll():
                    self._handle(role, conn.recv())
            except (EOFError, OSError):   # the worker's end closed: it died, or its host went away
                where = self.info[role]
                how = (f"died with exit code {self.processes[role].wait()}" if role in self.spawned
                       else f"on {where['host']} disconnected")
                self._lose(role, f"the {role} worker (pid {where['pid']}) {how}")
        now = time.perf_counter()
        for request in list(self.requests.values()):
            if now - request.stage_since > self.timeout_s:
                waited_for = "a staging slot" if request.stage == "queued" else f"the {request.stage} worker"
                self._end(request, f"timed out after {self.timeout_s:.0f} s waiting for {waited_for}")

    def _to(self, role: str, request: SplitRequest, message: tuple) -> None:
        request.stage, request.stage_since = role, time.perf_counter()
        try:
            self.conns[role].send(message)
        except (OSError, EOFError, KeyError):
            self._end(request, f"the {role} worker is gone")

    def _handle(self, role: str, message: tuple) -> None:
        kind = message[0]
        if kind == "counters":
            self.replies[message[1]] = message[2]
            return
        if kind == "slot_free":
            self.decode_slots.discard(message[1])
            if message[1] not in self.free_slots:
                self.free_slots.append(message[1])
            self.stats.unpack_s += message[2] if len(message) > 2 else 0.0
            return
        transfer: Transfer | None = message[1] if kind == "prefilled" else None
        request = self.requests.get(transfer.request_id if transfer else message[1])
        if kind == "failed" and role == "prefill":   # the prefill worker is done with the slot, whatever happened
            self.orphan_slots.discard(message[3])
            self.free_slots.append(message[3])
            if request is not None:
                request.slot = None
        if request is None:   # it ended meanwhile: drop the late news
            if transfer:
                self.orphan_slots.discard(transfer.slot)
                try:
                    if self.transport != "gloo" or "decode" not in self.conns:
                        raise OSError("nothing to drain")
                    self.conns["decode"].send(("discard", transfer))   # its send must still be received
                    self.decode_slots.add(transfer.slot)
                except OSError:
                    self.free_slots.append(transfer.slot)
            return
        if transfer:
            self.stats.transfers += 1
            self.stats.bytes += transfer.nbytes
            self.stats.pack_s += transfer.pack_s
            request.output_token_ids.append(transfer.first_token)
            request.token_times.append(time.perf_counter())
            corrupt, self.corrupt_next_transfer = self.corrupt_next_transfer, False
            self._to("decode", request, ("decode", transfer, request.params,
                                         len(request.prompt_token_ids) + request.params.max_tokens, corrupt))
            if request.slot is not None:   # sent: the decode side frees the slot once it has copied the bytes out
                self.decode_slots.add(request.slot)
                request.slot = None
        elif kind == "token":
            request.output_token_ids.append(message[2])
            request.token_times.append(time.perf_counter())
        elif kind == "done":
            self._finish(request, message[2])
        elif kind == "failed":
            self._end(request, f"{role} worker: {message[2]}")

    def _finish(self, request: SplitRequest, output: RequestOutput) -> None:
        output.request_id = request.front_id
        times = request.token_times
        request.finish_time = time.perf_counter()
        output.metrics.update(e2e_s=request.finish_time - request.arrival_time)
        if times:
            output.metrics["ttft_s"] = times[0] - request.arrival_time
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
            request.front_id, request.prompt_token_ids, list(request.output_token_ids),
            self.tokenizer.decode(request.output_token_ids), "abort", error,
            {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": len(request.output_token_ids)}))

    def _lose(self, role: str, error: str) -> None:
        """A worker is gone: close its channel, end the requests waiting on it, take back the slots nobody will
        touch any more (all but those of requests still waiting on a live prefill worker)."""
        self.conns.pop(role).close()
        for request in list(self.requests.values()):
            if request.stage == role:
                self._end(request, error)
        if role == "prefill":
            self.orphan_slots.clear()
        else:
            self.decode_slots.clear()
        held = {r.slot for r in self.requests.values() if r.slot is not None} | self.orphan_slots | self.decode_slots
        self.free_slots = deque(s for s in range(self.slots) if s not in held)


@contextmanager
def receive_timeout(conn: Connection, seconds: float) -> Iterator[None]:
    """Reads on `conn` fail (OSError) after `seconds` of silence while the block runs (the socket stays blocking,
    as Connection needs; SO_RCVTIMEO makes the kernel give up)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))
        yield
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        sock.close()


def connect_worker(role: str, address: str) -> Connection:
    """A worker's side of the control channel: TCP to the front, mutual challenge with NANO_DISAGG_KEY."""
    host, _, port = address.rpartition(":")
    key = os.environ.get("NANO_DISAGG_KEY", "").encode()
    if role not in ROLES or not host or not port.isdigit() or not key:
        raise NanoError(f"usage: NANO_DISAGG_KEY=... python -m nano.disagg {{{'|'.join(ROLES)}}} HOST:PORT")
    deadline = time.monotonic() + 60    # the front may start after its workers: keep trying for a minute
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.settimeout(None)   # a blocking socket from here on: Connection reads whole messages
            conn = Connection(sock.detach())
            with receive_timeout(conn, 30.0):
                answer_challenge(conn, key)
                deliver_challenge(conn, key)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise NanoError(f"nothing listens at {address} (is the front running?)") from None
            time.sleep(0.5)
        except (OSError, EOFError, AuthenticationError) as error:
            raise NanoError(f"cannot join the front at {address}: {error or 'the front refused the key'}") from None
    conn.send(role)
    return conn


if __name__ == "__main__":   # a worker: python -m nano.disagg ROLE HOST:PORT
    from nano import disagg   # the module by its name, so that what it pickles (Transfer) unpickles in the front
    try:
        worker_role, worker_address = sys.argv[1:3]
        disagg.worker_main(worker_role, disagg.connect_worker(worker_role, worker_address))
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionError):
        pass
    except (NanoError, ValueError) as failure:
        sys.exit(f"error: {' '.join(str(failure).splitlines())}")
