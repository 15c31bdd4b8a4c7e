"""The KV data paths between the workers, the byte layout of a packed transfer, and its checksum.

A prefill worker asks its path for an `outgoing` buffer, exports the prompt's KV straight into it (one copy, no
staging copy, no dtype change), checksums it and `send`s it; the decode worker `receive`s the bytes of a
`Transfer` (an `Incoming`, which says when they are in) and imports them from there. Two paths have that shape:
  Staging  - one host: an anonymous shared-memory buffer (memfd) in equal slots that every process maps (the front
             too); the spawned workers inherit its descriptor, so it has no name and nothing is left behind;
  GlooPath - across hosts: torch.distributed point to point over gloo (TCP), one group per generation.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
import zlib
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from nano.disagg.protocol import Part, Transfer, gloo_prefix
from nano.errors import NanoError, brief

ALIGN = 64                        # every part starts at a multiple of 64 bytes, so each can be viewed in its dtype
HASH_WORDS = 4096                 # the checksum's block: 4,096 int64 words (32 KiB)
HASH_KEYS = torch.randint(-2**63, 2**63 - 1, (HASH_WORDS,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(0x6E616E6F)) | 1   # fixed odd multipliers


def layout(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[Part], int]:
    """Where each part of an export goes in the buffer (back to back, aligned); returns (parts, bytes)."""
    parts, offset = [], 0
    for name, (dtype, shape) in shapes.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        parts.append(Part(name, str(dtype).removeprefix("torch."), list(shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return parts, offset


def views(parts: list[Part], data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parts as tensors viewing the byte buffer `data` (no copy)."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
    if any(p.dtype not in dtypes or p.offset % ALIGN or p.offset + p.nbytes > data.numel() for p in parts):
        raise NanoError("the transfer's layout does not fit its bytes")
    return {p.name: data[p.offset:p.offset + p.nbytes].view(dtypes[p.dtype]).view(p.shape) for p in parts}


def checksum(data: torch.Tensor) -> int:
    """A checksum of a byte buffer at memory speed (zlib's CRC32 runs at a third of it): each 32 KiB block's
    int64 words dotted with fixed odd multipliers, mod 2^64 (so one changed word always changes its block's sum,
    and a moved one almost always does), then CRC32 over the block sums and the last partial block. It catches
    accidents, not an attacker: the multipliers are public."""
    whole = data.numel() // (8 * HASH_WORDS) * 8 * HASH_WORDS
    blocks = data[:whole].view(torch.int64).view(-1, HASH_WORDS) @ HASH_KEYS            # [blocks] int64
    return zlib.crc32(data[whole:].numpy(), zlib.crc32(blocks.numpy()))


class Incoming:
    """One transfer's bytes on their way to the decode worker. shm: in the slot already. gloo: a thread of its own
    waits for the receive, so the worker decodes on meanwhile and a prefill worker that stops sending stalls only
    this request. `arrived` once the bytes are in or the receive failed; then `data()` returns them (NanoError if
    it failed), and `seconds` is how long the receive took."""

    def __init__(self, request_id: int, data: torch.Tensor | None = None,
                 receive: Callable[[], torch.Tensor] | None = None) -> None:
        self.request_id, self.buffer, self.error, self.seconds = request_id, data, None, 0.0
        self.done = threading.Event()
        if receive is None:
            self.done.set()
        else:
            threading.Thread(target=self._run, args=(receive, time.perf_counter()), daemon=True,
                             name="nano-kv-receive").start()

    def _run(self, receive: Callable[[], torch.Tensor], start: float) -> None:
        try:
            self.buffer = receive()
        except NanoError as error:
            self.error = str(error)
        except RuntimeError as error:   # the group broke (the prefill worker died), it timed out, no memory
            self.error = f"receiving request {self.request_id}'s KV from the prefill worker failed: {brief(error)}"
        self.seconds = time.perf_counter() - start
        self.done.set()

    @property
    def arrived(self) -> bool:
        return self.done.is_set()

    def data(self) -> torch.Tensor:
        if self.error:
            raise NanoError(self.error)
        return self.buffer


class Staging:
    """Data path on one host: an anonymous shared-memory byte buffer in `slots` equal slots. The front creates it
    with memfd_create (no name in /dev/shm) and its spawned workers inherit the descriptor (`fd`) and map it; the
    memory is freed by the kernel when the last process holding it exits or closes it, however it ends (SIGKILL
    of the whole process group included). The prefill worker packs into a slot; the decode worker reads the same
    memory, and returns the slot (SlotFree) once its pages hold a copy."""
    generation = 0

    def __init__(self, slots: int, slot_bytes: int, fd: int | None = None) -> None:
        self.slots, self.slot_bytes = slots, -(-slot_bytes // ALIGN) * ALIGN
        size = slots * self.slot_bytes
        if fd is None:
            self.fd = os.memfd_create("nano-disagg-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
        else:   # a worker: the descriptor it inherited from the front
            try:
                if os.fstat(fd).st_size < size:
                    raise NanoError("the staging buffer the front passed is smaller than its slots")
            except OSError as error:
                raise NanoError(f"no staging buffer at descriptor {fd} (shm needs a worker the front spawned): "
                                f"{brief(error)}") from None
            self.fd = fd
        self.map = mmap.mmap(self.fd, size)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap and close the descriptor (there is no name to remove)."""
        del self.buffer
        try:
            self.map.close()
        except BufferError:   # a view is still alive somewhere: the mapping goes with the process
            pass
        os.close(self.fd)

    def slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.buffer[start:start + (self.slot_bytes if nbytes is None else nbytes)]

    def outgoing(self, slot: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.slot_bytes:
            raise NanoError(f"the prompt's KV needs {nbytes:,} bytes, more than a staging slot's "
                            f"{self.slot_bytes:,}; start the split with larger staging slots")
        return self.slot(slot, nbytes)

    def send(self, request_id: int, data: torch.Tensor) -> None:
        """Nothing to do: the bytes are where the decode worker reads them."""

    def receive(self, transfer: Transfer) -> Incoming:
        return Incoming(transfer.request_id, self.slot(transfer.slot, transfer.nbytes))


class GlooPath:
    """Data path across hosts: torch.distributed point-to-point over gloo (TCP). Rank 0 is the prefill worker,
    rank 1 the decode worker; they meet through the front's TCPStore. Each group has a generation: when a worker
    is replaced, the front tells both live workers to form a fresh group under a new prefix (`connect`), and
    bytes sent on an older group are refused as stale, never waited for.

    Prefill posts an asynchronous send tagged with the request id before its control message goes out; decode,
    on the control message, receives into a buffer of its own. Gloo moves the bytes once both are posted. Every
    posted send is matched by exactly one receive (the front forwards even an ended request's transfer, to be
    drained), so no send waits forever: a thread waits on each, holding its bytes until the decode worker has
    them (or the group breaks)."""

    def __init__(self, rank: int, host: str, port: int, timeout_s: float, key: bytes) -> None:
        self.rank, self.timeout, self.key = rank, timedelta(seconds=timeout_s), key
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        except (RuntimeError, OSError) as error:
            raise NanoError(f"cannot reach the front's TCPStore at {host}:{port}: {brief(error)}") from None
        self.group: dist.ProcessGroupGloo | None = None
        self.generation = -1

    def connect(self, generation: int) -> None:
        """Form the group with the peer (blocks until it joins, at most the timeout)."""
        self.group, self.generation = None, generation
        try:
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(gloo_prefix(self.key, generation), self.store),
                                               self.rank, 2, self.timeout)
        except RuntimeError as error:
            raise NanoError(f"could not form the KV data group with the other worker: "
                            f"{brief(error)}") from None

    def outgoing(self, slot: int, nbytes: int) -> torch.Tensor:
        if self.group is None:
            raise NanoError("no KV data path: the decode worker has not joined (it is being replaced)")
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, request_id: int, data: torch.Tensor) -> None:
        try:
            work = self.group.send([data], 1, request_id)
        except RuntimeError as error:   # the group broke (decode died): a regroup follows
            raise NanoError(f"sending the KV to the decode worker failed: {brief(error)}") from None
        # no deadline of its own: the send completes when the front has forwarded it, however late it polls
        threading.Thread(target=lambda: _settle(work, data), daemon=True, name="nano-kv-send").start()

    def receive(self, transfer: Transfer) -> Incoming:
        group, generation = self.group, self.generation

        def receive() -> torch.Tensor:
            if group is None or transfer.generation != generation:
                raise NanoError(f"request {transfer.request_id}'s KV was sent to a worker that has since been "
                                f"replaced (group {transfer.generation}, now {generation})")
            data = torch.empty(transfer.nbytes, dtype=torch.uint8)
            group.recv([data], 0, transfer.request_id).wait()   # at most the group's timeout
            return data
        return Incoming(transfer.request_id, receive=receive)

    def close(self) -> None:
        self.group = None


def _settle(work: dist.Work, data: torch.Tensor) -> None:
    """Wait for a posted send (holding its bytes); a failure is the receiver's to report."""
    try:
        work.wait(timedelta(days=7))
    except RuntimeError:
        pass


DataPath = Staging | GlooPath
