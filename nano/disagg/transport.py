"""The KV data paths between the workers, the byte layout of a packed transfer, and its checksum.

A prefill worker asks its path for an `outgoing` buffer, exports the prompt's KV straight into it (one copy, no
staging copy, no dtype change), checksums it and `send`s it; the decode worker `receive`s the bytes of a
`Transfer` and imports them from there. Two paths have that shape:
  Staging  - one host: a POSIX shared-memory buffer in equal slots that every process maps (the front too);
  GlooPath - across hosts: torch.distributed point to point over gloo (TCP), one group per generation.
"""
from __future__ import annotations

import zlib
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
import torch.distributed as dist

from nano.disagg.protocol import Part, Transfer
from nano.errors import NanoError

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


class Staging:
    """Data path on one host: a shared-memory byte buffer (POSIX shm, by name) in `slots` equal slots. The front
    creates and unlinks it; the workers attach by name. The prefill worker packs into a slot; the decode worker
    reads the same memory, and returns the slot (SlotFree) once its pages hold a copy."""
    generation = 0

    def __init__(self, slots: int, slot_bytes: int, name: str | None = None) -> None:
        self.slots, self.slot_bytes = slots, -(-slot_bytes // ALIGN) * ALIGN
        self.shm = SharedMemory(name=name, create=name is None, size=slots * self.slot_bytes)
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

    def outgoing(self, slot: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.slot_bytes:
            raise NanoError(f"the prompt's KV needs {nbytes:,} bytes, more than a staging slot's "
                            f"{self.slot_bytes:,}; start the split with larger staging slots")
        return self.slot(slot, nbytes)

    def send(self, request_id: int, data: torch.Tensor) -> None:
        """Nothing to do: the bytes are where the decode worker reads them."""

    def receive(self, transfer: Transfer) -> torch.Tensor:
        return self.slot(transfer.slot, transfer.nbytes)


class GlooPath:
    """Data path across hosts: torch.distributed point-to-point over gloo (TCP). Rank 0 is the prefill worker,
    rank 1 the decode worker; they meet through the front's TCPStore. Each group has a generation: when a worker
    is replaced, the front tells both live workers to form a fresh group under a new prefix (`connect`), and
    bytes sent on an older group are refused as stale, never waited for.

    Prefill posts an asynchronous send tagged with the request id before its control message goes out; decode,
    on the control message, receives into a buffer of its own. Every posted send is matched by exactly one
    receive (the front forwards even an ended request's transfer, to be drained), so no send waits forever."""

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

    def outgoing(self, slot: int, nbytes: int) -> torch.Tensor:
        if self.group is None:
            raise NanoError("no KV data path: the decode worker has not joined (it is being replaced)")
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, request_id: int, data: torch.Tensor) -> None:
        self.outbox = {rid: (data, work) for rid, (data, work) in self.outbox.items() if not work.is_completed()}
        try:
            self.outbox[request_id] = (data, self.group.send([data], 1, request_id))
        except RuntimeError as error:   # the group broke (decode died): a regroup follows
            raise NanoError(f"sending the KV to the decode worker failed: {str(error).splitlines()[0]}") from None

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
