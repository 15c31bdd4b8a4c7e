"""Prefill and decode in two OS processes, each with its own formats (disaggregated serving).

Prefill is compute-bound and decode memory-bound, so production runs them on separate pools, each configured for
its phase: prefill with BF16 KV and BF16/FP8 weights, decode with FP8 KV and INT4 weights. Here:

    front (this process)          prefill worker (process)            decode worker (process)
    submit ── Prefill(id, prompt, params, slot) ─▶ engine: prompt -> KV + first token
                                   KV of the prompt's tokens -> data path, checksum; pages freed
           ◀── Prefilled(Transfer) ─┘
    first token out (TTFT)
           ── Decode(Transfer) ─────────────────────────────────────▶ verify checksum, allocate own pages
                                                                      (integrity-tagged), import (convert dtype),
                                                                      SlotFree, decode with the sampler state
           ◀── Token ... / Done(RequestOutput) ──────────────────────┘

The package, top to bottom (imports point down only):
    front.py       SplitLLM: the API, the event loop, the request records and the staging slots
    supervisor.py  spawn, handshake, ready, kill and close the workers; the staging buffer or TCPStore
    worker.py      the worker process: its own LLM, the prefill and decode loops
    transport.py   the KV data paths (shared-memory Staging, GlooPath), the byte layout and checksum
    protocol.py    the typed control messages, JSON-encoded (never pickled), and the Channel that carries them
"""
from nano.disagg.front import TRANSPORTS, SplitLLM, SplitRequest, TransferStats
from nano.disagg.protocol import PROTOCOL_VERSION, ROLES
from nano.disagg.transport import Staging

__all__ = ["PROTOCOL_VERSION", "ROLES", "TRANSPORTS", "SplitLLM", "SplitRequest", "Staging", "TransferStats"]
