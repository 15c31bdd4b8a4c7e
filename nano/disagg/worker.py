"""A worker process: `python -m nano.disagg ROLE HOST:PORT` joins the front, builds its own LLM in its own formats,
then serves the front's messages until `Stop` (or the front is gone).

prefill: each `Prefill` runs as a one-token request that keeps its pages; when it finishes, the prompt's KV is
  exported straight into the data path's buffer (after the integrity check of its page table), checksummed and
  announced with `Prefilled(Transfer)`; the pages are freed.
decode: each `Decode` receives the bytes, verifies the checksum, allocates pages of its own pool (tagged by its
  integrity tracker), imports the KV (converting to its dtype), returns the slot and decodes from the first
  token with the sampler state the prefill worker left; tokens go back as `Token`, the end as `Done`.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections import deque
from multiprocessing.connection import Connection

import torch

from nano.disagg import protocol as p
from nano.disagg.transport import DataPath, GlooPath, Incoming, Staging, checksum, layout, views
from nano.errors import NanoError, brief
from nano.kv import part_shapes
from nano.llm import LLM
from nano.scheduler import Request

SAMPLER_STATE_BYTES = torch.Generator().get_state().numel()   # a CPU generator's state


def connect_worker(role: str, address: str) -> p.Channel:
    """A worker's side of the control channel: TCP to the front, mutual challenge with NANO_DISAGG_KEY."""
    host, _, port = address.rpartition(":")
    key = os.environ.get("NANO_DISAGG_KEY", "").encode()
    if role not in p.ROLES or not host or not port.isdigit() or not key:
        raise NanoError(f"usage: NANO_DISAGG_KEY=... python -m nano.disagg {{{'|'.join(p.ROLES)}}} HOST:PORT")
    deadline = time.monotonic() + 60    # the front may start after its workers: keep trying for a minute
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.settimeout(None)   # a blocking socket from here on: Connection reads whole messages
            channel = p.open_channel(Connection(sock.detach()), key, "worker", timeout_s=30.0)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise NanoError(f"nothing listens at {address} (is the front running?)") from None
            time.sleep(0.5)
        except OSError as error:
            raise NanoError(f"cannot join the front at {address}: {brief(error)}") from None
        except NanoError as error:
            raise NanoError(f"cannot join the front at {address}: {error}") from None
    channel.send(p.Hello(role))
    return channel


def worker_main(role: str, channel: p.Channel) -> None:
    """Build the LLM and data path the front's `Setup` asks for, say `Ready`, then serve."""
    try:
        setup = channel.recv()
    except EOFError:   # the front hung up on our Hello
        raise NanoError("the front closed the connection after the handshake (another protocol version?)") from None
    try:
        if not isinstance(setup, p.Setup):
            raise NanoError("the front's first message is not a valid Setup")
        llm = LLM(setup.model, setup.config, progress=False)
        path: DataPath = (Staging(setup.slots, setup.slot_bytes, fd=setup.shm_fd) if setup.transport == "shm"
                          else GlooPath(p.ROLES.index(role), setup.store_host, setup.store_port, setup.timeout_s,
                                        os.environ.get("NANO_DISAGG_KEY", "").encode()))
    except (NanoError, OSError) as error:
        channel.send(p.Refused(str(error)))
        return
    weights = llm.prefill_weights if role == "prefill" else llm.decode_weights
    channel.send(p.Ready(os.getpid(), socket.gethostname(), llm.label, str(llm.dtype).removeprefix("torch."),
                         llm.pool.kv_dtype, weights, llm.weight_bytes(), llm.pool.tokens))
    try:
        Worker(role, channel, llm, path).serve()
    finally:
        path.close()


def reason(error: Exception) -> str:
    """One request's failure, in one line: a NanoError's message, or another exception's type and first line."""
    return str(error) if isinstance(error, NanoError) else f"{type(error).__name__}: {brief(error)}"


class Worker:
    """The serving loop. A failure of one request (its export, send, receive or import, a bad transfer) ends that
    request with `Failed`; the worker goes on. A message it cannot take ends the worker (`Refused`)."""

    def __init__(self, role: str, channel: p.Channel, llm: LLM, path: DataPath) -> None:
        self.role, self.channel, self.llm, self.engine, self.path = role, channel, llm, llm.engine, path
        self.owners: dict[Request, tuple[int, int]] = {}   # engine request -> (front id, staging slot)
        self.arrived: deque[tuple[p.Decode | p.Discard, Incoming]] = deque()   # decode: bytes coming in, in order

    def serve(self) -> None:
        """Messages first (waiting for one when there is nothing else to do), then admissions and one engine step."""
        while True:
            ready = self.engine.has_work() or self.arrived and self.arrived[0][1].arrived
            if self.channel.poll(0 if ready else 0.01 if self.arrived else None):   # bytes due: look again soon
                try:
                    message = self.channel.recv()
                    if isinstance(message, p.Stop):
                        return
                    self.handle(message)
                except EOFError:   # the front is gone
                    return
                except NanoError as error:   # unreadable or unexpected: refuse it and stop, never guess
                    self.channel.send(p.Refused(str(error)))
                    return
                continue
            if self.role == "decode":
                self.admit()
            for r, token in self.engine.step():
                if r in self.owners and self.role == "prefill" and r.finished:   # one token: it always is
                    self.prefilled(r)
                elif r in self.owners and self.role == "decode":
                    front_id = self.owners[r][0]
                    if token is not None:
                        self.channel.send(p.Token(front_id, token))
                    if r.finished:
                        del self.owners[r]
                        self.channel.send(p.Done(front_id, self.llm.output(r)))

    def handle(self, message: p.Message) -> None:
        if isinstance(message, p.Regroup):   # both workers are up (again): form the data group, this generation
            try:
                self.path.connect(message.generation)
            except NanoError:   # the peer died meanwhile: no data path until the front's next regroup
                pass
        elif isinstance(message, p.CountersQuery):
            self.channel.send(p.Counters(self.role, self.llm.counters(reset=message.reset)))
        elif isinstance(message, p.Abort):
            self.abort(message.request_id)
        elif isinstance(message, p.Prefill) and self.role == "prefill":
            params = dataclasses.replace(message.params, max_tokens=1)
            r = self.engine.add(message.prompt_token_ids, params, len(message.prompt_token_ids) + 1, keep_pages=True)
            self.owners[r] = (message.request_id, message.slot)
        elif isinstance(message, (p.Decode, p.Discard)) and self.role == "decode":   # admitted once its bytes are in
            self.arrived.append((message, self.path.receive(message.transfer)))
        else:
            raise NanoError(f"the {self.role} worker does not take {type(message).__name__} messages")

    def prefilled(self, r: Request) -> None:
        """Prefill: the request has its first token: export its KV to the data path, announce it, free its pages."""
        front_id, slot = self.owners.pop(r)
        try:
            if r.finish_reason == "abort":
                raise NanoError(r.error)
            start = time.perf_counter()
            parts, nbytes = layout(self.llm.pool.token_shapes(len(r.prompt_token_ids)))
            data = self.path.outgoing(slot, nbytes)
            self.engine.export_kv(r, views(parts, data))   # [L, T, ...] straight into the buffer, in the pool's dtype
            transfer = p.Transfer(front_id, slot, parts, nbytes, checksum(data), r.prompt_token_ids,
                                  r.output_token_ids[0], r.generator.get_state().numpy().tobytes(),
                                  self.llm.pool.kv_dtype, self.llm.pool.kv_layout, self.path.generation,
                                  time.perf_counter() - start)
            self.path.send(front_id, data)   # gloo: posted before the control message leaves
            self.channel.send(p.Prefilled(transfer))
        except Exception as error:
            self.channel.send(p.Failed(front_id, reason(error), slot))
        self.engine.release(r)

    def admit(self) -> None:
        """Decode: each transfer whose bytes are in, in order: verify it, copy it into pages of our own pool, give its
        slot back (a discarded one is only given back)."""
        while self.arrived and self.arrived[0][1].arrived:
            message, incoming = self.arrived[0]
            transfer, start, r, error = message.transfer, time.perf_counter(), None, None
            try:
                data = incoming.data()
                if isinstance(message, p.Decode):
                    r = self.imported(message, data)
                    if r is None:   # the pool is full: decode on, and try again after the step
                        return
            except Exception as failure:
                error = reason(failure)
            self.arrived.popleft()
            self.channel.send(p.SlotFree(transfer.slot, incoming.seconds + time.perf_counter() - start))
            if error and isinstance(message, p.Decode):
                self.channel.send(p.Failed(transfer.request_id, error, None))
            elif r is not None and r.finished:    # max_tokens 1, or the first token was a stop token
                self.channel.send(p.Done(transfer.request_id, self.llm.output(r)))
            elif r is not None:
                self.owners[r] = (transfer.request_id, transfer.slot)

    def imported(self, message: p.Decode, data: torch.Tensor) -> Request | None:
        """The request of a verified transfer, its KV copied into our pages (None: the pool cannot take it now)."""
        transfer = message.transfer
        if checksum(data) != transfer.checksum:
            raise NanoError(f"KV transfer checksum mismatch for request {transfer.request_id} (slot "
                            f"{transfer.slot}, {transfer.nbytes:,} bytes): the bytes changed between "
                            f"prefill and decode")
        parts = self.checked_parts(transfer, data)
        state = torch.frombuffer(bytearray(transfer.generator_state), dtype=torch.uint8)
        return self.engine.add_prefilled(transfer.prompt_token_ids, transfer.first_token, message.params,
                                         message.max_total_tokens, parts, generator_state=state)

    def checked_parts(self, transfer: p.Transfer, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """The transfer's tensors, if they are what a pool of the sender's dtype and layout holds for its tokens
        (this pool converts them when its own differ), the prompt fits the pool at all, and the sampler state has
        the right size."""
        tokens = len(transfer.prompt_token_ids)
        parts = views(transfer.parts, data)
        want = {name: (dtype, shape) for name, (dtype, shape) in
                part_shapes(self.llm.config, transfer.kv_dtype, transfer.kv_layout, tokens).items()}
        if {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in parts.items()} != want or \
                len(transfer.generator_state) != SAMPLER_STATE_BYTES:
            raise NanoError(f"request {transfer.request_id}'s KV layout does not fit the decode pool")
        if self.engine.scheduler.pages_for(tokens + 1) > self.llm.pool.num_pages:
            raise NanoError(f"request {transfer.request_id}'s prompt needs more pages than the decode pool holds")
        return parts

    def abort(self, front_id: int) -> None:
        """The front gave up on a request (e.g. a closed stream): drop it here too."""
        for item in [item for item in self.arrived if item[0].transfer.request_id == front_id]:
            self.arrived.remove(item)   # not admitted yet: give its slot back (gloo: its bytes are dropped on arrival)
            self.channel.send(p.SlotFree(item[0].transfer.slot))
        for r, (owner, _) in list(self.owners.items()):
            if owner == front_id:
                del self.owners[r]
                self.engine.abort(r, "aborted by the front")
