"""`nano serve`: the OpenAI-compatible server, driven by the official `openai` client and raw HTTP.

The server runs in this process on a free loopback port (uvicorn in a thread) over conftest.py's tiny GLM-5
checkpoint, served as `tiny-glm5` (what is tested is the server: a step of the tiny model costs a seventh of the
glm-5.2-random stand-in's); its replies are compared with `LLM.generate` on a second LLM of the same checkpoint,
greedy.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from nano import LLM, SamplingParams
from nano.cli.server import Server

MODEL = "tiny-glm5"   # the name the server answers to: it serves conftest.py's tiny GLM-5 checkpoint
USED = 'nano_kv_pages_used{role="engine"}'
DECODED = 'nano_decode_tokens_total{role="engine"}'
OPTIONS = dict(page_size=16, kv_budget="2MiB", max_step_tokens=256, progress=False)   # 3,120 tokens: < the context


def free_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serving(app: Server) -> Iterator[Server]:
    """`app` served by uvicorn, as `nano serve` configures it, on a free loopback port (`app.base`), in a thread."""
    sock = free_port()
    listener = uvicorn.Server(app.uvicorn_config())
    thread = threading.Thread(target=listener.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not listener.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    app.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield app
    finally:
        listener.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_glm5):
    with serving(Server(LLM(str(tiny_glm5), **OPTIONS), MODEL, api_key=None, max_queue=64)) as app:
        yield app


@pytest.fixture(scope="module")
def offline(tiny_glm5):
    return LLM(str(tiny_glm5), **OPTIONS)


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

    api = client(server)   # one client, its own connection per stream (a client costs ~0.05 s of CPU to make)

    def stream(prompt):
        return "".join(c.choices[0].text for c in api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))

    with api, ThreadPoolExecutor(32) as pool:
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


def test_nano_serve_command_requires_the_api_key_and_stops_at_one_ctrl_c(tmp_path, tiny_glm5):
    """The key from --api-key-file (not ASCII: the client sends its UTF-8 bytes); one SIGINT stops the server though
    a client holds a request open (N1: the graceful shutdown is bounded); a key typed on the command line warns."""
    sock = free_port()
    port = sock.getsockname()[1]
    sock.close()
    (tmp_path / "key").write_text("clé-über\n", encoding="utf-8")
    process = subprocess.Popen([sys.executable, "-m", "nano", "serve", str(tiny_glm5), "--port", str(port),
                                "--page-size", "16", "--kv-budget", "8MiB", "--api-key-file", str(tmp_path / "key"),
                                "--shutdown-timeout", "1"], stderr=subprocess.PIPE, text=True)
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
            wrong.completions.create(model=str(tiny_glm5), prompt="hi", max_tokens=2)
        right = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           headers={"Authorization": "Bearer clé-über".encode()})
        assert right.status_code == 200 and right.json()["usage"]["completion_tokens"] == 2
        hung = socket.create_connection(("127.0.0.1", port))   # a request whose body never comes
        hung.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130 and "Traceback" not in process.stderr.read()   # 130: Ctrl-C
        hung.close()
    finally:
        process.kill()
        process.wait(timeout=30)
    # the port is taken now by this socket: a clear error before the model loads, exit code 1 (issue 29: the
    # machine's state, not a wrong command line, which is 2)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = subprocess.run([sys.executable, "-m", "nano", "serve", "glm-5.2-random", "--port",
                               str(taken.getsockname()[1]),
                               "--api-key", "typed", "--no-access-log"], capture_output=True, text=True, timeout=60)
    warning, error = busy.stderr.strip().splitlines()
    assert busy.returncode == 1 and error.startswith("error: cannot listen on 127.0.0.1:")
    assert "Address already in use" in error
    assert warning.startswith("warning: --api-key on the command line is readable by other local users")


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


def test_an_engine_that_breaks_fails_its_requests_and_then_refuses(tiny_glm5, monkeypatch):
    from nano.cli.server import ApiError, EngineLoop, Stream

    broken = LLM(str(tiny_glm5), page_size=16, kv_budget="2MiB", progress=False)
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


# ---- issue 28: one request's failure stays its own; limits; parsing off the event loop --------------------------
def test_a_request_whose_submit_fails_gets_its_error_and_the_server_goes_on(server, offline, monkeypatch):
    """N1: the engine thread's `front.submit` raising anything (torch's seed overflow raised ValueError there) ends
    that request with its error; before, a non-NanoError left it unanswered and stopped the loop for everyone."""
    submit = server.front.submit

    def overflow(*args, **kwargs):
        raise ValueError("Overflow when unpacking long long")

    monkeypatch.setattr(server.front, "submit", overflow)
    response = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                          timeout=60)
    monkeypatch.setattr(server.front, "submit", submit)
    assert response.status_code == 500 and "ValueError: Overflow" in response.json()["error"]["message"]
    assert httpx.get(server.base + "/health").text == "ok"
    again = client(server).completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0)
    assert again.choices[0].text == greedy(offline, "hello", 6)
    assert server.loop.pending == 0


def test_a_failure_in_one_streams_delivery_or_abort_ends_that_stream_only(offline, monkeypatch):
    """N1: a stream whose handler cannot take its tokens (its event loop gone), and one whose abort raises, end
    with their errors; the request beside them finishes as `LLM.generate` would finish it."""
    from nano.cli.server import EngineLoop, Stream

    loop, ends, params = EngineLoop(offline, max_queue=8), {}, SamplingParams(temperature=0, max_tokens=6)
    started = threading.Event()

    def handler(name: str, fails_on: str | None = None):
        def deliver(event):
            if event[0] == fails_on:
                raise RuntimeError(f"{name}: the handler is gone")
            started.set()
            if event[0] == "end":
                ends[name] = event[1]
        return deliver

    gone = Stream([1, 2, 3], params, handler("gone", fails_on="tokens"))
    fine = Stream([5, 17, 42, 99], params, handler("fine"))
    stuck = Stream([9, 8, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), handler("stuck"))
    abort = offline.abort
    monkeypatch.setattr(offline, "abort", lambda request, error: (_ for _ in ()).throw(RuntimeError("abort broke")))
    loop.start()
    try:
        for stream in (gone, fine, stuck):
            loop.submit(stream)
        assert started.wait(60)
        loop.abort(stuck, "the client left")
        deadline = time.time() + 120
        while len(ends) < 3 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        loop.stop()
        monkeypatch.setattr(offline, "abort", abort)
        for stream in (gone, stuck):
            if stream.request is not None and not stream.request.finished:
                offline.abort(stream.request, "test cleanup")
    assert "the handler is gone" in ends["gone"]["error"] and ends["gone"]["finish_reason"] == "abort"
    assert "abort broke" in ends["stuck"]["error"] and ends["stuck"]["finish_reason"] == "abort"
    expected = offline.generate([[5, 17, 42, 99]], params)[0]
    assert (ends["fine"]["finish_reason"], ends["fine"]["completion_tokens"]) == (expected.finish_reason,
                                                                                  len(expected.token_ids))
    assert loop.error is None and loop.pending == 0


def test_health_reports_a_process_the_front_depends_on(server, monkeypatch):
    monkeypatch.setattr(server.front, "health", lambda: "the decode worker died (exit code 1)")
    response = httpx.get(server.base + "/health")
    assert response.status_code == 503 and "the decode worker died" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.get(server.base + "/health").text == "ok"


def test_parsing_and_tokenizing_run_off_the_event_loop(server, monkeypatch):
    """N3: a body is decoded and tokenized on a worker thread: the event loop (which serves every client) never
    waits for it."""
    import nano.cli.server

    parse, on_event_loop = nano.cli.server.parse_request, []

    def watched(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_event_loop.append(True)
        except RuntimeError:
            on_event_loop.append(False)
        return parse(*args, **kwargs)

    monkeypatch.setattr(nano.cli.server, "parse_request", watched)
    response = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and on_event_loop == [False]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "a" * 200_000}),
    ("/v1/completions", {"prompt": list(range(1, 250)) * 40}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * 100_000}]}),
], ids=["text", "token-ids", "chat"])
def test_a_prompt_too_long_by_its_size_is_refused_before_it_is_tokenized(server, monkeypatch, route, body):
    """N3: text of B UTF-8 bytes is at least B / (the longest token's bytes) tokens; past what one request holds
    it is refused without tokenizing (before, a 16 MB prompt took 36 s of the event loop to tokenize)."""
    encoded = []
    monkeypatch.setattr(server.front.tokenizer, "encode", lambda text: encoded.append(text) or [1])
    response = httpx.post(server.base + route, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400 and not encoded
    message = response.json()["error"]["message"]
    assert "the prompt (at least " in message and f"{server.front.max_request_tokens} tokens" in message


def test_a_request_larger_than_the_kv_pool_is_refused_up_front(server):
    """N7: prompt + max_tokens past the pool (smaller than the context here) is a 400 naming both numbers; before,
    it was accepted, computed for seconds, and failed with a 500 (the whole-body answer losing its tokens)."""
    pool = server.front.pool.tokens
    assert pool < server.front.max_context
    body = {"model": MODEL, "prompt": [5, 17, 42, 99], "max_tokens": pool, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as response:
        response.read()
    message = response.json()["error"]["message"]
    assert response.status_code == 400
    assert f"max_tokens ({pool})" in message and f"the KV pool holds ({pool} tokens)" in message


def test_the_default_max_tokens_is_openais(server):
    """Issue 29: without max_tokens, /v1/completions generates 16 tokens, OpenAI's documented default for its
    legacy completions (fewer when fewer fit); a chat generates until it stops or one request is full (OpenAI's
    chat has no default limit but the context), here the KV pool, smaller than the context."""
    from nano.cli.server import parse_request

    parse = lambda body, chat: parse_request(body, chat, server.front, MODEL, server.longest_token).params.max_tokens
    pool = server.front.pool.tokens
    assert parse({"prompt": [5, 17, 42, 99]}, chat=False) == 16
    assert parse({"prompt": [7] * (pool - 5)}, chat=False) == 5
    messages = [{"role": "user", "content": "hello"}]
    assert parse({"messages": messages}, chat=True) == pool - len(server.front.tokenizer.encode_chat(messages))
    answer = client(server).completions.create(model=MODEL, prompt=[5, 17, 42, 99], extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 100_000], ids=["arrays", "objects"])
def test_deeply_nested_json_is_a_400_without_a_traceback(server, body):
    """N9: json.loads raises RecursionError, which was a 500 and a 50-line traceback in the log per request."""
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        response = httpx.post(server.base + "/v1/completions", content=body,
                              headers={"Content-Type": "application/json"})
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]
    assert logged == []


def test_a_non_ascii_api_key_matches_a_client_sending_it_as_utf8(server):
    """N12: the header's bytes are compared with the key's UTF-8 bytes (before, only its Latin-1 bytes matched)."""
    key = "clé-über"
    server.api_key = key
    try:
        status = lambda value: httpx.get(server.base + "/v1/models", headers={"Authorization": value}).status_code
        assert status(f"Bearer {key}".encode()) == 200
        assert (status(f"Bearer {key}".encode("latin-1")), status(b"Bearer cle-uber"), status(b"")) == (401,) * 3
    finally:
        server.api_key = None


def test_the_api_key_comes_from_the_flag_its_file_or_the_environment(tmp_path, monkeypatch, capsys):
    """N12: a key typed on the command line works, with a warning that other local users can read it."""
    from nano.cli.serve import resolve_api_key

    monkeypatch.setenv("NANO_API_KEY", "from-env")
    (tmp_path / "key").write_text("clé-über\n", encoding="utf-8")
    assert resolve_api_key(None, tmp_path / "key") == "clé-über" and capsys.readouterr().err == ""
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key("typed", None) == "typed"
    assert "readable by other local users" in capsys.readouterr().err


# ---- issue 29: content parts, OpenAI's defaults, fresh seeds, the access log, finish reasons, special tokens ----
def test_chat_content_may_be_a_list_of_text_parts(server, offline):
    """OpenAI's content parts: the text parts of a message are joined with newlines (as vLLM joins them), so the
    reply equals the one to the joined string; a part of another type, or a malformed one, is a 400 naming it."""
    parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nthere"}]
    expected = offline.generate([offline.tokenizer.encode_chat(joined)], SamplingParams(temperature=0,
                                                                                         max_tokens=8))[0]
    answer = client(server).chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == len(offline.tokenizer.encode_chat(joined))
    for content, fragment in (
            ([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
             "messages[0].content[1] is of type 'image_url': this server takes text parts only"),
            ([{"type": "text"}], "messages[0].content[0].text must be a string"),
            (["hello"], "messages[0].content[0] must be an object with a type"),
            (5, "messages[0].content must be a string or a list of content parts")):
        response = httpx.post(server.base + "/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text


def test_an_unseeded_request_gets_a_fresh_seed_and_a_seeded_one_repeats(server):
    """Issue 29: without a seed, each reply draws with a fresh one (not one derived from the server's seed and the
    request's number, which gave the same replies after every restart); with one, the reply repeats."""
    from nano.cli.server import parse_request

    seeds = {parse_request({"prompt": "hi"}, False, server.front, MODEL, server.longest_token).params.seed
             for _ in range(3)}
    assert len(seeds) == 3 and None not in seeds
    assert parse_request({"prompt": "hi", "seed": 7}, False, server.front, MODEL,
                         server.longest_token).params.seed == 7
    sampled = lambda **seed: client(server).completions.create(model=MODEL, prompt="hello", max_tokens=6,
                                                                temperature=1.0, extra_body={"ignore_eos": True},
                                                                **seed).choices[0].text
    assert sampled(seed=11) == sampled(seed=11)
    assert len({sampled(), sampled(), sampled()}) > 1


def test_a_stop_string_in_the_last_token_counts_as_a_stop(server, offline, monkeypatch):
    """Issue 29: a stop string completed by the token that also reaches max_tokens, read by a slow handler (a busy
    event loop): the engine has ended the request as "length" before the handler finds the stop string; the client
    gets "stop", and /metrics counts a "stop" (before, the engine thread counted the end as it saw it)."""
    from nano.tokenizer import TextStream

    texts = {len(o.token_ids): o.text for o in offline.stream("hello", SamplingParams(temperature=0, max_tokens=16,
                                                                                        ignore_eos=True))}
    k = next(k for k in range(2, 17) if texts[k] != texts[k - 1] and texts[k][-1].isprintable()
             and texts[k][-1] != "\ufffd" and texts[k][-1] not in texts[k][:-1])   # the k-th token ends with it
    add = TextStream.add
    monkeypatch.setattr(TextStream, "add", lambda self, tokens: time.sleep(0.2) or add(self, tokens))
    reasons = lambda: {reason: metrics(server).get(f'nano_requests_finished_total{{reason="{reason}"}}', 0)
                       for reason in ("stop", "length", "abort")}
    for stream in (False, True):
        before = reasons()
        answer = client(server).completions.create(model=MODEL, prompt="hello", max_tokens=k, temperature=0,
                                                   stop=[texts[k][-1]], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == texts[k][:-1]
        assert chunks[-1].choices[0].finish_reason == "stop"
        deadline = time.time() + 10
        while (after := reasons()) == before and time.time() < deadline:
            time.sleep(0.05)
        assert {reason: after[reason] - before[reason] for reason in after} == {"stop": 1, "length": 0, "abort": 0}


def test_one_access_log_line_per_request(server, offline):
    """Issue 29: each request, answered or refused, streamed or not, is one line on the `nano.access` logger once
    its response has ended: client, method and path, status, seconds, and a completion's tokens and finish reason."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("nano.access").addHandler(handler)
    try:
        httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": [5, 17, 42, 99],
                                                          "max_tokens": 3, "ignore_eos": True})
        messages = [{"role": "user", "content": "hello"}]
        chunks = list(client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                             temperature=0, stream=True))
        httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -1})
        httpx.get(server.base + "/health?probe=1")
        deadline = time.time() + 10   # a line is written once the response has left: maybe after the client has it
        while len(lines) < 4 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        logging.getLogger("nano.access").removeHandler(handler)
    chat_prompt = len(offline.tokenizer.encode_chat(messages))
    patterns = [r'"POST /v1/completions" 200 \d+\.\d{3} s prompt=4 completion=3 finish=length',
                rf'"POST /v1/chat/completions" 200 \d+\.\d{{3}} s prompt={chat_prompt} completion=\d+ '
                rf"finish={chunks[-1].choices[0].finish_reason}",
                r'"POST /v1/completions" 400 \d+\.\d{3} s', r'"GET /health\?probe=1" 200 \d+\.\d{3} s']
    assert len(lines) == 4, lines
    for line, pattern in zip(lines, patterns):
        assert re.fullmatch(r"127\.0\.0\.1:\d+ " + pattern, line), (line, pattern)


def test_no_access_log_when_turned_off(offline):
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("nano.access").addHandler(handler)
    try:
        with serving(Server(offline, MODEL, api_key=None, max_queue=4, access_log=False)) as quiet:
            assert httpx.get(quiet.base + "/health").text == "ok"
    finally:
        logging.getLogger("nano.access").removeHandler(handler)
    assert lines == []


GLM_SPECIAL_TEXT = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


def test_a_chat_reply_holds_no_special_token_text():
    """Issue 29: the trained glm-5.2 stand-in emits role markers (<|assistant|>, <|user|>) mid-reply when told to
    ignore its end tokens; a reply's text never shows them (as vLLM's skip_special_tokens), streamed or not."""
    trained = LLM("glm-5.2", **OPTIONS)
    messages = [{"role": "user", "content": "Speak, friend"}]
    prompt = trained.tokenizer.encode_chat(messages)
    params = lambda seed: SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
    # a seed whose reply holds a special token, found in process before the server owns the engine
    seed = next(seed for seed in range(20)
                if set(trained.generate([prompt], params(seed))[0].token_ids) & trained.tokenizer.special_token_ids)
    with serving(Server(trained, "glm-5.2", api_key=None, max_queue=4)) as app:
        body = dict(model="glm-5.2", messages=messages, max_tokens=24, seed=seed, extra_body={"ignore_eos": True})
        whole = client(app).chat.completions.create(**body)
        streamed = "".join(c.choices[0].delta.content or "" for c in client(app).chat.completions.create(
            **body, stream=True) if c.choices)
    assert whole.usage.completion_tokens == 24 and whole.choices[0].message.content == streamed
    assert not [marker for marker in GLM_SPECIAL_TEXT if marker in streamed], streamed
