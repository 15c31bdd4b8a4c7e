"""The split's control messages: one frozen dataclass per message, sent as JSON data, never pickled.

Every message travels as `{"version": PROTOCOL_VERSION, "type": <class name>, "fields": {...}}` on the control
connection (`Channel`: `Connection.send_bytes` / `recv_bytes`), framed as MAC (32 bytes) + counter (8 bytes) +
JSON. `open_channel` runs the handshake: both ends prove they hold NANO_DISAGG_KEY (multiprocessing's challenge
and response), then each sends a fresh nonce, and the connection's MAC key is HMAC-SHA256(key, both nonces). Every
message after that carries HMAC-SHA256 over (direction, counter, payload) with a per-direction counter that starts
at 0 and goes up by one: a changed, replayed, reordered or reflected message, or one from another connection, is
refused (NanoError) before it is decoded, and the receiver drops the peer. Decoding checks the version, the type and
every field against the dataclass's annotations (nested dataclasses, lists, dicts, unions), and every int against
[0, 2**64), and raises a one-line NanoError on anything else: a pickle, unknown type, missing or extra field, wrong
type, a negative or huge number. It never executes anything. What only a side knows (the front: the vocabulary)
that side checks.
`SamplingParams` and `RequestOutput` travel as their field dicts (SamplingParams checks its own values again).
The KV bytes never travel here: they go on a data path (transport.py), described by `Transfer`.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Union

from nano.errors import NanoError, brief
from nano.engine import EngineConfig
from nano.llm import RequestOutput
from nano.sampling import SamplingParams

PROTOCOL_VERSION = 7
ROLES = ("prefill", "decode")
MAX_MESSAGE_BYTES = 64 * 2**20
INT_LIMIT = 2**64                  # every int a message carries (ids, counts, sizes, token ids, seeds) is in [0, 2**64)


# ---- front -> worker ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """The front's first message: the worker's `LLM(model, config)` and its data path (shm or gloo)."""
    model: str
    config: EngineConfig
    transport: str
    timeout_s: float
    shm_fd: int | None = None      # shm: the staging buffer (a memfd the worker inherited) and its slots
    slots: int = 0
    slot_bytes: int = 0
    store_host: str | None = None  # gloo: the front's TCPStore
    store_port: int | None = None


@dataclass(frozen=True)
class Prefill:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    slot: int                      # the staging slot this request's KV goes into


@dataclass(frozen=True)
class Part:
    """One tensor of the packed KV: `nbytes` bytes at `offset`, read as `dtype` in `shape`."""
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Transfer:
    """What goes with one request's packed KV (the bytes are on the data path)."""
    request_id: int
    slot: int
    parts: list[Part]
    nbytes: int
    checksum: int                  # transport.checksum of the first `nbytes` bytes
    prompt_token_ids: list[int]
    first_token: int
    generator_state: bytes         # the sampler's state after the first token (seeded requests continue it)
    kv_dtype: str                  # the prefill pool's KV dtype ...
    kv_layout: str                 # ... and layout (FP8: token, tensor or tile; nano/kv.py)
    generation: int                # gloo: the group the bytes were sent on (a replaced worker's are stale)
    pack_s: float                  # prefill side: export into the buffer + checksum


@dataclass(frozen=True)
class Decode:
    transfer: Transfer
    params: SamplingParams
    max_total_tokens: int


@dataclass(frozen=True)
class Discard:
    """gloo: an ended request's bytes, received and dropped so that the prefill worker's send completes."""
    transfer: Transfer


@dataclass(frozen=True)
class Abort:
    request_id: int


@dataclass(frozen=True)
class Regroup:
    generation: int


@dataclass(frozen=True)
class CountersQuery:
    reset: bool


@dataclass(frozen=True)
class Stop:
    """The worker finishes and exits."""


# ---- worker -> front ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    role: str


@dataclass(frozen=True)
class Ready:
    pid: int
    host: str
    label: str
    dtype: str
    kv_dtype: str
    weights: str                   # the worker's weight format
    weight_bytes: dict[str, int]   # its resident weight bytes by storage format (it holds only its own format)
    kv_tokens: int                 # the tokens its KV pool holds


@dataclass(frozen=True)
class Refused:
    """The worker could not start, or could not read a message (then it stops)."""
    error: str


@dataclass(frozen=True)
class Prefilled:
    transfer: Transfer


@dataclass(frozen=True)
class Token:
    request_id: int
    token: int


@dataclass(frozen=True)
class Done:
    request_id: int
    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    request_id: int
    error: str
    slot: int | None               # a staging slot the worker is done with, if any


@dataclass(frozen=True)
class SlotFree:
    slot: int
    unpack_s: float = 0.0          # decode side: receive + checksum + copy into its pages


@dataclass(frozen=True)
class Counters:
    role: str
    figures: dict[str, int | float | str | bool | None]


MESSAGES = {cls.__name__: cls for cls in (Setup, Prefill, Decode, Discard, Abort, Regroup, CountersQuery, Stop,
                                           Hello, Ready, Refused, Prefilled, Token, Done, Failed, SlotFree, Counters)}
Message = Union[tuple(MESSAGES.values())]


# ---- encoding -----------------------------------------------------------------------------------------------------
def encode(message: Message) -> bytes:
    return json.dumps({"version": PROTOCOL_VERSION, "type": type(message).__name__,
                       "fields": dataclasses.asdict(message)}, default=lambda raw: base64.b64encode(raw).decode()
                      ).encode()


@functools.cache
def _fields(kind: type) -> dict[str, Any]:
    return typing.get_type_hints(kind)


def _from_data(kind: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) as an instance of the annotation `kind`, or NanoError naming the field."""
    if type(value) is int and not 0 <= value < INT_LIMIT:
        raise NanoError(f"{where}: {value!r:.24} is out of range [0, 2**64)")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        for option in args:
            try:
                return _from_data(option, value, where)
            except NanoError:
                pass
    elif dataclasses.is_dataclass(kind) and isinstance(value, dict):
        fields = _fields(kind)
        if set(value) - set(fields):
            raise NanoError(f"{where}: unknown field {sorted(set(value) - set(fields))[0]!r:.40}")
        try:
            return kind(**{name: _from_data(fields[name], v, f"{where}.{name}") for name, v in value.items()})
        except TypeError:
            raise NanoError(f"{where}: missing field {sorted(set(fields) - set(value))[0]!r}") from None
    elif origin is list and isinstance(value, list):
        if args[0] is int and all(type(v) is int and 0 <= v < INT_LIMIT for v in value):   # token ids, at once
            return value
        return [_from_data(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, dict):
        return {k: _from_data(args[1], v, f"{where}.{k}") for k, v in value.items()}
    elif kind is bytes and isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            pass
    elif kind is float and type(value) in (int, float) or kind in (int, str, bool) and type(value) is kind:
        return value
    elif kind is type(None) and value is None:
        return None
    raise NanoError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")


def decode(data: bytes) -> Message:
    """One message from the peer, checked field by field; NanoError on anything malformed or unknown."""
    try:
        envelope = json.loads(data)
    except (ValueError, RecursionError):   # a pickle, say: refused, never loaded
        raise NanoError(f"malformed message ({len(data):,} bytes): not the split's JSON protocol") from None
    if not isinstance(envelope, dict) or set(envelope) != {"version", "type", "fields"}:
        raise NanoError("malformed message: expected version, type and fields")
    if envelope["version"] != PROTOCOL_VERSION:
        raise NanoError(f"protocol version {envelope['version']!r:.20} from the peer; this side speaks "
                        f"{PROTOCOL_VERSION}")
    kind = MESSAGES.get(envelope["type"]) if isinstance(envelope["type"], str) else None
    if kind is None:
        raise NanoError(f"unknown message type {envelope['type']!r:.40}")
    return _from_data(kind, envelope["fields"], kind.__name__)


MAC_BYTES, COUNTER_BYTES = 32, 8
NONCE_BYTES = 16
HANDSHAKE_S = 5.0                   # each step of the handshake, per connection


def gloo_prefix(key: bytes, generation: int) -> str:
    """The TCPStore prefix of a gloo group: secret (derived from the session key), so that nobody without the key
    can plant or read the keys of a rendezvous."""
    return f"nano-disagg/{hmac.new(key, b'gloo-rendezvous', hashlib.sha256).hexdigest()[:32]}/{generation}"


class Channel:
    """One end of an authenticated control connection, carrying `Message`s (the one place that reads or writes
    its bytes). `side` is "front" or "worker"; `key` the connection's MAC key (see `open_channel`)."""

    def __init__(self, conn: Connection, key: bytes, side: str) -> None:
        assert side in ("front", "worker")
        self.conn, self.key = conn, key
        self.out_label, self.in_label = (b"front->worker", b"worker->front") if side == "front" else \
            (b"worker->front", b"front->worker")
        self.sent = self.received = 0

    def mac(self, label: bytes, counter: int, payload: bytes) -> bytes:
        return hmac.new(self.key, label + counter.to_bytes(COUNTER_BYTES, "big") + payload, hashlib.sha256).digest()

    def send(self, message: Message) -> None:
        self.send_raw(encode(message))

    def send_raw(self, payload: bytes) -> None:
        counter = self.sent
        self.sent += 1
        self.conn.send_bytes(self.mac(self.out_label, counter, payload) + counter.to_bytes(COUNTER_BYTES, "big")
                             + payload)

    def recv(self) -> Message:
        """The next message (NanoError if it is unauthenticated, replayed or malformed; EOFError or OSError if the
        connection is gone)."""
        frame = self.conn.recv_bytes(MAX_MESSAGE_BYTES)
        if len(frame) < MAC_BYTES + COUNTER_BYTES:
            raise NanoError(f"unauthenticated message ({len(frame):,} bytes, no MAC): refused")
        tag, counter, payload = frame[:MAC_BYTES], frame[MAC_BYTES:MAC_BYTES + COUNTER_BYTES], \
            frame[MAC_BYTES + COUNTER_BYTES:]
        number = int.from_bytes(counter, "big")
        if not hmac.compare_digest(tag, self.mac(self.in_label, number, payload)):
            raise NanoError("message refused: its MAC does not match (changed in transit, or not from the peer)")
        if number != self.received:
            raise NanoError(f"message refused: counter {number}, expected {self.received} (replayed or reordered)")
        self.received += 1
        return decode(payload)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


def open_channel(conn: Connection, key: bytes, side: str, timeout_s: float = HANDSHAKE_S) -> Channel:
    """The handshake on a fresh connection: mutual challenge and response with `key` (the front challenges
    first), then a fresh nonce from each side; the MAC key is bound to both nonces, so no message of another
    connection is accepted on this one. Raises NanoError if the peer does not hold the key or is too slow."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        with receive_timeout(conn, timeout_s):
            if side == "front":
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
            else:
                answer_challenge(conn, key)
                deliver_challenge(conn, key)
            conn.send_bytes(nonce)
            theirs = conn.recv_bytes(NONCE_BYTES)
    except AuthenticationError:
        raise NanoError("the peer does not hold the session key") from None
    except BlockingIOError:
        raise NanoError(f"the peer did not complete the handshake within {timeout_s:.0f} s") from None
    except (EOFError, OSError) as error:
        raise NanoError(f"the handshake failed: {brief(error) if str(error) else 'the peer hung up'}") from None
    if len(theirs) != NONCE_BYTES:
        raise NanoError("the handshake failed: malformed nonce")
    front, worker = (nonce, theirs) if side == "front" else (theirs, nonce)
    return Channel(conn, hmac.new(key, b"nano-disagg-channel" + front + worker, hashlib.sha256).digest(), side)


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
