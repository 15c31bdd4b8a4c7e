"""Prefill and decode in two OS processes: the split's greedy output equals one process's, a corrupted transfer
aborts only its request, a dead worker ends its requests with errors (never a hang) and can be replaced.

Every test that waits on the workers is bounded: the front's `timeout_s` ends stuck requests, and each test
asserts how long settling took."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from nano import LLM, SamplingParams
from nano.disagg import PROTOCOL_VERSION, SplitLLM
from nano.errors import NanoError
from fixtures import assert_user_error, nano

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FORMATS = dict(prefill_weights="bf16", decode_weights="int4", dtype="float32", page_size=16)


@pytest.fixture(scope="module")
def split():
    with SplitLLM("glm-5.2", prefill_kv_dtype="fp8", decode_kv_dtype="fp8", timeout_s=60, **FORMATS) as front:
        yield front


def prompts(count: int, seed: int = 0, low: int = 20, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def settle(split: SplitLLM, requests, limit_s: float = 60.0) -> float:
    start = time.perf_counter()
    while not all(r.output for r in requests):
        split.poll()
        assert time.perf_counter() - start < limit_s, "the split did not settle"
    return time.perf_counter() - start


def test_split_equals_one_process_in_two_real_processes(split):
    batch = prompts(6)
    outputs = split.generate(batch, GREEDY)
    pids = {split.info[role]["pid"] for role in ("prefill", "decode")}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:
        os.kill(pid, 0)                                   # both are live OS processes
    single = LLM("glm-5.2", kv_dtype="fp8", progress=False, **FORMATS)
    # every prompt prefills in the first step, so the single process decodes with its decode weights too
    reference = single.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert all(o.finish_reason == "length" and o.error is None for o in outputs)
    assert all(o.metrics["ttft_s"] > 0 and o.metrics["tpot_s"] > 0 for o in outputs)


def test_only_the_prompts_tokens_move_in_the_prefill_kv_dtype():
    batch = prompts(3, seed=1)
    with SplitLLM("glm-5.2", timeout_s=60, **{**FORMATS, "dtype": "bfloat16"}) as front:   # bf16 KV -> fp8 KV
        assert front.info["prefill"]["kv_dtype"] == "bf16" and front.info["decode"]["kv_dtype"] == "fp8"
        outputs = front.generate(batch, GREEDY)
        assert all(o.finish_reason == "length" for o in outputs)
        assert front.stats.transfers == 3
        per_token = front.config.kv_bytes_per_token("bf16")
        assert front.stats.bytes == per_token * sum(map(len, batch))   # not whole pages: only the prompt tokens
        assert sorted(front.free_slots) == list(range(front.slots))


def test_a_corrupted_transfer_aborts_only_its_request(split):
    batch = prompts(4, seed=2)
    golden = [o.token_ids for o in split.generate(batch, GREEDY)]
    split.corrupt_next_transfer = True
    requests = [split.submit(p, GREEDY) for p in batch]
    assert settle(split, requests) < 30
    aborted = [i for i, r in enumerate(requests) if r.output.finish_reason == "abort"]
    assert len(aborted) == 1 and "checksum mismatch" in requests[aborted[0]].output.error
    assert all(r.output.token_ids == golden[i] for i, r in enumerate(requests) if i not in aborted)
    assert sorted(split.free_slots) == list(range(split.slots))   # its slot came back


def test_a_protocol_version_mismatch_aborts_the_request(split):
    send = split._to

    def old_protocol(role, request, message):
        if message[0] == "decode":
            message[1].version = PROTOCOL_VERSION + 1
        send(role, request, message)
    split._to = old_protocol
    try:
        output = split.generate(prompts(1, seed=3), GREEDY)[0]
    finally:
        split._to = send
    assert output.finish_reason == "abort" and "protocol version" in output.error


def test_a_killed_prefill_worker_ends_its_requests_and_a_replacement_serves(split):
    batch = prompts(6, seed=4, low=60, high=90)
    golden = [o.token_ids for o in split.generate(batch, GREEDY)]
    old_pid = split.info["prefill"]["pid"]
    requests = [split.submit(p, GREEDY) for p in batch]
    while not any(r.stage == "decode" for r in requests):
        split.poll()
    split.kill("prefill")
    assert settle(split, requests) < 30
    failed = [r for r in requests if r.output.finish_reason == "abort"]
    done = [i for i, r in enumerate(requests) if r.output.finish_reason == "length"]
    assert failed and done
    assert all(f"prefill worker (pid {old_pid}) died" in r.output.error for r in failed)
    assert all(requests[i].output.token_ids == golden[i] for i in done)     # never another request's text
    late = split.generate(batch[:1], GREEDY)[0]                              # no prefill worker: an error, no hang
    assert late.finish_reason == "abort" and "no prefill worker" in late.error
    split.restart("prefill")
    assert split.info["prefill"]["pid"] != old_pid
    assert [o.token_ids for o in split.generate(batch[:2], GREEDY)] == golden[:2]


def test_a_killed_decode_worker_ends_its_requests_and_a_replacement_serves(split):
    batch = prompts(3, seed=5)
    golden = [o.token_ids for o in split.generate(batch, GREEDY)]
    requests = [split.submit(p, GREEDY) for p in batch]
    while not any(r.stage == "decode" for r in requests):
        split.poll()
    split.kill("decode")
    assert settle(split, requests) < 30
    assert any(r.output.finish_reason == "abort" for r in requests)
    assert all(r.output.finish_reason == "abort" and "decode worker" in r.output.error
               for r in requests if r.output.token_ids != golden[requests.index(r)])
    split.restart("decode")
    assert [o.token_ids for o in split.generate(batch, GREEDY)] == golden
    assert sorted(split.free_slots) == list(range(split.slots))


def test_failed_prefills_give_their_slots_back():
    # 2 slots of 64 KiB: a 60-token prompt's FP8 KV does not fit one; every such request fails clearly, none
    # keeps a slot, and short prompts are served afterwards
    with SplitLLM("glm-5.2", prefill_kv_dtype="fp8", staging_slots=2, slot_bytes=64 * 2**10, timeout_s=60,
                  **FORMATS) as front:
        start = time.perf_counter()
        failed = front.generate(prompts(5, seed=11, low=60, high=80), GREEDY)
        assert all(o.finish_reason == "abort" and "staging slot" in o.error for o in failed)
        assert sorted(front.free_slots) == [0, 1] and not front.orphan_slots
        assert all(o.finish_reason == "length" for o in front.generate(prompts(3, seed=12, low=5, high=15), GREEDY))
        assert time.perf_counter() - start < 60


def test_a_bad_worker_option_is_one_clear_error():
    with pytest.raises(Exception, match="kv_dtype must be one of"):
        SplitLLM("glm-5.2", decode_kv_dtype="fp4", timeout_s=60)


# ---- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_fault_corrupt_transfer_and_kill_prefill():
    result = nano("fault", "glm-5.2", "--corrupt-transfer", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["aborted"]) and len(report["aborted"]) == 1 and report["silent_wrong"] == []
    assert "checksum mismatch" in next(iter(report["aborted"].values()))
    result = nano("fault", "glm-5.2", "--kill-prefill", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["aborted"] and report["silent_wrong"] == [] and report["after_restart"] == "length"
    assert report["pids"]["prefill_after_restart"] != report["pids"]["prefill"]
    assert report["seconds_to_settle"] < 30


def test_cli_chat_disagg():
    result = nano("chat", "glm-5.2", "--disagg", "-p", "hi", "--max-tokens", "4", "--temperature", "0", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["completion_tokens"] >= 1
    assert "split: prefill pid" in result.stderr
    assert_user_error(nano("chat", "glm-5.2", "--disagg", "--decode-kv-dtype", "fp4", "-p", "x"), "--decode-kv-dtype")
    result = nano("chat", "glm-5.2", "--disagg", "--transport", "gloo", "-p", "hi", "--max-tokens", "3", "--json")
    assert result.exit_code == 0, result.output                  # KV over torch.distributed (gloo) on loopback
    assert json.loads(result.stdout)["completion_tokens"] >= 1
    assert_user_error(nano("chat", "glm-5.2", "--disagg", "--transport", "rdma", "-p", "x"), "--transport")


def test_a_stream_closed_early_stops_the_request_in_the_workers(split):
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    stream = split.stream(prompts(1, seed=6)[0], long)
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert len(first) == 3 and split.last_output.finish_reason == "abort"
    assert "stream was closed" in split.last_output.error and not split.requests
    start = time.perf_counter()    # the decode worker is free again: 3,000 tokens would take minutes
    assert split.generate(prompts(1, seed=7), GREEDY)[0].finish_reason == "length"
    assert time.perf_counter() - start < 20


# ---- across hosts: gloo data path, a worker that connects by itself ---------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_worker(role: str, port: int, key: str) -> subprocess.Popen:
    """What an operator runs on the other host: python -m nano.disagg ROLE HOST:PORT."""
    return subprocess.Popen([sys.executable, "-m", "nano.disagg", role, f"127.0.0.1:{port}"],
                            env={**os.environ, "NANO_DISAGG_KEY": key}, stderr=subprocess.PIPE, text=True)


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
def remote(monkeypatch_module):
    port, key = free_port(), "test-secret"
    monkeypatch_module.setenv("NANO_DISAGG_KEY", key)
    intruder = start_worker("decode", port, "wrong-secret")      # a worker with the wrong key is turned away
    silent = threading.Thread(target=silent_client, args=(port,), daemon=True)   # and one that says nothing
    silent.start()
    worker = start_worker("decode", port, key)
    with SplitLLM("glm-5.2", prefill_kv_dtype="fp8", decode_kv_dtype="fp8", timeout_s=60, transport="gloo",
                  listen=("127.0.0.1", port), spawn=("prefill",), **FORMATS) as front:
        front.test_port, front.test_key, front.test_worker = port, key, worker
        assert intruder.wait(timeout=30) != 0 and "cannot join the front" in intruder.stderr.read()
        yield front
    worker.wait(timeout=30)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_gloo_with_a_worker_that_joined_by_itself_equals_one_process(remote):
    batch = prompts(4, seed=8)
    assert remote.info["decode"]["pid"] == remote.test_worker.pid
    outputs = remote.generate(batch, GREEDY)
    reference = LLM("glm-5.2", kv_dtype="fp8", progress=False, **FORMATS).generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert remote.stats.bytes == remote.config.kv_bytes_per_token("fp8") * sum(map(len, batch))
    remote.corrupt_next_transfer = True                           # corrupted in transit: only that request ends
    again = remote.generate(batch, GREEDY)
    aborted = [o for o in again if o.finish_reason == "abort"]
    assert len(aborted) == 1 and "checksum mismatch" in aborted[0].error
    assert all(o.token_ids == r.token_ids for o, r in zip(again, reference) if o.finish_reason != "abort")


def test_gloo_workers_regroup_after_either_is_replaced(remote):
    batch = prompts(3, seed=9)
    golden = [o.token_ids for o in remote.generate(batch, GREEDY)]
    requests = [remote.submit(p, GREEDY) for p in batch]
    while not any(r.stage == "decode" for r in requests):
        remote.poll()
    remote.test_worker.kill()                                     # the remote decode host goes away
    assert settle(remote, requests) < 30
    assert any(r.output.finish_reason == "abort" and "disconnected" in r.output.error for r in requests)
    remote.test_worker = start_worker("decode", remote.test_port, remote.test_key)
    remote.restart("decode")                                      # waits for the new worker; prefill regroups
    assert [o.token_ids for o in remote.generate(batch, GREEDY)] == golden
    remote.restart("prefill")                                     # a spawned role: a new process, decode regroups
    assert [o.token_ids for o in remote.generate(batch, GREEDY)] == golden
    remote.kill("prefill")                                        # both die: each comes back, then they regroup
    remote.test_worker.kill()
    settle(remote, [remote.submit(batch[0], GREEDY)])
    remote.restart("prefill")
    remote.test_worker = start_worker("decode", remote.test_port, remote.test_key)
    remote.restart("decode")
    assert [o.token_ids for o in remote.generate(batch, GREEDY)] == golden
    assert sorted(remote.free_slots) == list(range(remote.slots))


def test_gloo_an_ended_requests_bytes_are_drained(remote):
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
        remote.poll(0.1)
        assert time.monotonic() < deadline, (remote.free_slots, remote.decode_slots, remote.orphan_slots)
    assert remote.generate(batch[:1], GREEDY)[0].token_ids == golden[0]


def test_bad_split_setups_are_clear_errors(monkeypatch):
    with pytest.raises(NanoError, match="transport must be one of"):
        SplitLLM("glm-5.2", transport="rdma")
    with pytest.raises(NanoError, match="needs transport 'gloo'"):
        SplitLLM("glm-5.2", spawn=("prefill",))
    monkeypatch.delenv("NANO_DISAGG_KEY", raising=False)
    with pytest.raises(NanoError, match="NANO_DISAGG_KEY"):
        SplitLLM("glm-5.2", transport="gloo", spawn=("prefill",))
    monkeypatch.setenv("NANO_DISAGG_KEY", "k")
    with pytest.raises(NanoError, match="no decode worker connected"):   # nobody joins: a bounded wait
        SplitLLM("glm-5.2", transport="gloo", spawn=("prefill",), timeout_s=3, **FORMATS)
    result = subprocess.run([sys.executable, "-m", "nano.disagg", "decode", "nowhere"], capture_output=True,
                            text=True, env={**os.environ, "NANO_DISAGG_KEY": "k"}, timeout=60)
    assert result.returncode != 0 and result.stderr.strip().startswith("error: usage:")
