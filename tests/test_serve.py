"""`nano serve`: the OpenAI-compatible server, driven by the official `openai` client and raw HTTP.

The server runs in this process on a free loopback port (uvicorn in a thread) over the glm-5.2-random stand-in;
its replies are compared with `LLM.generate` on a second LLM of the same seed (the same weights), greedy.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from nano import LLM, SamplingParams
from nano.cli.server import Server

MODEL = "glm-5.2-random"
USED = 'nano_kv_pages_used{role="engine"}'
DECODED = 'nano_decode_tokens_total{role="engine"}'
OPTIONS = dict(page_size=16, kv_budget="16MiB", max_step_tokens=256, progress=False)


def free_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="module")
def server():
    front = LLM(MODEL, **OPTIONS)
    app = Server(front, MODEL, api_key=None, max_queue=64)
    sock = free_port()
    listener = uvicorn.Server(uvicorn.Config(app.app, log_level="warning", access_log=False))
    thread = threading.Thread(target=listener.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not listener.started:
        time.sleep(0.01)
    app.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield app
    listener.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, **OPTIONS)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def greedy(offline: LLM, prompt, max_tokens: int, ignore_eos: bool = False) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return offline.generate([prompt], params)[0].text


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.base + "/metrics").text
    return {name: float(value) for name, value in re.findall(r"^(nano_\S+) (\S+)$", text, re.M)}


def test_completions_streamed_and_whole_equal_offline_generate(server, offline):
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    whole = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert whole.choices[0].text == greedy(offline, prompt, 12, ignore_eos=True)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client(server).completions.create(model=MODEL, prompt="To be, or not", max_tokens=10,
                                                    temperature=0, stream=True))
    expected = offline.generate(["To be, or not"], SamplingParams(temperature=0, max_tokens=10))[0]
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_streamed_and_whole_use_the_chat_template(server, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = offline.generate([offline.tokenizer.encode_chat(messages)], SamplingParams(temperature=0,
                                                                                          max_tokens=10))[0]
    whole = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == expected.finish_reason
    stream = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids) and not chunks[-1].choices


def test_thirty_two_concurrent_streams_equal_offline_generate(server, offline):
    prompts = [[(7 * i + j) % 250 + 1 for j in range(8 + i)] for i in range(32)]
    expected = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]

    def stream(prompt):
        return "".join(c.choices[0].text for c in client(server).completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(stream, prompts)) == expected
    assert metrics(server)["nano_requests_running"] == 0


def test_stop_strings_cut_the_text_and_free_the_pages(server, offline):
    """The stop string comes within the first 16 tokens of a 200-token budget: the server ends the engine's request
    there, and every page it referenced is released. Pages the prefix cache keeps (the prompt's) may stay, but
    unreferenced, so `kv_pages_used` (the pool's pages less the free and the evictable cached ones) is back to 0,
    and the engine did not decode on to max_tokens."""
    full = greedy(offline, "To be, or not", 16, ignore_eos=True)
    stop, budget = full[3:5], 200
    before = metrics(server)
    answer = client(server).completions.create(model=MODEL, prompt="To be, or not", max_tokens=budget,
                                               temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert answer.choices[0].text == full[:full.index(stop)] and answer.choices[0].finish_reason == "stop"
    deadline = time.time() + 10   # the abort reaches the engine thread after the answer may have left
    while (now := metrics(server))[USED] > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert now[USED] == 0 and now["nano_requests_running"] == 0
    stopped, aborted = 'nano_requests_finished_total{reason="stop"}', 'nano_requests_finished_total{reason="abort"}'
    assert (now.get(stopped, 0) - before.get(stopped, 0), now.get(aborted, 0) - before.get(aborted, 0)) == (1, 0)
    decoded = now[DECODED] - before[DECODED]
    assert decoded < budget // 2, f"{decoded} tokens decoded after a stop string found within 16"


def test_a_client_that_disconnects_frees_its_pages(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()   # (kept: dropping the iterator would close the connection already)
        next(lines)                     # the first event: the request is decoding, its pages held
        assert metrics(server)[USED] > 0
    deadline = time.time() + 10
    while (now := metrics(server))[USED] > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert now[USED] == 0
    aborted = 'nano_requests_finished_total{reason="abort"}'
    assert now[aborted] == before.get(aborted, 0) + 1


def test_an_aborted_request_ends_its_stream_with_an_error_and_the_others_go_on(server, offline):
    body = {"model": MODEL, "prompt": "x y z", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        stream = server.loop.live[-1]
        other = client(server).completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0)
        server.loop.abort(stream, "KV integrity: request 9: injected by the test")
        events = [line for line in lines if line.startswith("data: ")]
    error = json.loads(events[-2][len("data: "):])["error"]
    assert "KV integrity" in error["message"] and events[-1] == "data: [DONE]"
    assert other.choices[0].text == greedy(offline, "hello", 6)


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "'max_tokens' must be int"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "'max_tokens' must be at least 1"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "word " * 5000}, 400, "context"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n=1"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ({"model": MODEL}, 400, "'prompt'"),
])
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.base + "/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_bad_chat_messages_and_unknown_routes(server):
    response = httpx.post(server.base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "x"}]})
    assert response.status_code == 400 and "messages[0]" in response.json()["error"]["message"]
    assert httpx.get(server.base + "/v1/nothing").status_code == 404
    assert httpx.get(server.base + "/v1/completions").status_code == 405


def test_a_full_queue_answers_503_with_retry_after(server):
    server.loop.max_queue = -server.loop.max_running   # room for nobody
    try:
        response = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    finally:
        server.loop.max_queue = 64
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "capacity" in response.json()["error"]["message"]


def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base + "/health").text == "ok"
    text = httpx.get(server.base + "/metrics").text
    for name in ("requests_running", "requests_waiting", "kv_pages_used", "kv_pages_free", "prefill_tokens_total",
                 "decode_tokens_total", "preemptions_total", "integrity_checked_total",
                 "integrity_mismatched_total", "integrity_aborted_total"):
        assert re.search(rf"^nano_{name}(\{{[^}}]*\}})? \d", text, re.M), name
    buckets = [float(v) for v in re.findall(r'^nano_time_to_first_token_seconds_bucket\{le="[^"]+"\} (\S+)', text,
                                            re.M)]
    assert buckets == sorted(buckets) and buckets[-1] == float(
        re.search(r"^nano_time_to_first_token_seconds_count (\S+)", text, re.M).group(1)) > 0


def test_nano_serve_command_requires_the_api_key():
    sock = free_port()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "NANO_API_KEY": "sekret"}
    process = subprocess.Popen([sys.executable, "-m", "nano", "serve", MODEL, "--port", str(port), "--page-size",
                                "16", "--kv-budget", "8MiB"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(base + "/health")
                break
            except httpx.TransportError:
                assert process.poll() is None and time.time() < deadline, process.stderr.read()
                time.sleep(0.2)
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        wrong = openai.OpenAI(base_url=base + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        right = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert right.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        process.terminate()
        process.wait(timeout=30)
    # the port is taken now by this socket: a clear error before the model loads
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = subprocess.run([sys.executable, "-m", "nano", "serve", MODEL, "--port",
                               str(taken.getsockname()[1])], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and busy.stderr.strip().startswith("error: cannot listen on 127.0.0.1:")


def test_a_bug_in_a_handler_is_a_500_for_that_request_only(server, monkeypatch):
    import nano.cli.server

    def broken(*args, **kwargs):
        raise RuntimeError("a handler bug")

    monkeypatch.setattr(nano.cli.server, "parse_request", broken)
    response = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 500 and "a handler bug" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                      ).status_code == 200


def test_a_whole_body_request_whose_client_leaves_is_aborted(server):
    before = metrics(server)['nano_requests_finished_total{reason="abort"}']
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    deadline = time.time() + 10
    while (now := metrics(server))[USED] > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert now[USED] == 0 and now['nano_requests_finished_total{reason="abort"}'] == before + 1


def test_an_engine_that_breaks_fails_its_requests_and_then_refuses(monkeypatch):
    from nano.cli.server import ApiError, EngineLoop, Stream

    broken = LLM(MODEL, page_size=16, kv_budget="2MiB", progress=False)
    monkeypatch.setattr(broken, "poll", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    loop = EngineLoop(broken, max_queue=4)
    loop.start()
    events = []
    loop.submit(Stream([1, 2, 3], SamplingParams(max_tokens=4), events.append))
    loop.thread.join(timeout=10)
    assert events == [("end", {"finish_reason": "abort", "error": "the engine stopped: RuntimeError: boom"})]
    with pytest.raises(ApiError, match="the engine stopped"):
        loop.submit(Stream([1], SamplingParams(), events.append))
    with pytest.raises(ApiError):
        loop.counters().result(timeout=1)
