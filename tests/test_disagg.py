"""Prefill and decode in two OS processes: the split's output equals one process's (greedy and seeded), its
protocol is typed data that refuses anything else, a corrupted transfer aborts only its request, a dead worker ends
its requests with errors (never a hang) and can be replaced.

Every test that waits on the workers is bounded: the front's `timeout_s` ends stuck requests, and each test
asserts how long settling took."""
from __future__ import annotations

import ast
import json
import os
import pickle
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import nullcontext
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

import pytest
import torch

from nano import LLM, SamplingParams
from nano.cli.faults import corrupt_next_transfer
from nano.disagg import SplitLLM, protocol
from nano.disagg.protocol import PROTOCOL_VERSION, decode, encode
from nano.disagg.transport import GlooPath, Staging, checksum
from nano.disagg.worker import Worker
from nano.kv import KVPool
from nano.engine import EngineConfig
from nano.errors import NanoError, brief
from nano.llm import RequestOutput, resolve_config
from fixtures import assert_user_error, listening_addresses, nano, read_config, read_tensors, write_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=1234, ignore_eos=True)
# The report's GLM-5.2 policy: prefill through FP8 weights, decode through INT4 experts (SplitLLM's defaults, BF16
# prefill weights, run in `small_split` and in tests/test_no_triton.py's split); 4 MiB of KV a pool (over 20,000 of
# the tiny model's tokens), not the 256 MiB a CPU pool zero-fills by default.
FORMATS = dict(prefill_weights="fp8", decode_weights="int4", dtype="float32", page_size=16, kv_budget="4MiB")
CONTEXT = 512


@pytest.fixture(scope="module")
def model(tiny_glm5, tmp_path_factory) -> str:
    """conftest.py's tiny random GLM-5 (3 layers of width 64, the DSA indexer), its context cut to 512 positions:
    nothing here depends on the weights, each worker process builds and steps it in a fraction of a stand-in's time,
    and a prompt that fills the context (the context test) is prefilled in a fraction of a second."""
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny_glm5_512"), read_tensors(tiny_glm5),
                                {**read_config(tiny_glm5), "max_position_embeddings": CONTEXT}, src=tiny_glm5))


@pytest.fixture(scope="module")
def split(model):
    # no prefix cache: the failure tests run a batch for its golden outputs, then run it again and kill a worker
    # while its prefill is in flight, which a cache hit would cut to nothing. 180 s: a hang guard only
    with SplitLLM(model, prefill_kv_dtype="fp8", decode_kv_dtype="fp8", timeout_s=180, prefix_cache=False,
                  **FORMATS) as front:
        yield front


@pytest.fixture(scope="module")
def single(model):
    """One process in the split's formats: prefill steps through FP8 weights, decode steps through INT4."""
    return LLM(model, kv_dtype="fp8", progress=False, **FORMATS)


def prompts(count: int, seed: int = 0, low: int = 20, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def settle(split: SplitLLM, requests, limit_s: float = 60.0) -> float:
    start = time.perf_counter()
    while not all(r.output for r in requests):
        split.poll()
        assert time.perf_counter() - start < limit_s, "the split did not settle"
    return time.perf_counter() - start


# ---- the protocol: typed data, nothing else ---------------------------------------------------------------------
PARAMS = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7, max_tokens=5, stop_token_ids=[2], ignore_eos=True)
TRANSFER = protocol.Transfer(3, 1, [protocol.Part("kv", "bfloat16", [2, 4, 8], 0, 128)], 128, 2**40 + 5, [1, 2, 3],
                             9, bytes(range(256)) * 3, "bf16", "token", 2, 0.25)
ONE_OF_EACH = [
    protocol.Setup("glm-5.2-random", EngineConfig(kv_budget=1024, integrity=False, threads=1), "shm", 60.0,
                   shm_fd=5, slots=8, slot_bytes=4096),
    protocol.Prefill(3, [1, 2, 3], PARAMS, 1), protocol.Decode(TRANSFER, PARAMS, 10), protocol.Discard(TRANSFER),
    protocol.Abort(3), protocol.Regroup(2), protocol.CountersQuery(True), protocol.Stop(), protocol.Hello("decode"),
    protocol.Ready(11, "host", "nano glm-5.2", "float32", "fp8", "int4", {"int4": 7, "fp32": 9}, 4096),
    protocol.Refused("no"),
    protocol.Prefilled(TRANSFER), protocol.Token(3, 42),
    protocol.Done(3, RequestOutput(3, [1, 2], [5, 6], "ab", "length", None, {"ttft_s": 0.5, "prompt_tokens": 2})),
    protocol.Failed(3, "boom", None), protocol.Failed(3, "boom", 2), protocol.SlotFree(1, 0.001),
    protocol.Counters("decode", {"steps": 3, "kv_dtype": "fp8", "integrity": True, "step_s": 0.5}),
]


def test_every_message_round_trips_as_json():
    assert {type(m).__name__ for m in ONE_OF_EACH} == set(protocol.MESSAGES)
    for message in ONE_OF_EACH:
        wire = encode(message)
        assert json.loads(wire)["type"] == type(message).__name__     # plain JSON data
        assert decode(wire) == message


class Payload:
    """Unpickling this would create `path`: a refused payload must never run."""
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def envelope(kind: str, fields, version: int = PROTOCOL_VERSION) -> bytes:
    return json.dumps({"version": version, "type": kind, "fields": fields}).encode()


def good(message) -> dict:
    return json.loads(encode(message))["fields"]


@pytest.mark.parametrize("payload, fragment", [
    (b"\x80\x04not json", "not the split's JSON protocol"),
    (pickle.dumps(("prefill", 0, [1, 2], None, 0)), "not the split's JSON protocol"),      # the old protocol
    (b"[1, 2]", "expected version, type and fields"),
    (envelope("Token", {"request_id": 1, "token": 2}, PROTOCOL_VERSION + 1), "protocol version"),
    (envelope("Exec", {"code": "print(1)"}), "unknown message type 'Exec'"),
    (envelope("Token", {"request_id": 1}), "missing field 'token'"),
    (envelope("Token", {"request_id": 1, "token": 2, "extra": 3}), "unknown field 'extra'"),
    (envelope("Token", {"request_id": "1", "token": 2}), "Token.request_id: expected int, got str"),
    (envelope("Token", {"request_id": True, "token": 2}), "Token.request_id: expected int, got bool"),
    (envelope("Token", {"request_id": 1, "token": 10**30}), "Token.token: 100000000000000000000000 is out of range"),
    (envelope("Token", {"request_id": -1, "token": 2}), "Token.request_id: -1 is out of range [0, 2**64)"),
    (envelope("Failed", {"request_id": 1, "error": "x", "slot": -3}), "Failed.slot: -3 is out of range"),
    (envelope("Token", [1, 2]), "Token: expected Token, got list"),
    (envelope("Prefill", {**good(protocol.Prefill(1, [1], PARAMS, 0)), "prompt_token_ids": [1, "x"]}),
     "Prefill.prompt_token_ids[1]: expected int"),
    (envelope("Prefill", {**good(protocol.Prefill(1, [1], PARAMS, 0)), "prompt_token_ids": [1, 2**64]}),
     "Prefill.prompt_token_ids[1]: 18446744073709551616 is out of range"),
    (envelope("Prefill", {**good(protocol.Prefill(1, [1], PARAMS, 0)),
                          "params": {**good(protocol.Prefill(1, [1], PARAMS, 0))["params"], "temperature": -1.5}}),
     "temperature must be"),
    (envelope("Prefilled", {"transfer": {**good(TRANSFER), "generator_state": "%%%"}}), "generator_state"),
    (envelope("Done", {"request_id": 1, "output": {"__class__": "os.system"}}), "unknown field '__class__'"),
    (b"[" * 100_000 + b"]" * 100_000, "not the split's JSON protocol"),
])
def test_malformed_unknown_and_pickled_messages_are_refused(payload, fragment):
    with pytest.raises(NanoError, match=None) as refused:
        decode(payload)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_a_pickle_is_never_loaded(tmp_path):
    with pytest.raises(NanoError, match="not the split's JSON protocol"):
        decode(pickle.dumps(Payload(tmp_path / "pwned")))
    assert not (tmp_path / "pwned").exists()


def channel_pair(key: bytes = b"session-key") -> tuple[protocol.Channel, protocol.Channel]:
    """Both ends of a control connection, after the handshake: (front, worker)."""
    a, b = socket.socketpair()
    ends: dict[str, protocol.Channel] = {}
    worker = threading.Thread(target=lambda: ends.update(worker=protocol.open_channel(Connection(b.detach()), key,
                                                                                       "worker")))
    worker.start()
    front = protocol.open_channel(Connection(a.detach()), key, "front")
    worker.join(timeout=10)
    return front, ends["worker"]


def frame(channel: protocol.Channel, message, counter: int, key: bytes | None = None) -> bytes:
    """What `channel.send` would put on the wire as message number `counter` (under `key`, if given)."""
    payload = encode(message)
    forger = protocol.Channel(channel.conn, key or channel.key, "worker" if channel.out_label[0:1] == b"w" else
                              "front")
    return forger.mac(channel.out_label, counter, payload) + counter.to_bytes(8, "big") + payload


def refused(channel: protocol.Channel, fragment: str) -> None:
    with pytest.raises(NanoError) as error:
        channel.recv()
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_every_message_carries_a_mac_and_a_counter():
    front, worker = channel_pair()
    worker.send(protocol.Token(1, 2))
    front.send(protocol.Abort(1))
    assert front.recv() == protocol.Token(1, 2) and worker.recv() == protocol.Abort(1)
    first = frame(worker, protocol.Token(1, 2), 0)
    worker.conn.send_bytes(first)                                              # replayed: counter 0 again
    refused(front, "counter 0, expected 1")
    front, worker = channel_pair()
    tampered = bytearray(frame(worker, protocol.Token(1, 2), 0))
    tampered[-3] ^= 0x01                                                        # one bit of the payload changed
    worker.conn.send_bytes(bytes(tampered))
    refused(front, "MAC does not match")
    front, worker = channel_pair()
    worker.conn.send_bytes(frame(worker, protocol.Token(1, 2), 0, key=b"no-key"))   # injected without the key
    refused(front, "MAC does not match")
    front, worker = channel_pair()
    worker.conn.send_bytes(frame(worker, protocol.Token(1, 2), 1))             # reordered: message 1 first
    refused(front, "counter 1, expected 0")
    front, worker = channel_pair()
    front.conn.send_bytes(frame(front, protocol.Abort(1), 0))                   # the front's own message reflected
    front.conn.send_bytes(frame(front, protocol.Abort(1), 0))
    assert worker.recv() == protocol.Abort(1)
    worker.conn.send_bytes(frame(front, protocol.Abort(1), 0))
    refused(front, "MAC does not match")
    other_front, other_worker = channel_pair()                                  # a message of another connection
    front, worker = channel_pair()
    worker.conn.send_bytes(frame(other_worker, protocol.Token(1, 2), 0))
    refused(front, "MAC does not match")
    worker.conn.send_bytes(encode(protocol.Token(1, 2)))                        # plain JSON: no MAC at all
    refused(front, "MAC")


def test_a_peer_without_the_key_or_too_slow_fails_the_handshake():
    a, b = socket.socketpair()
    thief = threading.Thread(target=lambda: pytest.raises(NanoError, protocol.open_channel, Connection(b.detach()),
                                                          b"guess", "worker"), daemon=True)
    thief.start()
    with pytest.raises(NanoError, match="does not hold the session key"):
        protocol.open_channel(Connection(a.detach()), b"session-key", "front")
    a, b = socket.socketpair()
    start = time.monotonic()
    with pytest.raises(NanoError, match="did not complete the handshake within 1 s"):
        protocol.open_channel(Connection(a.detach()), b"session-key", "front", timeout_s=1.0)
    assert time.monotonic() - start < 5
    b.close()


def test_errors_never_show_torchs_source_paths():
    fabricated = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                              "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:590]\nmore")
    assert brief(fabricated) == "Connection closed by peer"
    assert brief(RuntimeError("wait timed out at /pytorch/torch/csrc/x.cpp:12")) == "wait timed out"
    assert brief(RuntimeError("")) == "RuntimeError"
    gloo = RuntimeError("\n[/pytorch/gloo/x.cc:9] Timed out. This is typically caused by a firewall")
    assert brief(gloo) == "Timed out"
    assert protocol.gloo_prefix(b"a", 1) != protocol.gloo_prefix(b"b", 1) != protocol.gloo_prefix(b"b", 2)
    assert protocol.gloo_prefix(b"secret", 1).split("/")[1] not in ("1", "secret")   # 128 bits from the key
    assert len(protocol.gloo_prefix(b"secret", 1).split("/")[1]) == 32


def test_the_package_imports_point_one_way():
    order = ["front", "supervisor", "worker", "transport", "protocol"]   # each may import only those after it
    allowed_below = {"worker": {"transport", "protocol"}, "transport": {"protocol"}, "protocol": set(),
                     "supervisor": {"worker", "transport", "protocol"},
                     "front": {"supervisor", "worker", "transport", "protocol"}}
    package = Path(protocol.__file__).parent
    for name in order:
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        inside = {module.removeprefix("nano.disagg.") for module in imported if module.startswith("nano.disagg.")}
        inside |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module == "nano.disagg" for alias in node.names}
        assert inside <= allowed_below[name], (name, inside)
    for path in Path(protocol.__file__).parents[1].glob("**/*.py"):   # nothing else in nano/ imports the split
        if package not in path.parents and "cli" not in path.parts:
            assert "nano.disagg" not in path.read_text(), path


# ---- the transfer's bytes -----------------------------------------------------------------------------------------
def write(pool: KVPool, pages: list[int], kv: torch.Tensor, index: torch.Tensor) -> None:
    """Store kv [L, T, C + R] and indexer keys [L_idx, T, Di] as the model does, layer by layer."""
    config, slots = pool.cfg, torch.tensor(pool.slots(pages, 0, kv.shape[1]))
    for layer in range(config.num_hidden_layers):
        pool.write(layer, slots, kv[layer, :, :config.kv_lora_rank], kv[layer, :, config.kv_lora_rank:])
    for i, layer in enumerate(config.indexer_layers):
        pool.write_index(layer, slots, index[i])


KV_FORMATS = ["bf16", "fp32", "fp8:token", "fp8:tensor", "fp8:tile"]   # KV dtype[:FP8 layout]


def pool_of(config, form: str, pages: int = 24) -> KVPool:
    dtype, _, layout = form.partition(":")
    return KVPool(config, dtype, pages, 16, kv_layout=layout or "token")


def true_values(exported: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float values an export stands for, by the formats' definitions (nano/kv.py): codes times their scale
    (per token, or per quarter of the latent with the rope key in BF16 beside it); FP8 tensor codes are the values."""
    kv, index = exported["kv"].float(), exported["index"].float()
    if "rope" in exported:
        latent = kv.unflatten(-1, (4, -1)) * exported["kv_scale"][..., None]             # 4 tiles
        kv = torch.cat([latent.flatten(-2), exported["rope"].float()], -1)
    elif "kv_scale" in exported:
        kv = kv * exported["kv_scale"][..., None]
    if "index_scale" in exported:
        index = index * exported["index_scale"][..., None]
    return kv, index


@pytest.mark.parametrize("source", KV_FORMATS)
@pytest.mark.parametrize("target", KV_FORMATS)
def test_a_transfer_lands_as_if_the_decode_pool_had_written_it(source, target):
    """Same format: the bytes as they were (exact); another dtype or layout: converted to what the decode pool
    would have stored had it written the values itself."""
    config = resolve_config("glm-5.2-random")[1]
    sender, receiver, reference = pool_of(config, source), pool_of(config, target), pool_of(config, target)
    tokens, pages_in, pages_out = 40, [3, 4, 9], [0, 7, 8]
    values = torch.randn(config.num_hidden_layers, tokens, config.kv_values_per_token_layer)
    keys = torch.randn(len(config.indexer_layers), tokens, config.index_head_dim)
    write(sender, pages_in, values, keys)
    receiver.import_tokens(pages_out, sender.export_tokens(pages_in, tokens))
    if source == target:          # the sender's bytes, bit for bit
        for name, sent in sender.export_tokens(pages_in, tokens).items():
            assert torch.equal(receiver.export_tokens(pages_out, tokens)[name].view(torch.uint8),
                               sent.view(torch.uint8)), name
        return
    write(reference, pages_out, *true_values(sender.export_tokens(pages_in, tokens)))
    assert receiver.parts().keys() == reference.parts().keys()
    for name, want in reference.parts().items():
        assert torch.equal(receiver.parts()[name].view(torch.uint8), want.view(torch.uint8)), name


def test_the_checksum_sees_a_flipped_byte_or_moved_words_anywhere():
    data = torch.randint(0, 256, (3 * 32768 + 1000,), dtype=torch.uint8)
    reference = checksum(data)
    assert checksum(data.clone()) == reference
    for at in (0, 5, 32768 + 17, 3 * 32768 + 999):                  # in a block, and in the partial tail
        flipped = data.clone()
        flipped[at] ^= 0x01
        assert checksum(flipped) != reference
    words = data[:3 * 32768].clone().view(torch.int64)
    moved = torch.cat([words[1:2], words[:1], words[2:]]).view(torch.uint8)   # two 8-byte words swapped
    assert checksum(torch.cat([moved, data[3 * 32768:]])) != reference


# ---- one process, two processes ---------------------------------------------------------------------------------
def test_split_equals_one_process_in_two_real_processes(split, single):
    batch = prompts(6)
    outputs = split.generate(batch, GREEDY)
    pids = {split.info[role]["pid"] for role in ("prefill", "decode")}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:
        os.kill(pid, 0)                                   # both are live OS processes
    reference = single.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert all(o.finish_reason == "length" and o.error is None for o in outputs)
    assert all(o.metrics["ttft_s"] > 0 and o.metrics["tpot_s"] > 0 for o in outputs)


def test_seeded_sampling_continues_across_the_split(split, single):
    batch = prompts(3, seed=13)
    outputs = split.generate(batch, SEEDED)
    reference = single.generate(batch, SEEDED)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert len({tuple(o.token_ids) for o in outputs}) == 3 and not all(o.token_ids == outputs[0].token_ids[:1] * 8
                                                                        for o in outputs)


def test_prompt_plus_output_is_capped_at_the_context(split):
    context = split.max_context
    assert context == CONTEXT
    prompt = prompts(1, seed=14, low=context - 5, high=context - 5)[0]
    output = split.generate([prompt], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert output.finish_reason == "length" and len(prompt) + len(output.token_ids) == context, output.error


@pytest.fixture(scope="module")
def small_split(model):
    """SplitLLM's default formats (BF16 weights and KV in prefill, INT4 and FP8 in decode) and LLM's default dtype, in
    small pools: 2 staging slots of 16 KiB (48 tokens of BF16 KV), and a KV budget of 192 tokens of BF16 KV each: 12
    pages in the prefill worker, more in the decode worker's FP8. The prefix cache is on (the default)."""
    bf16 = resolve_config(model)[1].kv_bytes_per_token("bf16")
    with SplitLLM(model, staging_slots=2, slot_bytes=16 * 2**10, kv_budget=192 * bf16, timeout_s=60,
                  page_size=16) as front:
        yield front


def test_only_the_prompts_tokens_move_in_the_prefill_kv_dtype(small_split):
    front, batch = small_split, prompts(3, seed=1, low=20, high=45)
    assert front.info["prefill"]["kv_dtype"] == "bf16" and front.info["decode"]["kv_dtype"] == "fp8"
    transfers, moved = front.stats.transfers, front.stats.bytes
    outputs = front.generate(batch, GREEDY)
    assert all(o.finish_reason == "length" for o in outputs)
    assert front.stats.transfers - transfers == 3
    per_token = front.config.kv_bytes_per_token("bf16")
    assert front.stats.bytes - moved == per_token * sum(map(len, batch))   # not whole pages: only the prompt tokens
    assert sorted(front.free_slots) == list(range(front.slots))
    # the prefill worker keeps a prefix cache: the same prompts again take every whole page but the last token's
    front.counters(reset=True)
    assert [o.token_ids for o in front.generate(batch, GREEDY)] == [o.token_ids for o in outputs]
    page = FORMATS["page_size"]
    assert front.counters()["prefill"]["cached_tokens"] == sum(page * ((len(p) - 1) // page) for p in batch)
    assert front.stats.bytes - moved == 2 * per_token * sum(map(len, batch))   # the whole prompt moves either way


def test_fp8_prefill_and_int4_decode_workers_each_hold_only_their_own_format(split, single, model):
    """The report's GLM-5.2 policy across processes: the prefill worker holds FP8 weights and no INT4, the decode
    worker INT4 experts and no FP8 (each reports its resident bytes at start-up); test_split_equals_one_process...
    shows that together they decode what one process holding both formats decodes."""
    fp8_only = LLM(model, weights="fp8", kv_dtype="fp8", progress=False,
                   **{k: v for k, v in FORMATS.items() if not k.endswith("weights")})
    prefill, decode = split.info["prefill"]["weight_bytes"], split.info["decode"]["weight_bytes"]
    assert "int4" not in prefill and prefill["fp8"] == fp8_only.weight_bytes()["fp8"]
    assert "fp8" not in decode and decode["int4"] == single.weight_bytes()["int4"]


def test_a_corrupted_transfer_aborts_only_its_request(split):
    batch = prompts(4, seed=2)
    golden = [o.token_ids for o in split.generate(batch, GREEDY)]
    with corrupt_next_transfer(split) as hit:
        requests = [split.submit(p, GREEDY) for p in batch]
        assert settle(split, requests) < 30
    aborted = [i for i, r in enumerate(requests) if r.output.finish_reason == "abort"]
    assert len(aborted) == 1 and hit == [requests[aborted[0]].front_id]
    assert "checksum mismatch" in requests[aborted[0]].output.error
    assert all(r.output.token_ids == golden[i] for i, r in enumerate(requests) if i not in aborted)
    assert sorted(split.free_slots) == list(range(split.slots))   # its slot came back


class ScriptedFront:
    """The front's end of a worker's control channel, in this process: it hands the worker `messages`, then `Stop`
    once the worker has nothing left to do, and keeps what the worker sends."""

    def __init__(self, messages: list) -> None:
        self.inbox, self.sent = deque(messages), []

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self.inbox) or timeout is None

    def recv(self):
        return self.inbox.popleft() if self.inbox else protocol.Stop()

    def send(self, message) -> None:
        self.sent.append(message)


def test_a_request_failing_inside_a_worker_ends_alone_and_the_worker_lives_on(single, monkeypatch):
    """A request whose export (prefill) or import (decode) raises ends with `Failed`, its slot given back; the
    worker serves the others and returns only at `Stop`. Both workers run here, in turn, on the `single` LLM."""
    batch = prompts(3, seed=17)
    staging = Staging(3, 2**20)
    export, add = single.engine.export_kv, single.engine.add_prefilled

    def export_but_the_first(r, out=None):
        if r.prompt_token_ids == batch[0]:
            raise RuntimeError("export broke")
        return export(r, out)

    def add_but_the_second(prompt_ids, *args, **kwargs):
        return 1 / 0 if prompt_ids == batch[1] else add(prompt_ids, *args, **kwargs)
    monkeypatch.setattr(single.engine, "export_kv", export_but_the_first)
    prefill = ScriptedFront([protocol.Prefill(i, prompt, GREEDY, i) for i, prompt in enumerate(batch)])
    Worker("prefill", prefill, single, staging).serve()
    assert protocol.Failed(0, "RuntimeError: export broke", 0) in prefill.sent
    transfers = sorted((m.transfer for m in prefill.sent if isinstance(m, protocol.Prefilled)),
                       key=lambda transfer: transfer.request_id)
    assert [t.request_id for t in transfers] == [1, 2] and len(prefill.sent) == 3
    monkeypatch.setattr(single.engine, "add_prefilled", add_but_the_second)
    decode = ScriptedFront([protocol.Decode(t, GREEDY, len(t.prompt_token_ids) + 8) for t in transfers])
    Worker("decode", decode, single, staging).serve()
    assert protocol.Failed(1, "ZeroDivisionError: division by zero", None) in decode.sent
    assert sorted(m.slot for m in decode.sent if isinstance(m, protocol.SlotFree)) == [1, 2]
    done = [m for m in decode.sent if isinstance(m, protocol.Done)]
    assert len(done) == 1 and done[0].request_id == 2
    assert done[0].output.token_ids == single.generate(batch[2:], GREEDY)[0].token_ids   # one process's tokens
    staging.close()


def test_a_killed_prefill_worker_ends_its_requests_and_a_replacement_serves(split):
    batch = prompts(8, seed=4, low=70, high=90)     # more prompt tokens than one step takes: prefill is in flight
    golden = [o.token_ids for o in split.generate(batch, GREEDY)]
    old_pid = split.info["prefill"]["pid"]
    requests = [split.submit(p, GREEDY) for p in batch]
    while not any(r.stage == "decode" for r in requests) and not all(r.output for r in requests):
        split.poll()
    split.kill("prefill")
    assert split.health() == f"the prefill worker (pid {old_pid}) died with exit code -9"   # before the front polls
    assert settle(split, requests) < 30
    assert split.health() == f"the prefill worker (pid {old_pid}) died with exit code -9"
    failed = [r for r in requests if r.output.finish_reason == "abort"]
    done = [i for i, r in enumerate(requests) if r.output.finish_reason == "length"]
    assert failed and done
    assert all(f"prefill worker (pid {old_pid}) died" in r.output.error for r in failed)
    assert all(requests[i].output.token_ids == golden[i] for i in done)     # never another request's text
    late = split.generate(batch[:1], GREEDY)[0]                              # no prefill worker: an error, no hang
    assert late.finish_reason == "abort" and "no prefill worker" in late.error
    split.restart("prefill")
    assert split.info["prefill"]["pid"] != old_pid and split.health() is None
    assert [o.token_ids for o in split.generate(batch[:2], GREEDY)] == golden[:2]


def test_a_killed_decode_worker_ends_its_requests_and_a_replacement_serves(split):
    batch = prompts(3, seed=5)
    golden = [o.token_ids for o in split.generate(batch, GREEDY)]
    requests = [split.submit(p, GREEDY) for p in batch]
    while not any(r.stage == "decode" for r in requests) and not all(r.output for r in requests):
        split.poll()
    split.kill("decode")
    assert settle(split, requests) < 30
    assert any(r.output.finish_reason == "abort" for r in requests)
    for r, want in zip(requests, golden):   # each either completed as golden, or ended naming the decode worker
        if r.output.finish_reason == "abort":   # with a prefix of its own tokens, never another request's
            assert "decode worker" in r.output.error and r.output.token_ids == want[:len(r.output.token_ids)]
        else:
            assert r.output.token_ids == want
    split.restart("decode")
    assert [o.token_ids for o in split.generate(batch, GREEDY)] == golden
    assert sorted(split.free_slots) == list(range(split.slots))


def test_failed_prefills_give_their_slots_back_and_what_no_pool_holds_is_refused(small_split, model):
    # a 60-token prompt's BF16 KV does not fit a 16 KiB slot: every such request fails clearly, none keeps a slot,
    # and short prompts are served afterwards. A request longer than the smaller pool is refused up front.
    front = small_split
    pools = {role: figures["kv_tokens"] for role, figures in front.counters().items()}
    assert pools["prefill"] < pools["decode"] and front.max_request_tokens == pools["prefill"] == 192
    prompt = prompts(1, seed=18, low=16, high=16)[0]
    with pytest.raises(NanoError, match=r"prompt \(16 tokens\) \+ max_tokens \(177\) is more than .* \(192 tokens\)"):
        front.submit(prompt, SamplingParams(max_tokens=177, temperature=0.0, ignore_eos=True))
    assert not front.requests and not front.queue
    fits = front.generate([prompt], SamplingParams(max_tokens=176, temperature=0.0, ignore_eos=True))[0]
    assert fits.finish_reason == "length" and len(fits.token_ids) == 176, fits.error
    default = str(LLM(model, progress=False).dtype).removeprefix("torch.")   # no dtype given: LLM's default
    assert front.info["prefill"]["dtype"] == front.info["decode"]["dtype"] == default
    start = time.perf_counter()
    failed = front.generate(prompts(5, seed=11, low=60, high=80), GREEDY)
    assert all(o.finish_reason == "abort" and "staging slot" in o.error for o in failed)
    assert sorted(front.free_slots) == [0, 1] and not front.held
    assert all(o.finish_reason == "length" for o in front.generate(prompts(3, seed=12, low=5, high=15), GREEDY))
    assert time.perf_counter() - start < 60


def test_a_bad_worker_option_is_one_clear_error(model):
    with pytest.raises(NanoError, match="kv_dtype must be one of"):
        SplitLLM(model, decode_kv_dtype="fp4", timeout_s=60)


def test_a_stream_closed_early_stops_the_request_in_the_workers(split):
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    stream = split.stream(prompts(1, seed=6)[0], long)
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert len(first) == 3 and first[-1].finish_reason is None and not split.requests
    start = time.perf_counter()    # the decode worker is free again (the reply could run to the end of the context)
    assert split.generate(prompts(1, seed=7), GREEDY)[0].finish_reason == "length"
    assert time.perf_counter() - start < 20
    decode = split.counters()["decode"]                # and holds no pages: the closed request's are free
    assert decode["free_pages"] == decode["num_pages"]


def test_cli_fault_corrupt_transfer(split, model, monkeypatch):
    """`nano fault MODEL --corrupt-transfer`, on `split` in place of the split the command would start (its start,
    the same line of the command for either fault, runs in test_cli_fault_kill_prefill)."""
    monkeypatch.setattr("nano.disagg.SplitLLM", lambda *args, **kwargs: nullcontext(split))
    result = nano("fault", model, "--corrupt-transfer", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["aborted"]) == 1 and report["silent_wrong"] == [] and len(report["completed_identical"]) == 3
    assert "checksum mismatch" in next(iter(report["aborted"].values()))
    assert sorted(split.free_slots) == list(range(split.slots))


# The last test on `split`: it leaves it without a prefill worker (the tests above replace a lost worker and check
# that the replacement serves).
def test_a_protocol_version_mismatch_ends_requests_with_a_clear_error(split, monkeypatch):
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)   # this front speaks a newer version
    output = split.generate(prompts(1, seed=3), GREEDY)[0]
    monkeypatch.undo()
    assert output.finish_reason == "abort" and "protocol version" in output.error and "\n" not in output.error
    assert not split.alive("prefill") and split.health() == output.error   # the worker refused it and stopped


# ---- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_fault_kill_prefill(model):
    """`nano fault MODEL --kill-prefill`: it starts its own split, and restarts the worker it killed."""
    result = nano("fault", model, "--kill-prefill", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["aborted"] and report["silent_wrong"] == [] and report["after_restart"] == "length"
    assert report["pids"]["prefill_after_restart"] != report["pids"]["prefill"]
    assert report["seconds_to_settle"] < 30


def test_cli_chat_disagg_refuses_what_the_split_cannot_do(model):
    """Before any worker starts. The split answers through `nano chat --disagg` in tests/test_no_triton.py (without
    triton, against one process); --transport gloo only chooses SplitLLM's transport, which the tests below run."""
    assert_user_error(nano("chat", model, "--disagg", "--decode-kv-dtype", "fp4", "-p", "x"), "--decode-kv-dtype",
                      exit_code=2)
    assert_user_error(nano("chat", model, "--disagg", "--transport", "rdma", "-p", "x"), "--transport",
                      exit_code=2)


# ---- across hosts: gloo data path, a worker that connects by itself ---------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_worker(role: str, port: int, key: str) -> subprocess.Popen:
    """What an operator runs on the other host: python -m nano.disagg ROLE HOST:PORT."""
    return subprocess.Popen([sys.executable, "-m", "nano.disagg", role, f"127.0.0.1:{port}"],
                            env={**os.environ, "NANO_DISAGG_KEY": key}, stderr=subprocess.PIPE, text=True)


def join_decode_worker(remote: SplitLLM) -> None:
    """Unless a decode worker is connected, have a real one join (`python -m nano.disagg decode`), and wait for it."""
    if not remote.alive("decode"):
        remote.test_worker = start_worker("decode", remote.test_port, remote.test_key)
        remote.restart("decode")


def pickling_client(port: int, key: str, marker: Path) -> None:
    """Hold the key, then send a pickle where the Hello belongs: the front must drop it without loading it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn = Connection(socket.create_connection(("127.0.0.1", port)).detach())
        except ConnectionRefusedError:
            time.sleep(0.2)
            continue
        try:
            answer_challenge(conn, key.encode())
            deliver_challenge(conn, key.encode())
            conn.send(Payload(marker))
            conn.recv_bytes()   # the front closes the connection
        except (OSError, EOFError):
            pass
        return


def silent_client(port: int) -> None:
    """Connect to the front's control port and say nothing: the handshake's timeout drops it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port)):
                time.sleep(15)
            return
        except ConnectionRefusedError:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def remote(monkeypatch_module, tmp_path_factory, model):
    port, key = free_port(), "test-secret"
    monkeypatch_module.setenv("NANO_DISAGG_KEY", key)
    intruder = start_worker("decode", port, "wrong-secret")      # a worker with the wrong key is turned away
    silent = threading.Thread(target=silent_client, args=(port,), daemon=True)   # and one that says nothing
    silent.start()
    marker = tmp_path_factory.mktemp("pickle") / "loaded"           # and one with the key that sends a pickle
    pickler = threading.Thread(target=pickling_client, args=(port, key, marker), daemon=True)
    pickler.start()
    workers: list[subprocess.Popen] = []

    def real_worker_once_the_intruder_is_gone() -> None:   # the front, waiting for a decode worker, takes every
        intruder.wait(timeout=90)                          # connection until one joins: none is left to a timeout
        workers.append(start_worker("decode", port, key))
    threading.Thread(target=real_worker_once_the_intruder_is_gone, daemon=True).start()
    with SplitLLM(model, prefill_kv_dtype="fp8", decode_kv_dtype="fp8", timeout_s=60, transport="gloo",
                  listen=("127.0.0.1", port), spawn=("prefill",), **FORMATS) as front:
        front.test_port, front.test_key, front.test_worker = port, key, workers[0]
        error = intruder.stderr.read()
        assert intruder.returncode != 0 and "cannot join the front" in error and "session key" in error, error
        pickler.join(timeout=30)
        assert not marker.exists()
        yield front
    front.test_worker.wait(timeout=30)      # the last decode worker to join: the front told it to stop


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_gloo_with_a_worker_that_joined_by_itself_equals_one_process(remote, single):
    join_decode_worker(remote)
    batch = prompts(4, seed=8)
    assert remote.info["decode"]["pid"] == remote.test_worker.pid
    outputs = remote.generate(batch, GREEDY)
    reference = single.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert remote.stats.bytes == remote.config.kv_bytes_per_token("fp8") * sum(map(len, batch))
    with corrupt_next_transfer(remote):                           # corrupted in transit: only that request ends
        again = remote.generate(batch, GREEDY)
    aborted = [o for o in again if o.finish_reason == "abort"]
    assert len(aborted) == 1 and "checksum mismatch" in aborted[0].error
    assert all(o.token_ids == r.token_ids for o, r in zip(again, reference) if o.finish_reason != "abort")


def test_gloo_an_ended_requests_bytes_are_drained(remote):
    join_decode_worker(remote)
    batch = prompts(4, seed=10, low=60, high=90)
    golden = [o.token_ids for o in remote.generate(batch, GREEDY)]
    requests = [remote.submit(p, GREEDY) for p in batch]
    remote.poll(0.0)                                              # all four are sent to the prefill worker
    for request in requests[:2]:                                  # given up on while their prefill runs
        remote.abort(request, "the client went away")
    assert settle(remote, requests) < 30
    assert [r.output.token_ids for r in requests[2:]] == golden[2:]
    deadline = time.monotonic() + 30                              # the two sends were received and dropped
    while sorted(remote.free_slots) != list(range(remote.slots)):
        remote.poll(0.05)
        assert time.monotonic() < deadline, remote.held
    assert remote.generate(batch[:1], GREEDY)[0].token_ids == golden[0]


def test_gloo_a_decode_host_that_goes_away_ends_the_requests_it_held(remote):
    """The remote decode host goes away while requests decode on it: they end with errors that say so, and so does
    health() (those still in prefill end with their own failure to send). The front is left without a decode worker
    until test_idle_and_forged_connections... has one join (the workers regroup there, and in
    test_gloo_a_stopped_or_killed_prefill_worker... after the other is replaced)."""
    join_decode_worker(remote)
    # long replies, so that the decode worker is still at them when it dies
    requests = [remote.submit(p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
                for p in prompts(3, seed=9)]
    while not any(r.stage == "decode" for r in requests) and not all(r.output for r in requests):
        remote.poll()
    decoding = [r for r in requests if r.stage == "decode"]
    remote.test_worker.kill()                                     # the remote decode host goes away
    assert settle(remote, requests) < 30
    gone = f"the decode worker (pid {remote.test_worker.pid}) on {remote.info['decode']['host']} disconnected"
    assert remote.health() == gone and all(r.output.finish_reason == "abort" for r in requests)
    assert {r.output.error for r in decoding} == {gone}           # however the front noticed it (a read, a send)
    assert sorted(remote.free_slots) == list(range(remote.slots))


def forging_worker(port: int, key: str, token: int) -> None:
    """The report's ctl_attack `forged_token_ids`: a decode worker that holds the key and joins as a real one does
    (its handshake, Ready, the gloo group), then answers its first request with a forged token id and hangs up."""
    channel = protocol.open_channel(Connection(socket.create_connection(("127.0.0.1", port)).detach()),
                                    key.encode(), "worker")
    channel.send(protocol.Hello("decode"))
    setup = channel.recv()
    channel.send(protocol.Ready(os.getpid(), "forger", "forger", "float32", "fp8", "int4", {}, 10**6))
    path = GlooPath(1, setup.store_host, setup.store_port, setup.timeout_s, key.encode())
    path.connect(channel.recv().generation)                       # Regroup: the prefill worker joins this group
    request_id = channel.recv().transfer.request_id               # Decode
    channel.send(protocol.Token(request_id, token))
    channel.close()
    path.close()


def test_a_forged_token_id_drops_the_worker_and_the_front_lives_on(remote, single):
    """N6: a token id out of [0, 2**64) is refused by the protocol, one out of the vocabulary by the front (before,
    10**30 and -1 crashed the front in tokenizer.decode); either way that worker is dropped with one line and its
    request ends with it, keeping only its real tokens; health() says why. The front is left without a decode
    worker: the next test has a real one join while strangers try to delay it."""
    prompt = prompts(1, seed=15)[0]
    golden = single.generate([prompt], GREEDY)[0].token_ids                     # what the split answers
    remote.test_worker.kill()                                     # no real decode worker (if one is left)
    vocab = remote.config.vocab_size
    for token, why in ((10**30, "Token.token: 100000000000000000000000 is out of range [0, 2**64)"),
                       (-1, "Token.token: -1 is out of range [0, 2**64)"),
                       (vocab, f"token id {vocab} is outside the vocabulary [0, {vocab})")):
        forger = threading.Thread(target=forging_worker, args=(remote.test_port, remote.test_key, token), daemon=True)
        forger.start()
        remote.restart("decode")
        request = remote.submit(prompt, GREEDY)
        settle(remote, [request])
        forger.join(timeout=30)
        assert request.output.finish_reason == "abort" and request.output.token_ids == golden[:1]
        assert request.output.error == remote.health() == f"the decode worker sent a message the front refuses: {why}"


def forging_client(port: int, key: str, how: str, closed: list) -> None:
    """Hold the key and pass the handshake, then send a Hello the front must refuse: one changed in transit, or
    one whose MAC was made without the connection's key (injected on the path). Records whether the front hung up."""
    conn = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    try:
        channel = protocol.open_channel(conn, key.encode(), "worker")
        data = bytearray(frame(channel, protocol.Hello("decode"), 0, key=b"not-the-key" if how == "nokey" else None))
        if how == "tampered":
            data[-4] ^= 0x01
        conn.send_bytes(bytes(data))
        conn.recv_bytes()
    except (OSError, EOFError, NanoError):
        closed.append(how)


def test_idle_and_forged_connections_cannot_delay_or_replace_a_worker(remote, single):
    """While strangers hold connections open or send forged Hellos, a real decode worker joins within the bound,
    regroups with the prefill worker that stayed up, and serves what one process answers."""
    assert listening_addresses(remote.store.port) == {"0100007F"}       # the TCPStore: 127.0.0.1 only
    planted = torch.distributed.TCPStore("127.0.0.1", remote.store.port, is_master=False)   # keys a stranger plants
    for generation in range(remote.generation, remote.generation + 4):
        planted.set(f"nano-disagg/{generation}/0", "poison")
        planted.set(f"nano-disagg/{generation}/rank_0", "10.9.9.9:1")
    remote.test_worker.kill()                             # no decode worker (nothing to kill if none is left)
    settle(remote, [remote.submit(prompts(1)[0], GREEDY)])
    idle = [socket.create_connection(("127.0.0.1", remote.test_port)) for _ in range(8)]   # say nothing at all
    closed: list[str] = []
    forgers = [threading.Thread(target=forging_client, args=(remote.test_port, remote.test_key, how, closed),
                                daemon=True) for how in ("tampered", "nokey")]
    for forger in forgers:
        forger.start()
    start = time.monotonic()
    remote.test_worker = start_worker("decode", remote.test_port, remote.test_key)
    remote.restart("decode")
    took = time.monotonic() - start
    assert took < 40, f"restart took {took:.0f} s"    # one at a time, 8 idle clients alone held it 8 x 10 s
    assert remote.info["decode"]["pid"] == remote.test_worker.pid
    for forger in forgers:
        forger.join(timeout=15)
    assert sorted(closed) == ["nokey", "tampered"]
    for sock in idle:                                                   # dropped after the short deadline
        sock.settimeout(protocol.HANDSHAKE_S + 10)
        while sock.recv(4096):
            pass
        sock.close()
    assert remote.health() is None
    assert [o.token_ids for o in remote.generate(prompts(2, seed=11), GREEDY)] == [
        o.token_ids for o in single.generate(prompts(2, seed=11), GREEDY)]


def test_gloo_a_stopped_or_killed_prefill_worker_never_ends_a_request_already_decoding(remote, monkeypatch):
    """L3: the prefill worker stops (SIGSTOP) right after announcing request b's KV, before gloo moved a byte of
    it, while request a decodes. a finishes as in a run without the fault (before, the decode worker's blocking
    receive of b's bytes held a up to the data path's timeout, when the front's timeout ended a too). Then the
    stopped worker is killed: b alone ends, with its own receive's failure."""
    join_decode_worker(remote)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = prompts(2, seed=16)
    golden = [o.token_ids for o in remote.generate(batch, long)]
    prefill, forward = remote.processes["prefill"], remote._forward
    a = remote.submit(batch[0], long)
    while len(a.output_token_ids) < 3:                            # a is decoding on the decode worker
        remote.poll(0.05)
    b = remote.submit(batch[1], long)

    def stop_the_sender_first(request, transfer):
        if request is b:
            os.kill(prefill.pid, signal.SIGSTOP)
        forward(request, transfer)
    monkeypatch.setattr(remote, "_forward", stop_the_sender_first)
    start = time.monotonic()
    while not a.output:                      # bounded below the data path's 60 s timeout, which freed a before
        remote.poll(0.05)
        assert time.monotonic() - start < 45, "the decoding request stalled behind the stopped prefill worker"
    assert a.output.finish_reason == "length" and a.output.token_ids == golden[0]
    assert b.stage == "decode" and not b.output                   # its bytes cannot move: the sender is stopped
    remote.kill("prefill")
    assert settle(remote, [b]) < 30
    assert b.output.finish_reason == "abort" and f"receiving request {b.front_id}'s KV" in b.output.error
    assert b.output.token_ids == golden[1][:1]
    monkeypatch.undo()
    remote.restart("prefill")
    assert [o.token_ids for o in remote.generate(batch, long)] == golden


FRONT_SCRIPT = """
import os, sys, time
from nano.disagg import SplitLLM
front = SplitLLM(sys.argv[1], dtype="float32", page_size=16, kv_budget="4MiB", timeout_s=60)
print(" ".join(str(p.pid) for p in front.processes.values()), flush=True)
time.sleep(600)
"""


def test_a_front_killed_with_its_process_group_leaves_no_shared_memory(model):
    before = set(os.listdir("/dev/shm"))
    front = subprocess.Popen([sys.executable, "-c", FRONT_SCRIPT, model], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        workers = [int(pid) for pid in front.stdout.readline().split()]
        assert len(workers) == 2
        fds = [os.readlink(f"/proc/{front.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{front.pid}/fd")]
        assert any(link.startswith("/memfd:nano-disagg-staging") for link in fds)   # anonymous: no name to leak
        assert set(os.listdir("/dev/shm")) <= before
    finally:
        os.killpg(front.pid, signal.SIGKILL)                            # timeout, OOM killer, container stop
        front.wait(timeout=30)
    deadline = time.monotonic() + 30                                    # the workers see the front gone and exit
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
              for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived its front"
        time.sleep(0.05)
    assert set(os.listdir("/dev/shm")) <= before


def test_bad_split_setups_are_clear_errors(monkeypatch, model):
    with pytest.raises(NanoError, match="transport must be one of"):
        SplitLLM(model, transport="rdma")
    with pytest.raises(NanoError, match="needs transport 'gloo'"):
        SplitLLM(model, spawn=("prefill",))
    monkeypatch.delenv("NANO_DISAGG_KEY", raising=False)
    with pytest.raises(NanoError, match="NANO_DISAGG_KEY"):
        SplitLLM(model, transport="gloo", spawn=("prefill",))
    monkeypatch.setenv("NANO_DISAGG_KEY", "k")
    # nobody joins: a bounded wait. Under load the spawned prefill worker may not be up within the 1 s either, and
    # the error then names both: the test must not depend on the machine being idle. The worker still starting is
    # killed, not waited for.
    start = time.monotonic()
    with pytest.raises(NanoError, match="no decode (or prefill )?worker connected"):
        SplitLLM(model, transport="gloo", spawn=("prefill",), timeout_s=1, **FORMATS)
    assert time.monotonic() - start < 5
    # `python -m nano.disagg decode nowhere`, run here: the module's one line on stderr, exit status 1 (sys.exit)
    monkeypatch.setattr(sys, "argv", ["nano.disagg", "decode", "nowhere"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("nano.disagg", run_name="__main__")
    assert str(exited.value.code).startswith("error: usage:") and "\n" not in exited.value.code
